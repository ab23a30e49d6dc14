#include "worker/cuda/cublaslt_plan.h"

namespace zeroshard {
namespace gpu {
namespace internal {
namespace {

// A row-major [R,cols] operand's leading dimension: its row stride, or cols
// when packed (0).
int64_t RowStride(int64_t ld, int64_t cols) { return ld == 0 ? cols : ld; }

}  // namespace

LtPlan PlanForward(bool out_in, void* y, const void* x, const void* w, int64_t n, int64_t in,
                   int64_t out, int64_t ld_y) {
  LtPlan p;
  p.m = out;  // D = y^T, OUT x N
  p.n = n;
  p.k = in;
  p.a = w;
  if (out_in) {
    p.trans_a = true;  // w [OUT,IN] is column-major IN x OUT: y^T = (w^T)^T x^T
    p.lda = in;
  } else {
    p.lda = out;  // w [IN,OUT] is column-major OUT x IN: y^T = w^T x^T
  }
  p.b = x;  // x [N,IN] is column-major IN x N
  p.ldb = in;
  p.d = y;  // y [N,OUT], rows ld_y apart, is column-major OUT x N with leading dimension ld_y
  p.ldd = RowStride(ld_y, out);
  return p;
}

LtPlan PlanBackwardInput(bool out_in, void* dx, const void* dy, const void* w, int64_t n,
                         int64_t in, int64_t out, int64_t ld_dy) {
  LtPlan p;
  p.m = in;  // D = dx^T, IN x N
  p.n = n;
  p.k = out;
  p.a = w;
  if (out_in) {
    p.lda = in;  // dx = dy w, w [OUT,IN] column-major IN x OUT: dx^T = w^T dy^T
  } else {
    p.trans_a = true;  // dx = dy w^T, w [IN,OUT] column-major OUT x IN: dx^T = (w^T)^T dy^T
    p.lda = out;
  }
  p.b = dy;  // dy [N,OUT] is column-major OUT x N (leading dimension ld_dy)
  p.ldb = RowStride(ld_dy, out);
  p.d = dx;
  p.ldd = in;
  return p;
}

LtPlan PlanBackwardWeight(bool out_in, void* dw, const void* x, const void* dy, int64_t n,
                          int64_t in, int64_t out, int64_t ld_dy) {
  LtPlan p;
  p.k = n;
  p.d = dw;
  p.trans_b = true;
  if (out_in) {
    // dw[OUT,IN] = dy^T x: dw^T (IN x OUT) = x^T dy, with x^T the column-major
    // IN x N view of x and dy (column-major OUT x N) transposed: dy is op(B),
    // its column sums are BGRADB's k-reduction.
    p.m = in;
    p.n = out;
    p.a = x;
    p.lda = in;
    p.b = dy;
    p.ldb = RowStride(ld_dy, out);
    p.ldd = in;
  } else {
    // dw[IN,OUT] = x^T dy: dw^T (OUT x IN) = dy^T x, dy^T the column-major
    // OUT x N view of dy (op(A): BGRADA), x (IN x N) transposed.
    p.m = out;
    p.n = in;
    p.a = dy;
    p.lda = RowStride(ld_dy, out);
    p.b = x;
    p.ldb = in;
    p.ldd = out;
    p.bias_grad_from_a = true;
  }
  return p;
}

}  // namespace internal
}  // namespace gpu
}  // namespace zeroshard
