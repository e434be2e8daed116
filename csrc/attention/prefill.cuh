// Persistent prefill / append attention over the BSR KV format, driven by the plan (csrc/plan.h):
// FlashAttention-2 on tensor cores for query tiles of many rows, sharing the decode kernel's loader,
// plan reading, variant hooks and split merge (csrc/attention/shared.cuh).
//
// Grid (num_ctas), fixed, as for decode: CTA c runs work queue c of the plan; an item runs for its unit,
// KV head unit / num_head_chunks and its kHeadsPerChunk query heads (head-group fusion:
// a query tile of kTileRows = 16 * kMFrags * kWarps "packed rows", packed row = local row * kHPC +
// local head, so short queries of a GQA group fill the tile and each KV tile is loaded once for all
// its heads).
//
// Tiles. Warp w owns packed rows [16 kMF w, 16 kMF (w + 1)) of the query tile (kMF m fragments) and
// the whole KV tile (kTile tokens per stage): no cross-warp reduction. mma.sync m16n8k16, fp32 acc.:
//   S [16 x kTile] = Q [16 x D] . K^T     A = Q (ldmatrix from the CTA's Q buffer), B = K (ldmatrix)
//   O [16 x D]    += P [16 x kTile] . V    A = P (the C fragment of S, repacked), B = V (ldmatrix.trans)
// Every warp reads the whole K and V tile from shared memory; two m fragments per warp (each K/V
// fragment feeds two MMAs) halve those reads. That fits in 255 registers at head_dim 128 once the
// loader keeps little state (one page lookup per KV row, published through shared memory; the cursor
// holds only what the loader needs). The shared-memory reads of the fragments bound this path.
//
// Hopper (Cfg::kWgmma, sm_90a): the same loop with warpgroup MMAs (wgmma.cuh). A warpgroup's 4 warps
// step through the tile together; its fragment mf is one m64 MMA (warp w holds rows 16 (w % 4) of it,
// in the layout above, so masks, softmax, variants and the epilogue are shared). S = Q K^T reads Q and
// K from shared memory through descriptors, O += P V takes P from registers and V from shared memory:
// the tensor cores read the operands themselves, without the per-warp ldmatrix traffic. For variants
// without a QueryTransform or logits hooks, the loader copies each sub-item's query tile with its first
// KV tile into a query buffer (Cfg::kQBuffers), so the queries' global-memory latency no longer
// stalls every warp at each sub-item's start. The loader and
// the fp8 / RoPE pass write 16-bit tiles in wgmma's 128-byte-swizzled column blocks (Cfg::tile_offset);
// shared memory written by ordinary stores or cp.async is fenced into the async proxy before the
// barrier that publishes it. With two fragments a warpgroup overlaps one fragment's softmax with the
// other's MMAs (compute_tile). Without a producer warpgroup (below) the H100 family runs 16 warps x 1
// fragment instead (four warpgroups hide each other's MMA -> softmax -> MMA latency better, even where
// variants spill); with one, 8 x 2 (no logits hooks, or a mask that is the KV range) and 12 x 1 (other
// logits hooks; fi_backend/shapes.py).
// Warp-specialised (Cfg::kProducer, the default for 16-bit KV without Q/K transforms: fi_backend/shapes.py,
// _PREFILL_WS_MEMBER0): a producer warpgroup runs the loader (Loader::produce) and hands stages over
// through full / empty mbarriers, so there is no CTA barrier per tile: a warpgroup with less to do in a
// tile (causal diagonal, window edges) runs up to kStages tiles ahead, and the compute warps never issue
// copies or page lookups. setmaxnreg gives the compute warps the registers the producer does not need
// (8 x 2 fragments at 232, 12 x 1 at 152). Its two query buffers are released through barriers, not
// tied to the stages, so 8 x 2 runs three 32 KB stages.
// Whole tiles of consecutive tokens go by TMA (shared.cuh, Loader::produce; FI_BACKEND_KV_TMA=0 turns it
// off); scattered pages are gathered with cp.async.
// Row sums by MMA (Cfg::kRowSumMma, the default with wgmma): the softmax's denominators come from one
// m64n8k16 MMA of P against ones per 16 tokens, issued beside P.V, instead of an FADD a probability.
// ptxas serialises every wgmma of the kernel when one is in flight across the loop (C7513, C7514, C7518)
// or issued under a branch (C7520): keep each step's wgmmas inside it and unconditional.
// What was tried against these shapes and lost (FA3's intra- and inter-warpgroup overlaps, ping-pong, a
// deferred P.V, exponentials on the FMA pipe, ...): docs/prefill.md.
// MMAs run in the query's type. fp8 KV and key transforms (RoPE) go through one pass over the landed
// tile: fp8 is converted exactly into a 16-bit copy (e4m3 and e5m2 are exact in bf16 and fp16), a
// KeyTransform rotates K in fp32 in that pass; the per-tensor scales fold into the logits scale and
// the output.
//
// Masks. Causal steps past a unit's last row are skipped (the loader already stops at the sub-item's
// last row); the per-element mask runs only on steps that need it: the diagonal of a causal tile, the
// last partial tile, a variant with a LogitsMask, or for a mask that is the variant's KV range (a
// sliding window), a step across some row's range edge; a step outside every row's range is skipped.
#pragma once

#include <limits.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "shared.cuh"
#include "wgmma.cuh"

