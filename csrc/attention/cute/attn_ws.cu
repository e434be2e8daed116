// The prefill family's CuTe member (fi_backend/cute_member.py, docs/prefill.md): FlashAttention-3's CTA on CUTLASS /
// CuTe's SM90 atoms. A producer warpgroup whose first warp issues every TMA load (Q once, then K and V tiles through
// two PipelineTmaAsync rings), and two or three consumer warpgroups of 64 rows each (a 128- or 192-row query tile),
// with registers moved to them by setmaxnreg. Per KV tile a consumer waits for K, runs S = Q K^T, frees K, runs the
// online softmax, waits for V, runs O += P V and frees V. A work tile is one query head's 128 or 192 tokens
// (FlashAttention-3's: GQA heads not packed); the grid is persistent, one CTA an SM, each taking its next tile from a
// counter in global memory
// (dynamic: causal tiles' lengths differ). Tiles are ordered in sections of (request, head) pairs whose KV fits in L2
// together (the CTAs at work at once read the same KV), causal ones longest first within a section. The producer
// picks the tiles: it fetches the next index while the current one loads, hands it to the consumers in shared memory
// with the tile's Q (barrier q_full), loads a tile's first K as the ring frees up and its Q once the consumers are
// done with the last one's (barrier q_empty, before their epilogue).
// KV tiles run from the last to the first, as FlashAttention-3's: the causal diagonal (the one masked tile) comes
// first. OVERLAP 1 is FlashAttention-3's intra-warpgroup overlap: S of tile n is issued with P.V of tile n + 1 (the
// one before it in this order), and the softmax of S runs while that P.V is in flight. PINGPONG 1 (with OVERLAP) has
// the consumer warpgroups issue their MMAs in turns on named barriers, so one's softmax runs under the others'
// MMAs.
// Template parameters: HEAD_DIM 64, 96, 128 or 256, STAGES (2), WARPGROUPS (consumers: 2 or 3), CAUSAL, OVERLAP,
// PINGPONG, SOFTCAP (0 / 1), BF16 (1: bf16, 0: fp16), PAGE (0: ragged K / V, entries fi_cute_attn_ws (contiguous
// tensors) and fi_cute_attn_bsr (a ragged BSR); else pages of PAGE tokens read through a BSR, entry fi_cute_attn_bsr;
// the BSR entry also takes a sliding window: window_left >= 0, KV tiles below every row's window skipped), GATHER
// (paged: 0, K / V by TMA boxes, one a page and 64-dim block, pages of 16 tokens or more; 1, K / V rows gathered by
// the producer warpgroup's 128 threads with cp.async, 16 bytes a copy, pages of any power of two: FlashAttention-3's
// paged path, for pages too small for TMA boxes to pay).
// Requests: b's query rows qo_indptr[b] .. qo_indptr[b + 1] (int32, device), any lengths with 1 <= q_len <= kv_len,
// causal bottom-right aligned (query i sees keys <= kv_len - q_len + i); max_q_len bounds the query tiles. lse
// float32 natural log, logits scaled by sm_scale. counter: one int32 of device memory the call zeroes on its stream
// before the launch (the tile counter). l2_section_bytes: the KV a section of tiles may span (0: one KV head's).
// Keys past a request's KV and past a row's causal limit are masked on the tiles that hold any, and query rows past
// the request's end are computed but not stored.
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "attention/ptx.cuh"
#include "attention/variant.cuh"
#include "common.h"

