// The load-balanced planner: Algorithm 1 of the FlashInfer paper (Ye et al., MLSys 2025), run on the
// host once per generation step. Framework-free C++17; the CPython binding is planner_py.cc.
//
// Input: the step's query rows per request (qo_indptr) and KV lengths. Each request's rows are cut into
// query tiles of tile_q rows; a (request, tile) "pair" reads KV positions [0, len) where len = kv_len,
// or with causal masking (bottom-right aligned) len = kv_len - q_len + tile_end. When there are fewer
// pairs than CTAs, long pairs are split into KV chunks so that the items fill the CTAs; items are then
// assigned longest-processing-time first to the least loaded CTA. The result is written in place into
// a plan section laid out as csrc/plan.h describes.
#pragma once

#include <cstdint>
#include <vector>

#include "plan.h"

namespace fi {

struct PlanInputs {
  const int32_t* qo_indptr = nullptr;  // [num_requests + 1], qo_indptr[0] == 0, non-decreasing
  const int32_t* kv_lens = nullptr;    // [num_requests], KV tokens of each request (its query is the suffix)
  int64_t num_requests = 0;
  int64_t tile_q = 1;          // query rows per tile, >= 1
  int64_t num_ctas = 1;        // CTAs of the persistent kernel per KV head, >= 1
  bool causal = false;
  int64_t min_kv_chunk = 1;    // smallest KV chunk (tokens) a split may produce, >= 1
  int64_t kv_chunk_align = 1;  // chunk boundaries are multiples of this (page size or KV tile), >= 1
  double cost_q = 1.0;         // cost of an item = cost_q * rows + cost_kv * KV tokens
  double cost_kv = 1.0;
};

// A caller-owned int32 buffer holding one plan section, laid out by csrc/plan.h for
// (num_ctas, max_items, max_rows). max_partial_rows bounds the workspace's partial attention states.
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
  int64_t kv_chunk = 0;  // 0 when nothing was split
  int64_t num_split_rows = 0;
  double makespan = 0.0;  // the largest accumulated cost of a CTA
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
    int32_t kv_len;   // effective KV length of the tile
  };
  struct Item {
    FiWorkItem work;
    double cost;
  };
  struct Slot {  // a CTA in the winner tree, ordered by (load, cta)
    uint64_t load;  // bits of the accumulated cost (a double >= 0: its bits order like its value)
    int32_t cta;
  };

  PlanStatus Fail(PlanStatus status, const char* fmt, ...);
  int64_t CountItems(int64_t chunk) const;

  std::vector<Pair> pairs_;
  std::vector<Item> items_;        // creation order: request, tile, chunk
  std::vector<uint64_t> keys_;     // sort keys, see planner.cc
  std::vector<uint64_t> keys_tmp_;
  std::vector<Slot> tree_;
  std::vector<int32_t> item_cta_;  // CTA of each item, in assignment order
  std::vector<int32_t> cta_fill_;
  char error_[512] = {0};
};

}  // namespace fi