namespace fi {
namespace prefill {

using namespace attn;  // Params, Work, TileRecord, Loader, Epilogue (shared.cuh)

template <int kHeadDim_, int kHeadsPerChunk_, class DQ_, class DKV_, int kWarps_, int kMFrags_, int kTileKv_,
          int kStages_, int kStepKv_, bool kWgmma_ = false, int kQBuffers_ = 1, bool kProducer_ = false,
          bool kRowSumMma_ = false, bool kBiasMma_ = false, bool kOverlap_ = false, bool kPingPong_ = false>
struct Config {
  using DQ = DQ_;
  using DKV = DKV_;
  using KV = KvType<DKV>;
  static constexpr int kHeadDim = kHeadDim_;  // the tensors' head size: the MMAs' k steps and O's columns
  // Shared-memory rows are kHeadDimPad wide (80 and 96 as 128: whole 64-column blocks for wgmma's swizzle,
  // 16-byte chunks a power of two for the loader's rows); the pad columns are never read by an MMA.
  static constexpr int kHeadDimPad = (kHeadDim + 63) / 64 * 64;
  static constexpr int kHeadsPerChunk = kHeadsPerChunk_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;  // the compute warps
  // Warp-specialised (kProducer): a producer warpgroup after the kWarps compute warps walks the plan and
  // issues the tiles (Loader::produce), stages handed over through full / empty mbarriers; the compute
  // warps never wait for each other per tile. setmaxnreg moves registers from the producer to them.
  static constexpr bool kProducer = kProducer_;
  static constexpr int kLaunchThreads = kThreads + (kProducer ? 128 : 0);
  // The softmax's row sums by the tensor cores (wgmma): P . ones [kStep x 8] beside each P.V, one m64n8
  // MMA a 16-token k step, instead of an FADD a probability in the compute warps (about a ninth of their
  // instructions). The sum is then of the P the
  // P.V sees (rounded to 16 bits), and every lane of a row's quad holds the whole row's sum.
  static constexpr bool kRowSumMma = kRowSumMma_;
  // A variant's ALiBi bias (alibi_slope) by the tensor cores (wgmma): S += A . B with A the rows' slope /
  // logits scale (16-bit hi + lo at k 0 and 1, Kernel::bias_setup) and B the step's column indices (token
  // t's k 0 and 1 are t, exact in 16 bits): one m64 k16 MMA after Q.K^T adds slope * column, and
  // slope * (step start - query position) is a per-row offset of the softmax. Without it the bias takes
  // two FFMAs an element, 64 of a compute warp's ~300 instructions a step at 12 x 1. A from registers
  // (the rs form) made ptxas serialise the wgmmas at 8 x 2 (C7512); A from shared memory costs 128 bytes
  // a warpgroup, its 8 rows repeated for all 64 (a zero stride between row blocks). Heads per chunk must
  // divide 8 (a row block's heads) and the named barriers fit (kBiasBar).
  static constexpr bool kBiasMma = kBiasMma_;
  // FlashAttention-3's consumer loop (Kernel::consume_overlap): one m64 fragment a warpgroup, a compute step
  // the whole KV tile; QK^T of tile j and the deferred P.V of tile j - 1 issued together, tile j's softmax
  // while P.V runs, no wgmma in flight across the loop. V of tile j - 1 is held through tile j, so three
  // stages; the producer copies the query tiles (kQCopy), into one buffer where two do not fit (head size 128).
  static constexpr bool kOverlap = kOverlap_;
  // ... and FlashAttention-3's inter-warpgroup ping-pong (kOverlap's two consumer warpgroups): they issue their
  // MMAs in turns on two named barriers (kSchedBar, kSchedBar + 1), so one's softmax runs while the other's
  // MMAs hold the tensor cores.
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kSchedBar = 4;
  static constexpr int kLoaderThreads = kProducer ? 128 : kThreads;
  static constexpr int kLoaderThread0 = kProducer ? kThreads : 0;
  // Registers a thread (multiples of 8). The CTA's pool is what it launched with (64K / threads a thread,
  // rounded down to 8, as ptxas allocates under __launch_bounds__(threads, 1)); setmaxnreg only moves
  // registers within it (an increase beyond what the producer gave back waits forever). The compute
  // warps' share after 40 for the producer, at most 240 (216 in the overlapped loop, whose consumers use
  // fewer than 200: its producer, which copies the query tiles too, then keeps 72 and does not spill); the
  // producer then takes what is left (it keeps the cursor and the copy addresses). Only where the
  // launch leaves fewer than 240 a thread (384 threads and more): else every warp has enough.
  static constexpr bool kMoveRegs = kProducer && kLaunchThreads >= 384;
  static constexpr int kEntryRegs = (65536 / kLaunchThreads > 255 ? 255 : 65536 / kLaunchThreads) / 8 * 8;
  static constexpr int kRegPool = kEntryRegs * kLaunchThreads;
  static constexpr int kComputeRegsFit = (kRegPool - 128 * 40) / kThreads / 8 * 8;
  static constexpr int kComputeRegsMax = kOverlap ? 216 : 240;
  static constexpr int kComputeRegs = kComputeRegsFit > kComputeRegsMax ? kComputeRegsMax : kComputeRegsFit;
  static constexpr int kProducerRegs = (kRegPool - kThreads * kComputeRegs) / 128 / 8 * 8;
  static_assert(!kMoveRegs || (kProducerRegs >= 24 && kProducerRegs <= kEntryRegs && kComputeRegs >= kEntryRegs &&
                               kThreads * kComputeRegs + 128 * kProducerRegs <= kRegPool),
                "setmaxnreg: registers moved within the CTA's pool");
  static constexpr int kStages = kStages_;
  static constexpr int kTile = kTileKv_;  // KV tokens per stage
  static constexpr int kStep = kStepKv_;  // KV tokens per compute step (S registers: 4 kMFrags kStep / 8)
  static constexpr int kMFrags = kMFrags_;  // 16-row m fragments per warp
  static constexpr int kTileRows = 16 * kMFrags * kWarps;
  // Hopper warpgroup MMAs (wgmma.cuh) instead of mma.sync: a warpgroup's 4 warps step through the KV
  // tile together (a unit), each of its kMFrags fragments one m64 MMA; K, V and Q in shared memory in
  // wgmma's column-block layout.
  static constexpr bool kWgmma = kWgmma_;
  static constexpr int kUnitWarps = kWgmma ? 4 : 1;
  static constexpr int kUnitRows = 16 * kMFrags * kUnitWarps;
  static constexpr int kRowsPerTile = kTileRows / kHeadsPerChunk;  // query rows per sub-item
  static constexpr int kPackedRows = kRowsPerTile * kHeadsPerChunk;
  static constexpr int kRows = 0;        // no query slot in the stages: warps load their Q rows
  static constexpr int kQSlotBytes = 0;
  static constexpr bool kFp8 = KV::kFp8;
  static constexpr bool kFragFp8 = false;  // MMAs see 16-bit K/V in natural order
  static constexpr bool kQBf16 = sizeof(DQ) == 2 && !std::is_same<DQ, __half>::value;
  static constexpr bool kMmaBf16 = kQBf16;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kRowBytes = kHeadDimPad * KV::kBytes;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kRowsPerRound = kLoaderThreads / kChunksPerRow;
  static constexpr int kTokensPerThread = (kTile + kRowsPerRound - 1) / kRowsPerRound;  // last round partial (12 warps)
  static constexpr int kKvTileBytes = kTile * kRowBytes;
  static constexpr int kCRowBytes = kHeadDimPad * 2;  // the 16-bit copy of a converted tile
  static constexpr int kCChunksPerRow = kCRowBytes / 16;
  static constexpr int kCTileBytes = kTile * kCRowBytes;
  static constexpr int kStageAlign = kWgmma ? 1024 : 128;  // wgmma's swizzle atoms are 1024-byte aligned
  // A stage is its K and V tiles only (the tile records live apart, kRecordsAt): at 8 x 2, three 32 KB
  // stages then fit beside two 64 KB query buffers (a record per stage would round each up to 33 KB).
  static constexpr int kStageBytes = (2 * kKvTileBytes + kStageAlign - 1) / kStageAlign * kStageAlign;
  static constexpr int kConvertBytes = kFp8 ? 2 * kCTileBytes : 0;
  static constexpr int kQRowBytes = kHeadDimPad * 2;  // the query tile, [kTileRows][D], swizzled
  static constexpr int kQChunksPerRow = kQRowBytes / 16;
  static constexpr int kQBytes = kTileRows * kQRowBytes;
  // Split sub-items whose arrivals wait (Kernel::arrive): one fence and one round of row counters for up to
  // kDefer of them, not one each (each one's fence and counter round trip stalled every compute warp).
  // Not beside the bias MMA's operands: at 8 x 2 they leave 16 bytes of shared memory.
  static constexpr int kDefer = kBiasMma ? 1 : 8;
  // A bit a row of each waiting sub-item (slot k * kTileRows + r): the rows whose merge this CTA owns.
  static constexpr int kFlagBytes = (kDefer * kTileRows / 8 + 15) / 16 * 16;
  static constexpr int kDeferBytes = kDefer * 16;  // the waiting sub-items: row0, nrows, unit each
  static constexpr int kQAt = kStages * kStageBytes;
  // wgmma reads Q from shared memory, so the loader can copy the next sub-item's query tile with its first
  // KV tile (kQBuffers > 1; shared.cuh): its global-memory latency then overlaps the current sub-item
  // instead of stalling every warp at each sub-item's start. Without a producer, one buffer per stage;
  // with one, two or more, each released by the compute warps through a barrier when its sub-item ends.
  // Else (1) the warps load Q themselves (load_q). fi_backend/shapes.py (_prefill_q_buffers) decides.
  static constexpr int kQBuffers = kQBuffers_;
  // Whether the loader copies the query tiles (shared.cuh): with more than one buffer, or in the overlapped
  // consumer loop (kOverlap), whose single buffer at head size 128 the compute warps release after their last
  // QK^T of a sub-item, not at its end (Kernel::consume_overlap): the producer copies the next sub-item's query
  // tile while they finish this one.
  static constexpr bool kQCopy = kQBuffers > 1 || kOverlap;
  // The extra MMAs' constant operands, no swizzle (wgmma::desc_plain), after the query buffers. The bias MMA's
  // (kBiasMma): each compute warpgroup's A block (8 rows of 16 bytes, Kernel::bias_setup); 128 zero bytes,
  // A's k 8-15; B, kStep rows of 16 bytes at kBiasKAt (k 8-15 read the next 8 rows, and after the last the
  // ones: finite, and A is zero there). Then the row-sum MMA's B: 16 x 8 ones, 256 bytes. compute-sanitizer
  // counts an operand's dense extent from its start (2 KB for the A and B of an m64 n64 k16 MMA, though
  // the descriptors' strides read 256 and 1152 bytes), so these sit before the flags, records, row offsets
  // and barriers, not at the end. (The 1408 bytes at 8 x 2 are why the merge flags are bits.)
  static constexpr int kBiasAt = kQAt + kQBuffers * kQBytes + kConvertBytes;
  static constexpr int kBiasZeroAt = kBiasAt + 128 * (kWarps / 4);
  static constexpr int kBiasKAt = kBiasZeroAt + 128;
  static constexpr int kOnesAt = kBiasMma ? kBiasKAt + kStep * 16 : kBiasAt;
  static constexpr int kFlagsAt = kOnesAt + (kRowSumMma || kBiasMma ? 256 : 0);
  static constexpr int kDeferAt = kFlagsAt + kFlagBytes;
  static constexpr int kRecordsAt = kDeferAt + kDeferBytes;
  static constexpr int kRowOffsetsAt = kRecordsAt + kStages * (int)sizeof(TileRecord);
  // After the loader's row offsets (shared.cuh) and, warp-specialised, its TMA votes (two tiles x 4 warps).
  static constexpr int kBarriersAt = kRowOffsetsAt + 2 * kTile * 8 + (kProducer ? 32 : 0);
  // full[kStages], empty[kStages], qempty[kQBuffers] mbarriers
  static constexpr int kSmemBytes = kBarriersAt + (kProducer ? 16 * kStages + 8 * kQBuffers : 0);
  // Named barriers: 8 the compute side's, 9 the producer's; bias_setup's kBiasBar + warpgroup.
  static constexpr int kBiasBar = 10 + kWarps / 4;
  static_assert(sizeof(TileRecord) % 8 == 0 && kRecordsAt % 16 == 0, "tile records, row offsets: 8-byte aligned");

  static_assert(kHeadDim == 64 || kHeadDim == 80 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 256,
                "head_dim must be 64, 80, 96, 128 or 256");
  static_assert(!kRowSumMma || kWgmma, "row sums by MMA: warpgroup MMAs");
  static_assert(!kBiasMma || (kWgmma && 8 % kHeadsPerChunk == 0 && kBiasBar + kWarps / 4 <= 16),
                "the ALiBi bias by MMA: warpgroup MMAs, heads per chunk dividing 8, at most 12 compute warps");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");
  static_assert(kTileRows % 32 == 0 && kDefer >= 1, "merge flags: whole words a waiting sub-item");
  static_assert(kQBuffers == 1 || (kWgmma && (kQBuffers == kStages || (kProducer && kQBuffers >= 2))),
                "query buffers: 1, one per stage (wgmma), or 2 or more released through barriers (producer)");
  static_assert(kHeadsPerChunk >= 1 && kHeadsPerChunk <= kTileRows, "heads per chunk must fit in a tile");
  static_assert(kTile >= 16 && (kTile & (kTile - 1)) == 0, "KV tile: a power of two >= 16 (16-token blocks, tree max)");
  static_assert(kStep >= 16 && (kStep & (kStep - 1)) == 0 && kTile % kStep == 0, "compute step: a power of two dividing the tile");
  static_assert(kLoaderThreads % kChunksPerRow == 0, "loader shape");
  static_assert(!kProducer || (kWgmma && (kQBuffers >= 2 || kOverlap) && !kFp8),
                "warp-specialised: wgmma, the loader's query copy, 16-bit KV (no conversion pass)");
  static_assert(kChunksPerRow >= 4, "rows of at least 64 bytes");
  static_assert(!kOverlap || (kProducer && kMFrags == 1 && kStep == kTile && kStages >= 3 && !kRowSumMma &&
                              !kBiasMma && kHeadDim % 16 == 0),
                "overlapped consumers: producer, one fragment, a step per tile, three stages, row sums by FADD");
  static_assert(!kPingPong || (kOverlap && kWarps == 8), "ping-pong: the overlapped loop's two consumer warpgroups");
  static_assert(!kWgmma || (kWarps % 4 == 0 && (kStep == 32 || kStep == 64 || kStep == 128 || kStep == 256)),
                "wgmma: whole warpgroups, a compute step of 32, 64, 128 or 256 tokens (the MMA's n)");

  // Where 16-byte chunks live: the loaded tile (fp8 tiles are converted before any MMA reads them),
  // the 16-bit tile the MMAs read, the query tile.
  static __device__ __forceinline__ int tile_offset(int row, int chunk) {
    if constexpr (kWgmma && !kFp8) return colblock_offset<kTile>(row, chunk);
    else return rowmajor_offset<kRowBytes>(row, chunk);
  }
  static __device__ __forceinline__ int mma_offset(int row, int chunk) {
    if constexpr (kWgmma) return colblock_offset<kTile>(row, chunk);
    else return rowmajor_offset<kCRowBytes>(row, chunk);
  }
  // Warpgroup u's A block of the bias MMA.
  static __device__ __forceinline__ int bias_a(int u) { return kBiasAt + 128 * u; }
  // Stage s's tile record.
  static __device__ __forceinline__ TileRecord* record(uint8_t* smem, int s) {
    return reinterpret_cast<TileRecord*>(smem + kRecordsAt) + s;
  }
  static __device__ __forceinline__ int q_offset(int row, int chunk) {
    if constexpr (kWgmma) return colblock_offset<kTileRows>(row, chunk);
    else return rowmajor_offset<kQRowBytes>(row, chunk);
  }
};

template <class Cfg, class Variant, class VariantParams>
struct Kernel {
  using DQ = typename Cfg::DQ;
  using L = Loader<Cfg, Variant, VariantParams>;
  using E = Epilogue<Cfg, Variant, VariantParams>;
  using Cursor = typename L::Cursor;
  static constexpr int kThreads = Cfg::kThreads;
  static constexpr int kTile = Cfg::kTile;
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kHeadDim = Cfg::kHeadDim;
  static constexpr int kHPC = Cfg::kHeadsPerChunk;
  static constexpr int kKSteps = Cfg::kKSteps;
  static constexpr int kMF = Cfg::kMFrags;
  static constexpr int kDTiles = kHeadDim / 8;  // n tiles of O
  static constexpr int kStep = Cfg::kStep;
  static constexpr int kNTiles = kStep / 8;     // n tiles of S
  static constexpr int kTPT = Cfg::kTokensPerThread;
  static constexpr bool kFp8 = Cfg::kFp8;
  static constexpr bool kBf16 = Cfg::kMmaBf16;
  static constexpr bool kConvert = kFp8 || Variant::kHasKeyTransform;
  static constexpr bool kWgmma = Cfg::kWgmma;
  static constexpr bool kRowSum = Cfg::kRowSumMma && Variant::kUseSoftmax;  // row sums by MMA (Cfg::kRowSumMma)
  // ALiBi (the variant's alibi_slope): by MMA and per-row offsets (Cfg::kBiasMma), else per element with
  // the LogitsTransform, in natural units.
  static constexpr bool kAlibi = Variant::kHasAlibiSlope;
  static constexpr bool kBias = Cfg::kBiasMma;
  static_assert(!kBias || (kAlibi && Variant::kUseSoftmax && !Variant::kHasLogitsTransform),
                "the ALiBi bias by MMA: an alibi_slope, softmax, no LogitsTransform (which would see the bias)");
  static constexpr bool kTransform = Variant::kHasLogitsTransform || (kAlibi && !kBias);
  static constexpr bool kTmaKv = Cfg::kProducer;  // the producer copies whole contiguous tiles by TMA (shared.cuh)
  static constexpr int kUnitWarps = Cfg::kUnitWarps;

