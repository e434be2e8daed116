// Persistent decode attention over the BSR KV format, driven by the plan (csrc/plan.h).
//
// Grid (num_ctas, num_kv_heads * num_head_chunks), fixed: CTA (c, y) runs work queue c of the plan for
// KV head y / num_head_chunks and the kHeadsPerChunk query heads of chunk y % num_head_chunks that
// share it (head-group fusion: each KV byte is loaded once for all of them).
//
// Tiles. A work item's query rows are packed with their heads into kRows "packed rows" (row-major:
// packed row = local row * kHeadsPerChunk + local head); items with more rows run as several row
// sub-tiles. The CTA streams KV in tiles of kTile = 16 * kSub * kWarps tokens; warp w owns tokens
// [16 kSub w, 16 kSub (w + 1)) of every tile (kSub blocks of 16) and keeps its own online-softmax
// state, merged across warps at the end of a (sub-)item through shared memory.
//
// Tensor cores (mma.sync m16n8k16, fp32 accumulators), swapped where that saves registers:
//   S   [packed rows x 16 tokens] = Q [rows x D] . K^T     A = Q (registers), B = K (ldmatrix)
//   O^T [D x packed rows]        += V^T [D x 16] . P^T      A = V (ldmatrix.trans), B = P (from S)
// The C fragment of S is exactly the B fragment of P^T, so P never leaves registers, and O^T holds
// only useful rows (n = 8 per mma). fp8 KV is converted to fp16 in registers (exact); the k dimension
// of Q.K^T is permuted to match the fp8 ldmatrix layout, and the m dimension of O^T likewise.
//
// Loader. All threads gather a tile's K and V rows through the BSR indices (page = kv_indices
// [block_start + pos / Bc], slot = pos % Bc) into a kStages-deep ring of shared-memory stages with
// 16-byte cp.async; page ids of the next tile are prefetched into registers while the current one is
// issued. The loader walks the CTA's whole item list, so the next item's first tiles (and its query
// tile, into the stage's Q slot) are in flight while the current item finishes. Each stage carries a
// record (which item, which tokens, first/last tile) that the compute side reads: compute never
// touches the plan itself.
//
// Splits. An item with partial_base >= 0 writes partial states (float32 O, natural-log LSE) to the
// workspace; the CTA that completes the last chunk of a row (per-row arrival counters, reset by that
// CTA, so the kernel leaves them zeroed for the next launch and CUDA-graph replay) merges the row's
// partial states into the output. No second launch.
//
// Bounds. KV indices outside [0, num_kv_blocks) and kv_indices offsets outside the array are never
// dereferenced: the tokens read as zeros and a bit is set in error_flags (ErrorBits).
//
// Performance (H100, 32/8 heads, D 128, bf16, page 16; the shape table is _SHAPES in
// fi_backend/wrappers.py). Decode is bound by bytes in flight: what mattered in the measurements
// was ~8 warps per SM (the per-warp latency of a 16-token step is what overlaps the loads) and two
// ~64 KiB tiles in flight per SM. 8 warps x 3 stages (one CTA per SM) reads at 98-102% of a device
// copy's rate for batch >= 16 with KV >= 16k; 2-warp CTAs, or one 4-warp CTA per SM, fall to 35-75%.
// The L2 prefetch size of the copies made no measurable difference; prefetching kv_indices lines into
// L2 four tiles ahead is worth ~10 points of copy rate for fp8 KV (short tiles: without it the next
// tile's page-id loads miss to DRAM on the issue path) and is neutral for bf16.
#pragma once

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "../plan.h"
#include "ptx.cuh"
#include "variant.cuh"

