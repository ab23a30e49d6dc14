#include "tests/testing/simulated_members.h"

#include <atomic>
#include <cstdio>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace zeroshard::testing {

// Distinct channel arguments give each channel its own TCP connection.
std::vector<std::unique_ptr<v1::Coordinator::Stub>> MakeStubs(const std::string& address,
                                                              int count) {
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs;
  for (int i = 0; i < count; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("zeroshard.bench.channel", i);
    args.SetMaxReceiveMessageSize(64 << 20);  // as shardctl's: GetStatus of 32K ranks is 6.6 MB
    stubs.push_back(v1::Coordinator::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
  }
  return stubs;
}

Joined JoinAll(std::vector<std::unique_ptr<v1::Coordinator::Stub>>& stubs, const std::string& job,
               int world, bool member_table, int ranks_per_host) {
  Joined out;
  out.responses.resize(world);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts(world);
  std::vector<v1::JoinRequest> requests(world);
  absl::BlockingCounter done(world);
  std::atomic<int> failures{0};
  absl::Time start = absl::Now();
  for (int i = 0; i < world; ++i) {
    contexts[i] = std::make_unique<grpc::ClientContext>();
    contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    requests[i].set_job_id(job);
    requests[i].set_world_size(world);
    if (ranks_per_host > 0) {
      requests[i].set_worker_id(
          absl::StrFormat("node%05d/%d", i / ranks_per_host, i % ranks_per_host));
      requests[i].set_host(absl::StrFormat("node%05d", i / ranks_per_host));
    } else {
      requests[i].set_worker_id(absl::StrFormat("node%05d/0", i));
      requests[i].set_host("127.0.0.1");
    }
    requests[i].set_skip_member_table(!member_table);
    stubs[i % stubs.size()]->async()->Join(
        contexts[i].get(), &requests[i], &out.responses[i], [&](grpc::Status s) {
          if (!s.ok()) {
            if (failures++ == 0) {
              std::fprintf(stderr, "join failed: %s\n", s.error_message().c_str());
            }
          }
          done.DecrementCount();
        });
  }
  done.Wait();
  out.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  out.failures = failures.load();
  return out;
}

v1::MemberCredentials Credentials(const std::string& job, const v1::JoinResponse& r) {
  v1::MemberCredentials c;
  c.set_job_id(job);
  c.set_generation(r.generation());
  c.set_rank(r.rank());
  c.set_token(r.token());
  return c;
}

// What a ZeRO-3 rank of a GPT job sends in the middle of training: every
// telemetry field set to a value of realistic size.
void FillTelemetry(const std::string& telemetry, v1::HeartbeatRequest* request) {
  if (telemetry == "none") return;
  request->set_loss(2.718281828);
  request->set_memory_bytes(int64_t{3} << 30);
  request->set_collective_seq(1234567);
  v1::StepTelemetry* step = request->mutable_last_step();
  step->set_step_ms(123.456);
  step->set_items_per_second(81234.5);
  step->set_gather_wait_ms(12.5);
  step->set_reduce_wait_ms(3.25);
  if (telemetry != "full") return;
  v1::RankTelemetry* t = request->mutable_telemetry();
  v1::MemoryUsage* memory = t->mutable_memory();
  memory->set_params(int64_t{1} << 30);
  memory->set_grads(int64_t{1} << 29);
  memory->set_optimizer_state(int64_t{2} << 30);
  memory->set_activations(int64_t{3} << 28);
  memory->set_comm_buffers(int64_t{1} << 26);
  memory->set_cached(int64_t{1} << 27);
  t->set_bytes_moved(int64_t{123} << 30);
  t->set_gathers_entered(512345);
  t->set_reductions_entered(256789);
  t->set_first_collective_unix_us(1'790'000'000'123'456);
  t->set_arrival_lag_ms(3.5f);
  t->set_arrival_lag_median_ms(2.25f);
  v1::CollectiveInProgress* c = t->mutable_in_progress();
  c->set_op(v1::ALL_GATHER);
  c->set_unit("transformer.h.17");
  c->set_seq(512345);
  c->set_started_unix_ms(1'790'000'000'456);
}

}  // namespace zeroshard::testing