  // First packed row of m fragment mf of warp `warp` (16 rows). mma.sync: a warp's fragments are
  // consecutive; wgmma: fragment mf of warpgroup u is one m64 MMA, the warp's rows 16 (warp % 4) of it.
  static __device__ __forceinline__ int frag_row0(int warp, int mf) {
    if constexpr (kWgmma) return wg_frag_row0(warp >> 2, mf) + 16 * (warp & 3);
    else return 16 * (kMF * warp + mf);
  }
  // wgmma: first packed row of warpgroup `unit`'s fragment mf (64 rows, one m64 MMA).
  static __device__ __forceinline__ int wg_frag_row0(int unit, int mf) { return 64 * (kMF * unit + mf); }

  // The bias MMA's operands at a sub-item's start (kBias): warpgroup u's A block (Cfg::bias_a) gets row r =
  // slope / scale of head r % kHPC as hi + lo in the MMA's type (relative error 2^-17 with bf16: the bias of
  // a token that matters, within a few dozen of its row's maximum, is exact to 1e-3) at k 0 and 1, zeros
  // after; its 8 rows serve all 64 of a fragment (heads per chunk divide 8). The warpgroup's own MMAs of the
  // last sub-item are over (compute_tile waits for them); a named barrier publishes the rows to its warps.
  // Returns this lane's rows' slope in log2 units (rows g and g + 8 of every fragment: head g % kHPC).
  static __device__ __forceinline__ float bias_setup(const Params& p, const VariantParams& vp, const Work& w,
                                                    uint8_t* smem) {
    const int u = threadIdx.x >> 7, r = threadIdx.x & 127;
    if (r < 8) {
      const float v = Variant::alibi_slope(vp, w.unit * kHPC + r % kHPC) / p.logits_scale;
      const float hi = ptx::unpack2<kBf16>(ptx::pack2<kBf16>(v, 0.f)).x;
      *reinterpret_cast<uint4*>(smem + Cfg::bias_a(u) + 16 * r) = make_uint4(ptx::pack2<kBf16>(v, v - hi), 0u, 0u, 0u);
      wgmma::fence_proxy_async();
    }
    ptx::bar_sync(Cfg::kBiasBar + u, 128);
    return Variant::alibi_slope(vp, w.unit * kHPC + ((threadIdx.x & 31) >> 2) % kHPC) * kLog2e;
  }



  // This warp's query rows from global memory into its slice of the Q buffer (row-major, swizzled 16-byte
  // chunks, zeros for padding rows), QueryTransform applied in fp32 on the way. Lanes read the pairs of
  // the A-fragment layout, where (d, d + D/2) pairs meet in one lane (see Epilogue::rotate_pairs).
  static __device__ __forceinline__ void load_q(const Params& p, const VariantParams& vp, const Work& w,
                                                uint8_t* qbuf) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int h16 = 0; h16 < 2 * kMF; ++h16) {  // rows g + 8 h16 of the warp's 16 kMF rows
      const int pr = frag_row0(warp, h16 >> 1) + 8 * (h16 & 1) + g;
      const RowInfo ri = E::row_info(w, pr);
      float x[kKSteps][2][2];
      const DQ* src = static_cast<const DQ*>(p.q) + (int64_t)ri.q_row * p.q_stride_row + (int64_t)ri.qo_head * p.q_stride_head;
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t u = ri.valid ? __ldg(reinterpret_cast<const uint32_t*>(src + k_dim<false>(s, j, 0, c))) : 0u;
          const float2 f = ptx::unpack2<Cfg::kQBf16>(u);
          x[s][j][0] = f.x;
          x[s][j][1] = f.y;
        }
      if constexpr (Variant::kHasQueryTransform) {
        if (ri.valid) E::rotate_pairs(vp, x, RotaryCtx{ri.q_pos, ri.qo_head, w.request}, c, false);
      }
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int d = k_dim<false>(s, j, 0, c);
          *reinterpret_cast<uint32_t*>(qbuf + Cfg::q_offset(pr, d >> 3) + (d & 7) * 2) =
              ptx::pack2<kBf16>(x[s][j][0], x[s][j][1]);
        }
    }
    if constexpr (kWgmma) {  // the warpgroup's MMAs read all four warps' rows, through the async proxy
      wgmma::fence_proxy_async();
      ptx::bar_sync(1 + (warp >> 2), 128);
    } else {
      __syncwarp();
    }
  }

  // ------------------------------------------------------------------ fp8 / KeyTransform pass

  // 8 consecutive dims [8 dc, 8 dc + 8) of tile row `row` as floats.
  static __device__ __forceinline__ void read8(const uint8_t* tile, int row, int dc, float (&x)[8]) {
    uint32_t w[4];
    if constexpr (kFp8) {
      const uint2 u = *reinterpret_cast<const uint2*>(tile + Cfg::tile_offset(row, dc >> 1) + (dc & 1) * 8);
      w[0] = ptx::fp8x2_to_f16x2<Cfg::KV::kE5m2>(u.x);
      w[1] = ptx::fp8x2_to_f16x2<Cfg::KV::kE5m2>(u.x >> 16);
      w[2] = ptx::fp8x2_to_f16x2<Cfg::KV::kE5m2>(u.y);
      w[3] = ptx::fp8x2_to_f16x2<Cfg::KV::kE5m2>(u.y >> 16);
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(tile + Cfg::tile_offset(row, dc));
      w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = ptx::unpack2<kFp8 ? false : kBf16>(w[k]);
      x[2 * k] = f.x;
      x[2 * k + 1] = f.y;
    }
  }

  static __device__ __forceinline__ void write8(uint8_t* tile, int row, int dc, const float (&x)[8]) {
    const uint4 u = make_uint4(ptx::pack2<kBf16>(x[0], x[1]), ptx::pack2<kBf16>(x[2], x[3]),
                               ptx::pack2<kBf16>(x[4], x[5]), ptx::pack2<kBf16>(x[6], x[7]));
    *reinterpret_cast<uint4*>(tile + Cfg::mma_offset(row, dc)) = u;
  }

  // The landed tile's K (and V for fp8) as 16-bit rows in the MMA type, K rotated by the KeyTransform:
  // into cbuf for fp8, in place otherwise. Every row is converted (rows past the item's tokens hold the
  // loader's zeros), so masked rows are finite zeros and P.V never meets garbage.
  static __device__ __forceinline__ void convert_tile(const VariantParams& vp, uint8_t* stage, uint8_t* cbuf,
                                                      const TileRecord* rec, int kv_head) {
    constexpr int kUnits = kHeadDim / 16;  // a unit: dims [8 u, 8 u + 8) and the same + D/2
    const int pos0 = rec->w.pos_off + rec->tile_kv_begin, request = rec->w.request;
    for (int idx = threadIdx.x; idx < kTile * kUnits; idx += kThreads) {
      const int row = idx / kUnits, dc = idx % kUnits;
#pragma unroll
      for (int which = 0; which < (kFp8 ? 2 : 1); ++which) {  // 0: K, 1: V (16-bit V is used in place)
        const uint8_t* src = stage + which * Cfg::kKvTileBytes;
        uint8_t* dst = kFp8 ? cbuf + which * Cfg::kCTileBytes : stage;
        float a[8], b[8];
        read8(src, row, dc, a);
        read8(src, row, dc + kUnits, b);
        if constexpr (Variant::kHasKeyTransform) {
          if (which == 0) {
            const RotaryCtx ctx{pos0 + row, kv_head, request};
            if constexpr (Variant::kRotaryInterleave) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                Variant::key_transform(vp, a[2 * e], a[2 * e + 1], 4 * dc + e, ctx);
                Variant::key_transform(vp, b[2 * e], b[2 * e + 1], 4 * (dc + kUnits) + e, ctx);
              }
            } else {
#pragma unroll
              for (int e = 0; e < 8; ++e) Variant::key_transform(vp, a[e], b[e], 8 * dc + e, ctx);
            }
          }
        }
        write8(dst, row, dc, a);
        write8(dst, row, dc + kUnits, b);
      }
    }
  }

  // ------------------------------------------------------------------ one KV tile of one warp

  // The warp's rows: m fragment mf holds packed rows 16 (kMF warp + mf) + g (+ 8); S and O in C-fragment
  // layout (c0/c1: row g, c2/c3: row g + 8). Masks use each row's limits, computed here from the record.
  // Maximum of this lane's elements of row half hf (C-fragment slots 2 hf, 2 hf + 1 of every n tile), in
  // four independent chains: one serial chain of FMNMX waits on each result (ncu: "stall wait" led the
  // prefill kernel).
  static __device__ __forceinline__ float row_max(const float (&s)[kNTiles][4], int hf) {
    // Four running maxima over one flat loop: the tree it replaced (`for (w = kNTiles / 2; w >= 1; w /= 2)`)
    // stayed a rolled loop at 16 n tiles (128-token steps), its array in local memory.
    constexpr int kParts = kNTiles < 4 ? kNTiles : 4;
    float m[kParts];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const float v = fmaxf(s[nt][2 * hf], s[nt][2 * hf + 1]);
      m[nt % kParts] = nt < kParts ? v : fmaxf(m[nt % kParts], v);
    }
#pragma unroll
    for (int i = 1; i < kParts; ++i) m[0] = fmaxf(m[0], m[i]);
    return m[0];
  }

  // S = Q K^T of the warp's fragments over kStep tokens from token t0 of the tile (mma.sync): Q's A
  // fragments by ldmatrix from the Q buffer; one ldmatrix.x4 of K gives the B fragments of two n tiles
  // for one k step, used by every m fragment.
  static __device__ __forceinline__ void qk_sync(uint32_t qs, uint32_t ks, int t0, float (&s)[kMF][kNTiles][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, mi = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int mf = 0; mf < kMF; ++mf)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mf][nt][e] = 0.f;
