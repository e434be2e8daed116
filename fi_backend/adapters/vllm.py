"""fi-backend as vLLM 0.26's attention backend: `vllm serve MODEL --attention-backend CUSTOM`.

How vLLM finds it. pyproject.toml declares `register` below as an entry point of the group
`vllm.general_plugins`; vLLM calls it in every process it starts, and it registers the class path
BACKEND_CLASS_PATH as AttentionBackendEnum.CUSTOM. When a user selects CUSTOM, vLLM imports this
module and reads FiAttentionBackend from it. The three vLLM classes (FiAttentionBackend,
FiAttentionMetadataBuilder, FiAttentionImpl) subclass vLLM's abstract classes, so they are made on
first access (module __getattr__), from the plain classes _Backend, _MetadataBuilder and _Impl defined
here: importing this module, and calling register(), imports nothing of vLLM's beyond its registry.

The vLLM concepts, one class each:
  _Backend          what vLLM asks before it allocates anything: KV-cache shape (K and V packed in the
                    last dim, [num_blocks, block_size, num_kv_heads, 2 * head_size], read by strides),
                    supported head sizes / dtypes / block sizes, and why a model is refused.
  _MetadataBuilder  one per attention group: turns the step's CommonAttentionMetadata into a BSR over
                    vLLM's own persistent tensors and calls plan() once per step (_StepPlanner). Every
                    layer of the group then runs with that plan.
  _Impl             one per layer: writes the step's K/V into the paged cache (do_kv_cache_update) and
                    runs attention into vLLM's preallocated output.

Two kernels, each with its own wrapper and workspace: the decode kernel for steps where every request
has one query token, and the prefill kernel (FlashAttention-2 style, any mix of query lengths) for
every other step, mixed prefill + decode included (one plan, one launch per layer).

CUDA graphs: AttentionCGSupport.UNIFORM_BATCH. vLLM captures uniform batches (pure decode, or
1 + k tokens per request with speculative decoding) in full graphs and runs mixed batches piecewise,
attention eager. A captured run() stays correct after later plans because the plan lives in fixed
workspace sections and the BSR arrays are vLLM's persistent buffers (query_start_loc, seq_lens,
block tables) plus kv_block_start, which is allocated here once and sliced. Padded requests of a
captured batch have no query rows and a KV length of 0, so they read nothing and write nothing; the
output rows of padding tokens are left as they are (vLLM discards them).

Shared-prefix groups (docs/composable.md): from a host copy of the step's block table, which vLLM 0.26 gives build()
only through the opt-in worker (vllm_worker.py: `--worker-cls fi_backend.adapters.vllm_worker.Worker`, which
publishes it per step, publish_step_tables), or from the V1 runner's cascade prefix. With the worker each group
has a third wrapper, graph_prefill (the prefill kernel): a decode step whose groups pay for it (decode_groups_pay)
and that the planner keeps runs on it, with the decode wrapper planned idle; else the decode wrapper runs it with the
groups for its own verdict and graph_prefill is idle; a decode graph launches both into one output. Without the
worker or V1's cascade no groups come, and the workspaces hold no shared rows.

Batch invariance (VLLM_BATCH_INVARIANT=1, or FI_BACKEND_DETERMINISTIC=1): both wrappers plan deterministically
(docs/deterministic.md) and a mixed step runs in two launches, its decodes (vLLM puts them first:
reorder_batch_threshold = 1) on the decode kernel and the rest on the prefill kernel, so a request's kernel
depends on its own query length only, never on its companions.

Prefill on Hopper (fi_backend/cute_member.py): the prefill wrapper runs FlashAttention-3's CTA for the steps it takes.
A mixed step that it would take without its decodes, and not with them, runs in the same two launches (split_mixed):
the decodes on the decode kernel, the rest on the member. Steps of new prompts only (no cached token; after a mixed
step's leading decodes too) run on a third wrapper, fresh: a ragged prefill wrapper (BatchAttention(ragged=True))
whose member reads forward's own key / value rows, one TMA box a KV tile, where the cache's pages of 16 cost it
3-13% (docs/prefill.md, "New prompts on their own K / V"). FI_BACKEND_PREFILL_FRESH=0 turns it off; layers that share
another layer's KV cache (no key / value in forward) and batch invariance keep every step on the cache.

Encoder-only layers (BERT-like embedding and scoring models; vLLM's EncoderOnlyAttentionSpec group, no KV cache):
their builder makes one ragged prefill wrapper and plans each step non-causal over the step's own rows
(_EncoderPlanner): forward reads key / value, the CuTe member where it applies, the tile family otherwise. Each
prompt runs whole in one step (vLLM turns chunked prefill and prefix caching off for these models; fi-backend refuses
either at start-up where it could split a prompt or reuse a prefix). No CUDA graphs (AttentionCGSupport.NEVER: the
prompts' sizes change every step). Two-sided sliding windows and ALiBi are refused.

No GPU-to-CPU synchronisation per step: the plan is made from query_start_loc_cpu and
seq_lens_cpu_upper_bound (an upper bound is enough: the kernels read the true lengths from seq_lens on
the device and clip to them; the schedule is at worst slightly pessimistic).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from fi_backend import cute_member as _cute_member
from fi_backend import env as _env
from fi_backend import ops as _ops
from fi_backend import variants as _variants
from fi_backend.adapters import RaggedRows, plan_decode_step, rank_device, whole_prompts_refusal
from fi_backend.formats import BSR, prefix_groups_from_table
from fi_backend.wrappers import HEAD_DIMS

__all__ = ["register", "BACKEND_NAME", "BACKEND_CLASS_PATH", "FiAttentionMetadata", "layer_variant", "plan_counts",
           "check_errors"]

BACKEND_NAME = "CUSTOM"                                # vLLM 0.26 has no other way to add a backend name
BACKEND_CLASS_PATH = f"{__name__}.FiAttentionBackend"  # what register() hands to vLLM's register_backend
ENTRY_POINT_GROUP = "vllm.general_plugins"

HEAD_SIZES = HEAD_DIMS                                 # the kernels' (fi_backend.wrappers)
DTYPES = (torch.bfloat16, torch.float16)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3")  # "fp8" is e4m3 on CUDA
ATTN_TYPES = ("decoder", "encoder_only")   # vLLM's AttentionType values fi-backend runs
MAX_BLOCK_SIZE = 256                                   # the kernels' largest page (KV block width Bc)
# vLLM gives sliding-window layers the smallest kernel block a backend lists; pages of 16 let those layers' prefill
# run on the CuTe member (TMA boxes of whole pages) as FLASH_ATTN's do, where pages of 1 left them the tile family
MIN_BLOCK_SIZE = 16
# Hopper (sm_90a: warpgroup MMAs, TMA) and Ampere / Ada (mma.sync: A100, A10, L40S, RTX 4090)
COMPUTE_CAPABILITIES = ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0))
_FP8_DTYPE = torch.float8_e4m3fn

_VLLM_CLASSES = ("FiAttentionBackend", "FiAttentionMetadataBuilder", "FiAttentionImpl")
# A child of vLLM's "vllm" logger, so messages go through vLLM's handler and level.
_log = logging.getLogger("vllm.fi_backend")
_logged_active = False
_warned_unordered = False
_PLAN_COUNTS = {"decode": 0, "prefill": 0, "grouped_decode": 0, "grouped_extend": 0, "cute": 0, "fresh": 0,
                "encoder_only": 0}
_wrappers = weakref.WeakSet()   # every BatchAttention this process made, for check_errors()
_define_lock = threading.Lock()  # the vLLM classes are made once: vLLM compares them by identity
# Host block tables for shared-prefix groups, published by the opt-in worker (adapters/vllm_worker.py): its V2
# runner says so before its metadata builders are made (_table_provider), each builder that will read them counts
# itself (_table_readers), and each step's rows go to this thread's build() calls (_STEP_TABLES).
_STEP_TABLES = threading.local()
_table_provider = False
_table_readers = 0


# ------------------------------------------------------------------------------------ registration

def register() -> None:
    """Register fi-backend as AttentionBackendEnum.CUSTOM (vLLM's `vllm.general_plugins` hook).

    Idempotent and cheap (vLLM calls it in every process, sometimes twice); silent unless it fails.
    Without vLLM installed it raises ImportError: only vLLM calls it. With a vLLM that has no CUSTOM
    slot, or whose CUSTOM slot another plugin already took, it logs a warning and leaves vLLM as it
    is, so an installed but unused fi-backend never stops vLLM from starting."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError("fi_backend.adapters.vllm.register() is vLLM's plugin hook (entry point group "
                          f"{ENTRY_POINT_GROUP}); it needs vLLM 0.26 installed, and vllm is not importable")
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as e:
        _log.warning("fi-backend: not registered: this vLLM has no attention-backend registry "
                     "(vllm.v1.attention.backends.registry: %s); fi-backend supports vLLM 0.26", e)
        return
    custom = getattr(AttentionBackendEnum, BACKEND_NAME, None)
    if custom is None:
        _log.warning("fi-backend: not registered: this vLLM's AttentionBackendEnum has no %s member; "
                     "fi-backend supports vLLM 0.26", BACKEND_NAME)
        return
    if custom.is_overridden():
        current = custom.get_path()
        if current != BACKEND_CLASS_PATH:
            _log.warning("fi-backend: not registered: AttentionBackendEnum.%s is already registered to %s "
                         "by another plugin", BACKEND_NAME, current)
        return
    register_backend(custom, BACKEND_CLASS_PATH)


