// Persistent decode attention over the BSR KV format, driven by the plan (csrc/plan.h).
//
// Grid (num_ctas), fixed: CTA c runs work queue c of the plan, all the GPU's CTAs for every head. An
// item runs for its unit: KV head unit / num_head_chunks and the kHeadsPerChunk query heads of chunk
// unit % num_head_chunks that share it (head-group fusion: each KV byte is loaded once for all of them).
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
// Loader: csrc/attention/shared.cuh (the query tile rides in each stage's Q slot).
//
// Splits. An item with partial_base >= 0 writes partial states (float32 O, natural-log LSE) to the
// workspace; the CTA that completes the last chunk of a row (per-row arrival counters, reset by that
// CTA, so the kernel leaves them zeroed for the next launch and CUDA-graph replay) merges the row's
// partial states into the output. No second launch.
//
// Shapes (_SHAPES in fi_backend/shapes.py). Decode is bound by bytes in flight: 8-16 warps per SM (the
// per-warp latency of a 16-token step is what overlaps the loads) read KV at about a device copy's rate,
// and tiles short enough (64 tokens) that a short request's last one is not mostly empty. kv_indices lines
// are prefetched into L2 a few tiles ahead, for fp8 KV's short tiles (without it the next tile's page-id
// loads miss to DRAM on the issue path).
// Measurements: docs/decode.md.
#pragma once

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "shared.cuh"

namespace fi {
namespace decode {

using namespace attn;  // Params, Work, TileRecord, Loader, ... (shared.cuh)

// kDeterministic_: the module runs deterministic plans (docs/deterministic.md): the fold of a whole item's
// pieces and the fold merge of split rows are compiled in only then, so normal modules carry none of it.
template <int kHeadDim_, int kRows_, int kHeadsPerChunk_, class DQ_, class DKV_, int kWarps_, int kStages_,
          int kSub_ = 1, bool kDeterministic_ = false>
struct Config {
  using DQ = DQ_;
  using DKV = DKV_;
  using KV = KvType<DKV>;
  static constexpr int kHeadDim = kHeadDim_;  // the tensors' head size
  // The MMAs and shared-memory rows run a power-of-two width (80 and 96 as 128: the rows' swizzle, k steps in
  // pairs, whole merge passes); the loader fills the pad with zeros and the epilogue stores kHeadDim columns.
  // Decode streams KV: the padded MMAs' extra work hides under the loads.
  static constexpr int kHeadDimPad = kHeadDim <= 64 ? 64 : (kHeadDim <= 128 ? 128 : 256);
  static constexpr int kRows = kRows_;  // packed rows per tile: 8 or 16
  static constexpr int kHeadsPerChunk = kHeadsPerChunk_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLaunchThreads = kThreads;
  static constexpr int kLoaderThreads = kThreads, kLoaderThread0 = 0;  // every thread loads (shared.cuh)
  static constexpr bool kProducer = false;  // no producer warpgroup (shared.cuh)
  static constexpr int kSub = kSub_;  // 16-token blocks per warp per tile
  static constexpr bool kDeterministic = kDeterministic_;  // also read by the loader (shared.cuh)
  static constexpr int kTile = 16 * kSub * kWarps;
  static constexpr bool kFp8 = KV::kFp8;
  static constexpr bool kFragFp8 = kFp8;  // Q.K^T k dimension in the fp8 ldmatrix order
  static constexpr bool kMmaBf16 = KV::kMmaBf16;
  static constexpr bool kQBf16 = sizeof(DQ) == 2 && !std::is_same<DQ, __half>::value;
  static constexpr int kRowBytes = kHeadDimPad * KV::kBytes;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kRowsPerRound = kThreads / kChunksPerRow;  // tile rows one load round covers
  static constexpr int kTokensPerThread = kTile / kRowsPerRound;
  static constexpr int kKSteps = kHeadDimPad / 16;
  static constexpr int kMTiles = kHeadDimPad / 16;
  static constexpr int kRowsPerTile = kRows / kHeadsPerChunk;
  static constexpr int kPackedRows = kRowsPerTile * kHeadsPerChunk;
  static constexpr int kKvTileBytes = kTile * kRowBytes;
  static constexpr int kQSlotBytes = kRows * kHeadDimPad * 2;
  static constexpr int kQBuffers = 1;  // the query rides in each stage's slot (kQSlotBytes)
  static constexpr bool kQCopy = false;  // ... not in a query buffer of the loader's (shared.cuh)
  static constexpr int kStageBytes = (2 * kKvTileBytes + kQSlotBytes + (int)sizeof(TileRecord) + 127) / 128 * 128;
  // Cross-warp merge scratch [warp][row][D / kPasses] float lives in the stage just consumed.
  static constexpr int kScratchBytesFull = kWarps * kRows * kHeadDimPad * 4;
  static constexpr int kPasses = kScratchBytesFull <= 2 * kKvTileBytes ? 1 : (kScratchBytesFull <= 4 * kKvTileBytes ? 2 : 4);
  static constexpr int kPassDim = kHeadDimPad / kPasses;
  static constexpr int kMdBytes = kWarps * kRows * 8;
  static constexpr int kRowOffsetsAt = kStages * kStageBytes + kMdBytes + 16;  // the loader's (shared.cuh)
  static constexpr int kSmemBytes = kRowOffsetsAt + 2 * kTile * 8;
  static __device__ __forceinline__ int tile_offset(int row, int chunk) { return rowmajor_offset<kRowBytes>(row, chunk); }
  // Stage s's tile record: after its K, V and query slot.
  static __device__ __forceinline__ TileRecord* record(uint8_t* smem, int s) {
    return reinterpret_cast<TileRecord*>(smem + s * kStageBytes + 2 * kKvTileBytes + kQSlotBytes);
  }