namespace fi {
namespace decode {

enum ErrorBits : int32_t {
  kErrPageOutOfRange = 1,   // a kv_indices entry outside [0, num_kv_blocks)
  kErrIndexOutOfRange = 2,  // kv_block_start + block beyond kv_indices
};

// L2 prefetch size of the KV copies and how many tiles ahead kv_indices lines are prefetched into
// L2 (the page ids of the next tile are then L2 hits). Overridable with -D for tuning runs.
#ifndef FI_DECODE_L2_PREFETCH
#define FI_DECODE_L2_PREFETCH 128
#endif
#ifndef FI_DECODE_INDEX_AHEAD
#define FI_DECODE_INDEX_AHEAD 4
#endif

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <class T>
struct KvType;
template <>
struct KvType<__nv_bfloat16> {
  static constexpr int kBytes = 2;
  static constexpr bool kFp8 = false, kE5m2 = false, kMmaBf16 = true;
};
template <>
struct KvType<__half> {
  static constexpr int kBytes = 2;
  static constexpr bool kFp8 = false, kE5m2 = false, kMmaBf16 = false;
};
template <>
struct KvType<__nv_fp8_e4m3> {
  static constexpr int kBytes = 1;
  static constexpr bool kFp8 = true, kE5m2 = false, kMmaBf16 = false;
};
template <>
struct KvType<__nv_fp8_e5m2> {
  static constexpr int kBytes = 1;
  static constexpr bool kFp8 = true, kE5m2 = true, kMmaBf16 = false;
};

// Everything a launch reads; filled by the launcher from the wrapper's argument block.
struct Params {
  // Query [rows, num_qo_heads, D] (D contiguous) and output of the same shape, storage type DQ.
  const void* q;
  int64_t q_stride_row, q_stride_head;
  void* out;
  int64_t out_stride_row, out_stride_head;
  float* lse;  // [rows, num_qo_heads] natural log, or null
  int64_t lse_stride_row;
  // KV cache: element (block, slot, head, d) at base + block * stride_block + slot * stride_token +
  // head * stride_head + d (elements), the same strides for k and v.
  const void* k;
  const void* v;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  int32_t num_kv_blocks;
  int32_t page_size;
  ptx::FastDiv page_div;
  int32_t kv_block_start_int64;  // kv_block_start is int64 (else int32)
  // BSR (fi_backend.formats.BSR)
  const int32_t* kv_indices;
  int64_t num_kv_indices;
  const void* kv_block_start;
  const int32_t* kv_lens;
  const int32_t* qo_indptr;
  const int32_t* kv_pos_start;  // or null: positions start at 0
  // Plan section and workspace
  const int32_t* plan;
  int32_t items_offset;         // fi_plan_items_offset(num_ctas), int32 units
  int32_t merge_indptr_offset;  // fi_plan_merge_indptr_offset(num_ctas, max_items)
  float* partial_o;             // [max_partial_rows, num_qo_heads, D]
  float* partial_lse;           // [max_partial_rows, num_qo_heads]
  int32_t* merge_counters;      // [max_rows * gridDim.y], zero between launches
  int32_t* error_flags;         // ErrorBits, or null
  int32_t num_qo_heads;
  int32_t num_head_chunks;      // gridDim.y / num_kv_heads
  float logits_scale;           // sm_scale * k_scale
  float v_scale;
  int32_t causal;
};

// One (sub-)item as both sides of the CTA see it.
struct Work {
  int32_t request;
  int32_t row0;          // first query row of this sub-tile
  int32_t nrows;         // query rows in it (<= kRowsPerTile)
  int32_t q_idx0;        // row0 - qo_indptr[request]
  int32_t q_len, kv_len;
  int32_t pos_off;       // logical position of KV token 0
  int32_t kv_lo, kv_hi;  // KV tokens to read, [kv_lo, kv_hi) (after clipping)
  int32_t ntiles;
  int32_t partial_base, partial_stride, item_q_begin;
  int32_t pad_;
  int64_t block_start;   // offset of the request's first KV block in kv_indices
};

enum RecordFlags : int32_t { kFirst = 1, kLast = 2, kEnd = 4 };

struct alignas(16) TileRecord {
  Work w;
  int32_t tile_kv_begin;  // KV token index of the tile's row 0
  int32_t n_valid;        // rows of the tile that hold KV tokens of the item (<= 0: none)
  int32_t flags;
  int32_t pad_;
};

template <int kHeadDim_, int kRows_, int kHeadsPerChunk_, class DQ_, class DKV_, int kWarps_, int kStages_,
          int kSub_ = 1>
struct Config {
  using DQ = DQ_;
  using DKV = DKV_;
  using KV = KvType<DKV>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = kRows_;  // packed rows per tile: 8 or 16
  static constexpr int kHeadsPerChunk = kHeadsPerChunk_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSub = kSub_;  // 16-token blocks per warp per tile
  static constexpr int kTile = 16 * kSub * kWarps;
  static constexpr bool kFp8 = KV::kFp8;
  static constexpr bool kMmaBf16 = KV::kMmaBf16;
  static constexpr bool kQBf16 = sizeof(DQ) == 2 && !std::is_same<DQ, __half>::value;
  static constexpr int kRowBytes = kHeadDim * KV::kBytes;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kRowsPerRound = kThreads / kChunksPerRow;  // tile rows one load round covers
  static constexpr int kTokensPerThread = kTile / kRowsPerRound;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kMTiles = kHeadDim / 16;
  static constexpr int kRowsPerTile = kRows / kHeadsPerChunk;
  static constexpr int kPackedRows = kRowsPerTile * kHeadsPerChunk;
  static constexpr int kKvTileBytes = kTile * kRowBytes;
  static constexpr int kQSlotBytes = kRows * kHeadDim * 2;
  static constexpr int kStageBytes = (2 * kKvTileBytes + kQSlotBytes + (int)sizeof(TileRecord) + 127) / 128 * 128;
  // Cross-warp merge scratch [warp][row][D / kPasses] float lives in the stage just consumed.
  static constexpr int kScratchBytesFull = kWarps * kRows * kHeadDim * 4;
  static constexpr int kPasses = kScratchBytesFull <= 2 * kKvTileBytes ? 1 : (kScratchBytesFull <= 4 * kKvTileBytes ? 2 : 4);
  static constexpr int kPassDim = kHeadDim / kPasses;
  static constexpr int kMdBytes = kWarps * kRows * 8;
  static constexpr int kSmemBytes = kStages * kStageBytes + kMdBytes + 16;

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim must be 64, 128 or 256");
  static_assert(kRows == 8 || kRows == 16, "packed rows per tile must be 8 or 16");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");
  static_assert(kHeadsPerChunk >= 1 && kHeadsPerChunk <= kRows, "heads per chunk must fit in a tile");
  static_assert(kThreads % kChunksPerRow == 0 && kTile % kRowsPerRound == 0, "loader shape");
  static_assert(kChunksPerRow >= 4, "rows of at least 64 bytes");
  static_assert(kMTiles % (kFp8 ? 2 * kPasses : kPasses) == 0 && kPassDim >= 32, "merge passes");
  static_assert(kKSteps % 2 == 0, "k steps come in pairs");
};

// 16-byte chunk `chunk` of tile row `row`, XOR-swizzled so that ldmatrix's 8 rows hit 8 distinct
// bank groups (rows of 64 bytes pair up two rows per 128-byte line).
template <int kChunksPerRow>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  if constexpr (kChunksPerRow >= 8) {
    return chunk ^ (row & 7);
  } else {
    return chunk ^ ((row >> 1) & 3);
  }
}

// Dimension of element e of register j (of a k step / m tile) held by lane group c (k layout of Q.K^T).
template <bool kFp8>
__device__ __forceinline__ int k_dim(int step, int j, int e, int c) {
  return kFp8 ? 16 * step + 4 * c + 2 * j + e : 16 * step + 2 * c + 8 * j + e;
}
// Dimension of O^T row half `half` (0: c0/c1, 1: c2/c3) of m tile mt held by lane g.
template <bool kFp8>
__device__ __forceinline__ int o_dim(int mt, int half, int g) {
  return kFp8 ? 16 * mt + 2 * g + half : 16 * mt + g + 8 * half;
}

__device__ __forceinline__ void report(int32_t* flags, int32_t bit) {
  if (flags != nullptr) atomicOr(flags, bit);
}

template <class Cfg, class Variant, class VariantParams>
struct Kernel {
  using DQ = typename Cfg::DQ;
  using DKV = typename Cfg::DKV;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kTile = Cfg::kTile;
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kRows = Cfg::kRows;
  static constexpr int kHeadDim = Cfg::kHeadDim;
  static constexpr int kHPC = Cfg::kHeadsPerChunk;
  static constexpr int kRowsPerTile = Cfg::kRowsPerTile;
  static constexpr int kKSteps = Cfg::kKSteps;
  static constexpr int kMTiles = Cfg::kMTiles;
  static constexpr int kTPT = Cfg::kTokensPerThread;
  static constexpr bool kFp8 = Cfg::kFp8;
  static constexpr bool kBf16 = Cfg::kMmaBf16;
  static constexpr bool kTwoN = kRows == 16;  // second n tile of packed rows in P.V

