"""fi-backend as SGLang 0.5.15's attention backend: `python -m sglang.launch_server ... --attention-backend fi_backend`.

How SGLang finds it. pyproject.toml declares `register` below as an entry point of the group
`sglang.srt.plugins`. SGLang's load_plugins() calls it in every process that may parse arguments or
build a model: launch_server and `sglang serve` before they parse the command line, Engine.__init__
before it builds ServerArgs, and each scheduler process before it builds its ModelRunner. register()
adds "fi_backend" to SGLang's attention-backend registry (attention_registry.register_attention_backend)
and to the --attention-backend choices (server_args.add_attention_backend_choices); nothing of SGLang is
patched. When a ModelRunner is built with attention_backend="fi_backend", SGLang calls create_backend()
below, which makes FiAttnBackend: a subclass of SGLang's AttentionBackend made on first access (module
__getattr__) from the plain class _Backend here, so importing this module imports nothing of SGLang.

What SGLang hands a backend, and what this one does with it:
  init_forward_metadata(forward_batch)      once per step, eager: one plan per layer group (_StepPlanner),
                                            from the lengths SGLang keeps on the host (seq_lens_cpu,
                                            extend_seq_lens_cpu): no device-to-host synchronisation
  forward_decode / forward_extend           once per layer: write the step's K/V with SGLang's own
                                            token_to_kv_pool.set_kv_buffer (as the triton backend does;
                                            FI_BACKEND_SGLANG_KV_WRITE=append uses fi_backend.ops'
                                            append op into the pool's buffers instead), then attention
                                            of the step's queries over each request's whole KV (prefix
                                            and new tokens) read through req_to_token
  init_cuda_graph_state, init_forward_metadata_out_graph(fb, in_capture), get_cuda_graph_seq_len_fill_value
                                            SGLang 0.5.15's decode CUDA-graph contract (the legacy
                                            init_forward_metadata_capture/replay_cuda_graph pair was
                                            removed from its AttentionBackend): the out-of-graph hook runs
                                            before each capture and each replay and plans into the same
                                            persistent buffers the captured run() reads; nothing is
                                            recorded in the graph but the layers' KV write and run().

The BSR (fi_backend.formats, one row block per request). Page size 1 (SGLang's default): block width 1,
kv_indices = req_to_token viewed flat over its whole storage (zero-copy, as formats.from_token_table
does), kv_block_start = req_pool_indices * req_to_token.stride(0) written into a buffer of this planner;
kv_lens = seq_lens (prefix + this step's tokens: SGLang writes req_to_token for the new tokens before the
forward, and set_kv_buffer writes their K/V before attention, so the queries are the last q_len
positions of their KV, causal bottom-right aligned). Page size P > 1: block width P, kv_indices = a page
table of this planner, req_to_token[req, ::P] // P for the step's requests and the columns the longest
of them needs. qo_indptr: a constant arange for decode steps, a device cumsum of extend_seq_lens for
extend steps. Every array lives in a buffer allocated once and sliced, so their addresses never change:
the decode wrapper's captured run() replays correctly after each new plan (the wrapper checks this).

Steps and kernels. DECODE steps, and EXTEND / MIXED steps whose requests all have one new token, run the
decode kernel; other EXTEND and MIXED steps (prefill, radix-cache prefix hits, chunked prefill, chunked
prefill mixed with decodes) run the prefill kernel. EXTEND steps of new prompts only (no cached token) run
on a third wrapper per layer group where the CuTe member applies (Hopper, CUTLASS's headers, 16-bit KV): a ragged
prefill wrapper (BatchAttention(ragged=True)) over the layers' own k / v rows, since the member does not read
SGLang's pages of one (a layer passing no k / v then runs its group's prefill wrapper, planned on demand;
FI_BACKEND_PREFILL_FRESH=0 turns it off; docs/prefill.md, "New prompts on their own K / V"). IDLE steps plan
nothing (SGLang's base forward answers them). Prefill under SGLang's default breakable prefill CUDA graph runs
eagerly at the graph breaks SGLang places around attention, after init_forward_metadata: nothing of fi-backend is
captured there. Decode graphs pad a batch to the captured size with requests of pool row 0 and length
get_cuda_graph_seq_len_fill_value() = 1 (a valid slot), whose outputs SGLang discards.

Layer groups. Layers that share heads, head size, scale, sliding window and soft-cap share one plan per
step; a model with several kinds (Gemma-2: sliding-window and full layers, both soft-capped) gets one
plan per kind per step, each with its own decode and prefill wrappers. SGLang's sliding_window_size is
already the number of earlier tokens a query sees (q_pos - kv_pos <= it), i.e. fi-backend's window_left.

Shared-prefix groups (composable formats, docs/composable.md): off by default in SGLang until this path has run and
been timed on a GPU; FI_BACKEND_SHARED_PREFIX=1 turns them on (deterministic inference keeps them off). register()
then adds an AFTER hook on ForwardBatch.init_new through SGLang's plugin HookRegistry. For each batch it walks the requests once, on the host: neighbours share the tokens up to the lowest
common ancestor of their radix nodes (Req.last_node; radix_shared_tokens), and the result is kept with the batch's
out_cache_loc, which the eager batch and the decode graph's replay view both carry. The step's plan finds it by that
tensor's identity and makes the groups (_StepPlanner._prefix_groups: capped at each member's cached tokens, whole
pages, runs of sharing neighbours). Extend steps pass them to the prefill wrapper. Decode steps whose groups save
enough KV (scheduler.decode_groups_pay) run them on the prefill kernel, whose tile holds many requests' rows: a third
wrapper per layer group (graph_prefill, its own workspace) is planned with them, and where the planner keeps any
(plan_info.shared_groups) it runs the step; else the decode wrapper does, given the groups for its own verdict (a
16-row tile's requests read the prefix once). Eager decode steps run that one wrapper. A decode graph launches both
into one output, so each graph step gives the other one an idle plan (the same rows, no items).

Deterministic inference (--enable-deterministic-inference, or FI_BACKEND_DETERMINISTIC=1): both wrappers plan
deterministically (docs/deterministic.md) and every EXTEND step runs the prefill kernel (a one-token extend too),
so a row's kernel follows the step's kind, never its companions; register() lists fi_backend among SGLang's
deterministic backends but not (yet) its radix-cache ones, so SGLang turns the radix cache off in this mode; with
the radix cache forced on, sliding-window layers are refused.
Mixed chunks (--enable-mixed-chunk) are refused in this mode: their decodes would run on the prefill kernel.

Encoder-only layers (BERT-like embedding models): one ragged prefill wrapper a group, each step non-causal over its
own K / V, no KV written; the radix cache and chunked prefill are refused with them (whole prompts, one step each).

Refused when the backend is made (ValueError naming every reason; see _refusal_reasons): MLA, encoder-decoder /
cross / bidirectional decoder attention, encoder-only attention with a sliding window or beside decoder layers,
attention sinks, speculative decoding, two-batch overlap, PD multiplexing, decode / attention context parallelism,
the hybrid SWA and unified memory pools, KV layouts other than NHD / HND, fp8 e5m2 KV, head sizes the kernels
lack, and the experimental "full" prefill CUDA graph (breakable, tc_piecewise and disabled work).

Environment: FI_BACKEND_SGLANG_KV_WRITE ("sglang", default: set_kv_buffer; "append": fi_backend.ops.
append_paged_kv_cache into the pool's buffers, plain MHATokenToKVPool only); FI_BACKEND_SGLANG_DEBUG=1
validates every BSR on the host (synchronises; for debugging); FI_BACKEND_SHARED_PREFIX=1: shared-prefix groups
(read by register() and when the backend is made).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from fi_backend import cute_member as _cute_member
from fi_backend import env as _env
from fi_backend import ops as _ops
from fi_backend.adapters import RaggedRows, plan_decode_step, rank_device, whole_prompts_refusal
from fi_backend.formats import BSR, prefix_groups_from_links
from fi_backend.wrappers import HEAD_DIMS

__all__ = ["register", "create_backend", "BACKEND_NAME", "ENTRY_POINT_GROUP", "plan_counts", "check_errors",
           "layer_settings", "LayerSettings", "radix_shared_tokens"]

BACKEND_NAME = "fi_backend"                 # --attention-backend fi_backend
ENTRY_POINT_GROUP = "sglang.srt.plugins"
HEAD_SIZES = HEAD_DIMS                      # the kernels' (fi_backend.wrappers)
DTYPES = (torch.bfloat16, torch.float16)
_FP8_DTYPE = torch.float8_e4m3fn
MAX_PAGE_SIZE = 256
# Hopper (sm_90a) and, through the mma.sync kernels, Ampere / Ada
COMPUTE_CAPABILITIES = ((8, 0), (8, 6), (8, 7), (8, 9), (9, 0))
KV_WRITE_ENV = "FI_BACKEND_SGLANG_KV_WRITE"
DEBUG_ENV = "FI_BACKEND_SGLANG_DEBUG"
_KV_WRITES = ("sglang", "append")

_SGLANG_CLASSES = ("FiAttnBackend",)
# A child of SGLang's "sglang" logger namespace (SGLang configures the root logger's handler and level).
_log = logging.getLogger("sglang.fi_backend")
_logged_registered = False
_PLAN_COUNTS = {"decode": 0, "prefill": 0, "graph_steps": 0, "grouped_decode": 0, "grouped_extend": 0, "fresh": 0,
                "encoder_only": 0}
# Shared-prefix groups (docs/composable.md): the hook on ForwardBatch.init_new that finds them, and the requests a
# step's groups hold partial states for (a larger step's groups beyond them plan single-format; the workspaces'
# shared rows stay small for SGLang's request pools of thousands)
_FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
SHARED_PREFIX_MAX_REQUESTS = 512
# Off unless FI_BACKEND_SHARED_PREFIX=1: every decode-graph step would launch a second (idle) kernel a layer, a cost
# not measured on its own (the engine runs and end-to-end figures with it on: docs/composable.md)
SGLANG_SHARED_PREFIX_DEFAULT = False
_hook_registered = False
_shared_prefix_backends = 0     # backends of this process that plan groups: the hook works only when > 0
_wrappers = weakref.WeakSet()   # every BatchAttention this process made, for check_errors()
_define_lock = threading.Lock()


# ------------------------------------------------------------------------------------ registration

def register() -> None:
    """Register fi-backend as SGLang's attention backend "fi_backend" (the `sglang.srt.plugins` hook).

    Idempotent and cheap (SGLang calls it in each process it starts). Without SGLang installed it raises
    ImportError: only SGLang calls it (and SGLang logs a failing plugin rather than stopping). If another
    plugin already registered the name "fi_backend", it logs a warning and leaves SGLang as it is."""
    global _logged_registered
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("fi_backend.adapters.sglang.register() is SGLang's plugin hook (entry point group "
                          f"{ENTRY_POINT_GROUP}); it needs SGLang 0.5.15 installed, and sglang is not importable")
    try:
        from sglang.srt import server_args as sa
        from sglang.srt.layers.attention import attention_registry as reg
    except ImportError as e:
        _log.warning("fi-backend: not registered: this SGLang has no attention-backend registry (%s); fi-backend "
                     "supports SGLang 0.5.15", e)
        return
    current = reg.ATTENTION_BACKENDS.get(BACKEND_NAME)
    if current is None:
        reg.register_attention_backend(BACKEND_NAME)(create_backend)
    elif current is not create_backend:
        _log.warning("fi-backend: not registered: the attention backend name %r is already registered to %s by "
                     "another plugin", BACKEND_NAME, getattr(current, "__qualname__", current))
        return
    if BACKEND_NAME not in getattr(sa, "ATTENTION_BACKEND_CHOICES", ()):
        sa.add_attention_backend_choices([BACKEND_NAME])
    # --enable-deterministic-inference accepts the backends on the first list; on the second SGLang keeps the
    # radix cache on in that mode (a cached prefix keeps a request's bits: docs/deterministic.md).
    if hasattr(sa, "add_deterministic_attention_backend_choices") and \
            BACKEND_NAME not in getattr(sa, "DETERMINISTIC_ATTENTION_BACKEND_CHOICES", ()):
        sa.add_deterministic_attention_backend_choices([BACKEND_NAME])
    if hasattr(sa, "add_radix_supported_deterministic_attention_backend_choices") and \
            BACKEND_NAME not in getattr(sa, "RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND", ()):
        sa.add_radix_supported_deterministic_attention_backend_choices([BACKEND_NAME])
    if _env.flag(_env.SHARED_PREFIX, SGLANG_SHARED_PREFIX_DEFAULT):
        _register_prefix_hook()
    if not _logged_registered:
        _logged_registered = True
        _log.info("fi-backend registered as SGLang attention backend %r (--attention-backend %s)", BACKEND_NAME,
                  BACKEND_NAME)


def _register_prefix_hook() -> None:
    """An AFTER hook on ForwardBatch.init_new through SGLang's plugin HookRegistry (applied by load_plugins() once
    every plugin has registered): it publishes what neighbouring requests share in the radix tree for the
    backend's next plan (_after_forward_batch_init). Without the registry, steps plan single-format."""
    global _hook_registered
    if _hook_registered:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError as e:
        _log.info("fi-backend: this SGLang has no plugin HookRegistry (%s): shared-prefix groups are off", e)
        return
    HookRegistry.register(_FORWARD_BATCH_INIT, _after_forward_batch_init, HookType.AFTER)
    _hook_registered = True


