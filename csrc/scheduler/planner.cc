// Algorithm 1 of the FlashInfer paper; see planner.h for the contract and csrc/plan.h for the layout.
#include "scheduler/planner.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <utility>

namespace fi {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Order-preserving bits of a finite cost >= 0 (IEEE-754 doubles of one sign sort like their bits).
uint64_t CostBits(double cost) {
  uint64_t bits;
  std::memcpy(&bits, &cost, sizeof(bits));
  return bits;
}

double LoadOf(uint64_t bits) {
  double load;
  std::memcpy(&load, &bits, sizeof(load));
  return load;
}

// The cost of an item. One out-of-line definition, so the chunk search and the plan it picks add
// bit-identical doubles whatever the compiler does with multiply-adds at each call site.
__attribute__((noinline)) double ItemCost(const PlanInputs& in, int64_t rows, int64_t kv) {
  return std::max(in.cost_item_min, in.cost_q * (double)rows + in.cost_kv * (double)kv);
}

// Chunk sizes of a pair of `len` tokens cut into n aligned chunks, as even as alignment allows: the
// whole units of align are spread evenly (the first `rem` chunks get one more), the last chunk also
// takes the partial unit. Every chunk is non-empty when n <= ceil(len / align).
struct ChunkShape {
  int64_t per, rem, tail;  // chunk c < rem: (per + 1) * align; others per * align; the last + tail
  ChunkShape(int64_t len, int64_t n, int64_t align)
      : per(len / align / n), rem(len / align % n), tail(len % align) {}
  int64_t Size(int64_t c, int64_t n, int64_t align) const {
    return (per + (c < rem ? 1 : 0)) * align + (c == n - 1 ? tail : 0);
  }
};

// The deterministic plan's piece length for a request of kv_len tokens (PlanInputs::deterministic_pieces):
// align times a power of two, so that a request's cuts move seldom as it grows (decode), and a function
// of kv_len alone, so that they never move with the batch.
int64_t DeterministicChunk(int64_t kv_len, int64_t pieces, int64_t min_chunk, int64_t align) {
  const int64_t target = std::max(CeilDiv(std::max<int64_t>(kv_len, 1), pieces), min_chunk);
  int64_t chunk = align;
  while (chunk < target) chunk *= 2;
  return chunk;
}

// Below this many keys a comparison sort beats the radix sort's 256-entry histograms (measured).
constexpr int64_t kRadixMin = 64;

// LSD radix sort of 64-bit keys, ascending, stable, with `tmp` as scratch of the same size: stride 2
// sorts (key, index) pairs, stride 1 plain keys. The result may end in either buffer: returns
// true when it is in `tmp`. Byte digits on which all keys agree are skipped: integer-valued costs leave
// the low mantissa bytes zero and lengths leave the high bytes equal, so a decode batch takes two or
// three passes.
template <int kStride>
bool RadixSort(uint64_t* key, uint64_t* tmp, int64_t n) {
  uint64_t varying = 0;  // bits on which some key differs from the first
  for (int64_t k = 1; k < n; ++k) varying |= key[kStride * k] ^ key[0];
  uint32_t hist[256];
  bool swapped = false;
  for (int d = 0; d < 8; ++d) {
    const int shift = 8 * d;
    if (((varying >> shift) & 0xff) == 0) continue;
    std::memset(hist, 0, sizeof(hist));
    for (int64_t k = 0; k < n; ++k) ++hist[(key[kStride * k] >> shift) & 0xff];
    uint32_t sum = 0;
    for (int b = 0; b < 256; ++b) {
      const uint32_t c = hist[b];
      hist[b] = sum;
      sum += c;
    }
    for (int64_t k = 0; k < n; ++k) {
      const uint64_t v = key[kStride * k];
      const uint32_t pos = hist[(v >> shift) & 0xff]++;
      tmp[kStride * pos] = v;
      if (kStride == 2) tmp[2 * pos + 1] = key[2 * k + 1];
    }
    std::swap(key, tmp);
    swapped = !swapped;
  }
  return swapped;
}

// (load, cta) <- (sib_load, sib_cta) if sib_load < limit. Which sibling wins a tournament level is
// data-dependent and unpredictable, so this must be a conditional move, never a branch (a branch costs
// a misprediction on about half of the levels: measured 1.8x slower LPT). Compilers decide that by
// heuristics that change with the surrounding code, so on x86-64 it is spelled out.
inline void SelectIfBelow(uint64_t sib_load, int32_t sib_cta, uint64_t limit, uint64_t* load, int32_t* cta) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  uint64_t l = *load;
  int32_t c = *cta;
  __asm__("cmpq %[limit], %[sib_load]\n\t"
          "cmovbq %[sib_load], %[l]\n\t"
          "cmovbl %[sib_cta], %[c]"
          : [l] "+r"(l), [c] "+r"(c)
          : [sib_load] "r"(sib_load), [sib_cta] "r"(sib_cta), [limit] "r"(limit)
          : "cc");
  *load = l;
  *cta = c;
#else
  const bool wins = sib_load < limit;
  *load = wins ? sib_load : *load;
  *cta = wins ? sib_cta : *cta;
#endif
}

}  // namespace

PlanStatus Planner::Fail(PlanStatus status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(error_, sizeof(error_), fmt, args);
  va_end(args);
  return status;
}

// Items a chunk size produces when every pair longer than it is split: ceil(len / chunk) for those,
// one for every other pair, an empty one included.
int64_t Planner::CountItems(int64_t chunk) const {
  int64_t count = 0;
  for (const Pair& p : pairs_) count += p.block == 0 && p.kv_len > chunk ? CeilDiv(p.kv_len, chunk) : 1;
  return count;
}

// The smallest chunk (a multiple of align, >= lo) whose full split makes <= max_items items, or 0 when
// that chunk splits nothing. Needs pairs < max_items (else only "no split" qualifies).
int64_t Planner::SmallestChunkWithin(int64_t max_items, int64_t lo, int64_t align) const {
  const int64_t max_len = len_order_.empty() ? 0 : pairs_[len_order_[0]].kv_len;
  int64_t a = CeilDiv(lo, align);                    // in units of align
  int64_t b = std::max(a, CeilDiv(max_len, align));  // here every pair is one item: count = pairs
  while (a < b) {
    const int64_t mid = a + (b - a) / 2;
    if (CountItems(mid * align) <= max_items) b = mid; else a = mid + 1;
  }
  return a * align < max_len ? a * align : 0;
}

// Sorts keys_ = (key, index) pairs by key, ascending, stably (keys_tmp_ is scratch).
void Planner::RadixSortKeys(int64_t n) {
  keys_tmp_.resize(2 * n);
  if (RadixSort<2>(keys_.data(), keys_tmp_.data(), n)) keys_.swap(keys_tmp_);
}

// Longest processing time first: each item, heaviest first, goes to the CTA with the least accumulated
// cost (ties: lowest index). A winner tree (a tournament) over the CTAs finds it: leaves are the CTAs'
// loads, padded to a power of two with infinite loads, and each inner node holds the lighter of its two
// children, the left one on a tie; as a left subtree holds only lower CTA indices than its right
// sibling, the root is the least loaded CTA with the lowest index, exactly what a binary heap ordered by
// (load, cta) gives. An update walks from the winner's leaf to the root, comparing with siblings whose
// addresses are known in advance, so their loads overlap and the chain is one compare and two selects
// per level (a heap's sift-down chases addresses that each depend on the previous comparison). Loads
// are kept as the bits of non-negative doubles, which order like the values, so "<=" is "< bits + 1".
// The load sequence depends only on the sequence of costs, so items of equal cost may come in any order.
//
// LPT over the n entries whose keys_ hold (~CostBits(cost), creation index): sorts them by cost,
// descending, ties in creation order (cost_order_, sorted_cost_), gives each entry's `units` replicas,
// in turn, to the least-loaded of m CTAs (item_cta_[k * units + u]), and returns the makespan.
//
// request_of (PlanInputs::group_requests; indexed by creation index): the order is the requests by total
// cost, descending (ties: lower index), each request's entries by cost as above, and its replicas go
// unit-major (all of unit 0's entries, then unit 1's, ...); seq_ records that order (k * units + u).
double Planner::SortAndAssign(int64_t n, int32_t m, int32_t units, const int32_t* request_of) {
  RadixSortKeys(n);
  cost_order_.resize(n);
  sorted_cost_.resize(n);
  for (int64_t k = 0; k < n; ++k) {
    cost_order_[k] = (int32_t)keys_[2 * k + 1];
    sorted_cost_[k] = LoadOf(~keys_[2 * k]);
  }
  const int64_t total = n * units;
  item_cta_.resize(total);
  first_round_.resize(m);
  if (request_of != nullptr) return AssignByRequest(n, m, units, request_of);
  // StartTree's first round: the leading replicas with cost > 0, at most m. Replica r is item r / units
  // (counted with item and unit indices: a division per replica costs as much as the tree update).
  int64_t first = 0;
  for (int64_t k = 0, u = 0; first < total && first < m && sorted_cost_[k] > 0.0; ++first) {
    first_round_[first] = sorted_cost_[k];
    if (++u == units) u = 0, ++k;
  }
  StartTree(m, first_round_.data(), first);
  uint64_t max_load = first > 0 ? CostBits(first_round_[0]) : 0;
  for (int64_t k = 0; k < first; ++k) item_cta_[k] = (int32_t)k;
  int64_t r = first;
  for (int64_t k = first / units; k < n; ++k) {
    const double cost = sorted_cost_[k];
    for (int64_t end = (k + 1) * units; r < end; ++r) {
      uint64_t load;
      item_cta_[r] = Assign(cost, &load);
      max_load = std::max(max_load, load);
    }
  }
  return LoadOf(max_load);
}

