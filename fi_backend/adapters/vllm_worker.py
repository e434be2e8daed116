"""An opt-in vLLM 0.26 worker that gives fi-backend host block tables: `--worker-cls fi_backend.adapters.vllm_worker.Worker`.

Why. vLLM 0.26's V2 model runner (Llama's default) keeps the block table on the device only and never asks a backend
for cascade attention, so build() sees no host rows and fi-backend cannot find shared-prefix groups
(docs/composable.md, "Engines"). This worker's runner keeps a host mirror of the block ids and hands the step's rows
to fi-backend's metadata builders on the same thread, with no device work.

How (vLLM 0.26 source, paths under vllm/):
  Worker.init_device        v1/worker/gpu_worker.py:297. It builds the V2 runner at :402-410 from a local import of
                            v1/worker/gpu/model_runner.py's GPUModelRunner. After it, this worker changes that exact
                            class to its subclass (_runner_class): the subclass adds methods only and makes its state
                            in initialize_kv_cache, so nothing is built twice. The V1 runner (gpu_model_runner.py) is
                            left as it is: it already hands build() the cascade prefix (docs/composable.md).
  initialize_kv_cache       v1/worker/gpu/model_runner.py:411. The runner says it publishes tables
                            (adapter.provide_step_tables) before vLLM makes the metadata builders (:448,
                            init_attn_backend), so fi-backend's builders add graph_prefill. If one of them will read
                            the tables, the runner then mirrors the BlockTables (:451). Its append_block_ids
                            (v1/worker/gpu/block_table.py:107, called from add_requests :817 and update_requests :848)
                            is wrapped on this instance only, to write the same ids (the same bpk expansion) into the
                            host table, by request index.
  prepare_attn              v1/worker/gpu/model_runner.py:1055, called by execute_model at :1212 after prepare_inputs
                            made input_batch.idx_mapping_np (:896), and before model_state.prepare_attn (:1257) runs
                            every builder's build() (attn_utils.py:605-651). After vLLM's gather, the mirror and
                            idx_mapping_np go out (adapter.publish_step_tables, no copy of rows). They are keyed by the
                            data_ptr of the gathered device table that build() gets as block_table_tensor.
  execute_model             v1/worker/gpu/model_runner.py:1151. The published rows are cleared when it returns, so a
                            later build() (capture, dummy run, drafter) never reads a stale table.
Each tensor-parallel rank is a Worker in its own process and mirrors its own runner. FI_BACKEND_SHARED_PREFIX=0 (or a
backend other than fi-backend: no builder reads the tables) leaves the runner vLLM's own.

Importing this module imports no vLLM: Worker is made on first access (module __getattr__), as vLLM's
resolve_obj_by_qualname reads it. BlockTableMirror needs numpy only.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import numpy as np

from fi_backend import env as _env

__all__ = ["BlockTableMirror", "WORKER_CLASS_PATH"]   # and Worker, made on first access

WORKER_CLASS_PATH = f"{__name__}.Worker"
_log = logging.getLogger("vllm.fi_backend")
_define_lock = threading.Lock()


class BlockTableMirror:
    """A host copy of a vLLM V2 BlockTables' rows, one int32 table per KV-cache group, rows by request index.

    append() takes what BlockTables.append_block_ids takes and writes what it stages for the device: the ids,
    each expanded to bpk kernel blocks (b * bpk + k), from the row's current count or from 0 (overwrite, a row
    reused by a new request; its old tail is zeroed). rows() names one step's rows in batch order (no copy)."""

    def __init__(self, block_tables):
        self.bpk = [int(b) for b in block_tables.blocks_per_kv_block]
        shapes = [tuple(t.gpu.shape) for t in block_tables.block_tables]
        self.tables = [np.zeros(shape, dtype=np.int32) for shape in shapes]
        self.counts = np.zeros((len(shapes), shapes[0][0] if shapes else 0), dtype=np.int64)
        self._block_tables = block_tables

    def append(self, req_index: int, new_block_ids, overwrite: bool) -> None:
        for i, ids in enumerate(new_block_ids):
            row = self.tables[i][req_index]
            old = int(self.counts[i, req_index])
            start = 0 if overwrite else old
            ids = np.asarray(ids, dtype=np.int64)
            if self.bpk[i] > 1:
                ids = (ids[:, None] * self.bpk[i] + np.arange(self.bpk[i])).reshape(-1)
            end = start + ids.size
            if end > row.size:
                raise ValueError(f"request index {req_index}: {end} blocks for a block-table row of {row.size} "
                                 f"(KV-cache group {i})")
            row[start:end] = ids
            if end < old:   # a reused row: no ids of the request before
                row[end:old] = 0
            self.counts[i, req_index] = end

    def rows(self, idx_mapping_np) -> dict:
        """{device table key: StepRows} of the step's requests in batch order (idx_mapping_np), without copying
        rows: the planner reads only neighbours' leading ids."""
        from fi_backend.adapters.vllm import StepRows
        # build() gets input_block_tables[i][:rows] (a view from row 0): its data_ptr names group i, read each step
        # (vLLM reallocates those tables on a KV-cache wake-up)
        return {int(dev.data_ptr()): StepRows(table, idx_mapping_np)
                for table, dev in zip(self.tables, self._block_tables.input_block_tables)}


