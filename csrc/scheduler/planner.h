// The load-balanced planner: Algorithm 1 of the FlashInfer paper (Ye et al., MLSys 2025), run on the
// host once per generation step. Framework-free C++17; the CPython binding is planner_py.cc.
//
// Input: the step's query rows per request (qo_indptr) and KV lengths. Each request's rows are cut into
// query tiles of tile_q rows; a (request, tile) "pair" reads KV positions [0, len) where len = kv_len,
// or with causal masking (bottom-right aligned) len = kv_len - q_len + tile_end. Long pairs may be split
// into KV chunks; every item (whole pair or chunk) is run for each of num_units query-head groups, and
// these (item, unit) replicas are assigned longest-processing-time first (LPT) to the least loaded of
// all num_ctas CTAs, cost = max(cost_item_min, cost_q * rows + cost_kv * KV tokens). When num_ctas divides
// by num_units, unit u gets its own block of num_ctas / num_units CTAs instead and every unit the same LPT
// plan over its block ("unit blocks"). Each CTA then runs its items in creation order (request, query tile,
// chunk), which keeps a request's KV in L2 between its tiles (planner.cc, the write). The result is written in
// place into a plan section laid out as csrc/plan.h describes.
//
// Which pairs are split, and into what chunks, is a candidate (L, s): walking the pairs by KV length,
// longest first, each pair longer than L is cut into ceil(len / L) chunks with boundaries aligned to
// kv_chunk_align, until s pairs are split or the next one would take the split items past
// 2 * num_ctas (the walk then stops). The planner evaluates the LPT makespan of a small set of
// candidates, "split nothing" and the previous rule's chunk among them, and keeps the best
// (planner.cc, ChooseSplit, lists the set and the order of preference).
//
// A second kind of plan, the partition (stream-K style), competes with that choice where one LPT pass
// serves every unit: the pairs in creation order fill CTA after CTA up to a cap of cost each, a pair
// being cut where the cap falls (aligned, no piece under min_kv_chunk), with the cap found by bisection.
// It replaces the LPT plan only when its makespan is strictly lower (planner.cc, ChoosePartition).
#pragma once

#include <cstdint>
#include <vector>

#include "plan.h"

