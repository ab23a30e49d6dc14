// What a worker checks of its inputs before it joins its job (#44 finding
// 9): a bad input then fails this worker alone, at once, with a message
// naming it, instead of joining and failing every rank's generation (a
// truncated --init_from was taken for a recoverable failure: 10 recoveries
// of every rank, exit 1 after 66 s).
#ifndef ZEROSHARD_WORKER_INPUT_CHECKS_H_
#define ZEROSHARD_WORKER_INPUT_CHECKS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "worker/worker_config.h"

namespace zeroshard {

// The parameters of the model `task` describes (GPT: embeddings, blocks,
// final norm; MLP: its layers), as a double (a hostile config's count
// overflows int64).
double ModelParameters(const TaskOptions& task);

// What one rank holds of the model's state: parameters, gradients and the
// two Adam moments in f32 (16 bytes a parameter), sharded over the world
// (ZeRO), plus one block gathered in full for compute. A lower bound: the
// activations come on top.
double RankStateBytes(const TaskOptions& task, int world_size);

// OK when `config`'s inputs may be used: the model's state (RankStateBytes)
// fits `machine_bytes` (the machine's memory, /proc/meminfo's MemTotal when
// 0); --init_from is a complete safetensors file (or Hugging Face directory)
// whose size matches its header; --init_from, --data and --val_data name
// regular files only (a FIFO would block the worker's open for ever);
// --checkpoint_dir, where checkpoints are written or read, is a directory
// this process can write (made if missing). INVALID_ARGUMENT naming the
// input, the numbers and what to do.
absl::Status CheckInputsBeforeJoining(const WorkerConfig& config, int64_t machine_bytes = 0);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_INPUT_CHECKS_H_