  static_assert(kHeadDim == 64 || kHeadDim == 80 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 256,
                "head_dim must be 64, 80, 96, 128 or 256");
  static_assert(kRows == 8 || kRows == 16, "packed rows per tile must be 8 or 16");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");
  static_assert(kHeadsPerChunk >= 1 && kHeadsPerChunk <= kRows, "heads per chunk must fit in a tile");
  static_assert(kThreads % kChunksPerRow == 0 && kTile % kRowsPerRound == 0, "loader shape");
  static_assert(kChunksPerRow >= 4, "rows of at least 64 bytes");
  static_assert(kMTiles % (kFp8 ? 2 * kPasses : kPasses) == 0 && kPassDim >= 32, "merge passes");
  static_assert(kKSteps % 2 == 0, "k steps come in pairs");
};

// Dimension of O^T row half `half` (0: c0/c1, 1: c2/c3) of m tile mt held by lane g.
template <bool kFp8>
__device__ __forceinline__ int o_dim(int mt, int half, int g) {
  return kFp8 ? 16 * mt + 2 * g + half : 16 * mt + g + 8 * half;
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
  static constexpr bool kDet = Cfg::kDeterministic;

  using L = Loader<Cfg, Variant, VariantParams>;
  using E = Epilogue<Cfg, Variant, VariantParams>;
  using Cursor = typename L::Cursor;

  // ------------------------------------------------------------------ compute side



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
          const uint32_t u = *reinterpret_cast<const uint32_t*>(qs + pr * Cfg::kHeadDimPad + k_dim<kFp8>(s, j, 0, c));
          const float2 f = ptx::unpack2<Cfg::kQBf16>(u);
          x[s][j][0] = f.x;
          x[s][j][1] = f.y;
        }
      if constexpr (Variant::kHasQueryTransform) {
        const RotaryCtx ctx{ri[hf].q_pos, ri[hf].qo_head, w.request};
        E::rotate_pairs(vp, x, ctx, c, /*is_key=*/false);
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

  // ------------------------------------------------------------------ the kernel

  // finish's (row, 8 dims) units a thread owns: the fold accumulators it keeps across a whole item's pieces.
  static constexpr int kFinishIters = (Cfg::kPackedRows * (Cfg::kPassDim / 8) + kThreads - 1) / kThreads;
  static constexpr int kFoldSlots = kDet ? Cfg::kPasses * kFinishIters : 1;  // normal modules: an unused one
  using DetAcc = typename E::DetAcc;
  // finish's modes: write the (sub-)item's state (output or partial row); deterministic whole items cut
  // into pieces (Work::partial_stride tokens each): fold a piece's state, or fold the last and write the row.
  enum FinishMode { kStore = 0, kFoldPiece = 1, kFoldLast = 2 };

  static constexpr bool kTmaKv = false;  // the launcher encodes no KV maps (attention_module.cu)
  static __device__ __forceinline__ void run(const Params& p, const VariantParams& vp, uint8_t* smem, const KvTma&) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    Cursor cur;
    int page[L::kLookups], slot[L::kLookups];
    if (!L::start(p, vp, smem, cur, page, slot)) return;

    float2* md = reinterpret_cast<float2*>(smem + kStages * Cfg::kStageBytes);  // [warp][row] (m, d)
    int* merge_mask = reinterpret_cast<int*>(smem + kStages * Cfg::kStageBytes + Cfg::kMdBytes);

    // Online-softmax state of the rows this lane holds: S rows g (and g + 8); O^T columns 2c, 2c + 1.
    float m_run[2], d_run[2];
    float o[kMTiles][4], o2[kTwoN ? kMTiles : 1][4];
    uint32_t qa[kKSteps][4];
    RowInfo ri[2];
    float slope[2] = {0.f, 0.f};  // ALiBi (alibi_slope) of rows g and g + 8; padding rows never reach a hook
    const float scale_log2 = p.logits_scale * kLog2e;
    DetAcc fold[kFoldSlots];  // deterministic modules' whole items: the pieces folded so far (finish)
    int next_cut = 0;         // and where their current piece ends (a KV index)
    // A fresh online-softmax state: at a (sub-)item's first tile, and after each piece a whole item folds.
    auto reset = [&]() {
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
    };

    for (int j = 0;; ++j) {
      const int st = j % kStages;
      uint8_t* stage = smem + st * Cfg::kStageBytes;
      L::before_barrier(p, smem, j, cur, page, slot);
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      L::step(p, vp, smem, j, cur, page, slot);

      const TileRecord* rec = Cfg::record(smem, st);
      const int flags = rec->flags;
      if (flags & kEnd) break;
      const Work& w = rec->w;
      const int kv_head = kv_head_of(p, w.unit);  // for the hooks' contexts (unused ones cost nothing)
      if (flags & kFirst) {
        ri[0] = E::row_info(w, g);
        ri[1] = E::row_info(w, g + 8);
        if constexpr (Variant::kHasAlibiSlope) {
#pragma unroll
          for (int h = 0; h < 2; ++h) slope[h] = ri[h].valid ? Variant::alibi_slope(vp, ri[h].qo_head) : 0.f;
        }
        load_q(vp, stage, w, ri, qa);
        reset();
        if constexpr (kDet) {
#pragma unroll
          for (int f = 0; f < kFoldSlots; ++f) E::det_start(fold[f]);
          if (p.deterministic && w.partial_base < 0)  // the first multiple of the piece length past the first tile
            next_cut = (rec->tile_kv_begin / w.partial_stride + 1) * w.partial_stride;
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
            E::rotate_pairs(vp, x, RotaryCtx{w.pos_off + kv_idx, kv_head, w.request}, c, /*is_key=*/true);
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
        // A row half's keys in this block: its logit (8 nt + e % 2) is a key while it is below room[hf] (the
        // tile's keys, the causal limit, none for a padding row), one compare a logit and no branch
        int room[2];
#pragma unroll
        for (int hf = 0; hf < kHalves; ++hf) {
          const int cut = p.causal ? min(n_valid, ri[hf].climit - tile_begin + 1) : n_valid;
          room[hf] = ri[hf].valid ? cut - (tb + 2 * c) : 0;
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2 * kHalves; ++e) {
            const int hf = e >> 1;
            const int t = tb + 8 * nt + 2 * c + (e & 1);
            const int kv_idx = tile_begin + t;
            bool ok = 8 * nt + (e & 1) < room[hf];
            const float x = s[nt][e] * p.logits_scale;
            constexpr bool kNatural = Variant::kHasLogitsTransform || Variant::kHasAlibiSlope;  // not raw S
            LogitsCtx ctx;
            if constexpr (Variant::kHasLogitsMask || kNatural) {
              const float rel = (float)(w.pos_off + kv_idx - ri[hf].q_pos);  // memory-bound: converted here
              ctx = LogitsCtx{w.request, ri[hf].q_row, ri[hf].q_idx, ri[hf].q_pos, kv_idx, w.pos_off + kv_idx,
                              ri[hf].qo_head, kv_head, w.q_len, w.kv_len, rel, rel, 0.f};
            }
            if constexpr (Variant::kHasLogitsMask) ok = ok && Variant::logits_mask(vp, ctx);
            float y;
            if constexpr (Variant::kUseSoftmax) {
              if constexpr (kNatural) {  // the LogitsTransform, then ALiBi (softmax variants only)
                float z = x;
                if constexpr (Variant::kHasLogitsTransform) z = Variant::logits_transform(vp, z, ctx);
                if constexpr (Variant::kHasAlibiSlope) z = fmaf(slope[hf], ctx.rel_pos, z);
                y = ok ? z * kLog2e : -INFINITY;
              } else {
                y = ok ? s[nt][e] * scale_log2 : -INFINITY;
              }
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

      if constexpr (kDet) {
        // A deterministic whole item (partial_stride: its piece length, a multiple of kTile) folds each piece
        // as the merge of its split pieces would (docs/deterministic.md).
        const bool pieces = p.deterministic && w.partial_base < 0;
        const bool piece_end = pieces && !(flags & kLast) && rec->tile_kv_begin + kTile == next_cut;
        if (piece_end) next_cut += w.partial_stride;
        if ((flags & kLast) || piece_end) {
          finish(p, vp, stage, w, warp, lane, m_run, d_run, o, o2, md, merge_mask, fold,
                 !pieces ? kStore : piece_end ? kFoldPiece : kFoldLast);
          if (piece_end) reset();
        }
      } else if (flags & kLast) {
        finish(p, vp, stage, w, warp, lane, m_run, d_run, o, o2, md, merge_mask, fold, kStore);
      }
    }
  }

  // End of a (sub-)item or of a piece: merge the warps' states, normalise, then (mode) write out or to
  // partial rows and merge completed split rows, or fold into `fold`. `stage` (the tile just consumed) is
  // the scratch.
  template <int kO2>
  static __device__ __forceinline__ void finish(const Params& p, const VariantParams& vp, uint8_t* stage, const Work& w,
                                                int warp, int lane, float (&m_run)[2], float (&d_run)[2],
                                                float (&o)[kMTiles][4], float (&o2)[kO2][4], float2* md,
                                                int* merge_mask, DetAcc (&fold)[kFoldSlots], int mode) {
    const int g = lane >> 2, c = lane & 3;
    constexpr int kHalves = kTwoN ? 2 : 1;
#pragma unroll
    for (int hf = 0; hf < kHalves; ++hf) {
      d_run[hf] += __shfl_xor_sync(0xffffffffu, d_run[hf], 1);
      d_run[hf] += __shfl_xor_sync(0xffffffffu, d_run[hf], 2);
    }
    // Work is read from the record below, after the scratch overwrote nothing of it (it is past K/V/Q).
    const int row0 = w.row0, nrows = w.nrows, partial_base = w.partial_base, partial_stride = w.partial_stride;
    const int item_q_begin = w.item_q_begin, unit = w.unit;
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
      // (packed row, 8 dims) units, kThreads apart: kFinishIters at most a thread. Deterministic modules unroll
      // them (unit `it` folds into its own slot); normal ones keep the plain strided loop.
#pragma unroll(kDet ? kFinishIters : 1)
      for (int it = 0, next = threadIdx.x; kDet ? it < kFinishIters : next < Cfg::kPackedRows * kVecs;
           ++it, next += kThreads) {
        const int i = kDet ? threadIdx.x + it * kThreads : next;
        if (kDet && i >= Cfg::kPackedRows * kVecs) break;
        const int pr = i / kVecs, dl = (i % kVecs) * 8;
        const int r = pr / kHPC;
        const int d0 = pass * kPassDim + dl;
        if (r >= nrows || d0 >= kHeadDim) continue;  // a padding row, or the pad of an 80 / 96 head
        const int q_row = row0 + r, qo_head = unit * kHPC + pr % kHPC;
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
        if constexpr (kDet) {
          if (mode != kStore) {  // the piece's state, exactly as a split piece writes it, folded
            DetAcc& a = fold[pass * kFinishIters + it];
            E::det_add(a, lse_val, acc);
            if (mode == kFoldLast) E::det_store(p, vp, a, q_row, qo_head, d0);
            continue;
          }
        }
        if (!split) {
          E::store_out(p, vp, q_row, qo_head, d0, acc);
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
    if (!split || mode != kStore) return;

    // Arrival: the CTA that writes the last chunk of a row merges it (threadfence reduction pattern).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const int32_t* mi = p.plan + p.merge_indptr_offset;
      int mask = 0;
      for (int r = 0; r < nrows; ++r) {
        const int q_row = row0 + r;
        const int chunks = __ldg(mi + q_row + 1) - __ldg(mi + q_row);
        int32_t* counter = E::merge_counter(p, q_row, unit);
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
      E::template merge_rows<8, kDet, 8>(p, vp, unit, row0, nrows, [mask](int r) { return (mask >> r) & 1; });
    }
  }
};

}  // namespace decode
}  // namespace fi
