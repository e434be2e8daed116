// Attention module template (rendered by fi_backend/wrappers.py + variants.py + kernels): one kernel
// (KERNEL: decode, csrc/attention/decode.cuh, or prefill, csrc/attention/prefill.cuh) for one shape
// (CONFIG: head_dim, heads per chunk, dtypes, warps, tiles, stages) and one variant.
//
// Exports
//   fi_attention_run(const Params*, const VariantParams*, grid_x, grid_y, stream) -> cudaError_t, or -1
//       when the launch succeeded into a stream that is being captured (the caller then pins what the
//       graph will read)
//   fi_attention_layout(int64_t* out, int n) -> number of values: sizes and field offsets of Params and
//       VariantParams and the kernel shape, so the Python side can check its ctypes mirror
//   fi_attention_occupancy(int* blocks_per_sm) -> cudaError_t (needs a device)
#include <stddef.h>

#include "common.h"
#include "attention/{{KERNEL}}.cuh"

// Hooks a variant does not use are rendered (so the template always compiles) but never referenced.
#pragma nv_diag_suppress 177

namespace {

// Extra parameters of the variant (the first field keeps the struct non-empty).
struct VariantParams {
  int32_t reserved_;
{{VARIANT_PARAMS}}
};

struct Variant {
{{VARIANT_BODY}}
};

using Cfg = fi::{{KERNEL}}::Config<{{CONFIG}}>;
using Impl = fi::{{KERNEL}}::Kernel<Cfg, Variant, VariantParams>;

// MIN_BLOCKS: CTAs per SM that shared memory allows; the register budget follows from it.
__global__ void __launch_bounds__(Cfg::kLaunchThreads, {{MIN_BLOCKS}})
    attention_kernel(const __grid_constant__ fi::attn::Params p, const __grid_constant__ VariantParams vp) {
  extern __shared__ __align__(1024) uint8_t smem[];  // 1024: wgmma swizzle atoms
  Impl::run(p, vp, smem);
}

// cudaFuncSetAttribute is per device; remember which devices have it (a set bit per device index).
unsigned long long g_configured = 0ull;

int configure() {
  int dev = 0;
  FI_CUDA_TRY(cudaGetDevice(&dev));
  const unsigned long long bit = dev < 64 ? (1ull << dev) : 0ull;
  if (bit && (g_configured & bit)) return 0;
  FI_CUDA_TRY(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  g_configured |= bit;
  return 0;
}

}  // namespace

FI_EXPORT int fi_attention_run(const fi::attn::Params* p, const VariantParams* vp, int32_t grid_x, int32_t grid_y,
                            void* stream) {
  FI_REQUIRE(p != nullptr && vp != nullptr && grid_x >= 1 && grid_y >= 1 && grid_y <= 65535);
  const int rc = configure();
  if (rc) return rc;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FI_CUDA_TRY(cudaStreamIsCapturing((cudaStream_t)stream, &capture));
  attention_kernel<<<dim3(grid_x, grid_y), dim3(Cfg::kLaunchThreads), Cfg::kSmemBytes, (cudaStream_t)stream>>>(*p, *vp);
  const int err = (int)cudaGetLastError();
  return err ? err : (capture == cudaStreamCaptureStatusActive ? -1 : 0);
}

#define FI_PARAMS_FIELD(name) out[i++] = (int64_t)offsetof(fi::attn::Params, name)

FI_EXPORT int fi_attention_layout(int64_t* out, int n) {
  int64_t tmp[64];
  int i = 0;
  if (out == nullptr || n < 64) out = tmp;
  out[i++] = Cfg::kLaunchThreads;
  out[i++] = Cfg::kSmemBytes;
  out[i++] = Cfg::kTile;
  out[i++] = Cfg::kPackedRows;
  out[i++] = Cfg::kHeadsPerChunk;
  out[i++] = Cfg::kRowsPerTile;
  out[i++] = (int64_t)sizeof(fi::attn::Params);
  out[i++] = (int64_t)sizeof(VariantParams);
  FI_PARAMS_FIELD(q);
  FI_PARAMS_FIELD(out);
  FI_PARAMS_FIELD(lse);
  FI_PARAMS_FIELD(k);
  FI_PARAMS_FIELD(num_kv_blocks);
  FI_PARAMS_FIELD(page_div);
  FI_PARAMS_FIELD(kv_block_start_int64);
  FI_PARAMS_FIELD(kv_indices);
  FI_PARAMS_FIELD(kv_pos_start);
  FI_PARAMS_FIELD(plan);
  FI_PARAMS_FIELD(items_offset);
  FI_PARAMS_FIELD(partial_o);
  FI_PARAMS_FIELD(error_flags);
  FI_PARAMS_FIELD(num_qo_heads);
  FI_PARAMS_FIELD(logits_scale);
  FI_PARAMS_FIELD(causal);
{{VARIANT_LAYOUT}}
  return i;
}

FI_EXPORT int fi_attention_occupancy(int* blocks_per_sm) {
  FI_REQUIRE(blocks_per_sm != nullptr);
  const int rc = configure();
  if (rc) return rc;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, attention_kernel, Cfg::kLaunchThreads,
                                                            Cfg::kSmemBytes);
}