namespace fi {

// Split items (chunks of split pairs) per CTA a plan may have, counting an item once for all its units
// (their partial rows are shared): the workspace holds kMaxSplitItemsPerCta * ceil(num_ctas / num_units)
// * tile_q partial rows (the paper's bound, appendix D, with the CTAs of one unit's share).
constexpr int64_t kMaxSplitItemsPerCta = 2;
// The chunk search stops (and, for the unsplit plan, does not start) once the best plan's makespan is
// within this fraction, or one query row's fixed cost (cost_q) if more, above units * total cost / num_ctas,
// a lower bound of every candidate's makespan (splitting only adds items' fixed costs): it trades at most 2%
// of balance, or one row's cost where CTAs hold few items, for host time (a ShareGPT batch of 256 on 392 CTAs
// searched in 25 of 32 batches for nothing).
constexpr double kBalancedSlack = 0.02;
// Fill walks the partition's search for its cap may take (each O(pairs + num_ctas)), and the interval,
// relative to the lower bound, at which its bisection stops (planner.cc, ChoosePartition).
constexpr int kPartitionWalks = 10;
constexpr double kPartitionPrecision = 0.005;

// A shared-prefix group is kept when the KV cost it saves exceeds kSharedGain times the fixed cost of its
// rows' extra partial states (written, then merged: cost_q a row each); its prefix is cut into at most
// kMaxSharedChunks chunks.
constexpr double kSharedGain = 2.0;
constexpr int64_t kMaxSharedChunks = 16;

struct PlanInputs {
  const int32_t* qo_indptr = nullptr;  // [num_requests + 1], qo_indptr[0] == 0, non-decreasing
  const int32_t* kv_lens = nullptr;    // [num_requests], KV tokens of each request (its query is the suffix)
  int64_t num_requests = 0;
  int64_t tile_q = 1;          // query rows per tile, >= 1
  int64_t num_ctas = 1;        // CTAs of the persistent kernel (the whole grid), >= 1
  int64_t num_units = 1;       // query-head groups every item is run for (FiWorkItem::unit), >= 1
  bool causal = false;
  int64_t min_kv_chunk = 1;    // smallest KV chunk (tokens) a split may produce, >= 1
  int64_t kv_chunk_align = 1;  // chunk boundaries are multiples of this (page size or KV tile), >= 1
  double cost_q = 1.0;         // cost of an item = max(cost_item_min, cost_q * rows + cost_kv * KV tokens)
  double cost_kv = 1.0;
  double cost_item_min = 0.0;  // the least an item costs: small items' time is their latency, not their work
  // A fixed candidate instead of the search (tests, tuning): force_kv_chunk = 0 splits nothing; L > 0
  // (a multiple of kv_chunk_align, >= min_kv_chunk) is the candidate (L, force_split_pairs), where
  // force_split_pairs < 0 means as many pairs as the split-item budget allows. -1: search.
  int64_t force_kv_chunk = -1;
  int64_t force_split_pairs = -1;
  // Requests in turn instead of all items by cost (prefill): the requests by total cost, descending, each
  // one's (unit, item) replicas back to back, unit-major, items by cost descending, go to the least-loaded
  // CTA in that order, and every CTA runs its queue in that order (not creation order); the last replicas
  // worth 2 num_ctas times the largest item go by cost, descending, so the plan ends on small items. CTAs
  // that run at the same time then read the same request and unit's KV (L2 hits), where LPT over all items
  // has them read as many different KV streams as there are CTAs.
  bool group_requests = false;
  // Each query row sees at most kv_window KV positions (a sliding window: window_left + 1; 0: no bound). A
  // tile then reads at most kv_window - 1 + its rows of KV (the kernels skip the rest), which is what its
  // cost counts, and no pair is split (the search's chunk costs know no window; a window bounds every
  // item's work anyway). A forced split (force_kv_chunk > 0) still splits.
  int64_t kv_window = 0;
  // May the partition (a capped fill of CTA after CTA in creation order, pairs cut where the cap falls)
  // replace the LPT plan? Only considered when one LPT pass serves every unit (num_units == 1, or unit
  // blocks), without group_requests, kv_window or a forced candidate, and when the LPT plan's makespan is
  // over kBalancedSlack above the lower bound; taken only when its makespan is strictly lower.
  bool allow_partition = true;
  // Deterministic plan (0: off): a pair's KV is cut into pieces at the multiples of its request's chunk C,
  // taken from the request's own kv_len only: the smallest kv_chunk_align * 2^k that is >= ceil(kv_len /
  // deterministic_pieces) and >= min_kv_chunk. A pair runs either whole (one item, partial_stride = C: the
  // kernel folds its pieces' states in order) or as one item per piece (partial states, merged in piece
  // order by the same fold); which, is chosen for the batch (LPT makespan, planner.cc ChooseDeterministic),
  // as a row's bits are the same either way. A row's pieces and their fold then depend on its request
  // alone, never on the batch or the grid. 1: nothing is split (whole items, partial_stride = C >= the
  // pair's KV). No chunk search, no partition; a forced candidate is refused.
  int64_t deterministic_pieces = 0;
  // Shared prefixes (composable formats, docs/composable.md): num_groups triples (first request, end
  // request, prefix tokens), ascending and disjoint: requests [first, end) share their first prefix KV
  // tokens (<= every member's KV before its query). A kept group's rows, in tiles of tile_q, get items over
  // the prefix read once per tile (FI_ITEM_SHARED), cut into equal aligned chunks; its members' own items
  // cover KV [prefix, kv_len), unsplit; both write partial states the kernels merge. A group whose saved KV
  // does not pay for its partial states (kSharedGain), or that does not fit the partial rows, stays
  // single-format. Not with deterministic_pieces or kv_window; turns off group_requests and the partition.
  const int32_t* groups = nullptr;
  int64_t num_groups = 0;
  // The verdict's factor (kSharedGain by default; 0 keeps every group that saves any KV: experiments).
  double shared_gain = kSharedGain;
};

// A caller-owned int32 buffer holding one plan section, laid out by csrc/plan.h for
// (num_ctas, max_items, max_rows). max_partial_rows bounds the workspace's partial attention states.
// The search only considers candidates that fit these capacities; a step fails with kCapacityExceeded
// only when not even the unsplit plan fits (or a forced candidate does not).
struct PlanSection {
  int32_t* data = nullptr;
  int64_t num_ints = 0;  // size of data; must be >= fi_plan_ints(num_ctas, max_items, max_rows)
  int64_t num_ctas = 0;  // the layout's CTA capacity (cta_indptr has num_ctas + 1 entries)
  int64_t max_items = 0;
  int64_t max_rows = 0;
  int64_t max_partial_rows = 0;
};

struct PlanSummary {
  int64_t num_items = 0;
  int64_t num_rows = 0;
  int64_t num_partial_rows = 0;
  int64_t kv_chunk = 0;  // 0 when nothing was split; the partition: its longest split piece
  int64_t num_split_rows = 0;
  double makespan = 0.0;  // the largest accumulated cost of a CTA
  int64_t num_split_pairs = 0;  // (request, query tile) pairs whose KV was split
  bool partition = false;       // the plan is the partition (PlanInputs::allow_partition), not LPT's
  bool deterministic = false;   // the plan is PlanInputs::deterministic_pieces' fixed cuts
  int64_t num_shared_groups = 0;  // groups of PlanInputs::groups kept (run as shared-prefix items)
};

enum class PlanStatus { kOk = 0, kInvalidArgument = 1, kCapacityExceeded = 2 };

// Keeps its scratch arrays between calls, so a plan in steady state allocates nothing. Not thread-safe;
// use one Planner per thread.
class Planner {
 public:
  // Validates everything and computes every count before writing, so on an error the section is
  // untouched. On success writes the header, cta_indptr[0 .. section.num_ctas], items[0 .. num_items),
  // merge_indptr[0 .. num_rows] and split_rows[0 .. num_split_rows), and nothing else.
  PlanStatus Plan(const PlanInputs& in, const PlanSection& section, PlanSummary* summary);

