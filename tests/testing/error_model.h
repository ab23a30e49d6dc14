// Error models for the numerical tests: how far two float32 computations of
// the same real-number function may drift apart when they sum in different
// orders. Every tolerance in a test that compares float results should come
// from one of these (or from a float64 reference), with the shapes that feed
// it written at the call site — never from the value that passed on one
// machine.
//
// Where do the orders differ? OpenBLAS picks its GEMM kernels per CPU
// (SkylakeX on AVX-512, Haswell on AVX2 + FMA, Sandybridge on AVX, Zen, ...)
// and each blocks the inner products differently (and fuses multiply-adds or
// not); the ranks of a job reduce gradients in ring order; a micro-batch split
// adds partial gradients in another grouping. Our own kernels (optimizer,
// layer norm, attention's tiled path) do the same arithmetic on every CPU of
// one code path, so runs that share them and differ in nothing else are
// compared bitwise, not with these bounds.
#ifndef ZEROSHARD_TESTS_TESTING_ERROR_MODEL_H_
#define ZEROSHARD_TESTS_TESTING_ERROR_MODEL_H_

#include <cstdint>

namespace zeroshard::testing {

// Unit roundoff of float32 round-to-nearest: |fl(x) - x| <= u |x|.
inline constexpr double kFloat32Unit = 0x1p-24;

// gamma_n = n u / (1 - n u): a float32 sum or dot product of n terms, in any
// order or blocking, with or without fused multiply-adds, is within
// gamma_n * sum |terms| of the exact value (Higham, "Accuracy and Stability of
// Numerical Algorithms", 2nd ed., section 3.1). Two such orders differ by at
// most twice that.
inline double SumErrorBound(int64_t n) {
  const double nu = static_cast<double>(n) * kFloat32Unit;
  return nu / (1 - nu);
}

// A training run of a dense network compared with another run of the same
// real-number training in another summation order (see the top of the file).
struct TrainingErrorModel {
  int layers = 1;          // dense layers a forward + backward pass chains
  int64_t sum_length = 1;  // the longest sum in one layer: max(width, rows per step)
  int steps = 1;           // optimizer steps taken
  double lr = 0;           // the (largest) learning rate
  double param_scale = 1;  // smallest max|p| of a compared tensor (the denominator below)
  // Conditioning kappa of a gradient element: (sum of |terms|) / |sum|. Adam
  // divides each element by its own running magnitude, so an element whose
  // gradient nearly cancels carries its relative error, amplified by kappa,
  // into a full-size update (a sign flip at kappa = infinity moves it by 2 lr).
  // We assume every element's gradient keeps >= 1% of its terms' scale,
  // kappa <= 100: smooth activations (GELU) and random data. ReLU breaks it (a
  // unit switched on in one order and off in the other), which is why the
  // equality tests train GELU models or compare runs that share the order.
  double kappa = 100;
};

// Bound on max|p_a - p_b| / max|p_b| per tensor (what MaxRelativeDifference
// measures) after `steps` steps of Adam or AdamW. The model, to first order:
// - one step's gradient passes forward and backward through `layers` layers,
//   each a sum of <= sum_length terms: rho = 2 * layers * 2 gamma_n relative
//   to the terms' scale (2 gamma_n: two orders, each within gamma_n);
// - Adam's update lr * m_hat / (sqrt(v_hat) + eps) is scale-free: a relative
//   change rho * kappa of an element's gradients changes its update by at
//   most 2 rho kappa lr (m_hat and sqrt(v_hat) each by rho kappa);
// - the steps add: T steps, each also fed parameters already apart, whose
//   effect on the next gradient is of the same first order; and divided by
//   the tensor's scale.
// SGD's update lr * g has no kappa: with |g| <= 2 kappa (true for the
// normalised losses here) its difference is below this bound too.
inline double AdamRelativeParamBound(const TrainingErrorModel& m) {
  const double rho = 2.0 * m.layers * 2.0 * SumErrorBound(m.sum_length);
  return m.steps * 2.0 * rho * m.kappa * m.lr / m.param_scale;
}

}  // namespace zeroshard::testing

#endif  // ZEROSHARD_TESTS_TESTING_ERROR_MODEL_H_
