// What the attention kernels share (decode.cuh, prefill.cuh): the launch parameters, the work record,
// the loader that walks a CTA's plan items and gathers KV rows through the BSR indices, the rotary
// pairing of Q/K fragments, and the epilogue that writes outputs and merges split rows.
//
// Loader. All threads gather a tile's K and V rows through the BSR indices (page = kv_indices
// [block_start + pos / Bc], slot = pos % Bc) into a ring of shared-memory stages with 16-byte
// cp.async. A row's address is looked up once: one thread per tile row loads the next tile's page
// id into a register while the current tile is issued and, before the next barrier, publishes the
// row's byte offset to shared memory (double-buffered by tile parity at Cfg::kRowOffsetsAt); the
// kChunksPerRow threads that copy the row's 16-byte chunks read it there. (Every copying thread doing
// its own lookups was a third of the prefill kernel's instructions; one lookup per row is also 3%
// faster for fp8 decode, whose rows are short.)
// The loader walks the CTA's whole item list, so the next item's first tiles are in flight while the
// current item finishes. Each stage carries a record (which item, which tokens, first/last tile) that
// the compute side reads: compute never touches the plan itself.
//
// Bounds. KV indices outside [0, num_kv_blocks) and kv_indices offsets outside the array are never
// dereferenced: the tokens read as zeros and a bit is set in error_flags (ErrorBits).
//
// A kernel's Cfg provides: DQ, KV (KvType), kHeadDim, kHeadDimPad (shared-memory row width), kThreads, kTile (KV tokens per stage),
// kRowsPerTile (query rows per sub-item), kHeadsPerChunk, kPackedRows, kRows (packed rows of the stage's
// query slot), kQSlotBytes (0: no query slot; the kernel loads queries itself), kQBuffers and kQAt (> 1:
// the loader copies each sub-item's query tile into buffer qslot of kQBuffers at kQAt, kQBytes apart,
// with the sub-item's first KV tile; prefill on Hopper, where a warpgroup's MMAs read Q from shared
// memory), kRowBytes,
// kChunksPerRow, kRowsPerRound, kTokensPerThread, kKvTileBytes, kStages, kStageBytes, kRowOffsetsAt (2 kTile
// int64 of shared memory for the published row offsets), tile_offset(row, chunk) (where the loader puts a
// 16-byte chunk of a tile row), record(smem, s) (stage s's TileRecord).
// kProducer (prefill) and kLoaderThreads / kLoaderThread0: see produce().
// Epilogue (below) also needs kKSteps, kFragFp8 and kQBf16.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: the maps are encoded through the runtime's driver entry point)
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "../plan.h"
#include "ptx.cuh"
#include "timeline.cuh"
#include "variant.cuh"