// SortAndAssign's group_requests order (the entries already by cost in cost_order_ / sorted_cost_): a stable
// counting sort of that order by the rank of the entry's request, then the replicas request by request,
// unit-major, each to the least-loaded CTA.
double Planner::AssignByRequest(int64_t n, int32_t m, int32_t units, const int32_t* request_of) {
  int32_t B = 0;
  for (int64_t k = 0; k < n; ++k) B = std::max(B, request_of[k] + 1);
  request_cost_.assign(B, 0.0);
  for (int64_t k = 0; k < n; ++k) request_cost_[request_of[cost_order_[k]]] += sorted_cost_[k];
  // Requests by total cost, descending, ties by index: the radix sort of (complemented cost bits, request)
  // (keys_ is free again: the entries' order is in cost_order_), no allocation once the buffers have grown.
  keys_.resize(2 * (int64_t)B);
  for (int32_t b = 0; b < B; ++b) {
    keys_[2 * b] = ~CostBits(request_cost_[b]);
    keys_[2 * b + 1] = (uint64_t)b;
  }
  RadixSortKeys(B);
  request_rank_.resize(B);
  for (int32_t r = 0; r < B; ++r) request_rank_[r] = (int32_t)keys_[2 * r + 1];
  // request_rank_: position -> request; request_pos_: request -> position; request_start_: each position's
  // first slot in the new order (a counting sort, stable: the cost order within a request stays).
  request_pos_.resize(B);
  for (int32_t r = 0; r < B; ++r) request_pos_[request_rank_[r]] = r;
  request_start_.assign(B + 1, 0);
  for (int64_t k = 0; k < n; ++k) ++request_start_[request_pos_[request_of[cost_order_[k]]] + 1];
  for (int32_t r = 0; r < B; ++r) request_start_[r + 1] += request_start_[r];
  group_order_.resize(n);
  group_cost_.resize(n);
  for (int64_t k = 0; k < n; ++k) {
    const int32_t at = request_start_[request_pos_[request_of[cost_order_[k]]]]++;
    group_order_[at] = cost_order_[k];
    group_cost_[at] = sorted_cost_[k];
  }
  cost_order_.swap(group_order_);
  sorted_cost_.swap(group_cost_);
  // The replicas: per request (a run of cost_order_ with one request), unit-major.
  const int64_t total = n * units;
  seq_.resize(total);
  int64_t s = 0;
  for (int64_t g0 = 0; g0 < n;) {
    const int32_t req = request_of[cost_order_[g0]];
    int64_t g1 = g0 + 1;
    while (g1 < n && request_of[cost_order_[g1]] == req) ++g1;
    for (int32_t u = 0; u < units; ++u)
      for (int64_t k = g0; k < g1; ++k) seq_[s++] = (int32_t)(k * units + u);
    g0 = g1;
  }
  // The tail by cost, descending (LPT), so that the schedule ends on small items: request by request alone,
  // a request's largest items may come last and leave a CTA one item over the rest (1x16k, 16 heads: 11%
  // over LPT's makespan). The tail is the last replicas worth 2 m times the largest item (or everything).
  double max_cost = 0.0, tail_cost = 0.0;
  for (int64_t k = 0; k < n; ++k) max_cost = std::max(max_cost, sorted_cost_[k]);
  const double tail_target = 2.0 * m * max_cost;
  int64_t t0 = total;
  while (t0 > 0 && tail_cost < tail_target) tail_cost += sorted_cost_[seq_[--t0] / units];
  const int64_t tail = total - t0;  // sorted as (complemented cost bits, replica) keys, stably
  keys_.resize(2 * tail);
  for (int64_t i = 0; i < tail; ++i) {
    keys_[2 * i] = ~CostBits(sorted_cost_[seq_[t0 + i] / units]);
    keys_[2 * i + 1] = (uint64_t)seq_[t0 + i];
  }
  RadixSortKeys(tail);
  for (int64_t i = 0; i < tail; ++i) seq_[t0 + i] = (int32_t)keys_[2 * i + 1];
  int64_t first = 0;
  for (; first < total && first < m; ++first) {
    const double cost = sorted_cost_[seq_[first] / units];
    if (!(cost > 0.0)) break;
    first_round_[first] = cost;
  }
  StartTree(m, first_round_.data(), first);
  uint64_t max_load = 0;
  for (int64_t k = 0; k < first; ++k) {
    item_cta_[seq_[k]] = (int32_t)k;
    max_load = std::max(max_load, CostBits(first_round_[k]));
  }
  for (int64_t q = first; q < total; ++q) {
    uint64_t load;
    item_cta_[seq_[q]] = Assign(sorted_cost_[seq_[q] / units], &load);
    max_load = std::max(max_load, load);
  }
  return LoadOf(max_load);
}

// CTAs of one unit's share of the grid, and the split items (counted once for all units) a plan may
// have: see kMaxSplitItemsPerCta.
int64_t Planner::UnitShare(const PlanInputs& in) const { return CeilDiv(in.num_ctas, in.num_units); }
int64_t Planner::SplitBudget(const PlanInputs& in) const { return kMaxSplitItemsPerCta * UnitShare(in); }

// StartTree does LPT's first round in one go: while a CTA is empty and the items cost > 0, the next item
// goes to the lowest-indexed empty CTA, so the first `count` (<= m) items land on CTAs 0, 1, ... in
// order. Their costs become the leaves' loads and the tree is built once, instead of an update per item.
void Planner::StartTree(int32_t m, const double* first, int64_t count) {
  int32_t leaves = 1;
  while (leaves < m) leaves *= 2;
  leaves_ = leaves;
  tree_.resize(2 * (size_t)leaves);
  Slot* tree = tree_.data();  // node t has children 2t, 2t + 1; the leaf of CTA c is node leaves + c
  for (int32_t c = 0; c < leaves; ++c)
    tree[leaves + c] = Slot{CostBits(c < count ? first[c] : c < m ? 0.0 : HUGE_VAL), c};
  for (int32_t t = leaves - 1; t >= 1; --t)
    tree[t] = tree[2 * t + 1].load < tree[2 * t].load ? tree[2 * t + 1] : tree[2 * t];
}

// Adds `cost` to the least loaded CTA; returns that CTA and sets *new_load to its new load's bits.
__attribute__((always_inline)) inline int32_t Planner::Assign(double cost, uint64_t* new_load) {
  Slot* const tree = tree_.data();
  const int32_t winner = tree[1].cta;
  uint64_t load = CostBits(LoadOf(tree[1].load) + cost);
  *new_load = load;
  int32_t cta = winner;
  int32_t t = leaves_ + winner;
  tree[t].load = load;
  for (; t > 1; t >>= 1) {
    const uint64_t sib_load = tree[t ^ 1].load;
    const int32_t sib_cta = tree[t ^ 1].cta;
    // The sibling wins if lighter, or equal and on the left (t odd: we are the right child).
    SelectIfBelow(sib_load, sib_cta, load + (uint64_t)(t & 1), &load, &cta);
    tree[t >> 1] = Slot{load, cta};
  }
  return winner;
}

// The candidate (chunk, max_pairs): walking the pairs longest first, split each pair longer than chunk
// into ceil(len / chunk) chunks, and stop at the first pair that is not longer, after max_pairs pairs
// (max_pairs < 0: no such limit), or at the first pair whose chunks would take the split items past
// SplitBudget = 2 * ceil(num_ctas / num_units). The last stop is what keeps every plan within the
// workspace: split items <= that budget, each with <= tile_q rows and its partial rows shared by its
// units' replicas, so partial rows <= budget * tile_q.
Planner::Split Planner::WalkSplit(const PlanInputs& in, int64_t chunk, int64_t max_pairs) const {
  Split s;
  s.chunk = chunk;
  const int64_t budget = SplitBudget(in);
  for (const int32_t j : len_order_) {
    if (s.num_split_pairs == max_pairs) break;
    const Pair& p = pairs_[j];
    if (p.kv_len <= chunk) break;
    const int64_t n = CeilDiv(p.kv_len, chunk);
    if (s.split_items + n > budget) break;
    const int64_t rows = p.q_end - p.q_begin;
    s.split_items += n;
    s.num_split_pairs += 1;
    s.partial_rows += rows * n;
    s.extra_rows += rows * (n - 1);
  }
  s.num_items = (int64_t)pairs_.size() + s.split_items - s.num_split_pairs;
  return s;
}