# ------------------------------------------------------------------------------------ shared-prefix groups

class _StepShares:
    """What the hook found for the last ForwardBatch made in this process: its out_cache_loc (by identity: the
    eager batch and the decode graph's replay view both carry that tensor) and radix_shared_tokens of its
    requests."""

    loc: Any = None
    shares: Optional[np.ndarray] = None


_STEP = _StepShares()
_hook_failed = False


def _after_forward_batch_init(result, *args, **kwargs):
    """HookRegistry AFTER hook of the classmethod ForwardBatch.init_new(cls, batch, model_runner): host data only
    (the requests' radix nodes), no device work. Never raises into SGLang's step: a failure logs once and leaves
    steps single-format. Returns None (SGLang keeps init_new's result)."""
    global _hook_failed
    if not _shared_prefix_backends or _hook_failed:
        return None
    _STEP.loc = _STEP.shares = None
    try:
        batch = kwargs["batch"] if "batch" in kwargs else args[1]
        mode = result.forward_mode
        reqs = getattr(batch, "reqs", None)
        if reqs is None or len(reqs) < 2 or len(reqs) != result.batch_size or not (mode.is_decode() or mode.is_extend()):
            return None
        _STEP.shares = radix_shared_tokens(reqs)
        _STEP.loc = result.out_cache_loc
    except Exception as e:   # a SGLang whose batch or tree differs: no groups rather than no step
        _hook_failed = True
        _log.warning("fi-backend: shared-prefix groups are off: reading the radix tree failed (%s: %s)",
                     type(e).__name__, e)
    return None