  // The reason of the last failed Plan(), naming the argument or bound and the values.
  const char* error() const { return error_; }

 private:
  struct Pair {
    int32_t request;
    int32_t q_begin;  // global query rows [q_begin, q_end)
    int32_t q_end;
    int32_t kv_len;   // effective KV length of the tile (its KV end)
    double cost;      // of the pair as one item
    int32_t kv_begin = 0;  // > 0: a member's suffix or a shared chunk
    int32_t block = 0;     // > 0: a fixed item of a shared-prefix group (never split): its rows' partial rows
    int32_t slot = 0;      // and its state's place among them
  };
  struct Item {
    FiWorkItem work;
    double cost;
    int32_t block = 0, slot = 0;  // as Pair's; for split pairs set by WriteGroupMergeMap
  };
  struct Slot {  // a CTA in the winner tree, ordered by (load, cta)
    uint64_t load;  // bits of the accumulated cost (a double >= 0: its bits order like its value)
    int32_t cta;
  };
  // The pairs a candidate (chunk, max_pairs) splits: the first num_split_pairs of len_order_.
  struct Split {
    int64_t chunk = 0;           // the partition: its longest split piece
    int64_t num_split_pairs = 0;
    int64_t split_items = 0;     // chunks of the split pairs
    int64_t num_items = 0;       // all items: unsplit pairs + split_items
    int64_t partial_rows = 0;    // sum over split pairs of rows * chunks
    int64_t extra_rows = 0;      // sum over split pairs of rows * (chunks - 1): added fixed cost / cost_q
  };