  // ------------------------------------------------------------------ plan reading (loader side)

  // Fill w for row sub-tile `sub` of plan item `item`; returns the item's number of sub-tiles.
  static __device__ __forceinline__ int begin_work(const Params& p, const VariantParams& vp, int item, int sub,
                                                   Work& w) {
    const int4* raw = reinterpret_cast<const int4*>(p.plan + p.items_offset) + 2 * item;
    const int4 a = __ldg(raw), b = __ldg(raw + 1);
    // FiWorkItem: request, q_begin, q_end, kv_begin | kv_end, partial_base, partial_stride, chunk
    const int req = a.x, q_begin = a.y, q_end = a.z, kv_begin = a.w, kv_end = b.x;
    const int nsub = (q_end - q_begin + kRowsPerTile - 1) / kRowsPerTile;
    if (nsub <= 0) return 0;
    w.request = req;
    w.kv_len = __ldg(p.kv_lens + req);
    const int qs = __ldg(p.qo_indptr + req);
    w.q_len = __ldg(p.qo_indptr + req + 1) - qs;
    w.pos_off = p.kv_pos_start != nullptr ? __ldg(p.kv_pos_start + req) : 0;
    w.block_start = p.kv_block_start_int64 ? __ldg(static_cast<const int64_t*>(p.kv_block_start) + req)
                                           : (int64_t)__ldg(static_cast<const int32_t*>(p.kv_block_start) + req);
    w.item_q_begin = q_begin;
    w.partial_base = b.y;
    w.partial_stride = b.z;
    w.row0 = q_begin + sub * kRowsPerTile;
    w.nrows = min(kRowsPerTile, q_end - w.row0);
    w.q_idx0 = w.row0 - qs;
    int lo = max(kv_begin, 0), hi = min(kv_end, w.kv_len);
    const int q_pos_min = w.pos_off + w.kv_len - w.q_len + w.q_idx0;  // row0's position
    const int q_pos_max = q_pos_min + w.nrows - 1;
    if (p.causal) hi = min(hi, q_pos_max - w.pos_off + 1);
    if constexpr (Variant::kHasKvRange) {
      int plo = w.pos_off + lo, phi = w.pos_off + hi;
      Variant::kv_range(vp, q_pos_min, q_pos_max, plo, phi);
      lo = max(lo, plo - w.pos_off);
      hi = min(hi, phi - w.pos_off);
    }
    if (hi < lo) hi = lo;
    w.kv_lo = lo;
    w.kv_hi = hi;
    w.ntiles = max(1, (hi - lo + kTile - 1) / kTile);
    w.pad_ = 0;
    return nsub;
  }

  struct Cursor {
    int item, item_end, sub, nsub, tile;
    bool done;
    Work w;
  };

  static __device__ __forceinline__ void seek_item(const Params& p, const VariantParams& vp, Cursor& cur) {
    while (cur.item < cur.item_end) {
      cur.nsub = begin_work(p, vp, cur.item, 0, cur.w);
      if (cur.nsub > 0) break;
      ++cur.item;
    }
    cur.sub = 0;
    cur.tile = 0;
    cur.done = cur.item >= cur.item_end;
  }

  static __device__ __forceinline__ void advance(const Params& p, const VariantParams& vp, Cursor& cur) {
    if (cur.done) return;
    if (++cur.tile < cur.w.ntiles) return;
    cur.tile = 0;
    if (++cur.sub < cur.nsub) {
      begin_work(p, vp, cur.item, cur.sub, cur.w);
      return;
    }
    ++cur.item;
    seek_item(p, vp, cur);
  }

  // Page ids of this thread's rows of the cursor's tile: page[r] (INT_MIN: index outside kv_indices)
  // and slot[r] (< 0: not a KV token of the item; nothing is loaded).
  static __device__ __forceinline__ void prefetch_pages(const Params& p, const Cursor& cur, int (&page)[kTPT],
                                                        int (&slot)[kTPT]) {
    const int row_base = threadIdx.x / Cfg::kChunksPerRow;
    const int tile_begin = cur.w.kv_lo + cur.tile * kTile;
    const int n_valid = cur.done ? 0 : cur.w.kv_hi - tile_begin;
#pragma unroll
    for (int r = 0; r < kTPT; ++r) {
      const int row = row_base + r * Cfg::kRowsPerRound;
      page[r] = -1;
      slot[r] = -1;
      if (row < n_valid) {
        int blk, s;
        ptx::divmod(p.page_div, tile_begin + row, blk, s);
        const int64_t idx = cur.w.block_start + blk;
        slot[r] = s;
        page[r] = (idx >= 0 && idx < p.num_kv_indices) ? __ldg(p.kv_indices + idx) : INT32_MIN;
      }
    }
    // kv_indices of a tile FI_DECODE_INDEX_AHEAD tiles on: into L2 now, so that its page-id loads
    // (one tile ahead of its copies) do not wait on DRAM. 32 ids per 128-byte line.
    if constexpr (FI_DECODE_INDEX_AHEAD > 0) {
      const int ahead_begin = tile_begin + FI_DECODE_INDEX_AHEAD * kTile;
      if (!cur.done && threadIdx.x < 8 && ahead_begin < cur.w.kv_hi) {
        int b0, b1, s0;
        ptx::divmod(p.page_div, ahead_begin, b0, s0);
        ptx::divmod(p.page_div, min(ahead_begin + kTile, cur.w.kv_hi) - 1, b1, s0);
        const int64_t first = (cur.w.block_start + b0) & ~int64_t(31);
        const int64_t line = first + 32 * threadIdx.x;
        if (line <= cur.w.block_start + b1 && line < p.num_kv_indices) ptx::prefetch_l2(p.kv_indices + line);
      }
    }
  }

