"""The workspace: one device buffer in fixed sections, written by plan() and read by run().

Sections, each starting 256-byte aligned, in this order:
  plan         int32, the plan (csrc/plan.h) for (num_ctas, max_items, max_tokens)
  partial_o    float32 [max_partial_rows, num_qo_heads, head_dim]  partial attention states of split KV
  partial_lse  float32 [max_partial_rows, num_qo_heads]
num_ctas is the kernels' whole grid: every CTA serves every head (a work item names its unit, the
query-head group it runs for: a KV head, or a chunk of its query heads, so num_kv_heads <= units <=
num_qo_heads). max_partial_rows = 2 * ceil(num_ctas / num_kv_heads) * max_tile_q, the paper's bound
(appendix D) for the CTAs of one unit's share: the planner never makes more than 2 * ceil(num_ctas /
units) split items, each of <= tile_q rows, whose replicas for all units share their partial rows.
With deterministic_pieces = P (deterministic plans, docs/deterministic.md: every row may be split into up to
P pieces, whatever the batch), also max_tokens * P partial rows and P items per query row and unit.

max_items = scheduler.max_items_for(max_tokens, num_ctas, num_qo_heads), which holds for every tile_q >= 1
and every unit count: per unit one item per (request, query tile) pair (pairs <= query rows <=
max_tokens) plus the extra chunks of split pairs, so the planner's chunk search is never cut short for
room. Items are the section's last array and a plan copies only the prefix it used.

Addresses and sizes never change after construction, so a run() captured in a CUDA graph stays valid
across plans: a new plan only rewrites the contents of the plan section. plan() writes into a host
staging buffer (pinned when CUDA is available) through numpy views made once, then issues one
asynchronous host-to-device copy of the used prefix of the plan section on the current stream (header,
cta_indptr, merge map and the plan's items: the device then holds exactly what the header describes). Before the next plan overwrites staging it waits on
an event recorded after that copy, since the copy engine may still be reading it.
"""
from __future__ import annotations

from typing import Optional

import torch

from fi_backend.scheduler import (DEFAULT_COST_KV, DEFAULT_COST_Q, DEFAULT_MIN_KV_CHUNK, NUM_CTAS, NUM_REQUESTS,
                                  NUM_ROWS, NUM_UNITS, TILE_Q, DecodedPlan, PlanInfo, PlanLayout, PlanViews,
                                  _host_int32, decode_plan, max_items_for, max_partial_rows_for, plan_into)

SECTION_ALIGN = 256


