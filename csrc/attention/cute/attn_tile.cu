// The second piece of issue 30's CuTe member (docs/prefill.md): attention of one 64-row query tile over its KV in
// 128-token tiles by one warpgroup, non-causal, loads synchronous. It checks what the mainloop's math rests on:
//   S = Q K^T   SS GMMA, Q and K K-major in 128-byte swizzled atoms (as qk_tile.cu);
//   softmax     on S's accumulators: value v of a thread is row warp * 16 + lane / 4 + 8 * ((v >> 1) & 1), column
//               (v >> 2) * 8 + (lane & 3) * 2 + (v & 1); a row's four threads are a quad (shuffles 1, 2);
//   O += P V    RS GMMA: P from registers (S's accumulators in the same order are the A operand's, k-blocks of 16
//               columns), V as the MN-major B operand (its rows' head dims contiguous, 128-byte swizzled).
// Template parameter: HEAD_DIM 64 or 128.
// fi_cute_attn_tile: q [tiles, 64, D], k / v [tiles, kv_len, D] bf16 row-major (kv_len a multiple of 128, > 0),
// o [tiles, 64, D] bf16, lse [tiles, 64] float32 (natural log), logits scaled by sm_scale.
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "common.h"

namespace fi {
namespace cute_probe {  // named: cute has anonymous namespaces of its own, which the kernel stub must not meet

using namespace cute;
using Elem = cute::bfloat16_t;
constexpr int kHeadDim = {{HEAD_DIM}};
static_assert(kHeadDim % 64 == 0, "head size: whole 128-byte swizzle atoms");
constexpr int kRows = 64, kKv = 128, kThreads = 128;
using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<kRows>, Int<kHeadDim>>{}));
using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<kKv>, Int<kHeadDim>>{}));
// V as P.V's B operand: (N = head dim, K = token), head dims contiguous
using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<kHeadDim>, Int<kKv>>{}));
using MmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<kRows>, Int<kKv>, Int<kHeadDim>>>()));
using MmaPV = decltype(make_tiled_mma(GMMA::rs_op_selector<Elem, Elem, float, Shape<Int<kRows>, Int<kHeadDim>, Int<kKv>>,
                                                            GMMA::Major::K, GMMA::Major::MN>()));
constexpr int kSmemBytes = (cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutK> + cosize_v<SmemLayoutVt>) * sizeof(Elem);
constexpr float kLog2e = 1.4426950408889634f;