// The LPT makespan of a candidate's items: the unsplit pairs (already by cost, descending) merged with
// the split pairs' chunks (sorted here; at most SplitBudget), each as its units' replicas. Gives up, returning +inf, as soon as
// a CTA's load exceeds `bound` (or reaches it, when `strict`): loads only grow, so the candidate cannot
// win any more.
double Planner::EvaluateSplit(const PlanInputs& in, const Split& split, double bound, bool strict) {
  const int64_t align = in.kv_chunk_align;
  // The chunks' costs, as complemented bits sorted ascending: costs descending. A pair's chunks have at
  // most three sizes, so each size's cost is computed once.
  chunk_keys_.resize(2 * split.split_items);
  uint64_t* chunk_key = chunk_keys_.data();
  for (int64_t i = 0; i < split.num_split_pairs; ++i) {
    const int32_t j = len_order_[i];
    const Pair& p = pairs_[j];
    const int64_t n = CeilDiv(p.kv_len, split.chunk), rows = p.q_end - p.q_begin;
    skip_[rank_[j]] = 1;
    const ChunkShape shape(p.kv_len, n, align);
    const uint64_t big = ~CostBits(ItemCost(in, rows, (shape.per + 1) * align));
    const uint64_t small = ~CostBits(ItemCost(in, rows, shape.per * align));
    for (int64_t c = 0; c < n - 1; ++c) *chunk_key++ = c < shape.rem ? big : small;
    *chunk_key++ = ~CostBits(ItemCost(in, rows, shape.Size(n - 1, n, align)));
  }
  // Sorted by comparisons when short, by radix (its 256-entry histograms pay off) when long.
  const uint64_t* chunk = chunk_keys_.data();
  if (split.split_items < kRadixMin) {
    std::sort(chunk_keys_.data(), chunk_keys_.data() + split.split_items);
  } else if (RadixSort<1>(chunk_keys_.data(), chunk_keys_.data() + split.split_items, split.split_items)) {
    chunk += split.split_items;
  }
  const uint64_t limit = CostBits(bound) + (strict ? 0 : 1);  // give up when a load's bits reach this
  const double* pair_cost = sorted_cost_.data();
  const uint8_t* skip = skip_.data();
  const int64_t n_pairs = (int64_t)sorted_cost_.size();
  const int64_t n_chunks = split.split_items;
  int64_t i = 0, c = 0;
  // The items by cost, descending: the unsplit pairs merged with the chunks. Returns false at the end.
  auto next = [&](double* cost) {
    while (i < n_pairs && skip[i]) ++i;
    if (i < n_pairs && (c == n_chunks || pair_cost[i] >= LoadOf(~chunk[c]))) {
      *cost = pair_cost[i++];
    } else if (c < n_chunks) {
      *cost = LoadOf(~chunk[c++]);
    } else {
      return false;
    }
    return true;
  };
  // Each item `units` times: its replicas, one per unit.
  const int32_t units = (int32_t)in.num_units;
  double item_cost = 0.0;
  int32_t replicas_left = 0;
  auto next_replica = [&](double* cost) {
    if (replicas_left == 0) {
      if (!next(&item_cost)) return false;
      replicas_left = units;
    }
    --replicas_left;
    *cost = item_cost;
    return true;
  };
  const int32_t m = (int32_t)in.num_ctas;
  first_round_.resize(m);
  double cost = 0.0;
  int64_t count = 0;
  bool held = false;  // `cost` is a replica taken from next_replica() but not yet assigned (a zero cost)
  while (count < m && next_replica(&cost)) {
    if (!(cost > 0.0)) {
      held = true;
      break;
    }
    first_round_[count++] = cost;
  }
  StartTree(m, first_round_.data(), count);
  uint64_t max_load = count > 0 ? CostBits(first_round_[0]) : 0, load = 0;
  bool gave_up = max_load >= limit;
  while (!gave_up && (held || next_replica(&cost))) {
    held = false;
    Assign(cost, &load);
    max_load = std::max(max_load, load);
    gave_up = max_load >= limit;
  }
  for (int64_t k = 0; k < split.num_split_pairs; ++k) skip_[rank_[len_order_[k]]] = 0;
  return gave_up ? HUGE_VAL : LoadOf(max_load);
}

// Algorithm 1's chunk choice, as a search over candidates (see WalkSplit), in this order:
// With s = ceil(num_ctas / num_units), the CTAs of one unit's share:
//   1. the previous rule's chunk, when pairs < s: the smallest whose full split makes <= s items. Its
//      plan is exactly the previous rule's, and coming first it is always compared, so the choice is
//      never worse than that rule;
//   2. units * total KV / (j * num_ctas), j = 1, 2, 3: chunks near a CTA's fair share (one long request
//      among short ones: the long one is cut to about the share, the short ones fill in around its chunks);
//   3. the smallest chunk whose full split makes <= 2 s items, when pairs < 2 s;
//   4. longest / k, k = 2 .. 16: the longest pair cut into k (a few long requests, or many equal ones).
// Each chunk is rounded up to kv_chunk_align and to at least min_kv_chunk, kept if shorter than the
// longest pair, and tried with the most pairs the split-item budget allows, then with half as many
// (when the batch is not a multiple of the CTAs, splitting only some pairs balances the last round
// with fewer items). "No split" is the incumbent. A candidate replaces the best so far if its LPT
// makespan is lower, or equal with fewer items (fewer partial states to write and merge). Skipped:
// candidates that do not fit the section's capacities, and candidates that split the same pairs into
// the same numbers of chunks as an earlier one (the same plan). The search stops as soon as the best
// is within kBalancedSlack of the lower bound units * total cost / num_ctas, which keeps large batches
// (where a split or two already reaches it) to one or two LPT passes. Every candidate's split items are
// within WalkSplit's budget, so every plan fits the workspace's partial rows.
Planner::Split Planner::ChooseSplit(const PlanInputs& in, const PlanSection& section, int64_t replicas,
                                    double total_cost, double unsplit_makespan, double good_enough,
                                    double* makespan_out) {
  Split best;
  best.num_items = (int64_t)pairs_.size();
  double& best_makespan = *makespan_out;  // the choice's LPT makespan
  best_makespan = unsplit_makespan;
  const int64_t n = (int64_t)pairs_.size(), m = in.num_ctas, units = in.num_units, align = in.kv_chunk_align;
  const int64_t share = UnitShare(in);
  const int64_t lo = RoundUp(in.min_kv_chunk, align);
  const int64_t max_len = pairs_[len_order_[0]].kv_len;
  if (max_len <= lo) return best;  // no chunk may split anything

  int64_t chunks[1 + 3 + 1 + 15];
  int num_chunks = 0;
  auto add = [&](int64_t chunk) {
    chunk = std::max(lo, RoundUp(chunk, align));
    if (chunk >= max_len) return;
    for (int k = 0; k < num_chunks; ++k)
      if (chunks[k] == chunk) return;
    chunks[num_chunks++] = chunk;
  };
  if (n < share) {
    const int64_t chunk = SmallestChunkWithin(share, lo, align);
    if (chunk > 0) add(chunk);
  }
  int64_t total_kv = 0;
  for (const Pair& p : pairs_) total_kv += p.kv_len - p.kv_begin;
  for (int64_t j = 1; j <= 3; ++j) add(CeilDiv(units * total_kv, j * m));
  if (n < 2 * share) {
    const int64_t chunk = SmallestChunkWithin(2 * share, lo, align);
    if (chunk > 0) add(chunk);
  }
  for (int64_t k = 2; k <= 16; ++k) add(CeilDiv(max_len, k));

  const double inv_m = (double)units / (double)m;  // total cost of the items -> lower bound
  int num_seen = 0;
  for (int k = 0; k < num_chunks && best_makespan > good_enough; ++k) {
    const Split full = WalkSplit(in, chunks[k], -1);
    for (int variant = 0; variant < 2 && best_makespan > good_enough; ++variant) {
      Split split = full;
      if (variant == 1) {
        if (full.num_split_pairs < 2) break;
        split = WalkSplit(in, chunks[k], full.num_split_pairs / 2);
      }
      if (split.num_split_pairs == 0) break;
      // The same plan as an earlier candidate: same pairs (a prefix of len_order_), same chunk counts.
      bool repeat = false;
      for (int e = 0; e < num_seen && !repeat; ++e) {
        const Split& o = seen_[e];
        if (o.num_split_pairs != split.num_split_pairs || o.split_items != split.split_items) continue;
        repeat = true;
        for (int64_t i = 0; i < split.num_split_pairs && repeat; ++i) {
          const int64_t len = pairs_[len_order_[i]].kv_len;
          repeat = CeilDiv(len, o.chunk) == CeilDiv(len, split.chunk);
        }
      }
      if (repeat) continue;
      seen_[num_seen++] = split;
      if (split.num_items * replicas > section.max_items || split.partial_rows > section.max_partial_rows) continue;
      // More (or as many) items than the best so far must beat its makespan; fewer may tie it.
      const bool strict = split.num_items >= best.num_items;
      // Cheap bound first: the makespan is >= units * the candidate's total cost / num_ctas (a margin keeps
      // rounding from ever discarding a candidate that could win).
      const double total = total_cost + in.cost_q * (double)split.extra_rows;
      if (total * inv_m > best_makespan * (1.0 + 1e-9)) continue;
      const double makespan = EvaluateSplit(in, split, best_makespan, strict);
      if (makespan == HUGE_VAL) continue;
      best = split;
      best_makespan = makespan;
    }
  }
  return best;
}

