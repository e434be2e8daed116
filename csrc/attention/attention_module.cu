// Attention module template (rendered by fi_backend/specs.py + variants.py + kernels): one kernel
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
//   fi_attention_kv_maps(const Params*) -> 1 when a launch would give the kernel KV TMA maps (tests)
#include <stddef.h>
#include <stdlib.h>
#include <strings.h>

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
    attention_kernel(const __grid_constant__ fi::attn::Params p, const __grid_constant__ VariantParams vp,
                     const __grid_constant__ fi::attn::KvTma tma) {
  extern __shared__ __align__(1024) uint8_t smem[];  // 1024: wgmma swizzle atoms
  Impl::run(p, vp, smem, tma);
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

// KV TMA maps (fi::attn::KvTma) for kernels whose producer copies whole tiles by TMA: K and V as
// [num_kv_blocks * page_size tokens, kv heads, D], which the cache is when a page's stride is page_size
// token strides (ragged KV, NHD pages, SGLang's buffers; not HND). Left unused (the loader gathers every
// tile with cp.async) where the cache has no such view, TMA cannot address it (bases or strides not
// 16-byte multiples, more than 2^31 tokens), the driver has no encoder, or FI_BACKEND_KV_TMA is set false.
// A host-only call a launch (no device work): graph capture bakes the maps in like the rest of Params.
typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encoder() {
  static EncodeTiled fn = [] {
    // On unless FI_BACKEND_KV_TMA is false (a switch for comparisons; docs/prefill.md has the figures).
    const char* env = getenv("FI_BACKEND_KV_TMA");
    if (env != nullptr && (!strcasecmp(env, "0") || !strcasecmp(env, "false") || !strcasecmp(env, "no") ||
                           !strcasecmp(env, "off")))  // fi_backend/env.py's false values
      return (EncodeTiled) nullptr;
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return (EncodeTiled) nullptr;
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

void encode_kv_maps(const fi::attn::Params& p, fi::attn::KvTma& tma) {
  tma.use = 0;
  if constexpr (Impl::kTmaKv) {
    const EncodeTiled encode = encoder();
    const int64_t units = p.num_qo_heads / Cfg::kHeadsPerChunk;
    const int64_t heads = p.num_head_chunks > 0 ? units / p.num_head_chunks : 0;
    const int64_t tokens = (int64_t)p.num_kv_blocks * p.page_size;
    constexpr int64_t kBytes = 2;  // 16-bit KV (the producer's condition)
    // At page size 1 a block is a token (3-D caches such as SGLang's report token stride 0).
    const int64_t token_stride = p.page_size == 1 ? p.kv_stride_block : p.kv_stride_token;
    if (encode == nullptr || heads < 1 || tokens < 1 || tokens > INT32_MAX ||
        p.kv_stride_block != (int64_t)p.page_size * token_stride || (p.kv_stride_head * kBytes) % 16 != 0 ||
        (token_stride * kBytes) % 16 != 0 || p.kv_stride_head <= 0 || token_stride <= 0 ||
        ((uintptr_t)p.k % 16) != 0 || ((uintptr_t)p.v % 16) != 0)
      return;
    const cuuint64_t dims[3] = {(cuuint64_t)Cfg::kHeadDim, (cuuint64_t)heads, (cuuint64_t)tokens};
    const cuuint64_t strides[2] = {(cuuint64_t)(p.kv_stride_head * kBytes), (cuuint64_t)(token_stride * kBytes)};
    const cuuint32_t box[3] = {64, 1, (cuuint32_t)Cfg::kTile};
    const cuuint32_t unit_strides[3] = {1, 1, 1};
    for (int i = 0; i < 2; ++i) {
      if (encode(i == 0 ? &tma.k : &tma.v, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(i == 0 ? p.k : p.v),
                 dims, strides, box, unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return;
    }
    tma.use = 1;
  }
}

// encode_kv_maps, remembered per thread by everything the maps are encoded from: an engine hands run() the
// same caches every step (vLLM: one a layer), and encoding two maps a run() costs host time. Direct-mapped by
// the K pointer; a collision re-encodes.
void kv_maps(const fi::attn::Params& p, fi::attn::KvTma& tma) {
  if constexpr (!Impl::kTmaKv) {
    tma.use = 0;
  } else {
    struct Entry {
      const void *k, *v;
      int64_t stride_block, stride_token, stride_head;
      int32_t num_kv_blocks, page_size, num_qo_heads, num_head_chunks;
      fi::attn::KvTma tma;
    };
    constexpr int kEntries = 64;
    thread_local Entry cache[kEntries] = {};
    const uint64_t h = ((uint64_t)(uintptr_t)p.k >> 8) * 0x9E3779B97F4A7C15ull;
    Entry& e = cache[h >> 58];  // 6 bits: kEntries
    static_assert(kEntries == 64, "the hash's top 6 bits index the cache");
    if (e.k != p.k || e.v != p.v || e.stride_block != p.kv_stride_block || e.stride_token != p.kv_stride_token ||
        e.stride_head != p.kv_stride_head || e.num_kv_blocks != p.num_kv_blocks || e.page_size != p.page_size ||
        e.num_qo_heads != p.num_qo_heads || e.num_head_chunks != p.num_head_chunks) {
      encode_kv_maps(p, e.tma);
      e.k = p.k, e.v = p.v, e.stride_block = p.kv_stride_block, e.stride_token = p.kv_stride_token;
      e.stride_head = p.kv_stride_head, e.num_kv_blocks = p.num_kv_blocks, e.page_size = p.page_size;
      e.num_qo_heads = p.num_qo_heads, e.num_head_chunks = p.num_head_chunks;
    }
    tma = e.tma;
  }
}

}  // namespace

FI_EXPORT int fi_attention_run(const fi::attn::Params* p, const VariantParams* vp, int32_t grid_x, int32_t grid_y,
                            void* stream) {
  FI_REQUIRE(p != nullptr && vp != nullptr && grid_x >= 1 && grid_y >= 1 && grid_y <= 65535);
  const int rc = configure();
  if (rc) return rc;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FI_CUDA_TRY(cudaStreamIsCapturing((cudaStream_t)stream, &capture));
  fi::attn::KvTma tma;
  kv_maps(*p, tma);
  attention_kernel<<<dim3(grid_x, grid_y), dim3(Cfg::kLaunchThreads), Cfg::kSmemBytes, (cudaStream_t)stream>>>(*p, *vp,
                                                                                                               tma);
  const int err = (int)cudaGetLastError();
  return err ? err : (capture == cudaStreamCaptureStatusActive ? -1 : 0);
}

// 1 when a launch with these parameters gives the kernel KV TMA maps, else 0 (tests; host only; the launch's
// own path, cache included).
FI_EXPORT int fi_attention_kv_maps(const fi::attn::Params* p) {
  if (p == nullptr) return 0;
  fi::attn::KvTma tma;
  kv_maps(*p, tma);
  return tma.use;
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
  FI_PARAMS_FIELD(deterministic);
{{VARIANT_LAYOUT}}
  return i;
}

#ifdef FI_TIMELINE
// perf/tools/timeline.py: the last launch's stamps (csrc/attention/timeline.cuh), and clearing them before one.
FI_EXPORT int fi_timeline_read(void* dst, int64_t bytes) {
  FI_REQUIRE(dst != nullptr && bytes >= 0 && bytes <= (int64_t)sizeof(fi::timeline::events));
  return (int)cudaMemcpyFromSymbol(dst, fi::timeline::events, (size_t)bytes);
}
FI_EXPORT int fi_timeline_clear() {
  void* at = nullptr;
  const int rc = (int)cudaGetSymbolAddress(&at, fi::timeline::events);
  return rc ? rc : (int)cudaMemset(at, 0, sizeof(fi::timeline::events));
}
FI_EXPORT int64_t fi_timeline_shape(int64_t* out) {  // CTAs, events a writer
  out[0] = FI_TIMELINE_CTAS;
  out[1] = FI_TIMELINE_EVENTS;
  return 2;
}
#endif

FI_EXPORT int fi_attention_occupancy(int* blocks_per_sm) {
  FI_REQUIRE(blocks_per_sm != nullptr);
  const int rc = configure();
  if (rc) return rc;
  return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, attention_kernel, Cfg::kLaunchThreads,
                                                            Cfg::kSmemBytes);
}