def __getattr__(name: str) -> Any:
    """Make the vLLM classes on first access (this is how vLLM's resolve_obj_by_qualname reaches them)."""
    if name in _VLLM_CLASSES:
        with _define_lock:
            if name not in globals():
                _define_vllm_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_vllm_classes() -> None:
    try:
        from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,
                                               AttentionMetadataBuilder)
    except ImportError as e:
        raise ImportError(f"{__name__}.{{{', '.join(_VLLM_CLASSES)}}} subclass vLLM's attention classes and need "
                          f"vLLM 0.26 installed ({e})") from e
    made = {
        "FiAttentionBackend": (_Backend, AttentionBackend, {}),
        "FiAttentionMetadataBuilder": (_MetadataBuilder, AttentionMetadataBuilder,
                                       {"_cudagraph_support": AttentionCGSupport.UNIFORM_BATCH}),
        "FiAttentionImpl": (_Impl, AttentionImpl, {}),
    }
    for name, (ours, theirs, extra) in made.items():
        # Ours first in the MRO, so it overrides vLLM's defaults; __module__ and the type() name make
        # the qualified name vLLM stores and re-imports BACKEND_CLASS_PATH-style paths by.
        globals()[name] = type(name, (ours, theirs), {"__module__": __name__, "__doc__": ours.__doc__, **extra})


def _vllm_class(name: str) -> type:
    return globals()[name] if name in globals() else __getattr__(name)


def plan_counts() -> dict:
    """Plans made in this process per kernel, {"decode": n, "prefill": m, ...} (tests and debugging). grouped_decode /
    grouped_extend: decode / other steps whose plan kept at least one shared-prefix group; a decode step run on
    graph_prefill counts as a prefill plan; cute: prefill plans the CuTe member took."""
    return dict(_PLAN_COUNTS)


def provide_step_tables(on: bool = True) -> None:
    """Say that this process's model runner publishes host block tables every step (publish_step_tables): metadata
    builders made after it, with shared prefixes on, add the graph_prefill wrapper for grouped decode steps. Called
    by adapters/vllm_worker.py's runner before vLLM makes its builders."""
    global _table_provider
    _table_provider = bool(on)


def _add_table_reader() -> None:
    global _table_readers
    _table_readers += 1


def step_table_readers() -> int:
    """How many metadata builders of this process read the published tables (0: publishing would be wasted)."""
    return _table_readers


class StepRows(NamedTuple):
    """A step's host block-table rows without a copy: request i (batch order) holds row rows[i] of table."""

    table: Any      # int32 numpy [max requests, blocks], by request index
    rows: Any       # int numpy [num_reqs]


def publish_step_tables(tables: Optional[dict]) -> None:
    """This step's host block tables for the build() calls that follow on this thread: {data_ptr of the device
    block table vLLM hands build() (block_table_tensor): StepRows}. None clears them (after the step, so that no
    later build() reads a stale table)."""
    _STEP_TABLES.tables = tables


def _step_table(block_table):
    tables = getattr(_STEP_TABLES, "tables", None)
    return None if tables is None else tables.get(block_table.data_ptr())


def check_errors() -> None:
    """Raise RuntimeError if an fi-backend kernel of this process met an out-of-range KV block index or
    KV slot since the last check. Synchronises the GPU: for tests and debugging, never per step."""
    for wrapper in list(_wrappers):
        wrapper.check_errors()
    _ops.check_append_errors()


def _log_active(settings: "_GroupSettings", page_size: int, num_layers: int, where: str) -> None:
    global _logged_active
    if not _logged_active:
        _logged_active = True
        _log.info("fi-backend attention is active (vLLM backend %s) on %s: %d layers, %d query / %d KV heads, head_dim "
                  "%d, page %d, KV %s, variant %s; decode + prefill kernels, one plan per step; CUDA graphs for "
                  "uniform (decode) batches", BACKEND_NAME, where, num_layers, settings.num_qo_heads, settings.num_kv_heads,
                  settings.head_dim, page_size, settings.kv_cache_dtype, settings.variant.name)


# ------------------------------------------------------------------------------------ variants

def layer_variant(alibi_slopes=None, sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None):
    """(variant, plan parameters) of a vLLM attention layer's settings.

    sliding_window is vLLM's: a query attends to itself and the sliding_window - 1 tokens before it,
    i.e. fi_backend's window_left = sliding_window - 1. logits_soft_cap None or 0 means none (as in
    FlashAttention). ALiBi slopes are kept as a tuple (the builder puts them on the device once)."""
    parts, params = [], {}
    if logits_soft_cap:
        parts.append(_variants.SOFT_CAP)
        params["logits_soft_cap"] = float(logits_soft_cap)
    if alibi_slopes is not None:
        parts.append(_variants.ALIBI)
        params["alibi_slopes"] = tuple(float(s) for s in (alibi_slopes.tolist() if isinstance(alibi_slopes, torch.Tensor)
                                                           else alibi_slopes))
    if sliding_window is not None:
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        parts.append(_variants.SLIDING_WINDOW)
        params["window_left"] = int(sliding_window) - 1
    if not parts:
        return _variants.DEFAULT, params
    return (parts[0] if len(parts) == 1 else _variants.combine(*parts)), params