  // Issue the cursor's tile into stage `st`: record, Q slot (first tile of a sub-item), K and V rows.
  static __device__ __forceinline__ void issue(const Params& p, uint8_t* stage, const Cursor& cur,
                                               const int (&page)[kTPT], const int (&slot)[kTPT], int kv_head) {
    const int tid = threadIdx.x;
    TileRecord* rec = reinterpret_cast<TileRecord*>(stage + 2 * Cfg::kKvTileBytes + Cfg::kQSlotBytes);
    if (cur.done) {
      if (tid == 0) rec->flags = kEnd;
      return;
    }
    const int tile_begin = cur.w.kv_lo + cur.tile * kTile;
    if (tid == 0) {
      rec->w = cur.w;
      rec->tile_kv_begin = tile_begin;
      rec->n_valid = cur.w.kv_hi - tile_begin;
      rec->flags = (cur.tile == 0 ? kFirst : 0) | (cur.tile == cur.w.ntiles - 1 ? kLast : 0);
    }
    if (cur.tile == 0) {  // query tile: packed row pr = local row * kHPC + local head, zeros past nrows
      constexpr int kChunksQ = kHeadDim * 2 / 16;
      const uint32_t qslot = ptx::smem_u32(stage + 2 * Cfg::kKvTileBytes);
      const int head0 = blockIdx.y * kHPC;
#pragma unroll
      for (int i = tid; i < kRows * kChunksQ; i += kThreads) {
        const int pr = i / kChunksQ, ch = i % kChunksQ;
        const int r = pr / kHPC, h = pr % kHPC;
        const bool ok = pr < Cfg::kPackedRows && r < cur.w.nrows;
        const DQ* src = static_cast<const DQ*>(p.q) + (ok ? (int64_t)(cur.w.row0 + r) * p.q_stride_row +
                                                              (int64_t)(head0 + h) * p.q_stride_head + ch * 8
                                                        : 0);
        ptx::cp_async_16(qslot + i * 16, src, ok);
      }
    }
    const uint32_t ks = ptx::smem_u32(stage), vs = ks + Cfg::kKvTileBytes;
    const int row_base = tid / Cfg::kChunksPerRow, chunk = tid % Cfg::kChunksPerRow;
    const char* kbase = static_cast<const char*>(p.k);
    const char* vbase = static_cast<const char*>(p.v);
    const int64_t head_off = (int64_t)kv_head * p.kv_stride_head;
#pragma unroll
    for (int r = 0; r < kTPT; ++r) {
      const int row = row_base + r * Cfg::kRowsPerRound;
      bool ok = slot[r] >= 0;
      if (ok && (page[r] < 0 || page[r] >= p.num_kv_blocks)) {
        report(p.error_flags, page[r] == INT32_MIN ? kErrIndexOutOfRange : kErrPageOutOfRange);
        ok = false;
      }
      const int64_t off = ok ? ((int64_t)page[r] * p.kv_stride_block + (int64_t)slot[r] * p.kv_stride_token +
                                head_off) * Cfg::KV::kBytes + chunk * 16
                             : 0;
      const uint32_t dst = row * Cfg::kRowBytes + swizzle<Cfg::kChunksPerRow>(row, chunk) * 16;
      ptx::cp_async_16<FI_DECODE_L2_PREFETCH>(ks + dst, kbase + off, ok);
      ptx::cp_async_16<FI_DECODE_L2_PREFETCH>(vs + dst, vbase + off, ok);
    }
  }

  // ------------------------------------------------------------------ compute side

  struct RowInfo {  // the packed rows this lane holds in S (g and g + 8)
    int q_row, q_idx, q_pos, qo_head, climit;
    bool valid;  // a real query row of the sub-item (padding rows never reach a variant hook)
  };

  static __device__ __forceinline__ RowInfo row_info(const Params& p, const Work& w, int pr) {
    RowInfo ri;
    const int r = pr / kHPC;
    ri.q_row = w.row0 + r;
    ri.q_idx = w.q_idx0 + r;
    ri.q_pos = w.pos_off + w.kv_len - w.q_len + ri.q_idx;
    ri.qo_head = blockIdx.y * kHPC + pr % kHPC;
    ri.climit = w.kv_len - w.q_len + ri.q_idx;  // causal: kv_idx <= climit
    ri.valid = pr < Cfg::kPackedRows && r < w.nrows;
    return ri;
  }

