"""The plan: load-balanced scheduling of a generation step (Algorithm 1 of the FlashInfer paper).

`plan_into` runs the C++ planner (csrc/scheduler/planner.cc, module `fi_backend._planner`) on the step's
query rows per request (qo_indptr) and KV lengths, and writes the plan in place into a plan section laid
out as csrc/plan.h describes: header, cta_indptr, merge_indptr, split_rows and work items grouped by CTA.
`PlanLayout` is the one Python copy of plan.h's offset formulas (tests compare it with the C values).

The planner cuts each request's rows into query tiles of tile_q rows; a (request, tile) pair reads KV
positions [0, kv_len) (causal, bottom-right aligned: [0, kv_len - q_len + tile_end)). Items (whole pairs
or KV chunks of split pairs) run once for each of num_units query-head groups (a KV head, or a chunk of
its query heads: the item's `unit`); these replicas are assigned heaviest first to the least loaded of
all num_ctas CTAs (LPT; cost = max(cost_item_min, cost_q * rows + cost_kv * KV tokens)), so one grid of all the GPU's CTAs
serves every head. Which pairs are split is chosen by search: a candidate (L, s) splits the s longest
pairs that are longer than L into ceil(len / L) chunks aligned to kv_chunk_align, never more than
MAX_SPLIT_ITEMS_PER_CTA * ceil(num_ctas / num_units) chunks in all (the workspace's partial-state bound;
a chunk's replicas share its partial rows, each writing its own heads); the planner
keeps the candidate with the lowest LPT makespan (ties: fewer items) among "no split", the previous
rule's chunk and a few chunks derived from the longest pair and the fair share of KV per CTA
(csrc/scheduler/planner.cc, ChooseSplit). When the unsplit plan is already within BALANCED_SLACK of the
lower bound num_units * total cost / num_ctas, or within cost_q (one query row's fixed cost) if that is more,
it is taken without a search. Split items write partial attention states, which the merge combines per row.
Where one LPT pass serves every unit and that plan is still over that margin above the bound, a partition (the
pairs filling CTA after CTA up to a cap, cut where it falls) replaces it when its makespan is strictly lower
(plan_into's partition, PlanInfo.kind).

A deterministic plan (plan_into's deterministic_pieces, docs/deterministic.md) replaces the search and the
partition: each request's KV is cut into pieces at the multiples of a chunk taken from its own length, so a
query row's pieces and the order they are folded in never depend on the rest of the step. A request runs
either whole (the kernel folds its pieces) or as one item per piece (merged by the same fold), whichever
balances the step better: the bits are the same.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from fi_backend import _planner, env

# Header ints (csrc/plan.h, enum FiPlanHeader).
HEADER_INTS = 16
(NUM_ITEMS, NUM_ROWS, NUM_PARTIAL_ROWS, KV_CHUNK, NUM_REQUESTS, NUM_CTAS, TILE_Q, NUM_SPLIT_ROWS, NUM_UNITS,
 CHUNKS_AT_ONCE) = range(10)
# FiWorkItem's int32 fields, in order.
ITEM_FIELDS = ("request", "q_begin", "q_end", "kv_begin", "kv_end", "partial_base", "partial_stride", "unit")
ITEM_INTS = len(ITEM_FIELDS)
ITEM_DTYPE = np.dtype([(name, np.int32) for name in ITEM_FIELDS])

# Default cost weights. Only their ratio matters. A query row moves its Q in and its O (or partial state)
# out: about 2 * head_dim values per query head; a KV token moves K and V: 2 * head_dim values per KV head.
# For multi-head attention that is the same traffic, hence 1 : 1; with a GQA group of g query heads per
# KV head a row moves g times more, so callers may pass cost_q = g. Compute scales the same way as
# traffic here because the kernel runs whole query tiles, so each KV token costs a tile's work.
DEFAULT_COST_Q = 1.0
DEFAULT_COST_KV = 1.0
# Split items per CTA of a unit's share a plan may have (the workspace's partial rows: 2 * ceil(num_ctas /
# num_units) * tile_q, appendix D)
# and the unsplit plan's tolerance over the lower bound below which no chunk search runs.
MAX_SPLIT_ITEMS_PER_CTA = _planner.MAX_SPLIT_ITEMS_PER_CTA
BALANCED_SLACK = _planner.BALANCED_SLACK
# Fill walks the partition's search for its cap takes at most, and the interval (relative to the lower
# bound) at which its bisection stops (plan_into's partition).
PARTITION_WALKS = _planner.PARTITION_WALKS
PARTITION_PRECISION = _planner.PARTITION_PRECISION
# Shared-prefix groups (plan_into's groups, docs/composable.md): a work item's request field with this bit
# is a shared-prefix item of the group that starts at that request; a kept group's prefix is cut into at most
# MAX_SHARED_CHUNKS chunks; a group is kept when the KV cost it saves exceeds SHARED_GAIN times the fixed
# cost of its rows' extra partial states.
ITEM_SHARED = _planner.ITEM_SHARED
MAX_SHARED_CHUNKS = _planner.MAX_SHARED_CHUNKS
SHARED_GAIN = _planner.SHARED_GAIN
# A decode step's groups move it to the prefill kernel (the adapters' graph_prefill), where each request's own item
# costs about as much as the decode kernel spends on this many shared KV tokens (read from L2 there: a whole query
# tile's MMAs, query copy and partial state for the item's one row; the family's smallest tile). Fitted on the
# H100: docs/composable.md, "The threshold, measured".
PREFILL_DECODE_ITEM_TOKENS = 500
# Smallest KV chunk a split produces: below ~128 tokens the fixed cost of an item (loading the query
# tile, filling the pipeline, writing and later merging a partial state) outweighs the extra parallelism.
DEFAULT_MIN_KV_CHUNK = 128
# Decode steps of so few (request, unit) pairs that the grid could cut each into more chunks than this plan with a
# chunk floor of the longest KV / this (at least DEFAULT_MIN_KV_CHUNK): the merge of a row's partial states (by the
# CTA that completes it) grows with their count (measured: docs/decode.md).
DECODE_MAX_CHUNKS = 32
# ... that floor kept within these bounds: 1 x 8192 and 2 x 4096 ran faster in chunks of 256 than of 128 (1 x 4096
# mixed), and 1 x 32k faster in 64 chunks of 512 than in 32 of 1024 (docs/decode.md).
DECODE_FEW_PAIRS_CHUNK = (256, 512)


def decode_min_kv_chunk(pairs: int, num_ctas: int, max_kv_len: int) -> int:
    """The decode planner's shortest split for a step of `pairs` (request, unit) pairs on num_ctas CTAs whose longest
    request has max_kv_len KV tokens: DEFAULT_MIN_KV_CHUNK, or max_kv_len / DECODE_MAX_CHUNKS within
    DECODE_FEW_PAIRS_CHUNK where the grid could cut every pair into more than DECODE_MAX_CHUNKS chunks."""
    if 0 < pairs * DECODE_MAX_CHUNKS < num_ctas:
        return max(DECODE_FEW_PAIRS_CHUNK[0], min(DECODE_FEW_PAIRS_CHUNK[1], -(-max_kv_len // DECODE_MAX_CHUNKS)))
    return DEFAULT_MIN_KV_CHUNK
# Deterministic plans (plan_into's deterministic_pieces): at most this many pieces per request, none
# shorter than DETERMINISTIC_MIN_CHUNK tokens (the normal plan's floor): one request alone then spreads over
# the grid as the normal plan would, while a large batch runs its requests whole, the kernel folding their
# pieces exactly as the merge of split pieces would (docs/deterministic.md).
DETERMINISTIC_PIECES = 16
DETERMINISTIC_MIN_CHUNK = DEFAULT_MIN_KV_CHUNK


def max_items_for(max_rows: int, num_ctas: int, max_units: int = 1, deterministic_pieces: int = 0) -> int:
    """Work items a plan section needs so that no candidate of the chunk search is ever skipped for room,
    for plans of up to max_units units: per unit, one per (request, query tile) pair (<= query rows) plus
    the extra chunks of split pairs (<= MAX_SPLIT_ITEMS_PER_CTA * ceil(num_ctas / units) of them, so
    <= MAX_SPLIT_ITEMS_PER_CTA * (num_ctas + units) over all units). With fewer, the search keeps to
    what fits and may balance worse; the unsplit plan only needs one item per pair and unit. Deterministic
    plans of up to deterministic_pieces pieces a pair need up to that many items per pair and unit."""
    return max_units * max_rows * max(1, deterministic_pieces) + MAX_SPLIT_ITEMS_PER_CTA * (num_ctas + max_units)


def max_partial_rows_for(num_ctas: int, min_units: int, max_tile_q: int, max_rows: int = 0,
                         deterministic_pieces: int = 0) -> int:
    """Partial rows (attention states of split chunks, each [num_qo_heads, head_dim]) a workspace needs for
    plans of at least min_units units and tiles of up to max_tile_q rows: the split-item budget
    MAX_SPLIT_ITEMS_PER_CTA * ceil(num_ctas / units) times the tile's rows (appendix D); with
    deterministic plans of up to deterministic_pieces pieces a row, also max_rows * deterministic_pieces
    (every row may be split, whatever the batch)."""
    budget = MAX_SPLIT_ITEMS_PER_CTA * (-(-num_ctas // min_units)) * max_tile_q
    return max(budget, max_rows * deterministic_pieces)


def _align4(n: int) -> int:
    return (n + 3) & ~3


@dataclass(frozen=True)
class PlanLayout:
    """Offsets of a plan section in int32 units (csrc/plan.h; this is the only Python copy)."""

    num_ctas: int
    max_items: int
    max_rows: int

    @property
    def cta_indptr_offset(self) -> int:
        return HEADER_INTS

    @property
    def merge_indptr_offset(self) -> int:
        return self.cta_indptr_offset + _align4(self.num_ctas + 1)

    @property
    def split_rows_offset(self) -> int:
        return self.merge_indptr_offset + _align4(self.max_rows + 1)

    @property
    def items_offset(self) -> int:
        return self.split_rows_offset + _align4(self.max_rows)

    def used_ints(self, num_items: int) -> int:
        """Int32 of the section a plan of num_items items uses: what a plan copies to the device."""
        return self.items_offset + num_items * ITEM_INTS

    @property
    def num_ints(self) -> int:
        return self.used_ints(self.max_items)

    @property
    def nbytes(self) -> int:
        return 4 * self.num_ints


class PlanViews:
    """numpy views of one plan section (a flat int32 array), made once and reused for every plan."""

    def __init__(self, section: np.ndarray, layout: PlanLayout, max_partial_rows: int):
        if section.dtype != np.int32 or section.ndim != 1 or not section.flags.c_contiguous:
            raise TypeError(f"section must be a flat C-contiguous int32 array, got {section.dtype} {section.shape}")
        if section.size < layout.num_ints:
            raise ValueError(f"section holds {section.size} int32 but {layout} needs {layout.num_ints}")
        self.section = section
        self.layout = layout
        self.max_partial_rows = int(max_partial_rows)
        L = layout
        self.header = section[:HEADER_INTS]
        self.cta_indptr = section[L.cta_indptr_offset:L.cta_indptr_offset + L.num_ctas + 1]
        self.merge_indptr = section[L.merge_indptr_offset:L.merge_indptr_offset + L.max_rows + 1]
        self.split_rows = section[L.split_rows_offset:L.split_rows_offset + L.max_rows]
        self.items = section[L.items_offset:L.num_ints].reshape(L.max_items, ITEM_INTS)

    @classmethod
    def allocate(cls, num_ctas: int, max_items: int, max_rows: int, max_partial_rows: int) -> "PlanViews":
        """Views over a fresh zeroed host array (tests and benchmarks; the workspace brings its own)."""
        layout = PlanLayout(num_ctas, max_items, max_rows)
        return cls(np.zeros(layout.num_ints, dtype=np.int32), layout, max_partial_rows)


class PlanInfo(NamedTuple):
    num_items: int
    num_rows: int
    num_partial_rows: int
    kv_chunk: int        # KV chunk size (tokens) of split pairs (a partition: its longest split piece); 0: no split
    num_split_rows: int
    makespan: float      # largest accumulated cost of a CTA
    num_split_pairs: int  # (request, query tile) pairs whose KV was split
    kind: str            # "lpt" (LPT over the chosen split), "partition" (the capped fill, plan_into's partition)
                         # or "deterministic" (LPT over plan_into's deterministic_pieces cuts); "idle": no items
                         # (Workspace.plan_idle)
    shared_groups: int = 0  # shared-prefix groups of plan_into's groups that run as shared items


def _host_int32(x, name: str):
    """An int32 host array the planner can read through the buffer protocol, without copying."""
    if type(x) is np.ndarray:
        return x  # dtype and contiguity are checked by the extension
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 CPU tensor, got {x.dtype} on {x.device}")
        return x.numpy()
    if isinstance(x, (list, tuple)):
        return np.asarray(x, dtype=np.int32)
    return x


def _groups_array(groups) -> np.ndarray:
    """plan_into's groups as a C-contiguous int32 [G * 3] array (no copy when it already is one)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(groups, torch.Tensor):
        if groups.device.type != "cpu":
            raise TypeError(f"groups must be on the CPU, got a tensor on {groups.device}")
        groups = groups.numpy()
    arr = np.ascontiguousarray(groups, dtype=np.int32)
    if arr.size and (arr.ndim != 2 or arr.shape[1] != 3):
        raise ValueError(f"groups must be [G, 3] (first request, end request, prefix tokens), got shape {arr.shape}")
    return arr.reshape(-1)


