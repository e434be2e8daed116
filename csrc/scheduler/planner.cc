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

}  // namespace

PlanStatus Planner::Fail(PlanStatus status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(error_, sizeof(error_), fmt, args);
  va_end(args);
  return status;
}

// Items a chunk size produces: a pair longer than `chunk` becomes ceil(len / chunk) items; every other
// pair, an empty one included, one item.
int64_t Planner::CountItems(int64_t chunk) const {
  int64_t count = 0;
  for (const Pair& p : pairs_) count += p.kv_len > chunk ? CeilDiv(p.kv_len, chunk) : 1;
  return count;
}

PlanStatus Planner::Plan(const PlanInputs& in, const PlanSection& section, PlanSummary* summary) {
  using S = PlanStatus;
  error_[0] = '\0';
  // ---- arguments -------------------------------------------------------------------------------
  if (in.num_requests < 0)
    return Fail(S::kInvalidArgument, "num_requests must be >= 0, got %lld", (long long)in.num_requests);
  if (in.tile_q < 1) return Fail(S::kInvalidArgument, "tile_q must be >= 1, got %lld", (long long)in.tile_q);
  if (in.num_ctas < 1) return Fail(S::kInvalidArgument, "num_ctas must be >= 1, got %lld", (long long)in.num_ctas);
  if (in.min_kv_chunk < 1)
    return Fail(S::kInvalidArgument, "min_kv_chunk must be >= 1 token, got %lld", (long long)in.min_kv_chunk);
  if (in.kv_chunk_align < 1)
    return Fail(S::kInvalidArgument, "kv_chunk_align must be >= 1 token, got %lld", (long long)in.kv_chunk_align);
  if (!(std::isfinite(in.cost_q) && in.cost_q >= 0.0) || !(std::isfinite(in.cost_kv) && in.cost_kv >= 0.0))
    return Fail(S::kInvalidArgument, "cost_q and cost_kv must be finite and >= 0, got cost_q=%g cost_kv=%g", in.cost_q,
                in.cost_kv);
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
  // One pass validates each request and appends its pairs (no division: this loop is per request).
  // Rows beyond qo_indptr[B] are refused before their pairs are made, so pairs <= num_rows <= max_rows.
  pairs_.clear();
  int64_t max_len = 0;
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
    if (q_len > kv_len)
      return Fail(S::kInvalidArgument,
                  "request %lld has q_len=%lld > kv_len=%lld (its query must be a suffix of its KV)", (long long)i,
                  (long long)q_len, (long long)kv_len);
    for (int64_t tile_begin = 0; tile_begin < q_len; tile_begin += in.tile_q) {
      const int64_t tile_end = std::min(q_len, tile_begin + in.tile_q);  // relative to the request's first row
      // Causal, bottom-right aligned: query row j sees keys [0, kv_len - q_len + j], so the tile needs
      // keys [0, kv_len - q_len + tile_end).
      const int64_t len = in.causal ? kv_len - q_len + tile_end : kv_len;
      pairs_.push_back(Pair{(int32_t)i, (int32_t)(q0 + tile_begin), (int32_t)(q0 + tile_end), (int32_t)len});
      max_len = std::max(max_len, len);
    }
  }
  const int64_t num_pairs = (int64_t)pairs_.size();

  // ---- KV chunk size ---------------------------------------------------------------------------
  // With at least num_ctas pairs every CTA already has work: nothing is split. Otherwise take the
  // smallest chunk L (a multiple of kv_chunk_align, >= min_kv_chunk) with sum_p max(1, ceil(len_p / L))
  // <= num_ctas. Consequence: the items of split pairs number <= num_ctas, so the partial rows number
  // <= num_ctas * tile_q, within the paper's workspace bound 2 * num_ctas * tile_q (appendix D).
  int64_t chunk = 0;  // 0: nothing split
  if (num_pairs < in.num_ctas && num_pairs > 0) {
    const int64_t align = in.kv_chunk_align;
    int64_t lo = CeilDiv(in.min_kv_chunk, align);      // in units of align
    int64_t hi = std::max(lo, CeilDiv(max_len, align));  // here every pair is one item: count = num_pairs
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (CountItems(mid * align) <= in.num_ctas) hi = mid; else lo = mid + 1;
    }
    if (lo * align < max_len) chunk = lo * align;
  }

  // ---- counts and capacities (before writing anything) -----------------------------------------
  int64_t num_items = 0, num_partial_rows = 0, num_split_rows = 0;
  for (const Pair& p : pairs_) {
    const int64_t n = chunk > 0 && p.kv_len > chunk ? CeilDiv(p.kv_len, chunk) : 1;
    num_items += n;
    if (n > 1) {
      num_partial_rows += (int64_t)(p.q_end - p.q_begin) * n;
      num_split_rows += p.q_end - p.q_begin;
    }
  }
  if (num_items > section.max_items)
    return Fail(S::kCapacityExceeded, "max_items=%lld but the plan needs %lld work items", (long long)section.max_items,
                (long long)num_items);
  if (num_partial_rows > section.max_partial_rows)
    return Fail(S::kCapacityExceeded, "max_partial_rows=%lld but the plan needs %lld partial rows",
                (long long)section.max_partial_rows, (long long)num_partial_rows);

  // ---- work items, in creation order (request, tile, chunk) ------------------------------------
  int32_t* const base = section.data;
  int32_t* const merge_indptr = base + fi_plan_merge_indptr_offset(section.num_ctas, section.max_items);
  int32_t* const split_rows = base + fi_plan_split_rows_offset(section.num_ctas, section.max_items, section.max_rows);
  items_.resize(num_items);
  {
    Item* item = items_.data();
    int32_t partial = 0;  // partial rows handed out so far, also merge_indptr at the current row
    int32_t* split = split_rows;
    merge_indptr[0] = 0;
    const int64_t align = in.kv_chunk_align;
    for (const Pair& p : pairs_) {
      const int32_t rows = p.q_end - p.q_begin;
      const int64_t n = chunk > 0 && p.kv_len > chunk ? CeilDiv(p.kv_len, chunk) : 1;
      if (n == 1) {
        *item++ = Item{FiWorkItem{p.request, p.q_begin, p.q_end, 0, p.kv_len, -1, 1, 0},
                       in.cost_q * rows + in.cost_kv * p.kv_len};
        for (int32_t r = p.q_begin; r < p.q_end; ++r) merge_indptr[r + 1] = partial;
        continue;
      }
      // n chunks with aligned boundaries, as even as alignment allows: the whole units of align are
      // spread evenly (the first `rem` chunks get one more), the last chunk also takes the partial
      // unit. Every chunk is non-empty (n <= ceil(len / align)) and <= chunk.
      const int64_t whole = p.kv_len / align, rem = whole % n, per = whole / n;
      int64_t kv_begin = 0;
      for (int64_t c = 0; c < n; ++c) {
        const int64_t kv_end = c == n - 1 ? p.kv_len : kv_begin + (per + (c < rem ? 1 : 0)) * align;
        *item++ = Item{FiWorkItem{p.request, p.q_begin, p.q_end, (int32_t)kv_begin, (int32_t)kv_end,
                                  (int32_t)(partial + c), (int32_t)n, (int32_t)c},
                       in.cost_q * rows + in.cost_kv * (double)(kv_end - kv_begin)};
        kv_begin = kv_end;
      }
      // Row r of the pair owns partial rows [partial + (r - q_begin) * n, + n), in chunk order.
      for (int32_t r = p.q_begin; r < p.q_end; ++r) {
        partial += (int32_t)n;
        merge_indptr[r + 1] = partial;
        *split++ = r;
      }
    }
  }

  // ---- longest processing time first -----------------------------------------------------------
  // Sort by cost descending, ties in creation order: a stable LSD radix sort on the complemented cost
  // bits (ascending complement = descending cost), each key followed by its item index. Byte digits on
  // which all keys agree are skipped: integer-valued costs leave the low mantissa bytes zero, so a
  // decode batch takes two or three passes instead of eight (and no comparisons at all).
  const int64_t n_items = num_items;
  keys_.resize(2 * n_items);
  keys_tmp_.resize(2 * n_items);
  uint64_t* key = keys_.data();
  uint64_t* tmp = keys_tmp_.data();
  for (int64_t k = 0; k < n_items; ++k) {
    key[2 * k] = ~CostBits(items_[k].cost);
    key[2 * k + 1] = (uint64_t)k;
  }
  {
    uint64_t varying = 0;  // bits on which some key differs from the first
    for (int64_t k = 1; k < n_items; ++k) varying |= key[2 * k] ^ key[0];
    uint32_t hist[256];
    for (int d = 0; d < 8; ++d) {
      const int shift = 8 * d;
      if (((varying >> shift) & 0xff) == 0) continue;
      std::memset(hist, 0, sizeof(hist));
      for (int64_t k = 0; k < n_items; ++k) ++hist[(key[2 * k] >> shift) & 0xff];
      uint32_t sum = 0;
      for (int b = 0; b < 256; ++b) {
        const uint32_t c = hist[b];
        hist[b] = sum;
        sum += c;
      }
      for (int64_t k = 0; k < n_items; ++k) {
        const uint64_t v = key[2 * k];
        const uint32_t pos = hist[(v >> shift) & 0xff]++;
        tmp[2 * pos] = v;
        tmp[2 * pos + 1] = key[2 * k + 1];
      }
      std::swap(key, tmp);
    }
  }

  // Each item, heaviest first, to the CTA with the least accumulated cost (ties: lowest index). A winner
  // tree (a tournament) over the CTAs finds it: leaves are the CTAs' loads, padded to a power of two
  // with infinite loads, and each inner node holds the lighter of its two children, the left one on a
  // tie; as a left subtree holds only lower CTA indices than its right sibling, the root is the least
  // loaded CTA with the lowest index, exactly what a binary heap ordered by (load, cta) gives. An update
  // walks from the winner's leaf to the root, comparing with siblings whose addresses are known in
  // advance, so their loads overlap and the chain is one compare and two selects per level (a heap's
  // sift-down chases addresses that each depend on the previous comparison). Loads are kept as the
  // bits of non-negative doubles, which order like the values, so "<=" is "< bits + 1".
  const int32_t m = (int32_t)in.num_ctas;
  int32_t leaves = 1;
  while (leaves < m) leaves *= 2;
  tree_.resize(2 * (size_t)leaves);
  Slot* tree = tree_.data();  // node t has children 2t, 2t + 1; the leaf of CTA c is node leaves + c
  for (int32_t c = 0; c < leaves; ++c) tree[leaves + c] = Slot{CostBits(c < m ? 0.0 : HUGE_VAL), c};
  for (int32_t t = leaves - 1; t >= 1; --t)
    tree[t] = tree[2 * t + 1].load < tree[2 * t].load ? tree[2 * t + 1] : tree[2 * t];
  item_cta_.resize(n_items);
  for (int64_t k = 0; k < n_items; ++k) {
    const double cost = items_[key[2 * k + 1]].cost;
    const int32_t winner = tree[1].cta;
    item_cta_[k] = winner;
    uint64_t load = CostBits(LoadOf(tree[1].load) + cost);
    int32_t cta = winner;
    int32_t t = leaves + winner;
    tree[t].load = load;
    for (; t > 1; t >>= 1) {
      const uint64_t sib_load = tree[t ^ 1].load;
      const int32_t sib_cta = tree[t ^ 1].cta;
      // The sibling wins if lighter, or equal and on the left (t odd: we are the right child).
      const bool sib_wins = sib_load < load + (uint64_t)(t & 1);
      load = sib_wins ? sib_load : load;
      cta = sib_wins ? sib_cta : cta;
      tree[t >> 1] = Slot{load, cta};
    }
  }
  double makespan = 0.0;
  for (int32_t c = 0; c < m; ++c) makespan = std::max(makespan, LoadOf(tree[leaves + c].load));

  // ---- write: header, cta_indptr, items grouped by CTA in assignment order ---------------------
  int32_t* const header = base;
  int32_t* const cta_indptr = base + fi_plan_cta_indptr_offset();
  FiWorkItem* const out_items = reinterpret_cast<FiWorkItem*>(base + fi_plan_items_offset(section.num_ctas));
  cta_fill_.assign(m + 1, 0);
  int32_t* fill = cta_fill_.data();
  for (int64_t k = 0; k < n_items; ++k) ++fill[item_cta_[k] + 1];
  for (int32_t c = 0; c < m; ++c) fill[c + 1] += fill[c];
  for (int32_t c = 0; c <= m; ++c) cta_indptr[c] = fill[c];
  // CTAs the layout has beyond num_ctas get no items, so a kernel launched on the full grid is correct.
  for (int64_t c = m + 1; c <= section.num_ctas; ++c) cta_indptr[c] = (int32_t)n_items;
  for (int64_t k = 0; k < n_items; ++k) out_items[fill[item_cta_[k]]++] = items_[key[2 * k + 1]].work;

  for (int h = 0; h < FI_PLAN_HEADER_INTS; ++h) header[h] = 0;
  header[FI_PLAN_NUM_ITEMS] = (int32_t)n_items;
  header[FI_PLAN_NUM_ROWS] = (int32_t)num_rows;
  header[FI_PLAN_NUM_PARTIAL_ROWS] = (int32_t)num_partial_rows;
  header[FI_PLAN_KV_CHUNK] = (int32_t)chunk;
  header[FI_PLAN_NUM_REQUESTS] = (int32_t)B;
  header[FI_PLAN_NUM_CTAS] = m;
  header[FI_PLAN_TILE_Q] = (int32_t)in.tile_q;
  header[FI_PLAN_NUM_SPLIT_ROWS] = (int32_t)num_split_rows;

  summary->num_items = n_items;
  summary->num_rows = num_rows;
  summary->num_partial_rows = num_partial_rows;
  summary->kv_chunk = chunk;
  summary->num_split_rows = num_split_rows;
  summary->makespan = makespan;
  return S::kOk;
}

}  // namespace fi