  // Q fragments of the sub-item from the stage's Q slot, QueryTransform applied in fp32.
  static __device__ __forceinline__ void load_q(const VariantParams& vp, const uint8_t* stage, const Work& w,
                                                const RowInfo (&ri)[2], uint32_t (&qa)[kKSteps][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const DQ* qs = reinterpret_cast<const DQ*>(stage + 2 * Cfg::kKvTileBytes);
    constexpr int kHalves = kTwoN ? 2 : 1;
#pragma unroll
    for (int hf = 0; hf < kHalves; ++hf) {
      const int pr = g + 8 * hf;
      float x[kKSteps][2][2];
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t u = *reinterpret_cast<const uint32_t*>(qs + pr * kHeadDim + k_dim<kFp8>(s, j, 0, c));
          const float2 f = ptx::unpack2<Cfg::kQBf16>(u);
          x[s][j][0] = f.x;
          x[s][j][1] = f.y;
        }
      if constexpr (Variant::kHasQueryTransform) {
        const RotaryCtx ctx{ri[hf].q_pos, ri[hf].qo_head, w.request};
        rotate_pairs(vp, x, ctx, c, /*is_key=*/false);
      }
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float lo = x[s][j][0], hi = x[s][j][1];
          if (!kBf16 && Cfg::kQBf16) {  // bf16 query into fp16 MMAs (fp8 KV): saturate, do not overflow
            lo = fminf(fmaxf(lo, -65504.f), 65504.f);
            hi = fminf(fmaxf(hi, -65504.f), 65504.f);
          }
          qa[s][2 * j + hf] = ptx::pack2<kBf16>(lo, hi);  // a0/a2: rows g, a1/a3: rows g + 8
        }
    }
    if constexpr (!kTwoN) {
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) qa[s][1] = qa[s][3] = 0u;
    }
  }

  // Query/KeyTransform over the pairs one lane holds: (d, d + D/2) sit in k steps s and s + kKSteps/2
  // at the same slot; interleaved pairs (2i, 2i + 1) are the two halves of one register.
  static __device__ __forceinline__ void rotate_pairs(const VariantParams& vp, float (&x)[kKSteps][2][2],
                                                      const RotaryCtx& ctx, int c, bool is_key) {
    if constexpr (Variant::kRotaryInterleave) {
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int i = k_dim<kFp8>(s, j, 0, c) / 2;
          if (is_key)
            Variant::key_transform(vp, x[s][j][0], x[s][j][1], i, ctx);
          else
            Variant::query_transform(vp, x[s][j][0], x[s][j][1], i, ctx);
        }
    } else {
#pragma unroll
      for (int s = 0; s < kKSteps / 2; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = k_dim<kFp8>(s, j, e, c);
            if (is_key)
              Variant::key_transform(vp, x[s][j][e], x[s + kKSteps / 2][j][e], i, ctx);
            else
              Variant::query_transform(vp, x[s][j][e], x[s + kKSteps / 2][j][e], i, ctx);
          }
    }
  }

  // K fragments (B of Q.K^T) of n tile nt (8 tokens) of this warp, all k steps.
  static __device__ __forceinline__ void load_k(uint32_t ks, int tb, int nt, uint32_t (&kb)[kKSteps][2]) {
    const int lane = threadIdx.x & 31;
    const int row = tb + 8 * nt + (lane & 7);
    const uint32_t row_addr = ks + row * Cfg::kRowBytes;
    if constexpr (!kFp8) {
#pragma unroll
      for (int kp = 0; kp < kKSteps / 2; ++kp) {
        uint32_t r[4];
        ptx::ldmatrix_x4(r, row_addr + swizzle<Cfg::kChunksPerRow>(row, 4 * kp + (lane >> 3)) * 16);
        kb[2 * kp][0] = r[0];
        kb[2 * kp][1] = r[1];
        kb[2 * kp + 1][0] = r[2];
        kb[2 * kp + 1][1] = r[3];
      }
    } else {
#pragma unroll
      for (int kq = 0; kq < kKSteps / 4; ++kq) {
        uint32_t r[4];
        ptx::ldmatrix_x4(r, row_addr + swizzle<Cfg::kChunksPerRow>(row, 4 * kq + (lane >> 3)) * 16);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          kb[4 * kq + i][0] = ptx::fp8x2_to_f16x2<Cfg::KV::kE5m2>(r[i]);
          kb[4 * kq + i][1] = ptx::fp8x2_to_f16x2<Cfg::KV::kE5m2>(r[i] >> 16);
        }
      }
    }
  }

  // V^T fragments (A of P.V) of m tile mt (16-bit KV) or m tiles 2*mp, 2*mp + 1 (fp8).
  static __device__ __forceinline__ void load_v16(uint32_t vs, int tb, int mt, uint32_t (&a)[4]) {
    const int lane = threadIdx.x & 31;
    const int row = tb + ((lane >> 4) << 3) + (lane & 7);
    ptx::ldmatrix_x4_trans(a, vs + row * Cfg::kRowBytes +
                                  swizzle<Cfg::kChunksPerRow>(row, 2 * mt + ((lane >> 3) & 1)) * 16);
  }
  static __device__ __forceinline__ void load_v8(uint32_t vs, int tb, int mp, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
    const int lane = threadIdx.x & 31;
    const int row = tb + (((lane >> 3) & 1) << 3) + (lane & 7);
    uint32_t r[4];
    ptx::ldmatrix_x4_trans(r, vs + row * Cfg::kRowBytes + swizzle<Cfg::kChunksPerRow>(row, 2 * mp + (lane >> 4)) * 16);
    // r = [(tok 2c: d 2g, 2g+1), (tok 2c+1: d 2g, 2g+1)] bytes; a pair of tokens per dim -> prmt
    const uint32_t x0 = __byte_perm(r[0], 0, 0x3120), x1 = __byte_perm(r[1], 0, 0x3120);
    const uint32_t x2 = __byte_perm(r[2], 0, 0x3120), x3 = __byte_perm(r[3], 0, 0x3120);
    constexpr bool kE5m2 = Cfg::KV::kE5m2;
    a0[0] = ptx::fp8x2_to_f16x2<kE5m2>(x0);
    a0[1] = ptx::fp8x2_to_f16x2<kE5m2>(x0 >> 16);
    a0[2] = ptx::fp8x2_to_f16x2<kE5m2>(x1);
    a0[3] = ptx::fp8x2_to_f16x2<kE5m2>(x1 >> 16);
    a1[0] = ptx::fp8x2_to_f16x2<kE5m2>(x2);
    a1[1] = ptx::fp8x2_to_f16x2<kE5m2>(x2 >> 16);
    a1[2] = ptx::fp8x2_to_f16x2<kE5m2>(x3);
    a1[3] = ptx::fp8x2_to_f16x2<kE5m2>(x3 >> 16);
  }

  // ------------------------------------------------------------------ epilogue

  // Final O (8 consecutive dims of one packed row) -> output or partial rows.
  static __device__ __forceinline__ void store_out(const Params& p, const VariantParams& vp, int q_row, int qo_head,
                                                   int d0, const float (&o)[8]) {
    DQ* dst = static_cast<DQ*>(p.out) + (int64_t)q_row * p.out_stride_row + (int64_t)qo_head * p.out_stride_head + d0;
    uint32_t packed[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float lo = o[2 * i], hi = o[2 * i + 1];
      if constexpr (Variant::kHasOutputTransform) {
        lo = Variant::output_transform(vp, lo, OutputCtx{q_row, qo_head, d0 + 2 * i});
        hi = Variant::output_transform(vp, hi, OutputCtx{q_row, qo_head, d0 + 2 * i + 1});
      }
      packed[i] = ptx::pack2<Cfg::kQBf16>(lo, hi);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }

  // Merge the partial states of `q_row` (all chunks written, fences done) for this CTA's heads.
  static __device__ __forceinline__ void merge_row(const Params& p, const VariantParams& vp, int q_row) {
    const int32_t* mi = p.plan + p.merge_indptr_offset;
    const int j0 = __ldcg(mi + q_row), j1 = __ldcg(mi + q_row + 1);
    constexpr int kVecs = kHeadDim / 8;
    for (int i = threadIdx.x; i < kHPC * kVecs; i += kThreads) {
      const int h = i / kVecs, d0 = (i % kVecs) * 8;
      const int qo_head = blockIdx.y * kHPC + h;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float mx = -INFINITY;
      // Unrolled so that several partial states' loads are in flight (this runs on the kernel's tail).
      if constexpr (Variant::kUseSoftmax) {
#pragma unroll 4
        for (int j = j0; j < j1; ++j) mx = fmaxf(mx, __ldcg(p.partial_lse + (int64_t)j * p.num_qo_heads + qo_head));
      }
      float den = 0.f;
#pragma unroll 4
      for (int j = j0; j < j1; ++j) {
        float wgt = 1.f;
        if constexpr (Variant::kUseSoftmax) {
          const float l = __ldcg(p.partial_lse + (int64_t)j * p.num_qo_heads + qo_head);
          wgt = l == -INFINITY ? 0.f : __expf(l - mx);
          den += wgt;
          if (wgt == 0.f) continue;  // empty state: its O is never read
        }
        const float4* src = reinterpret_cast<const float4*>(
            p.partial_o + ((int64_t)j * p.num_qo_heads + qo_head) * kHeadDim + d0);
        const float4 u = __ldcg(src), v = __ldcg(src + 1);
        acc[0] += wgt * u.x; acc[1] += wgt * u.y; acc[2] += wgt * u.z; acc[3] += wgt * u.w;
        acc[4] += wgt * v.x; acc[5] += wgt * v.y; acc[6] += wgt * v.z; acc[7] += wgt * v.w;
      }
      if constexpr (Variant::kUseSoftmax) {
        const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= inv;
        if (p.lse != nullptr && d0 == 0)
          p.lse[(int64_t)q_row * p.lse_stride_row + qo_head] = den > 0.f ? mx + logf(den) : -INFINITY;
      }
      store_out(p, vp, q_row, qo_head, d0, acc);
    }
  }

  // ------------------------------------------------------------------ the kernel

  static __device__ __forceinline__ void run(const Params& p, const VariantParams& vp, uint8_t* smem) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int kv_head = blockIdx.y / p.num_head_chunks;
    const int32_t* cta_indptr = p.plan + FI_PLAN_HEADER_INTS;

    Cursor cur;
    cur.item = __ldg(cta_indptr + blockIdx.x);
    cur.item_end = __ldg(cta_indptr + blockIdx.x + 1);
    seek_item(p, vp, cur);
    if (cur.done) return;

    float2* md = reinterpret_cast<float2*>(smem + kStages * Cfg::kStageBytes);  // [warp][row] (m, d)
    int* merge_mask = reinterpret_cast<int*>(smem + kStages * Cfg::kStageBytes + Cfg::kMdBytes);

    int page[kTPT], slot[kTPT];
    prefetch_pages(p, cur, page, slot);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      issue(p, smem + s * Cfg::kStageBytes, cur, page, slot, kv_head);
      ptx::cp_async_commit();
      advance(p, vp, cur);
      prefetch_pages(p, cur, page, slot);
    }

    // Online-softmax state of the rows this lane holds: S rows g (and g + 8); O^T columns 2c, 2c + 1.
    float m_run[2], d_run[2];
    float o[kMTiles][4], o2[kTwoN ? kMTiles : 1][4];
    uint32_t qa[kKSteps][4];
    RowInfo ri[2];
    const float scale_log2 = p.logits_scale * kLog2e;

    for (int j = 0;; ++j) {
      const int st = j % kStages;
      uint8_t* stage = smem + st * Cfg::kStageBytes;
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      issue(p, smem + ((j + kStages - 1) % kStages) * Cfg::kStageBytes, cur, page, slot, kv_head);
      ptx::cp_async_commit();
      advance(p, vp, cur);
      prefetch_pages(p, cur, page, slot);

      const TileRecord* rec = reinterpret_cast<const TileRecord*>(stage + 2 * Cfg::kKvTileBytes + Cfg::kQSlotBytes);
      const int flags = rec->flags;
      if (flags & kEnd) break;
      const Work& w = rec->w;
      if (flags & kFirst) {
        ri[0] = row_info(p, w, g);
        ri[1] = row_info(p, w, g + 8);
        load_q(vp, stage, w, ri, qa);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          m_run[h] = -INFINITY;
          d_run[h] = 0.f;
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            o[mt][e] = 0.f;
            if constexpr (kTwoN) o2[mt][e] = 0.f;
          }
      }

      const int n_valid = rec->n_valid;
