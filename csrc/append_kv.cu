// Paged KV-cache append: the engines' KV write path. Token t of key/value [num_tokens, heads, D] goes
// to slot s = slot_mapping[t] of the cache: block s / page_size, offset s % page_size. Template
// parameters (rendered by fi_backend/kernels, one module per pair):
//     KEY_DTYPE    __nv_bfloat16 or __half: key and value storage
//     CACHE_DTYPE  KEY_DTYPE (a copy) or __nv_fp8_e4m3 / __nv_fp8_e5m2: stored = satfinite(x / scale),
//                  rounded to nearest even, with a per-tensor scale for K and one for V
//
// Layouts (element strides; fi_backend/kv_cache.py parses the cache, fi_backend/ops.py the rest):
//   key, value  row t, head h at ptr + t * stride_token + h * stride_head; head_dim contiguous
//   k/v cache   block b, offset o, head h at ptr + b * stride_block + o * stride_token + h * stride_head
// Every row start is 16-byte aligned; D is a multiple of 8 (16 for fp8 caches: 16-byte fp8 rows) up to 512.
//
// Slots s < 0 are padding (vLLM pads with -1) and are skipped. Slots >= num_blocks * page_size are
// skipped too and recorded in the module's error word (per device and module, a __device__ global: no
// allocation, a fixed address inside CUDA graphs); fi_append_errors reads and clears it.
#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "common.h"

namespace {

using KeyT = {{KEY_DTYPE}};
using CacheT = {{CACHE_DTYPE}};

constexpr bool kCopy = std::is_same<CacheT, KeyT>::value;
static_assert(kCopy || sizeof(CacheT) == 1, "the cache stores the key dtype or an fp8 format");
constexpr int kThreads = 256;
constexpr int kUnroll = 4;           // items in flight per thread (loads issued before stores)
constexpr int kMaxTokensPerBlock = 64;
constexpr int kItemsPerThread = 8;   // target work per thread when tokens are plentiful
constexpr int kMaxHeadDim = 512;

// Error word: [0] flag bits, [1] tokens skipped, [2] largest offending slot, [3] the slot count of a
// cache that met one. Bit 1: a slot >= num_blocks * page_size.
__device__ unsigned long long g_errors[4];
constexpr unsigned long long kErrSlotRange = 1;

// One item = kElems consecutive elements of one (token, K or V, head), one 16-byte store: 16 bytes of
// input for a copy, 32 bytes of input -> 16 bytes for an fp8 cache.
constexpr int kElems = kCopy ? 8 : 16;
struct Item {
  static constexpr int kIn = kElems * (int)sizeof(KeyT) / 16;  // uint4 loads
  uint4 in[kIn];
};

// fp8 conversion (struct members, so copy modules, which never use them, do not warn).
struct Fp8 {
  static constexpr __nv_fp8_interpretation_t kKind =
      std::is_same<CacheT, __nv_fp8_e5m2>::value ? __NV_E5M2 : __NV_E4M3;

  static __device__ __forceinline__ float2 to_float2(uint32_t packed) {
    if constexpr (std::is_same<KeyT, __half>::value) {
      return __half22float2(*reinterpret_cast<const __half2*>(&packed));
    } else {
      return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
    }
  }

