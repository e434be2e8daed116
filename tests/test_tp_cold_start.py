"""tools/tp_cold_start.py on the CPU: its verdicts from rank reports, its refusals, and a real cold start of
ranks that build one module into a fresh shared cache at once (needs nvcc, no GPU). The GPU run (8 ranks of
Llama-3.1-70B TP8 on one or more GPUs, plan + run checked against the reference) is `bash .ci/gpu tp-cold-start`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fi_backend import kernels, reference
from fi_backend import variants as V

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import tp_cold_start as T  # noqa: E402


def _tool(*args, **env):
    return subprocess.run([sys.executable, str(REPO / "tools" / "tp_cold_start.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FI_BACKEND_CUDA_ARCH_LIST": "90a", **env})


def _report(rank, *builds, up=True, **extra):
    return {"rank": rank, "up": up, "builds": [{"module": m, "built": b, "seconds": 1.0} for m, b in builds], **extra}


def test_summarise_each_module_built_once(tmp_path):
    good = [_report(0, ("a", True), ("b", False)), _report(1, ("a", False), ("b", True)), _report(2, ("a", False),
                                                                                                 ("b", False))]
    s = T.summarise(good, 3, tmp_path)
    assert s["ok"] and s["modules"]["a"]["built_by"] == [0] and s["modules"]["b"]["found_by"] == [0, 2]
    assert "outputs_match_reference" not in s["verdict"]   # builds only: nothing ran
    twice = [_report(0, ("a", True)), _report(1, ("a", True))]
    s = T.summarise(twice, 2, tmp_path)
    assert not s["ok"] and not s["verdict"]["each_module_built_once"]


def test_summarise_ranks_down_errors_and_leftovers(tmp_path):
    s = T.summarise([_report(0, ("a", True)), {"rank": 1, "up": False, "error": "timed out"}], 2, tmp_path)
    assert not s["verdict"]["every_rank_up"] and s["ranks_up"] == [0]
    ran = [_report(0, ("a", True), relative_error={"default decode": 0.003}),
           _report(1, ("a", False), relative_error={"default decode": 0.5})]
    s = T.summarise(ran, 2, tmp_path)
    assert s["verdict"]["outputs_match_reference"] is False and not s["ok"]
    (tmp_path / ".tmp-decode_x-12-ab").mkdir()
    s = T.summarise([_report(0, ("a", True))], 1, tmp_path)
    assert not s["verdict"]["no_leftovers_in_cache"] and s["cache_leftovers"] == [".tmp-decode_x-12-ab"]
    assert not T.summarise([], 1, tmp_path)["ok"]


class _RefWrapper:
    """A rank's wrapper computed by the reference (what _plan_and_run needs of BatchAttention), optionally off."""

    def __init__(self, hq, hkv, d, wrong=False):
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.wrong = hq, hkv, d, wrong

    def plan(self, qo, kv, bsr, causal, **params):
        assert qo.dtype == kv.dtype == torch.int32 and qo.device.type == kv.device.type == "cpu" and causal
        assert bsr.kv_lens.tolist() == kv.tolist() and bsr.qo_indptr.tolist() == qo.tolist()
        self.bsr, self.params = bsr, params

    def run(self, q, cache):
        d = self.head_dim
        o, _ = reference.attention_bsr(q.double(), cache[..., :d].double(), cache[..., d:].double(), self.bsr,
                                       causal=True, **self.params)
        return (o * (1.1 if self.wrong else 1.0)).to(q.dtype)

    def check_errors(self):
        pass


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_plan_and_run_measures_against_the_reference(kernel):
    """The rank's check (run on the GPU by each rank) on the CPU, with the wrapper the reference itself."""
    cpu = torch.device("cpu")
    assert T._plan_and_run(_RefWrapper(8, 1, 128), kernel, 16, cpu, {}) < 1e-2   # bf16 rounding only
    assert T._plan_and_run(_RefWrapper(8, 1, 128, wrong=True), kernel, 16, cpu, {}) > T.TOLERANCE
    window = T._plan_params(V.combine(V.SOFT_CAP, V.SLIDING_WINDOW))
    assert window == {"window_left": 37, "logits_soft_cap": 2.5} and T._plan_params(V.DEFAULT) == {}
    assert T._plan_and_run(_RefWrapper(4, 2, 128), kernel, 1, cpu, window) < 1e-2


def test_refusals(tmp_path):
    (tmp_path / "old").write_text("x")
    proc = _tool("--build-only", "--cache-dir", str(tmp_path))
    assert proc.returncode == 2 and "is not empty: a cold start needs an empty" in proc.stderr
    proc = _tool("--build-only", "--kernels", "decode,append")
    assert proc.returncode == 2 and "--kernels: append; accepted: decode, prefill" in proc.stderr
    proc = _tool("--build-only", "--model", "Phi-4", "--tp", "4")
    assert proc.returncode == 2 and "cannot split 40 query / 10 KV heads" in proc.stderr
    proc = _tool("--build-only", "--model", "GPT-5")
    assert proc.returncode == 2 and "no model 'GPT-5' in the zoo" in proc.stderr


@pytest.mark.skipif(kernels.find_nvcc() is None, reason="needs nvcc")
def test_ranks_build_each_module_once(tmp_path):
    """Three ranks of Llama-3.1-70B TP8 start at once on an empty cache: each decode module (8 / 1 heads: the
    family of two) is compiled by one of them, found by the others; none fails or waits forever on the lock."""
    out = tmp_path / "report.json"
    proc = _tool("--build-only", "--kernels", "decode", "--ranks", "3", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(out), "--timeout", "400")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["verdict"] == {"every_rank_up": True, "each_module_built_once": True,
                            "every_rank_loaded_every_module": True, "no_leftovers_in_cache": True}
    assert len(r["modules"]) == 2
    for name, m in r["modules"].items():
        assert name.startswith("decode_default_bf16_bf16_d128_") and "_h8_" in name
        assert len(m["built_by"]) == 1 and sorted(m["built_by"] + m["found_by"]) == [0, 1, 2]
    assert r["ranks_up"] == [0, 1, 2] and 0 < r["ready_s_max"] <= r["wall_s"]
    assert "8 query / 1 KV heads, head 128" in r["what"]