// The partition: the pairs in creation order fill CTA 0, then CTA 1, ... up to `cap` of cost each. A
// pair that does not fit whole is cut at the last boundary within the cap (a multiple of kv_chunk_align,
// each piece at least min_kv_chunk rounded up to it, the remainder too unless it is the pair's last KV
// tile) and goes on in the next CTA; when no such cut exists the CTA is closed and the pair tried on the
// next. Each cut costs its piece's fixed cost (cost_q * rows) once more, counted where it falls. A CTA
// closes with one cut at most, so the split items are at most 2 (num_ctas - 1): within SplitBudget. Infeasible (+inf) when the pairs need more
// CTAs, or an empty CTA takes not even the piece that must come next.
Planner::Split Planner::FillWalk(const PlanInputs& in, double cap, bool record, double* makespan) {
  Split s;
  *makespan = HUGE_VAL;
  const int64_t align = in.kv_chunk_align, lo = RoundUp(in.min_kv_chunk, align);
  const int32_t m = (int32_t)in.num_ctas;
  int32_t cta = 0;
  bool empty = true;  // nothing on `cta` yet
  double load = 0.0, max_load = 0.0;
  if (record) items_.clear(), item_cta_.clear();
  for (const Pair& p : pairs_) {
    const int64_t rows = p.q_end - p.q_begin, len = p.kv_len;
    int64_t begin = 0, pieces = 0;
    double rest = p.cost;  // of the pair's KV [begin, len)
    for (;;) {
      if (cta == m) return s;
      int64_t end = len;
      double cost = rest;
      if (load + rest > cap) {
        // KV tokens that still fit (< len - begin, as the rest does not) and a cut at the last aligned
        // boundary within them. It leaves >= lo tokens behind it, or exactly the pair's last KV tile (a
        // partial tile is one tile's work anyway; without this, 1001 tokens in 128-token tiles could not be
        // cut past 768). Divisions only here: at most one cut or close per CTA.
        const double room = (cap - load - in.cost_q * (double)rows) / in.cost_kv;
        end = -1;
        if (room >= 0.0) {
          const int64_t last_tile = (len - 1) / align * align;
          end = (begin + (int64_t)room) / align * align;
          end = end >= last_tile ? last_tile : std::min(end, (len - lo) / align * align);
        }
        if (end < begin + lo) {
          if (empty) return s;  // not even the smallest piece fits an empty CTA
          max_load = std::max(max_load, load);
          ++cta, load = 0.0, empty = true;
          continue;
        }
        cost = ItemCost(in, rows, end - begin);
      }
      if (record) {
        items_.push_back(Item{FiWorkItem{p.request, p.q_begin, p.q_end, (int32_t)begin, (int32_t)end, -1, 1, 0}, cost});
        item_cta_.push_back(cta);
      }
      load += cost, empty = false, ++pieces;
      if (end == len) break;
      s.chunk = std::max(s.chunk, end - begin);
      max_load = std::max(max_load, load);
      ++cta, load = 0.0, empty = true, begin = end;
      rest = ItemCost(in, rows, len - begin);
    }
    if (pieces > 1) {
      s.chunk = std::max(s.chunk, len - begin);
      s.num_split_pairs += 1;
      s.split_items += pieces;
      s.partial_rows += rows * pieces;
      s.extra_rows += rows * (pieces - 1);
    }
  }
  s.num_items = (int64_t)pairs_.size() + s.split_items - s.num_split_pairs;
  *makespan = std::max(max_load, load);
  return s;
}

// The partition's cap. The first walk's cap is LPT's makespan: when not even that fits the pairs into the
// CTAs (or the section), no lower cap is tried (feasibility is all but monotone in the cap), so a batch the
// partition cannot help costs one walk. Then bisection between the lower bound total cost / num_ctas and
// the best makespan so far: a feasible walk lowers the upper end to its makespan, an infeasible one (or one
// that does not fit the section) raises the lower end to its cap, until kPartitionWalks walks or an
// interval of kPartitionPrecision times the bound. Alignment makes feasibility not quite monotone, so
// this is a search, not a proof of the best cap. Returns true, with the cap and makespan, when some walk's
// makespan is strictly below LPT's.
bool Planner::ChoosePartition(const PlanInputs& in, const PlanSection& section, int64_t replicas,
                              double total_cost, double lpt_makespan, double* cap, double* makespan) {
  if (!(in.cost_kv > 0.0)) return false;  // KV costs nothing: cutting adds fixed cost only
  const double bound = total_cost / (double)in.num_ctas;
  double lo = bound, hi = lpt_makespan, best = lpt_makespan;
  for (int walk = 0; walk < kPartitionWalks && hi - lo > kPartitionPrecision * bound; ++walk) {
    const double try_cap = walk == 0 ? hi : 0.5 * (lo + hi);
    double got;
    const Split s = FillWalk(in, try_cap, false, &got);
    if (got == HUGE_VAL || s.num_items * replicas > section.max_items || s.partial_rows > section.max_partial_rows) {
      if (walk == 0) return false;
      lo = try_cap;
      continue;
    }
    if (got < best) best = got, *cap = try_cap;
    hi = got;
  }
  if (!(best < lpt_makespan)) return false;
  *makespan = best;
  return true;
}

// The deterministic plan's items, in creation order (request, tile, piece) into items_. Pair j's pieces are
// its request's [0, C), [C, 2C), ... up to its tile's KV end (C = det_chunk_[j]) whatever else is in the
// step; a pair marked in det_split_ runs them as items of their own (pieces past a row's own causal end
// are masked for it: their states are empty and the merge skips them), any other pair as one whole item
// with partial_stride = C, whose kernel folds the pieces' states exactly as the merge would (decode.cuh).
// Returns the shape (chunk: the largest C that split a pair).
Planner::Split Planner::DeterministicItems(const PlanInputs& in) {
  Split s;
  items_.clear();
  for (size_t j = 0; j < pairs_.size(); ++j) {
    const Pair& p = pairs_[j];
    const int64_t rows = p.q_end - p.q_begin;
    const int64_t chunk = det_chunk_[j];
    if (!det_split_[j]) {
      const int32_t stride = (int32_t)std::min<int64_t>(chunk, INT32_MAX);
      items_.push_back(Item{FiWorkItem{p.request, p.q_begin, p.q_end, 0, p.kv_len, -1, stride, 0}, p.cost});
      continue;
    }
    const int64_t n = CeilDiv(p.kv_len, chunk);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t kv_begin = c * chunk, kv_end = std::min<int64_t>(p.kv_len, kv_begin + chunk);
      items_.push_back(Item{FiWorkItem{p.request, p.q_begin, p.q_end, (int32_t)kv_begin, (int32_t)kv_end, -1, 1, 0},
                            ItemCost(in, rows, kv_end - kv_begin)});
    }
    s.chunk = std::max(s.chunk, chunk);
    s.num_split_pairs += 1;
    s.split_items += n;
    s.partial_rows += rows * n;
    s.extra_rows += rows * (n - 1);
  }
  s.num_items = (int64_t)items_.size();
  return s;
}

// Which pairs of a deterministic plan run their pieces as items of their own (the rest run whole and fold):
// the choice may follow the batch, since either way a row's bits are the same. Candidates: nothing, then
// the s longest pairs of more than one piece (ties in creation order), s = 1, 2, 4, ... up to all of them;
// the lowest LPT makespan wins (ties: the fewer split, coming first), the search stopping once within
// kBalancedSlack of the lower bound (a balanced batch plans as whole items at once) and at the first
// candidate that does not fit the section. Leaves the winner's items in items_ and its makespan.
Planner::Split Planner::ChooseDeterministic(const PlanInputs& in, const PlanSection& section, int64_t replicas,
                                            int32_t m, int32_t lpt_units, double unsplit_makespan,
                                            double good_enough, double* makespan) {
  const int64_t n = (int64_t)pairs_.size();
  det_chunk_.resize(n);
  det_split_.assign(n, 0);
  det_order_.clear();
  for (int64_t j = 0; j < n; ++j) {
    const Pair& p = pairs_[j];
    det_chunk_[j] = DeterministicChunk(in.kv_lens[p.request], in.deterministic_pieces, in.min_kv_chunk,
                                       in.kv_chunk_align);
    if (p.kv_len > det_chunk_[j]) det_order_.push_back((int32_t)j);
  }
  std::stable_sort(det_order_.begin(), det_order_.end(),
                   [&](int32_t a, int32_t b) { return pairs_[a].kv_len > pairs_[b].kv_len; });
  const int64_t multi = (int64_t)det_order_.size();
  int64_t best_s = 0, marked = 0;
  double best = unsplit_makespan;
  for (int64_t s = 1; multi > 0 && best > good_enough; s = std::min(2 * s, multi)) {
    for (; marked < s; ++marked) det_split_[det_order_[marked]] = 1;
    const Split split = DeterministicItems(in);
    if (split.num_items * replicas > section.max_items || split.partial_rows > section.max_partial_rows) break;
    const double got = AssignItems(in, split.num_items, m, lpt_units);
    if (got < best) best = got, best_s = s;
    if (s == multi) break;
  }
  for (int64_t k = best_s; k < marked; ++k) det_split_[det_order_[k]] = 0;
  *makespan = best;
  return DeterministicItems(in);
}

