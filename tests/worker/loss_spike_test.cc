// LossSpikeDetector (--loss_spike_zscore): which losses are spikes against
// the window of applied steps, and how a rewind's re-run sees the window the
// first run had.
#include "worker/loss_spike.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

StepVerdict Loss(double loss) {
  StepVerdict v;
  v.mean_loss = loss;
  return v;
}

// Losses 1.0, 1.1, 1.0, 1.1, ... for steps [0, n): mean 1.05, sample sd
// ~0.0513 for an even count.
void Fill(LossSpikeDetector* d, int n) {
  for (int step = 0; step < n; ++step) d->Record(step, step % 2 ? 1.1 : 1.0);
}

TEST(LossSpikeTest, OffJudgesNothing) {
  LossSpikeDetector d(0);
  EXPECT_FALSE(d.enabled());
  Fill(&d, 20);
  StepVerdict v = Loss(1e9);
  d.Screen(&v);
  EXPECT_FALSE(v.loss_spike);
}

TEST(LossSpikeTest, NoJudgementBeforeMinSteps) {
  LossSpikeDetector d(3);
  Fill(&d, LossSpikeDetector::kMinSteps - 1);
  StepVerdict v = Loss(1e9);
  d.Screen(&v);
  EXPECT_FALSE(v.loss_spike);
}

TEST(LossSpikeTest, ALossAboveZDeviationsIsASpikeAndBelowIsNot) {
  LossSpikeDetector d(3);
  Fill(&d, 10);
  // Mean 1.05, sd = sqrt(10 * 0.05^2 / 9) = 0.0527: z = 3 at 1.208.
  StepVerdict below = Loss(1.2);
  d.Screen(&below);
  EXPECT_FALSE(below.loss_spike);
  StepVerdict above = Loss(1.22);
  d.Screen(&above);
  ASSERT_TRUE(above.loss_spike);
  EXPECT_NEAR(above.window_mean, 1.05, 1e-12);
  EXPECT_NEAR(above.window_sd, std::sqrt(10 * 0.0025 / 9), 1e-12);
  EXPECT_NEAR(above.zscore, (1.22 - 1.05) / above.window_sd, 1e-9);
  EXPECT_EQ(above.window_steps, 10);
  EXPECT_TRUE(above.bad());
  EXPECT_FALSE(above.apply());
  EXPECT_NE(above.Describe().find("standard deviations above the mean"), std::string::npos)
      << above.Describe();
  // One-sided: a loss far below the window is good news.
  StepVerdict low = Loss(0.0);
  d.Screen(&low);
  EXPECT_FALSE(low.loss_spike);
}

TEST(LossSpikeTest, AFlatWindowUsesTheFloorNotRoundingNoise) {
  LossSpikeDetector d(6);
  for (int step = 0; step < 10; ++step) d.Record(step, 2.0);
  // sd 0 would make any wobble infinitely many sigma; the floor is 1e-3 of
  // the mean (0.002): 2.01 is 5 of them, 2.02 is 10.
  StepVerdict wobble = Loss(2.01);
  d.Screen(&wobble);
  EXPECT_FALSE(wobble.loss_spike);
  StepVerdict spike = Loss(2.02);
  d.Screen(&spike);
  EXPECT_TRUE(spike.loss_spike);
}

TEST(LossSpikeTest, ANonFiniteStepStaysNonFiniteNotASpike) {
  LossSpikeDetector d(3);
  Fill(&d, 10);
  StepVerdict v = Loss(std::numeric_limits<double>::infinity());
  v.nonfinite = NonFiniteQuantity::kLoss;
  d.Screen(&v);
  EXPECT_FALSE(v.loss_spike);
  EXPECT_TRUE(v.bad());
}

TEST(LossSpikeTest, TheWindowKeepsTheLast32Steps) {
  LossSpikeDetector d(3);
  // 40 steps: 0..7 at 100 (would dominate the mean), then 32 at 1.0/1.1.
  for (int step = 0; step < 8; ++step) d.Record(step, 100);
  for (int step = 8; step < 40; ++step) d.Record(step, step % 2 ? 1.1 : 1.0);
  StepVerdict v = Loss(1.5);
  d.Screen(&v);
  EXPECT_TRUE(v.loss_spike);
  EXPECT_EQ(v.window_steps, LossSpikeDetector::kWindow);
  EXPECT_NEAR(v.window_mean, 1.05, 1e-12);
}

TEST(LossSpikeTest, ARewindRestoresTheWindowTheFirstRunHad) {
  LossSpikeDetector first(3), rewound(3);
  Fill(&first, 10);
  Fill(&rewound, 14);  // steps 10-13 ran, then a spike at 14 rewound to 10
  rewound.RewindTo(10);
  StepVerdict a = Loss(1.2), b = Loss(1.2);
  first.Screen(&a);
  rewound.Screen(&b);
  EXPECT_EQ(a.loss_spike, b.loss_spike);
  // Re-recording a step replaces it rather than adding a second entry.
  rewound.Record(10, 50.0);
  rewound.Record(10, 1.0);
  first.Record(10, 1.0);
  StepVerdict c = Loss(1.21), e = Loss(1.21);
  first.Screen(&c);
  rewound.Screen(&e);
  EXPECT_EQ(c.window_mean, e.window_mean);
  EXPECT_EQ(c.window_steps, e.window_steps);
}

}  // namespace
}  // namespace zeroshard