# ------------------------------------------------------------------------------------ per-step plan

@dataclass
class FiAttentionMetadata:
    """One step's attention metadata, shared by every layer of an attention group."""

    wrapper: Any                 # the BatchAttention planned for this step (decode or prefill kernel)
    num_rows: int                # query rows the plan covers; rows past it are CUDA-graph padding
    num_actual_tokens: int       # as vLLM counts them (may include padding)
    max_query_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    # Batch invariance, mixed step: rows [0, num_decode_rows) are the step's decodes, planned on this
    # decode wrapper; `wrapper` (prefill) covers rows [num_decode_rows, num_rows).
    decode_wrapper: Any = None
    num_decode_rows: int = 0
    # `wrapper` is the ragged one (fresh): it reads the step's own K / V (forward's key / value rows from
    # num_decode_rows on), not the cache
    fresh: bool = False
    # A CUDA-graph capture of a decode step with graph_prefill: the other wrapper, planned idle (no items); forward
    # launches it after `wrapper` into the same output, so the graph holds both launches (None: run `wrapper` only).
    partner: Any = None


class _StepPlanner:
    """The per-step half of the metadata builder: CommonAttentionMetadata -> BSR -> plan().

    It only reads vLLM's metadata fields, so it is tested without vLLM. The BSR is made of views: the
    engine's query_start_loc (qo_indptr), seq_lens (kv_lens) and block table (kv_indices, a flat view
    over the table's whole buffer), and kv_block_start, this planner's own arange(rows) * row_stride
    made once per block-table buffer. Their addresses never change between steps, which is what a
    captured run() needs (the wrapper refuses a plan with other addresses after a capture)."""

    def __init__(self, decode, prefill, *, page_size: int, sm_scale: float, variant_params: dict,
                 debug: bool = False, deterministic: bool = False, shared_prefix: bool = False, graph_prefill=None,
                 split_mixed: bool = False, fresh=None):
        self.decode, self.prefill = decode, prefill
        # A ragged prefill wrapper (BatchAttention(ragged=True)) for steps whose prefill requests have no cached
        # tokens: its CuTe member reads forward's key / value rows (a KV tile one TMA box) where the cache's pages of
        # 16 cost it 3-13% (docs/prefill.md, "New prompts on their own K / V"). None: every step reads the cache.
        self.fresh = fresh
        self._fresh_rows = RaggedRows()
        # Mixed steps in two launches where the prefill part then goes to the prefill wrapper's CuTe member
        # (BatchAttention.cute_takes) and the whole step would not: the decode rows on the decode kernel (GQA
        # packed), not a 128-row tile each a query head. Needs the decodes first (reorder_batch_threshold = 1).
        self.split_mixed = split_mixed
        # The prefill kernel for decode steps whose groups the planner keeps (docs/composable.md); its own
        # workspace, since a capture freezes a wrapper's tile member and BSR. None: decode steps on `decode` only.
        self.graph_prefill = graph_prefill
        self.deterministic = deterministic
        self.shared_prefix = shared_prefix and not deterministic  # composable formats (docs/composable.md)
        self._qo_rest = None        # deterministic mixed steps: the prefill part's qo_indptr, rebased to 0
        self.page_size = page_size
        self.sm_scale = sm_scale
        self.variant_params = variant_params
        self.debug = debug
        self._table_key = None      # (data_ptr, row stride) of the block-table buffer bound below
        self._kv_indices = None
        self._kv_block_start = None

    def _prefix_groups(self, cm, qo_cpu, kv_cpu, common_prefix_len: int):
        """The step's shared-prefix groups, from host data only (no device sync): a host copy of the step's block
        table where the runner provides one (cm.block_table_cpu, or the rows the opt-in worker published for this
        block table: consecutive requests with identical leading block ids, any number of groups), else vLLM's
        cascade prefix common to the whole batch (common_prefix_len, computed by the V1 runner from its host block
        table). Rows past the host table's (CUDA-graph padding) are in no group. None: single-format."""
        n = cm.num_reqs
        if not self.shared_prefix or n < 2:
            return None
        cached = kv_cpu - (qo_cpu[1:] - qo_cpu[:-1])
        table, rows = getattr(cm, "block_table_cpu", None), None
        if table is None:
            step = _step_table(cm.block_table_tensor)
            if step is not None:
                table, rows = step.table, step.rows
        if table is not None:
            m = min(int(table.shape[0] if rows is None else len(rows)), n)
            if rows is None:
                groups = prefix_groups_from_table(table[:m], cached[:m], self.page_size)
            else:
                groups = prefix_groups_from_table(table, cached[:m], self.page_size, rows=rows[:m])
            return groups if len(groups) else None
        if common_prefix_len:
            plen = min(int(common_prefix_len), int(cached.min())) // self.page_size * self.page_size
            return [[0, n, plen]] if plen > 0 else None
        return None

    def plan(self, cm, common_prefix_len: int = 0, capture: bool = False) -> FiAttentionMetadata:
        """capture: a CUDA-graph capture (or its warm-up), planned without groups; with graph_prefill both decode
        wrappers launch (one idle), so that the graph holds both."""
        if cm.causal is not True:
            raise NotImplementedError(f"fi-backend runs causal decoder attention only (got causal={cm.causal!r})")
        n = cm.num_reqs
        qo_cpu = cm.query_start_loc_cpu[: n + 1]
        kv_cpu = getattr(cm, "seq_lens_cpu_upper_bound", None)
        if kv_cpu is not None:
            kv_cpu = kv_cpu[:n]
        else:  # an upper bound without a sync: every request at the step's longest context
            kv_cpu = torch.full((n,), cm.max_seq_len, dtype=torch.int32)
        if cm.max_query_len <= 1:
            kernel, wrapper = "decode", self.decode
        else:
            kernel, wrapper = "prefill", self.prefill
        table = cm.block_table_tensor
        if self._table_key != (table.data_ptr(), table.stride(0)):
            self._bind_block_table(table)
        if kernel == "prefill" and (self.deterministic or self.split_mixed):
            q_lens = qo_cpu[1:] - qo_cpu[:-1]
            one = q_lens == 1
            nd = int(torch.cumprod(one, 0).sum())  # the leading decodes (vLLM orders them first)
            if self.deterministic and int(one.sum()) != nd:
                _warn_unordered()
            fresh = not capture and self._fresh_takes(q_lens[nd:], kv_cpu[nd:n])
            vp = self.variant_params
            if nd and (self.deterministic or fresh or (not self.prefill.cute_takes(q_lens, kv_cpu, **vp)
                                                       and self.prefill.cute_takes(q_lens[nd:], kv_cpu[nd:n], **vp))):
                return self._plan_mixed(cm, qo_cpu, kv_cpu, nd, fresh)
            if fresh:
                return self._plan_fresh(cm, qo_cpu, kv_cpu)
        bsr = BSR(qo_indptr=cm.query_start_loc, kv_indices=self._kv_indices, kv_block_start=self._kv_block_start[:n],
                  kv_lens=cm.seq_lens, block_width=self.page_size)
        groups = None if capture else self._prefix_groups(cm, qo_cpu, kv_cpu, common_prefix_len)
        kw = dict(causal=True, sm_scale=self.sm_scale, debug=self.debug, **self.variant_params)
        partner = None
        if kernel == "decode" and self.graph_prefill is not None:
            # build() cannot tell a replayed step from an eager one: the other wrapper always gets its idle plan
            wrapper, partner = plan_decode_step(self.decode, self.graph_prefill, qo_cpu, kv_cpu, bsr, groups, kw,
                                                _PLAN_COUNTS, plan_other=True)
            partner = partner if capture else None
        else:
            wrapper.plan(qo_cpu, kv_cpu, bsr, prefix_groups=groups, **kw)
            _PLAN_COUNTS[kernel] += 1
            if kernel == "prefill" and wrapper.cute_step:
                _PLAN_COUNTS["cute"] += 1
            if groups is not None and wrapper.plan_info.shared_groups > 0:
                _PLAN_COUNTS["grouped_decode" if kernel == "decode" else "grouped_extend"] += 1
        return FiAttentionMetadata(wrapper=wrapper, num_rows=int(qo_cpu[n]), num_actual_tokens=cm.num_actual_tokens,
                                   max_query_len=cm.max_query_len, query_start_loc=cm.query_start_loc,
                                   seq_lens=cm.seq_lens, block_table=table, slot_mapping=cm.slot_mapping,
                                   partner=partner)

    def _fresh_takes(self, q_lens: torch.Tensor, kv_cpu: torch.Tensor) -> bool:
        """Whether requests of these host lengths run on the fresh wrapper: none has cached tokens (its host KV
        length, an upper bound, equals its query length) and the ragged member takes the step."""
        if self.fresh is None or self.deterministic or q_lens.numel() == 0:
            return False
        return bool(torch.equal(kv_cpu.to(q_lens.dtype), q_lens)) and self.fresh.cute_takes(q_lens, kv_cpu,
                                                                                             **self.variant_params)

    def _plan_fresh(self, cm, qo_cpu, kv_cpu) -> FiAttentionMetadata:
        """A step of new prompts only, on the fresh wrapper over forward's key / value."""
        return _plan_own_rows(self.fresh, self._fresh_rows, cm, qo_cpu, kv_cpu, causal=True, sm_scale=self.sm_scale,
                              debug=self.debug, variant_params=self.variant_params, count="fresh")

    def _plan_mixed(self, cm, qo_cpu, kv_cpu, nd: int, fresh: bool = False) -> FiAttentionMetadata:
        """A mixed step's nd leading decodes on the decode wrapper, the rest on the prefill wrapper: for batch
        invariance (each request's kernel then follows its own query length, not its companions'), or so that the
        rest runs on the prefill wrapper's CuTe member (split_mixed); fresh: the rest (new prompts only) on the
        fresh wrapper, over forward's key / value rows from nd on."""
        n = cm.num_reqs
        dec = BSR(qo_indptr=cm.query_start_loc[: nd + 1], kv_indices=self._kv_indices,
                  kv_block_start=self._kv_block_start[:nd], kv_lens=cm.seq_lens[:nd], block_width=self.page_size)
        self.decode.plan(qo_cpu[: nd + 1], kv_cpu[:nd], dec, causal=True, sm_scale=self.sm_scale, debug=self.debug,
                         **self.variant_params)
        if self._qo_rest is None or self._qo_rest.numel() < n - nd + 1:
            self._qo_rest = torch.empty(n + 1, dtype=torch.int32, device=cm.query_start_loc.device)
        qo_rest = self._qo_rest[: n - nd + 1]
        torch.sub(cm.query_start_loc[nd: n + 1], nd, out=qo_rest)  # one row per decode before them
        wrapper = self.fresh if fresh else self.prefill
        if fresh:
            rest = self._fresh_rows.bsr(qo_rest, cm.seq_lens[nd:n], int(qo_cpu[n]) - nd)
            _PLAN_COUNTS["fresh"] += 1
        else:
            rest = BSR(qo_indptr=qo_rest, kv_indices=self._kv_indices, kv_block_start=self._kv_block_start[nd:n],
                       kv_lens=cm.seq_lens[nd:n], block_width=self.page_size)
        wrapper.plan(qo_cpu[nd:] - nd, kv_cpu[nd:n], rest, causal=True, sm_scale=self.sm_scale, debug=self.debug,
                     **self.variant_params)
        _PLAN_COUNTS["decode"] += 1
        _PLAN_COUNTS["prefill"] += 1
        if wrapper.cute_step:
            _PLAN_COUNTS["cute"] += 1
        return FiAttentionMetadata(wrapper=wrapper, num_rows=int(qo_cpu[n]), num_actual_tokens=cm.num_actual_tokens,
                                   max_query_len=cm.max_query_len, query_start_loc=cm.query_start_loc,
                                   seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
                                   slot_mapping=cm.slot_mapping, decode_wrapper=self.decode, num_decode_rows=nd,
                                   fresh=fresh)

    def _bind_block_table(self, table: torch.Tensor) -> None:
        """Flat kv_indices over the table's buffer from its first row on, and its row starts (once)."""
        if table.dtype != torch.int32 or table.dim() != 2:
            raise TypeError(f"vLLM's block table must be a 2-D int32 tensor, got {table.dtype} {tuple(table.shape)}")
        if table.shape[1] > 1 and table.stride(1) != 1:
            raise ValueError(f"vLLM's block table must have contiguous rows, got strides {table.stride()}")
        row_stride = table.stride(0)
        span = table.untyped_storage().nbytes() // table.element_size() - table.storage_offset()
        rows = max(span // max(row_stride, 1), table.shape[0])
        starts = torch.arange(rows, dtype=torch.int64, device=table.device) * row_stride
        self._kv_indices = table.as_strided((span,), (1,))
        self._kv_block_start = starts.to(torch.int32) if rows * row_stride < 2 ** 31 else starts
        self._table_key = (table.data_ptr(), row_stride)


def _warn_unordered() -> None:
    """Once per process: a batch-invariant mixed step whose decodes were not all first (vLLM orders them first
    for reorder_batch_threshold = 1); those after a prefill run on the prefill kernel in that step."""
    global _warned_unordered
    if not _warned_unordered:
        _warned_unordered = True
        _log.warning("fi-backend: VLLM_BATCH_INVARIANT: a mixed step has one-token requests after longer ones; "
                     "they run on the prefill kernel in such steps, so their outputs may differ in the last bits "
                     "from the same tokens in other steps (the model runner did not put decodes first)")


def batch_invariant() -> bool:
    """Whether the engine asks for batch-invariant attention: VLLM_BATCH_INVARIANT read as vLLM reads it (an
    int, nonzero: on), or fi-backend's own FI_BACKEND_DETERMINISTIC."""
    return _env.batch_invariant()


def _make_wrapper(kernel: str, *, device, num_qo_heads: int, num_kv_heads: int, head_dim: int, q_dtype, kv_dtype,
                  page_size: int, variant, max_requests: int, max_rows: int, deterministic: bool = False,
                  shared_prefix: bool = False, prefix_groups_only: bool = False, ragged: bool = False):
    """A BatchAttention of one kernel with its own workspace, sized once for the engine's limits
    (prefix_groups_only: graph_prefill, BatchAttention.for_prefix_groups)."""
    from fi_backend.wrappers import BatchAttention
    ws = BatchAttention.workspace_for(device, num_qo_heads, num_kv_heads, head_dim, max_requests=max_requests,
                                      max_tokens=max_rows, q_dtype=q_dtype, kv_dtype=kv_dtype, variant=variant,
                                      kernel=kernel, deterministic=deterministic, shared_prefix=shared_prefix)
    wrapper = BatchAttention(ws, num_qo_heads, num_kv_heads, head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
                             page_size=1 if ragged else page_size, kv_layout="NHD", variant=variant, kernel=kernel,
                             deterministic=deterministic, ragged=ragged)
    wrapper.graphs_keep_request_count = True   # FULL decode graphs replay at their captured num_reqs
    if prefix_groups_only:
        wrapper.for_prefix_groups()
    _wrappers.add(wrapper)
    return wrapper


@dataclass(frozen=True)
class _GroupSettings:
    """What every layer of an attention group must share, since they share one plan."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    kv_cache_dtype: str
    plan_params: tuple          # sorted (name, value) pairs; ALiBi slopes as a tuple of floats
    variant: Any = field(compare=False)   # determined by plan_params' names (layer_variant)


def _group_settings(impls: dict) -> _GroupSettings:
    """The settings of an attention group's layers {name: impl}; ValueError naming the layers that differ."""
    if not impls:
        raise ValueError("fi-backend found no attention layers for this attention group")
    groups: dict = {}
    for name, impl in impls.items():
        if not isinstance(impl, _Impl):
            raise TypeError(f"layer {name} uses {type(impl).__name__}, not fi-backend's impl: all layers of an "
                            f"attention group must use the {BACKEND_NAME} backend")
        groups.setdefault(impl.group_settings(), []).append(name)
    if len(groups) > 1:
        detail = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: {s}"
                           for s, names in groups.items())
        raise ValueError("fi-backend plans once per step for all layers of an attention group, so they must share "
                         "heads, head size, scale, KV-cache dtype, sliding window, soft-cap and ALiBi slopes; "
                         f"these differ: {detail}")
    return next(iter(groups))


