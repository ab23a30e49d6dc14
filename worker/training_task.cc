#include "worker/training_task.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/hf_gpt2_config.h"
#include "nlohmann/json.hpp"
#include "worker/data/regression_data.h"
#include "worker/data/text_data.h"
#include "worker/data/token_shards.h"
#include "worker/model/gpt.h"
#include "worker/model/mlp.h"

namespace zeroshard {
namespace {

// The global samples (MLP: file rows, read cyclically when `rows` > 0) of
// `rank`'s micro-batches at `step` steps past the data cursor's, as
// "24-27, 40-43": the layout of regression_data.h and text_data.h, taken
// as `layout` gives them to `rank`.
std::string SampleRanges(const TaskOptions& o, const BatchLayout& layout, int64_t step, int rank,
                         int64_t cursor_row, int64_t rows) {
  std::vector<std::string> ranges;
  for (int micro = 0; micro < layout.DataMicroBatches(rank); ++micro) {
    const BatchLayout::Coordinates at = layout.At(rank, micro);
    absl::StatusOr<int64_t> start =
        MicroBatchStartRow(step, at.micro, at.rank, layout.data_world, o.batch, layout.data_accum);
    if (!start.ok()) return "?";
    int64_t first = *start + cursor_row;
    int64_t last = first + o.batch - 1;
    if (rows > 0) {
      first %= rows;
      last %= rows;
    }
    ranges.push_back(last >= first ? absl::StrCat(first, "-", last)
                                   : absl::StrCat(first, "-", rows - 1, ", 0-", last));
  }
  return absl::StrJoin(ranges, ", ");
}

// The parameters of `spec` but the tensors whose names end in `except`
// ("": none excepted).
double ParametersOf(const ModelSpec& spec, absl::string_view except) {
  double n = 0;
  for (const TensorSpec& t : spec.tensors) {
    if (except.empty() || !absl::EndsWith(t.name, except)) n += static_cast<double>(t.Elements());
  }
  return n;
}

// ---- MLP regression (seed 001's setting) ----

class MlpTask : public TrainingTask {
 public:
  static absl::StatusOr<std::unique_ptr<TrainingTask>> Create(const TaskOptions& o) {
    const MlpConfig config{o.layers, o.width, o.activation};
    absl::StatusOr<std::unique_ptr<RegressionModel>> model;
    if (o.mlp_factory) {
      model = o.mlp_factory(config);
    } else {
      model = MlpModel::Create(config);
    }
    if (!model.ok()) return model.status();
    auto data = OpenRegressionData(o.data, o.seed, o.width, o.width);
    if (!data.ok()) return data.status();
    auto task = std::unique_ptr<MlpTask>(new MlpTask());
    task->options_ = o;
    task->default_accum_ = o.grad_accum;
    task->model_ = std::move(*model);
    task->data_ = std::move(*data);
    task->x_.resize(static_cast<size_t>(o.batch) * o.width);
    task->y_.resize(task->x_.size());
    return std::unique_ptr<TrainingTask>(std::move(task));
  }
  Model* model() override { return model_.get(); }
  absl::Status SetTrainBatch(int64_t step, int micro, int rank, int world) override {
    const BatchLayout layout = Layout(world);
    const BatchLayout::Coordinates at = layout.At(rank, micro);
    absl::Status s =
        data_->Fill(step - cursor_step_, at.micro, at.rank, layout.data_world, options_.batch,
                    layout.data_accum, x_.data(), y_.data(), cursor_row_);
    if (!s.ok()) return s;
    return model_->SetBatch(x_.data(), y_.data(), options_.batch);
  }
  int64_t ItemsPerMicroBatch() const override { return options_.batch; }
  // 6N a row: the forward's multiply-add per weight (2N), the backward's two
  // (input and weight gradients, 4N); biases and activations are noise.
  double FlopsPerItem() const override { return 6.0 * ParametersOf(model_->Spec(), ""); }
  std::string TrainSamples(int64_t step, int rank, int world) const override {
    const int64_t rows = data_->num_rows();
    if (options_.data.empty() || rows <= 0) return "";
    return absl::StrCat(
        "rows ",
        SampleRanges(options_, Layout(world), step - cursor_step_, rank, cursor_row_, rows), " of ",
        options_.data);
  }
  absl::StatusOr<Evaluation> Evaluate(ZeroEngine& engine, int rank, int world,
                                      int batches) override {
    // Held-out rows: the ones far past any training step.
    double sum = 0;
    for (int b = 0; b < batches; ++b) {
      absl::Status s = data_->Fill(int64_t{1} << 40 | b, 0, rank, world, options_.batch, 1,
                                   x_.data(), y_.data());
      if (!s.ok()) return s;
      if (s = model_->SetBatch(x_.data(), y_.data(), options_.batch); !s.ok()) return s;
      absl::StatusOr<double> loss = engine.Forward();
      if (!loss.ok()) return loss.status();
      sum += *loss;
    }
    absl::StatusOr<double> mean = engine.MeanOverRanks(sum / std::max(1, batches));
    if (!mean.ok()) return mean.status();
    return Evaluation{*mean, -1};
  }
  absl::StatusOr<std::string> Sample(ZeroEngine&, int) override {
    return absl::FailedPreconditionError("--sample needs --model=gpt");
  }
  absl::StatusOr<std::string> EvalRecord(ZeroEngine& engine, int rank, int world) override {
    absl::Status s =
        data_->Fill(int64_t{1} << 40, 0, rank, world, options_.batch, 1, x_.data(), y_.data());
    if (!s.ok()) return s;
    if (s = model_->SetBatch(x_.data(), y_.data(), options_.batch); !s.ok()) return s;
    absl::StatusOr<double> loss = engine.Forward();
    if (!loss.ok()) return loss.status();
    absl::StatusOr<std::vector<float>> output = model_->OutputToHost();
    if (!output.ok()) return output.status();
    nlohmann::json out;
    out["loss"] = *loss;
    const int64_t w = options_.width;
    for (int r = 0; r < options_.batch; ++r) {
      out["x"].push_back(std::vector<float>(x_.begin() + r * w, x_.begin() + (r + 1) * w));
      out["y"].push_back(std::vector<float>(y_.begin() + r * w, y_.begin() + (r + 1) * w));
      const float* o = output->data() + r * w;
      out["output"].push_back(std::vector<float>(o, o + w));
    }
    return out.dump();
  }
  std::string Describe() const override {
    return absl::StrFormat("mlp: %d × Linear(%d, %d), activation %s", options_.layers,
                           options_.width, options_.width, options_.activation);
  }

