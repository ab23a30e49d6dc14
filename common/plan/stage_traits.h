// What a ZeRO stage decides, derived once from the stage number so that code
// asks what a stage means rather than which number it is: the engine's
// schedule (worker/zero/engine.cc) and the memory estimate
// (memory_estimate.cc) read the same rules from here. docs/design.md, "ZeRO
// engine", explains the stages.
#ifndef ZEROSHARD_COMMON_PLAN_STAGE_TRAITS_H_
#define ZEROSHARD_COMMON_PLAN_STAGE_TRAITS_H_

#include <cassert>

namespace zeroshard {

struct StageTraits {
  // Stage 3: parameters live only as this rank's chunk (the fp32 master) and
  // are all-gathered per unit for each use. Stages 0-2: every rank holds the
  // replicated parameters.
  bool params_sharded = false;
  // Stages 1-3: optimizer state (and a separate master, if any) cover this
  // rank's chunk; the gradient norm adds up over ranks. Stage 0: every row.
  bool state_sharded = false;
  // Stages 2-3: gradients are reduce-scattered per unit during the backward
  // into an accumulated chunk; the flat gradient lives only for one
  // micro-batch. Stages 0-1: the flat gradient accumulates over the step.
  bool grads_sharded = false;
  // Stage 1: the step's flat gradient is reduce-scattered at the step into a
  // separate chunk (`reduced`), and the updated chunks all-gathered back.
  bool reduce_at_step = false;

  // REQUIRES: 0 <= stage <= 3 (EngineOptions and the planner check it).
  static StageTraits Of(int stage) {
    assert(stage >= 0 && stage <= 3);
    StageTraits t;
    t.params_sharded = stage >= 3;
    t.state_sharded = stage >= 1;
    t.grads_sharded = stage >= 2;
    t.reduce_at_step = stage == 1;
    return t;
  }
};

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_PLAN_STAGE_TRAITS_H_
