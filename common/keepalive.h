// gRPC keepalive between the shard server and its clients: both sides' numbers
// in one place, because a client that pings more often than the server allows
// is sent GOAWAY ("too_many_pings") and disconnected.
//
// Why: a silent network outage (a host's link or switch port, no FIN, no RST)
// leaves a TCP connection looking open; the heartbeat stream's writes pile up
// and TCP's retransmissions back off to minutes, so a connection that survives
// a 60-s outage resumes 50 s after the network does. A client that pings
// every kClientKeepaliveTimeMs and gives up after kClientKeepaliveTimeoutMs
// without an answer closes the dead connection within ~3 s of the outage and
// then reconnects on the channel's capped backoff (client.cc: at most 1 s
// apart), so heartbeats resume within ~2 s of the network's return whatever
// the outage's length.
#ifndef ZEROSHARD_COMMON_KEEPALIVE_H_
#define ZEROSHARD_COMMON_KEEPALIVE_H_

namespace zeroshard {

// Client channels (workers, shardctl).
inline constexpr int kClientKeepaliveTimeMs = 1000;
inline constexpr int kClientKeepaliveTimeoutMs = 2000;
// The server accepts pings this often, with or without calls in flight, and
// never counts them as abuse.
inline constexpr int kServerMinPingIntervalMs = kClientKeepaliveTimeMs / 2;
// The server's own pings: streams of a client that vanished close within
// ~15 s instead of waiting on TCP.
inline constexpr int kServerKeepaliveTimeMs = 10000;
inline constexpr int kServerKeepaliveTimeoutMs = 5000;

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_KEEPALIVE_H_