// items_[0, n_items) by cost, descending, ties in creation order, then LPT (or request by request with
// group_requests); cost_order_ then holds the item order (the pairs' is no longer needed).
double Planner::AssignItems(const PlanInputs& in, int64_t n_items, int32_t m, int32_t lpt_units) {
  keys_.resize(2 * n_items);
  for (int64_t k = 0; k < n_items; ++k) {
    keys_[2 * k] = ~CostBits(items_[k].cost);
    keys_[2 * k + 1] = (uint64_t)k;
  }
  if (in.group_requests) {
    entry_request_.resize(n_items);
    for (int64_t k = 0; k < n_items; ++k) entry_request_[k] = items_[k].work.request;
  }
  return SortAndAssign(n_items, m, lpt_units, in.group_requests ? entry_request_.data() : nullptr);
}

// Partial rows and merge map of items_[0, n_items) (creation order, a pair's items consecutive in chunk
// order): a pair of n > 1 items is split, and row r of it owns partial rows [partial + (r - q_begin) * n,
// + n), item c writing the c-th of each row's; whole pairs write through. Returns the split rows.
int64_t Planner::WriteMergeMap(int64_t n_items, int32_t* merge_indptr, int32_t* split_rows) {
  int32_t partial = 0;  // partial rows handed out so far, also merge_indptr at the current row
  int64_t num_split_rows = 0;
  for (int64_t k = 0; k < n_items;) {
    const FiWorkItem& first = items_[k].work;
    int64_t k1 = k + 1;
    while (k1 < n_items && items_[k1].work.q_begin == first.q_begin) ++k1;
    const int32_t n = (int32_t)(k1 - k);
    if (n > 1) {
      for (int32_t c = 0; c < n; ++c) items_[k + c].work.partial_base = partial + c, items_[k + c].work.partial_stride = n;
      for (int32_t r = first.q_begin; r < first.q_end; ++r) {
        partial += n;
        merge_indptr[r + 1] = partial;
        split_rows[num_split_rows++] = r;
      }
    } else {
      for (int32_t r = first.q_begin; r < first.q_end; ++r) merge_indptr[r + 1] = partial;
    }
    k = k1;
  }
  return num_split_rows;
}

// The merge map of a plan with shared-prefix groups: items_[0, n_items) in creation order, a group's fixed
// items carrying their rows' partial rows (block = chunks + 1: the prefix's chunks, then the member's own
// state) and their slot; a split pair's chunks (consecutive unfixed items of one q_begin) get block = their
// count. Partial rows are laid out row by row (merge_indptr), so a fixed item's rows, which all have the
// same block, take partial_base = merge_indptr[q_begin] + slot and stride = block. Returns the split rows.
int64_t Planner::WriteGroupMergeMap(int64_t n_items, int64_t num_rows, int32_t* merge_indptr, int32_t* split_rows) {
  row_block_.assign(num_rows, 0);
  for (int64_t k = 0; k < n_items;) {
    Item& first = items_[k];
    int64_t k1 = k + 1;
    if (first.block == 0) {
      while (k1 < n_items && items_[k1].block == 0 && items_[k1].work.q_begin == first.work.q_begin) ++k1;
      const int32_t n = (int32_t)(k1 - k);
      if (n > 1)
        for (int32_t c = 0; c < n; ++c) items_[k + c].block = n, items_[k + c].slot = c;
    }
    const int32_t block = first.block;
    for (int32_t r = first.work.q_begin; r < first.work.q_end; ++r) row_block_[r] = block;
    k = k1;
  }
  int64_t num_split_rows = 0;
  merge_indptr[0] = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    merge_indptr[r + 1] = merge_indptr[r] + row_block_[r];
    if (row_block_[r] > 0) split_rows[num_split_rows++] = (int32_t)r;
  }
  for (int64_t k = 0; k < n_items; ++k) {
    Item& it = items_[k];
    if (it.block > 0) {
      it.work.partial_base = merge_indptr[it.work.q_begin] + it.slot;
      it.work.partial_stride = it.block;
    }
  }
  return num_split_rows;
}