namespace fi {
namespace cute_probe {  // named: cute has anonymous namespaces of its own, which the kernel stub must not meet

using namespace cute;
#define FI_CUTE_BF16 {{BF16}}
using Elem = std::conditional_t<FI_CUTE_BF16, cute::bfloat16_t, cute::half_t>;  // Q, K, V and O
constexpr bool kBf16 = FI_CUTE_BF16;
constexpr int kHeadDim = {{HEAD_DIM}}, kStages = {{STAGES}};
constexpr bool kCausal = {{CAUSAL}}, kOverlap = {{OVERLAP}}, kPingPong = {{PINGPONG}};
constexpr bool kSoftCap = {{SOFTCAP}};  // logits = cap x tanh(logits / cap) (Gemma-2's), cap from Args
// LAZY 1: a row keeps its softmax maximum until a KV tile's exceeds it by more than 2^kLazyLog2 (in exp2), so P stays
// below 2^8 and a warp skips O's rescale where none of its rows moved (FlashAttention-4's; the tile family's too); O,
// the row sums and the LSE all use the kept maximum. 0: the maximum moves, and O is rescaled, every tile
constexpr bool kLazyRescale = {{LAZY}};
constexpr float kLazyLog2 = 8.f;
#define FI_CUTE_PAGE {{PAGE}}
constexpr int kPage = FI_CUTE_PAGE;  // 0: K / V ragged [tokens, kv_heads, D]; else pages of kPage tokens (a BSR)
constexpr bool kGather = {{GATHER}};
static_assert(!kGather || kPage > 0, "gather: paged K / V only");
static_assert(!kPingPong || kOverlap, "ping-pong: the overlapped loop's warpgroups");
static_assert(kHeadDim % 32 == 0, "head size: whole 64-byte swizzle atoms");
// Dims a swizzle atom's row holds: 64 (128-byte rows, 128-byte swizzle) where the head size allows, else 32 (head size
// 96: 64-byte rows and swizzle). A row of an atom is a token's dims of one block in every layout below.
constexpr int kDimBlock = kHeadDim % 64 == 0 ? 64 : 32;
using DimBlock = Int<kDimBlock>;
using AtomK = std::conditional_t<kDimBlock == 64, GMMA::Layout_K_SW128_Atom<Elem>, GMMA::Layout_K_SW64_Atom<Elem>>;
using AtomMN = std::conditional_t<kDimBlock == 64, GMMA::Layout_MN_SW128_Atom<Elem>, GMMA::Layout_MN_SW64_Atom<Elem>>;
// KV tiles of 128 tokens; 64 at head size 256, where O (128 registers a thread) and 128-token K / V stages would not
// fit (FlashAttention-3 takes 80 there)
// WARPGROUPS consumer warpgroups of 64 query rows each: 2 (128-row tiles), or 3 (192 rows, FlashAttention-3's at head
// sizes 64 and 96, where a KV tile's MMAs are short against its softmax). Three at 96 take KV tiles of 96 tokens: with
// 128, S, P and O overflow the 160 registers a consumer thread then gets and ptxas serialises the wgmma
// (FlashAttention-3 keeps 144 but writes P to shared memory)
constexpr int kWarpGroups = {{WARPGROUPS}};
static_assert(kWarpGroups == 2 || (kWarpGroups == 3 && (kHeadDim == 64 || kHeadDim == 96)),
              "consumer warpgroups: 2, or 3 at head sizes 64 and 96");
constexpr int kRows = 64 * kWarpGroups, kConsumers = 128 * kWarpGroups;
constexpr int kKv = kHeadDim == 256 ? 64 : kHeadDim == 96 && kWarpGroups == 3 ? 96 : 128;
constexpr int kThreads = 128 + kConsumers;
using D = Int<kHeadDim>;
using SmemLayoutQ = decltype(tile_to_shape(AtomK{}, Shape<Int<kRows>, D>{}));
using SmemLayoutO = SmemLayoutQ;  // O staged for coalesced stores
// Head size 256: Q, K and V take 192 KB of shared memory, so O is staged 64 dims at a time through rows of 64 + 8
// elements (the pad: 16-byte row reads without bank conflicts)
constexpr bool kChunkedO = kHeadDim == 256;
constexpr int kOPitch = 64 + 8;
using SmemLayoutK = decltype(tile_to_shape(AtomK{}, Shape<Int<kKv>, D, Int<kStages>>{}));
// V as P.V's B operand: (N = head dim, K = token), head dims contiguous; TMA fills it from V's transposed view. Atoms
// tiled along the tokens first, so each 64-dim block holds all 128 tokens in a row: one TMA box a block (tiled along
// the dims first, a box spans 8 tokens: 32 TMA copies a tile at head size 128)
// Paged K (and V without kVPageBox): TMA boxes of kBox tokens x 64 dims, one a page and 64-dim block (several a KV
// tile below 128 tokens a page). A box is a contiguous run of the stage's atoms in both layouts (K: rows first; V:
// tokens first), laid out as the layouts below.
constexpr int kBox = kPage == 0 || kPage >= kKv || kGather ? kKv : kPage, kBoxes = kKv / kBox;
// Pages below a KV tile: V takes one box a page, all its dim blocks (a 3-D box: dims of a block, the page's tokens,
// the blocks), laid out page after page, each page's blocks of kBox tokens in a run. P.V's k-blocks of 16 tokens stay
// within a page, and a k-block is where GMMA needs its canonical layout, so the page-major order costs the MMA
// nothing. K cannot: S's N = 128 tokens would span pages at uneven strides.
constexpr bool kVPageBox = {{VBOX}} && kBoxes > 1 && kHeadDim > kDimBlock;
// Pages below a KV tile (TMA): the producer warpgroup's four warps each issue the boxes of every fourth page (one
// elected lane a warp, each page id looked up by its own warp), where one thread issuing a tile's 16-24 K boxes,
// each behind its page id and coordinates, left the consumers waiting on K (ncu: docs/prefill.md)
constexpr bool kSplitIssue = {{SPLIT}} && kBoxes > 1 && !kGather;
constexpr int kIssuers = kSplitIssue ? 4 : 1;
constexpr int kDimBlocks = kHeadDim / kDimBlock;
using VtPage = decltype(tile_to_shape(AtomMN{}, Shape<D, Int<kBox>>{}, Step<_2, _1>{}));
// The same page as the box's (dims of a block, tokens, blocks): V's view for its TMA map, D split in two modes
using VtPageBox = decltype(blocked_product(tile_to_shape(AtomMN{}, Shape<DimBlock, Int<kBox>>{}),
                                           make_layout(make_shape(_1{}, _1{}, Int<kDimBlocks>{}))));
using SmemLayoutVt = std::conditional_t<
    kVPageBox, decltype(blocked_product(VtPage{}, make_layout(make_shape(_1{}, Int<kBoxes>{}, Int<kStages>{})))),
    decltype(tile_to_shape(AtomMN{}, Shape<D, Int<kKv>, Int<kStages>>{}, Step<_2, _1, _3>{}))>;
static_assert(kPage == 0 || ((kPage & (kPage - 1)) == 0 && (kGather || kPage >= 16)),
              "page size: a power of two, 16 or more (any where gathered)");
static_assert(kPage == 0 || kGather || (kPage < kKv ? kKv % (kPage > 0 ? kPage : 1) : kPage % kKv) == 0,
              "page size: whole pages a KV tile, or whole KV tiles a page (96-token tiles: pages of 16 or 32)");
// Registers by setmaxnreg: 128 x producer + kConsumers x consumer must not pass the launch's share (the most a thread
// of kThreads may hold: 168 at 384 threads, 128 at 512), or the consumers' setmaxnreg waits forever; a producer
// looking up several pages a KV tile (boxes, or gathered rows) needs more than 24
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
constexpr bool kManyPages = kBoxes > 1 || kGather;
// (three warpgroups: consumers below 160 serialise their wgmma, so the producer keeps 32 whatever it loads)
constexpr int kProducerRegs = kWarpGroups == 3 ? 32 : (kManyPages ? 40 : 24);
constexpr int kConsumerRegs = kWarpGroups == 3 ? 160 : (kManyPages ? 232 : 240);
static_assert(kProducerRegs * 128 + kConsumerRegs * kConsumers <= kLaunchRegs * kThreads,
              "setmaxnreg: more than the launch gave");
using SmemLayoutKBox = decltype(tile_to_shape(AtomK{}, Shape<Int<kBox>, DimBlock>{}));
// Gather: the byte offset in a K or V^T stage of the 16-byte chunk of token `row` from dim `dim` (a multiple of 8):
// rows of kDimBlock dims, a block's kKv rows in a run, chunks swizzled within a row (128-byte atoms: chunk ^ row % 8;
// 64-byte: chunk ^ row / 2 % 4); the same offsets as the layouts' (checked below), in a few integer operations
__host__ __device__ constexpr uint32_t chunk_offset(uint32_t row, uint32_t dim) {  // (unsigned: shifts and masks)
  constexpr uint32_t kRowBytes = kDimBlock * 2;
  return dim / kDimBlock * (kKv * kRowBytes) + row * kRowBytes +
         ((dim % kDimBlock / 8) ^ (row * kRowBytes / 128 % (kRowBytes / 16))) * 16;
}
// (a layout's swizzle acts on byte addresses: applied to its inner layout's element offset x 2)
template <class Layout, class... Coord>
constexpr int layout_bytes(Layout const& layout, Coord... coord) {
  return (int)layout.layout_a()(2 * (int)layout.layout_b()(coord...));
}
constexpr bool chunk_offsets_match() {
  for (int row = 0; row < kKv; ++row)
    for (int dim = 0; dim < kHeadDim; dim += 8)
      if ((int)chunk_offset(row, dim) != layout_bytes(SmemLayoutK{}, row, dim, 0) ||
          (int)chunk_offset(row, dim) != layout_bytes(SmemLayoutVt{}, dim, row, 0))
        return false;
  return layout_bytes(SmemLayoutK{}, 0, 0, 1) == 2 * kKv * kHeadDim &&
         layout_bytes(SmemLayoutVt{}, 0, 0, 1) == 2 * kKv * kHeadDim;
}
using SmemLayoutVtBox =
    std::conditional_t<kVPageBox, VtPageBox, decltype(tile_to_shape(AtomMN{}, Shape<DimBlock, Int<kBox>>{}))>;
using AtomQK = decltype(GMMA::ss_op_selector<Elem, Elem, float, Shape<_64, Int<kKv>, D>>());
using AtomPV = decltype(GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, D, Int<kKv>>, GMMA::Major::K,
                                             GMMA::Major::MN>());
using MmaQK = decltype(make_tiled_mma(AtomQK{}, Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));  // 64 rows a warpgroup
using MmaPV = decltype(make_tiled_mma(AtomPV{}, Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
// K and V stages: filled by TMA (their bytes counted), or by the producer's 128 threads' cp.async (each thread's
// arrival made when its copies land)
using Pipeline = std::conditional_t<kGather, cutlass::PipelineAsync<kStages>, cutlass::PipelineTmaAsync<kStages>>;
using PipelineState = cutlass::PipelineState<kStages>;
constexpr uint32_t kTileBytes = kKv * kHeadDim * sizeof(Elem), kQBytes = kRows * kHeadDim * sizeof(Elem);
constexpr float kLog2e = 1.4426950408889634f;
// named barriers 0 .. kWarpGroups - 1: the ping-pong's turns; then one a warpgroup's epilogue; then the consumers' V
// tail; then the producer warpgroup's tile draw (gather)
constexpr int kEpilogueBarrier = kWarpGroups, kTailBarrier = 2 * kWarpGroups, kDrawBarrier = 2 * kWarpGroups + 1;

struct SharedStorage {
  cute::array_aligned<Elem, cosize_v<SmemLayoutQ>, 1024> q;
  cute::array_aligned<Elem, cosize_v<SmemLayoutK>, 1024> k;
  cute::array_aligned<Elem, cosize_v<SmemLayoutVt>, 1024> v;
  cute::array_aligned<Elem, kChunkedO ? kRows * kOPitch : cosize_v<SmemLayoutO>, 1024> o;
  typename Pipeline::SharedStorage pipe_k, pipe_v;
  alignas(8) uint64_t q_full, q_empty;
  // arrived at, never waited on: an arrive that depends on the softmax's sums pins the P.V's wait after the
  // exponentials (ptxas keeps warpgroup waits in order with mbarrier arrives and schedules both early)
  alignas(8) uint64_t pin;
  int tile;     // the work tile whose Q q_full announces (work: none left)
  int draw[2];  // gather, split issue: the work tile the producer's thread 0 drew for all 128 (by the draw's parity)
  int64_t row_off[kGather ? 2 : 1][kGather ? kKv : 1];  // gather: a KV tile's rows' offsets in the cache
};
constexpr int kSmemBytes = sizeof(SharedStorage);

// The kernel's arguments besides the TMA maps (element strides).
struct Args {
  Elem* o;  // O [rows, heads, D] at o + row x o_stride_row + head x o_stride_head
  int64_t o_stride_row, o_stride_head;
  float* lse;  // [rows, heads] at lse + row x lse_stride_row + head (natural log), or null
  int64_t lse_stride_row;
  const int* qo_indptr;       // request b's query rows qo_indptr[b] .. qo_indptr[b + 1]
  const int* kv_lens;         // its KV length (ragged, null: kv_block_start[b + 1] - kv_block_start[b], int32)
  const void* kv_block_start;  // paged: its first page's entry in kv_indices; ragged: its first KV row (int64 where
                               // kv_block_start_int64, else int32)
  const int* kv_indices;      // paged: the pages
  int* counter;               // the tile counter (zeroed before the launch)
  int* error_flags;           // bit 1 a page id outside [0, num_pages), bit 2 an entry past kv_indices or (ragged) a
                              // request's rows past K / V's (or null)
  int64_t num_kv_indices;     // paged: kv_indices' entries
  int kv_block_start_int64, batch, max_q_len, heads, kv_heads, total_q, total_kv;
  int num_pages;  // paged: pages in the cache; ragged: rows of K / V
  int section;
  int window_left;  // >= 0: a query at position p sees keys from p - window_left on (a sliding window); -1: all
  float sm_scale;
  float softcap;  // kSoftCap: the cap (> 0)
  const Elem* k;  // gather: the caches, token `slot` of page p and KV head h at p x kv_stride_block + slot x
  const Elem* v;  // kv_stride_token + h x kv_stride_head (elements)
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
};

// threadIdx.x read where it is used: volatile, so not hoisted (nor the addresses computed from it) out of a loop
__device__ __forceinline__ int fresh_tid() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// The first of a consumer thread's two accumulator rows (the other 8 below) in the 128-row tile, by its index among
// the consumer threads and its lane (GMMA's C layout)
__device__ __forceinline__ int acc_row0(int ctid, int lane) {
  return (ctid / 128) * 64 + ((ctid / 32) % 4) * 16 + (lane >> 2);
}

template <class TmaQ, class TmaK, class TmaV>
__global__ void __launch_bounds__(kThreads, 1) attn_ws(CUTE_GRID_CONSTANT TmaQ const tma_q,
                                                        CUTE_GRID_CONSTANT TmaK const tma_k,
                                                        CUTE_GRID_CONSTANT TmaV const tma_v,
                                                        CUTE_GRID_CONSTANT Args const a) {
  const int batch = a.batch, max_q_len = a.max_q_len, heads = a.heads, kv_heads = a.kv_heads;
  const int section = a.section;
  const int* __restrict__ qo_indptr = a.qo_indptr;
  int* __restrict__ counter = a.counter;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int tid = threadIdx.x, warp_group = tid / 128;
  const int warp_in_group = __shfl_sync(0xffffffffu, (tid / 32) % 4, 0);
  const int max_qtiles = (max_q_len + kRows - 1) / kRows, pairs = heads * batch, work = max_qtiles * pairs;
  // Work tile t: section t / (section x max_qtiles) of `section` (request, head) pairs (heads of one KV head
  // adjacent), within it the query tile rank (the causal ones last-first: the longest first where lengths are
  // alike), then the pair. False where the request has no such query tile (the producer skips it).
  struct Tile {
    int qtile, head, b, q_begin, q_len, kv_begin, kv_len, ntiles;  // kv_begin: paged, the first page's entry
    int n_lo;  // the first KV tile the tile's rows see (a sliding window), else 0: tiles n_lo .. ntiles - 1 run
  };
  auto coords = [&](int t, Tile& w) -> bool {
    const int sec = t / (section * max_qtiles), r = t - sec * section * max_qtiles;
    const int in_sec = min(section, pairs - sec * section);  // the last section may be short
    const int rank = r / in_sec, pair = sec * section + r % in_sec;
    w.qtile = kCausal ? max_qtiles - 1 - rank : rank;
    w.head = pair % heads;
    w.b = pair / heads;
    w.q_begin = __ldg(qo_indptr + w.b);
    w.q_len = __ldg(qo_indptr + w.b + 1) - w.q_begin;
    if (w.qtile * kRows >= w.q_len) return false;
    w.kv_begin = a.kv_block_start_int64 ? (int)__ldg(static_cast<const int64_t*>(a.kv_block_start) + w.b)
                                        : __ldg(static_cast<const int*>(a.kv_block_start) + w.b);
    if constexpr (kPage == 0) {
      w.kv_len = a.kv_lens != nullptr ? __ldg(a.kv_lens + w.b)
                                      : __ldg(static_cast<const int*>(a.kv_block_start) + w.b + 1) - w.kv_begin;
      // rows outside K / V: TMA reads them as zeros; flagged as a bad BSR
      if ((w.kv_begin < 0 || w.kv_len > a.num_pages - w.kv_begin) && a.error_flags != nullptr)
        atomicOr(a.error_flags, 2);
    } else {
      w.kv_len = __ldg(a.kv_lens + w.b);
    }
    // keys the tile's last row sees (causal), or all of them
    const int last_row = min(w.q_len, (w.qtile + 1) * kRows) - 1;
    const int kv_end = kCausal ? min(w.kv_len, w.kv_len - w.q_len + last_row + 1) : w.kv_len;
    w.ntiles = (kv_end + kKv - 1) / kKv;
    // the first row's lowest key (a window)
    w.n_lo = a.window_left >= 0 ? max(0, w.kv_len - w.q_len + w.qtile * kRows - a.window_left) / kKv : 0;
    return true;
  };
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), SmemLayoutVt{});

  typename Pipeline::Params pp;
  pp.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  [&](auto& params) {  // generic: each branch names only its pipeline's fields
    if constexpr (kGather) {
      params.producer_arv_count = 128;  // each producer thread's noinc arrival, once its copies of the stage land
      params.consumer_arv_count = kConsumers;
    } else {
      params.transaction_bytes = kTileBytes;
      params.is_leader = tid == 0;
      params.num_consumers = kConsumers;
    }
  }(pp);
  auto make_pipeline = [&](auto& storage) {
    if constexpr (kGather) return Pipeline(storage, pp);
    else return Pipeline(storage, pp, Shape<_1, _1, _1>{});
  };
  Pipeline pipe_k = make_pipeline(ss.pipe_k);
  Pipeline pipe_v = make_pipeline(ss.pipe_v);
  if (tid == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&ss.q_full, 1);
    cutlass::arch::ClusterBarrier::init(&ss.q_empty, kConsumers);
    cutlass::arch::ClusterBarrier::init(&ss.pin, 1);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();  // barriers initialised before anyone waits on or arrives at them

  if (warp_group == 0) {  // producer
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    // The tile loop is thread 0's (the tile counter, Q's TMA load, the end), or with gather or split issue every
    // producer thread's: thread 0 draws each tile and hands it to the others through ss.draw (named barrier
    // kDrawBarrier)
    const bool issuer = kGather || cute::elect_one_sync();  // a warp's TMA issuer (split issue: every warp's)
    const bool leader = kGather ? tid == 0 : (warp_in_group == 0 && issuer);
    if (!kGather && !kSplitIssue && !leader) return;
    Tensor mQ = tma_q.get_tma_tensor(make_shape(a.total_q, D{}, heads));
    PipelineState st = cutlass::make_producer_start_state<Pipeline>();
    Tile w;
    auto next_valid = [&](int t) {  // the first tile from t on that has query rows (work: none)
      while (t < work && !coords(t, w)) t = gridDim.x + atomicAdd(counter, 1);
      return t;
    };
    int t = leader ? next_valid(blockIdx.x) : 0;
    for (int j = 0;; ++j) {
      if constexpr (kGather || kSplitIssue) {
        if (leader) ss.draw[j & 1] = t;
        cutlass::arch::NamedBarrier::sync(128, kDrawBarrier);
        t = ss.draw[j & 1];
        if (!leader && t < work) coords(t, w);
      }
      if (t >= work) {  // none left: tell the consumers (no bytes to wait for)
        if (leader) {
          if (j > 0) cutlass::arch::ClusterBarrier::wait(&ss.q_empty, (j - 1) & 1);
          ss.tile = work;
          cutlass::arch::ClusterBarrier::arrive(&ss.q_full);
        }
        break;
      }
      const int next = leader ? gridDim.x + atomicAdd(counter, 1) : 0;  // in flight while this tile's loads go out
      const int kv_head = w.head / (heads / kv_heads);
      auto load_q = [&] {  // after the tile's first K: that K may land while the last tile's S still runs
        if (!leader) return;
        // tiles from the request's own first row (TMA coordinates: any offset)
        Tensor gQ = local_tile(domain_offset(make_coord(w.q_begin, 0), mQ(_, _, w.head)), Shape<Int<kRows>, D>{},
                               make_coord(w.qtile, 0));                                                    // (rows, D)
        auto [tQg, tQs] = tma_partition(tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        if (j > 0) cutlass::arch::ClusterBarrier::wait(&ss.q_empty, (j - 1) & 1);  // its Q is done with
        ss.tile = t;
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full, kQBytes);
        copy(tma_q.with(ss.q_full), tQg, tQs);
      };
      // A bad BSR is flagged (fi_backend's ErrorBits) and never read past: an entry outside kv_indices or a page id
      // outside the cache is page num_pages, past the TMA map's end: boxes of zeros (gathered: publish_row's zeros)
      auto page_of = [&](int64_t e) {
        int page = a.num_pages, bad = 2;
        if (e >= 0 && e < a.num_kv_indices) {
          page = __ldg(a.kv_indices + e);
          bad = (unsigned)page < (unsigned)a.num_pages ? 0 : 1;
          if (bad) page = a.num_pages;
        }
        if (bad && a.error_flags != nullptr) atomicOr(a.error_flags, bad);
        return page;
      };
      if constexpr (kGather) {
        // A KV tile's K or V^T into a stage (gather(cache, stage, parity)): 16-byte chunks of token rows, thread i
        // taking chunks i, i + 128, ... of the tile's rows (consecutive threads, consecutive chunks of a row: rows
        // coalesced); a chunk lands at its (token, dims) in the stage's swizzled layout, where its 8 dims are
        // contiguous in K's and V^T's alike. Tokens past the request's KV, or of a bad entry, read as zeros.
        static_assert(!kGather || chunk_offsets_match(), "gather: chunk_offset disagrees with the stages' layouts");
        // Each row's offset in the cache (elements; -1: zeros) is looked up once a KV tile, by thread `row` (kKv <=
        // 128), into ss.row_off, and K and V share it. The next tile's page ids are loaded before this tile's copies
        // and published after them (fetch_row, then publish_row), so no copy waits for a lookup. By the tile's
        // parity: a row's readers of the tile before are past the barrier that precedes the next write.
        struct RowFetch {
          int token, page, bad;  // bad: fi_backend's ErrorBits (2: an entry past kv_indices)
        };
        auto fetch_row = [&](int n) {
          RowFetch f{n * kKv + tid, a.num_pages, 0};
          if (tid < kKv && f.token < w.kv_len) {  // (unsigned: division by a power of two is a shift)
            const int64_t e = (int64_t)w.kv_begin + (unsigned)f.token / kPage;
            if (e >= 0 && e < a.num_kv_indices) f.page = __ldg(a.kv_indices + e);
            else f.bad = 2;
          }
          return f;
        };
        auto publish_row = [&](const RowFetch& f, int parity) {
          if (tid < kKv) {
            int64_t off = -1;
            if (f.token < w.kv_len) {
              const int bad = f.bad ? f.bad : (unsigned)f.page < (unsigned)a.num_pages ? 0 : 1;
              if (!bad) off = f.page * a.kv_stride_block + (unsigned)f.token % kPage * a.kv_stride_token;
              else if (a.error_flags != nullptr) atomicOr(a.error_flags, bad);
            }
            ss.row_off[parity][tid] = off;
          }
          cutlass::arch::NamedBarrier::sync(128, kDrawBarrier);
        };
        auto gather = [&](const Elem* base, const Elem* stage_smem, int parity) {
          constexpr int kChunks = kHeadDim / 8, kIters = kKv * kChunks / 128;
          static_assert(kKv * kChunks % 128 == 0, "gather: whole chunks a thread");
          const Elem* head = base + kv_head * a.kv_stride_head;
          const uint32_t stage_u32 = ptx::smem_u32(stage_smem);
          // Where a thread's chunks are one dim block's in rows 8 apart (head sizes 64, 128: 8 or 16 chunks a row),
          // their swizzle is the same and only the row moves: one offset, then a constant stride
          constexpr int kRowStep = 128 / kChunks;
          if constexpr (128 % kChunks == 0 && kRowStep % 8 == 0) {
            const uint32_t row0 = tid / kChunks, dim = tid % kChunks * 8;
            const uint32_t dst0 = stage_u32 + chunk_offset(row0, dim);
            const int64_t* offs = &ss.row_off[parity][row0];
            head += dim;
#pragma unroll 4  // fully unrolled, the offsets' loads are hoisted and the producer's registers spill
            for (int i = 0; i < kIters; ++i) {
              const int64_t off = offs[i * kRowStep];
              // (a zero-filled chunk still names an aligned source: the row's head)
              ptx::cp_async_16_or_zero(dst0 + i * kRowStep * kDimBlock * 2, head + (off >= 0 ? off : 0), off >= 0);
            }
          } else {
#pragma unroll 4
            for (int i = 0; i < kIters; ++i) {
              const uint32_t idx = tid + 128 * i, row = idx / kChunks, dim = idx % kChunks * 8;
              const int64_t off = ss.row_off[parity][row];
              ptx::cp_async_16_or_zero(stage_u32 + chunk_offset(row, dim), off >= 0 ? head + off + dim : head,
                                       off >= 0);
            }
          }
        };
        RowFetch next_rows = fetch_row(w.ntiles - 1);
        publish_row(next_rows, (w.ntiles - 1) & 1);
        for (int n = w.ntiles - 1; n >= w.n_lo; --n) {  // the consumers' order: the diagonal first
          const int parity = n & 1;
          if (n > w.n_lo) next_rows = fetch_row(n - 1);  // in flight under this tile's copies
          pipe_k.producer_acquire(st);
          gather(a.k, ss.k.data() + st.index() * kKv * kHeadDim, parity);
          cutlass::arch::cpasync_barrier_arrive_noinc(pipe_k.producer_get_barrier(st));
          if (n == w.ntiles - 1) load_q();
          pipe_v.producer_acquire(st);
          gather(a.v, ss.v.data() + st.index() * kKv * kHeadDim, parity);
          cutlass::arch::cpasync_barrier_arrive_noinc(pipe_v.producer_get_barrier(st));
          ++st;
          if (n > w.n_lo) publish_row(next_rows, parity ^ 1);
        }
      } else {
        // ragged: (token, dim, KV head); paged: (slot, dim, KV head, page)
        auto mK = [&] {
          if constexpr (kPage == 0) return tma_k.get_tma_tensor(make_shape(a.num_pages, D{}, kv_heads));
          else return tma_k.get_tma_tensor(make_shape(Int<kPage>{}, D{}, kv_heads, a.num_pages));
        }();
        auto mVt = [&] {
          if constexpr (kPage == 0) return tma_v.get_tma_tensor(make_shape(D{}, a.num_pages, kv_heads));
          else if constexpr (kVPageBox)  // (dim in block, slot, block, KV head, page)
            return tma_v.get_tma_tensor(make_shape(DimBlock{}, Int<kPage>{}, Int<kDimBlocks>{}, kv_heads, a.num_pages));
          else return tma_v.get_tma_tensor(make_shape(D{}, Int<kPage>{}, kv_heads, a.num_pages));
        }();
        // paged: box j of KV tile n is the request's page (n x 128 + j x kBox) / kPage (its last page past the end),
        // at slot (n x 128 + j x kBox) % kPage; each page id loaded just before its box (one thread holding a tile's
        // ids spilled them; loading an issuer's ids a tile ahead, before the stage's wait, was slower: docs/prefill.md)
        auto load_boxes = [&](int n, auto&& issue) {
          const int last = (w.kv_len - 1) / max(kPage, 1);
          CUTE_UNROLL
          for (int jj = 0; jj < kBoxes; ++jj)
            if (jj % kIssuers == (kSplitIssue ? warp_in_group : 0))  // split issue: this warp's pages
              issue(jj, page_of((int64_t)w.kv_begin + min((n * kKv + jj * kBox) / max(kPage, 1), last)),
                    (n * kKv + jj * kBox) % max(kPage, 1));
        };
        // KV tile n into stage `stage`, K or (is_v) V^T: one TMA copy (ragged), or a box a page and 64-dim block
        // (paged; boxes past the request's last page read that page again: their keys are masked, V zeroed by the
        // consumers). K's tiles are (token, dim), V^T's (dim, token): `order` puts a (token, dim) pair in the
        // operand's modes
        auto load_kv = [&](auto is_v, auto const& tma, auto const& gmem, auto& smem, int n, int stage,
                           uint64_t* bar) {
          auto order = [](auto token, auto dim) {
            if constexpr (decltype(is_v)::value) return make_coord(dim, token);
            else return make_coord(token, dim);
          };
          if constexpr (kPage == 0) {
            Tensor g = local_tile(domain_offset(order(w.kv_begin, 0), gmem(_, _, kv_head)), order(Int<kKv>{}, D{}),
                                  order(n, 0));
            auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(smem(_, _, stage)),
                                          group_modes<0, 2>(g));
            copy(tma.with(*bar), tg, ts);
          } else if constexpr (decltype(is_v)::value && kVPageBox) {  // one box a page
            load_boxes(n, [&](int jj, int page, int) {
              // page jj of the stage (a whole number of swizzle periods from the stage's start), as the box's view
              Tensor sb = make_tensor(make_smem_ptr(&smem(0, make_coord(0, jj), stage)), VtPageBox{});
              auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 3>(sb),
                                            group_modes<0, 3>(gmem(_, _, _, kv_head, page)));
              copy(tma.with(*bar), tg, ts);
            });
          } else {
            load_boxes(n, [&](int jj, int page, int slot0) {
              CUTE_UNROLL
              for (int c = 0; c < kDimBlocks; ++c) {
                Tensor g = local_tile(gmem(_, _, kv_head, page), order(Int<kBox>{}, DimBlock{}),
                                      order(slot0 / kBox, c));
                Tensor sb = local_tile(smem(_, _, stage), order(Int<kBox>{}, DimBlock{}), order(jj, c));
                auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sb),
                                              group_modes<0, 2>(g));
                copy(tma.with(*bar), tg, ts);
              }
            });
          }
        };
        for (int n = w.ntiles - 1; n >= w.n_lo; --n) {  // the consumers' order: the diagonal first
          // split issue: each warp's issuer waits for the stage and issues its pages; thread 0 (the pipeline's
          // leader) also posts the stage's bytes, which may come after another warp's boxes have landed (the
          // phase waits for its arrival)
          if (issuer) {
            pipe_k.producer_acquire(st);
            load_kv(cute::false_type{}, tma_k, mK, sK, n, st.index(), pipe_k.producer_get_barrier(st));
            if (n == w.ntiles - 1) load_q();
            pipe_v.producer_acquire(st);
            load_kv(cute::true_type{}, tma_v, mVt, sVt, n, st.index(), pipe_v.producer_get_barrier(st));
          }
          ++st;
        }
      }
      if (leader) t = next_valid(next);
    }
    return;
  }
  // consumers
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
  const int ctid = tid - 128, lane = tid & 31;
  const int row0 = acc_row0(ctid, lane);  // this thread's rows: row0, row0 + 8
  // the warpgroup, warp-uniform (FlashAttention-3's): its MMAs' shared-memory descriptors then live in uniform
  // registers, not 16 vector registers the KV loop holds and moves to uniform ones (R2UR) every step
  const int wg = __shfl_sync(0xffffffffu, ctid / 128, 0);
  MmaQK mma_qk;
  MmaPV mma_pv;
  ThrMMA thr_qk = mma_qk.get_thread_slice(wg * 128);  // descriptors and fragment shapes: the warpgroup's alone
  ThrMMA thr_pv = mma_pv.get_thread_slice(wg * 128);
  Tensor tQ = thr_qk.partition_fragment_A(sQ);
  Tensor tK = thr_qk.partition_fragment_B(sK);    // (MMA, N, K, stage)
  Tensor tVt = thr_pv.partition_fragment_B(sVt);  // (MMA, N, K, stage)
  Tensor tS = partition_fragment_C(mma_qk, Shape<Int<kRows>, Int<kKv>>{});
  Tensor tO = partition_fragment_C(mma_pv, Shape<Int<kRows>, D>{});
  Tensor tP = thr_pv.partition_fragment_A(make_tensor(make_smem_ptr(ss.q.data()), Shape<Int<kRows>, Int<kKv>>{}));
  static_assert(decltype(size(tS))::value == decltype(size(tP))::value, "P: S's accumulators in their order");
  float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};  // reset per work tile below
  // soft-cap: S becomes the capped logits (sm_scale applied), the softmax's scale is then 1
  const float sm_scale = a.sm_scale, scale2 = kSoftCap ? kLog2e : sm_scale * kLog2e;
  const float lse_scale = kSoftCap ? 1.f : sm_scale, cap_in = kSoftCap ? sm_scale / a.softcap : 0.f;

  // ping-pong: the warpgroups issue their MMAs in turns, 0, 1, (2,) 0, ...; turn barrier i: warpgroup i waits, the
  // one before it arrives (256 threads)
  auto turn_begin = [&]() {  // wait for this warpgroup's turn to issue MMAs
    if constexpr (kPingPong) cutlass::arch::NamedBarrier::sync(256, wg);
  };
  auto turn_end = [&]() {  // ... and pass the turn to the next warpgroup
    if constexpr (kPingPong) cutlass::arch::NamedBarrier::arrive(256, (wg + 1) % kWarpGroups);
  };
  if (kPingPong && wg == kWarpGroups - 1) cutlass::arch::NamedBarrier::arrive(256, 0);  // warpgroup 0 goes first
  auto issue_qk = [&](int stage) {
    warpgroup_fence_operand(tS);
    warpgroup_arrive();
    mma_qk.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tQ); ++kb) {
      cute::gemm(mma_qk, tQ(_, _, kb), tK(_, _, kb, stage), tS);
      mma_qk.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  Tensor tP32 = recast<uint32_t>(tP);  // P as the registers the RS MMA reads while in flight: fenced like O
  auto issue_pv = [&](int stage) {
    warpgroup_fence_operand(tP32);
    warpgroup_fence_operand(tO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tP); ++kb) cute::gemm(mma_pv, tP(_, _, kb), tVt(_, _, kb, stage), tO);
    warpgroup_commit_batch();
  };
  // KV tile n of work tile w needs a mask where it holds keys past the request's KV, causal past its first row's limit
  // (then some row's), or below its last row's window (then some row's); the mask: key >= kv_len, key > the row's
  // position kv_len - q_len + its query index (causal), key < that position - window_left (a window)
  auto needs_mask = [&](const Tile& w, int n) {
    const int end = (n + 1) * kKv, pos0 = w.kv_len - w.q_len + w.qtile * kRows;
    return end > w.kv_len || (kCausal && end - 1 > pos0) ||
           (a.window_left >= 0 && n * kKv < pos0 + min(kRows, w.q_len - w.qtile * kRows) - 1 - a.window_left);
  };
  auto mask_tile = [&](const Tile& w, int n) {
    const int key0 = n * kKv + (lane & 3) * 2, pos0 = w.kv_len - w.q_len + w.qtile * kRows + row0;
    const int window = a.window_left;
    CUTE_UNROLL
    for (int i = 0; i < size(tS); ++i) {
      const int key = key0 + (i >> 2) * 8 + (i & 1), pos = pos0 + 8 * ((i >> 1) & 1);
      if (key >= w.kv_len || (kCausal && key > pos) || (window >= 0 && key < pos - window)) tS(i) = -INFINITY;
    }
  };
  auto soft_cap = [&]() {  // before the mask: a masked logit stays -inf
    if constexpr (kSoftCap) {
      CUTE_UNROLL
      for (int i = 0; i < size(tS); ++i) tS(i) = a.softcap * fi::tanh_fast(tS(i) * cap_in);
    }
  };
  // The online softmax of S in place (S becomes the tile's probabilities); alpha rescales what O and the sums held.
  // Whether a row of this thread moved its maximum (kLazyRescale; else always true)
  auto softmax = [&](float (&alpha)[2]) {
    bool moved = !kLazyRescale;
    float tmax[2][2] = {{mx[0], mx[1]}, {mx[0], mx[1]}};  // two chains a row: half the max's latency
    CUTE_UNROLL
    for (int i = 0; i < size(tS); ++i) {
      float& m = tmax[(i >> 2) & 1][(i >> 1) & 1];
      m = fmaxf(m, tS(i));
    }
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      float m = fmaxf(tmax[0][h], tmax[1][h]);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if (kLazyRescale && !((m - mx[h]) * scale2 > kLazyLog2)) {  // kept (NaN: both -inf, a row with no key yet)
        alpha[h] = 1.f;
        continue;
      }
      alpha[h] = mx[h] == -INFINITY ? 0.f : ptx::exp2((mx[h] - m) * scale2);
      mx[h] = m;
      sum[h] *= alpha[h];
      moved = true;
    }
    const float base[2] = {mx[0] == -INFINITY ? 0.f : mx[0] * scale2, mx[1] == -INFINITY ? 0.f : mx[1] * scale2};
    float part[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    CUTE_UNROLL
    for (int i = 0; i < size(tS); ++i) {  // a row with no key yet: every probability 0, not NaN
      const int h = (i >> 1) & 1;
      tS(i) = ptx::exp2(fmaf(tS(i), scale2, -base[h]));
      part[(i >> 2) & 1][h] += tS(i);
    }
    sum[0] += part[0][0] + part[1][0];
    sum[1] += part[0][1] + part[1][1];
    return moved;
  };
  auto rescale_o = [&](const float (&alpha)[2], bool moved) {
    // lazy: the warp skips it where none of its rows moved (a uniform branch; alpha is 1 on the rows that kept theirs)
    if (kLazyRescale && !__any_sync(0xffffffffu, moved)) return;
    CUTE_UNROLL
    for (int i = 0; i < size(tO); ++i) tO(i) *= alpha[(i >> 1) & 1];
  };
  // Paged: V tokens past the request's KV in its last KV tile are the last page's unused slots (any bits: NaN x a
  // probability of 0 is NaN) or boxes that re-read that page; zeroed in shared memory before P.V reads them
  auto zero_v_tail = [&](const Tile& w, int n, int stage) {
    if constexpr (kPage != 0 && !kGather) {  // gathered: zeros already
      const int valid = w.kv_len - n * kKv;
      if (valid >= kKv) return;
      // a token's dims of a dim block are one row of kDimBlock x 2 bytes, row (block x kKv + token) of the stage
      // (tokens first; the swizzle permutes 16-byte chunks within a row), or with a box a page, row (page x blocks +
      // block) x kBox + token in page: zeroed 16 bytes at a time
      constexpr int kRowChunks = kDimBlock / 8;
      uint4* stage_v = reinterpret_cast<uint4*>(ss.v.data() + stage * kHeadDim * kKv);
      CUTE_UNROLL
      for (int i = ctid; i < kHeadDim / 8 * kKv; i += kConsumers) {
        const int row = i / kRowChunks;
        const int token = kVPageBox ? row / (kDimBlocks * kBox) * kBox + row % kBox : row % kKv;
        if (token >= valid) stage_v[i] = make_uint4(0, 0, 0, 0);
      }
      cutlass::arch::fence_view_async_shared();  // the generic stores, before the async proxy's MMA reads
      cutlass::arch::NamedBarrier::sync(kConsumers, kTailBarrier);
    }
  };
  auto to_p = [&]() {  // only once the P.V reading the last P has been waited for; two values a cvt
    warpgroup_fence_operand(tP32);
    CUTE_UNROLL
    for (int i = 0; i < size(tP32); ++i) tP32(i) = ptx::pack2<kBf16>(tS(2 * i), tS(2 * i + 1));
  };
  // a stage's K or V ready to read; gathered by cp.async (the generic proxy), made visible to the wgmma's async proxy
  auto wait_stage = [&](Pipeline& pipe, PipelineState s) {
    pipe.consumer_wait(s);
    if constexpr (kGather) cutlass::arch::fence_view_async_shared();
  };
  PipelineState st;
  float alpha[2];
  Tile w;
  for (int j = 0;; ++j) {
    cutlass::arch::ClusterTransactionBarrier::wait(&ss.q_full, j & 1);
    const int t = ss.tile;  // read before q_empty's arrive: the producer then writes the next
    if (t >= work) break;
    coords(t, w);
    const int ntiles = w.ntiles;
    clear(tO);
    mx[0] = mx[1] = -INFINITY;
    sum[0] = sum[1] = 0.f;
    if constexpr (kOverlap) {
      // the first tile (the diagonal when causal): S and its softmax alone
      wait_stage(pipe_k, st);
      turn_begin();
      issue_qk(st.index());
      turn_end();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tS);
      pipe_k.consumer_release(st);
      soft_cap();
      if (needs_mask(w, ntiles - 1)) mask_tile(w, ntiles - 1);
      softmax(alpha);
      to_p();
      PipelineState prev = st;
      ++st;
      for (int n = ntiles - 2; n >= w.n_lo; --n) {
        wait_stage(pipe_k, st);
        wait_stage(pipe_v, prev);
        if (n == ntiles - 2) zero_v_tail(w, ntiles - 1, prev.index());
        turn_begin();
        issue_qk(st.index());
        issue_pv(prev.index());
        turn_end();
        warpgroup_wait<1>();  // S of this tile; the previous tile's P.V still in flight
        warpgroup_fence_operand(tS);
        pipe_k.consumer_release(st);
        soft_cap();
        if (needs_mask(w, n)) mask_tile(w, n);  // the second of a causal limit's two tiles, or a window's
        const bool moved = softmax(alpha);
        // always true (NaN too), but ptxas cannot know: the P.V's wait below cannot move above the exponentials
        if (lane == 0 && !(sum[0] + sum[1] < 0.f)) cutlass::arch::ClusterBarrier::arrive(&ss.pin);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tO);
        pipe_v.consumer_release(prev);
        rescale_o(alpha, moved);
        to_p();
        prev = st;
        ++st;
      }
      wait_stage(pipe_v, prev);  // the last tile's P.V, outside the turns (as FlashAttention-3's)
      if (ntiles - 1 == w.n_lo) zero_v_tail(w, ntiles - 1, prev.index());  // the one tile run
      issue_pv(prev.index());
      warpgroup_wait<0>();
      warpgroup_fence_operand(tO);
      pipe_v.consumer_release(prev);
    } else {
      for (int n = ntiles - 1; n >= w.n_lo; --n, ++st) {
        wait_stage(pipe_k, st);
        issue_qk(st.index());
        warpgroup_wait<0>();
        warpgroup_fence_operand(tS);
        pipe_k.consumer_release(st);
        soft_cap();
        if (needs_mask(w, n)) mask_tile(w, n);
        rescale_o(alpha, softmax(alpha));
        to_p();
        wait_stage(pipe_v, st);
        if (n == ntiles - 1) zero_v_tail(w, n, st.index());
        issue_pv(st.index());
        warpgroup_wait<0>();
        warpgroup_fence_operand(tO);
        pipe_v.consumer_release(st);
      }
    }
    cutlass::arch::ClusterBarrier::arrive(&ss.q_empty);  // every S of the tile is done: the next Q may land

    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
    }
    // O through shared memory: each warpgroup its own 64 rows, then 16-byte stores a row's 256 bytes at a time
    // (rows past the request's end not stored: they are the next request's)
    const int64_t token0 = (int64_t)w.q_begin + w.qtile * kRows;
    const int rows = min(kRows, w.q_len - w.qtile * kRows);  // the request's rows in this tile
    const float inv[2] = {1.f / sum[0], 1.f / sum[1]};
    // the epilogue's thread-dependent addresses from the thread index read afresh: computed from the one above,
    // the compiler hoists them out of the work-tile loop and holds ~50 registers across the KV loop
    const int etid = fresh_tid() - 128, elane = etid & 31;
    const int erow0 = acc_row0(etid, elane);
    Elem* o_tile = a.o + token0 * a.o_stride_row + w.head * a.o_stride_head;
    if constexpr (!kChunkedO) {
      Tensor sO = make_tensor(make_smem_ptr(ss.o.data()), SmemLayoutO{});
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + wg);  // the last tile's rows read out of sO
      Tensor tOs = mma_pv.get_thread_slice(etid).partition_C(sO);
      CUTE_UNROLL
      for (int i = 0; i < size(tO); ++i) tOs(i) = Elem(tO(i) * inv[(i >> 1) & 1]);
      cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + wg);
      constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks a row
      CUTE_UNROLL
      for (int i = 0; i < 64 * kChunks / 128; ++i) {
        const int c = etid % 128 + 128 * i, r = wg * 64 + c / kChunks, col = (c % kChunks) * 8;
        if (r < rows)
          *reinterpret_cast<uint4*>(o_tile + r * a.o_stride_row + col) = *reinterpret_cast<const uint4*>(&sO(r, col));
      }
    } else {
      // 64 dims at a time: value i of the accumulator is row row0 + 8 ((i >> 1) & 1), dim (i >> 2) x 8 + (lane & 3)
      // x 2 + (i & 1) (the layout mask_tile reads S by), so dims [64 c, 64 c + 64) are values [32 c, 32 c + 32)
      Elem* so = ss.o.data();
      CUTE_UNROLL
      for (int c = 0; c < kHeadDim / 64; ++c) {
        cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + wg);  // the last chunk's rows read out
        CUTE_UNROLL
        for (int i = 32 * c; i < 32 * c + 32; i += 2) {
          const int r = erow0 + 8 * ((i >> 1) & 1), col = ((i >> 2) & 7) * 8 + (elane & 3) * 2;
          *reinterpret_cast<uint32_t*>(so + r * kOPitch + col) =
              ptx::pack2<kBf16>(tO(i) * inv[(i >> 1) & 1], tO(i + 1) * inv[(i >> 1) & 1]);
        }
        cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + wg);
        CUTE_UNROLL
        for (int k = 0; k < 64 * 8 / 128; ++k) {  // 64 rows x 8 16-byte chunks
          const int q = etid % 128 + 128 * k, r = wg * 64 + q / 8, col = (q % 8) * 8;
          if (r < rows)
            *reinterpret_cast<uint4*>(o_tile + r * a.o_stride_row + 64 * c + col) =
                *reinterpret_cast<const uint4*>(so + r * kOPitch + col);
        }
      }
    }
    if (a.lse != nullptr && (elane & 3) == 0) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h)
        if (erow0 + 8 * h < rows)
          a.lse[(token0 + erow0 + 8 * h) * a.lse_stride_row + w.head] = mx[h] * lse_scale + logf(sum[h]);
    }
  }
}

}  // namespace cute_probe
}  // namespace fi