def _plan_own_rows(wrapper, rows: RaggedRows, cm, qo_cpu, kv_cpu, *, causal: bool, sm_scale: float, debug: bool,
                   variant_params: dict, count: str) -> FiAttentionMetadata:
    """Plan a ragged wrapper over the step's own K / V rows (every request's keys are its queries; forward's key /
    value), counted under `count`; the step's metadata (fresh: forward reads key / value, not the cache)."""
    n = cm.num_reqs
    num_rows = int(qo_cpu[n])
    bsr = rows.bsr(cm.query_start_loc[: n + 1], cm.seq_lens[:n], num_rows)
    wrapper.plan(qo_cpu[: n + 1], kv_cpu, bsr, causal=causal, sm_scale=sm_scale, debug=debug, **variant_params)
    _PLAN_COUNTS["prefill"] += 1
    _PLAN_COUNTS[count] += 1
    if wrapper.cute_step:
        _PLAN_COUNTS["cute"] += 1
    return FiAttentionMetadata(wrapper=wrapper, num_rows=num_rows, num_actual_tokens=cm.num_actual_tokens,
                               max_query_len=cm.max_query_len, query_start_loc=cm.query_start_loc,
                               seq_lens=cm.seq_lens, block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
                               fresh=True)


def _is_encoder_only(kv_cache_spec, kinds: Optional[dict] = None) -> bool:
    """Whether an attention group is encoder-only: vLLM gives such layers an EncoderOnlyAttentionSpec (no KV cache
    behind it) and their impls attn_type "encoder_only"."""
    return (type(kv_cache_spec).__name__ == "EncoderOnlyAttentionSpec"
            or (kinds is not None and "encoder_only" in kinds.values()))