def _radix_path(node) -> tuple:
    """(nodes from the root's child down to node, tokens from the root to the end of each): one walk up."""
    nodes = []
    while node is not None and node.parent is not None:   # the root (no parent) holds no tokens
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    depths, total = [], 0
    for n in nodes:
        total += len(n.key)
        depths.append(total)
    return nodes, depths


def radix_shared_tokens(reqs) -> np.ndarray:
    """int64 [R - 1]: entry i the KV tokens requests i and i + 1 share through SGLang's radix tree, the depth of
    the lowest common ancestor of their last_node (Req.last_node: the tree node their req_to_token row points at
    up to its end; a running request locks that path, and a split keeps a node's identity and depth). 0 where a
    request has no node (radix cache off, retracted). One pass over the requests, each walking its node's
    ancestors once; a request on its neighbour's node reuses the walk."""
    out = np.zeros(max(len(reqs) - 1, 0), dtype=np.int64)
    prev = prev_nodes = prev_depths = None
    for i, req in enumerate(reqs):
        node = req.last_node
        if i and node is prev:   # parallel samples of one prompt, or requests at the same node
            out[i - 1] = prev_depths[-1] if prev_depths else 0
            continue
        nodes, depths = _radix_path(node)
        if i:
            k, m = 0, min(len(nodes), len(prev_nodes))
            while k < m and nodes[k] is prev_nodes[k]:
                k += 1
            out[i - 1] = depths[k - 1] if k else 0
        prev, prev_nodes, prev_depths = node, nodes, depths
    return out


def create_backend(model_runner):
    """SGLang's factory for "fi_backend" (attention_registry.ATTENTION_BACKENDS[name](runner))."""
    return _sglang_class("FiAttnBackend")(model_runner)


def __getattr__(name: str) -> Any:
    """Make the SGLang class on first access (create_backend, or a test importing it)."""
    if name in _SGLANG_CLASSES:
        with _define_lock:
            if name not in globals():
                _define_sglang_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _define_sglang_classes() -> None:
    try:
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    except ImportError as e:
        raise ImportError(f"{__name__}.FiAttnBackend subclasses SGLang's AttentionBackend and needs SGLang 0.5.15 "
                          f"installed ({e})") from e
    # Ours first in the MRO: our methods override SGLang's defaults; SGLang's forward() dispatches
    # (idle -> empty output, decode -> forward_decode, everything else -> forward_extend).
    globals()["FiAttnBackend"] = type("FiAttnBackend", (_Backend, AttentionBackend),
                                      {"__module__": __name__, "__doc__": _Backend.__doc__})


def _sglang_class(name: str) -> type:
    return globals()[name] if name in globals() else __getattr__(name)


def plan_counts() -> dict:
    """Plans made in this process per kernel, {"decode": n, "prefill": m, ...} (one per layer group per
    step), and "graph_steps": steps planned for a decode CUDA-graph capture or replay (tests and debugging)."""
    return dict(_PLAN_COUNTS)


def check_errors() -> None:
    """Raise RuntimeError if an fi-backend kernel of this process met an out-of-range KV index or slot since
    the last check. Synchronises the GPU: for tests and debugging, never per step."""
    for wrapper in list(_wrappers):
        wrapper.check_errors()
    _ops.check_append_errors()


# ------------------------------------------------------------------------------------ layer settings

@dataclass(frozen=True)
class LayerSettings:
    """What the layers that share a plan must agree on (a RadixAttention's attention settings)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    window_left: Optional[int]      # SGLang's sliding_window_size when >= 0 (q_pos - kv_pos <= window_left)
    soft_cap: float                 # logit_cap (tanh), 0 = none
    # False: encoder-only attention (BERT-like embedding models): each prompt's tokens see all of its tokens, over the
    # step's own K / V (no KV cache read or written)
    causal: bool = True

    def variant(self):
        """(fi_backend Variant, plan parameters), through the vLLM adapter's layer_variant (whose
        sliding_window counts the query itself: window_left + 1)."""
        from fi_backend.adapters.vllm import layer_variant
        window = None if self.window_left is None else self.window_left + 1
        return layer_variant(None, window, self.soft_cap or None)

    def describe(self) -> str:
        extra = ""
        if self.window_left is not None:
            extra += f", sliding window {self.window_left}"
        if self.soft_cap:
            extra += f", soft-cap {self.soft_cap:g}"
        if not self.causal:
            extra += ", encoder-only (non-causal, each step's own K / V)"
        return (f"{self.num_qo_heads} query / {self.num_kv_heads} KV heads, head_dim {self.head_dim}, "
                f"scale {self.sm_scale:.6g}{extra}")


def _value(x) -> Any:
    return getattr(x, "value", x)


def layer_settings(layer) -> tuple:
    """(LayerSettings, reasons) of an SGLang RadixAttention: reasons lists what fi-backend cannot run."""
    reasons = []
    lid = getattr(layer, "layer_id", "?")
    hq, hkv, d = int(layer.tp_q_head_num), int(layer.tp_k_head_num), int(layer.head_dim)
    attn_type = str(_value(getattr(layer, "attn_type", "decoder"))).lower()
    encoder_only = attn_type == "encoder_only"
    if getattr(layer, "is_cross_attention", False):
        reasons.append(f"layer {lid}: cross-attention is not supported (fi-backend runs decoder self-attention)")
    elif attn_type not in ("decoder", "encoder_only"):
        reasons.append(f"layer {lid}: attention type {attn_type} is not supported (fi-backend runs causal decoder "
                       "and encoder-only self-attention: no bidirectional decoder attention)")
    if d not in HEAD_SIZES:
        reasons.append(f"layer {lid}: head size {d} is not supported (fi-backend: {', '.join(map(str, HEAD_SIZES))})")
    v_dim = getattr(layer, "v_head_dim", d)
    if v_dim != d or getattr(layer, "qk_head_dim", d) != d:
        reasons.append(f"layer {lid}: query/key head size {getattr(layer, 'qk_head_dim', d)} and value head size "
                       f"{v_dim} differ (fi-backend needs one head size)")
    if hkv < 1 or hq % hkv:
        reasons.append(f"layer {lid}: {hq} query heads are not a multiple of {hkv} KV heads")
    if getattr(layer, "tp_v_head_num", hkv) != hkv:
        reasons.append(f"layer {lid}: {layer.tp_v_head_num} value heads but {hkv} key heads")
    cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
    if cap > 0 and getattr(layer, "logit_capping_method", "tanh") != "tanh":
        reasons.append(f"layer {lid}: logit capping method {layer.logit_capping_method!r} is not supported "
                       "(fi-backend: tanh soft-cap)")
    if (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        reasons.append(f"layer {lid}: xai_temperature_len attention scaling is not supported")
    if getattr(layer, "use_irope", False):
        reasons.append(f"layer {lid}: chunked local attention (use_irope) is not supported")
    pos = getattr(layer, "pos_encoding_mode", "NONE")
    if pos not in (None, "NONE"):
        reasons.append(f"layer {lid}: pos_encoding_mode {pos!r} is not supported (apply RoPE before attention)")
    window = getattr(layer, "sliding_window_size", -1)
    window = None if window is None or int(window) < 0 else int(window)
    if encoder_only and window is not None:
        reasons.append(f"layer {lid}: encoder-only attention with a sliding window ({window}) is not supported (a "
                       "two-sided window; the kernels' windows look back only)")
    return LayerSettings(hq, hkv, d, float(layer.scaling), window, cap if cap > 0 else 0.0,
                         causal=not encoder_only), reasons


_LAYER_ATTRS = ("layer_id", "tp_q_head_num", "tp_k_head_num", "tp_v_head_num", "head_dim", "scaling",
                "sliding_window_size", "logit_cap")


def _attention_layers(model) -> list:
    """The model's RadixAttention modules (duck-typed by their attributes), in module order."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in _LAYER_ATTRS)]