def _align(n: int, a: int = SECTION_ALIGN) -> int:
    return (n + a - 1) // a * a


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class Workspace:
    def __init__(self, device, *, max_requests: int, max_tokens: int, num_ctas: int, max_tile_q: int,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, pin_memory: Optional[bool] = None,
                 deterministic_pieces: int = 0, shared_prefix_rows: int = 0):
        self.device = torch.device(device)
        self.max_requests = _positive_int("max_requests", max_requests)
        self.max_tokens = _positive_int("max_tokens", max_tokens)
        self.num_ctas = _positive_int("num_ctas", num_ctas)
        self.max_tile_q = _positive_int("max_tile_q", max_tile_q)
        self.num_qo_heads = _positive_int("num_qo_heads", num_qo_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.head_dim = _positive_int("head_dim", head_dim)
        # deterministic plans of up to this many pieces a row (scheduler.plan_into's deterministic_pieces) may
        # split every row, whatever the batch: items and partial rows for all of them
        if isinstance(deterministic_pieces, bool) or not isinstance(deterministic_pieces, int) or deterministic_pieces < 0:
            raise ValueError(f"deterministic_pieces must be an int >= 0 (0: no deterministic plans), got "
                             f"{deterministic_pieces!r}")
        self.deterministic_pieces = deterministic_pieces
        self.max_items = max_items_for(max_tokens, num_ctas, num_qo_heads, deterministic_pieces)
        # shared-prefix groups (composable formats) take their rows' partial states beyond the split budget:
        # shared_prefix_rows more partial rows (SHARED_ROWS_PER_REQUEST a request: workspace_for)
        if isinstance(shared_prefix_rows, bool) or not isinstance(shared_prefix_rows, int) or shared_prefix_rows < 0:
            raise ValueError(f"shared_prefix_rows must be an int >= 0, got {shared_prefix_rows!r}")
        self.shared_prefix_rows = shared_prefix_rows
        self.max_partial_rows = max_partial_rows_for(num_ctas, num_kv_heads, max_tile_q, max_tokens,
                                                     deterministic_pieces) + shared_prefix_rows
        self.layout = PlanLayout(num_ctas, self.max_items, max_tokens)

        # Section offsets in bytes.
        self.plan_offset = 0
        self.partial_o_offset = _align(self.plan_offset + self.layout.nbytes)
        partial_o_bytes = 4 * self.max_partial_rows * num_qo_heads * head_dim
        self.partial_lse_offset = _align(self.partial_o_offset + partial_o_bytes)
        partial_lse_bytes = 4 * self.max_partial_rows * num_qo_heads
        self.nbytes = _align(self.partial_lse_offset + partial_lse_bytes)

        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.plan_section = self.buffer[self.plan_offset:self.plan_offset + self.layout.nbytes].view(torch.int32)
        self.partial_o = (self.buffer[self.partial_o_offset:self.partial_o_offset + partial_o_bytes]
                          .view(torch.float32).view(self.max_partial_rows, num_qo_heads, head_dim))
        self.partial_lse = (self.buffer[self.partial_lse_offset:self.partial_lse_offset + partial_lse_bytes]
                            .view(torch.float32).view(self.max_partial_rows, num_qo_heads))
        base = self.buffer.data_ptr()
        self.plan_ptr = base + self.plan_offset
        self.partial_o_ptr = base + self.partial_o_offset
        self.partial_lse_ptr = base + self.partial_lse_offset

        cuda = torch.cuda.is_available()
        if pin_memory is None:
            pin_memory = cuda
        if pin_memory and not cuda:
            raise ValueError("pin_memory=True needs CUDA, which is not available")
        self.staging = torch.zeros(self.layout.nbytes, dtype=torch.uint8, pin_memory=bool(pin_memory))
        self._staging_i32 = self.staging.view(torch.int32)
        self._views = PlanViews(self._staging_i32.numpy(), self.layout, self.max_partial_rows)
        self._copy_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self._copy_pending = False

    def plan(self, qo_indptr, kv_lens, *, tile_q: int, num_units: Optional[int] = None, causal: bool = False,
             min_kv_chunk: int = DEFAULT_MIN_KV_CHUNK, kv_chunk_align: int = 1,
             cost_q: float = DEFAULT_COST_Q, cost_kv: float = DEFAULT_COST_KV,
             group_requests: bool = False, kv_window: int = 0, deterministic_pieces: int = 0,
             partition: Optional[bool] = None, groups=None, num_ctas: Optional[int] = None,
             cost_item_min: float = 0.0) -> PlanInfo:
        """Plan a step (see fi_backend.scheduler.plan_into) and copy it into the plan section.

        qo_indptr: int32 [B + 1], kv_lens: int32 [B] (numpy arrays or CPU tensors). num_units: the
        query-head groups of the kernel that runs the plan (num_kv_heads * head chunks; None: num_kv_heads,
        one unit per KV head). groups: shared-prefix groups (scheduler.plan_into). Raises ValueError
        naming the workspace bound a step exceeds (max_requests, max_tokens, max_tile_q, num_units).
        num_ctas: the CTAs the items are spread over (None: all of the grid's num_ctas; the rest find their queues
        empty).
        """
        qo = _host_int32(qo_indptr, "qo_indptr")
        kv = _host_int32(kv_lens, "kv_lens")
        num_units = self._begin_step(int(qo[-1]) if len(qo) else 0, len(kv), tile_q, num_units)
        if num_ctas is None:
            num_ctas = self.num_ctas
        elif not 1 <= num_ctas <= self.num_ctas:
            raise ValueError(f"num_ctas must be in [1, {self.num_ctas}] (the workspace's grid), got {num_ctas}")
        info = plan_into(self._views, qo, kv, tile_q=tile_q, num_ctas=num_ctas, num_units=num_units,
                         causal=causal, min_kv_chunk=min_kv_chunk, kv_chunk_align=kv_chunk_align, cost_q=cost_q,
                         cost_kv=cost_kv, group_requests=group_requests, kv_window=kv_window,
                         deterministic_pieces=deterministic_pieces, partition=partition, groups=groups,
                         cost_item_min=cost_item_min)
        self._copy(self.layout.used_ints(info.num_items))
        return info

    def _begin_step(self, rows: int, requests: int, tile_q: int, num_units: Optional[int]) -> int:
        """Check a step against the workspace's bounds (ValueError naming the bound) and wait until staging is free
        (the previous plan's copy may still be reading it); returns num_units (None: num_kv_heads)."""
        if requests > self.max_requests:
            raise ValueError(f"max_requests={self.max_requests} but the step has {requests} requests")
        if rows > self.max_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} but the step has {rows} query rows")
        if tile_q > self.max_tile_q:
            raise ValueError(f"max_tile_q={self.max_tile_q} but tile_q={tile_q}")
        if num_units is None:
            num_units = self.num_kv_heads
        if not self.num_kv_heads <= num_units <= self.num_qo_heads:
            raise ValueError(f"num_units={num_units} must be in [num_kv_heads, num_qo_heads] = "
                             f"[{self.num_kv_heads}, {self.num_qo_heads}] (the sizes the workspace was made for)")
        if self._copy_pending:
            self._copy_done.synchronize()
            self._copy_pending = False
        return num_units

    def _copy(self, used: int) -> None:
        """Staging's first `used` int32 into the plan section: asynchronous on the current stream, with the event
        the next plan waits on before it overwrites staging."""
        if self._copy_done is None:
            self.plan_section[:used].copy_(self._staging_i32[:used])
        else:
            self.plan_section[:used].copy_(self._staging_i32[:used], non_blocking=True)
            self._copy_done.record(torch.cuda.current_stream(self.device))
            self._copy_pending = True

    def plan_idle(self, num_rows: int, num_requests: int, *, tile_q: int, num_units: Optional[int] = None) -> PlanInfo:
        """An idle plan: a step of num_rows query rows with no work items, so every CTA of a launch finds its
        queue empty and writes nothing (the partner of a wrapper that runs the step in the same CUDA graph).
        Copies only the header and cta_indptr, all the kernels read of a plan without items."""
        num_units = self._begin_step(num_rows, num_requests, tile_q, num_units)
        v = self._views
        v.header[:] = 0
        v.header[NUM_ROWS], v.header[NUM_REQUESTS], v.header[NUM_CTAS] = num_rows, num_requests, self.num_ctas
        v.header[TILE_Q], v.header[NUM_UNITS] = tile_q, num_units
        v.cta_indptr[:] = 0
        v.merge_indptr[:num_rows + 1] = 0   # host only: host_plan() reads it; no item sends the kernel there
        self._copy(self.layout.merge_indptr_offset)
        return PlanInfo(num_items=0, num_rows=num_rows, num_partial_rows=0, kv_chunk=0, num_split_rows=0,
                        makespan=0.0, num_split_pairs=0, kind="idle")

    def host_plan(self) -> DecodedPlan:
        """The last plan as written to staging, decoded (tests and debugging)."""
        return decode_plan(self._views)

    def __repr__(self) -> str:
        return (f"Workspace(device={self.device}, nbytes={self.nbytes}, num_ctas={self.num_ctas}, "
                f"num_qo_heads={self.num_qo_heads}, num_kv_heads={self.num_kv_heads}, "
                f"max_items={self.max_items}, max_tokens={self.max_tokens}, "
                f"max_partial_rows={self.max_partial_rows})")