class _EncoderPlanner:
    """One plan per step for encoder-only layers: every request's keys are its own query rows (no KV cache; vLLM
    runs each prompt whole in one step), non-causal, on one ragged prefill wrapper (BatchAttention(ragged=True))
    over forward's key / value."""

    shared_prefix = False   # use_cascade_attention: no
    page_size = 1

    def __init__(self, wrapper, *, sm_scale: float, variant_params: dict, debug: bool = False):
        self.wrapper, self.sm_scale, self.variant_params, self.debug = wrapper, sm_scale, variant_params, debug
        self._rows = RaggedRows()

    def plan(self, cm, common_prefix_len: int = 0, capture: bool = False) -> FiAttentionMetadata:
        if capture:
            raise NotImplementedError("fi-backend does not capture encoder-only attention in CUDA graphs (its "
                                      "builder says NEVER)")
        if cm.causal is not False:
            raise ValueError(f"encoder-only attention is non-causal; vLLM's metadata says causal={cm.causal!r}")
        n = cm.num_reqs
        qo_cpu = cm.query_start_loc_cpu[: n + 1]
        q_lens = qo_cpu[1:] - qo_cpu[:-1]
        kv_cpu = getattr(cm, "seq_lens_cpu_upper_bound", None)
        why = None if kv_cpu is None else whole_prompts_refusal(
            kv_cpu[:n], q_lens, "chunked prefill or prefix caching: vLLM turns both off for these models")
        if why:
            raise ValueError(why)
        return _plan_own_rows(self.wrapper, self._rows, cm, qo_cpu, q_lens.to(torch.int32), causal=False,
                              sm_scale=self.sm_scale, debug=self.debug, variant_params=self.variant_params,
                              count="encoder_only")


def _kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return _FP8_DTYPE
    return {"auto": model_dtype, "bfloat16": torch.bfloat16, "float16": torch.float16}[kv_cache_dtype]


# ------------------------------------------------------------------------------------ AttentionBackend