def plan_into(views: PlanViews, qo_indptr, kv_lens, *, tile_q: int, num_ctas: int, num_units: int = 1,
              causal: bool = False,
              min_kv_chunk: int = DEFAULT_MIN_KV_CHUNK, kv_chunk_align: int = 1,
              cost_q: float = DEFAULT_COST_Q, cost_kv: float = DEFAULT_COST_KV,
              force_kv_chunk: Optional[int] = None, force_split_pairs: Optional[int] = None,
              group_requests: bool = False, kv_window: int = 0, partition: Optional[bool] = None,
              deterministic_pieces: int = 0, groups=None, shared_gain: Optional[float] = None,
              cost_item_min: float = 0.0) -> PlanInfo:
    """Plan one step into `views` in place.

    qo_indptr: int32 [B + 1] (numpy array or CPU tensor), query rows of each request, qo_indptr[0] = 0.
    kv_lens: int32 [B], KV tokens of each request (its query rows are the last q_len of them).
    num_ctas: CTAs of the launch the items are spread over (<= the layout's num_ctas; CTAs beyond it get
    no items). num_units: query-head groups every item runs for (each (item, unit) is placed on its own). The chunk search only considers plans that fit the section's capacities, so a step fails
    only when even the unsplit plan does not fit: ValueError naming the bound (max_items, max_rows), or
    naming the invalid input; the section is then left untouched.
    force_kv_chunk / force_split_pairs (tests, tuning): skip the search and plan one candidate. 0 splits
    nothing; L > 0 (a multiple of kv_chunk_align, >= min_kv_chunk) splits the force_split_pairs longest
    pairs longer than L (None: as many as MAX_SPLIT_ITEMS_PER_CTA * ceil(num_ctas / num_units) chunks allow). A forced plan
    that does not fit raises ValueError naming max_items or max_partial_rows.
    group_requests (prefill): requests by total cost, each one's (unit, item) replicas back to back, to the
    least-loaded CTA in that order, and each CTA's queue in that order (csrc/scheduler/planner.h,
    PlanInputs::group_requests), instead of LPT over all items with queues in creation order.
    kv_window: the most KV positions a query row sees (a sliding window: window_left + 1; 0: no bound): a
    tile's cost counts at most kv_window - 1 + its rows of KV, and no pair is split unless forced.
    partition: may the partition replace the LPT plan (None: unless FI_BACKEND_PLAN_PARTITION=0)? The pairs in
    creation order fill CTA after CTA up to a cap of cost, cut where the cap falls (aligned, pieces of at least
    min_kv_chunk), the cap by bisection; considered only where one LPT pass serves every unit (num_units == 1,
    or num_ctas divisible by num_units), without group_requests, kv_window or a forced candidate, when LPT's
    makespan is over BALANCED_SLACK (or cost_q, if more) above the bound, and kept only when strictly lower
    (PlanInfo.kind says which plan it is; csrc/scheduler/planner.cc, ChoosePartition).
    deterministic_pieces (0: off): a deterministic plan. Each pair's KV is cut into pieces at the multiples of
    its request's chunk C, the smallest kv_chunk_align * 2^k >= ceil(kv_len / deterministic_pieces) and >=
    min_kv_chunk, from that request's kv_len alone. A pair runs whole (one item, partial_stride = C: the
    kernel folds the pieces) or as one item per piece (merged in piece order by the same fold): the s
    longest pairs of several pieces split, s = 0, 1, 2, 4, ... by LPT makespan; no chunk search, no
    partition, forced candidates refused; 1 splits nothing. A row's pieces and their fold then depend on its
    request only (docs/deterministic.md).
    groups (composable formats, docs/composable.md): None, or int32 [G, 3] rows (first request, end request,
    prefix tokens), ascending and disjoint: requests [first, end) share their first prefix tokens of KV
    (<= each member's KV before its query). A kept group's rows get shared-prefix items (request field
    first | ITEM_SHARED) reading the prefix once per query tile, cut into equal aligned chunks; its members'
    own items read KV [prefix, kv_len) unsplit; both write partial states merged per row. Groups whose saved
    KV does not pay for those states (SHARED_GAIN), or that do not fit the partial rows, stay single-format
    (PlanInfo.shared_groups counts the kept ones). Not with deterministic_pieces or kv_window; group_requests
    and the partition are off for a plan with groups. shared_gain: the verdict's factor (None:
    FI_BACKEND_PLAN_SHARED_GAIN, else SHARED_GAIN; 0 keeps every group that saves KV, for experiments).
    cost_item_min: the least an item costs, in KV tokens (0: no floor), whatever its rows and KV.
    """
    if partition is None:
        partition = env.flag(env.PLAN_PARTITION, True)
    if shared_gain is None:
        shared_gain = env.number(env.PLAN_SHARED_GAIN)
        shared_gain = SHARED_GAIN if shared_gain is None else shared_gain
    L = views.layout
    out = _planner.plan(views.section, L.num_ctas, L.max_items, L.max_rows, views.max_partial_rows,
                        _host_int32(qo_indptr, "qo_indptr"), _host_int32(kv_lens, "kv_lens"),
                        tile_q, num_ctas, num_units, causal, min_kv_chunk, kv_chunk_align, cost_q, cost_kv,
                        -1 if force_kv_chunk is None else force_kv_chunk,
                        -1 if force_split_pairs is None else force_split_pairs, bool(group_requests),
                        int(kv_window), bool(partition), int(deterministic_pieces),
                        None if groups is None else _groups_array(groups), float(shared_gain), float(cost_item_min))
    return PlanInfo._make(out)


