"""Environment variables read by fi-backend, in one place (each is read when used, not at import).

FI_BACKEND_CACHE_DIR        directory of built kernel modules (default: ~/.cache/fi_backend/<version>/<archs>)
FI_BACKEND_CUDA_ARCH_LIST   architectures to build for, e.g. "90a" or "9.0a;10.0a" (default: the current GPU)
FI_BACKEND_NVCC             nvcc to use (default: $CUDA_HOME/bin/nvcc, then nvcc on PATH, then /usr/local/cuda)
FI_BACKEND_NVCC_FLAGS       extra nvcc flags for every module built (space-separated; part of each module's identity,
                            so such modules are cached and loaded apart; for experiments: perf/tools/timeline.py,
                            `perf composable --build`)
FI_BACKEND_JIT              "0": never compile; load only modules already in the cache (any nvcc built them)
FI_BACKEND_QUIET            "1": no "fi-backend: building ..." lines on stderr
FI_BACKEND_KV_TMA           "0": the warp-specialised prefill kernel gathers every KV tile with cp.async; by
                            default it copies whole tiles of consecutive tokens (ragged K/V, pages in order)
                            by TMA (read once per process by each kernel module, in C:
                            csrc/attention/attention_module.cu)
FI_BACKEND_PLAN_GROUPED     "0": prefill plans place all items longest first (LPT); by default steps of two
                            requests or more go request by request (fi_backend.scheduler.plan_into's
                            group_requests; read when a wrapper is made)
FI_BACKEND_PLAN_WINDOW      "0": a causal sliding window's prefill tiles are planned at the cost of their whole
                            KV prefix; by default at that of their window (plan_into's kv_window; read when a
                            wrapper is made)
FI_BACKEND_PLAN_PARTITION   "0": plans are always LPT over the chunk search's split; by default a partition
                            (pairs filling CTA after CTA up to a cap, cut where it falls) replaces an LPT plan
                            over 2% above the bound when its makespan is lower (plan_into's partition; read
                            at each plan, for A/B runs; docs/planner.md)
FI_BACKEND_PLAN_SHARED_GAIN a float >= 0: the shared-prefix verdict's factor instead of SHARED_GAIN (0 keeps every
                            group that saves any KV; plan_into's shared_gain; read at each plan, for experiments:
                            perf composable's cells with the verdict forced)
FI_BACKEND_PLAN_DECODE_COST_Q a float > 0: the decode planner's cost of a query row, in KV tokens, instead of the
                            kernel's KV tile (how eagerly plans split KV; read when a wrapper is made, for
                            experiments: perf/tools/decode_shapes.py's "cost_q")
FI_BACKEND_PLAN_GROUP_ITEM_MIN a float >= 0: the least an item costs a prefill plan, in KV tokens, in steps with
                            shared-prefix groups, instead of PREFILL_GROUP_ITEM_MIN_TILES KV tiles (read when a
                            wrapper is made, for experiments: perf composable --group-item-mins)
FI_BACKEND_DETERMINISTIC    "1": wrappers made without a deterministic= argument plan deterministically (a
                            request's KV splits and merge order depend on that request alone: batch-invariant
                            outputs; read when a wrapper is made; docs/deterministic.md)
FI_BACKEND_SHARED_PREFIX    "0": the vLLM adapter plans every step single-format (by default it passes the
                            step's shared-prefix groups to plan(); read when its metadata builder is made) and its
                            opt-in worker (adapters/vllm_worker.py) leaves vLLM's runner as it is; "1":
                            the SGLang adapter finds groups in the radix tree (off by default there; read by its
                            register() and backend; composable formats, docs/composable.md)
FI_BACKEND_PREFILL_CUTE     "0": prefill wrappers do not load the CuTe member (FlashAttention-3's CTA,
                            fi_backend.cute_member) and run every step on the tile family; read when a wrapper is made
FI_BACKEND_PREFILL_STAGE    "0": the CuTe member reads every paged step's pages (by default it copies the pages of
                            steps whose keys many queries read into rows for its ragged CTA: cute_member.STAGE_*);
                            read when a wrapper is made
FI_BACKEND_PREFILL_FRESH    "0": the adapters run steps of new prompts over the KV cache like every other step (by
                            default they run them on the ragged CuTe member over the layers' own key / value rows);
                            read when vLLM's metadata builder or SGLang's backend is made
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

CACHE_DIR = "FI_BACKEND_CACHE_DIR"
CUDA_ARCH_LIST = "FI_BACKEND_CUDA_ARCH_LIST"
NVCC = "FI_BACKEND_NVCC"
NVCC_FLAGS = "FI_BACKEND_NVCC_FLAGS"
JIT = "FI_BACKEND_JIT"
QUIET = "FI_BACKEND_QUIET"
KV_TMA = "FI_BACKEND_KV_TMA"
PLAN_GROUPED = "FI_BACKEND_PLAN_GROUPED"
PLAN_WINDOW = "FI_BACKEND_PLAN_WINDOW"
PLAN_PARTITION = "FI_BACKEND_PLAN_PARTITION"
PLAN_SHARED_GAIN = "FI_BACKEND_PLAN_SHARED_GAIN"
PLAN_DECODE_COST_Q = "FI_BACKEND_PLAN_DECODE_COST_Q"
PLAN_GROUP_ITEM_MIN = "FI_BACKEND_PLAN_GROUP_ITEM_MIN"
DETERMINISTIC = "FI_BACKEND_DETERMINISTIC"
VLLM_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"  # vLLM's own switch (the adapter and `fi-backend build --model` read it)
SHARED_PREFIX = "FI_BACKEND_SHARED_PREFIX"
PREFILL_CUTE = "FI_BACKEND_PREFILL_CUTE"
PREFILL_FRESH = "FI_BACKEND_PREFILL_FRESH"
PREFILL_STAGE = "FI_BACKEND_PREFILL_STAGE"

_FALSE = ("0", "false", "no", "off")


def get(name: str) -> Optional[str]:
    """The variable's value, or None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def flag(name: str, default: bool) -> bool:
    """A boolean variable: unset -> default; "0"/"false"/"no"/"off" -> False; anything else -> True."""
    value = get(name)
    if value is None:
        return default
    return value.lower() not in _FALSE


def number(name: str) -> Optional[float]:
    """A float variable (None: unset); a value that is not a number raises ValueError naming the variable."""
    value = get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def batch_invariant() -> bool:
    """Whether the environment asks for deterministic (batch-invariant) attention: VLLM_BATCH_INVARIANT read as
    vLLM reads it (an int, nonzero: on), or FI_BACKEND_DETERMINISTIC."""
    try:
        vllm_on = int(os.environ.get(VLLM_BATCH_INVARIANT, "0")) != 0
    except ValueError:
        vllm_on = False
    return vllm_on or flag(DETERMINISTIC, False)


@contextlib.contextmanager
def setting(name: str, value: Optional[str]):
    """The variable set to value inside the block (None: left as it is), restored after."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