 private:
  TaskOptions options_;
  std::unique_ptr<RegressionModel> model_;
  std::unique_ptr<RegressionData> data_;
  std::vector<float> x_, y_;
};

// ---- GPT: token shards, a text file's bytes, or the built-in addition task ----

// The token source of the GPT task, and the vocabulary it needs.
absl::StatusOr<std::unique_ptr<TokenData>> OpenGptData(const TaskOptions& o, int64_t vocab) {
  if (LooksLikeTokenShards(o.data)) {
    absl::StatusOr<std::unique_ptr<TokenShardData>> shards =
        TokenShardData::Open(o.data, o.val_data, vocab, o.val_tokens);
    if (!shards.ok()) return shards.status();
    return std::unique_ptr<TokenData>(*std::move(shards));
  }
  if (!o.val_data.empty() || o.val_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--val_data and --val_tokens apply to token shards (--data=GLOB or a .bin file), not to ",
        o.data.empty() ? absl::StrCat("the ", o.task, " task") : absl::StrCat("text ", o.data)));
  }
  if (vocab < TokenData::kVocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab=", vocab, ": byte data needs a vocabulary of at least ", TokenData::kVocab));
  }
  return OpenTokenData(o.data, o.data.empty() ? o.task : "text", o.seed, o.validation_fraction,
                       o.digits);
}