# ------------------------------------------------------------------------------------ refusals

def deterministic(server_args) -> bool:
    """Deterministic (batch-invariant) attention: --enable-deterministic-inference or FI_BACKEND_DETERMINISTIC."""
    return bool(getattr(server_args, "enable_deterministic_inference", False)) or _env.flag(_env.DETERMINISTIC, False)


def _refusal_reasons(model_runner, layers: list) -> list:
    """Why fi-backend must not run this SGLang ModelRunner, one sentence per problem ([] = it can)."""
    reasons = []
    sa = model_runner.server_args
    mc = model_runner.model_config
    if getattr(model_runner, "use_mla_backend", False):
        reasons.append("MLA (multi-head latent attention) is not supported: fi-backend runs multi-head and "
                       "grouped-query attention")
    if getattr(mc, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models (cross-attention) are not supported")
    spec = getattr(model_runner, "spec_algorithm", None)
    if getattr(model_runner, "is_draft_worker", False) or (spec is not None and not spec.is_none()):
        reasons.append(f"speculative decoding (--speculative-algorithm {getattr(sa, 'speculative_algorithm', None)}) "
                       "is not supported yet: its target-verify and draft-extend steps have no fi-backend path")
    if deterministic(sa):
        if getattr(sa, "enable_mixed_chunk", False):
            reasons.append("--enable-mixed-chunk with deterministic inference is not supported: a mixed step's decodes "
                           "would run on the prefill kernel, so their results would follow their companions")
        if not getattr(sa, "disable_radix_cache", False) and any(layer_settings(layer)[0].window_left is not None
                                                                 for layer in layers):
            reasons.append("deterministic inference with the radix cache and sliding-window layers is not supported: "
                           "a cached prefix moves a window's first KV tile (pass --disable-radix-cache)")
    causal = {layer_settings(layer)[0].causal for layer in layers}
    if causal == {True, False}:
        reasons.append("models mixing encoder-only and decoder attention layers are not supported")
    if False in causal:   # encoder-only: whole prompts, one step each
        if not getattr(sa, "disable_radix_cache", False):
            reasons.append("encoder-only models need --disable-radix-cache: a cached prefix's K / V would come from a "
                           "KV cache these layers never write")
        chunk = int(getattr(sa, "chunked_prefill_size", 0) or 0)
        if chunk > 0:
            reasons.append(f"encoder-only models need --chunked-prefill-size -1: chunked prefill ({chunk} tokens a "
                           "step) can split a prompt over steps, and its later part would not see the earlier one")
    if getattr(sa, "enable_two_batch_overlap", False):
        reasons.append("--enable-two-batch-overlap is not supported (not tested with fi-backend)")
    if getattr(sa, "enable_pdmux", False):
        reasons.append("--enable-pdmux (PD multiplexing) is not supported (not tested with fi-backend)")
    if getattr(sa, "dllm_algorithm", None):
        reasons.append("diffusion LLMs (--dllm-algorithm) are not supported: their blocks attend bidirectionally")
    if getattr(sa, "enable_mis", False):
        reasons.append("multi-item scoring (--enable-mis) is not supported: it needs per-item masks")
    if (getattr(model_runner, "dcp_size", 1) or 1) > 1:
        reasons.append("decode context parallelism (--dcp-size > 1) is not supported")
    if (getattr(sa, "attn_cp_size", 1) or 1) > 1:
        reasons.append("attention context parallelism (--attn-cp-size > 1) is not supported")
    prefill_cg = getattr(getattr(getattr(sa, "cuda_graph_config", None), "prefill", None), "backend", None)
    if prefill_cg == "full":
        reasons.append("the experimental full prefill CUDA graph (cuda_graph_config prefill backend 'full') is not "
                       "supported: use breakable (the default), tc_piecewise or disabled")
    dtype = model_runner.dtype
    if dtype not in DTYPES:
        reasons.append(f"model dtype {dtype} is not supported (fi-backend: bfloat16, float16)")
    kv = model_runner.kv_cache_dtype
    if kv != dtype and kv != _FP8_DTYPE:
        reasons.append(f"KV-cache dtype {kv} is not supported with model dtype {dtype} (fi-backend: the model's "
                       "dtype, or fp8_e4m3 with per-tensor scales)")
    page = int(getattr(model_runner, "page_size", 1) or 1)
    if not 1 <= page <= MAX_PAGE_SIZE:
        reasons.append(f"page size {page} is not supported (fi-backend: 1..{MAX_PAGE_SIZE})")
    pool = model_runner.token_to_kv_pool
    if hasattr(pool, "translate_loc_from_full_to_swa"):
        reasons.append("the hybrid SWA KV pool is not supported: pass --disable-hybrid-swa-memory (fi-backend reads "
                       "sliding-window layers from the full pool)")
    if getattr(getattr(model_runner, "token_to_kv_pool_allocator", None), "translate_kv_loc", None) is not None:
        reasons.append("the unified (virtual-slot) KV memory pool is not supported")
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout not in ("nhd", "hnd"):
        reasons.append(f"KV-cache layout {layout!r} is not supported (fi-backend: nhd, hnd)")
    if torch.cuda.is_available() and str(getattr(model_runner, "device", "cuda")).startswith("cuda"):
        cap = torch.cuda.get_device_capability(getattr(model_runner, "gpu_id", None))
        if tuple(cap) not in COMPUTE_CAPABILITIES:
            reasons.append(f"compute capability {cap[0]}.{cap[1]} is not supported: fi-backend's kernels are built "
                           f"for {', '.join(f'{a}.{b}' for a, b in COMPUTE_CAPABILITIES)} (Ampere, Ada, Hopper)")
    sinks = [n for n, _ in model_runner.model.named_parameters() if n.rsplit(".", 1)[-1] in ("sinks", "attn_sinks")]
    if sinks:
        reasons.append(f"attention sinks ({sinks[0]}) are not supported")
    if not layers:
        reasons.append("the model has no RadixAttention layers")
    for layer in layers:
        reasons += layer_settings(layer)[1]
    return list(dict.fromkeys(reasons))   # once each, in order


# ------------------------------------------------------------------------------------ per-step plan

@dataclass
class _Group:
    """Layers sharing one plan per step: their settings, variant parameters and wrappers."""

    settings: LayerSettings
    params: dict
    decode: Any
    prefill: Any
    # Shared-prefix groups on: the prefill kernel with its own workspace for decode steps whose groups the planner
    # keeps. Not the eager prefill wrapper: a capture freezes a wrapper's tile member and BSR.
    graph_prefill: Any = None
    # A ragged prefill wrapper (BatchAttention(ragged=True)) for extend steps of new prompts only: its CuTe member
    # reads the step's own K / V rows (the paged member does not run at SGLang's pages of one). None: off.
    fresh: Any = None


@dataclass
class StepMetadata:
    """One step's attention metadata: the wrapper each layer group runs with, planned for num_rows rows."""

    kernel: str                 # the step's kind: "decode" (a query row a request) or "prefill"
    wrappers: tuple             # one per layer group, in group order (a grouped decode step: graph_prefill)
    num_rows: int               # query rows of the plan (the step's tokens; padded batch size in a graph)
    # Decode-graph steps with shared-prefix groups on: per layer group the other wrapper the graph launches into
    # the same output, planned idle (no items); () for eager steps, which run only `wrappers`.
    partners: tuple = ()
    # Per layer group, whether its wrapper is the fresh one (it reads the layer's k / v, not the pool); () if none
    fresh: tuple = ()
    # A fresh step's paged plan, made on demand for a layer that passes no k / v (it reads another layer's cache):
    # paged(group) plans that group's prefill wrapper over the pool and returns it
    paged: Any = None


def _cpu_int32(x, n: int, name: str) -> torch.Tensor:
    """SGLang's host-side lengths (a list or a CPU tensor) as a CPU int32 tensor of n entries."""
    if x is None:
        raise RuntimeError(f"fi-backend plans from SGLang's host-side lengths, and this batch has no {name} (SGLang "
                           "leaves them unset only for speculative decoding's GPU-only batches)")
    t = torch.as_tensor(x[:n])
    if t.device.type != "cpu":
        raise RuntimeError(f"{name} must be on the host (got {t.device}); reading it would synchronise the GPU")
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} entries for a batch of {n} requests")
    return t.to(torch.int32)


