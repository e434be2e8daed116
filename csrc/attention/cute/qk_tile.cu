// The first piece of issue 30's CuTe member (docs/prefill.md, "Open design change"): S = Q K^T of one 64 x 128 tile a
// CTA by one warpgroup's GMMA, written with CUTLASS / CuTe's SM90 atoms (headers of the nvidia-cutlass wheel, found by
// fi_backend.kernels.cutlass). It proves the build path (include dirs, identity, ptxas without C75xx) and the shared
// memory layouts the mainloop will use: Q and K K-major in 128-byte swizzled atoms. Template parameter:
//     HEAD_DIM  64 or 128
// fi_cute_qk_tile: q [tiles, 64, D], k [tiles, 128, D] bf16 row-major, s [tiles, 64, 128] float32.
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
using TileQ = Shape<_64, Int<kHeadDim>>;
using TileK = Shape<_128, Int<kHeadDim>>;
using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, TileQ{}));
using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, TileK{}));
using TiledMma = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, _128, Int<kHeadDim>>>()));
constexpr int kThreads = 128;  // one warpgroup
constexpr int kSmemBytes = (cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutK>) * sizeof(Elem);

__global__ void __launch_bounds__(kThreads) qk_tile(const Elem* __restrict__ q, const Elem* __restrict__ k,
                                                     float* __restrict__ s) {
  extern __shared__ __align__(1024) uint8_t smem[];
  Elem* sq_ptr = reinterpret_cast<Elem*>(smem);
  Elem* sk_ptr = sq_ptr + cosize_v<SmemLayoutQ>;
  Tensor sQ = make_tensor(make_smem_ptr(sq_ptr), SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(sk_ptr), SmemLayoutK{});
  const int64_t tile = blockIdx.x;
  Tensor gQ = make_tensor(make_gmem_ptr(q + tile * 64 * kHeadDim), TileQ{}, LayoutRight{});
  Tensor gK = make_tensor(make_gmem_ptr(k + tile * 128 * kHeadDim), TileK{}, LayoutRight{});
  Tensor gS = make_tensor(make_gmem_ptr(s + tile * 64 * 128), Shape<_64, _128>{}, LayoutRight{});

  // Element by element through the logical coordinates: the swizzle is the layouts' business.
  for (int i = threadIdx.x; i < size(sQ); i += kThreads) sQ(i) = gQ(i);
  for (int i = threadIdx.x; i < size(sK); i += kThreads) sK(i) = gK(i);
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read by the tensor cores' async proxy
  __syncthreads();

  TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(threadIdx.x);
  Tensor tQ = thr.partition_fragment_A(sQ);  // descriptors
  Tensor tK = thr.partition_fragment_B(sK);
  Tensor tS = partition_fragment_C(mma, Shape<_64, _128>{});
  warpgroup_fence_operand(tS);
  warpgroup_arrive();
  mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tQ); ++kb) {
    cute::gemm(mma, tQ(_, _, kb), tK(_, _, kb), tS);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(tS);
  copy(tS, thr.partition_C(gS));
}

}  // namespace cute_probe
}  // namespace fi

FI_EXPORT int fi_cute_qk_tile(const void* q, const void* k, float* s, int64_t tiles, void* stream) {
  if (tiles <= 0) return 0;
  using namespace fi::cute_probe;
  cudaError_t e = cudaFuncSetAttribute(qk_tile, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return (int)e;
  qk_tile<<<(unsigned)tiles, kThreads, kSmemBytes, (cudaStream_t)stream>>>(
      static_cast<const Elem*>(q), static_cast<const Elem*>(k), s);
  return (int)cudaGetLastError();
}