class GptTask : public TrainingTask {
 public:
  static absl::StatusOr<std::unique_ptr<TrainingTask>> Create(const TaskOptions& o) {
    GptConfig config;
    config.n_layer = o.layers;
    config.n_head = o.heads;
    config.n_embd = o.d_model;
    config.vocab = o.vocab > 0                    ? o.vocab
                   : LooksLikeTokenShards(o.data) ? kGpt2Vocab
                                                  : TokenData::kVocab;
    config.n_ctx = o.positions > 0 ? o.positions : o.context;
    if (o.context > config.n_ctx) {
      return absl::InvalidArgumentError(absl::StrCat("--context=", o.context,
                                                     " is longer than the ", config.n_ctx,
                                                     " positions of the model"));
    }
    auto data = OpenGptData(o, config.vocab);
    if (!data.ok()) return data.status();
    if (absl::Status s = (*data)->CheckContext(o.context); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<TokenModel>> model;
    if (o.gpt_factory) {
      model = o.gpt_factory(config, o.batch);
    } else {
      model = GptModel::Create(config);
    }
    if (!model.ok()) return model.status();
    auto task = std::unique_ptr<GptTask>(new GptTask());
    task->options_ = o;
    task->default_accum_ = o.grad_accum;
    task->model_ = std::move(*model);
    task->data_ = std::move(*data);
    task->shards_ = dynamic_cast<TokenShardData*>(task->data_.get());
    task->tokens_.resize(static_cast<size_t>(o.batch) * o.context);
    task->targets_.resize(task->tokens_.size());
    return std::unique_ptr<TrainingTask>(std::move(task));
  }
  Model* model() override { return model_.get(); }
  absl::Status SetTrainBatch(int64_t step, int micro, int rank, int world) override {
    const BatchLayout layout = Layout(world);
    const BatchLayout::Coordinates at = layout.At(rank, micro);
    absl::Status s = data_->FillBatch(
        Split::kTrain, step - cursor_step_, at.micro, at.rank, layout.data_world, options_.batch,
        layout.data_accum, options_.context, tokens_.data(), targets_.data(), cursor_row_);
    if (!s.ok()) return s;
    ScoreAsAsked();
    return model_->SetBatch(tokens_.data(), targets_.data(), options_.batch, options_.context);
  }
  int64_t ItemsPerMicroBatch() const override { return int64_t{options_.batch} * options_.context; }
  // PaLM's (arXiv 2204.02311, Appendix B) per token: 6N + 12 L T d, N the
  // parameters but the position embeddings (a look-up, no product; the
  // token embeddings count: they are the tied LM head's product), T the
  // trained sequence length (--context), d = n_embd. 12 L T d is the
  // attention's scores and weighted values, forward and backward, over the
  // full T x T (non-causal, as PaLM counts it; a causal kernel could skip
  // half).
  double FlopsPerItem() const override {
    const double n = ParametersOf(model_->Spec(), "wpe.weight");
    return 6.0 * n +
           12.0 * options_.layers * options_.context * static_cast<double>(options_.d_model);
  }
  std::string TrainSamples(int64_t step, int rank, int world) const override {
    if (options_.data.empty()) return "";
    return absl::StrCat(
        "training samples ",
        SampleRanges(options_, Layout(world), step - cursor_step_, rank, cursor_row_, /*rows=*/0),
        " of ", options_.data, " (text_data.h / token_shards.h map a sample to its tokens)");
  }

  absl::StatusOr<Evaluation> Evaluate(ZeroEngine& engine, int rank, int world,
                                      int batches) override {
    if (shards_ != nullptr) {
      absl::StatusOr<double> loss = ShardValidationLoss(engine, rank, world);
      if (!loss.ok()) return loss.status();
      Evaluation result;
      result.loss = *loss;
      return result;
    }
    double sum = 0;
    for (int b = 0; b < batches; ++b) {
      absl::Status s = data_->FillBatch(Split::kValidation, b, 0, rank, world, options_.batch, 1,
                                        options_.context, tokens_.data(), targets_.data());
      if (!s.ok()) return s;
      ScoreAsAsked();
      if (s = model_->SetBatch(tokens_.data(), targets_.data(), options_.batch, options_.context);
          !s.ok()) {
        return s;
      }
      absl::StatusOr<double> loss = engine.Forward();
      if (!loss.ok()) return loss.status();
      sum += *loss;
    }
    Evaluation result;
    absl::StatusOr<double> mean = engine.MeanOverRanks(sum / std::max(1, batches));
    if (!mean.ok()) return mean.status();
    result.loss = *mean;
    if (auto* addition = dynamic_cast<AdditionTaskData*>(data_.get())) {
      absl::StatusOr<double> accuracy = AdditionAccuracy(engine, *addition, rank, world, false);
      if (!accuracy.ok()) return accuracy.status();
      result.accuracy = *accuracy;
      // After another line only where the window holds that line whole
      // before the prompt and its answer (a shorter one crops it away).
      if (options_.context >= 2 * addition->MaxLineBytes()) {
        accuracy = AdditionAccuracy(engine, *addition, rank, world, true);
        if (!accuracy.ok()) return accuracy.status();
        result.accuracy_in_context = *accuracy;
      }
    }
    return result;
  }

  absl::StatusOr<std::string> Sample(ZeroEngine& engine, int bytes) override {
    // Every rank runs the same forwards (stage 3 gathers are collective) on
    // the same prompt with the same seeded sampler, so all agree. Stage 3
    // gathers the parameters once for the whole sample, not once per token
    // (across hosts each gather crosses the network).
    if (absl::Status s = engine.HoldGatheredParameters(); !s.ok()) return s;
    absl::Cleanup release = [&engine] { engine.ReleaseHeldParameters(); };
    if (shards_ != nullptr) return SampleTokenIds(engine, bytes);
    const bool addition = dynamic_cast<AdditionTaskData*>(data_.get()) != nullptr;
    std::vector<int32_t> sequence;
    if (addition) {
      for (char c : std::string("12+34=")) sequence.push_back(static_cast<uint8_t>(c));
    } else {
      sequence.push_back('\n');
    }
    std::mt19937_64 rng(options_.seed ^ 0x5a4d91e3ULL);
    std::string out;
    for (int i = 0; i < bytes; ++i) {
      absl::StatusOr<int32_t> next =
          NextToken(engine, sequence, /*temperature=*/0.5, &rng, /*line_only=*/addition);
      if (!next.ok()) return next.status();
      sequence.push_back(*next);
      out.push_back(static_cast<char>(*next));
      // Trained on the answers alone, the model has no operands to invent:
      // the sample ends with the prompt's answer.
      if (addition && options_.loss_on == "answers" && *next == '\n') break;
    }
    std::string prompt;
    for (size_t i = 0; i + out.size() < sequence.size(); ++i) {
      prompt.push_back(static_cast<char>(sequence[i]));
    }
    return prompt + out;
  }

  absl::StatusOr<std::string> EvalRecord(ZeroEngine& engine, int rank, int world) override {
    if (shards_ != nullptr) return ShardEvalRecord(engine, rank, world);
    absl::Status s = data_->FillBatch(Split::kValidation, 0, 0, rank, world, options_.batch, 1,
                                      options_.context, tokens_.data(), targets_.data());
    if (!s.ok()) return s;
    s = model_->SetBatch(tokens_.data(), targets_.data(), options_.batch, options_.context);
    if (!s.ok()) return s;
    absl::StatusOr<double> loss = engine.Forward();
    if (!loss.ok()) return loss.status();
    nlohmann::json out;
    out["loss"] = *loss;
    const int t = options_.context;
    for (int b = 0; b < options_.batch; ++b) {
      out["tokens"].push_back(
          std::vector<int32_t>(tokens_.begin() + b * t, tokens_.begin() + (b + 1) * t));
      out["targets"].push_back(
          std::vector<int32_t>(targets_.begin() + b * t, targets_.begin() + (b + 1) * t));
    }
    return out.dump();
  }

  std::string HuggingFaceConfig() const override {
    const GptConfig& c = model_->config();
    return HfGpt2ConfigJson({c.n_layer, c.n_head, c.n_embd, c.n_ctx, c.vocab});
  }

  std::string Describe() const override {
    const GptConfig& c = model_->config();
    return absl::StrFormat(
        "gpt: %d layers, %d heads, d_model %d, context %d of %d positions, "
        "vocabulary %d; data: %s",
        c.n_layer, c.n_head, c.n_embd, options_.context, c.n_ctx, c.vocab, data_->Describe());
  }

 private:
  // --loss_on=answers: only the answers' targets count (checked against the
  // task when the flags were read).
  void ScoreAsAsked() {
    if (options_.loss_on == "answers") {
      ScoreOnlyAnswers(tokens_.data(), targets_.data(), options_.batch, options_.context);
    }
  }

  // The validation loss of token shards as token_shards.h defines it: the
  // mean over every position of validation windows [0, n). Rank r takes the
  // contiguous windows [r * ceil(n / W), ...), `batch` at a time; every rank
  // runs the same number of forwards (stage 3's gathers are collective), a
  // rank out of windows running window 0 with weight 0. Sums of nats over
  // positions are added over ranks in float64.
  absl::StatusOr<double> ShardValidationLoss(ZeroEngine& engine, int rank, int world) {
    const int t = options_.context;
    const int64_t windows = shards_->ValidationWindows(t);
    const int64_t per_rank = (windows + world - 1) / world;
    const int64_t begin = std::min(windows, rank * per_rank);
    const int64_t end = std::min(windows, begin + per_rank);
    const int64_t rounds = (per_rank + options_.batch - 1) / options_.batch;
    std::vector<int32_t> window(static_cast<size_t>(t) + 1);
    double nats = 0;
    for (int64_t round = 0; round < rounds; ++round) {
      const int64_t first = begin + round * options_.batch;
      const int rows = static_cast<int>(std::clamp<int64_t>(end - first, 0, options_.batch));
      const int run_rows = std::max(rows, 1);
      for (int i = 0; i < run_rows; ++i) {
        absl::Status s =
            shards_->FillSample(Split::kValidation, rows > 0 ? first + i : 0, t, window.data());
        if (!s.ok()) return s;
        std::copy(window.begin(), window.end() - 1, tokens_.begin() + int64_t{i} * t);
        std::copy(window.begin() + 1, window.end(), targets_.begin() + int64_t{i} * t);
      }
      absl::Status s = model_->SetBatch(tokens_.data(), targets_.data(), run_rows, t);
      if (!s.ok()) return s;
      absl::StatusOr<double> loss = engine.Forward();
      if (!loss.ok()) return loss.status();
      if (rows > 0) nats += *loss * rows * t;
    }
    absl::StatusOr<std::vector<double>> sums = engine.GatherOverRanks(nats, "validation nats");
    if (!sums.ok()) return sums.status();
    double total = 0;
    for (double v : *sums) total += v;
    return total / (static_cast<double>(windows) * t);
  }

  // --eval_out for token shards: the validation loss and what defines it.
  absl::StatusOr<std::string> ShardEvalRecord(ZeroEngine& engine, int rank, int world) {
    absl::StatusOr<double> loss = ShardValidationLoss(engine, rank, world);
    if (!loss.ok()) return loss.status();
    nlohmann::ordered_json out;
    out["loss"] = *loss;
    out["definition"] =
        "mean cross-entropy (nats) over every position of windows k = 0..windows-1 of "
        "context + 1 tokens starting at token k * context of the validation shards "
        "concatenated in sorted order";
    out["windows"] = shards_->ValidationWindows(options_.context);
    out["context"] = options_.context;
    out["val_data"] = shards_->ValidationPaths();
    return out.dump();
  }

  // Generated token ids after the first validation token, space-separated:
  // the worker has no tokenizer.
  absl::StatusOr<std::string> SampleTokenIds(ZeroEngine& engine, int count) {
    std::vector<int32_t> window(static_cast<size_t>(options_.context) + 1);
    if (absl::Status s =
            shards_->FillSample(Split::kValidation, 0, options_.context, window.data());
        !s.ok()) {
      return s;
    }
    std::vector<int32_t> sequence = {window[0]};
    std::mt19937_64 rng(options_.seed ^ 0x5a4d91e3ULL);
    std::string out = absl::StrCat("token ids: ", window[0], " |");
    for (int i = 0; i < count; ++i) {
      absl::StatusOr<int32_t> next = NextToken(engine, sequence, /*temperature=*/0.8, &rng);
      if (!next.ok()) return next.status();
      sequence.push_back(*next);
      absl::StrAppend(&out, " ", *next);
    }
    return out;
  }

  // The next token after `sequence` (its last n_ctx tokens): greedy when
  // temperature is 0, else sampled.
  // `line_only` (addition): the window holds only the current line (or the
  // previous one, before a line's first byte).
  absl::StatusOr<int32_t> NextToken(ZeroEngine& engine, const std::vector<int32_t>& sequence,
                                    double temperature, std::mt19937_64* rng,
                                    bool line_only = false) {
    int t = static_cast<int>(std::min<size_t>(sequence.size(), options_.context));
    if (line_only) {
      // Sums are line-level: the sampler asks each line on its own, as the
      // first-line accuracy does (a small model learns to add at the start
      // of a sequence long before it does after other lines).
      auto newline = std::find(std::make_reverse_iterator(sequence.end() - 1),
                               std::make_reverse_iterator(sequence.end() - t), int32_t{'\n'});
      if (newline != std::make_reverse_iterator(sequence.end() - t)) {
        t = static_cast<int>(newline - std::make_reverse_iterator(sequence.end()));
      }
    } else if (static_cast<size_t>(t) < sequence.size()) {
      // Training windows start at a line; so does a cropped one, if it can.
      auto begin = sequence.end() - t;
      auto newline = std::find(begin, sequence.end() - 1, int32_t{'\n'});
      if (newline != sequence.end() - 1) t = static_cast<int>(sequence.end() - (newline + 1));
    }
    std::vector<int32_t> window(sequence.end() - t, sequence.end());
    std::vector<int32_t> targets(window.begin() + 1, window.end());
    targets.push_back(0);
    absl::Status s = model_->SetBatch(window.data(), targets.data(), 1, t);
    if (!s.ok()) return s;
    absl::StatusOr<double> loss = engine.Forward();
    if (!loss.ok()) return loss.status();
    std::vector<float> row(model_->config().vocab);
    if (s = model_->LogitsRowToHost(t - 1, row.data()); !s.ok()) return s;
    const float* logits = row.data();
    // Only the data's tokens: byte tasks leave the rows above 255 unused.
    const int choices = data_->vocab();
    if (temperature <= 0) {
      return static_cast<int32_t>(std::max_element(logits, logits + choices) - logits);
    }
    double max_logit = *std::max_element(logits, logits + choices);
    std::vector<double> p(choices);
    double total = 0;
    for (int v = 0; v < choices; ++v) {
      total += p[v] = std::exp((logits[v] - max_logit) / temperature);
    }
    double u = std::uniform_real_distribution<double>(0, total)(*rng);
    for (int v = 0; v < choices; ++v) {
      if ((u -= p[v]) <= 0) return v;
    }
    return choices - 1;
  }

  // Greedy answers to held-out problems: every rank answers the same number
  // of problems with the same number of forwards (collectives line up).
  // With `in_context`, each problem follows one solved line of another
  // held-out problem.
  absl::StatusOr<double> AdditionAccuracy(ZeroEngine& engine, AdditionTaskData& data, int rank,
                                          int world, bool in_context) {
    // 64 per rank: 256 problems at the quickstart's W = 4, so that "99 %" means at
    // most 2 wrong answers rather than none of 64.
    constexpr int kProblemsPerRank = 64;
    // 64 x (digits + 2) forwards: at stage 3 each would gather every unit
    // again (across hosts, 512 gathers of the whole model crossed the network
    // per evaluation of a 2-digit task); gather once, as Sample does.
    if (absl::Status s = engine.HoldGatheredParameters(); !s.ok()) return s;
    absl::Cleanup release = [&engine] { engine.ReleaseHeldParameters(); };
    std::vector<AdditionProblem> problems = data.ValidationProblems(2 * kProblemsPerRank * world);
    int correct = 0;
    const int answer_tokens = data.digits() + 2;  // digits, a carry, '\n'
    for (int i = 0; i < kProblemsPerRank; ++i) {
      const AdditionProblem& problem = problems[rank * kProblemsPerRank + i];
      std::vector<int32_t> sequence;
      if (in_context) {
        const AdditionProblem& before = problems[(world + rank) * kProblemsPerRank + i];
        for (char c : before.Line()) sequence.push_back(static_cast<uint8_t>(c));
      }
      for (char c : problem.prompt) sequence.push_back(static_cast<uint8_t>(c));
      std::string generated;
      for (int k = 0; k < answer_tokens; ++k) {
        absl::StatusOr<int32_t> next = NextToken(engine, sequence, 0, nullptr);
        if (!next.ok()) return next.status();
        sequence.push_back(*next);
        generated.push_back(static_cast<char>(*next));
      }
      correct += CheckAnswer(generated, problem.answer);
    }
    absl::StatusOr<double> mean = engine.MeanOverRanks(double(correct) / kProblemsPerRank);
    if (!mean.ok()) return mean.status();
    return *mean;
  }

  TaskOptions options_;
  std::unique_ptr<TokenModel> model_;
  std::unique_ptr<TokenData> data_;
  TokenShardData* shards_ = nullptr;  // data_, when it is token shards
  std::vector<int32_t> tokens_, targets_;
};

}  // namespace