#pragma unroll
      for (int sb = 0; sb < Cfg::kSub; ++sb) {
      const int tb = 16 * (warp * Cfg::kSub + sb);  // first tile row of this 16-token block
      if (tb < n_valid) {
        const int tile_begin = rec->tile_kv_begin;
        const uint32_t ks = ptx::smem_u32(stage), vs = ks + Cfg::kKvTileBytes;
        // ---- S = Q K^T
        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t kb[kKSteps][2];
          load_k(ks, tb, nt, kb);
          if constexpr (Variant::kHasKeyTransform) {
            float x[kKSteps][2][2];
#pragma unroll
            for (int st2 = 0; st2 < kKSteps; ++st2)
#pragma unroll
              for (int jj = 0; jj < 2; ++jj) {
                const float2 f = ptx::unpack2<kBf16>(kb[st2][jj]);
                x[st2][jj][0] = f.x;
                x[st2][jj][1] = f.y;
              }
            const int kv_idx = tile_begin + tb + 8 * nt + g;
            rotate_pairs(vp, x, RotaryCtx{w.pos_off + kv_idx, kv_head, w.request}, c, /*is_key=*/true);
#pragma unroll
            for (int st2 = 0; st2 < kKSteps; ++st2)
#pragma unroll
              for (int jj = 0; jj < 2; ++jj) kb[st2][jj] = ptx::pack2<kBf16>(x[st2][jj][0], x[st2][jj][1]);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
          for (int ks2 = 0; ks2 < kKSteps; ++ks2)
            ptx::mma_16816<kBf16>(s[nt], qa[ks2][0], qa[ks2][1], qa[ks2][2], qa[ks2][3], kb[ks2][0], kb[ks2][1]);
        }

        // ---- logits: scale, LogitsTransform, LogitsMask (natural units), then log2 units
        constexpr int kHalves = kTwoN ? 2 : 1;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2 * kHalves; ++e) {
            const int hf = e >> 1;
            const int t = tb + 8 * nt + 2 * c + (e & 1);
            const int kv_idx = tile_begin + t;
            bool ok = ri[hf].valid && t < n_valid;
            if (p.causal) ok = ok && kv_idx <= ri[hf].climit;
            const float x = s[nt][e] * p.logits_scale;
            LogitsCtx ctx;
            if constexpr (Variant::kHasLogitsMask || Variant::kHasLogitsTransform) {
              ctx = LogitsCtx{w.request, ri[hf].q_row, ri[hf].q_idx, ri[hf].q_pos, kv_idx, w.pos_off + kv_idx,
                              ri[hf].qo_head, kv_head, w.q_len, w.kv_len};
            }
            if constexpr (Variant::kHasLogitsMask) ok = ok && Variant::logits_mask(vp, ctx);
            float y;
            if constexpr (Variant::kUseSoftmax) {
              if constexpr (Variant::kHasLogitsTransform)
                y = ok ? Variant::logits_transform(vp, x, ctx) * kLog2e : -INFINITY;
              else
                y = ok ? s[nt][e] * scale_log2 : -INFINITY;
              mx[hf] = fmaxf(mx[hf], y);
            } else {
              if constexpr (Variant::kHasLogitsTransform)
                y = ok ? Variant::logits_transform(vp, x, ctx) : 0.f;
              else
                y = ok ? x : 0.f;
            }
            s[nt][e] = y;
          }

        // ---- online softmax (rows g, g + 8), rescale O^T columns (rows 2c, 2c + 1 [+ 8])
        if constexpr (Variant::kUseSoftmax) {
          float alpha[2];
#pragma unroll
          for (int hf = 0; hf < kHalves; ++hf) {
            mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
            mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
            const float m_new = fmaxf(m_run[hf], mx[hf]);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            alpha[hf] = ptx::exp2(m_run[hf] - m_use);
            m_run[hf] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float pe = ptx::exp2(s[nt][2 * hf + e] - m_use);
                s[nt][2 * hf + e] = pe;
                sum += pe;
              }
            d_run[hf] = d_run[hf] * alpha[hf] + sum;
          }
          const float a0 = __shfl_sync(0xffffffffu, alpha[0], 8 * c);
          const float a1 = __shfl_sync(0xffffffffu, alpha[0], 8 * c + 4);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            o[mt][0] *= a0;
            o[mt][1] *= a1;
            o[mt][2] *= a0;
            o[mt][3] *= a1;
          }
          if constexpr (kTwoN) {
            const float b0 = __shfl_sync(0xffffffffu, alpha[1], 8 * c);
            const float b1 = __shfl_sync(0xffffffffu, alpha[1], 8 * c + 4);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
              o2[mt][0] *= b0;
              o2[mt][1] *= b1;
              o2[mt][2] *= b0;
              o2[mt][3] *= b1;
            }
          }
        }

        // ---- O^T += V^T P^T
        const uint32_t pb0 = ptx::pack2<kBf16>(s[0][0], s[0][1]);
        const uint32_t pb1 = ptx::pack2<kBf16>(s[1][0], s[1][1]);
        uint32_t pb2 = 0, pb3 = 0;
        if constexpr (kTwoN) {
          pb2 = ptx::pack2<kBf16>(s[0][2], s[0][3]);
          pb3 = ptx::pack2<kBf16>(s[1][2], s[1][3]);
        }
        if constexpr (!kFp8) {
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            uint32_t a[4];
            load_v16(vs, tb, mt, a);
            ptx::mma_16816<kBf16>(o[mt], a[0], a[1], a[2], a[3], pb0, pb1);
            if constexpr (kTwoN) ptx::mma_16816<kBf16>(o2[mt], a[0], a[1], a[2], a[3], pb2, pb3);
          }
        } else {
#pragma unroll
          for (int mp = 0; mp < kMTiles / 2; ++mp) {
            uint32_t a0[4], a1[4];
            load_v8(vs, tb, mp, a0, a1);
            ptx::mma_16816<kBf16>(o[2 * mp], a0[0], a0[1], a0[2], a0[3], pb0, pb1);
            ptx::mma_16816<kBf16>(o[2 * mp + 1], a1[0], a1[1], a1[2], a1[3], pb0, pb1);
            if constexpr (kTwoN) {
              ptx::mma_16816<kBf16>(o2[2 * mp], a0[0], a0[1], a0[2], a0[3], pb2, pb3);
              ptx::mma_16816<kBf16>(o2[2 * mp + 1], a1[0], a1[1], a1[2], a1[3], pb2, pb3);
            }
          }
        }
      }
      }  // 16-token blocks

      if (flags & kLast) finish(p, vp, stage, w, warp, lane, m_run, d_run, o, o2, md, merge_mask);
    }
  }

  // End of a (sub-)item: merge the warps' states, normalise, write out or to partial rows, and merge
  // completed split rows. `stage` (the tile just consumed) is the scratch.
  template <int kO2>
  static __device__ __forceinline__ void finish(const Params& p, const VariantParams& vp, uint8_t* stage, const Work& w,
                                                int warp, int lane, float (&m_run)[2], float (&d_run)[2],
                                                float (&o)[kMTiles][4], float (&o2)[kO2][4], float2* md,
                                                int* merge_mask) {
    const int g = lane >> 2, c = lane & 3;
    constexpr int kHalves = kTwoN ? 2 : 1;
#pragma unroll
    for (int hf = 0; hf < kHalves; ++hf) {
      d_run[hf] += __shfl_xor_sync(0xffffffffu, d_run[hf], 1);
      d_run[hf] += __shfl_xor_sync(0xffffffffu, d_run[hf], 2);
    }
    // Work is read from the record below, after the scratch overwrote nothing of it (it is past K/V/Q).
    const int row0 = w.row0, nrows = w.nrows, partial_base = w.partial_base, partial_stride = w.partial_stride;
    const int item_q_begin = w.item_q_begin;
    __syncthreads();  // every warp is done with this stage's K/V
    if (c == 0) {
#pragma unroll
      for (int hf = 0; hf < kHalves; ++hf) md[warp * kRows + g + 8 * hf] = make_float2(m_run[hf], d_run[hf]);
    }
    float* scratch = reinterpret_cast<float*>(stage);
    constexpr int kPassDim = Cfg::kPassDim;
    constexpr int kPassMTiles = kMTiles / Cfg::kPasses;
    constexpr int kVecs = kPassDim / 8;
    const bool split = partial_base >= 0;
#pragma unroll
    for (int pass = 0; pass < Cfg::kPasses; ++pass) {
      if (pass > 0) __syncthreads();  // the previous pass's readers are done
#pragma unroll
      for (int mt = pass * kPassMTiles; mt < (pass + 1) * kPassMTiles; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int n = 2 * c + (e & 1);
          const int dl = o_dim<kFp8>(mt, e >> 1, g) - pass * kPassDim;
          scratch[(warp * kRows + n) * kPassDim + (dl ^ (((n >> 1) & 3) << 3))] = o[mt][e];
          if constexpr (kTwoN) {
            const int n2 = n + 8;
            scratch[(warp * kRows + n2) * kPassDim + (dl ^ (((n2 >> 1) & 3) << 3))] = o2[mt][e];
          }
        }
      __syncthreads();
      for (int i = threadIdx.x; i < Cfg::kPackedRows * kVecs; i += kThreads) {
        const int pr = i / kVecs, dl = (i % kVecs) * 8;
        const int r = pr / kHPC;
        if (r >= nrows) continue;
        const int q_row = row0 + r, qo_head = blockIdx.y * kHPC + pr % kHPC;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        float mmax = -INFINITY, den = 0.f;
        if constexpr (Variant::kUseSoftmax) {
#pragma unroll
          for (int ww = 0; ww < Cfg::kWarps; ++ww) mmax = fmaxf(mmax, md[ww * kRows + pr].x);
        }
#pragma unroll
        for (int ww = 0; ww < Cfg::kWarps; ++ww) {
          float f = 1.f;
          if constexpr (Variant::kUseSoftmax) {
            const float2 st = md[ww * kRows + pr];
            f = st.x == -INFINITY ? 0.f : ptx::exp2(st.x - mmax);
            den += f * st.y;
          }
          const float* src = scratch + (ww * kRows + pr) * kPassDim + (dl ^ (((pr >> 1) & 3) << 3));
          const float4 u = *reinterpret_cast<const float4*>(src), v = *reinterpret_cast<const float4*>(src + 4);
          acc[0] += f * u.x; acc[1] += f * u.y; acc[2] += f * u.z; acc[3] += f * u.w;
          acc[4] += f * v.x; acc[5] += f * v.y; acc[6] += f * v.z; acc[7] += f * v.w;
        }
        float scale = p.v_scale;
        float lse_val = 0.f;
        if constexpr (Variant::kUseSoftmax) {
          scale = den > 0.f ? p.v_scale / den : 0.f;
          lse_val = den > 0.f ? (mmax + __log2f(den)) * kLn2 : -INFINITY;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= scale;
        const int d0 = pass * kPassDim + dl;
        if (!split) {
          store_out(p, vp, q_row, qo_head, d0, acc);
          if (Variant::kUseSoftmax && p.lse != nullptr && d0 == 0)
            p.lse[(int64_t)q_row * p.lse_stride_row + qo_head] = lse_val;
        } else {
          const int64_t prow = partial_base + (int64_t)(q_row - item_q_begin) * partial_stride;
          float4* dst = reinterpret_cast<float4*>(p.partial_o + (prow * p.num_qo_heads + qo_head) * kHeadDim + d0);
          __stcg(dst, make_float4(acc[0], acc[1], acc[2], acc[3]));
          __stcg(dst + 1, make_float4(acc[4], acc[5], acc[6], acc[7]));
          if (d0 == 0) __stcg(p.partial_lse + prow * p.num_qo_heads + qo_head, lse_val);
        }
      }
    }
    if (!split) return;

    // Arrival: the CTA that writes the last chunk of a row merges it (threadfence reduction pattern).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const int32_t* mi = p.plan + p.merge_indptr_offset;
      int mask = 0;
      for (int r = 0; r < nrows; ++r) {
        const int q_row = row0 + r;
        const int chunks = __ldg(mi + q_row + 1) - __ldg(mi + q_row);
        int32_t* counter = p.merge_counters + (int64_t)q_row * gridDim.y + blockIdx.y;
        if (atomicAdd(counter, 1) == chunks - 1) {
          *counter = 0;  // nobody else touches it in this launch: leave it zeroed for the next
          mask |= 1 << r;
        }
      }
      *merge_mask = mask;
    }
    __syncthreads();
    const int mask = *merge_mask;
    if (mask) {
      __threadfence();
      for (int r = 0; r < nrows; ++r)
        if (mask & (1 << r)) merge_row(p, vp, row0 + r);
    }
  }
};

}  // namespace decode
}  // namespace fi