class _Backend:
    """fi-backend's AttentionBackend for vLLM 0.26 (selected as CUSTOM)."""

    supported_dtypes = list(DTYPES)
    supported_kv_cache_dtypes = list(KV_CACHE_DTYPES)
    forward_includes_kv_cache_update = False   # vLLM calls _Impl.do_kv_cache_update before forward
    # Variants the impl turns vLLM's layer settings into (fi_backend.variants); sliding window is also
    # what vLLM asks through supports_sliding_window.
    supports_logits_soft_cap = True
    supports_alibi = True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        return _vllm_class("FiAttentionImpl")

    @staticmethod
    def get_builder_cls():
        return _vllm_class("FiAttentionMetadataBuilder")

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple:
        """K and V packed in the last dim: [num_blocks, block_size, num_kv_heads, 2 * head_size].
        The kernels and the append op address it by strides, so no copy is ever made."""
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"fi-backend supports block sizes {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, got {block_size}")
        if head_size not in HEAD_SIZES:
            raise ValueError(f"fi-backend supports head sizes {HEAD_SIZES}, got {head_size}")
        if cache_dtype_str not in KV_CACHE_DTYPES:
            raise ValueError(f"fi-backend supports KV-cache dtypes {KV_CACHE_DTYPES}, got {cache_dtype_str!r}")
        return (num_blocks, block_size, num_kv_heads, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple:
        """Physical order of get_kv_cache_shape's dims. Blocks first always (vLLM may then put several
        layers in one allocation, block-major); tokens-then-heads (NHD) unless vLLM's KV-cache layout
        is HND (VLLM_KV_CACHE_LAYOUT or a KV connector), which the kernels read by strides as well."""
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
        hnd = get_kv_cache_layout() == "HND"
        if include_num_layers_dimension:  # logical (layers, blocks, tokens, heads, 2D)
            return (1, 3, 0, 2, 4) if hnd else (1, 0, 2, 3, 4)
        return (0, 2, 1, 3) if hnd else (0, 1, 2, 3)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        # Any size 16..256, largest first: vLLM picks the manager's block where listed, else the largest that divides
        # it, and for sliding-window layers the smallest (MIN_BLOCK_SIZE).
        return list(range(MAX_BLOCK_SIZE, MIN_BLOCK_SIZE - 1, -1))

    @classmethod
    def get_supported_head_sizes(cls) -> list:
        return list(HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in HEAD_SIZES

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in DTYPES

    @classmethod
    def supports_block_size(cls, block_size: Optional[int]) -> bool:
        return block_size is None or MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Optional[str]) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in KV_CACHE_DTYPES

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        # encoder-only: BERT-like embedding and scoring models' bidirectional attention over each prompt's own K / V
        return attn_type in ATTN_TYPES

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) in COMPUTE_CAPABILITIES

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False   # not tested with fi-backend (disaggregated prefill, KV offloading): refused, not guessed

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: Optional[str],
                               block_size: Optional[int], use_mla: bool, has_sink: bool, use_sparse: bool,
                               use_mm_prefix: bool, use_per_head_quant_scales: bool, device_capability,
                               attn_type: str, has_sliding_window: bool = False, use_non_causal: bool = False,
                               use_batch_invariant: bool = False, use_kv_connector: bool = False,
                               use_pcp: bool = False, **other) -> list:
        """Why vLLM must not use fi-backend for this layer, one reason per problem ([] = supported)."""
        reasons = []
        if use_mla:
            reasons.append("MLA (multi-head latent attention) is not supported: fi-backend runs multi-head and "
                           "grouped-query attention")
        if not cls.supports_head_size(head_size):
            reasons.append(f"head size {head_size} is not supported (fi-backend: {', '.join(map(str, HEAD_SIZES))})")
        if not cls.supports_dtype(dtype):
            reasons.append(f"model dtype {dtype} is not supported (fi-backend: bfloat16, float16)")
        if not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} is not supported (fi-backend: "
                           f"{', '.join(KV_CACHE_DTYPES)}; fp8 means e4m3 with per-tensor scales)")
        elif kv_cache_dtype in ("bfloat16", "float16") and dtype in DTYPES and str(dtype) != f"torch.{kv_cache_dtype}":
            reasons.append(f"kv_cache_dtype {kv_cache_dtype} with model dtype {dtype} is not supported: the kernels "
                           "read KV in the query's dtype or in fp8")
        if not cls.supports_block_size(block_size):
            reasons.append(f"block size {block_size} is not supported (fi-backend: {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE})")
        if not cls.supports_attn_type(attn_type):
            reasons.append(f"attention type {getattr(attn_type, 'value', attn_type)} is not supported: fi-backend "
                           "runs decoder self-attention and encoder-only attention (no encoder-decoder or "
                           "cross-attention)")
        if use_non_causal:
            reasons.append("non-causal (bidirectional) decoder attention is not supported")
        if str(getattr(attn_type, "value", attn_type)) == "encoder_only" and has_sliding_window:
            reasons.append("encoder-only attention with a sliding window is not supported (a two-sided window; the "
                           "kernels' windows are causal)")
        if has_sink:
            reasons.append("attention sinks are not supported")
        if use_sparse:
            reasons.append("sparse attention is not supported")
        if use_mm_prefix:
            reasons.append("PrefixLM bidirectional attention over multimodal tokens is not supported")
        if use_per_head_quant_scales:
            reasons.append("per-head KV-cache quantization scales are not supported (per-tensor fp8 scales only)")
        if not cls.supports_compute_capability(device_capability):
            cap = f"{device_capability.major}.{device_capability.minor}"
            reasons.append(f"compute capability {cap} is not supported: fi-backend's kernels are built for "
                           f"{', '.join(f'{a}.{b}' for a, b in COMPUTE_CAPABILITIES)} (Ampere, Ada, Hopper)")
        if use_kv_connector:
            reasons.append("KV connectors (disaggregated prefill, KV offloading) are not supported yet")
        if use_pcp:
            reasons.append("prefill context parallelism is not supported")
        reasons += [f"{k}={v!r} is not supported (not known to fi-backend's vLLM 0.26 adapter)"
                    for k, v in sorted(other.items()) if v]
        return reasons


# ------------------------------------------------------------------------------------ AttentionMetadataBuilder

