// The plan: what plan() writes on the host and run() reads on the device.
// Plain C layout shared by the planner (csrc/scheduler/), the kernels and fi_backend/workspace.py.
// Everything is int32 so one host-to-device copy moves it and a kernel reads it without conversion.
#pragma once
#include <stdint.h>

// One unit of work of the persistent kernel: query rows [q_begin, q_end) of `request` against that
// request's KV positions [kv_begin, kv_end) (logical positions within the request's KV, not slots).
// Query rows are global rows of the step's query tensor. A kernel clips kv_end to the request's
// actual KV length read on the device (a plan may be made from upper bounds), and an item whose
// range is then empty yields O = 0, LSE = -inf.
//
// unit: the query-head group the item is run for: KV head unit / num_head_chunks and query heads
// [unit * heads_per_chunk, (unit + 1) * heads_per_chunk). Every (request, query tile) pair is run for every
// unit of the launch, and the planner places the (item, unit) replicas over the whole grid (in blocks of
// CTAs per unit when the CTAs divide by the units: csrc/scheduler/planner.h), so one fixed grid of any
// size serves every head (queues per KV head left SMs idle when the CTAs did not divide by the heads).
//
// partial_base < 0: the item covers the request's whole KV for these rows ("write-through"): results
// go straight to the output rows.
// partial_base >= 0: the KV of these rows was split into partial_stride chunks; row r's partial state
// goes to partial row  partial_base + (r - q_begin) * partial_stride  of the workspace, and the merge
// combines partial rows [merge_indptr[r], merge_indptr[r + 1]) into output row r.
// Shared-prefix items (composable formats, docs/composable.md): request = the group's first request |
// FI_ITEM_SHARED; rows [q_begin, q_end) span consecutive requests of the group, KV [kv_begin, kv_end) is
// within the prefix they share (the first request's blocks), and every row sees all of it.
#define FI_ITEM_SHARED (1 << 30)

typedef struct FiWorkItem {
  int32_t request;
  int32_t q_begin;
  int32_t q_end;
  int32_t kv_begin;
  int32_t kv_end;
  int32_t partial_base;
  int32_t partial_stride;
  int32_t unit;
} FiWorkItem;

// The plan header: a fixed block of int32 at the start of the plan section.
enum FiPlanHeader {
  FI_PLAN_NUM_ITEMS = 0,         // work items written
  FI_PLAN_NUM_ROWS = 1,          // query rows of the step (merge_indptr has NUM_ROWS + 1 entries)
  FI_PLAN_NUM_PARTIAL_ROWS = 2,  // partial rows used in the workspace
  FI_PLAN_KV_CHUNK = 3,          // KV chunk size chosen (tokens); 0 when nothing was split
  FI_PLAN_NUM_REQUESTS = 4,
  FI_PLAN_NUM_CTAS = 5,          // CTAs the items were spread over (cta_indptr has NUM_CTAS + 1)
  FI_PLAN_TILE_Q = 6,            // query rows per tile
  FI_PLAN_NUM_SPLIT_ROWS = 7,    // rows whose KV was split (rows the merge must visit)
  FI_PLAN_NUM_UNITS = 8,         // query-head groups each pair is run for (FiWorkItem::unit)
  FI_PLAN_CHUNKS_AT_ONCE = 9,    // 1: shared-prefix chunks arrive as they end, before their CTA's own items
  FI_PLAN_HEADER_INTS = 16
};

// Plan section layout, in int32 units from its start (every array starts 16-byte aligned):
//   header        [FI_PLAN_HEADER_INTS]
//   cta_indptr    [num_ctas + 1]            items of CTA c are items[cta_indptr[c] .. cta_indptr[c + 1])
//   merge_indptr  [max_rows + 1]            partial rows of output row r, see FiWorkItem (the same for
//                                           every unit: a split item's replicas write their own heads)
//   split_rows    [max_rows]                the rows with partials, ascending (NUM_SPLIT_ROWS of them)
//   items         [max_items] FiWorkItem    grouped by CTA, in the order each CTA runs them
// Items come last: their capacity is units x query rows, and a plan copies only the prefix it used.
static inline int64_t fi_align4(int64_t n) { return (n + 3) & ~(int64_t)3; }
static inline int64_t fi_plan_cta_indptr_offset(void) { return FI_PLAN_HEADER_INTS; }
static inline int64_t fi_plan_merge_indptr_offset(int64_t num_ctas) {
  return fi_plan_cta_indptr_offset() + fi_align4(num_ctas + 1);
}
static inline int64_t fi_plan_split_rows_offset(int64_t num_ctas, int64_t max_rows) {
  return fi_plan_merge_indptr_offset(num_ctas) + fi_align4(max_rows + 1);
}
static inline int64_t fi_plan_items_offset(int64_t num_ctas, int64_t max_rows) {
  return fi_plan_split_rows_offset(num_ctas, max_rows) + fi_align4(max_rows);
}
// Int32 of the section a plan of num_items items uses (what plan() copies to the device).
static inline int64_t fi_plan_used_ints(int64_t num_ctas, int64_t max_rows, int64_t num_items) {
  return fi_plan_items_offset(num_ctas, max_rows) + num_items * (int64_t)(sizeof(FiWorkItem) / 4);
}
static inline int64_t fi_plan_ints(int64_t num_ctas, int64_t max_items, int64_t max_rows) {
  return fi_plan_used_ints(num_ctas, max_rows, max_items);
}