__global__ void __launch_bounds__(kThreads) attn_tile(const Elem* __restrict__ q, const Elem* __restrict__ k,
                                                       const Elem* __restrict__ v, Elem* __restrict__ o,
                                                       float* __restrict__ lse, int kv_len, float sm_scale) {
  extern __shared__ __align__(1024) uint8_t smem[];
  Elem* sq_ptr = reinterpret_cast<Elem*>(smem);
  Elem* sk_ptr = sq_ptr + cosize_v<SmemLayoutQ>;
  Elem* sv_ptr = sk_ptr + cosize_v<SmemLayoutK>;
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(sv_ptr), SmemLayoutVt{});
  const int64_t tile = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  Tensor gQ = make_tensor(make_gmem_ptr(q + tile * kRows * kHeadDim), Shape<Int<kRows>, Int<kHeadDim>>{}, LayoutRight{});
  for (int i = tid; i < size(sQ); i += kThreads) sQ(i) = gQ(i);

  MmaQK mma_qk;
  MmaPV mma_pv;
  ThrMMA thr_qk = mma_qk.get_thread_slice(tid);
  ThrMMA thr_pv = mma_pv.get_thread_slice(tid);
  Tensor tQ = thr_qk.partition_fragment_A(sQ);
  Tensor tK = thr_qk.partition_fragment_B(sK);
  Tensor tVt = thr_pv.partition_fragment_B(sVt);
  Tensor tS = partition_fragment_C(mma_qk, Shape<Int<kRows>, Int<kKv>>{});
  Tensor tO = partition_fragment_C(mma_pv, Shape<Int<kRows>, Int<kHeadDim>>{});
  Tensor tP = thr_pv.partition_fragment_A(make_tensor(make_smem_ptr(sq_ptr), Shape<Int<kRows>, Int<kKv>>{}));
  static_assert(decltype(size(tS))::value == decltype(size(tP))::value, "P: S's accumulators in their order");
  clear(tO);
  float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};
  const float scale2 = sm_scale * kLog2e;

  for (int kv0 = 0; kv0 < kv_len; kv0 += kKv) {
    __syncthreads();  // the previous tile's MMAs are done with sK / sVt (waited for below)
    const Elem* kt = k + (tile * kv_len + kv0) * kHeadDim;
    const Elem* vt = v + (tile * kv_len + kv0) * kHeadDim;
    Tensor gK = make_tensor(make_gmem_ptr(kt), Shape<Int<kKv>, Int<kHeadDim>>{}, LayoutRight{});
    for (int i = tid; i < size(sK); i += kThreads) sK(i) = gK(i);
    for (int i = tid; i < kKv * kHeadDim; i += kThreads) {
      const int t = i / kHeadDim, d = i % kHeadDim;
      sVt(d, t) = vt[(int64_t)t * kHeadDim + d];
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by the tensor cores' async proxy
    __syncthreads();

    warpgroup_fence_operand(tS);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tQ); ++kb) {
      cute::gemm(mma_qk, tQ(_, _, kb), tK(_, _, kb), tS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tS);

    // online softmax over this tile's 128 columns; the rows' new maxima rescale O and the sums
    float tmax[2] = {mx[0], mx[1]};
    CUTE_UNROLL
    for (int i = 0; i < size(tS); ++i) tmax[(i >> 1) & 1] = fmaxf(tmax[(i >> 1) & 1], tS(i));
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
    }
    float alpha[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      alpha[h] = mx[h] == -INFINITY ? 0.f : exp2f((mx[h] - tmax[h]) * scale2);
      mx[h] = tmax[h];
      sum[h] *= alpha[h];
    }
    CUTE_UNROLL
    for (int i = 0; i < size(tO); ++i) tO(i) *= alpha[(i >> 1) & 1];
    CUTE_UNROLL
    for (int i = 0; i < size(tS); ++i) {
      const int h = (i >> 1) & 1;
      const float p = exp2f(tS(i) * scale2 - mx[h] * scale2);
      sum[h] += p;
      tP(i) = Elem(p);
    }

    warpgroup_fence_operand(tO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tP); ++kb) cute::gemm(mma_pv, tP(_, _, kb), tVt(_, _, kb), tO);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tO);
  }

  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
    sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
  }
  Tensor tOb = make_tensor_like<Elem>(tO);
  CUTE_UNROLL
  for (int i = 0; i < size(tO); ++i) tOb(i) = Elem(tO(i) / sum[(i >> 1) & 1]);
  Tensor gO = make_tensor(make_gmem_ptr(o + tile * kRows * kHeadDim), Shape<Int<kRows>, Int<kHeadDim>>{}, LayoutRight{});
  copy(tOb, thr_pv.partition_C(gO));
  if ((lane & 3) == 0) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h)
      lse[tile * kRows + warp * 16 + (lane >> 2) + 8 * h] = mx[h] * sm_scale + logf(sum[h]);
  }
}

}  // namespace cute_probe
}  // namespace fi

FI_EXPORT int fi_cute_attn_tile(const void* q, const void* k, const void* v, void* o, float* lse, int64_t tiles,
                                int64_t kv_len, float sm_scale, void* stream) {
  using namespace fi::cute_probe;
  if (tiles <= 0) return 0;
  if (kv_len <= 0 || kv_len % kKv) return (int)cudaErrorInvalidValue;
  cudaError_t e = cudaFuncSetAttribute(attn_tile, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return (int)e;
  attn_tile<<<(unsigned)tiles, kThreads, kSmemBytes, (cudaStream_t)stream>>>(
      static_cast<const Elem*>(q), static_cast<const Elem*>(k), static_cast<const Elem*>(v), static_cast<Elem*>(o),
      lse, (int)kv_len, sm_scale);
  return (int)cudaGetLastError();
}