namespace fi {
namespace cute_probe {

// The launch both entries share: a persistent grid (one CTA an SM) over the work tiles, the counter zeroed first.
// a.section is filled in here.
template <class TmaQ, class TmaK, class TmaV>
int launch(const TmaQ& tma_q, const TmaK& tma_k, const TmaV& tma_v, Args a, int64_t l2_section_bytes, void* stream) {
  auto kernel = attn_ws<TmaQ, TmaK, TmaV>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (e != cudaSuccess) return (int)e;
  int device = 0, sms = 0;
  if ((e = cudaGetDevice(&device)) != cudaSuccess) return (int)e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) return (int)e;
  const int64_t heads = a.heads, batch = a.batch;
  const int64_t work = (a.max_q_len + kRows - 1) / kRows * heads * batch;
  const unsigned grid = (unsigned)(work < sms ? work : sms);  // persistent: one CTA an SM
  // a section: as many KV heads' KV (a request of the mean KV length) as fit in l2_section_bytes, at least one, with
  // their query heads
  const int64_t kv_head_bytes = ((int64_t)a.total_kv + batch - 1) / batch * kHeadDim * (int64_t)sizeof(Elem) * 2;
  const int64_t kv_per_section = std::max<int64_t>(1, l2_section_bytes / std::max<int64_t>(1, kv_head_bytes));
  a.section = (int)std::min<int64_t>(heads * batch, kv_per_section * (heads / a.kv_heads));
  if ((e = cudaMemsetAsync(a.counter, 0, sizeof(int), (cudaStream_t)stream)) != cudaSuccess) return (int)e;
  kernel<<<grid, kThreads, kSmemBytes, (cudaStream_t)stream>>>(tma_q, tma_k, tma_v, a);
  return (int)cudaGetLastError();
}

}  // namespace cute_probe
}  // namespace fi

