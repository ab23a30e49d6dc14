// How CublasLtLinear (cublaslt_linear.h) maps a row-major Linear / Conv1D
// product onto cuBLASLt's column-major D[m,n] = op(A)[m,k] op(B)[k,n]: plain
// host code, so that the mapping (transposes, leading dimensions, which
// operand a bias gradient reduces) is tested on the CPU against layers.h
// (//tests/worker/cuda:cuda_cublaslt_plan_test) without a GPU.
//
// A row-major [R,C] matrix is the column-major C x R matrix with leading
// dimension C, so Y = X W is issued as Y^T = W^T X^T (the same memory). A
// row-major [R,C] matrix whose rows are ld >= C elements apart (padded rows)
// is the column-major C x R matrix with leading dimension ld: y and dy take
// such an ld (0 meaning C, packed), so that the LM head's [N,V] logits can
// live in rows padded to a multiple of 64 columns.
#ifndef ZEROSHARD_WORKER_CUDA_CUBLASLT_PLAN_H_
#define ZEROSHARD_WORKER_CUDA_CUBLASLT_PLAN_H_

#include <cstdint>

namespace zeroshard {
namespace gpu {
namespace internal {

// Column-major D[m,n] = op(A)[m,k] op(B)[k,n]: A is stored (trans_a ? k x m :
// m x k) with leading dimension lda, B likewise, D is m x n with ldd.
struct LtPlan {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  // BackwardWeight only: the bias gradient (column sums of dy) is the
  // k-reduction of op(A) (cuBLASLt's BGRADA, one value per row of D) when
  // true, of op(B) (BGRADB, one per column of D) when false.
  bool bias_grad_from_a = false;
};

// out_in: w [OUT,IN] (PyTorch Linear); else w [IN,OUT] (GPT-2 Conv1D).
// y[N,OUT] = x[N,IN] W; y's rows ld_y apart (0: OUT).
LtPlan PlanForward(bool out_in, void* y, const void* x, const void* w, int64_t n, int64_t in,
                   int64_t out, int64_t ld_y = 0);
// dx[N,IN] = dy[N,OUT] W^T; dy's rows ld_dy apart (0: OUT).
LtPlan PlanBackwardInput(bool out_in, void* dx, const void* dy, const void* w, int64_t n,
                         int64_t in, int64_t out, int64_t ld_dy = 0);
// dw (w's shape) = x^T dy in w's layout; the caller adds (beta 1). dy's rows
// ld_dy apart (0: OUT).
LtPlan PlanBackwardWeight(bool out_in, void* dw, const void* x, const void* dy, int64_t n,
                          int64_t in, int64_t out, int64_t ld_dy = 0);

}  // namespace internal
}  // namespace gpu
}  // namespace zeroshard

#endif  // ZEROSHARD_WORKER_CUDA_CUBLASLT_PLAN_H_
