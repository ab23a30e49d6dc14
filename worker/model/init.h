// Counter-based deterministic initialization.
//
// Every parameter element gets its value from (seed, tensor name, element
// index) alone, with no sequential generator state. That lets each rank of a
// sharded run produce just the rows it owns, in any order, and still build
// bit-for-bit the same model as a single process would.
//
// Element e of a stream draws from SplitMix64 at counter position e: the
// stream key plays the role of SplitMix64's seed, and position e is the state
// after e+1 increments, computed directly instead of by stepping.
#ifndef ZEROSHARD_WORKER_MODEL_INIT_H_
#define ZEROSHARD_WORKER_MODEL_INIT_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace zeroshard {

// The SplitMix64 output function: a bijective 64-bit mixer.
uint64_t SplitMix64Mix(uint64_t x);

// The key of the stream of tensor `name` under `seed`. Distinct names give
// unrelated streams; the same (seed, name) always gives the same key.
uint64_t InitStreamKey(uint64_t seed, absl::string_view name);

// The raw 64 random bits at position `counter` of stream `key`.
uint64_t InitBits(uint64_t key, uint64_t counter);

// out[i] = the value of element first_element + i, for i in [0, count).
// Uniform: in [low, high] (the f32 rounding may reach `high`), one draw per
// element. Normal: Box-Muller over two draws per element (positions 2e, 2e+1),
// keeping only the cosine branch so each element stands alone.
void FillUniform(uint64_t key, int64_t first_element, int64_t count, float low, float high,
                 float* out);
void FillNormal(uint64_t key, int64_t first_element, int64_t count, float mean, float stddev,
                float* out);
void FillConstant(float value, int64_t count, float* out);

// How one tensor is initialized: uniform(a, b), normal(mean a, stddev b), or
// the constant a.
struct InitRule {
  enum class Kind { kUniform, kNormal, kConstant };
  Kind kind = Kind::kConstant;
  float a = 0.0f;
  float b = 0.0f;

  static InitRule Uniform(float low, float high) { return {Kind::kUniform, low, high}; }
  static InitRule Normal(float mean, float stddev) { return {Kind::kNormal, mean, stddev}; }
  static InitRule Constant(float value) { return {Kind::kConstant, value, 0.0f}; }
};

// Elements [first_element, first_element + count) of the tensor `name`
// initialized by `rule` under `seed`, into out[0, count).
void FillInit(const InitRule& rule, uint64_t seed, absl::string_view name, int64_t first_element,
              int64_t count, float* out);

}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_MODEL_INIT_H_
