// TrainingTask::FlopsPerItem, the numerator of MFU (docs/goodput.md): 6N a
// row for the MLP; PaLM's 6N + 12 L T d a token for the GPT, N without the
// position embeddings. The expected values are counted here from the
// shapes, independently of the model's Spec().
#include <memory>

#include "gtest/gtest.h"
#include "worker/training_task.h"

namespace zeroshard {
namespace {

TEST(FlopsPerItemTest, MlpIsSixTimesItsParameters) {
  TaskOptions o;
  o.model = "mlp";
  o.layers = 3;
  o.width = 16;
  absl::StatusOr<std::unique_ptr<TrainingTask>> task = MakeTrainingTask(o);
  ASSERT_TRUE(task.ok()) << task.status();
  double parameters = 0;
  for (const TensorSpec& t : (*task)->model()->Spec().tensors) parameters += t.Elements();
  // Three 16 x 16 layers, with or without biases.
  EXPECT_GE(parameters, 3 * 16 * 16);
  EXPECT_LE(parameters, 3 * (16 * 16 + 16));
  EXPECT_EQ((*task)->FlopsPerItem(), 6 * parameters);
}

TEST(FlopsPerItemTest, GptIsPalmsCountWithoutThePositionEmbeddings) {
  TaskOptions o;
  o.model = "gpt";
  o.layers = 2;
  o.heads = 2;
  o.d_model = 16;
  o.context = 8;  // also the positions (wpe's rows)
  absl::StatusOr<std::unique_ptr<TrainingTask>> task = MakeTrainingTask(o);
  ASSERT_TRUE(task.ok()) << task.status();
  const double c = 16, l = 2, t = 8, vocab = 256;  // the addition task's bytes
  // GPT-2's block: ln_1, c_attn (C x 3C + 3C), attn c_proj (C x C + C), ln_2,
  // c_fc (C x 4C + 4C), mlp c_proj (4C x C + C): 12 C^2 + 13 C. Plus wte
  // (V x C, the tied LM head) and ln_f (2C); wpe (T x C) is left out.
  const double n = vocab * c + l * (12 * c * c + 13 * c) + 2 * c;
  EXPECT_EQ((*task)->FlopsPerItem(), 6 * n + 12 * l * t * c);
}

}  // namespace
}  // namespace zeroshard