  PlanStatus Fail(PlanStatus status, const char* fmt, ...);
  int64_t CountItems(int64_t chunk) const;
  int64_t SmallestChunkWithin(int64_t max_items, int64_t lo, int64_t align) const;
  Split WalkSplit(const PlanInputs& in, int64_t chunk, int64_t max_pairs) const;
  double EvaluateSplit(const PlanInputs& in, const Split& split, double bound, bool strict);
  // `in` is the LPT's grid (unit blocks: one unit on num_ctas / units CTAs); replicas: items written per
  // item (the units), for the section's capacity.
  Split ChooseSplit(const PlanInputs& in, const PlanSection& section, int64_t replicas, double total_cost,
                    double unsplit_makespan, double good_enough, double* makespan);
  // The partition on `in`'s grid (one unit) with CTA loads up to `cap`: its shape and makespan (+inf when
  // the pairs do not fit the CTAs). With `record`, its items in items_ (creation order, write-through
  // fields) and each one's CTA in item_cta_.
  Split FillWalk(const PlanInputs& in, double cap, bool record, double* makespan);
  Split DeterministicItems(const PlanInputs& in);
  Split ChooseDeterministic(const PlanInputs& in, const PlanSection& section, int64_t replicas, int32_t m,
                            int32_t lpt_units, double unsplit_makespan, double good_enough, double* makespan);
  double AssignItems(const PlanInputs& in, int64_t n_items, int32_t m, int32_t lpt_units);
  int64_t WriteMergeMap(int64_t n_items, int32_t* merge_indptr, int32_t* split_rows);
  int64_t WriteGroupMergeMap(int64_t n_items, int64_t num_rows, int32_t* merge_indptr, int32_t* split_rows);
  PlanStatus PrepareGroups(const PlanInputs& in, int64_t num_ctas, int64_t units, int64_t partial_room,
                           double* total_cost);
  bool ChoosePartition(const PlanInputs& in, const PlanSection& section, int64_t replicas, double total_cost,
                       double lpt_makespan, double* cap, double* makespan);
  void RadixSortKeys(int64_t n);
  double SortAndAssign(int64_t n, int32_t m, int32_t units, const int32_t* request_of = nullptr);
  double AssignByRequest(int64_t n, int32_t m, int32_t units, const int32_t* request_of);
  int64_t UnitShare(const PlanInputs& in) const;
  int64_t SplitBudget(const PlanInputs& in) const;
  void StartTree(int32_t m, const double* first, int64_t count);
  inline int32_t Assign(double cost, uint64_t* new_load);

  std::vector<Pair> pairs_;
  std::vector<int32_t> cost_order_;  // pairs by cost descending, ties in creation order
  std::vector<double> sorted_cost_;  // their costs, in that order
  std::vector<int32_t> rank_;        // position of each pair (of each item, once written) in cost_order_
  std::vector<uint8_t> skip_;        // by position in cost_order_: split in the candidate being evaluated
  std::vector<int32_t> len_order_;  // pairs by KV length descending, ties in creation order
  std::vector<int32_t> chunks_of_;  // chunks of each pair in the chosen plan (0: whole)
  std::vector<uint64_t> chunk_keys_;  // a candidate's chunk costs (complemented bits) and sort scratch
  Split seen_[2 * (1 + 3 + 1 + 15)];  // candidates the search has considered (ChooseSplit)
  std::vector<Item> items_;        // creation order: request, tile, chunk
  std::vector<uint64_t> keys_;     // sort keys, see planner.cc
  std::vector<uint64_t> keys_tmp_;
  std::vector<Slot> tree_;
  std::vector<double> first_round_;
  int32_t leaves_ = 0;
  std::vector<int32_t> item_cta_;  // CTA of each (item, unit), in assignment order (units innermost)
  std::vector<int32_t> seq_;       // group_requests: the replicas k * units + u in the order they were assigned
  std::vector<int32_t> entry_request_;  // request of each entry SortAndAssign sorts (group_requests)
  std::vector<double> request_cost_;
  std::vector<int32_t> request_rank_, request_pos_, request_start_, group_order_;
  std::vector<double> group_cost_;
  std::vector<int32_t> cta_fill_;
  std::vector<int32_t> group_of_;      // kept group of each request (-1: none), for the pairs' walk
  std::vector<int32_t> group_chunks_;  // chunks of each group's prefix (0: the group was dropped)
  std::vector<int32_t> row_block_;     // partial rows of each query row (WriteGroupMergeMap)
  std::vector<int64_t> det_chunk_;   // deterministic plans: each pair's piece length
  std::vector<uint8_t> det_split_;   // pairs whose pieces run as items of their own (else whole, folded)
  std::vector<int32_t> det_order_;   // pairs of more than one piece, by KV length descending
  char error_[512] = {0};
};

}  // namespace fi