#pragma unroll
    for (int kstep = 0; kstep < kKSteps; ++kstep) {
      uint32_t qa[kMF][4];
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) {
        const int row = frag_row0(warp, mf) + (lane & 15);
        ptx::ldmatrix_x4(qa[mf], qs + Cfg::q_offset(row, 2 * kstep + (lane >> 4)));
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        const int row = t0 + 16 * np + ((mi >> 1) << 3) + r8;
        uint32_t r[4];
        ptx::ldmatrix_x4(r, ks + Cfg::mma_offset(row, 2 * kstep + (mi & 1)));
#pragma unroll
        for (int mf = 0; mf < kMF; ++mf) {
          ptx::mma_16816<kBf16>(s[mf][2 * np], qa[mf][0], qa[mf][1], qa[mf][2], qa[mf][3], r[0], r[1]);
          ptx::mma_16816<kBf16>(s[mf][2 * np + 1], qa[mf][0], qa[mf][1], qa[mf][2], qa[mf][3], r[2], r[3]);
        }
      }
    }
  }

  // The same with the warpgroup's m64 MMAs, fragment mf (issued, not waited for): A = the Q buffer's 64
  // rows of the fragment, B = K (K-major: rows of the tile, 8-row atoms 1024 bytes apart), both through
  // descriptors at the k step's first chunk (its 16 dims are 32 bytes into a 128-byte column block; the
  // fragment's and the step's first rows are multiples of 8, so the swizzle leaves that chunk in place).
  // One descriptor each for the k steps' first chunk, advanced by the chunk's offset from row 0 (rows a
  // multiple of 8 apart: the offsets add). qs, ks: warp-uniform (uniform()), so the descriptors stay in
  // uniform registers.
  static __device__ __forceinline__ void qk_wgmma(uint32_t qs, uint32_t ks, uint32_t os, int t0, int mf,
                                                  float (&s)[kNTiles][4]) {
    const int row0 = wg_frag_row0(uniform(threadIdx.x >> 7), mf);
    const uint64_t a0 = wgmma::desc(qs + Cfg::q_offset(row0, 0), 16, 1024);
    const uint64_t b0 = wgmma::desc(ks + Cfg::mma_offset(t0, 0), 16, 1024);
#pragma unroll
    for (int kstep = 0; kstep < kKSteps; ++kstep) {
      const uint64_t a = wgmma::desc_advance(a0, Cfg::q_offset(0, 2 * kstep));
      const uint64_t b = wgmma::desc_advance(b0, Cfg::mma_offset(0, 2 * kstep));
      wgmma::Mma<kStep, kBf16>::template ss<0>(reinterpret_cast<float(&)[kNTiles * 4]>(s), a, b, kstep > 0);
    }
    if constexpr (kBias) {  // S += (slope / scale) . column (Cfg::kBiasMma; bias_a, bias_zero: see Config)
      const int u = uniform(threadIdx.x >> 7);
      const uint32_t base = os - Cfg::kOnesAt;  // the CTA's shared memory
      const uint64_t a = wgmma::desc_plain(base + Cfg::bias_a(u), Cfg::kBiasZeroAt - Cfg::bias_a(u), 0);
      const uint64_t b = wgmma::desc_plain(base + Cfg::kBiasKAt, 128, 128);
      wgmma::Mma<kStep, kBf16>::template ss<0>(reinterpret_cast<float(&)[kNTiles * 4]>(s), a, b, 1);
    }
  }

  // x as the compiler sees a warp-uniform value (lane 0's, broadcast): kept in uniform registers.
  static __device__ __forceinline__ uint32_t uniform(uint32_t x) { return __shfl_sync(0xffffffffu, x, 0); }

  // O += P V (mma.sync): P's A fragment is S's C fragment of two n tiles; V's B fragments by ldmatrix.trans.
  static __device__ __forceinline__ void pv_sync(uint32_t vs, int t0, const float (&s)[kMF][kNTiles][4],
                                                 float (&o)[kMF][kDTiles][4]) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int kk = 0; kk < kStep / 16; ++kk) {
      uint32_t a[kMF][4];
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) p_fragment(s[mf], kk, a[mf]);
      const int row = t0 + 16 * kk + ((mi & 1) << 3) + r8;
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        uint32_t r[4];
        ptx::ldmatrix_x4_trans(r, vs + Cfg::mma_offset(row, 2 * dp + (mi >> 1)));