#if FI_CUTE_PAGE == 0
// Ragged (the probe's): q [total_q, heads, D], k / v [total_kv, kv_heads, D] with request b's keys kv_indptr[b] ..
// kv_indptr[b + 1]; o like q, lse [total_q, heads]. TMA reads tiles at each request's offset (zeros past the
// tensors' ends; another request's keys are masked).
FI_EXPORT int fi_cute_attn_ws(const void* q, const void* k, const void* v, void* o, float* lse, const int* qo_indptr,
                              const int* kv_indptr, int* counter, int64_t batch, int64_t max_q_len, int64_t heads,
                              int64_t kv_heads, int64_t total_q, int64_t total_kv, int64_t l2_section_bytes,
                              float sm_scale, void* stream) {
  using namespace fi::cute_probe;
  if (batch <= 0 || max_q_len <= 0) return 0;
  if (kv_heads <= 0 || heads % kv_heads || total_q <= 0 || total_kv <= 0) return (int)cudaErrorInvalidValue;
  const int H = (int)heads, Hkv = (int)kv_heads, tq = (int)total_q, tkv = (int)total_kv;
  Tensor gQ = make_tensor(make_gmem_ptr(static_cast<const Elem*>(q)), make_shape(tq, D{}, H),
                          make_stride(H * kHeadDim, _1{}, D{}));
  Tensor gK = make_tensor(make_gmem_ptr(static_cast<const Elem*>(k)), make_shape(tkv, D{}, Hkv),
                          make_stride(Hkv * kHeadDim, _1{}, D{}));
  Tensor gVt = make_tensor(make_gmem_ptr(static_cast<const Elem*>(v)), make_shape(D{}, tkv, Hkv),
                           make_stride(_1{}, Hkv * kHeadDim, D{}));
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, SmemLayoutQ{});
  auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, take<0, 2>(SmemLayoutK{}));
  auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, gVt, take<0, 2>(SmemLayoutVt{}));
  Args a{static_cast<Elem*>(o), (int64_t)H * kHeadDim, kHeadDim, lse, H, qo_indptr, nullptr, kv_indptr, nullptr,
         counter, nullptr, 0, 0, (int)batch, (int)max_q_len, H, Hkv, tq, tkv, tkv, 0, -1, sm_scale, 0.f,
         nullptr, nullptr, 0, 0, 0};
  return launch(tma_q, tma_k, tma_v, a, l2_section_bytes, stream);
}
#endif
// The BSR (fi_backend.formats.BSR) over a paged cache: K / V pages at k / v + page x kv_stride_block + slot x
// kv_stride_token + kv_head x kv_stride_head (elements; vLLM's [blocks, 2, block_size, kv_heads, D] and the HND
// layouts alike), request b's KV length kv_lens[b] and pages kv_indices[kv_block_start[b] ..] (num_kv_indices
// entries; error_flags, may be null, gets fi_backend's bits for a bad BSR). q / o / lse by their strides (16-byte
// multiples; lse may be null). PAGE 0: a ragged BSR (fi_backend.formats.from_ragged, kv_indices unread): request b's
// keys are rows kv_block_start[b] .. + kv_lens[b] of K / V, row r of KV head h at r x kv_stride_block + h x
// kv_stride_head, num_kv_blocks rows. V by v_stride_block / _token / _head (an engine's key and value may be views of
// different tensors; gathers need V's equal to K's). Refused with kCaptureRefused into a capturing stream: the launch
// holds the step's sizes, which a graph replaying other steps would keep.
constexpr int kCaptureRefused = -2;
FI_EXPORT int fi_cute_attn_bsr(const void* q, void* o, float* lse, const void* k, const void* v, const int* qo_indptr,
                               const int* kv_lens, const int* kv_indices, const void* kv_block_start, int* counter,
                               int* error_flags, int64_t num_kv_indices, int64_t q_stride_row,
                               int64_t q_stride_head, int64_t o_stride_row, int64_t o_stride_head,
                               int64_t lse_stride_row, int64_t kv_stride_block,
                               int64_t kv_stride_token, int64_t kv_stride_head, int64_t v_stride_block,
                               int64_t v_stride_token, int64_t v_stride_head, int64_t num_kv_blocks,
                               int64_t kv_block_start_int64, int64_t batch, int64_t max_q_len, int64_t heads,
                               int64_t kv_heads, int64_t total_q, int64_t total_kv, int64_t l2_section_bytes,
                               int64_t window_left, float sm_scale, float softcap, void* stream) {
  using namespace fi::cute_probe;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing((cudaStream_t)stream, &capture);
  if (e != cudaSuccess) return (int)e;
  if (capture != cudaStreamCaptureStatusNone) return kCaptureRefused;
  if (batch <= 0 || max_q_len <= 0) return 0;
  if (kv_heads <= 0 || heads % kv_heads || total_q <= 0 || num_kv_blocks <= 0 || num_kv_blocks >= (1ll << 31) ||
      window_left < -1 || window_left >= (1ll << 31) || (kSoftCap && !(softcap > 0.f)))
    return (int)cudaErrorInvalidValue;
  const int H = (int)heads, Hkv = (int)kv_heads, tq = (int)total_q, nb = (int)num_kv_blocks;
  Tensor gQ = make_tensor(make_gmem_ptr(static_cast<const Elem*>(q)), make_shape(tq, D{}, H),
                          make_stride(q_stride_row, _1{}, q_stride_head));
  auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, gQ, SmemLayoutQ{});
  Args a{static_cast<Elem*>(o), o_stride_row, o_stride_head, lse, lse_stride_row, qo_indptr, kv_lens,
         kv_block_start, kv_indices, counter, error_flags, num_kv_indices, (int)kv_block_start_int64, (int)batch,
         (int)max_q_len, H, Hkv, tq, (int)total_kv, nb, 0, (int)window_left, sm_scale, softcap,
         static_cast<const Elem*>(k), static_cast<const Elem*>(v), kv_stride_block, kv_stride_token, kv_stride_head};
  if constexpr (kGather) {
    if (((kv_stride_block | kv_stride_token | kv_stride_head) & 7) != 0 || ((uintptr_t)k | (uintptr_t)v) & 15 ||
        v_stride_block != kv_stride_block || v_stride_token != kv_stride_token || v_stride_head != kv_stride_head)
      return (int)cudaErrorInvalidValue;  // 16-byte rows: aligned copies; one row offset for K and V
    return launch(tma_q, tma_q, tma_q, a, l2_section_bytes, stream);  // no K / V maps: the kernel never reads them
  } else if constexpr (kPage == 0) {  // K / V rows: (row, dim, KV head)
    Tensor gK = make_tensor(make_gmem_ptr(static_cast<const Elem*>(k)), make_shape(nb, D{}, Hkv),
                            make_stride(kv_stride_block, _1{}, kv_stride_head));
    Tensor gVt = make_tensor(make_gmem_ptr(static_cast<const Elem*>(v)), make_shape(D{}, nb, Hkv),
                             make_stride(_1{}, v_stride_block, v_stride_head));
    auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, take<0, 2>(SmemLayoutK{}));
    auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, gVt, take<0, 2>(SmemLayoutVt{}));
    return launch(tma_q, tma_k, tma_v, a, l2_section_bytes, stream);
  } else {
    Tensor gK = make_tensor(make_gmem_ptr(static_cast<const Elem*>(k)), make_shape(Int<kPage>{}, D{}, Hkv, nb),
                            make_stride(kv_stride_token, _1{}, kv_stride_head, kv_stride_block));
    auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, gK, SmemLayoutKBox{});
    if constexpr (kVPageBox) {  // one box a page: (dim in block, slot, block, KV head, page)
      Tensor gVt = make_tensor(make_gmem_ptr(static_cast<const Elem*>(v)),
                               make_shape(DimBlock{}, Int<kPage>{}, Int<kDimBlocks>{}, Hkv, nb),
                               make_stride(_1{}, v_stride_token, DimBlock{}, v_stride_head, v_stride_block));
      auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, gVt, SmemLayoutVtBox{});
      return launch(tma_q, tma_k, tma_v, a, l2_section_bytes, stream);
    } else {
      Tensor gVt = make_tensor(make_gmem_ptr(static_cast<const Elem*>(v)), make_shape(D{}, Int<kPage>{}, Hkv, nb),
                               make_stride(_1{}, v_stride_token, v_stride_head, v_stride_block));
      auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, gVt, SmemLayoutVtBox{});
      return launch(tma_q, tma_k, tma_v, a, l2_section_bytes, stream);
    }
  }
}