def _mirrored_append(original, mirror: BlockTableMirror):
    """BlockTables.append_block_ids that also writes the host mirror."""

    def append_block_ids(req_index: int, new_block_ids, overwrite: bool) -> None:
        original(req_index, new_block_ids, overwrite)
        mirror.append(req_index, new_block_ids, overwrite)

    return append_block_ids


def _runner_class(base: type) -> type:
    """The V2 model runner with host block tables (module docstring), as a subclass of vLLM's `base`."""
    from fi_backend.adapters import vllm as adapter

    class FiHostTableModelRunner(base):
        _fi_mirror: Optional[BlockTableMirror] = None

        def initialize_kv_cache(self, kv_cache_config) -> None:
            adapter.provide_step_tables(True)
            readers = adapter.step_table_readers()
            super().initialize_kv_cache(kv_cache_config)
            self._fi_mirror = None
            if adapter.step_table_readers() > readers:   # fi-backend's builders were made and will read them
                bt = self.block_tables
                self._fi_mirror = BlockTableMirror(bt)
                bt.append_block_ids = _mirrored_append(bt.append_block_ids, self._fi_mirror)

        def prepare_attn(self, input_batch):
            out = super().prepare_attn(input_batch)
            if self._fi_mirror is not None and getattr(self, "pcp_manager", None) is None:
                adapter.publish_step_tables(self._fi_mirror.rows(input_batch.idx_mapping_np))
            return out

        def execute_model(self, *args, **kwargs):
            try:
                return super().execute_model(*args, **kwargs)
            finally:
                adapter.publish_step_tables(None)

    FiHostTableModelRunner.__qualname__ = f"FiHostTableModelRunner[{base.__qualname__}]"
    return FiHostTableModelRunner


def _worker_class(base: type, v2_runner: type) -> type:
    """vLLM's GPU Worker whose V2 runner (exactly v2_runner) becomes _runner_class(v2_runner) after init_device."""
    runner = _runner_class(v2_runner)

    class Worker(base):
        """vLLM's GPU worker with fi-backend's host block tables for its V2 model runner (vllm_worker.py)."""

        def init_device(self):
            super().init_device()
            mr = getattr(self, "model_runner", None)
            if not _env.flag(_env.SHARED_PREFIX, True):
                return
            if type(mr) is v2_runner:
                mr.__class__ = runner
            elif mr is not None and not isinstance(mr, runner):   # V1: the cascade path; or another plugin's
                _log.info("fi-backend: worker %s leaves the model runner %s as it is (host block tables are for "
                          "vLLM's V2 runner)", WORKER_CLASS_PATH, type(mr).__name__)

    Worker.__module__ = __name__
    return Worker


def __getattr__(name: str) -> Any:
    if name == "Worker":
        with _define_lock:
            if "Worker" not in globals():
                try:
                    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
                    from vllm.v1.worker.gpu_worker import Worker as GpuWorker
                except ImportError as e:
                    raise ImportError(f"{WORKER_CLASS_PATH} subclasses vLLM 0.26's GPU worker and needs vLLM 0.26 "
                                      f"installed ({e})") from e
                globals()["Worker"] = _worker_class(GpuWorker, GPUModelRunner)
        return globals()["Worker"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