#pragma unroll
        for (int mf = 0; mf < kMF; ++mf) {
          ptx::mma_16816<kBf16>(o[mf][2 * dp], a[mf][0], a[mf][1], a[mf][2], a[mf][3], r[0], r[1]);
          ptx::mma_16816<kBf16>(o[mf][2 * dp + 1], a[mf][0], a[mf][1], a[mf][2], a[mf][3], r[2], r[3]);
        }
      }
    }
  }

  // The same with the warpgroup's m64 MMAs, one fragment (issued, not waited for): A = P from registers,
  // B = V (MN-major: dims contiguous; 64-dim column blocks kTile * 128 bytes apart, 8-token atoms 1024
  // bytes apart).
  static __device__ __forceinline__ void pv_wgmma(uint32_t vs, uint32_t os, int t0, const float (&s)[kNTiles][4],
                                                  float (&o)[kDTiles][4], float (&d_run)[4]) {
    uint32_t a[kStep / 16][4];
#pragma unroll
    for (int kk = 0; kk < kStep / 16; ++kk) p_fragment(s, kk, a[kk]);
    pv_packed(vs + Cfg::mma_offset(t0, 0), a, o);
    if constexpr (kRowSum) {  // the row sums: P . ones (Cfg::kRowSumMma)
      const uint64_t ones = wgmma::desc_plain(os, 128, 256);
#pragma unroll
      for (int kk = 0; kk < kStep / 16; ++kk) wgmma::Mma<8, kBf16>::template rs<0>(d_run, a[kk], ones, 1);
    }
  }

  // P's A fragment for k step kk (16 tokens): the C fragments of S's n tiles 2 kk and 2 kk + 1, packed.
  static __device__ __forceinline__ void p_fragment(const float (&s)[kNTiles][4], int kk, uint32_t (&a)[4]) {
    a[0] = ptx::pack2<kBf16>(s[2 * kk][0], s[2 * kk][1]);
    a[1] = ptx::pack2<kBf16>(s[2 * kk][2], s[2 * kk][3]);
    a[2] = ptx::pack2<kBf16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = ptx::pack2<kBf16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }

  // The LogitsTransform on scaled logits, then ALiBi per element (without the bias MMA: one FFMA with the
  // scale's multiply, one with the column).
  static __device__ __forceinline__ float transform(const VariantParams& vp, float z, const LogitsCtx& ctx,
                                                    float slope) {
    if constexpr (Variant::kHasLogitsTransform) z = Variant::logits_transform(vp, z, ctx);
    if constexpr (kAlibi && !kBias) z = fmaf(slope, ctx.rel_col, z + slope * ctx.rel_row);
    return z;
  }

  // Scale, LogitsTransform and LogitsMask, in place on S of m fragment mf. kMask: the per-element mask
  // runs (else the step is full, visible to every row, and without a LogitsTransform S stays raw: the
  // softmax folds the scale into its exponent, one FFMA per element). Softmax units: a LogitsTransform's
  // result stays in natural units (the exponent's FFMA takes log2 e, one multiply an element fewer),
  // masked logits without one stay raw too (-inf where masked), in log2 units only for a non-positive
  // scale. ALiBi without the bias MMA counts as a transform.
  template <bool kMask>
  static __device__ __forceinline__ void logits_frag(const Params& p, const VariantParams& vp, const Work& w,
                                                     int tile_begin, int n_valid, int kv_head, int mf,
                                                     float (&s)[kNTiles][4]) {
    constexpr bool kRaw = !kMask && !kTransform;
    if constexpr (kRaw && Variant::kUseSoftmax) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane & 3, g = lane >> 2;
    const float scale_log2 = p.logits_scale * kLog2e;
    // Masked logits without a transform stay raw (the softmax scales them as unmasked steps' with one FFMA):
    // whether a step is masked depends on the unit's rows, so both must round alike. A non-positive scale
    // masks every step (need_mask) and scales here, where the raw maximum would be the wrong one.
    const float pre = p.logits_scale > 0.f ? 1.f : scale_log2;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      constexpr bool kCtx = Variant::kHasLogitsMask || kTransform;  // hooks see LogitsCtx
      RowInfo ri;
      if constexpr (kMask || kCtx) ri = E::row_info(w, frag_row0(warp, mf) + 8 * hf + g);
      float slope = 0.f;  // ALiBi per element (no bias MMA): padding rows never reach a hook
      if constexpr (kAlibi && !kBias) slope = ri.valid ? Variant::alibi_slope(vp, ri.qo_head) : 0.f;
      float rel0 = 0.f;  // LogitsCtx::rel_pos of this lane's first column: one conversion a row
      if constexpr (kCtx) rel0 = (float)(w.pos_off + tile_begin + 2 * c - ri.q_pos);
      // The row's visible columns as one interval, in this lane's columns 2 c + 8 nt + e2: the element
      // test is then a compare or two against constants, not the causal limit and the variant's mask
      // recomputed per element (the window's mask is its KV range, kMaskIsKvRange).
      int lim_lo = 0, lim_hi = 0;
      if constexpr (kMask) {
        int hi_t = ri.valid ? n_valid : 0;
        if (p.causal) hi_t = min(hi_t, ri.climit - tile_begin + 1);
        if constexpr (Variant::kMaskIsKvRange) {
          int lo = INT_MIN, hi = INT_MAX;
          Variant::kv_range(vp, ri.q_pos, ri.q_pos, lo, hi);
          const int base = w.pos_off + tile_begin;
          lim_lo = max(lo, base) - base - 2 * c;
          hi_t = min(hi_t, min(hi, base + kStep) - base);
        }
        lim_hi = hi_t - 2 * c;
      }
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
          const int e = 2 * hf + e2;
          const int t = 8 * nt + 2 * c + e2;
          const int kv_idx = tile_begin + t;
          bool ok = true;
          LogitsCtx ctx;
          if constexpr (kCtx) {
            ctx = LogitsCtx{w.request, ri.q_row, ri.q_idx, ri.q_pos, kv_idx, w.pos_off + kv_idx,
                            ri.qo_head, kv_head, w.q_len, w.kv_len, rel0 + (float)(8 * nt + e2), rel0,
                            (float)(8 * nt + e2)};
          }
          if constexpr (kMask) {
            ok = 8 * nt + e2 < lim_hi;
            if constexpr (Variant::kMaskIsKvRange) ok = ok && 8 * nt + e2 >= lim_lo;
            else if constexpr (Variant::kHasLogitsMask) ok = ok && Variant::logits_mask(vp, ctx);
          }
          const float x = s[nt][e];
          float y;
          if constexpr (Variant::kUseSoftmax) {
            if constexpr (kTransform)  // natural units: the softmax's exponent takes log2 e
              y = ok ? transform(vp, x * p.logits_scale, ctx, slope) : -INFINITY;
            else  // raw (x 1) as an unmasked step, so a row's exponents never depend on its tile-mates
              y = ok ? x * pre : -INFINITY;
          } else {
            if constexpr (kTransform)
              y = ok ? transform(vp, x * p.logits_scale, ctx, slope) : 0.f;
            else
              y = ok ? x * p.logits_scale : 0.f;
          }
          s[nt][e] = y;
        }
    }
  }

  // Row half hf of S -> P = 2^(S sl + nb) in place; kSum: d = d alpha + the lane's sum of them (per lane; the
  // quad's sum is taken at the end). Four independent partial sums: one serial chain of FADDs would wait on
  // each result. (Each starts from its first element, not 0.f + it: ptxas keeps that add, -0 + 0 being +0.)
  template <bool kSum>
  static __device__ __forceinline__ void exp_row(float (&s)[kNTiles][4], int hf, float sl, float nb, float alpha,
                                                 float& d) {
    float sum4[4];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * nt + e;
        const float pe = ptx::exp2(fmaf(s[nt][2 * hf + e], sl, nb));
        s[nt][2 * hf + e] = pe;
        if constexpr (kSum) sum4[i & 3] = i < 4 ? pe : sum4[i & 3] + pe;
      }
    if constexpr (kSum) d = d * alpha + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
  }

  // The logits pass, then the online softmax, of m fragment mf: S becomes P in place, O is rescaled.
  // kMode: kFull, kMasked (logits_frag's kMask), or kMaskedIf: masked iff `masked`, one copy of the
  // softmax and the MMAs for both (wgmma: with a full and a masked copy of the step, each its own wgmma
  // pipeline, ptxas ran out of registers at 8 x 2 (232) and 16 x 1 (128) and serialised every wgmma of
  // the kernel, C7512: each HGMMA waited for before the next issued; perf/ptxas.py reports it).
  static constexpr int kFull = 0, kMasked = 1, kMaskedIf = 2;
  static constexpr float kRescaleLog2 = 8.f;  // how far a row's maximum may outgrow m_run (log2 units)
  template <int kMode>
  static __device__ __forceinline__ void softmax_frag(const Params& p, const VariantParams& vp, const Work& w,
                                                      int tile_begin, int n_valid, int kv_head, int mf, bool masked,
                                                      float bias_slope, float (&s)[kNTiles][4], float (&m_run)[2],
                                                      float (&d_run)[4], float (&o)[kDTiles][4]) {
    if constexpr (kMode == kMaskedIf) {
      if (masked) logits_frag<true>(p, vp, w, tile_begin, n_valid, kv_head, mf, s);
      else logits_frag<false>(p, vp, w, tile_begin, n_valid, kv_head, mf, s);
    } else {
      logits_frag<kMode == kMasked>(p, vp, w, tile_begin, n_valid, kv_head, mf, s);
    }
    // S holds raw logits (scale not applied), masked or not, unless the scale is not positive (logits_frag)
    const bool raw = !kTransform && p.logits_scale > 0.f;
    const float scale_log2 = p.logits_scale * kLog2e;
    float mx[2] = {-INFINITY, -INFINITY};

    // ---- online softmax of rows g (hf 0) and g + 8 (hf 1); a row lives in the 4 lanes of a quad.
    // A row's running maximum m_run (log2 units) moves only when that row grows by more than kRescaleLog2
    // (FlashAttention-4's conditional rescaling): in between, exponents are taken against the stale
    // maximum, so P <= 2^kRescaleLog2 (well inside bf16 / fp16 and far from fp32 overflow) and O, d and m
    // stay consistent; the O rescale (kDTiles * 4 multiplies, twice the step's elements at 64-token steps)
    // then runs only on the steps where some row of the warp's fragment jumps (a warp vote). A row that did
    // not jump keeps its maximum and multiplies by exactly 1, so its arithmetic never depends on the rows
    // that share its fragment (which a cached prefix or another chunking changes).
    if constexpr (Variant::kUseSoftmax) {
      // S -> log2 units: raw logits take the scale, transformed ones (natural units) log2 e, those of a
      // non-positive scale are scaled already.
      const float sl = raw ? scale_log2 : kTransform ? kLog2e : 1.f;
      // The bias MMA's row offsets (log2 units): the row's logits are S sl + rb, S holding slope * column.
      // rb = slope * (step start - (q_pos - pos_off)), the distance converted from the exact integer.
      float rb[2] = {0.f, 0.f};
      if constexpr (kBias) {
        const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int q_rel = w.kv_len - w.q_len + w.q_idx0 + (frag_row0(warp, mf) + 8 * hf + g) / kHPC;
          rb[hf] = bias_slope * (float)(tile_begin - q_rel);
        }
      }
      float m_new[2];
      bool grow[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = row_max(s, hf);
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
        m_new[hf] = kBias ? fmaxf(m_run[hf], fmaf(mx[hf], sl, rb[hf])) : fmaxf(m_run[hf], mx[hf] * sl);
        grow[hf] = m_new[hf] > m_run[hf] + kRescaleLog2;  // false while the row has seen only -inf
      }
      const bool rescale = __any_sync(0xffffffffu, grow[0] || grow[1]);  // gates the O multiply only
      float alpha[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float m_next = grow[hf] ? m_new[hf] : m_run[hf];  // the row's own growth alone
        const float m_use = m_next == -INFINITY ? 0.f : m_next;
        // exactly 1 for a row that did not grow (not left to ex2.approx of 0); 0 for a first finite maximum
        alpha[hf] = grow[hf] ? ptx::exp2(m_run[hf] - m_use) : 1.f;
        m_run[hf] = m_next;
        const float nb = kBias ? rb[hf] - m_use : -m_use;
        exp_row<!kRowSum>(s, hf, sl, nb, alpha[hf], d_run[2 * hf]);
      }
      if (rescale) {
        rescale_o(o, alpha);
        if constexpr (kRowSum) {  // the row-sum MMA's D fragment, as O's
          d_run[0] *= alpha[0];
          d_run[1] *= alpha[0];
          d_run[2] *= alpha[1];
          d_run[3] *= alpha[1];
        }
      }
    }
  }

  // One compute step: kStep tokens from token t0 of the landed tile, for all of the unit's fragments.
  // wgmma: a fragment's softmax runs while the tensor cores work on the other fragment's MMAs (S of all
  // fragments issued first; before fragment mf's softmax, kMF - 1 groups may still be in flight: the
  // later fragments' S and the earlier fragments' P.V).
  template <int kMode>
  static __device__ __forceinline__ void compute_tile(const Params& p, const VariantParams& vp, uint32_t qs,
                                                      uint32_t ks, uint32_t vs, uint32_t os, int t0, const Work& w, int tile_begin,
                                                      int n_valid, int kv_head, bool masked, float bias_slope,
                                                      float (&m_run)[kMF][2], float (&d_run)[kMF][4],
                                                      float (&o)[kMF][kDTiles][4]) {
    float s[kMF][kNTiles][4];
    if constexpr (kWgmma) {
      wgmma::fence();
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) {
        qk_wgmma(qs, ks, os, t0, mf, s[mf]);
        wgmma::commit();
      }
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf) {
        wgmma::wait<kMF - 1>();
        softmax_frag<kMode>(p, vp, w, tile_begin, n_valid, kv_head, mf, masked, bias_slope, s[mf], m_run[mf], d_run[mf],
                            o[mf]);
        pv_wgmma(vs, os, t0, s[mf], o[mf], d_run[mf]);
        wgmma::commit();
      }
      wgmma::wait<0>();
    } else {
      qk_sync(qs, ks, t0, s);
#pragma unroll
      for (int mf = 0; mf < kMF; ++mf)
        softmax_frag<kMode>(p, vp, w, tile_begin, n_valid, kv_head, mf, masked, bias_slope, s[mf], m_run[mf], d_run[mf],
                            o[mf]);
      pv_sync(vs, t0, s, o);
    }
  }

  // Whether the unit whose first packed row is first_pr has rows in sub-item w; last_r its last query row.
  static __device__ __forceinline__ bool unit_rows(const Work& w, int first_pr, int& last_r) {
    last_r = min((first_pr + Cfg::kUnitRows - 1) / kHPC, w.nrows - 1);
    return first_pr < Cfg::kPackedRows && first_pr / kHPC < w.nrows;
  }

  // ------------------------------------------------------------------ FlashAttention-3's consumer loop

  // Keeps the compiler from moving this thread's reads or writes of x across the asm around it (wgmma
  // issue, wait): an accumulator is only defined at the wait, not where the MMA's asm names it.
  template <int N>
  static __device__ __forceinline__ void fence_regs(float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
  }
  template <int N>
  static __device__ __forceinline__ void fence_regs(uint32_t (&x)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(x[i][e])::"memory");
  }

  // O += P V for a tile's kStep tokens, P packed in registers (A of the rs form), V from shared memory; issued,
  // not committed. The wgmma fence orders the rescaled O and P, written by this thread, before the MMAs read them.
  static __device__ __forceinline__ void pv_packed(uint32_t vs, const uint32_t (&pa)[kStep / 16][4],
                                                   float (&o)[kDTiles][4]) {
    wgmma::fence();
    const uint64_t b0 = wgmma::desc(vs, kTile * 128, 1024);
    // A head size that is not a whole number of 64-column blocks (80, 96): the full blocks in one MMA, the rest
    // (16 or 32 columns of the next block) in a second.
    constexpr int kFull = kHeadDim % 64 == 0 ? kHeadDim : kHeadDim / 64 * 64, kRest = kHeadDim - kFull;
#pragma unroll
    for (int kk = 0; kk < kStep / 16; ++kk) {
      const uint64_t b = wgmma::desc_advance(b0, Cfg::mma_offset(16 * kk, 0));
      wgmma::Mma<kFull, kBf16>::template rs<1>(reinterpret_cast<float(&)[kFull / 2]>(o), pa[kk], b, 1);
      if constexpr (kRest > 0)
        wgmma::Mma<kRest, kBf16>::template rs<1>(reinterpret_cast<float(&)[kRest / 2]>(o[kFull / 8]), pa[kk],
                                                 wgmma::desc_advance(b, kFull / 64 * kTile * 128), 1);
    }
  }

  // O += P V, committed and waited for (a sub-item's last P.V).
  static __device__ __forceinline__ void pv_now(uint32_t vs, const uint32_t (&pa)[kStep / 16][4],
                                                float (&o)[kDTiles][4]) {
    pv_packed(vs, pa, o);
    wgmma::commit();
    wgmma::wait<0>();
    fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(o));
  }

  // The online softmax of one step with O's rescale deferred (O is an accumulator of the P.V in flight):
  // S becomes P in place, m_run and the lane's partial sums d_run move now, alpha and `rescale` say what O
  // must be multiplied by before the next P.V. The same arithmetic as softmax_frag (conditional rescale by
  // more than 2^kRescaleLog2, the scale folded into the exponent's FFMA).
  static __device__ __forceinline__ void softmax_deferred(const Params& p, const VariantParams& vp, const Work& w,
                                                          int tile_begin, int n_valid, int kv_head, bool masked,
                                                          float (&s)[kNTiles][4], float (&m_run)[2], float (&d_run)[4],
                                                          float (&alpha)[2], bool& rescale) {
    if (masked) logits_frag<true>(p, vp, w, tile_begin, n_valid, kv_head, 0, s);
    else logits_frag<false>(p, vp, w, tile_begin, n_valid, kv_head, 0, s);
    const bool raw = !kTransform && p.logits_scale > 0.f;
    const float sl = raw ? p.logits_scale * kLog2e : kTransform ? kLog2e : 1.f;
    float m_new[2];
    bool grow[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = row_max(s, hf);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      m_new[hf] = fmaxf(m_run[hf], mx * sl);
      grow[hf] = m_new[hf] > m_run[hf] + kRescaleLog2;
    }
    rescale = __any_sync(0xffffffffu, grow[0] || grow[1]);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float m_next = grow[hf] ? m_new[hf] : m_run[hf];
      const float m_use = m_next == -INFINITY ? 0.f : m_next;
      alpha[hf] = grow[hf] ? ptx::exp2(m_run[hf] - m_use) : 1.f;
      m_run[hf] = m_next;
      exp_row<true>(s, hf, sl, -m_use, alpha[hf], d_run[2 * hf]);
    }
  }

  static __device__ __forceinline__ void pack_p(const float (&s)[kNTiles][4], uint32_t (&pa)[kStep / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kStep / 16; ++kk) p_fragment(s, kk, pa[kk]);
  }

  static __device__ __forceinline__ void rescale_o(float (&o)[kDTiles][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }
  }

  // The compute warpgroups of Cfg::kOverlap: a tile is one step. A sub-item's first active tile runs
  // S = QK^T and its softmax alone; each later one issues S_j = Q K_j^T, then (behind it on the tensor
  // cores) O = alpha O + P_{j-1} V_{j-1}, waits for S_j only, runs its softmax while the P.V runs, and waits
  // for both before the back-edge: no wgmma is in flight across the loop or a branch that issues one, which
  // is what makes ptxas serialise them. P_j waits packed in registers for tile j + 1 (or the flush at the
  // sub-item's end or at its first skipped tile), and tile j's stage with it: the stage is released once
  // its V is read, so the producer runs with kStages - 2 tiles ahead. The producer copies each sub-item's query
  // tile (Cfg::kQCopy); a warp releases its buffer after its last QK^T of the sub-item, so with one buffer (head
  // size 128) the next query tile lands while the last softmax, P.V and epilogue run.
  static __device__ __forceinline__ void consume_overlap(const Params& p, const VariantParams& vp, uint8_t* smem,
                                                         uint32_t full, uint32_t empty, uint32_t qempty) {
    static_assert(kMF == 1 && !kRowSum && !kBias && Variant::kUseSoftmax && !Variant::kHasLogitsMask &&
                      !Variant::kMaskIsKvRange,
                  "overlapped consumers: one fragment, softmax, row sums by FADD, no bias MMA, no LogitsMask");
    static_assert(L::kQCopy, "overlapped consumers: the producer copies the query tiles");
    const int warp = threadIdx.x >> 5, unit = warp >> 2;
    int n_def = 0;  // split sub-items waiting for their arrival (arrive)
    const uint32_t qs0 = uniform(ptx::smem_u32(smem + Cfg::kQAt));
    constexpr bool kOneQ = Cfg::kQBuffers == 1;  // the query buffer is always slot 0: no record read, no shuffle
    float m_run[1][2], d_run[1][4], o[1][kDTiles][4];
    float s[kNTiles][4];
    uint32_t pa[kStep / 16][4];  // P of the pending tile, packed
    float alpha[2] = {1.f, 1.f};
    bool rescale = false, pending = false;
    bool q_held = false;  // the sub-item's query buffer, until this warp's last QK^T of it has been waited for
    int held = 0;     // the pending tile's stage
    uint32_t vs_held = 0;
    constexpr int kUnitRows = Cfg::kUnitRows;
    const int first_pr = kUnitRows * unit;
    if (unit == 1) turn_end(1);  // warpgroup 0 takes the first turn
    // The tile's stage and its full barrier's parity, kept as counters (j % kStages and (j / kStages) & 1 cost a
    // multiply-high chain a tile); the sub-item's values, read from its first tile's record only.
    int sj = 0, parity = 0;
    int kv_head = 0, last_r = 0, climit_lo = 0, climit_hi = 0;
    bool unit_active = false;
#pragma unroll 1
    for (;;) {
      ptx::mbar_wait(full + 8 * sj, parity);
      const TileRecord* rec = Cfg::record(smem, sj);
      const int flags = rec->flags;
      if (flags & kEnd) {
        if (n_def) arrive(p, vp, smem, n_def);
        break;
      }
      if (flags & kCopied) wgmma::fence_proxy_async();  // cp.async writes (generic proxy), for the tensor cores
      const Work& w = rec->w;
      if (flags & kFirst) {
        kv_head = kv_head_of(p, w.unit);
        unit_active = unit_rows(w, first_pr, last_r);
        climit_lo = w.kv_len - w.q_len + w.q_idx0 + first_pr / kHPC;
        climit_hi = w.kv_len - w.q_len + w.q_idx0 + last_r;
      }
      const int qslot = kOneQ ? 0 : rec->qslot;
      const uint32_t qs = kOneQ ? qs0 : uniform(qs0 + qslot * Cfg::kQBytes);
      if (flags & kFirst) {
        __syncwarp();  // the producer copied Q (see run)
        q_held = true;
        m_run[0][0] = m_run[0][1] = -INFINITY;
        d_run[0][0] = d_run[0][1] = d_run[0][2] = d_run[0][3] = 0.f;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[0][dt][e] = 0.f;
      }
      const uint32_t ks = uniform(ptx::smem_u32(smem + sj * Cfg::kStageBytes)), vs = ks + Cfg::kKvTileBytes;
      const int tile_begin = rec->tile_kv_begin, n_valid = rec->n_valid;
      // Causal: a tile wholly past the unit's last row is skipped (and every later one of the sub-item); the
      // per-element mask only on a diagonal or partial tile (or a non-positive scale: softmax_frag).
      const bool active = unit_active && n_valid > 0 && !(p.causal && tile_begin > climit_hi);
      const bool masked = n_valid < kStep || (p.causal && tile_begin + kStep - 1 > climit_lo) || !(p.logits_scale > 0.f);
      const bool last = (flags & kLast) != 0;
      // This warp's last QK^T of the sub-item (the next tile is skipped, or there is none): the query buffer is
      // released once it has been waited for, so the producer copies the next sub-item's query tile while this
      // one's last softmax, P.V and epilogue run. An inactive tile releases it at once (every later one is
      // inactive too: n_valid falls and tile_begin grows tile by tile). Exactly once a sub-item: at its last
      // tile q_last holds.
      const bool q_last = !active || last || n_valid <= kStep || (p.causal && tile_begin + kStep > climit_hi);
      const bool q_release = L::kQCopy && q_held && q_last;
      const uint32_t qbar = qempty + 8 * qslot;
      q_held = q_held && !q_last;
      // Three exclusive cases, each with its own wgmmas, all waited for inside it (a first active tile
      // followed by a separate flush on the same path made ptxas serialise every wgmma, C7518). Ping-pong: a
      // warpgroup's turn (turn_begin .. turn_end) is one a tile in every case, so the two take turns in step.
      turn_begin(unit);
      if (active && pending) {  // S_j = Q K_j^T; O = alpha O + P_{j-1} V_{j-1} behind it; softmax of S_j
        wgmma::fence();
        qk_wgmma(qs, ks, 0u, 0, 0, s);
        wgmma::commit();
        if (rescale) rescale_o(o[0], alpha);
        pv_packed(vs_held, pa, o[0]);
        wgmma::commit();
        turn_end(unit);
        wgmma::wait<1>();
        fence_regs(reinterpret_cast<float(&)[kNTiles * 4]>(s));
        release_if(qbar, q_release);
        softmax_deferred(p, vp, w, tile_begin, n_valid, kv_head, masked, s, m_run[0], d_run[0], alpha, rescale);
        fence_regs(reinterpret_cast<float(&)[kNTiles * 4]>(s));  // the softmax before the wait, not after it
        block_boundary(d_run[0][0]);  // ... in the SASS too (without it the exponentials followed the P.V)
        wgmma::wait<0>();
        fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(o[0]));
        fence_regs(pa);  // P.V's A registers stay P's to the wait: no softmax temporary reuses them
        release(empty + 8 * held);
        pack_p(s, pa);
        held = sj;
        vs_held = vs;
        if (last) {  // the sub-item's last P.V
          if (rescale) rescale_o(o[0], alpha);
          pv_now(vs, pa, o[0]);
          pending = false;
        }
      } else if (active) {  // a sub-item's first active tile: S and its softmax alone (P.V with the next)
        wgmma::fence();
        qk_wgmma(qs, ks, 0u, 0, 0, s);
        wgmma::commit();
        turn_end(unit);
        wgmma::wait<0>();
        fence_regs(reinterpret_cast<float(&)[kNTiles * 4]>(s));
        release_if(qbar, q_release);
        softmax_deferred(p, vp, w, tile_begin, n_valid, kv_head, masked, s, m_run[0], d_run[0], alpha, rescale);
        pack_p(s, pa);
        if (last) {  // and its last: the P.V now (O is zero: no rescale)
          pv_now(vs, pa, o[0]);
        } else {
          pending = true;
          held = sj;
          vs_held = vs;
        }
      } else if (pending) {  // a skipped tile ends the sub-item's active ones: the pending P.V
        if (rescale) rescale_o(o[0], alpha);
        pv_packed(vs_held, pa, o[0]);
        wgmma::commit();
        turn_end(unit);
        wgmma::wait<0>();
        fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(o[0]));
        release(empty + 8 * held);
        pending = false;
      } else {
        turn_end(unit);
      }
      if (!active) release_if(qbar, q_release);
      if (last) {  // the record is read by finish: release after it
        finish(p, vp, w, m_run, d_run, o, smem, n_def);
        release(empty + 8 * sj);
      } else if (!pending || held != sj) {
        release(empty + 8 * sj);
      }
      if (++sj == kStages) {
        sj = 0;
        parity ^= 1;
      }
    }
  }

  // ------------------------------------------------------------------ the kernel

  // The compute warps' own barrier (finish): with a producer warpgroup, __syncthreads would wait for it.
  static __device__ __forceinline__ void sync_compute() {
    if constexpr (Cfg::kProducer) ptx::bar_sync(8, kThreads);
    else __syncthreads();
  }

  // A compute warp is done with what barrier `bar` guards (warp-specialised): a stage ("empty") or a
  // sub-item's query buffer ("qempty", after finish); its reads, the tensor cores' included
  // (compute_tile waits for its MMAs), are over. One arrival per warp.
  static __device__ __forceinline__ void release(uint32_t bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) ptx::mbar_arrive(bar);
  }
  // Ping-pong (Cfg::kPingPong): warpgroup u's turn to issue its MMAs begins once the other warpgroup has issued
  // its own of the turn before (bar.sync on kSchedBar + u by u's 128 threads, completed by the other's 128
  // arrivals) and ends with its arrival at the other's barrier (FlashAttention-3's warp scheduler barriers).
  static __device__ __forceinline__ void turn_begin(int unit) {
    if constexpr (Cfg::kPingPong) ptx::bar_sync(Cfg::kSchedBar + unit, 256);
  }
  static __device__ __forceinline__ void turn_end(int unit) {
    if constexpr (Cfg::kPingPong) ptx::bar_arrive(Cfg::kSchedBar + (unit ^ 1), 256);
  }

  // The same where `cond` (the same in every lane of the warp) holds.
  static __device__ __forceinline__ void release_if(uint32_t bar, bool cond) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0 && cond) ptx::mbar_arrive(bar);
  }

  // Ends the basic block here, in the SASS: a warp-uniform branch never taken (x is a row sum, never negative;
  // NaN compares false). ptxas puts a wgmma wait at the top of the basic block that holds it, however late the
  // PTX has it, ahead of the independent work before it (consume_overlap: the softmax's exponentials ran after
  // the P.V they were to overlap); a wait after this boundary stays after what precedes it.
  static __device__ __forceinline__ void block_boundary(float x) {
    if (__any_sync(0xffffffffu, x < 0.f)) __trap();
  }

  static __device__ __forceinline__ void run(const Params& p, const VariantParams& vp, uint8_t* smem,
                                             const KvTma& tma) {
    const int warp = threadIdx.x >> 5;
    Cursor cur;
    int page[L::kLookups], slot[L::kLookups];
    const uint32_t full = ptx::smem_u32(smem + Cfg::kBarriersAt), empty = full + 8 * kStages,
                   qempty = empty + 8 * kStages;
    // The row-sum MMA's ones and the bias MMA's column indices (published by the first barrier below, or the
    // first tile's, into the async proxy).
    if constexpr (kRowSum || kBias) {
      if (threadIdx.x < 64) {
        reinterpret_cast<uint32_t*>(smem + Cfg::kOnesAt)[threadIdx.x] = ptx::pack2<kBf16>(1.f, 1.f);
        wgmma::fence_proxy_async();
      }
    }
    if constexpr (kBias) {  // B row t: k 0 and 1 are t (exact: kStep <= 256), k 2-7 zero; A's zeros
      for (int t = threadIdx.x; t < Cfg::kStep + 8; t += blockDim.x) {
        const uint32_t x = t < Cfg::kStep ? ptx::pack2<kBf16>((float)t, (float)t) : 0u;
        const int at = t < Cfg::kStep ? Cfg::kBiasKAt + 16 * t : Cfg::kBiasZeroAt + 16 * (t - Cfg::kStep);
        *reinterpret_cast<uint4*>(smem + at) = make_uint4(x, 0u, 0u, 0u);
        wgmma::fence_proxy_async();
      }
    }
    if constexpr (Cfg::kProducer) {
      static_assert(!kConvert, "warp-specialised: no conversion pass (it would need every warp per tile)");
      if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
          ptx::mbar_init(full + 8 * s, L::kThreads + 1);  // every loading thread's copies + the record
          ptx::mbar_init(empty + 8 * s, Cfg::kWarps);     // every compute warp
        }
        for (int b = 0; b < Cfg::kQBuffers; ++b) ptx::mbar_init(qempty + 8 * b, Cfg::kWarps);
      }
      __syncthreads();
      if (threadIdx.x >= kThreads) {
        if constexpr (Cfg::kMoveRegs) ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
        L::produce(p, vp, smem, full, empty, qempty, tma);
        return;
      }
      if constexpr (Cfg::kMoveRegs) ptx::setmaxnreg_inc<Cfg::kComputeRegs>();
      if constexpr (Cfg::kOverlap) {
        consume_overlap(p, vp, smem, full, empty, qempty);
        return;
      }
    } else {
      if (!L::start(p, vp, smem, cur, page, slot)) return;
    }

    uint8_t* qbuf = smem + Cfg::kQAt;
    uint8_t* cbuf = qbuf + Cfg::kQBuffers * Cfg::kQBytes;
    int n_def = 0;  // split sub-items waiting for their arrival (arrive)
    const uint32_t qs0 = ptx::smem_u32(qbuf);
    const uint32_t os = uniform(ptx::smem_u32(smem + Cfg::kOnesAt));


    // d_run: the rows' softmax sums, in O's C-fragment layout for 8 columns: this lane's partial sums of
    // rows g and g + 8 in [0] and [2] (the quad's sum is taken at the end), or with the row-sum MMA
    // (kRowSum) its D fragment, whose every column is the whole row's sum.
    float m_run[kMF][2], d_run[kMF][4], o[kMF][kDTiles][4];
    float bias_slope = 0.f;  // kBias: this lane's rows' ALiBi slope, log2 units
    constexpr int kUnitRows = Cfg::kUnitRows;
    const int unit = warp / kUnitWarps;  // a warp, or a warpgroup with wgmma: they skip steps together
    FI_TIMELINE_COUNTER(tl_n);  // perf/tools/timeline.py: 9 waiting for a tile, then 8 (a sub-item's first) or 1
                                // landed, 2 / 3 a sub-item's finish, 4 the queue's end

    for (int j = 0;; ++j) {
      uint8_t* stage = smem + (j % kStages) * Cfg::kStageBytes;
      if constexpr (Cfg::kProducer) {
        if (threadIdx.x == 0) FI_STAMP(0, tl_n, 9);
        ptx::mbar_wait(full + 8 * (j % kStages), (j / kStages) & 1);
        wgmma::fence_proxy_async();  // the landed tile (cp.async writes, generic proxy), for the tensor cores
      } else {
        L::before_barrier(p, smem, j, cur, page, slot);
        ptx::cp_async_wait<kStages - 2>();
        if constexpr (kWgmma) wgmma::fence_proxy_async();  // the landed tile, for the tensor cores' reads
        __syncthreads();
        L::step(p, vp, smem, j, cur, page, slot);
      }

      const TileRecord* rec = Cfg::record(smem, j % kStages);
      const int flags = rec->flags;
      if (threadIdx.x == 0) FI_STAMP(0, tl_n, (flags & kEnd) ? 4 : (flags & kFirst) ? 8 : 1);
      if (flags & kEnd) {
        if (n_def) {
          if (threadIdx.x == 0) FI_STAMP(0, tl_n, 2);
          arrive(p, vp, smem, n_def);
          if (threadIdx.x == 0) FI_STAMP(0, tl_n, 3);
        }
        break;
      }
      const Work& w = rec->w;
      const int kv_head = kv_head_of(p, w.unit);  // for the hooks' contexts (unused ones cost nothing)
      // The unit's real rows: packed rows [first_pr, first_pr + kUnitRows) clipped to the sub-item.
      const int first_pr = kUnitRows * unit;
      const int last_r = min((first_pr + kUnitRows - 1) / kHPC, w.nrows - 1);
      const bool unit_active = first_pr < Cfg::kPackedRows && first_pr / kHPC < w.nrows;
      const uint32_t qs = uniform(L::kQCopy ? qs0 + rec->qslot * Cfg::kQBytes : qs0);
      if (flags & kFirst) {
        // With the loader's query copy (L::kQCopy) the tile is in qs already. The __syncwarp costs nothing
        // and keeps ptxas from serialising the wgmmas for lack of registers (C7512 without it).
        if constexpr (L::kQCopy) __syncwarp();
        else if (unit_active) load_q(p, vp, w, qbuf);
        if constexpr (kBias) bias_slope = bias_setup(p, vp, w, smem);
#pragma unroll
        for (int mf = 0; mf < kMF; ++mf) {
          m_run[mf][0] = m_run[mf][1] = -INFINITY;
          d_run[mf][0] = d_run[mf][1] = d_run[mf][2] = d_run[mf][3] = 0.f;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mf][dt][e] = 0.f;
        }
      }

      uint32_t ks = uniform(ptx::smem_u32(stage)), vs = ks + Cfg::kKvTileBytes;
      if constexpr (kConvert) {
        convert_tile(vp, stage, cbuf, rec, kv_head);
        if constexpr (kWgmma) wgmma::fence_proxy_async();
        __syncthreads();
        if constexpr (kFp8) {
          ks = ptx::smem_u32(cbuf);
          vs = ks + Cfg::kCTileBytes;
        }
      }
      // The tile in compute steps of kStep tokens (S of a step in registers). Causal: a step wholly past
      // the unit's last row is skipped; one wholly at or before its first row needs no mask, nor does a
      // full step without a LogitsMask (padding rows compute on zero queries and are never written).
      const int climit_lo = w.kv_len - w.q_len + w.q_idx0 + first_pr / kHPC;
      const int climit_hi = w.kv_len - w.q_len + w.q_idx0 + last_r;
      // A variant whose mask is its KV range (a sliding window): positions [range_lo, range_hi) are visible
      // to every row of the unit (the last row's lower edge, the first row's upper edge), and none outside
      // [seen_lo, seen_hi) to any (the first row's lower edge, the last row's upper edge): steps there are
      // skipped (the loader's range is the sub-item's, wider than a unit's).
      int range_lo = 0, range_hi = 0, seen_lo = INT_MIN, seen_hi = INT_MAX;
      if constexpr (Variant::kMaskIsKvRange) {
        int lo = INT_MIN, hi = INT_MAX;
        Variant::kv_range(vp, w.pos_off + climit_hi, w.pos_off + climit_hi, lo, hi);
        range_lo = lo;
        seen_hi = hi;
        lo = INT_MIN, hi = INT_MAX;
        Variant::kv_range(vp, w.pos_off + climit_lo, w.pos_off + climit_lo, lo, hi);
        range_hi = hi;
        seen_lo = lo;
      }