#if FI_CUTE_PAGE == 0
// Staged pages (fi_backend.cute_member STAGE_*): a paged step's KV copied into contiguous rows, for this ragged CTA,
// where the pages' TMA boxes (two a page of K at head size 128) cost more than the copy. Staged page g holds rows
// g x page_size ..: request b's pages kv_indices[kv_block_start[b] ..] at rows stage_start[b] .. (a multiple of
// page_size; stage_start [batch + 1]). k_out / v_out [rows, kv_heads, D] contiguous; K / V read by their strides
// (elements; 16-byte rows). Rows past a request's KV, and those of a bad entry (flagged in error_flags as the CTA
// flags them), are written as zeros: the CTA multiplies masked P by every V row of a tile, and 0 x NaN is NaN.
namespace fi {
namespace cute_probe {
struct StageArgs {
  const Elem *k, *v;
  Elem *k_out, *v_out;
  const int *kv_lens, *kv_indices, *stage_start;
  const void* kv_block_start;
  int* error_flags;
  int64_t num_kv_indices, num_kv_blocks, k_block, k_token, k_head, v_block, v_token, v_head;
  int kv_block_start_int64, batch, kv_heads, page;
};

__global__ void __launch_bounds__(256) stage_pages_kernel(StageArgs a) {
  const int64_t row0 = (int64_t)blockIdx.x * a.page;
  int lo = 0, hi = a.batch - 1;  // the last request whose rows start at or before row0
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(a.stage_start + mid) <= row0) lo = mid; else hi = mid - 1;
  }
  const int j = (int)((row0 - __ldg(a.stage_start + lo)) / a.page);
  const int64_t e = (a.kv_block_start_int64 ? __ldg(static_cast<const int64_t*>(a.kv_block_start) + lo)
                                            : (int64_t)__ldg(static_cast<const int*>(a.kv_block_start) + lo)) + j;
  int bad = 0;
  int64_t page = 0;
  if (e < 0 || e >= a.num_kv_indices) bad = 2;
  else if ((page = __ldg(a.kv_indices + e)) < 0 || page >= a.num_kv_blocks) bad = 1;
  if (bad && threadIdx.x == 0 && a.error_flags != nullptr) atomicOr(a.error_flags, bad);
  const int valid = bad ? 0 : min(a.page, __ldg(a.kv_lens + lo) - j * a.page);
  constexpr int kChunks = kHeadDim / 8;  // 16 bytes each
  const int total = a.page * a.kv_heads * kChunks;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int c = i % kChunks, h = (i / kChunks) % a.kv_heads, t = i / (kChunks * a.kv_heads);
    uint4 kx = make_uint4(0, 0, 0, 0), vx = kx;
    if (t < valid) {
      kx = __ldg(reinterpret_cast<const uint4*>(a.k + page * a.k_block + t * a.k_token + h * a.k_head) + c);
      vx = __ldg(reinterpret_cast<const uint4*>(a.v + page * a.v_block + t * a.v_token + h * a.v_head) + c);
    }
    const int64_t dst = ((row0 + t) * a.kv_heads + h) * kHeadDim;
    reinterpret_cast<uint4*>(a.k_out + dst)[c] = kx;
    reinterpret_cast<uint4*>(a.v_out + dst)[c] = vx;
  }
}
}  // namespace cute_probe
}  // namespace fi