def decode_groups_pay(groups, num_requests: int) -> bool:
    """Whether a decode step of num_requests requests with these shared-prefix groups (int [G, 3]: first request,
    end request, prefix tokens) belongs on the prefill kernel: the KV the groups save (each member after the first
    skips its prefix) exceeds PREFILL_DECODE_ITEM_TOKENS a request. Where it does not, the decode kernel runs the
    step faster (parallel sampling of short prompts: 8 requests sharing 160 tokens), with the groups its own
    verdict keeps."""
    g = np.asarray(groups, dtype=np.int64).reshape(-1, 3)
    saved = int(((g[:, 1] - g[:, 0] - 1) * g[:, 2]).sum())
    return saved > PREFILL_DECODE_ITEM_TOKENS * int(num_requests)


@dataclass
class DecodedPlan:
    """A plan section read back as plain numpy arrays (copies), for tests and debugging."""

    num_items: int
    num_rows: int
    num_partial_rows: int
    kv_chunk: int
    num_requests: int
    num_ctas: int
    tile_q: int
    num_split_rows: int
    num_units: int
    chunks_at_once: bool      # shared-prefix chunks arrive as they end (csrc/plan.h, FI_PLAN_CHUNKS_AT_ONCE)
    cta_indptr: np.ndarray    # int32 [num_ctas + 1]
    items: np.ndarray         # ITEM_DTYPE [num_items], grouped by CTA in run order
    item_cta: np.ndarray      # int32 [num_items], the CTA running each item
    merge_indptr: np.ndarray  # int32 [num_rows + 1]
    split_rows: np.ndarray    # int32 [num_split_rows]


def decode_plan(views: PlanViews) -> DecodedPlan:
    h = [int(v) for v in views.header[:10]]
    n_items, n_rows, n_ctas, n_split = h[NUM_ITEMS], h[NUM_ROWS], h[NUM_CTAS], h[NUM_SPLIT_ROWS]
    cta_indptr = views.cta_indptr[:n_ctas + 1].copy()
    items = views.items[:n_items].copy().view(ITEM_DTYPE).reshape(n_items)
    item_cta = np.repeat(np.arange(n_ctas, dtype=np.int32), np.diff(cta_indptr))
    return DecodedPlan(
        num_items=n_items, num_rows=n_rows, num_partial_rows=h[NUM_PARTIAL_ROWS], kv_chunk=h[KV_CHUNK],
        num_requests=h[NUM_REQUESTS], num_ctas=n_ctas, tile_q=h[TILE_Q], num_split_rows=n_split,
        num_units=h[NUM_UNITS], chunks_at_once=bool(h[CHUNKS_AT_ONCE]),
        cta_indptr=cta_indptr, items=items, item_cta=item_cta,
        merge_indptr=views.merge_indptr[:n_rows + 1].copy(), split_rows=views.split_rows[:n_split].copy())