class _MetadataBuilder:
    """fi-backend's AttentionMetadataBuilder: one plan per step for all layers of an attention group."""

    reorder_batch_threshold = None      # the prefill kernel takes any mix of query lengths in any order
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names: list, vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        s = _group_settings({name: layer.impl for name, layer in layers.items()})
        if (kv_cache_spec.num_kv_heads, kv_cache_spec.head_size) != (s.num_kv_heads, s.head_dim):
            raise ValueError(f"the KV-cache spec has {kv_cache_spec.num_kv_heads} KV heads of size "
                             f"{kv_cache_spec.head_size}; the layers have {s.num_kv_heads} of size {s.head_dim}")
        sched = vllm_config.scheduler_config
        q_dtype = vllm_config.model_config.dtype
        device = rank_device(device)   # vLLM passes the rank's cuda:<local rank>; an index-less one: the current
        tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
        where = f"{device}" + (f" (one of {tp} tensor-parallel ranks)" if tp > 1 else "")
        kinds = {name: getattr(layer.impl, "attn_type", "decoder") for name, layer in layers.items()}
        if len(set(kinds.values())) > 1:
            raise ValueError(f"an attention group mixes attention types: {kinds}")
        if _is_encoder_only(kv_cache_spec, kinds):
            self._init_encoder_only(s, len(layers), vllm_config, device, where)
            return
        common = dict(device=device, num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                      q_dtype=q_dtype, kv_dtype=_kv_torch_dtype(s.kv_cache_dtype, q_dtype),
                      page_size=kv_cache_spec.block_size, variant=s.variant, max_requests=sched.max_num_seqs)
        # A decode step has one query row per request; any other step at most max_num_batched_tokens. Both
        # kernels' modules are built (or found in the cache) here, at the engine's start, never mid-serving.
        what = (f"{s.num_qo_heads} query heads, {s.num_kv_heads} KV heads, head size {s.head_dim}, KV "
                f"{s.kv_cache_dtype}, variant {s.variant.name}")
        deterministic = batch_invariant()
        common["deterministic"] = deterministic
        shared_prefix = _env.flag(_env.SHARED_PREFIX, True) and not deterministic
        # Groups reach build() only from the opt-in worker's tables or from the V1 runner's cascade prefix; else the
        # workspaces keep no shared rows (about 9 partial rows a request: GPU memory the KV cache keeps)
        v1_cascade = (not getattr(vllm_config, "use_v2_model_runner", True)
                      and not getattr(getattr(vllm_config, "model_config", None), "disable_cascade_attn", True))
        shared_prefix = shared_prefix and (_table_provider or v1_cascade)
        if shared_prefix and getattr(vllm_config, "speculative_config", None) is not None:
            # Under speculative decoding vLLM's host KV lengths assume every draft accepted, so a group's prefix
            # could reach past a member's computed KV: single-format
            shared_prefix = False
            _log.info("fi-backend: shared-prefix groups off with speculative decoding (host KV lengths are upper "
                      "bounds)")
        common["shared_prefix"] = shared_prefix
        # Grouped decode steps on the prefill kernel, in CUDA graphs too: only where the opt-in worker publishes
        # host block tables (vLLM 0.26's runners give build() none), else decode steps keep one wrapper and launch.
        grouped_decode = shared_prefix and _table_provider
        try:
            # every module the wrappers load, built in parallel first (the CuTe member's take about 40 s each)
            from fi_backend.wrappers import BatchAttention
            # New prompts on their own K / V (_StepPlanner.fresh): where the ragged CuTe member applies (as the paged
            # wrapper's does, on this GPU) and every layer has its own K / V (layers sharing another's cache get no
            # key / value in forward)
            fresh_on = (_env.flag(_env.PREFILL_FRESH, True) and not deterministic
                        and not any(getattr(l.impl, "kv_sharing_target_layer_name", None) for l in layers.values())
                        and _cute_member.unsupported(s.variant, s.head_dim, q_dtype, common["kv_dtype"], 0) is None)
            BatchAttention.prepare(s.num_qo_heads, s.num_kv_heads, s.head_dim, q_dtype=q_dtype,
                                   kv_dtype=common["kv_dtype"], page_size=kv_cache_spec.block_size, variant=s.variant,
                                   deterministic=deterministic, device=device, also_ragged=fresh_on)
            decode = _make_wrapper("decode", max_rows=sched.max_num_seqs, **common)
            max_rows = max(sched.max_num_batched_tokens, sched.max_num_seqs)
            prefill = _make_wrapper("prefill", max_rows=max_rows, **common)
            fresh = (_make_wrapper("prefill", max_rows=max_rows, ragged=True, **common)
                     if fresh_on and prefill.cute_unsupported is None else None)
            graph_prefill = (_make_wrapper("prefill", max_rows=sched.max_num_seqs, prefix_groups_only=True, **common)
                             if grouped_decode else None)
        except Exception as e:  # a build failure or a refused shape: say which model shape, at start-up
            raise RuntimeError(f"fi-backend cannot run this model's attention ({what}): {e}") from e
        if grouped_decode:
            _add_table_reader()
            _log.info("fi-backend: shared-prefix groups from the worker's host block tables; grouped decode steps "
                      "on the prefill kernel (graph_prefill, %d rows) on %s", sched.max_num_seqs, where)
        # Mixed steps in two launches (deterministic mode; or the CuTe member's prefill parts, split_mixed) need
        # their decodes first (_StepPlanner._plan_mixed)
        split_mixed = prefill.cute_unsupported is None
        if deterministic or split_mixed:
            self.reorder_batch_threshold = 1
        if split_mixed:
            _log.info("fi-backend: prefill steps on the CuTe member (FlashAttention-3's CTA) where it applies, a mixed "
                      "step's decodes then on the decode kernel, on %s", where)
        else:
            _log.info("fi-backend: prefill on the tile family only (no CuTe member: %s) on %s",
                      prefill.cute_unsupported, where)
        if fresh is not None:
            _log.info("fi-backend: steps of new prompts read their own K / V (the ragged CuTe member) on %s", where)
        for name in decode.module_names + prefill.module_names + (fresh.module_names if fresh is not None else []):
            _log.info("fi-backend: kernel module %s ready (%s) on %s", name, what, where)
        params = dict(s.plan_params)
        if "alibi_slopes" in params:  # a device tensor made once: captured graphs read it by address
            params["alibi_slopes"] = torch.tensor(params["alibi_slopes"], dtype=torch.float32, device=device)
        self._step = _StepPlanner(decode, prefill, page_size=kv_cache_spec.block_size, sm_scale=s.sm_scale,
                                  variant_params=params, debug=os.environ.get("FI_BACKEND_VLLM_DEBUG") == "1",
                                  deterministic=deterministic, shared_prefix=shared_prefix,
                                  graph_prefill=graph_prefill, split_mixed=split_mixed, fresh=fresh)
        _log_active(s, kv_cache_spec.block_size, len(layers), where)

    def _init_encoder_only(self, s: "_GroupSettings", num_layers: int, vllm_config, device, where: str) -> None:
        """Encoder-only layers (no KV cache): one ragged prefill wrapper over each step's own key / value rows,
        non-causal, the CuTe member where it applies (_EncoderPlanner)."""
        from fi_backend.wrappers import BatchAttention
        sched, q_dtype = vllm_config.scheduler_config, vllm_config.model_config.dtype
        what = f"{s.num_qo_heads} query heads, {s.num_kv_heads} KV heads, head size {s.head_dim}, encoder-only"
        max_len = getattr(vllm_config.model_config, "max_model_len", None)
        if getattr(sched, "enable_chunked_prefill", False) and max_len and sched.max_num_batched_tokens < max_len:
            # a prompt split over steps would attend to its own chunk only: no cache holds the earlier ones
            raise ValueError(f"fi-backend runs encoder-only attention on whole prompts: chunked prefill with "
                             f"max_num_batched_tokens {sched.max_num_batched_tokens} < max_model_len {max_len} would "
                             "split them (turn chunked prefill off, vLLM's default for these models)")
        if getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False):
            # a cached prefix's K / V would come from no cache (and bidirectional layers' K / V depend on the rest)
            raise ValueError("fi-backend runs encoder-only attention on whole prompts: prefix caching is on (turn it "
                             "off, vLLM's default for these models)")
        deterministic = batch_invariant()
        common = dict(device=device, num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                      q_dtype=q_dtype, kv_dtype=q_dtype, page_size=1, variant=s.variant,
                      max_requests=sched.max_num_seqs, deterministic=deterministic)
        try:
            BatchAttention.prepare(s.num_qo_heads, s.num_kv_heads, s.head_dim, kinds=("prefill",), q_dtype=q_dtype,
                                   kv_dtype=q_dtype, page_size=1, ragged=True, variant=s.variant,
                                   deterministic=deterministic, device=device)
            wrapper = _make_wrapper("prefill", max_rows=max(sched.max_num_batched_tokens, sched.max_num_seqs),
                                    ragged=True, **common)
        except Exception as e:  # a build failure or a refused shape: say which model shape, at start-up
            raise RuntimeError(f"fi-backend cannot run this model's attention ({what}): {e}") from e
        # (_Impl refuses windows and ALiBi here: at most a soft-cap)
        self._step = _EncoderPlanner(wrapper, sm_scale=s.sm_scale, variant_params=dict(s.plan_params),
                                     debug=os.environ.get("FI_BACKEND_VLLM_DEBUG") == "1")
        member = ("the CuTe member where it applies" if wrapper.cute_unsupported is None
                  else f"the tile family (no CuTe member: {wrapper.cute_unsupported})")
        _log.info("fi-backend: encoder-only attention (%d layers, %s) on each step's own K / V, non-causal, on %s, "
                  "on %s", num_layers, what, member, where)
        for name in wrapper.module_names:
            _log.info("fi-backend: kernel module %s ready (%s) on %s", name, what, where)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        # UNIFORM_BATCH, not ALWAYS: mixed batches run piecewise with attention eager (see the module docstring).
        # Encoder-only steps are prompts whose sizes a graph would keep: never captured
        if _is_encoder_only(kv_cache_spec):
            from vllm.v1.attention.backend import AttentionCGSupport
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False) -> FiAttentionMetadata:
        # vLLM's cascade prefix (asked for by use_cascade_attention) becomes one shared-prefix group
        return self._step.plan(common_attn_metadata, common_prefix_len)

    def build_for_cudagraph_capture(self, common_attn_metadata) -> FiAttentionMetadata:
        # The same plan as any step: run() captured now keeps reading the fixed workspace sections and
        # the persistent BSR buffers, so it replays correctly after every later plan of its wrapper. With
        # graph_prefill a decode capture launches both decode-step wrappers (one idle); each replayed step's
        # build() then gives the step to one of them and an idle plan to the other.
        return self._step.plan(common_attn_metadata, 0, capture=True)

    def use_cascade_attention(self, common_prefix_len: int = 0, *args, **kwargs) -> bool:
        # The V1 runner asks with the prefix common to the whole batch (from its host block table); yes, when
        # composable formats are on: build() then gets it and plans it as one shared-prefix group (same launch,
        # docs/composable.md). vLLM's V2 runner never asks.
        return bool(self._step.shared_prefix) and int(common_prefix_len) >= self._step.page_size