namespace fi {
namespace attn {
enum ErrorBits : int32_t {
  kErrPageOutOfRange = 1,   // a kv_indices entry outside [0, num_kv_blocks)
  kErrIndexOutOfRange = 2,  // kv_block_start + block beyond kv_indices
};

// kv_indices lines are prefetched into L2 this many tiles ahead (the page ids of the next tile are then
// L2 hits).
constexpr int kIndexAheadTiles = 4;

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
  int32_t items_offset;         // fi_plan_items_offset(num_ctas, max_rows), int32 units
  int32_t merge_indptr_offset;  // fi_plan_merge_indptr_offset(num_ctas)
  float* partial_o;             // [max_partial_rows, num_qo_heads, D]
  float* partial_lse;           // [max_partial_rows, num_qo_heads]
  int32_t* merge_counters;      // [max_rows * units], zero between launches (units = num_qo_heads / kHPC)
  int32_t* error_flags;         // ErrorBits, or null
  int32_t num_qo_heads;
  int32_t num_head_chunks;      // units / num_kv_heads: unit u runs for KV head u / num_head_chunks
  float logits_scale;           // sm_scale * k_scale
  float v_scale;
  int32_t causal;
  // A deterministic plan (docs/deterministic.md): KV tiles start at multiples of the tile (a window's too),
  // split rows merge by the fold (Epilogue::det_add), and the decode kernel folds the pieces of a whole
  // item (Work::partial_stride: the piece length) with that same fold.
  int32_t deterministic;
};

// TMA maps of the KV cache as a token-major tensor [num_kv_blocks * page_size, kv heads, D] (K and V),
// encoded by the launcher (attention_module.cu) where the cache has that view (page stride = page_size
// token strides, 16-byte aligned strides and bases); a box is one 64-element column block (128 bytes,
// 128-byte swizzle: wgmma's layout, colblock_offset) of kTile tokens of one head. use = 0: no maps (the
// loader gathers with cp.async). A kernel parameter of its own (__grid_constant__): TMA reads the map
// from parameter space.
struct alignas(64) KvTma {
  CUtensorMap k, v;
  int32_t use;
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
  int32_t unit;          // query heads [unit * kHPC, + kHPC) of KV head unit / num_head_chunks
  int64_t block_start;   // offset of the request's first KV block in kv_indices
};

// kCopied: threads wrote the stage or the query buffer by cp.async (generic proxy): a consumer whose MMAs
// read shared memory through the async proxy fences first. TMA-boxed K and V need no fence.
enum RecordFlags : int32_t { kFirst = 1, kLast = 2, kEnd = 4, kCopied = 8 };

struct alignas(16) TileRecord {
  Work w;
  int32_t tile_kv_begin;  // KV token index of the tile's row 0
  int32_t n_valid;        // rows of the tile that hold KV tokens of the item (<= 0: none)
  int32_t flags;
  int32_t qslot;          // the sub-item's query buffer (Cfg::kQBuffers > 1)
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
// Byte offset of 16-byte chunk `chunk` of row `row` in a row-major tile of kRowBytes rows, swizzled
// for ldmatrix (the mma.sync kernels' layout).
template <int kRowBytes>
__device__ __forceinline__ int rowmajor_offset(int row, int chunk) {
  return row * kRowBytes + swizzle<kRowBytes / 16>(row, chunk) * 16;
}
// The same tile as Hopper's wgmma reads it (csrc/attention/wgmma.cuh): column blocks of 128 bytes (64
// 16-bit elements), each [kRows][128 bytes] with the 128-byte swizzle (chunk c of row r at c ^ r % 8).
template <int kRows>
__device__ __forceinline__ int colblock_offset(int row, int chunk) {
  return (chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// KV head of a unit (FiWorkItem::unit). num_head_chunks is 1 unless a GQA group is larger than the
// kernel's heads per chunk: skip the integer division (a long instruction sequence, run per tile by the
// loader) in that common case.
__device__ __forceinline__ int kv_head_of(const Params& p, int unit) {
  return p.num_head_chunks == 1 ? unit : unit / p.num_head_chunks;
}

__device__ __forceinline__ void report(int32_t* flags, int32_t bit) {
  if (flags != nullptr) atomicOr(flags, bit);
}

// Whether a kernel may run deterministic plans (Params::deterministic): a decode module fixes it when it is
// compiled (Config::kDeterministic); the prefill kernel, whose Config has no such field, reads it at run time.
template <class Cfg, class = void>
struct MayRunDeterministic : std::true_type {};
template <class Cfg>
struct MayRunDeterministic<Cfg, std::void_t<decltype(Cfg::kDeterministic)>>
    : std::integral_constant<bool, Cfg::kDeterministic> {};

template <class Cfg, class Variant, class VariantParams>
struct Loader {
  using DQ = typename Cfg::DQ;
  // The loading threads: the whole CTA, or the producer warpgroup (threads [kLoaderThread0, + 128)) of
  // a warp-specialised kernel (produce()).
  static constexpr int kThreads = Cfg::kLoaderThreads;
  static __device__ __forceinline__ int tid() { return (int)threadIdx.x - Cfg::kLoaderThread0; }
  static constexpr int kTile = Cfg::kTile;
  static constexpr int kRows = Cfg::kRows;
  static constexpr int kHeadDim = Cfg::kHeadDim;
  // Shared-memory rows are Cfg::kHeadDimPad wide (Cfg::kChunksPerRow chunks); a row's first kLoadChunks
  // chunks hold the head, the pad is filled with zeros (the decode kernel's MMAs run the padded width).
  static constexpr int kLoadChunks = kHeadDim * Cfg::KV::kBytes / 16;
  static constexpr int64_t kNoRow = -16;  // a row offset: not loaded (16-byte aligned, so an unread copy source)
  static constexpr int kQChunks = kHeadDim * 2 / 16, kQChunksPad = Cfg::kHeadDimPad * 2 / 16;
  static constexpr int kHPC = Cfg::kHeadsPerChunk;
  static constexpr int kRowsPerTile = Cfg::kRowsPerTile;
  static constexpr int kTPT = Cfg::kTokensPerThread;
  static constexpr int kStages = Cfg::kStages;
  // Page lookups one thread holds from prefetch_pages to publish: tile rows tid, tid + kThreads, ...
  static constexpr int kLookups = (kTile + kThreads - 1) / kThreads;

  // Fill w for row sub-tile `sub` of plan item `item`; returns the item's number of sub-tiles.
  static __device__ __forceinline__ int begin_work(const Params& p, const VariantParams& vp, int item, int sub,
                                                   Work& w) {
    const int4* raw = reinterpret_cast<const int4*>(p.plan + p.items_offset) + 2 * item;
    const int4 a = __ldg(raw), b = __ldg(raw + 1);
    // FiWorkItem: request, q_begin, q_end, kv_begin | kv_end, partial_base, partial_stride, unit
    // A shared-prefix item (FI_ITEM_SHARED, csrc/plan.h): rows of several requests against the prefix of the
    // group's first request, which every row sees whole. Its rows are placed as one request's query of
    // q_len 0 starting at q_begin, so the causal limit lies past the prefix for each of them.
    const bool shared = (a.x & FI_ITEM_SHARED) != 0;
    const int req = a.x & ~FI_ITEM_SHARED, q_begin = a.y, q_end = a.z, kv_begin = a.w, kv_end = b.x;
    const int nsub = (q_end - q_begin + kRowsPerTile - 1) / kRowsPerTile;
    if (nsub <= 0) return 0;
    w.request = req;
    w.kv_len = __ldg(p.kv_lens + req);
    const int qs = shared ? q_begin : __ldg(p.qo_indptr + req);
    w.q_len = shared ? 0 : __ldg(p.qo_indptr + req + 1) - qs;
    w.pos_off = p.kv_pos_start != nullptr ? __ldg(p.kv_pos_start + req) : 0;
    w.block_start = p.kv_block_start_int64 ? __ldg(static_cast<const int64_t*>(p.kv_block_start) + req)
                                           : (int64_t)__ldg(static_cast<const int32_t*>(p.kv_block_start) + req);
    w.item_q_begin = q_begin;
    w.partial_base = b.y;
    w.partial_stride = b.z;
    w.unit = b.w;
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
      // deterministic: the tiles stay on the multiples of kTile (the range's edge, which follows the
      // sub-item's first row, falls inside a tile and is masked per element), so a row's KV steps never
      // depend on which rows share its tile (the range is also a LogitsMask: variant.cuh)
      const bool det = MayRunDeterministic<Cfg>::value && p.deterministic;
      lo = max(lo, det ? (plo - w.pos_off) / kTile * kTile : plo - w.pos_off);
      hi = min(hi, phi - w.pos_off);
    }
    if (hi < lo) hi = lo;
    w.kv_lo = lo;
    w.kv_hi = hi;
    w.ntiles = max(1, (hi - lo + kTile - 1) / kTile);
    return nsub;
  }

  // Where the loader is: the fields of the sub-item's Work it needs itself. It lives in registers through
  // the compute, so the rest of the Work is not kept: the record's copy is rebuilt at a sub-item's first
  // tile (begin_work again, thread 0) and copied from the previous tile's record after that.
  struct Pos {
    int row0, nrows, kv_lo, kv_hi, ntiles, unit;
    int64_t block_start;
  };
  struct Cursor {
    int item, item_end, sub, nsub, tile;
    bool done;
    Pos w;
  };
  // The loader copies query tiles where the kernel has query buffers (prefill on Hopper, for some
  // variants: fi_backend/shapes.py, _prefill_q_buffers; Cfg::kQCopy). Sub-item n uses buffer n % kQBuffers
  // (TileRecord::qslot). With a buffer per stage, sub-item n - kStages ended at least kStages - 1 tiles
  // before sub-item n's first tile, so it was consumed before that tile (and its query copy) is issued.
  // A producer warpgroup (produce()) instead waits for the buffer's release (its "qempty" barrier), so
  // it can run more stages than query buffers (prefill's overlapped consumers: one buffer, released early).
  static constexpr bool kQCopy = Cfg::kQCopy;
  static_assert(!kQCopy || !Variant::kHasQueryTransform, "a QueryTransform rotates Q in registers (load_q)");
  static_assert(Cfg::kQBuffers == 1 || Cfg::kQBuffers == kStages || Cfg::kProducer,
                "query buffers: one, one per stage, or released through barriers (producer)");

  static __device__ __forceinline__ void set_pos(Pos& pos, const Work& w) {
    pos.row0 = w.row0;
    pos.nrows = w.nrows;
    pos.kv_lo = w.kv_lo;
    pos.kv_hi = w.kv_hi;
    pos.ntiles = w.ntiles;
    pos.unit = w.unit;
    pos.block_start = w.block_start;
  }

  static __device__ __forceinline__ void seek_item(const Params& p, const VariantParams& vp, Cursor& cur) {
    while (cur.item < cur.item_end) {
      Work w;
      cur.nsub = begin_work(p, vp, cur.item, 0, w);
      set_pos(cur.w, w);
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
      Work w;
      begin_work(p, vp, cur.item, cur.sub, w);
      set_pos(cur.w, w);
      return;
    }
    ++cur.item;
    seek_item(p, vp, cur);
  }

  static __device__ __forceinline__ int lookup_row(int r) { return tid() + r * kThreads; }

  // Page ids of this thread's lookup rows of the cursor's tile: page[r] (INT_MIN: index outside
  // kv_indices) and slot[r] (< 0: not a KV token of the item; nothing is loaded).
  static __device__ __forceinline__ void prefetch_pages(const Params& p, const Cursor& cur, int (&page)[kLookups],
                                                        int (&slot)[kLookups]) {
    const int tile_begin = cur.w.kv_lo + cur.tile * kTile;
    const int n_valid = cur.done ? 0 : min(cur.w.kv_hi - tile_begin, kTile);
#pragma unroll
    for (int r = 0; r < kLookups; ++r) {
      const int row = lookup_row(r);
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
    // kv_indices of a tile kIndexAheadTiles tiles on: into L2 now, so that its page-id loads
    // (one tile ahead of its copies) do not wait on DRAM. 32 ids per 128-byte line.
    {
      const int ahead_begin = tile_begin + kIndexAheadTiles * kTile;
      const int t = tid();
      if (!cur.done && t < 8 && ahead_begin < cur.w.kv_hi) {
        int b0, b1, s0;
        ptx::divmod(p.page_div, ahead_begin, b0, s0);
        ptx::divmod(p.page_div, min(ahead_begin + kTile, cur.w.kv_hi) - 1, b1, s0);
        const int64_t first = (cur.w.block_start + b0) & ~int64_t(31);
        const int64_t line = first + 32 * t;
        if (line <= cur.w.block_start + b1 && line < p.num_kv_indices) ptx::prefetch_l2(p.kv_indices + line);
      }
    }
  }

  // Byte offset (from the K or V base) of a looked-up row, kNoRow for a row that is not loaded; a page id
  // outside the cache or an index outside kv_indices is reported and not loaded.
  static __device__ __forceinline__ int64_t row_offset(const Params& p, int page, int slot, int kv_head) {
    if (slot < 0) return kNoRow;
    if (page < 0 || page >= p.num_kv_blocks) {
      report(p.error_flags, page == INT32_MIN ? kErrIndexOutOfRange : kErrPageOutOfRange);
      return kNoRow;
    }
    return ((int64_t)page * p.kv_stride_block + (int64_t)slot * p.kv_stride_token + (int64_t)kv_head * p.kv_stride_head) *
           Cfg::KV::kBytes;
  }

  static __device__ __forceinline__ int64_t* row_offsets(uint8_t* smem, int tile_no) {
    return reinterpret_cast<int64_t*>(smem + Cfg::kRowOffsetsAt) + (tile_no & 1) * kTile;
  }

  // Publish the looked-up rows of tile number `tile_no`, the cursor's (its copies are issued after the
  // next barrier).
  static __device__ __forceinline__ void publish(const Params& p, uint8_t* smem, int tile_no, const Cursor& cur,
                                                 const int (&page)[kLookups], const int (&slot)[kLookups]) {
    int64_t* offs = row_offsets(smem, tile_no);
    const int kv_head = kv_head_of(p, cur.w.unit);
#pragma unroll
    for (int r = 0; r < kLookups; ++r) {
      const int row = lookup_row(r);
      if (kTile % kThreads == 0 || row < kTile) offs[row] = row_offset(p, page[r], slot[r], kv_head);
    }
  }

  // Issue the cursor's tile, the CTA's tile number tile_no, into its stage (tile_no % kStages): record,
  // Q slot (first tile of a sub-item), K and V rows.
  // gather = false: the K and V rows are not copied here (produce() issues them through TMA).
  static __device__ __forceinline__ void issue(const Params& p, const VariantParams& vp, uint8_t* smem, int tile_no,
                                               const Cursor& cur, bool gather = true) {
    const int tid = Loader::tid();
    uint8_t* stage = smem + (tile_no % kStages) * Cfg::kStageBytes;
    TileRecord* rec = Cfg::record(smem, tile_no % kStages);
    const TileRecord* prev = Cfg::record(smem, (tile_no + kStages - 1) % kStages);
    if (cur.done) {
      if (tid == 0) rec->flags = kEnd;
      return;
    }
    const int tile_begin = cur.w.kv_lo + cur.tile * kTile;
    // The sub-item's query buffer: the previous tile's, or the next one for a new sub-item (the previous
    // record was written before the barrier this issue follows; not kept in the cursor: registers).
    int qslot = 0;
    if constexpr (kQCopy) {
      if (tile_no > 0) {
        qslot = prev->qslot;
        if (cur.tile == 0) qslot = qslot + 1 == Cfg::kQBuffers ? 0 : qslot + 1;
      }
    }
    if (tid == 0) {
      if (cur.tile == 0) {
        begin_work(p, vp, cur.item, cur.sub, rec->w);
      } else {  // the previous tile, same sub-item, is not consumed before this one is issued
        rec->w = prev->w;
      }
      rec->tile_kv_begin = tile_begin;
      rec->n_valid = cur.w.kv_hi - tile_begin;
      rec->flags = (cur.tile == 0 ? kFirst : 0) | (cur.tile == cur.w.ntiles - 1 ? kLast : 0) |
                   (gather || (kQCopy && cur.tile == 0) ? kCopied : 0);
      rec->qslot = qslot;
    }
    if constexpr (kQCopy) {
      if (cur.tile == 0) {  // the sub-item's query tile, in the MMAs' layout (Cfg::q_offset), zeros past nrows
        // A thread copies one 16-byte chunk column of rows pr0, pr0 + kRound, ... (few registers: this runs
        // inside the compute loop, next to the accumulators). Where a round holds whole GQA groups, those rows
        // are one head, kRound / kHPC query rows apart: a pointer step; else each row's (row, head) is derived.
        constexpr int kChunksQ = kQChunksPad;
        constexpr int kRound = kThreads / kChunksQ;
        static_assert(kThreads % kChunksQ == 0 && Cfg::kTileRows % kRound == 0, "query copy");
        const uint32_t qbuf = ptx::smem_u32(smem + Cfg::kQAt + qslot * Cfg::kQBytes);
        const int t = ptx::thread_index_here() - Cfg::kLoaderThread0;
        const int ch = t % kChunksQ, pr0 = t / kChunksQ;
        const DQ* q = static_cast<const DQ*>(p.q);
        if constexpr (kRound % kHPC == 0) {
          const DQ* src = q + (int64_t)(cur.w.row0 + pr0 / kHPC) * p.q_stride_row +
                          (int64_t)(cur.w.unit * kHPC + pr0 % kHPC) * p.q_stride_head + ch * 8;
#pragma unroll 1
          for (int pr = pr0; pr < Cfg::kTileRows; pr += kRound) {
            const bool ok = pr < Cfg::kPackedRows && pr / kHPC < cur.w.nrows && ch < kQChunks;
            ptx::cp_async_16(qbuf + Cfg::q_offset(pr, ch), ok ? src : p.q, ok);
            src += (int64_t)(kRound / kHPC) * p.q_stride_row;
          }
        } else {
          const DQ* head0 = q + (int64_t)cur.w.row0 * p.q_stride_row + (int64_t)cur.w.unit * kHPC * p.q_stride_head + ch * 8;
#pragma unroll 1
          for (int pr = pr0; pr < Cfg::kTileRows; pr += kRound) {
            const int r = pr / kHPC;
            const bool ok = pr < Cfg::kPackedRows && r < cur.w.nrows && ch < kQChunks;
            const DQ* src = head0 + (int64_t)r * p.q_stride_row + (int64_t)(pr - r * kHPC) * p.q_stride_head;
            ptx::cp_async_16(qbuf + Cfg::q_offset(pr, ch), ok ? src : p.q, ok);
          }
        }
      }
    }
    if constexpr (Cfg::kQSlotBytes > 0) {
    if (cur.tile == 0) {  // query tile: packed row pr = local row * kHPC + local head, zeros past nrows
      constexpr int kChunksQ = kQChunksPad;
      const uint32_t qslot = ptx::smem_u32(stage + 2 * Cfg::kKvTileBytes);
      const int head0 = cur.w.unit * kHPC;
#pragma unroll
      for (int i = tid; i < kRows * kChunksQ; i += kThreads) {
        const int pr = i / kChunksQ, ch = i % kChunksQ;
        const int r = pr / kHPC, h = pr % kHPC;
        const bool ok = pr < Cfg::kPackedRows && r < cur.w.nrows && ch < kQChunks;
        const DQ* src = static_cast<const DQ*>(p.q) + (ok ? (int64_t)(cur.w.row0 + r) * p.q_stride_row +
                                                              (int64_t)(head0 + h) * p.q_stride_head + ch * 8
                                                        : 0);
        ptx::cp_async_16(qslot + i * 16, src, ok);
      }
    }
    }
    if (!gather) return;
    const uint32_t ks = ptx::smem_u32(stage), vs = ks + Cfg::kKvTileBytes;
    const int row_base = tid / Cfg::kChunksPerRow, chunk = tid % Cfg::kChunksPerRow;
    // A row not loaded (kNoRow) still names a 16-byte aligned source, which its zero-filling copy never reads: no
    // select of a safe address a copy (where KV comes from L2, decode is bound by instructions, this loop's first)
    const bool chunk_ok = chunk < kLoadChunks;
    const char* kchunk = static_cast<const char*>(p.k) + chunk * 16;
    const char* vchunk = static_cast<const char*>(p.v) + chunk * 16;
    const int64_t* offs = row_offsets(smem, tile_no);
#pragma unroll
    for (int r = 0; r < kTPT; ++r) {
      const int row = row_base + r * Cfg::kRowsPerRound;
      if (kTile % Cfg::kRowsPerRound != 0 && row >= kTile) break;  // a partial last round
      const uint32_t dst = Cfg::tile_offset(row, chunk);
      ptx::cp_async_16_kv(ks + dst, vs + dst, kchunk, vchunk, chunk_ok ? offs[row] : kNoRow);
    }
  }


  // A CTA's walk over its queue of the plan, as both kernels run it. start(): the cursor at the CTA's
  // first item and the first kStages - 1 tiles issued; false when the queue is empty. step(): at the top
  // of iteration j (after the wait and barrier), issue the tile kStages - 1 ahead into the stage that
  // iteration j - 1 consumed, and move on.
  // The cursor at the CTA's first item (done when its queue is empty).
  static __device__ __forceinline__ void seek_queue(const Params& p, const VariantParams& vp, Cursor& cur) {
    const int32_t* cta_indptr = p.plan + FI_PLAN_HEADER_INTS;
    cur.item = __ldg(cta_indptr + blockIdx.x);
    cur.item_end = __ldg(cta_indptr + blockIdx.x + 1);
    seek_item(p, vp, cur);
  }

  static __device__ __forceinline__ bool start(const Params& p, const VariantParams& vp, uint8_t* smem, Cursor& cur,
                                               int (&page)[kLookups], int (&slot)[kLookups]) {
    seek_queue(p, vp, cur);
    if (cur.done) return false;
    prefetch_pages(p, cur, page, slot);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      publish(p, smem, s, cur, page, slot);
      __syncthreads();
      issue(p, vp, smem, s, cur);
      ptx::cp_async_commit();
      advance(p, vp, cur);
      prefetch_pages(p, cur, page, slot);
    }
    return true;
  }

  // Before iteration j's barrier: publish the lookups of the tile that iteration j issues.
  static __device__ __forceinline__ void before_barrier(const Params& p, uint8_t* smem, int j, const Cursor& cur,
                                                        const int (&page)[kLookups], const int (&slot)[kLookups]) {
    publish(p, smem, j + kStages - 1, cur, page, slot);
  }

  static __device__ __forceinline__ void step(const Params& p, const VariantParams& vp, uint8_t* smem, int j,
                                              Cursor& cur, int (&page)[kLookups], int (&slot)[kLookups]) {
    issue(p, vp, smem, j + kStages - 1, cur);
    ptx::cp_async_commit();
    advance(p, vp, cur);
    prefetch_pages(p, cur, page, slot);
  }

  // Whether the cursor's tile can be one TMA box a column block (produce(), with maps): it is full and its
  // rows are kTile consecutive tokens of the cache's token-major view (ragged KV, whose BSR is the
  // identity at page size 1, or pages that happen to be in order). Decided from the page lookups already
  // made, when publish() consumes them anyway (consuming them earlier exposed their global-memory latency
  // in every producer step): a warp's rows agree on token - row (one vote),
  // its lane 0 leaves that base (INT_MIN: no) in shared memory, and after the barrier every loading thread
  // reads the same bases and so reaches the same answer (tma_decide).
  static __device__ __forceinline__ void tma_vote(const Params& p, uint8_t* smem, int tile_no, const Cursor& cur,
                                                  const int (&page)[kLookups], const int (&slot)[kLookups]) {
    static_assert(kLookups == 1, "one lookup row a loading thread (kTile <= 128)");
    const int row = lookup_row(0), lane = tid() & 31;
    if (32 * (tid() >> 5) >= kTile) return;  // a warp without rows
    const bool full = !cur.done && cur.w.kv_hi - (cur.w.kv_lo + cur.tile * kTile) >= kTile;
    const bool ok = full && row < kTile && page[0] >= 0 && page[0] < p.num_kv_blocks && slot[0] >= 0;
    const int d = ok ? page[0] * p.page_size + slot[0] - row : INT32_MIN;  // < 2^31 tokens (the maps' condition)
    const int d0 = __shfl_sync(0xffffffffu, d, 0);
    const bool same = __all_sync(0xffffffffu, row >= kTile || (ok && d == d0));
    if (lane == 0) tma_bases(smem, tile_no)[tid() >> 5] = same ? d0 : INT32_MIN;
  }
  static __device__ __forceinline__ int32_t* tma_bases(uint8_t* smem, int tile_no) {
    return reinterpret_cast<int32_t*>(smem + Cfg::kRowOffsetsAt + 2 * kTile * 8) + (tile_no & 1) * 4;
  }
  // After the barrier: the token of the tile's row 0 when every warp's rows continue it, else INT32_MIN.
  static __device__ __forceinline__ int tma_decide(uint8_t* smem, int tile_no) {
    const int32_t* b = tma_bases(smem, tile_no);
    const int base = b[0];
    bool all = base != INT32_MIN;
#pragma unroll
    for (int w = 1; w < (kTile + 31) / 32; ++w) all = all && b[w] == base;
    return all ? base : INT32_MIN;
  }

  // With TMA maps (tma.use), a tile of consecutive tokens (tma_vote / tma_decide) is copied by thread 0 as
  // kHeadDimPad / 64 boxes each of K and V, its bytes added to the full barrier before its own arrivals (so
  // the phase cannot complete without them); the other threads issue nothing. Any other tile (partial,
  // scattered pages) is gathered as before (one-page boxes were slower than the gather: docs/prefill.md).
  // A sub-item stops voting at its first gathered tile: its later tiles are gathered without a vote (an
  // engine's scattered pages stay scattered; ragged KV fails only on its partial last tile), so a failed
  // vote is not paid on every tile.
  static __device__ __forceinline__ void produce(const Params& p, const VariantParams& vp, uint8_t* smem,
                                                 uint32_t full, uint32_t empty, uint32_t qempty, const KvTma& tma) {
    static_assert(kThreads == 128 && Cfg::kLoaderThread0 > 0, "a producer warpgroup after the compute warps");
    static_assert(!Cfg::kFp8, "TMA boxes: 64 16-bit elements (128 bytes) of a row");
    constexpr int kBarrierId = 9;  // the producer's own named barrier (the compute side's is 8)
    Cursor cur;
    int page[kLookups], slot[kLookups];
    const bool maps = tma.use != 0;
    seek_queue(p, vp, cur);  // an empty queue: the first tile is the kEnd record
    prefetch_pages(p, cur, page, slot);
    int nsub = 0;  // sub-items issued: the next one's query buffer is nsub % kQBuffers
    bool vote = maps;  // the same in every loading thread (set from tma_decide)
    // prefill's overlapped consumers (Cfg::kOverlap) release a query buffer after their last QK^T of its
    // sub-item, while they finish it: the boxes of the next sub-item's first tile go before the wait for it.
    constexpr bool kBoxesFirst = Cfg::kOverlap;
    // The FA3 member's producer: one warp waits for the stage's (and the query buffer's) release, and the named
    // barrier below passes it on to the other three, which would otherwise spin in try-wait loops beside the
    // consumers' softmax (member 0 keeps all waiting: no faster so, and its 24-register producer spills more).
    const bool waiter = !Cfg::kOverlap || tid() < 32;
    FI_TIMELINE_COUNTER(tl_n);  // perf/tools/timeline.py: 5 a tile's wait for its stage, 6 issued, 7 done
#pragma unroll 1
    for (int j = 0;; ++j) {
      const int s = j % kStages;
      if (tid() == 0) FI_STAMP(1, tl_n, 5);
      if (waiter) ptx::mbar_wait(empty + 8 * s, ((j / kStages) & 1) ^ 1);
      const bool new_q = kQCopy && !cur.done && cur.tile == 0;
      auto wait_q = [&]() {
        if (waiter) ptx::mbar_wait(qempty + 8 * (nsub % Cfg::kQBuffers), ((nsub / Cfg::kQBuffers) & 1) ^ 1);
        ++nsub;
      };
      if (!kBoxesFirst && new_q) wait_q();
      // Row offsets are double-buffered by tile parity: the barrier below also orders this tile's
      // publish after every loading thread's copies of tile j - 2 (issued before the last barrier), and
      // passes the waiter's view of the released stage to the threads that write it.
      if (cur.tile == 0) vote = maps;
      publish(p, smem, j, cur, page, slot);
      if (vote) tma_vote(p, smem, j, cur, page, slot);
      ptx::bar_sync(kBarrierId, kThreads);
      const int token0 = vote ? tma_decide(smem, j) : INT32_MIN;
      const bool box = token0 != INT32_MIN;
      vote = box;
      auto boxes = [&]() {
        const uint32_t bar = full + 8 * s;
        const uint32_t ks = ptx::smem_u32(smem + s * Cfg::kStageBytes), vs = ks + Cfg::kKvTileBytes;
        const int kv_head = kv_head_of(p, cur.w.unit);
        ptx::mbar_expect_tx(bar, 2 * Cfg::kKvTileBytes);
#pragma unroll
        for (int cb = 0; cb < Cfg::kHeadDimPad / 64; ++cb) {  // a box past the head's columns reads zeros
          ptx::tma_load_3d(ks + cb * kTile * 128, &tma.k, 64 * cb, kv_head, token0, bar);
          ptx::tma_load_3d(vs + cb * kTile * 128, &tma.v, 64 * cb, kv_head, token0, bar);
        }
      };
      if (kBoxesFirst) {  // (the barrier's phase cannot complete before this thread's arrivals below)
        if (box && tid() == 0) boxes();
        if (new_q) {
          wait_q();
          ptx::bar_sync(kBarrierId, kThreads);  // the waiter saw the buffer released
        }
      }
      issue(p, vp, smem, j, cur, !box);
      if (!kBoxesFirst && box && tid() == 0) boxes();
      ptx::cp_async_mbar_arrive(full + 8 * s);
      if (tid() == 0) ptx::mbar_arrive(full + 8 * s);  // the record (ordinary stores): released here
      if (tid() == 0) FI_STAMP(1, tl_n, cur.done ? 7 : 6);
      if (cur.done) return;
      advance(p, vp, cur);
      prefetch_pages(p, cur, page, slot);
    }
  }
};

// Dimension of element e of register j (of a k step / m tile) held by lane group c (k layout of Q.K^T).
template <bool kFp8>
__device__ __forceinline__ int k_dim(int step, int j, int e, int c) {
  return kFp8 ? 16 * step + 4 * c + 2 * j + e : 16 * step + 2 * c + 8 * j + e;
}

// A packed row (local row * heads per chunk + local head) of a sub-item, as the compute side sees it.
struct RowInfo {
  int q_row, q_idx, q_pos, qo_head, climit;
  bool valid;  // a real query row of the sub-item (padding rows never reach a variant hook)
};

// Pieces of the compute side both kernels use. Cfg also provides kFragFp8 (the k dimension of Q.K^T is
// permuted to the fp8 ldmatrix layout), kQBf16 (output type), kKSteps.
template <class Cfg, class Variant, class VariantParams>
struct Epilogue {
  using DQ = typename Cfg::DQ;
  static constexpr int kHeadDim = Cfg::kHeadDim;
  static constexpr int kHPC = Cfg::kHeadsPerChunk;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kKSteps = Cfg::kKSteps;

  static __device__ __forceinline__ RowInfo row_info(const Work& w, int pr) {
    RowInfo ri;
    const int r = pr / kHPC;
    ri.q_row = w.row0 + r;
    ri.q_idx = w.q_idx0 + r;
    ri.q_pos = w.pos_off + w.kv_len - w.q_len + ri.q_idx;
    ri.qo_head = w.unit * kHPC + pr % kHPC;
    ri.climit = w.kv_len - w.q_len + ri.q_idx;  // causal (bottom-right): kv_idx <= climit
    ri.valid = pr < Cfg::kPackedRows && r < w.nrows;
    return ri;
  }

  // Query/KeyTransform over the pairs one lane holds: (d, d + D/2) sit in k steps s and s + kKSteps/2
  // at the same slot; interleaved pairs (2i, 2i + 1) are the two halves of one register.
  static __device__ __forceinline__ void rotate_pairs(const VariantParams& vp, float (&x)[kKSteps][2][2],
                                                      const RotaryCtx& ctx, int c, bool is_key) {
    static_assert(Cfg::kHeadDim == Cfg::kHeadDimPad, "rotary transforms: head size 64, 128 or 256 (no pad columns)");
    if constexpr (Variant::kRotaryInterleave) {
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int i = k_dim<Cfg::kFragFp8>(s, j, 0, c) / 2;
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
            const int i = k_dim<Cfg::kFragFp8>(s, j, e, c);
            if (is_key)
              Variant::key_transform(vp, x[s][j][e], x[s + kKSteps / 2][j][e], i, ctx);
            else
              Variant::query_transform(vp, x[s][j][e], x[s + kKSteps / 2][j][e], i, ctx);
          }
    }
  }


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

  // Merge the partial states of the rows r of [row0, row0 + nrows) with merged(r) (all chunks written,
  // fences done) for the query heads of `unit`. Every (row, head, 8 dims) unit is one thread's: a sub-item's rows
  // merge in parallel (one row at a time left most threads idle and made a 64-row tile's merge the tail
  // of short prefills). The merge runs between a CTA's items, so every other item of that CTA waits for
  // it: states are read kBatch at a time with no branch between the loads, so a batch costs one
  // L2 round trip (a loop that skipped empty states issued one state's loads per round trip, and a
  // 16-chunk row took ~16 of them), and merged online (one pass: no separate pass for the max).
  // kBatch costs 9 registers per state: decode affords 8. (Prefill merges in its own Kernel::arrive, through
  // merge_states.)
  // Where the rows leave threads idle (a decode row of one unit: kHPC x kVecs units for 128 or 256 threads), up to
  // kMaxLanes neighbouring lanes share a unit, each merging every lanes-th batch of its states, and combine their
  // states by shuffles: a row of n states then takes n / (kBatch x lanes) round trips, not n / kBatch (single
  // requests of few KV heads split 32-64 ways, where the merge is the step's tail).
  // Row q_row's arrival counter for the query heads of `unit` (Params::merge_counters: [rows][units]).
  static __device__ __forceinline__ int32_t* merge_counter(const Params& p, int q_row, int unit) {
    return p.merge_counters + (int64_t)q_row * (p.num_qo_heads / kHPC) + unit;
  }

  // Deterministic plans fold a row's piece states (O of 8 dims, LSE) in piece order, each added to the
  // running state on its own: the merge of a split row (merge_rows) and the decode kernel's fold of a
  // whole item's pieces run this code on the same values, so a row's bits do not depend on whether its
  // pieces ran on one CTA or on several. Roundings are explicit (__fmaf_rn, __fmul_rn: no multiply-add
  // contracted at one call site and not at the other). mx = -inf: nothing added yet.
  struct DetAcc {
    float mx, den, acc[8];
  };
  static __device__ __forceinline__ void det_start(DetAcc& a) {
    a.mx = -INFINITY;
    a.den = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) a.acc[e] = 0.f;
  }
  static __device__ __forceinline__ void det_add(DetAcc& a, float lse, const float (&u)[8]) {
    if constexpr (Variant::kUseSoftmax) {
      if (lse == -INFINITY) return;  // an empty state (no visible token) adds nothing
      if (a.mx == -INFINITY) {       // the first state is taken as it is
        a.mx = lse;
        a.den = 1.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) a.acc[e] = u[e];
        return;
      }
      const float m = fmaxf(a.mx, lse);
      const float r = ptx::exp2(__fmul_rn(a.mx - m, kLog2e)), wgt = ptx::exp2(__fmul_rn(lse - m, kLog2e));
      a.den = __fmaf_rn(a.den, r, wgt);
#pragma unroll
      for (int e = 0; e < 8; ++e) a.acc[e] = __fmaf_rn(wgt, u[e], __fmul_rn(a.acc[e], r));
      a.mx = m;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) a.acc[e] = a.mx == -INFINITY ? u[e] : __fadd_rn(a.acc[e], u[e]);
      a.mx = 0.f;
    }
  }
  // The folded row: O = acc / den (0 and LSE -inf when every state was empty) to the output.
  static __device__ __forceinline__ void det_store(const Params& p, const VariantParams& vp, const DetAcc& a,
                                                   int q_row, int qo_head, int d0) {
    float o[8];
    const bool empty = a.mx == -INFINITY;
    const float inv = Variant::kUseSoftmax ? (empty ? 0.f : __frcp_rn(a.den)) : 1.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = empty ? 0.f : __fmul_rn(a.acc[e], inv);
    store_out(p, vp, q_row, qo_head, d0, o);
    if (Variant::kUseSoftmax && p.lse != nullptr && d0 == 0)
      p.lse[(int64_t)q_row * p.lse_stride_row + qo_head] = empty ? -INFINITY : a.mx + logf(a.den);
  }

  // kDet: the kernel may run deterministic plans (p.deterministic): their split rows merge by det_add. Without
  // it (normal decode modules) the code below is the merge.
  // The states jfirst, jfirst + jstep, ... (< j1) of one (row, head, 8 dims) unit, kBatch at a time, merged online
  // into (mx, den, acc) (empty: -inf, 0, 0). Past the end a batch reloads the last state (weight 0 below), or with
  // kSkipPast loads nothing there: where a CTA merges thousands of units of a few states each, the reloads' L2
  // requests, not their latency, were the merge's time.
  template <int kBatch, bool kSkipPast = false>
  static __device__ __forceinline__ void merge_states(const Params& p, int qo_head, int d0, int jfirst, int jstep,
                                                      int j1, float (&acc)[8], float& mx, float& den) {
    for (int jb = jfirst; jb < j1; jb += jstep) {
      float l[kBatch];
      float4 u[kBatch], v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (kSkipPast && jb + k >= j1) {
          l[k] = 0.f;
          u[k] = v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
          continue;
        }
        const int j = min(jb + k, j1 - 1);
        const int64_t at = (int64_t)j * p.num_qo_heads + qo_head;
        l[k] = Variant::kUseSoftmax ? __ldcg(p.partial_lse + at) : 0.f;
        const float4* src = reinterpret_cast<const float4*>(p.partial_o + at * kHeadDim + d0);
        u[k] = __ldcg(src);
        v[k] = __ldcg(src + 1);
      }
      float wgt[kBatch];
      if constexpr (Variant::kUseSoftmax) {
        float bm = mx;
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (jb + k < j1) bm = fmaxf(bm, l[k]);
        if (bm == -INFINITY) continue;  // every state so far is empty
        const float rescale = __expf(mx - bm);  // 0 while mx is -inf
        den *= rescale;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= rescale;
        mx = bm;
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          wgt[k] = (jb + k < j1 && l[k] != -INFINITY) ? __expf(l[k] - bm) : 0.f;
          den += wgt[k];
        }
      } else {
#pragma unroll
        for (int k = 0; k < kBatch; ++k) wgt[k] = jb + k < j1 ? 1.f : 0.f;
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (wgt[k] == 0.f) continue;  // an empty state's O is never used (nor one past the end)
        acc[0] += wgt[k] * u[k].x; acc[1] += wgt[k] * u[k].y; acc[2] += wgt[k] * u[k].z; acc[3] += wgt[k] * u[k].w;
        acc[4] += wgt[k] * v[k].x; acc[5] += wgt[k] * v[k].y; acc[6] += wgt[k] * v[k].z; acc[7] += wgt[k] * v[k].w;
      }
    }
  }
  // A merged unit's output (and LSE) from its online state.
  static __device__ __forceinline__ void merge_store(const Params& p, const VariantParams& vp, int q_row, int qo_head,
                                                     int d0, float (&acc)[8], float mx, float den) {
    if constexpr (Variant::kUseSoftmax) {
      const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] *= inv;
      if (p.lse != nullptr && d0 == 0)
        p.lse[(int64_t)q_row * p.lse_stride_row + qo_head] = den > 0.f ? mx + logf(den) : -INFINITY;
    }
    store_out(p, vp, q_row, qo_head, d0, acc);
  }

  // The online states of a unit's `lanes` neighbouring lanes (xor partners within it) combined in every one of
  // them. Every lane of the warp calls it, converged (full-mask shuffles).
  static __device__ __forceinline__ void combine_lanes(int lanes, float (&acc)[8], float& mx, float& den) {
    for (int o = 1; o < lanes; o <<= 1) {
      const float omx = __shfl_xor_sync(0xffffffffu, mx, o), oden = __shfl_xor_sync(0xffffffffu, den, o);
      float oacc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) oacc[e] = __shfl_xor_sync(0xffffffffu, acc[e], o);
      if constexpr (Variant::kUseSoftmax) {
        const float m = fmaxf(mx, omx);
        const float a = m == -INFINITY ? 0.f : __expf(mx - m), b = m == -INFINITY ? 0.f : __expf(omx - m);
        den = den * a + oden * b;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = acc[e] * a + oacc[e] * b;
        mx = m;
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += oacc[e];
      }
    }
  }

  template <int kBatch, bool kDet, int kMaxLanes, class Merged>
  static __device__ __forceinline__ void merge_rows(const Params& p, const VariantParams& vp, int unit, int row0,
                                                    int nrows, Merged merged) {
    static_assert(kMaxLanes >= 1 && kMaxLanes <= 32 && (kMaxLanes & (kMaxLanes - 1)) == 0, "lanes a unit: 2^k <= 32");
    const int32_t* mi = p.plan + p.merge_indptr_offset;
    constexpr int kVecs = kHeadDim / 8;
    const int units = nrows * kHPC * kVecs;
    if constexpr (kMaxLanes > 1) {
      int lanes_log2 = 0;  // deterministic plans fold states in order: one lane a unit
      if (!(kDet && p.deterministic))
        while ((1 << lanes_log2) < kMaxLanes && (units << (lanes_log2 + 1)) <= kThreads) ++lanes_log2;
      if (lanes_log2 > 0) {
        // One pass (units x lanes <= kThreads) in which every thread of every warp reaches the shuffles with the full
        // warp's mask (under a group's own mask, lanes that left the state loop apart took ptxas's slow collective path).
        const int lanes = 1 << lanes_log2;
        const int u = threadIdx.x >> lanes_log2, lane = threadIdx.x & (lanes - 1);
        const int r = u / (kHPC * kVecs);
        const bool live = u < units && merged(r);
        const int q_row = row0 + r;
        const int h = (u / kVecs) % kHPC, d0 = (u % kVecs) * 8;
        const int qo_head = unit * kHPC + h;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        float mx = -INFINITY, den = 0.f;
        if (live) {
          const int j0 = __ldcg(mi + q_row), j1 = __ldcg(mi + q_row + 1);
          merge_states<kBatch>(p, qo_head, d0, j0 + lane * kBatch, lanes * kBatch, j1, acc, mx, den);
        }
        __syncwarp();  // lanes that ran fewer batches wait here, so the shuffles find the warp converged
        combine_lanes(lanes, acc, mx, den);
        if (live && lane == 0) merge_store(p, vp, q_row, qo_head, d0, acc, mx, den);
        return;
      }
    }
    for (int i = threadIdx.x; i < units; i += kThreads) {
      const int r = i / (kHPC * kVecs);
      if (!merged(r)) continue;
      const int q_row = row0 + r;
      const int j0 = __ldcg(mi + q_row), j1 = __ldcg(mi + q_row + 1);
      const int h = (i / kVecs) % kHPC, d0 = (i % kVecs) * 8;
      const int qo_head = unit * kHPC + h;
      if constexpr (kDet) {
        if (p.deterministic) {  // the states kBatch at a time (one L2 round trip), added one by one
          DetAcc a;
          det_start(a);
          for (int jb = j0; jb < j1; jb += kBatch) {
            float l[kBatch];
            float4 u[kBatch], v[kBatch];
#pragma unroll
            for (int k = 0; k < kBatch; ++k) {
              const int64_t at = (int64_t)min(jb + k, j1 - 1) * p.num_qo_heads + qo_head;
              l[k] = Variant::kUseSoftmax ? __ldcg(p.partial_lse + at) : 0.f;
              const float4* src = reinterpret_cast<const float4*>(p.partial_o + at * kHeadDim + d0);
              u[k] = __ldcg(src);
              v[k] = __ldcg(src + 1);
            }
#pragma unroll
            for (int k = 0; k < kBatch; ++k) {
              if (jb + k >= j1) break;
              const float x[8] = {u[k].x, u[k].y, u[k].z, u[k].w, v[k].x, v[k].y, v[k].z, v[k].w};
              det_add(a, l[k], x);
            }
          }
          det_store(p, vp, a, q_row, qo_head, d0);
          continue;
        }
      }
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float mx = -INFINITY, den = 0.f;
      merge_states<kBatch>(p, qo_head, d0, j0, kBatch, j1, acc, mx, den);
      merge_store(p, vp, q_row, qo_head, d0, acc, mx, den);
    }
  }
};

}  // namespace attn
}  // namespace fi