FI_EXPORT int fi_cute_stage_pages(const void* k, const void* v, void* k_out, void* v_out, const int* kv_lens,
                                  const int* kv_indices, const void* kv_block_start, const int* stage_start,
                                  int* error_flags, int64_t num_kv_indices, int64_t num_kv_blocks,
                                  int64_t kv_stride_block, int64_t kv_stride_token, int64_t kv_stride_head,
                                  int64_t v_stride_block, int64_t v_stride_token, int64_t v_stride_head,
                                  int64_t kv_block_start_int64, int64_t batch, int64_t kv_heads, int64_t page_size,
                                  int64_t staged_pages, void* stream) {
  using namespace fi::cute_probe;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing((cudaStream_t)stream, &capture);
  if (e != cudaSuccess) return (int)e;
  if (capture != cudaStreamCaptureStatusNone) return kCaptureRefused;
  if (staged_pages <= 0) return 0;
  if (batch <= 0 || kv_heads <= 0 || page_size <= 0 || staged_pages >= (1ll << 31) ||
      page_size * kv_heads * kHeadDim >= (1ll << 31) ||
      ((kv_stride_block | kv_stride_token | kv_stride_head | v_stride_block | v_stride_token | v_stride_head) & 7) ||
      (((uintptr_t)k | (uintptr_t)v | (uintptr_t)k_out | (uintptr_t)v_out) & 15))
    return (int)cudaErrorInvalidValue;
  StageArgs a{static_cast<const Elem*>(k), static_cast<const Elem*>(v), static_cast<Elem*>(k_out),
              static_cast<Elem*>(v_out), kv_lens, kv_indices, stage_start, kv_block_start, error_flags,
              num_kv_indices, num_kv_blocks, kv_stride_block, kv_stride_token, kv_stride_head, v_stride_block,
              v_stride_token, v_stride_head, (int)kv_block_start_int64, (int)batch, (int)kv_heads, (int)page_size};
  stage_pages_kernel<<<(unsigned)staged_pages, 256, 0, (cudaStream_t)stream>>>(a);
  return (int)cudaGetLastError();
}
#endif