# ------------------------------------------------------------------------------------ AttentionImpl

class _Impl:
    """fi-backend's AttentionImpl: one per layer; KV append and attention against the group's plan."""

    can_return_lse_for_decode = False
    supports_quant_query_input = False   # the query stays in the model's dtype, also with fp8 KV

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes=None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None, attn_type: str = "decoder",
                 kv_sharing_target_layer_name: Optional[str] = None, sinks: Optional[torch.Tensor] = None, **other):
        attn_type = str(getattr(attn_type, "value", attn_type))
        if attn_type not in ATTN_TYPES:
            raise NotImplementedError(f"fi-backend runs attention types {', '.join(ATTN_TYPES)}, got {attn_type}")
        if attn_type == "encoder_only" and (sliding_window or alibi_slopes is not None):
            # the kernels' windows and ALiBi are causal ones (keys to the left); an encoder's are two-sided
            raise NotImplementedError("fi-backend does not run encoder-only attention with a sliding window or ALiBi "
                                      "(two-sided there; the kernels' are causal)")
        if head_size not in HEAD_SIZES:
            raise ValueError(f"fi-backend supports head sizes {HEAD_SIZES}, got {head_size}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"fi-backend supports KV-cache dtypes {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if sinks is not None:
            raise NotImplementedError("fi-backend does not support attention sinks")
        unknown = sorted(k for k, v in other.items() if v not in (None, False, -1))
        if unknown:
            raise NotImplementedError(f"fi-backend does not support the attention arguments {unknown}")
        if getattr(self, "dcp_world_size", 1) > 1:  # set by vLLM's AttentionImplBase.__new__
            raise NotImplementedError("fi-backend does not support decode context parallelism")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.alibi_slopes = alibi_slopes
        self.variant, self.plan_params = layer_variant(alibi_slopes, sliding_window, logits_soft_cap)
        if "alibi_slopes" in self.plan_params and len(self.plan_params["alibi_slopes"]) != num_heads:
            raise ValueError(f"alibi_slopes has {len(self.plan_params['alibi_slopes'])} entries, expected num_heads "
                             f"= {num_heads}")
        self._fp8 = kv_cache_dtype.startswith("fp8")
        self._kv_src = self._kv_view = None   # vLLM's cache tensor and its fp8 view, made once

    def group_settings(self) -> _GroupSettings:
        return _GroupSettings(self.num_heads, self.num_kv_heads, self.head_size, self.scale, self.kv_cache_dtype,
                              tuple(sorted(self.plan_params.items())), self.variant)

    def _kv(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as the kernels take it: vLLM stores fp8 as uint8, viewed once as float8_e4m3fn."""
        if kv_cache is not self._kv_src:
            self._kv_src = kv_cache
            self._kv_view = kv_cache.view(_FP8_DTYPE) if self._fp8 and kv_cache.dtype != _FP8_DTYPE else kv_cache
        return self._kv_view

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[FiAttentionMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of query [tokens, heads, head_size] into vLLM's output [tokens, heads, head_size]."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fi-backend does not fuse output quantization into attention")
        if attn_metadata is None:   # vLLM's memory-profiling run: no metadata, no KV cache yet
            return output.fill_(0)
        n = attn_metadata.num_rows
        if query.shape[0] != n:   # rows past the plan are padding (CUDA-graph batch sizes); slicing costs
            query, out = query[:n], output[:n]   # host time in eager mode, so only when needed
        else:
            out = output
        # k/v scales as floats: vLLM's per-tensor fp8 dequantisation (ignored for 16-bit caches).
        nd = getattr(attn_metadata, "num_decode_rows", 0)
        fresh = getattr(attn_metadata, "fresh", False)
        if nd:  # batch invariance, mixed step: the decodes on the decode kernel, the rest on the prefill kernel
            kv = self._kv(kv_cache)
            attn_metadata.decode_wrapper.run(query[:nd], kv, out=out[:nd], k_scale=layer._k_scale_float,
                                             v_scale=layer._v_scale_float)
            if fresh:
                kv = (key[nd:n].unsqueeze(1), value[nd:n].unsqueeze(1))
            attn_metadata.wrapper.run(query[nd:n], kv, out=out[nd:n], k_scale=layer._k_scale_float,
                                      v_scale=layer._v_scale_float)
            return output
        if fresh:  # new prompts only (or encoder-only layers): their own K / V rows, not the cache
            attn_metadata.wrapper.run(query, (key[:n].unsqueeze(1), value[:n].unsqueeze(1)), out=out)
            return output
        kv = self._kv(kv_cache)
        attn_metadata.wrapper.run(query, kv, out=out, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float)
        partner = getattr(attn_metadata, "partner", None)
        if partner is not None:   # a decode-graph capture: the idle wrapper too (it writes nothing)
            partner.run(query, kv, out=out, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float)
        return output

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write this step's K/V [tokens, kv_heads, head_size] at slot_mapping (-1 = padding, skipped)."""
        if kv_cache.numel() == 0 or self.attn_type == "encoder_only":   # dummy runs; encoder-only layers: no cache
            return
        # fp8: the scales as vLLM's device tensors, so a captured graph reads their current values.
        _ops.append_paged_kv_cache(key, value, self._kv(kv_cache), slot_mapping, kv_layout="NHD",
                                   k_scale=layer._k_scale if self._fp8 else None,
                                   v_scale=layer._v_scale if self._fp8 else None)
