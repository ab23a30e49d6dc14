// The shard server's KV store (this member's job generation) as the data
// plane's KeyValueStore: what Gloo's rendezvous and NCCL's unique-id exchange
// run over.
#ifndef ZEROSHARD_WORKER_COMM_CLIENT_KV_STORE_H_
#define ZEROSHARD_WORKER_COMM_CLIENT_KV_STORE_H_

#include "client/client.h"
#include "worker/comm/kv_store.h"

namespace zeroshard {

// Thread-safe. REQUIRES: `client` joined a job; it outlives this store.
class ClientKvStore : public KeyValueStore {
 public:
  explicit ClientKvStore(Client* client) : client_(client) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return client_->StoreSet(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return client_->StoreGet(key, timeout);
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    return client_->StoreAdd(key, delta);
  }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    return client_->StoreWait(keys, timeout);
  }

 private:
  Client* const client_;
};

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_COMM_CLIENT_KV_STORE_H_
