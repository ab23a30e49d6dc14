// What a worker trains: a model with its data, evaluation and sampling. The
// training loop (shard_worker) and the ZeRO engine stay model-agnostic.
#ifndef ZEROSHARD_WORKER_TRAINING_TASK_H_
#define ZEROSHARD_WORKER_TRAINING_TASK_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/data/batch_layout.h"
#include "worker/model/gpt.h"
#include "worker/model/mlp.h"
#include "worker/model/model.h"
#include "worker/zero/engine.h"

namespace zeroshard {

struct TaskOptions {
  std::string model = "mlp";  // mlp | gpt
  // MLP
  int layers = 4;
  int width = 256;
  std::string activation = "none";
  // GPT
  int heads = 4;
  int d_model = 128;
  int context = 64;
  std::string task = "addition";  // addition | text (with data)
  int digits = 2;                 // addition: operands below 10^digits
  // The targets the loss covers: "all", or "answers" (addition tasks: only
  // each line's answer; ScoreOnlyAnswers() in data/text_data.h).
  std::string loss_on = "all";
  double validation_fraction = 0.1;
  // Vocabulary (rows of wte and of the tied LM head); 0: 256 for bytes and
  // the addition task, 50,257 (GPT-2's BPE) for token shards.
  int64_t vocab = 0;
  // Positions (rows of wpe), >= context; 0: context. A Hugging Face
  // checkpoint's n_positions.
  int64_t positions = 0;
  // Token shards (data/token_shards.h): the validation glob, and how many
  // validation tokens the validation loss covers (0: all).
  std::string val_data;
  int64_t val_tokens = 0;
  // Both
  // File (safetensors for the MLP; for the GPT a text file, or a glob / .bin
  // path of llm.c token shards), or "" for synthetic data.
  std::string data;
  uint64_t seed = 0;
  int batch = 8;  // samples per rank per micro-batch
  int grad_accum = 1;
  // MLP on another device: makes the model (default: MlpModel, on the CPU).
  std::function<absl::StatusOr<std::unique_ptr<RegressionModel>>(const MlpConfig&)> mlp_factory;
  // GPT on another device: makes the model for batches of up to `max_batch`
  // sequences of up to config.n_ctx tokens (default: GptModel, on the CPU).
  std::function<absl::StatusOr<std::unique_ptr<TokenModel>>(const GptConfig&, int max_batch)>
      gpt_factory;
};

struct Evaluation {
  double loss = 0;       // mean validation loss over ranks
  double accuracy = -1;  // the task's accuracy in [0, 1]; -1 if it has none
  // Addition: the same held-out problems asked after one line of other
  // (solved) text, as they appear inside training sequences.
  double accuracy_in_context = -1;
};

class TrainingTask {
 public:
  virtual ~TrainingTask() = default;
  virtual Model* model() = 0;
  // Sets the model's batch for `rank`'s micro-batch `micro` of `step` in a
  // generation of `world` ranks: the samples the batch layout gives it
  // (SetBatchLayout; 0 <= micro < layout.DataMicroBatches(rank)).
  virtual absl::Status SetTrainBatch(int64_t step, int micro, int rank, int world) = 0;
  // The data cursor: training step `step` starts at global row `row`, and
  // later steps follow at the current world size (a job that shrank goes on
  // from the row after the last one trained). Default: step 0 at row 0.
  void SetDataCursor(int64_t step, int64_t row) {
    cursor_step_ = step;
    cursor_row_ = row;
  }
  int64_t cursor_step() const { return cursor_step_; }
  // Which micro-batches each rank of the generation trains
  // (worker/data/batch_layout.h): the generation's own (world, --grad_accum)
  // until set, or a shrunk generation's under --keep_global_batch
  // (worker/recovery/global_batch.h).
  void SetBatchLayout(const BatchLayout& layout) { layout_ = layout; }
  // The layout at `world` ranks (the set one when it is for `world`).
  BatchLayout Layout(int world) const {
    if (layout_.world == world) return layout_;
    return BatchLayout{world, world, std::max(1, default_accum_)};
  }
  int64_t cursor_row() const { return cursor_row_; }
  // Where `rank`'s training samples of `step` come from, for the line that
  // names a non-finite step ("rows 24-31 of data.safetensors"); "" when the
  // data is not a file whose rows can be named (synthetic data, text).
  virtual std::string TrainSamples(int64_t step, int rank, int world) const { return ""; }
  // Tokens (GPT) or rows (MLP) in one rank's micro-batch.
  virtual int64_t ItemsPerMicroBatch() const = 0;
  // Model FLOPs of training one item (a row, a token): forward and backward,
  // as docs/goodput.md states them (6N; the GPT adds PaLM's attention term).
  virtual double FlopsPerItem() const = 0;
  // Validation loss (and accuracy) with the engine's current parameters.
  // Every rank must call it (collectives); ranks evaluate different samples.
  virtual absl::StatusOr<Evaluation> Evaluate(ZeroEngine& engine, int rank, int world,
                                              int batches) = 0;
  // Generated text of `bytes` bytes (every rank runs it; the same on all).
  virtual absl::StatusOr<std::string> Sample(ZeroEngine& engine, int bytes) = 0;
  // A description for people.
  virtual std::string Describe() const = 0;
  // The model's Hugging Face config.json, recorded in checkpoints for
  // `consolidate --format=hf`; "" for models Hugging Face has no class for.
  virtual std::string HuggingFaceConfig() const { return ""; }
  // Runs the first validation batch of `rank` forward and returns it with
  // what the model computed, as JSON: {"loss", and for the MLP "x" and
  // "output" [rows][width], for the GPT "tokens" and "targets" [b][t]}. For
  // checking the consolidated model in other tools. Every rank must call it.
  virtual absl::StatusOr<std::string> EvalRecord(ZeroEngine& engine, int rank, int world) = 0;

 protected:
  int default_accum_ = 1;        // --grad_accum
  BatchLayout layout_{0, 0, 0};  // world 0: not set
  int64_t cursor_step_ = 0;
  int64_t cursor_row_ = 0;
};

// Whether `options` name a model and task that exist, with sizes they take:
// INVALID_ARGUMENT in the flags' names (shard_worker checks them with its
// other flags, before it joins).
absl::Status CheckTaskOptions(const TaskOptions& options);
absl::StatusOr<std::unique_ptr<TrainingTask>> MakeTrainingTask(const TaskOptions& options);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_TRAINING_TASK_H_