#pragma unroll 1
      for (int st = 0; st < kTile / kStep; ++st) {
        const int step_begin = rec->tile_kv_begin + st * kStep, n_valid = rec->n_valid - st * kStep;
        bool stop = !unit_active || n_valid <= 0 || (p.causal && step_begin > climit_hi);  // nor any later step
        bool skip = stop;
        if constexpr (Variant::kMaskIsKvRange) {
          stop = stop || w.pos_off + step_begin >= seen_hi;
          skip = stop || w.pos_off + step_begin + min(n_valid, kStep) <= seen_lo;
        }
        if (skip) {
          if (stop) break;
          continue;
        }
        // (a non-positive scale would break the raw-logit maximum: it takes the masked path)
        const bool need_mask = (Variant::kHasLogitsMask && !Variant::kMaskIsKvRange) || n_valid < kStep ||
                               (Variant::kMaskIsKvRange && (w.pos_off + step_begin < range_lo ||
                                                            w.pos_off + step_begin + kStep > range_hi)) ||
                               (p.causal && step_begin + kStep - 1 > climit_lo) || !(p.logits_scale > 0.f);
        if constexpr (kWgmma)
          compute_tile<kMaskedIf>(p, vp, qs, ks, vs, os, st * kStep, w, step_begin, n_valid, kv_head, need_mask, bias_slope,
                                  m_run, d_run, o);
        else if (need_mask)
          compute_tile<kMasked>(p, vp, qs, ks, vs, os, st * kStep, w, step_begin, n_valid, kv_head, true, bias_slope, m_run, d_run, o);
        else
          compute_tile<kFull>(p, vp, qs, ks, vs, os, st * kStep, w, step_begin, n_valid, kv_head, false, bias_slope, m_run, d_run, o);
      }

      if constexpr (Cfg::kProducer) {  // the record is read by finish: release after it
        if (!(flags & kLast)) release(empty + 8 * (j % kStages));
      }
      if (flags & kLast) {
        if (threadIdx.x == 0) FI_STAMP(0, tl_n, 2);
        finish(p, vp, w, m_run, d_run, o, smem, n_def);
        if (threadIdx.x == 0) FI_STAMP(0, tl_n, 3);
        if constexpr (Cfg::kProducer) {
          release(qempty + 8 * rec->qslot);
          release(empty + 8 * (j % kStages));
        }
      }
    }
  }

  // End of a sub-item: normalise this warp's rows and write them out, or write partial states and wait for
  // the arrival (arrive), which merges the rows whose last chunk this CTA completed.
  static __device__ __forceinline__ void finish(const Params& p, const VariantParams& vp, const Work& w,
                                                float (&m_run)[kMF][2], float (&d_run)[kMF][4],
                                                float (&o)[kMF][kDTiles][4], uint8_t* smem, int& n_def) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int row0 = w.row0, nrows = w.nrows, item_q_begin = w.item_q_begin;
    const int partial_base = w.partial_base, partial_stride = w.partial_stride, unit = w.unit;
    const bool split = partial_base >= 0;