class _StepPlanner:
    """The per-step half of the backend: a ForwardBatch (or SGLang's replay view of one) -> BSR -> plan().

    It reads SGLang's batch fields only, so it is tested without SGLang. All device arrays of the BSR
    are this planner's persistent buffers (or req_to_token itself), sliced per step."""

    def __init__(self, groups: list, req_to_token: torch.Tensor, *, page_size: int, max_requests: int,
                 debug: bool = False, deterministic: bool = False, shared_prefix: bool = False):
        if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2:
            raise TypeError(f"SGLang's req_to_token must be a 2-D int32 tensor, got {req_to_token.dtype} "
                            f"{tuple(req_to_token.shape)}")
        if req_to_token.shape[1] > 1 and req_to_token.stride(1) != 1:
            raise ValueError(f"SGLang's req_to_token must have contiguous rows, got strides {req_to_token.stride()}")
        self.groups = groups
        self.req_to_token = req_to_token
        self.page_size = int(page_size)
        self.debug = debug
        self.deterministic = deterministic
        self.shared_prefix = shared_prefix and not deterministic  # composable formats (docs/composable.md)
        self.max_requests = 0
        self._fresh_rows = RaggedRows()
        self.encoder_only = any(not g.settings.causal for g in groups)
        self.resize(max_requests)

    def resize(self, max_requests: int) -> None:
        """(Re)allocate the persistent buffers for batches of up to max_requests requests. Only before a
        CUDA graph is captured: the captured runs read the buffers by address."""
        dev = self.req_to_token.device
        n = max(int(max_requests), 1)
        rows, max_len = self.req_to_token.shape
        P = self.page_size
        if P == 1:
            t = self.req_to_token
            span = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
            self._kv_indices = t.as_strided((span,), (1,))   # the whole table, zero-copy
            self._row_stride = t.stride(0)
            self._kv_block_start = torch.zeros(n, dtype=torch.int64, device=dev)
            self._page_table = None
        else:
            cols = -(-max_len // P)
            self._page_table = torch.zeros(n, cols, dtype=torch.int32, device=dev)
            self._kv_indices = self._page_table.view(-1)
            self._kv_block_start = torch.arange(n, dtype=torch.int64, device=dev) * cols
        self._kv_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self._qo_indptr = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self._qo_decode = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._qo_decode_cpu = torch.arange(n + 1, dtype=torch.int32)
        self.max_requests = n

    def _prefix_groups(self, fb, qo_cpu: torch.Tensor, kv_cpu: torch.Tensor):
        """The step's shared-prefix groups, from what the ForwardBatch.init_new hook found in the radix tree for this
        batch (matched by its out_cache_loc, which a graph replay view also carries): neighbours' shared tokens
        capped at both ones' cached tokens (kv_len - q_len), in whole pages, runs of them by
        prefix_groups_from_links. Rows past the batch the hook saw (graph padding) are in no group. None:
        single-format."""
        shares = _STEP.shares
        if not self.shared_prefix or shares is None or _STEP.loc is not getattr(fb, "out_cache_loc", None):
            return None
        n = shares.size + 1
        if n > kv_cpu.numel():
            return None
        cached = (kv_cpu[:n] - (qo_cpu[1: n + 1] - qo_cpu[:n])).numpy()
        common = np.minimum(shares, np.minimum(cached[:-1], cached[1:])) // self.page_size
        groups = prefix_groups_from_links(common, self.page_size)
        return groups if len(groups) else None

    def plan(self, fb, graph: bool = False) -> Optional[StepMetadata]:
        """Plan this step for every layer group; None for an idle (empty) step. graph: a decode-graph capture or
        replay, whose graph launches both decode-step wrappers of a group when it has graph_prefill."""
        mode = fb.forward_mode
        bs = int(fb.batch_size or 0)
        if mode.is_idle() or bs == 0:
            return None
        if bs > self.max_requests:
            raise ValueError(f"fi-backend: a step of {bs} requests exceeds the {self.max_requests} the backend was "
                             "sized for (SGLang's request pool)")
        kv_cpu = _cpu_int32(fb.seq_lens_cpu, bs, "seq_lens_cpu")
        if mode.is_decode():
            decode = True
        elif mode.is_extend() and not (mode.is_target_verify() or mode.is_draft_extend_v2() or mode.is_dllm_extend()
                                       or mode.is_split_prefill()):
            q_lens = _cpu_int32(fb.extend_seq_lens_cpu, bs, "extend_seq_lens_cpu")
            # deterministic: an extend row always on the prefill kernel, whatever its companions' lengths; encoder-only
            # layers: one-token prompts are prompts all the same
            decode = not self.deterministic and not self.encoder_only and bool((q_lens == 1).all())
        else:
            raise NotImplementedError(f"fi-backend does not run SGLang forward mode {mode.name}")
        if self.encoder_only:   # no KV cache holds these layers' earlier tokens
            if decode:
                raise ValueError(f"fi-backend: encoder-only attention runs prompts, not decode steps (SGLang forward "
                                 f"mode {mode.name}): an embedding model generates no tokens")
            why = whole_prompts_refusal(kv_cpu, q_lens, "a radix-cache hit or a chunked prompt: pass "
                                        "--disable-radix-cache --chunked-prefill-size -1")
            if why:
                raise ValueError(why)
        if decode:   # one query row per request: the constant arange (also what captured graphs read)
            kernel, qo_cpu, qo_dev = "decode", self._qo_decode_cpu[: bs + 1], self._qo_decode[: bs + 1]
        else:
            kernel = "prefill"
            qo_cpu = torch.zeros(bs + 1, dtype=torch.int32)
            torch.cumsum(q_lens, 0, dtype=torch.int32, out=qo_cpu[1:])
            qo_dev = self._qo_indptr[: bs + 1]
            torch.cumsum(fb.extend_seq_lens[:bs], 0, dtype=torch.int32, out=self._qo_indptr[1: bs + 1])
        self._write_kv_rows(fb.req_pool_indices[:bs], fb.seq_lens[:bs], kv_cpu)
        bsr = BSR(qo_indptr=qo_dev, kv_indices=self._kv_indices, kv_block_start=self._kv_block_start[:bs],
                  kv_lens=self._kv_lens[:bs], block_width=self.page_size)
        groups = self._prefix_groups(fb, qo_cpu, kv_cpu) if self.shared_prefix else None
        # new prompts only (no cached token): the groups' fresh wrappers, over the layers' own k / v
        fresh_step = (not decode and not graph and not self.deterministic and groups is None
                      and bool(torch.equal(kv_cpu, q_lens)))
        wrappers, partners, fresh = [], [], []
        for g in self.groups:
            if not g.settings.causal:   # encoder-only: every step on the ragged wrapper, non-causal
                g.fresh.plan(qo_cpu, kv_cpu, self._fresh_rows.bsr(qo_dev, self._kv_lens[:bs], int(qo_cpu[bs])),
                             causal=False, sm_scale=g.settings.sm_scale, debug=self.debug, **g.params)
                _PLAN_COUNTS["prefill"] += 1
                _PLAN_COUNTS["encoder_only"] += 1
                wrappers.append(g.fresh)
                fresh.append(True)
                continue
            kw = dict(causal=True, sm_scale=g.settings.sm_scale, debug=self.debug, **g.params)
            if fresh_step and g.fresh is not None and g.fresh.cute_takes(q_lens, kv_cpu, **g.params):
                g.fresh.plan(qo_cpu, kv_cpu, self._fresh_rows.bsr(qo_dev, self._kv_lens[:bs], int(qo_cpu[bs])), **kw)
                _PLAN_COUNTS["prefill"] += 1
                _PLAN_COUNTS["fresh"] += 1
                wrappers.append(g.fresh)
                fresh.append(True)
                continue
            fresh.append(False)
            if not decode:
                g.prefill.plan(qo_cpu, kv_cpu, bsr, prefix_groups=groups, **kw)
                _PLAN_COUNTS["prefill"] += 1
                _PLAN_COUNTS["grouped_extend"] += groups is not None and g.prefill.plan_info.shared_groups > 0
                wrappers.append(g.prefill)
                continue
            if g.graph_prefill is None:   # no groups: the decode wrapper alone
                g.decode.plan(qo_cpu, kv_cpu, bsr, **kw)
                _PLAN_COUNTS["decode"] += 1
                w = g.decode
            else:
                w, other = plan_decode_step(g.decode, g.graph_prefill, qo_cpu, kv_cpu, bsr, groups, kw, _PLAN_COUNTS,
                                            plan_other=graph)
                if other is not None:   # the graph launches both: the other one runs no items
                    partners.append(other)
            wrappers.append(w)
        paged = None
        if any(fresh):
            planned = set()   # the groups whose prefill wrapper this step has planned (once each)

            def plan_paged(i, qo_cpu=qo_cpu, kv_cpu=kv_cpu, bsr=bsr):
                g = self.groups[i]
                if i not in planned:
                    planned.add(i)
                    g.prefill.plan(qo_cpu, kv_cpu, bsr, causal=True, sm_scale=g.settings.sm_scale, debug=self.debug,
                                   **g.params)
                    _PLAN_COUNTS["prefill"] += 1
                return g.prefill
            paged = plan_paged
        return StepMetadata(kernel=kernel, wrappers=tuple(wrappers), num_rows=int(qo_cpu[bs]), partners=tuple(partners),
                            fresh=tuple(fresh) if any(fresh) else (), paged=paged)

    def _write_kv_rows(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, kv_cpu: torch.Tensor) -> None:
        """The step's KV lengths and rows into the persistent buffers (device ops, no synchronisation)."""
        bs = kv_cpu.numel()
        self._kv_lens[:bs].copy_(seq_lens)
        if self._page_table is None:
            torch.mul(req_pool_indices, self._row_stride, out=self._kv_block_start[:bs])
        else:
            P = self.page_size
            cols = min(-(-int(kv_cpu.max()) // P), self._page_table.shape[1])
            # first slot of each page the step needs, for the step's rows only: [bs, cols] gathered
            firsts = self.req_to_token[:, : cols * P: P].index_select(0, req_pool_indices.to(torch.int64))
            torch.floor_divide(firsts, P, out=self._page_table[:bs, :cols])


def _make_wrapper(kernel: str, *, device, settings: LayerSettings, variant, q_dtype, kv_dtype, page_size: int,
                  kv_layout: str, max_requests: int, max_rows: int, deterministic: bool = False,
                  shared_prefix: bool = False, prefix_groups_only: bool = False, ragged: bool = False):
    """A BatchAttention of one kernel with its own workspace, sized once for the engine's limits (shared_prefix:
    partial rows for the groups of up to SHARED_PREFIX_MAX_REQUESTS requests; prefix_groups_only: graph_prefill,
    BatchAttention.for_prefix_groups; ragged: a fresh wrapper, over K / V rows)."""
    from fi_backend.wrappers import BatchAttention
    hq, hkv, d = settings.num_qo_heads, settings.num_kv_heads, settings.head_dim
    ws = BatchAttention.workspace_for(device, hq, hkv, d, max_requests=max_requests, max_tokens=max_rows,
                                      q_dtype=q_dtype, kv_dtype=kv_dtype, variant=variant, kernel=kernel,
                                      deterministic=deterministic, shared_prefix=shared_prefix,
                                      shared_prefix_requests=SHARED_PREFIX_MAX_REQUESTS)
    wrapper = BatchAttention(ws, hq, hkv, d, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=1 if ragged else page_size,
                             kv_layout="NHD" if ragged else kv_layout, variant=variant, kernel=kernel,
                             deterministic=deterministic, ragged=ragged)
    wrapper.graphs_keep_request_count = True   # decode graphs replay with the padded batch they were captured at
    if prefix_groups_only:
        wrapper.for_prefix_groups()
    _wrappers.add(wrapper)
    return wrapper


def _tp_words(model_runner) -> str:
    """", tensor-parallel rank r of n" when SGLang splits the model over n > 1 GPUs, else ""."""
    n = int(getattr(model_runner, "tp_size", 1) or 1)
    return f", tensor-parallel rank {getattr(model_runner, 'tp_rank', '?')} of {n}" if n > 1 else ""


def _prefill_rows(model_runner, max_requests: int) -> int:
    """Query rows an extend step may have: a prefill budget (chunked_prefill_size, max_prefill_tokens, the
    largest prefill CUDA-graph size; the context length when chunked prefill is off) plus one decode row
    per request of a mixed batch."""
    sa = model_runner.server_args
    chunk = int(getattr(sa, "chunked_prefill_size", 0) or 0)
    rows = max(chunk, int(getattr(sa, "max_prefill_tokens", 0) or 0))
    prefill_cg = getattr(getattr(sa, "cuda_graph_config", None), "prefill", None)
    rows = max([rows] + [int(x) for x in (getattr(prefill_cg, "bs", None) or [])])
    if chunk <= 0:
        rows = max(rows, int(model_runner.model_config.context_len))
    return max(rows, 1) + max_requests


# ------------------------------------------------------------------------------------ the backend

class _Backend:
    """fi-backend's SGLang AttentionBackend: one plan per step per layer group; decode in CUDA graphs."""

    needs_cpu_seq_lens = True   # plans come from seq_lens_cpu (SGLang's default contract)

    def __init__(self, model_runner):
        super().__init__()
        layers = _attention_layers(model_runner.model)
        reasons = _refusal_reasons(model_runner, layers)
        if reasons:
            raise ValueError("fi-backend cannot run this model in SGLang: " + "; ".join(reasons))
        self.device = rank_device(model_runner.device, getattr(model_runner, "gpu_id", None))
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = int(getattr(model_runner, "page_size", 1) or 1)
        self.kv_layout = "HND" if getattr(self.token_to_kv_pool, "kv_cache_layout", "nhd") == "hnd" else "NHD"
        self.q_dtype = model_runner.dtype
        self.kv_dtype = model_runner.kv_cache_dtype
        self._fp8 = self.kv_dtype == _FP8_DTYPE
        self._model_runner = model_runner
        write = (os.environ.get(KV_WRITE_ENV) or "sglang").strip().lower()
        if write not in _KV_WRITES:
            raise ValueError(f"{KV_WRITE_ENV}={write!r}: expected one of {_KV_WRITES}")
        if write == "append" and type(self.token_to_kv_pool).__name__ != "MHATokenToKVPool":
            _log.warning("fi-backend: %s=append needs SGLang's plain MHATokenToKVPool, this model has %s: writing "
                         "K/V with its set_kv_buffer", KV_WRITE_ENV, type(self.token_to_kv_pool).__name__)
            write = "sglang"
        self.kv_write = write

        # Layer groups: one plan per step each.
        keys: dict = {}
        self._layer_group: dict = {}
        for layer in layers:
            s, _ = layer_settings(layer)
            self._layer_group[int(layer.layer_id)] = keys.setdefault(s, len(keys))
        self._group_keys = list(keys)
        self._max_requests = int(self.req_to_token.shape[0])
        # composable formats (docs/composable.md): groups from the radix tree, on with FI_BACKEND_SHARED_PREFIX=1
        self.shared_prefix = (_env.flag(_env.SHARED_PREFIX, SGLANG_SHARED_PREFIX_DEFAULT)
                              and not deterministic(model_runner.server_args))
        self._groups = self._make_groups(self._max_requests)
        self._planner = _StepPlanner(self._groups, self.req_to_token, page_size=self.page_size,
                                     max_requests=self._max_requests, debug=os.environ.get(DEBUG_ENV) == "1",
                                     deterministic=deterministic(model_runner.server_args),
                                     shared_prefix=self.shared_prefix)
        if self.shared_prefix:
            global _shared_prefix_backends
            _shared_prefix_backends += 1
        self._kv_views: dict = {}
        self.forward_metadata: Optional[StepMetadata] = None
        _log.info("fi-backend attention is active (SGLang backend %s) on %s%s: %d layers in %d group(s) [%s], page %d, "
                  "KV %s (%s), KV write %s; decode + prefill kernels, one plan per step per group; CUDA graphs for "
                  "decode; shared-prefix groups %s", BACKEND_NAME, self.device, _tp_words(model_runner), len(layers),
                  len(self._groups), "; ".join(s.describe() for s in self._group_keys), self.page_size,
                  str(self.kv_dtype).replace("torch.", ""), self.kv_layout, self.kv_write,
                  "from the radix tree" if self.shared_prefix
                  else f"off (opt-in: {_env.SHARED_PREFIX}=1; never in deterministic mode)")

    # -------------------------------------------------------------------------------- setup

    def _make_groups(self, max_requests: int) -> list:
        mr = self._model_runner
        rows = _prefill_rows(mr, max_requests)
        groups = []
        for s in self._group_keys:
            variant, params = s.variant()
            what = f"{s.describe()}, KV {str(self.kv_dtype).replace('torch.', '')}, variant {variant.name}"
            common = dict(device=self.device, settings=s, variant=variant, q_dtype=self.q_dtype, kv_dtype=self.kv_dtype,
                          page_size=self.page_size, kv_layout=self.kv_layout, max_requests=max_requests,
                          deterministic=deterministic(mr.server_args))
            if not s.causal:
                groups.append(self._encoder_only_group(s, variant, params, common, rows, what))
                continue
            shared = self.shared_prefix
            # steps of new prompts on the ragged CuTe member, over the layers' own k / v (docs/prefill.md)
            fresh_on = (_env.flag(_env.PREFILL_FRESH, True) and not common["deterministic"]
                        and _cute_member.unsupported(variant, s.head_dim, self.q_dtype, self.kv_dtype, 0,
                                                     self.device) is None)
            try:
                # every module the wrappers load, built in parallel first (the CuTe member's take about 40 s each)
                from fi_backend.wrappers import BatchAttention
                BatchAttention.prepare(s.num_qo_heads, s.num_kv_heads, s.head_dim, q_dtype=self.q_dtype,
                                       kv_dtype=self.kv_dtype, page_size=self.page_size, variant=variant,
                                       deterministic=common["deterministic"], device=self.device,
                                       also_ragged=fresh_on)
                decode = _make_wrapper("decode", max_rows=max_requests, shared_prefix=shared, **common)
                prefill = _make_wrapper("prefill", max_rows=rows, shared_prefix=shared, **common)
                graph_prefill = _make_wrapper("prefill", max_rows=max_requests, shared_prefix=True,
                                              prefix_groups_only=True, **common) if shared else None
                fresh = _make_wrapper("prefill", max_rows=rows, ragged=True, **common) if fresh_on else None
            except Exception as e:  # a build failure or a refused shape: say which, at start-up
                raise RuntimeError(f"fi-backend cannot run this model's attention ({what}): {e}") from e
            names = decode.module_names + prefill.module_names + (fresh.module_names if fresh is not None else [])
            for name in names:
                _log.info("fi-backend: kernel module %s ready (%s) on %s", name, what, self.device)
            if fresh is not None:
                _log.info("fi-backend: extend steps of new prompts read their own K / V (the ragged CuTe member) "
                          "(%s) on %s", what, self.device)
            groups.append(_Group(s, params, decode, prefill, graph_prefill, fresh))
        return groups

    def _encoder_only_group(self, s: LayerSettings, variant, params: dict, common: dict, rows: int,
                            what: str) -> "_Group":
        """Encoder-only layers: one ragged prefill wrapper over each step's own K / V (in the model's dtype, rows of
        one token), non-causal, on the CuTe member where it takes the step, else the tile family. No decode or paged
        wrappers: these layers neither read nor write the KV cache."""
        from fi_backend.wrappers import BatchAttention
        common = {**common, "kv_dtype": self.q_dtype, "page_size": 1}
        try:
            BatchAttention.prepare(s.num_qo_heads, s.num_kv_heads, s.head_dim, kinds=("prefill",), q_dtype=self.q_dtype,
                                   kv_dtype=self.q_dtype, page_size=1, ragged=True, variant=variant,
                                   deterministic=common["deterministic"], device=self.device)
            wrapper = _make_wrapper("prefill", max_rows=rows, ragged=True, **common)
        except Exception as e:  # a build failure or a refused shape: say which, at start-up
            raise RuntimeError(f"fi-backend cannot run this model's attention ({what}): {e}") from e
        member = ("the CuTe member where it takes a step" if getattr(wrapper, "cute_unsupported", None) is None
                  else f"the tile family (no CuTe member: {wrapper.cute_unsupported})")
        _log.info("fi-backend: encoder-only attention (%s) over each step's own K / V, non-causal, on %s, on %s",
                  what, member, self.device)
        for name in wrapper.module_names:
            _log.info("fi-backend: kernel module %s ready (%s) on %s", name, what, self.device)
        return _Group(s, params, None, None, None, wrapper)

    def _group_of(self, layer) -> int:
        g = self._layer_group.get(int(layer.layer_id))
        if g is None:   # a layer not found at start-up: it must match a planned group
            s, reasons = layer_settings(layer)
            if reasons or s not in self._group_keys:
                raise RuntimeError(f"fi-backend: layer {layer.layer_id} ({s.describe()}) was not among the model's "
                                   "attention layers at start-up, so no plan covers it" + (
                                       f" ({'; '.join(reasons)})" if reasons else ""))
            g = self._layer_group[int(layer.layer_id)] = self._group_keys.index(s)
        return g

    def _kv(self, layer_id: int):
        """The layer's (k, v) cache pair as the kernels read it, made once per layer (fp8 pools hand out a
        new view of their uint8 storage on every call; P > 1 NHD slot buffers are viewed as pages)."""
        pool = self.token_to_kv_pool
        k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        key = (k.data_ptr(), v.data_ptr(), k.dtype, tuple(k.shape))
        hit = self._kv_views.get(layer_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        if self._fp8 and k.dtype != _FP8_DTYPE:
            k, v = k.view(_FP8_DTYPE), v.view(_FP8_DTYPE)
        if self.page_size > 1 and k.dim() == 3:   # NHD slots [size + P, H, D] -> pages [n, P, H, D]
            if k.shape[0] % self.page_size:
                raise ValueError(f"fi-backend: the KV pool has {k.shape[0]} slots, not a multiple of the page size "
                                 f"{self.page_size}")
            k = k.view(-1, self.page_size, *k.shape[1:])
            v = v.view(-1, self.page_size, *v.shape[1:])
        pair = (k, v)
        self._kv_views[layer_id] = (key, pair)
        return pair

    # -------------------------------------------------------------------------------- metadata

    def init_forward_metadata(self, forward_batch) -> None:
        """Eager entry point, once per step: plan every layer group."""
        self.forward_metadata = self._planner.plan(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Before decode graphs are captured: make sure the persistent buffers and the workspaces hold the
        largest captured batch (they are normally sized for SGLang's whole request pool already)."""
        if max_bs > self._max_requests:
            self._max_requests = int(max_bs)
            self._groups[:] = self._make_groups(self._max_requests)
            self._planner.resize(self._max_requests)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Before each decode-graph capture (in_capture) and each replay: plan the padded batch into the
        same buffers and workspace sections the captured run() reads. SGLang's replay view carries the padded
        req_pool_indices / seq_lens / seq_lens_cpu of the captured batch size."""
        self.forward_metadata = self._planner.plan(forward_batch, graph=True)
        _PLAN_COUNTS["graph_steps"] += 1

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Nothing to record in the graph: the plan is made out of it."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1   # padded requests read one valid slot (pool row 0's first) and write slot 0

    # -------------------------------------------------------------------------------- forward

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs, out=None)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        # Under SGLang's piecewise / breakable prefill graphs the layer hands its output buffer over.
        out = getattr(forward_batch, "_attn_output", None)
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs, out=out)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs, out):
        unknown = sorted(name for name, value in kwargs.items() if value is not None)
        if unknown:
            raise NotImplementedError(f"fi-backend does not support the attention arguments {unknown} (layer "
                                      f"{layer.layer_id})")
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("fi-backend: attention ran without a plan for this step (init_forward_metadata was not "
                               "called, or the step is idle)")
        g = self._group_of(layer)
        wrapper = md.wrappers[g]
        fresh = bool(md.fresh) and md.fresh[g]
        encoder_only = not self._group_keys[g].causal
        if encoder_only and (k is None or v is None):
            raise ValueError(f"fi-backend: encoder-only layer {layer.layer_id} passed no key / value (its attention "
                             "reads the step's own K / V; there is no KV cache to read)")
        if fresh and k is None:   # a layer reading another's cache in a step of new prompts: the pool, planned now
            wrapper, fresh = md.paged(g), False
        if k is not None and not encoder_only:   # encoder-only layers keep no KV cache
            if not save_kv_cache:
                raise NotImplementedError("fi-backend reads K/V from the KV cache: a layer that passes K/V without "
                                          f"saving them (layer {layer.layer_id}) is not supported")
            self._write_kv(layer, forward_batch, k, v)
        hq, d = layer.tp_q_head_num, layer.head_dim
        try:
            q3 = q.view(-1, hq, d)
        except RuntimeError:
            q3 = q.reshape(-1, hq, d)
        if q3.stride(2) != 1 or (q3.stride(0) | q3.stride(1)) & 7 or q3.data_ptr() & 15:
            q3 = q3.contiguous()   # the kernels read 16-byte aligned rows and heads
        rows = q3.shape[0]
        n = md.num_rows
        if rows < n:
            raise RuntimeError(f"fi-backend: {rows} query rows for a plan of {n}")
        if out is not None and tuple(out.shape) in ((rows, hq * d), (rows, hq, d)) and out.dtype == q.dtype:
            o3 = out.view(rows, hq, d)
        else:
            o3 = torch.empty((rows, hq, d), dtype=q.dtype, device=q.device)
        if rows != n:   # rows past the plan (padding): zeros, so no garbage reaches the residual stream
            q3, o_run = q3[:n], o3[:n]
            o3[n:].zero_()
        else:
            o_run = o3
        if fresh:   # new prompts (or encoder-only): their own K / V rows [tokens, KV heads, D], 16-bit: no scales
            ks = vs = 1.0
            hkv = layer.tp_k_head_num
            kv = (k.view(-1, hkv, d)[:n].unsqueeze(1), v.view(-1, hkv, d)[:n].unsqueeze(1))
        else:
            ks = layer.k_scale_float if self._fp8 and getattr(layer, "k_scale_float", None) is not None else 1.0
            vs = layer.v_scale_float if self._fp8 and getattr(layer, "v_scale_float", None) is not None else 1.0
            kv = self._kv(layer.layer_id)
        wrapper.run(q3, kv, out=o_run, k_scale=ks, v_scale=vs)
        if md.partners:   # a decode graph launches both wrappers; the idle one writes nothing
            md.partners[g].run(q3, kv, out=o_run, k_scale=ks, v_scale=vs)
        return o3.view(rows, hq * d)

    def _write_kv(self, layer, forward_batch, k, v) -> None:
        """The step's K/V [tokens, kv_heads, D] into the pool at out_cache_loc (padding tokens at slot 0)."""
        loc = forward_batch.out_cache_loc
        if self.kv_write == "append":
            _ops.append_paged_kv_cache(k, v, self._kv(layer.layer_id), loc, kv_layout=self.kv_layout,
                                       k_scale=layer.k_scale if self._fp8 else None,
                                       v_scale=layer.v_scale if self._fp8 else None)
        else:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v, layer.k_scale, layer.v_scale)