namespace {

absl::Status Bad(const std::string& message) { return absl::InvalidArgumentError(message); }

// --model=gpt's sizes, in the flags' names (the model says n_head, n_embd).
absl::Status CheckGptSizes(const TaskOptions& task) {
  const std::pair<const char*, int64_t> sizes[] = {{"layers", task.layers},
                                                   {"heads", task.heads},
                                                   {"d_model", task.d_model},
                                                   {"context", task.context}};
  for (const auto& [flag, value] : sizes) {
    if (value < 1) return Bad(absl::StrCat("--", flag, "=", value, ": expected 1 or more"));
  }
  if (task.d_model % task.heads != 0) {
    return Bad(absl::StrCat("--d_model=", task.d_model, " is not divisible by --heads=", task.heads,
                            ": each head takes d_model / heads components; pick "
                            "heads that divide d_model"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTaskOptions(const TaskOptions& task) {
  if (task.model != "mlp" && task.model != "gpt") {
    return Bad(absl::StrCat("--model=", task.model, " is unknown: expected mlp or gpt"));
  }
  if (task.model == "mlp" && task.activation != "none" && task.activation != "relu" &&
      task.activation != "gelu") {
    return Bad(absl::StrCat("--activation=", task.activation, ": expected none, relu or gelu"));
  }
  if (task.digits < 1 || task.digits > 9) {
    return Bad(absl::StrCat("--digits=", task.digits, ": expected 1 to 9"));
  }
  if (task.loss_on != "all" && task.loss_on != "answers") {
    return Bad(absl::StrCat("--loss_on=", task.loss_on, ": expected all or answers"));
  }
  const bool addition = task.task == "addition" || task.task == "reversed-addition";
  if (task.loss_on == "answers" && (task.model != "gpt" || !task.data.empty() || !addition)) {
    return Bad(
        "--loss_on=answers needs --model=gpt on an addition task (--task=addition or "
        "reversed-addition, no --data): only its lines have answers");
  }
  if (!addition && !(task.task == "text" && !task.data.empty())) {
    return Bad(absl::StrCat("--task=", task.task,
                            " is unknown: expected addition or reversed-addition (built-in "
                            "synthetic sums); for text, pass --data=FILE"));
  }
  return task.model == "gpt" ? CheckGptSizes(task) : absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TrainingTask>> MakeTrainingTask(const TaskOptions& options) {
  if (options.model == "mlp") return MlpTask::Create(options);
  if (options.model == "gpt") return GptTask::Create(options);
  return absl::InvalidArgumentError(
      absl::StrCat("--model=", options.model, " is unknown: expected mlp or gpt"));
}

}  // namespace zeroshard