#pragma unroll
    for (int mf = 0; mf < kMF; ++mf)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        if constexpr (!kRowSum) {
          d_run[mf][2 * hf] += __shfl_xor_sync(0xffffffffu, d_run[mf][2 * hf], 1);
          d_run[mf][2 * hf] += __shfl_xor_sync(0xffffffffu, d_run[mf][2 * hf], 2);
        }
        const RowInfo ri = E::row_info(w, frag_row0(warp, mf) + 8 * hf + g);
        if (!ri.valid) continue;
        float scale = p.v_scale, lse_val = 0.f;
        if constexpr (Variant::kUseSoftmax) {
          const float den = d_run[mf][2 * hf];
          scale = den > 0.f ? p.v_scale / den : 0.f;
          lse_val = den > 0.f ? (m_run[mf][hf] + __log2f(den)) * kLn2 : -INFINITY;
        }
        const int q_row = ri.q_row, qo_head = ri.qo_head;
        if (!split) {
          DQ* dst = static_cast<DQ*>(p.out) + (int64_t)q_row * p.out_stride_row + (int64_t)qo_head * p.out_stride_head;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            const int d = 8 * dt + 2 * c;
            float lo = o[mf][dt][2 * hf] * scale, hi = o[mf][dt][2 * hf + 1] * scale;
            if constexpr (Variant::kHasOutputTransform) {
              lo = Variant::output_transform(vp, lo, OutputCtx{q_row, qo_head, d});
              hi = Variant::output_transform(vp, hi, OutputCtx{q_row, qo_head, d + 1});
            }
            *reinterpret_cast<uint32_t*>(dst + d) = ptx::pack2<Cfg::kQBf16>(lo, hi);
          }
          if (Variant::kUseSoftmax && p.lse != nullptr && c == 0)
            p.lse[(int64_t)q_row * p.lse_stride_row + qo_head] = lse_val;
        } else {
          const int64_t prow = partial_base + (int64_t)(q_row - item_q_begin) * partial_stride;
          float* dst = p.partial_o + (prow * p.num_qo_heads + qo_head) * kHeadDim;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt)
            __stcg(reinterpret_cast<float2*>(dst + 8 * dt + 2 * c),
                   make_float2(o[mf][dt][2 * hf] * scale, o[mf][dt][2 * hf + 1] * scale));
          if (c == 0) __stcg(p.partial_lse + prow * p.num_qo_heads + qo_head, lse_val);
        }
      }
    if (!split) return;
    if (threadIdx.x == 0) reinterpret_cast<int4*>(smem + Cfg::kDeferAt)[n_def] = make_int4(row0, nrows, unit, 0);
    // A shared-prefix chunk (q_len 0: begin_work) of a plan that cut its chunks for own items to follow them
    // arrives at once: those own items then arrive last and merge their request's rows, where the chunk
    // would merge its whole tile's rows alone (an arrival costs the compute warps a few us: others wait).
    if (++n_def == Cfg::kDefer || (w.q_len == 0 && __ldg(p.plan + FI_PLAN_CHUNKS_AT_ONCE)))
      arrive(p, vp, smem, n_def);
  }

  // States a merge loads a round trip (8 spilled at 8 x 2 and head size 256).
  static constexpr int kMergeBatch = 4;

  // The waiting split sub-items' arrivals (threadfence reduction pattern): their partial states fenced once,
  // then every row's counter at once (the atomics' round trips overlap); the CTA whose arrival is a row's last
  // merges it. Run by every compute thread with the same n_def, which it resets. Not inlined: at its two call sites
  // the merge's registers made ptxas spill more (8 x 2 at 4 states a round trip: 248 bytes, against 44 as a call).
  static __device__ __noinline__ void arrive(const Params& p, const VariantParams& vp, uint8_t* smem, int& n_def) {
    constexpr int kRowsMax = Cfg::kTileRows;
    constexpr int kSlotRounds = (Cfg::kDefer * kRowsMax + kThreads - 1) / kThreads;
    const int4* def = reinterpret_cast<const int4*>(smem + Cfg::kDeferAt);
    uint32_t* flags = reinterpret_cast<uint32_t*>(smem + Cfg::kFlagsAt);
    __threadfence();
    sync_compute();  // every warp's partial states fenced; the records written
    const int32_t* mi = p.plan + p.merge_indptr_offset;
    bool last[kSlotRounds];
#pragma unroll
    for (int i = 0; i < kSlotRounds; ++i) {  // slot k * kRowsMax + r: record k's row r
      const int slot = i * kThreads + threadIdx.x, k = slot / kRowsMax, r = slot % kRowsMax;
      last[i] = false;
      if (k < n_def) {
        const int4 d = def[k];
        if (r < d.y) {
          const int q_row = d.x + r;
          const int chunks = __ldg(mi + q_row + 1) - __ldg(mi + q_row);
          int32_t* counter = E::merge_counter(p, q_row, d.z);
          last[i] = atomicAdd(counter, 1) == chunks - 1;
          if (last[i]) *counter = 0;  // nobody else touches it in this launch: leave it zeroed for the next
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kSlotRounds; ++i) {  // a bit a slot, a word a warp (whole warps: ballot)
      const int slot = i * kThreads + threadIdx.x;
      const uint32_t bits = __ballot_sync(0xffffffffu, last[i]);
      if ((threadIdx.x & 31) == 0 && slot < n_def * kRowsMax) flags[slot >> 5] = bits;
    }
    sync_compute();
    // The merged rows' units (a query head's 8 dims of a row) of every record in one pass: a thread's units are
    // independent, so their states' round trips are its only wait (record by record, a CTA with many one-row
    // records waited for each in turn at its queue's end).
    constexpr int kVecs = kHeadDim / 8, kUnitsPerRow = kHPC * kVecs;
    int total = 0;
    for (int k = 0; k < n_def; ++k) total += def[k].y * kUnitsPerRow;
    if (total * 2 <= kThreads) {  // few units (a request's rows): lanes share each
      merge_lanes(p, vp, def, flags, total);
      sync_compute();
      n_def = 0;
      return;
    }
    bool fenced = false;
    for (int i = threadIdx.x; i < total; i += kThreads) {
      int k = 0, u = i;
      while (u >= def[k].y * kUnitsPerRow) u -= def[k++].y * kUnitsPerRow;
      const int4 d = def[k];
      const int r = u / kUnitsPerRow, slot = k * kRowsMax + r;
      if (!((flags[slot >> 5] >> (slot & 31)) & 1u)) continue;
      if (!fenced) {  // the other CTAs' partial states, written before their arrivals
        __threadfence();
        fenced = true;
      }
      const int q_row = d.x + r, qo_head = d.z * kHPC + (u / kVecs) % kHPC, d0 = (u % kVecs) * 8;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float mx = -INFINITY, den = 0.f;
      E::template merge_states<kMergeBatch, true>(p, qo_head, d0, __ldcg(mi + q_row), kMergeBatch,
                                                  __ldcg(mi + q_row + 1), acc, mx, den);
      E::merge_store(p, vp, q_row, qo_head, d0, acc, mx, den);
    }
    sync_compute();  // the records and flags are reused
    n_def = 0;
  }

  // arrive's merge where its units x 2 fit the compute threads: up to 8 neighbouring lanes share a unit, each
  // merging every lanes-th batch of its states, combined by shuffles (a row of n states in n / (4 x lanes)
  // round trips; a request's own item that arrives last merges its rows at the queue's end).
  static __device__ __forceinline__ void merge_lanes(const Params& p, const VariantParams& vp, const int4* def,
                                                     const uint32_t* flags, int total) {
    constexpr int kRowsMax = Cfg::kTileRows, kVecs = kHeadDim / 8, kUnitsPerRow = kHPC * kVecs;
    const int32_t* mi = p.plan + p.merge_indptr_offset;
    int lanes_log2 = 1;
    while (lanes_log2 < 3 && (total << (lanes_log2 + 1)) <= kThreads) ++lanes_log2;
    const int lanes = 1 << lanes_log2, lane = threadIdx.x & (lanes - 1);
    int u = threadIdx.x >> lanes_log2, k = 0;
    bool live = u < total;
    if (live)
      while (u >= def[k].y * kUnitsPerRow) u -= def[k++].y * kUnitsPerRow;
    const int4 d = live ? def[k] : make_int4(0, 0, 0, 0);
    const int r = u / kUnitsPerRow, slot = k * kRowsMax + r;
    live = live && ((flags[slot >> 5] >> (slot & 31)) & 1u);
    const int q_row = d.x + r, qo_head = d.z * kHPC + (u / kVecs) % kHPC, d0 = (u % kVecs) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float mx = -INFINITY, den = 0.f;
    if (live) {
      __threadfence();  // the other CTAs' partial states, written before their arrivals
      E::template merge_states<kMergeBatch, true>(p, qo_head, d0, __ldcg(mi + q_row) + lane * kMergeBatch,
                                                  lanes * kMergeBatch, __ldcg(mi + q_row + 1), acc, mx, den);
    }
    __syncwarp();  // every lane reaches the shuffles with the full warp
    E::combine_lanes(lanes, acc, mx, den);
    if (live && lane == 0) E::merge_store(p, vp, q_row, qo_head, d0, acc, mx, den);
  }
};

}  // namespace prefill
}  // namespace fi