PlanStatus Planner::Plan(const PlanInputs& in_arg, const PlanSection& section, PlanSummary* summary) {
  using S = PlanStatus;
  error_[0] = '\0';
  // Shared-prefix groups run neither request by request nor as the partition (their items are fixed).
  PlanInputs in_copy = in_arg;
  if (in_arg.num_groups > 0) in_copy.group_requests = false, in_copy.allow_partition = false;
  const PlanInputs& in = in_copy;
  // ---- arguments -------------------------------------------------------------------------------
  if (in.num_requests < 0)
    return Fail(S::kInvalidArgument, "num_requests must be >= 0, got %lld", (long long)in.num_requests);
  if (in.tile_q < 1) return Fail(S::kInvalidArgument, "tile_q must be >= 1, got %lld", (long long)in.tile_q);
  if (in.num_ctas < 1) return Fail(S::kInvalidArgument, "num_ctas must be >= 1, got %lld", (long long)in.num_ctas);
  if (in.num_units < 1 || in.num_units > INT32_MAX)
    return Fail(S::kInvalidArgument, "num_units must be in [1, 2^31), got %lld", (long long)in.num_units);
  if (in.min_kv_chunk < 1)
    return Fail(S::kInvalidArgument, "min_kv_chunk must be >= 1 token, got %lld", (long long)in.min_kv_chunk);
  if (in.kv_chunk_align < 1)
    return Fail(S::kInvalidArgument, "kv_chunk_align must be >= 1 token, got %lld", (long long)in.kv_chunk_align);
  if (!(std::isfinite(in.cost_q) && in.cost_q >= 0.0) || !(std::isfinite(in.cost_kv) && in.cost_kv >= 0.0) ||
      !(std::isfinite(in.cost_item_min) && in.cost_item_min >= 0.0))
    return Fail(S::kInvalidArgument, "cost_q, cost_kv and cost_item_min must be finite and >= 0, got cost_q=%g "
                "cost_kv=%g cost_item_min=%g", in.cost_q, in.cost_kv, in.cost_item_min);
  if (in.force_kv_chunk > 0 && (in.force_kv_chunk % in.kv_chunk_align != 0 || in.force_kv_chunk < in.min_kv_chunk))
    return Fail(S::kInvalidArgument,
                "force_kv_chunk must be -1 (search), 0 (no split) or a multiple of kv_chunk_align=%lld that is >= "
                "min_kv_chunk=%lld, got %lld",
                (long long)in.kv_chunk_align, (long long)in.min_kv_chunk, (long long)in.force_kv_chunk);
  if (in.kv_window < 0)
    return Fail(S::kInvalidArgument, "kv_window must be >= 0 (0: no window), got %lld", (long long)in.kv_window);
  if (in.deterministic_pieces < 0)
    return Fail(S::kInvalidArgument, "deterministic_pieces must be >= 0 (0: off, 1: no split), got %lld",
                (long long)in.deterministic_pieces);
  if (in.deterministic_pieces > 0 && in.force_kv_chunk >= 0)
    return Fail(S::kInvalidArgument,
                "force_kv_chunk=%lld with deterministic_pieces=%lld: a deterministic plan's cuts come from each "
                "request alone, not from a forced candidate (use force_kv_chunk=-1)",
                (long long)in.force_kv_chunk, (long long)in.deterministic_pieces);
  if (in.force_kv_chunk < -1)
    return Fail(S::kInvalidArgument, "force_kv_chunk must be -1 (search), 0 (no split) or a chunk > 0, got %lld",
                (long long)in.force_kv_chunk);
  if (in.force_split_pairs < -1 || (in.force_split_pairs >= 0 && in.force_kv_chunk <= 0))
    return Fail(S::kInvalidArgument,
                "force_split_pairs must be -1 (as many as the budget allows) or >= 0 with force_kv_chunk > 0, got "
                "force_split_pairs=%lld with force_kv_chunk=%lld",
                (long long)in.force_split_pairs, (long long)in.force_kv_chunk);
  if (section.num_ctas < 1 || section.max_items < 0 || section.max_rows < 0 || section.max_partial_rows < 0)
    return Fail(S::kInvalidArgument,
                "plan section capacities must be num_ctas >= 1 and max_items, max_rows, max_partial_rows >= 0, got "
                "num_ctas=%lld max_items=%lld max_rows=%lld max_partial_rows=%lld",
                (long long)section.num_ctas, (long long)section.max_items, (long long)section.max_rows,
                (long long)section.max_partial_rows);
  const int64_t layout_ints = fi_plan_ints(section.num_ctas, section.max_items, section.max_rows);
  if (section.data == nullptr || section.num_ints < layout_ints)
    return Fail(S::kInvalidArgument,
                "the plan section holds %lld int32 but its layout (num_ctas=%lld, max_items=%lld, max_rows=%lld) needs "
                "%lld",
                (long long)section.num_ints, (long long)section.num_ctas, (long long)section.max_items,
                (long long)section.max_rows, (long long)layout_ints);
  if (in.tile_q > INT32_MAX || section.num_ctas > INT32_MAX || section.max_items > INT32_MAX ||
      section.max_rows > INT32_MAX || section.max_partial_rows > INT32_MAX)
    return Fail(S::kInvalidArgument, "tile_q and the plan section's capacities must fit in int32");
  if (in.num_ctas > section.num_ctas)
    return Fail(S::kCapacityExceeded, "num_ctas=%lld exceeds the plan section's num_ctas=%lld", (long long)in.num_ctas,
                (long long)section.num_ctas);

  // ---- requests -> (request, query tile) pairs -------------------------------------------------
  const int64_t B = in.num_requests;
  if (B > 0 && in.qo_indptr[0] != 0)
    return Fail(S::kInvalidArgument, "qo_indptr[0] must be 0, got %d", in.qo_indptr[0]);
  if (B == 0 && in.qo_indptr != nullptr && in.qo_indptr[0] != 0)
    return Fail(S::kInvalidArgument, "qo_indptr[0] must be 0, got %d", in.qo_indptr[0]);
  const int64_t num_rows = B > 0 ? in.qo_indptr[B] : 0;
  if (num_rows > section.max_rows)
    return Fail(S::kCapacityExceeded, "max_rows=%lld but the step has %lld query rows", (long long)section.max_rows,
                (long long)num_rows);
  // One pass validates each request (no division: this loop is per request). Rows beyond qo_indptr[B] are
  // refused before any pair is made, so pairs <= num_rows <= max_rows (plus shared chunks).
  for (int64_t i = 0; i < B; ++i) {
    const int32_t q0 = in.qo_indptr[i];
    const int64_t q_len = (int64_t)in.qo_indptr[i + 1] - q0;
    const int64_t kv_len = in.kv_lens[i];
    if (q_len < 0 || in.qo_indptr[i + 1] > num_rows)
      return Fail(S::kInvalidArgument, "qo_indptr must be non-decreasing, got qo_indptr[%lld]=%d > qo_indptr[%lld]=%d",
                  (long long)(q_len < 0 ? i : i + 1), in.qo_indptr[q_len < 0 ? i : i + 1],
                  (long long)(q_len < 0 ? i + 1 : B), in.qo_indptr[q_len < 0 ? i + 1 : B]);
    if (kv_len < 0)
      return Fail(S::kInvalidArgument, "kv_lens must be >= 0, got kv_lens[%lld]=%lld", (long long)i, (long long)kv_len);
    // Causal alignment needs the query to be a suffix of the KV; without it a query may be longer than
    // the KV it reads (e.g. new tokens against their cached prefix alone, merged with a second pass).
    if (in.causal && q_len > kv_len)
      return Fail(S::kInvalidArgument,
                  "request %lld has q_len=%lld > kv_len=%lld (causal: its query must be a suffix of its KV)",
                  (long long)i, (long long)q_len, (long long)kv_len);
  }
  // ---- shared-prefix groups: checked, then kept where they pay off (planner.h, PlanInputs::groups) ----
  if (in.num_groups < 0 || (in.num_groups > 0 && in.groups == nullptr))
    return Fail(S::kInvalidArgument, "num_groups must be >= 0 with a groups array, got %lld", (long long)in.num_groups);
  if (in.num_groups > 0 && (in.deterministic_pieces > 0 || in.kv_window > 0))
    return Fail(S::kInvalidArgument, "shared-prefix groups cannot be planned with deterministic_pieces=%lld or "
                "kv_window=%lld", (long long)in.deterministic_pieces, (long long)in.kv_window);
  const int64_t units_in = in.num_units;
  const int64_t m_lpt = units_in > 1 && in.num_ctas % units_in == 0 ? in.num_ctas / units_in : in.num_ctas;
  const int64_t lpt_units_in = units_in > 1 && in.num_ctas % units_in == 0 ? 1 : units_in;
  int64_t kept_groups = 0, group_partial_rows = 0;
  bool chunks_at_once = false;  // the chunks were cut for own items to follow them (FI_PLAN_CHUNKS_AT_ONCE)
  if (in.num_groups > 0) {
    group_of_.assign(B, -1);
    group_chunks_.assign(in.num_groups, 0);
    int64_t prev_end = 0;
    for (int64_t g = 0; g < in.num_groups; ++g) {
      const int64_t first = in.groups[3 * g], end = in.groups[3 * g + 1], len = in.groups[3 * g + 2];
      if (first < prev_end || end <= first || end > B)
        return Fail(S::kInvalidArgument, "group %lld: requests [%lld, %lld) must be non-empty, within the step's %lld "
                    "requests and after the previous group's (which ends at %lld)", (long long)g, (long long)first,
                    (long long)end, (long long)B, (long long)prev_end);
      if (len < 0)
        return Fail(S::kInvalidArgument, "group %lld: prefix length %lld must be >= 0", (long long)g, (long long)len);
      prev_end = end;
      int64_t member_tiles = 0;
      for (int64_t r = first; r < end; ++r) {
        const int64_t q_len = (int64_t)in.qo_indptr[r + 1] - in.qo_indptr[r];
        const int64_t cached = (int64_t)in.kv_lens[r] - (in.causal ? q_len : 0);
        if (len > cached)
          return Fail(S::kInvalidArgument, "group %lld: prefix length %lld exceeds request %lld's KV before its query "
                      "(kv_len=%d, q_len=%lld)", (long long)g, (long long)len, (long long)r, in.kv_lens[r],
                      (long long)q_len);
        member_tiles += q_len > 0 ? CeilDiv(q_len, in.tile_q) : 0;
      }
      const int64_t rows = (int64_t)in.qo_indptr[end] - in.qo_indptr[first];
      const int64_t tiles = CeilDiv(rows, in.tile_q);
      // KV read once per tile instead of once per member tile, against a partial state written and merged
      // for every row (two row costs).
      const double saved = in.cost_kv * (double)len * (double)(member_tiles - tiles);
      if (end - first < 2 || rows == 0 || len == 0 || !(saved > in.shared_gain * 2.0 * in.cost_q * (double)rows)) continue;
      group_chunks_[g] = -1;  // kept; chunks decided once the step's total cost is known
      for (int64_t r = first; r < end; ++r) group_of_[r] = (int32_t)g;
    }
  }
  // Pairs: each request's query tiles, and before a kept group's first member its shared tiles (whole, or
  // cut into group_chunks_ chunks once known); a member's own pairs start past the prefix.
  double total_cost = 0.0;
  auto build_pairs = [&]() {
    pairs_.clear();
    total_cost = 0.0;
    for (int64_t i = 0; i < B; ++i) {
      const int32_t q0 = in.qo_indptr[i];
      const int64_t q_len = (int64_t)in.qo_indptr[i + 1] - q0;
      const int64_t kv_len = in.kv_lens[i];
      const int32_t g = in.num_groups > 0 ? group_of_[i] : -1;
      int32_t prefix = 0, block = 0;
      if (g >= 0) {
        const int64_t len = in.groups[3 * g + 2], n = group_chunks_[g] > 0 ? group_chunks_[g] : 1;
        prefix = (int32_t)len;
        block = (int32_t)n + 1;
        if (i == in.groups[3 * g]) {
          const int32_t r0 = q0, r1 = in.qo_indptr[in.groups[3 * g + 1]];
          const ChunkShape shape(len, n, in.kv_chunk_align);
          for (int32_t t0 = r0; t0 < r1; t0 += (int32_t)in.tile_q) {
            const int32_t t1 = (int32_t)std::min<int64_t>(r1, t0 + in.tile_q);
            int64_t kv_begin = 0;
            for (int64_t c = 0; c < n; ++c) {
              const int64_t kv_end = kv_begin + shape.Size(c, n, in.kv_chunk_align);
              const double cost = ItemCost(in, t1 - t0, kv_end - kv_begin);
              pairs_.push_back(Pair{(int32_t)(i | FI_ITEM_SHARED), t0, t1, (int32_t)kv_end, cost, (int32_t)kv_begin,
                                    block, (int32_t)c});
              total_cost += cost;
              kv_begin = kv_end;
            }
          }
        }
      }
      for (int64_t tile_begin = 0; tile_begin < q_len; tile_begin += in.tile_q) {
        const int64_t tile_end = std::min(q_len, tile_begin + in.tile_q);  // relative to the request's first row
        // Causal, bottom-right aligned: query row j sees keys [0, kv_len - q_len + j], so the tile needs
        // keys [0, kv_len - q_len + tile_end).
        const int64_t len = in.causal ? kv_len - q_len + tile_end : kv_len;
        const int64_t rows = tile_end - tile_begin;
        const int64_t span = in.kv_window > 0 ? std::min(len, in.kv_window - 1 + rows) : len;  // KV it reads
        const double cost = ItemCost(in, rows, span - prefix);
        pairs_.push_back(Pair{(int32_t)i, (int32_t)(q0 + tile_begin), (int32_t)(q0 + tile_end), (int32_t)len, cost,
                              prefix, block, block - 1});
        total_cost += cost;
      }
    }
  };
  build_pairs();
  if (in.num_groups > 0) {
    // Chunks of each kept group's prefix: a chunk of a tile costs about a CTA's fair share of the step
    // (at least min_kv_chunk, aligned), at most kMaxSharedChunks; the groups' partial rows come out of what
    // the section has beyond the split budget, and a group that does not fit stays single-format.
    const double fair = total_cost * (double)lpt_units_in / (double)m_lpt;
    int64_t room = section.max_partial_rows - kMaxSplitItemsPerCta * CeilDiv(in.num_ctas, in.num_units) * in.tile_q;
    const int64_t align = in.kv_chunk_align, lo = RoundUp(in.min_kv_chunk, align);
    // ... and at least enough chunks that a chunk's CTA has room for an own item beside it: chunk work / chunk
    // pairs <= fair - an own item (LPT hands the chunks out first, then fills up with own items). A CTA's queue
    // is in creation order, so its own items run after its chunk and most often arrive last, each merging its
    // request's rows; a chunk arriving last merges its whole tile's rows alone, the tail of a step whose few
    // own items fill the CTAs without a chunk (16 requests x 8k, docs/composable.md).
    double chunk_work = 0.0, own_work = 0.0;
    int64_t shared_tiles = 0, own_pairs = 0;
    for (const Pair& q : pairs_) {
      if (q.block <= 0) continue;
      if (q.request & FI_ITEM_SHARED) chunk_work += q.cost, ++shared_tiles;
      else own_work += q.cost, ++own_pairs;
    }
    int64_t fill = 1;
    if (shared_tiles > 0 && own_pairs > 0 && fair - own_work / (double)own_pairs > 0.0) {
      fill = (int64_t)std::ceil(chunk_work / (fair - own_work / (double)own_pairs) / (double)shared_tiles);
      fill = std::min(fill, std::max<int64_t>(1, in.num_ctas / (shared_tiles * units_in)));  // a chunk a CTA at most
    }
    for (int64_t g = 0; g < in.num_groups; ++g) {
      if (group_chunks_[g] == 0) continue;
      const int64_t first = in.groups[3 * g], end = in.groups[3 * g + 1], len = in.groups[3 * g + 2];
      const int64_t rows = (int64_t)in.qo_indptr[end] - in.qo_indptr[first];
      const double tile_cost = ItemCost(in, std::min(rows, in.tile_q), len);
      const int64_t n_fair = fair > 0.0 ? (int64_t)std::ceil(tile_cost / fair) : 1;
      int64_t n = std::max(n_fair, fill);
      n = std::max<int64_t>(1, std::min<int64_t>(n, kMaxSharedChunks));
      const int64_t chunk = std::max(lo, RoundUp(CeilDiv(len, n), align));
      n = std::max<int64_t>(1, std::min(n, CeilDiv(len, chunk)));
      n = std::min(n, room / rows - 1);
      if (n < 1) {
        group_chunks_[g] = 0;
        for (int64_t r = first; r < end; ++r) group_of_[r] = -1;
        continue;
      }
      group_chunks_[g] = (int32_t)n;
      chunks_at_once = chunks_at_once || n > n_fair;
      room -= rows * (n + 1);
      group_partial_rows += rows * (n + 1);
      ++kept_groups;
    }
    build_pairs();
  }
  const int64_t num_pairs = (int64_t)pairs_.size();
  int64_t num_splittable = num_pairs;
  if (kept_groups > 0)
    for (const Pair& p : pairs_) num_splittable -= p.block > 0 ? 1 : 0;
  // The search sees the partial rows the groups leave.
  PlanSection search_section = section;
  search_section.max_partial_rows -= group_partial_rows;
  const int32_t units = (int32_t)in.num_units;
  // Every plan has at least one item per pair and unit.
  if (num_pairs * units > section.max_items)
    return Fail(S::kCapacityExceeded, "max_items=%lld but the plan needs %lld work items (%lld pairs x %d units)",
                (long long)section.max_items, (long long)(num_pairs * units), (long long)num_pairs, units);

  // Unit blocks: when the CTAs divide by the units, unit u runs on its own CTAs [u m', (u + 1) m'),
  // m' = num_ctas / units, all in one plan: LPT over the pairs on m' CTAs (makespan and split budget are
  // the replicated plan's), one pass over n items instead of n * units. Decode grids are made so
  // (wrappers.recommended_num_ctas), and on the H100 they measured best with it. Otherwise every (item,
  // unit) replica is placed on its own, over all the CTAs. `lin` holds the LPT's grid.
  const bool blocks = units > 1 && in.num_ctas % units == 0;
  PlanInputs lin = in;
  if (blocks) {
    lin.num_ctas = in.num_ctas / units;
    lin.num_units = 1;
  }
  const int32_t m = (int32_t)lin.num_ctas, lpt_units = (int32_t)lin.num_units;

  // ---- the unsplit plan: pairs by cost, descending (ties in creation order), then LPT ----------
  // Sorting the complemented cost bits ascending sorts the costs descending.
  keys_.resize(2 * num_pairs);
  for (int64_t j = 0; j < num_pairs; ++j) {
    keys_[2 * j] = ~CostBits(pairs_[j].cost);
    keys_[2 * j + 1] = (uint64_t)j;
  }
  const double unsplit_makespan = SortAndAssign(num_pairs, m, lpt_units);

  // ---- KV chunks: a fixed candidate, "no split" when already balanced, or the search -----------
  Split split;  // chunk 0: nothing split
  split.num_items = num_pairs;
  double lpt_makespan = unsplit_makespan;  // of the split chosen (when searched)
  const double bound = (double)lpt_units * total_cost / (double)m;
  const double good_enough = bound + std::max(kBalancedSlack * bound, in.cost_q);
  const bool det = in.deterministic_pieces > 0;
  if (det) {
    split = ChooseDeterministic(in, section, units, m, lpt_units, unsplit_makespan, good_enough, &lpt_makespan);
  } else if (num_splittable > 0 && in.force_kv_chunk != 0 &&
             (in.force_kv_chunk > 0 || (unsplit_makespan > good_enough && in.kv_window == 0))) {
    // Pairs by KV length, descending, ties in creation order: the order splits are handed out (a shared
    // group's fixed pairs are never split).
    keys_.resize(2 * num_splittable);
    for (int64_t j = 0, k = 0; j < num_pairs; ++j) {
      if (pairs_[j].block > 0) continue;
      keys_[2 * k] = ~(uint64_t)pairs_[j].kv_len;
      keys_[2 * k + 1] = (uint64_t)j;
      ++k;
    }
    RadixSortKeys(num_splittable);
    len_order_.resize(num_splittable);
    for (int64_t k = 0; k < num_splittable; ++k) len_order_[k] = (int32_t)keys_[2 * k + 1];
    chunks_of_.assign(num_pairs, 0);
    rank_.resize(num_pairs);
    for (int64_t k = 0; k < num_pairs; ++k) rank_[cost_order_[k]] = (int32_t)k;
    skip_.assign(num_pairs, 0);
    if (in.force_kv_chunk > 0) {
      split = WalkSplit(lin, in.force_kv_chunk, in.force_split_pairs);
      if (split.num_split_pairs == 0) split = Split{0, 0, 0, num_pairs, 0, 0};
    } else {
      split = ChooseSplit(lin, search_section, units, total_cost, unsplit_makespan, good_enough, &lpt_makespan);
    }
  }
  // ---- the partition, where one LPT pass serves every unit and LPT's plan is not balanced ----------
  double cap = 0.0, partition_makespan = 0.0;
  const bool partition = in.allow_partition && !det && lpt_units == 1 && !in.group_requests && in.kv_window == 0 &&
                         in.force_kv_chunk < 0 && num_pairs > 0 && lpt_makespan > good_enough &&
                         ChoosePartition(lin, section, units, total_cost, lpt_makespan, &cap, &partition_makespan);
  if (partition) split = FillWalk(lin, cap, true, &partition_makespan);
  const int64_t chunk = split.chunk;
  if (split.num_items * units > section.max_items)
    return Fail(S::kCapacityExceeded, "max_items=%lld but the plan needs %lld work items", (long long)section.max_items,
                (long long)(split.num_items * units));
  if (split.partial_rows + group_partial_rows > section.max_partial_rows)
    return Fail(S::kCapacityExceeded, "max_partial_rows=%lld but the plan needs %lld partial rows",
                (long long)section.max_partial_rows, (long long)(split.partial_rows + group_partial_rows));

  // ---- work items (nothing is written before this point) ---------------------------------------
  int32_t* const base = section.data;
  int32_t* const merge_indptr = base + fi_plan_merge_indptr_offset(section.num_ctas);
  int32_t* const split_rows = base + fi_plan_split_rows_offset(section.num_ctas, section.max_rows);
  const int64_t n_items = split.num_items;  // before replication: n_items * units are written
  int64_t num_split_rows = 0;
  double makespan = unsplit_makespan;
  if (in.group_requests && !det && split.num_split_pairs == 0 && num_pairs > 0) {
    // The chunk search compared LPT makespans; the plan itself goes request by request.
    keys_.resize(2 * num_pairs);
    entry_request_.resize(num_pairs);
    for (int64_t j = 0; j < num_pairs; ++j) {
      keys_[2 * j] = ~CostBits(pairs_[j].cost);
      keys_[2 * j + 1] = (uint64_t)j;
      entry_request_[j] = pairs_[j].request;
    }
    makespan = SortAndAssign(num_pairs, m, lpt_units, entry_request_.data());
  }
  // The items in LPT order: order[k] indexes items_ (split plan or partition) or pairs_ (unsplit plan);
  // the CTA of its replica for unit u is item_cta_[k * units + u].
  const int32_t* order = cost_order_.data();
  const bool grouped = kept_groups > 0;  // never with det (refused above)
  const bool from_items = partition || det || split.num_split_pairs > 0 || grouped;
  merge_indptr[0] = 0;
  if (partition) {
    // FillWalk left the items in creation order with their CTAs: LPT order is creation order here.
    num_split_rows = WriteMergeMap(n_items, merge_indptr, split_rows);
    cost_order_.resize(n_items);
    for (int64_t k = 0; k < n_items; ++k) cost_order_[k] = (int32_t)k;
    makespan = partition_makespan;
    order = cost_order_.data();
  } else if (split.num_split_pairs == 0 && !det && !grouped) {
    for (int64_t r = 0; r < num_rows; ++r) merge_indptr[r + 1] = 0;
  } else if (det) {  // items_ are the chosen candidate's (ChooseDeterministic)
    num_split_rows = WriteMergeMap(n_items, merge_indptr, split_rows);
    makespan = AssignItems(in, n_items, m, lpt_units);
    order = cost_order_.data();
  } else {
    for (int64_t i = 0; i < split.num_split_pairs; ++i) {
      const int32_t j = len_order_[i];
      chunks_of_[j] = (int32_t)CeilDiv(pairs_[j].kv_len, chunk);
    }
    // Creation order (request, tile, chunk).
    if ((int64_t)chunks_of_.size() < num_pairs) chunks_of_.resize(num_pairs, 0);  // no search ran (groups)
    items_.resize(n_items);
    Item* item = items_.data();
    const int64_t align = in.kv_chunk_align;
    for (int64_t j = 0; j < num_pairs; ++j) {
      const Pair& p = pairs_[j];
      const int32_t rows = p.q_end - p.q_begin;
      const int64_t n = chunks_of_[j];
      if (n == 0) {  // whole (no ChunkShape: its divisions per pair cost more than the rest of this loop)
        *item++ = Item{FiWorkItem{p.request, p.q_begin, p.q_end, p.kv_begin, p.kv_len, -1, 1, 0}, p.cost, p.block,
                       p.slot};
        continue;
      }
      const ChunkShape shape(p.kv_len, n, align);
      int64_t kv_begin = 0;
      for (int64_t c = 0; c < n; ++c) {
        const int64_t kv_end = kv_begin + shape.Size(c, n, align);
        *item++ = Item{FiWorkItem{p.request, p.q_begin, p.q_end, (int32_t)kv_begin, (int32_t)kv_end, -1, 1, 0},
                       ItemCost(in, rows, kv_end - kv_begin)};
        kv_begin = kv_end;
      }
    }
    for (int64_t i = 0; i < split.num_split_pairs; ++i) chunks_of_[len_order_[i]] = 0;
    num_split_rows = grouped ? WriteGroupMergeMap(n_items, num_rows, merge_indptr, split_rows)
                             : WriteMergeMap(n_items, merge_indptr, split_rows);

    makespan = AssignItems(in, n_items, m, lpt_units);
    order = cost_order_.data();
  }

  // ---- write: header, cta_indptr, items grouped by CTA, each CTA's in creation order ------------
  // LPT decides which CTA runs an item; the order within a CTA's queue changes no CTA's total, so it
  // is (request, query tile, chunk): a request's tiles back to back, shortest first, each re-reading
  // the KV prefix the tile before it read a moment ago (in L2) instead of after the rest of the
  // queue (longest first, the KV had long left L2: at 16 x 1k tokens, 32 heads, 1% of the loads hit).
  int32_t* const header = base;
  int32_t* const cta_indptr = base + fi_plan_cta_indptr_offset();
  FiWorkItem* const out_items =
      reinterpret_cast<FiWorkItem*>(base + fi_plan_items_offset(section.num_ctas, section.max_rows));
  const int64_t n_out = n_items * units;
  const int32_t grid = (int32_t)in.num_ctas;
  // The CTA of the k-th item's replica for unit u.
  auto cta_of = [&](int64_t k, int32_t u) {
    return blocks ? u * m + item_cta_[k] : item_cta_[k * units + u];
  };
  cta_fill_.assign(grid + 1, 0);
  int32_t* fill = cta_fill_.data();
  for (int64_t k = 0; k < n_items; ++k)
    for (int32_t u = 0; u < units; ++u) ++fill[cta_of(k, u) + 1];
  for (int32_t c = 0; c < grid; ++c) fill[c + 1] += fill[c];
  for (int32_t c = 0; c <= grid; ++c) cta_indptr[c] = fill[c];
  // CTAs the layout has beyond num_ctas get no items, so a kernel launched on the full grid is correct.
  for (int64_t c = grid + 1; c <= section.num_ctas; ++c) cta_indptr[c] = (int32_t)n_out;
  auto work_of = [&](int64_t i) {
    if (!from_items) {
      const Pair& p = pairs_[i];
      return FiWorkItem{p.request, p.q_begin, p.q_end, p.kv_begin, p.kv_len, -1, 1, 0};
    }
    return items_[i].work;
  };
  if (in.group_requests) {  // each CTA's queue in assignment order (seq_), so CTAs keep to the same requests
    const int64_t n_seq = n_items * lpt_units;
    for (int64_t q = 0; q < n_seq; ++q) {
      const int32_t r = seq_[q];
      const int64_t k = r / lpt_units;
      FiWorkItem work = work_of(order[k]);
      if (blocks) {
        for (int32_t u = 0; u < units; ++u) {
          work.unit = u;
          out_items[fill[cta_of(k, u)]++] = work;
        }
      } else {
        work.unit = r % lpt_units;
        out_items[fill[item_cta_[r]]++] = work;
      }
    }
  } else {  // creation order: item i is the rank_[i]-th in LPT order, whose replicas' CTAs cta_of gives
    rank_.resize(n_items);
    for (int64_t k = 0; k < n_items; ++k) rank_[order[k]] = (int32_t)k;
    for (int64_t i = 0; i < n_items; ++i) {
      const int64_t k = rank_[i];
      FiWorkItem work = work_of(i);
      for (int32_t u = 0; u < units; ++u) {
        work.unit = u;
        out_items[fill[cta_of(k, u)]++] = work;
      }
    }
  }

  for (int h = 0; h < FI_PLAN_HEADER_INTS; ++h) header[h] = 0;
  header[FI_PLAN_NUM_ITEMS] = (int32_t)n_out;
  header[FI_PLAN_NUM_ROWS] = (int32_t)num_rows;
  const int64_t partial_rows = split.partial_rows + group_partial_rows;
  header[FI_PLAN_NUM_PARTIAL_ROWS] = (int32_t)partial_rows;
  header[FI_PLAN_KV_CHUNK] = (int32_t)chunk;
  header[FI_PLAN_NUM_REQUESTS] = (int32_t)B;
  header[FI_PLAN_NUM_CTAS] = grid;
  header[FI_PLAN_CHUNKS_AT_ONCE] = chunks_at_once && kept_groups > 0 ? 1 : 0;
  header[FI_PLAN_TILE_Q] = (int32_t)in.tile_q;
  header[FI_PLAN_NUM_SPLIT_ROWS] = (int32_t)num_split_rows;
  header[FI_PLAN_NUM_UNITS] = units;

  summary->num_items = n_out;
  summary->num_rows = num_rows;
  summary->num_partial_rows = partial_rows;
  summary->kv_chunk = chunk;
  summary->num_split_rows = num_split_rows;
  summary->makespan = makespan;
  summary->num_split_pairs = split.num_split_pairs;
  summary->partition = partition;
  summary->deterministic = det;
  summary->num_shared_groups = kept_groups;
  return S::kOk;
}

}  // namespace fi