  // Four inputs (two packed pairs) -> four fp8 bytes, satfinite(x / scale) rounded to nearest even.
  // IEEE division, not the reciprocal, so the result matches the reference bit for bit.
  static __device__ __forceinline__ uint32_t x4(uint32_t lo, uint32_t hi, float scale) {
    const float2 a = to_float2(lo), b = to_float2(hi);
    const __nv_fp8x2_storage_t p = __nv_cvt_float2_to_fp8x2(
        make_float2(__fdiv_rn(a.x, scale), __fdiv_rn(a.y, scale)), __NV_SATFINITE, kKind);
    const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(
        make_float2(__fdiv_rn(b.x, scale), __fdiv_rn(b.y, scale)), __NV_SATFINITE, kKind);
    return (uint32_t)p | ((uint32_t)q << 16);
  }
};

__device__ __forceinline__ void store_item(CacheT* dst, const Item& it, float scale) {
  if constexpr (kCopy) {
    *reinterpret_cast<uint4*>(dst) = it.in[0];
  } else {
    uint4 out;
    out.x = Fp8::x4(it.in[0].x, it.in[0].y, scale);
    out.y = Fp8::x4(it.in[0].z, it.in[0].w, scale);
    out.z = Fp8::x4(it.in[1].x, it.in[1].y, scale);
    out.w = Fp8::x4(it.in[1].z, it.in[1].w, scale);
    *reinterpret_cast<uint4*>(dst) = out;
  }
}

struct Args {
  const KeyT* key;
  const KeyT* value;
  int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;
  CacheT* k_cache;
  CacheT* v_cache;
  int64_t stride_block, stride_token, stride_head;
  int64_t num_slots, page_size;
  const void* slot_mapping;
  int64_t slot_stride;
  int slot_int64;
  int64_t num_tokens;
  int heads, head_dim;
  const float* k_scale_ptr;  // read on the device when set (no host sync), else k_scale
  const float* v_scale_ptr;
  float k_scale, v_scale;
  int tokens_per_block;
};

// Block = tokens_per_block consecutive tokens. Their cache offsets are resolved once into shared
// memory; then the block's items (token-major, then K before V, head, vector) are spread over the
// threads so consecutive threads touch consecutive 16-byte vectors of a row.
__global__ void __launch_bounds__(kThreads) append_kernel(const Args a) {
  __shared__ int64_t dst_offset[kMaxTokensPerBlock];  // cache element offset of the token, -1: skip
  const int64_t tok0 = (int64_t)blockIdx.x * a.tokens_per_block;
  const int ntok = (int)min((int64_t)a.tokens_per_block, a.num_tokens - tok0);
  if ((int)threadIdx.x < ntok) {
    const int64_t t = tok0 + threadIdx.x;
    const int64_t s = a.slot_int64 ? static_cast<const int64_t*>(a.slot_mapping)[t * a.slot_stride]
                                   : (int64_t) static_cast<const int32_t*>(a.slot_mapping)[t * a.slot_stride];
    int64_t off = -1;
    if (s >= a.num_slots) {
      atomicOr(&g_errors[0], kErrSlotRange);
      atomicAdd(&g_errors[1], 1ull);
      atomicMax(&g_errors[2], (unsigned long long)s);
      g_errors[3] = (unsigned long long)a.num_slots;
    } else if (s >= 0) {
      const int64_t block = s / a.page_size;
      off = block * a.stride_block + (s - block * a.page_size) * a.stride_token;
    }
    dst_offset[threadIdx.x] = off;
  }
  __syncthreads();

  float k_scale = 1.f, v_scale = 1.f;
  if constexpr (!kCopy) {
    k_scale = a.k_scale_ptr ? *a.k_scale_ptr : a.k_scale;
    v_scale = a.v_scale_ptr ? *a.v_scale_ptr : a.v_scale;
  }
  const uint32_t vecs = (uint32_t)(a.head_dim / kElems);  // items per head
  const uint32_t half = (uint32_t)a.heads * vecs;         // items per token of K (and of V)
  const uint32_t total = (uint32_t)ntok * 2u * half;

  for (uint32_t base = threadIdx.x; base < total; base += kUnroll * kThreads) {
    Item item[kUnroll];
    CacheT* dst[kUnroll];
    bool is_v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint32_t i = base + (uint32_t)j * kThreads;
      dst[j] = nullptr;
      if (i >= total) continue;
      const uint32_t tok = i / (2u * half);
      uint32_t c = i - tok * 2u * half;
      is_v[j] = c >= half;
      if (is_v[j]) c -= half;
      const uint32_t head = c / vecs;
      const uint32_t col = (c - head * vecs) * kElems;
      const int64_t off = dst_offset[tok];
      if (off < 0) continue;
      const int64_t t = tok0 + tok;
      const KeyT* src = is_v[j] ? a.value + t * a.value_stride_token + head * a.value_stride_head + col
                                : a.key + t * a.key_stride_token + head * a.key_stride_head + col;
      dst[j] = (is_v[j] ? a.v_cache : a.k_cache) + off + head * a.stride_head + col;
#pragma unroll
      for (int k = 0; k < Item::kIn; ++k) item[j].in[k] = __ldg(reinterpret_cast<const uint4*>(src) + k);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (dst[j] != nullptr) store_item(dst[j], item[j], is_v[j] ? v_scale : k_scale);
    }
  }
}

int sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  static int cached[64] = {0};  // per device; attribute queries are cheap but not free
  if (device < 64 && cached[device]) return cached[device];
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (device < 64) cached[device] = sms;
  return sms;
}

}  // namespace

// key/value [num_tokens >= n, heads, head_dim] (only the first n rows are read), caches as above,
// slot_mapping [n] int32 (slot_int64 = 0) or int64 with element stride slot_stride. k_scale_ptr /
// v_scale_ptr: 1-element float32 device tensors, or null to use k_scale / v_scale (fp8 caches only).
FI_EXPORT int fi_append_paged_kv_cache(const void* key, const void* value, int64_t key_stride_token,
                                       int64_t key_stride_head, int64_t value_stride_token,
                                       int64_t value_stride_head, void* k_cache, void* v_cache,
                                       int64_t stride_block, int64_t stride_token, int64_t stride_head,
                                       int64_t num_blocks, int64_t page_size, const void* slot_mapping,
                                       int64_t slot_stride, int slot_int64, int64_t n, int64_t heads,
                                       int64_t head_dim, const float* k_scale_ptr, const float* v_scale_ptr,
                                       float k_scale, float v_scale, void* stream) {
  FI_REQUIRE(n >= 0 && heads >= 1 && page_size >= 1 && num_blocks >= 0);
  FI_REQUIRE(head_dim > 0 && head_dim % kElems == 0 && head_dim <= kMaxHeadDim);
  FI_REQUIRE(heads * head_dim < (1 << 26));  // item indices of a block fit 32 bits
  if (n == 0) return 0;
  Args a{(const KeyT*)key, (const KeyT*)value, key_stride_token, key_stride_head, value_stride_token,
         value_stride_head, (CacheT*)k_cache, (CacheT*)v_cache, stride_block, stride_token, stride_head,
         num_blocks * page_size, page_size, slot_mapping, slot_stride, slot_int64, n, (int)heads,
         (int)head_dim, k_scale_ptr, v_scale_ptr, k_scale, v_scale, 1};
  const int64_t items_per_token = 2 * heads * (head_dim / kElems);
  // Enough tokens per block to give each thread ~kItemsPerThread items, but no fewer than about two
  // blocks per SM while there are tokens for them (small decode batches).
  const int64_t by_work = std::max<int64_t>(1, (int64_t)kThreads * kItemsPerThread / items_per_token);
  const int64_t sms = std::max(1, sm_count());
  const int64_t by_spread = std::max<int64_t>(1, (n + 2 * sms - 1) / (2 * sms));
  a.tokens_per_block = (int)std::min<int64_t>(kMaxTokensPerBlock, std::min(by_work, by_spread));
  const int64_t blocks = (n + a.tokens_per_block - 1) / a.tokens_per_block;
  FI_REQUIRE(blocks <= 0x7fffffff);
  FI_LAUNCH(append_kernel, dim3((unsigned)blocks), dim3(kThreads), 0, stream, a);
}

// Copy the current device's error word of this module into out[0..3] (see g_errors) and, if clear,
// zero it. Synchronous: call after the appends it should cover have finished, never during capture.
FI_EXPORT int fi_append_errors(unsigned long long* out, int clear) {
  FI_CUDA_TRY(cudaMemcpyFromSymbol(out, g_errors, sizeof(g_errors)));
  if (clear && (out[0] | out[1])) {
    const unsigned long long zeros[4] = {0, 0, 0, 0};
    FI_CUDA_TRY(cudaMemcpyToSymbol(g_errors, zeros, sizeof(g_errors)));
  }
  return 0;
}
