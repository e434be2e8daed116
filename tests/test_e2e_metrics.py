"""perf/e2e without a GPU, vLLM or SGLang: serving metrics against straightforward numpy, workload sampling, the
report/merge path, and the parent/child plumbing of both benches on a backend that is unavailable here and on
fake vllm / sglang packages whose engines stream tokens on a timer.

The metric reference below restates vLLM 0.26.0's definitions (vllm/benchmarks/lib/endpoint_request_func.py
and vllm/benchmarks/serve.py calculate_metrics) loop by loop, independently of perf/e2e/metrics.py.
"""
import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perf import sharegpt as sg
from perf.e2e import metrics as M
from perf.e2e import serving as S
from perf.e2e import sglang_bench as SG
from perf.e2e import vllm_bench as B
from perf.e2e import workload as W

RNG_SEED = random.SystemRandom().randrange(2**32)


def synthetic_records(rng, n, *, fail_every=0):
    """Requests with random starts, random chunk gaps and some multi-token chunks; every fail_every-th fails."""
    recs = []
    for i in range(n):
        out_len = int(rng.integers(1, 60))
        start = float(rng.uniform(0, 5))
        # split out_len tokens into chunks of 1 (mostly) or 2-3 tokens
        sizes = []
        left = out_len
        while left:
            k = min(left, int(rng.choice([1, 1, 1, 1, 2, 3])))
            sizes.append(k)
            left -= k
        gaps = rng.exponential(0.02, size=len(sizes))
        gaps[0] = rng.uniform(0.01, 0.5)         # time to first token
        times = (start + np.cumsum(gaps)).tolist()
        rec = M.RequestRecord(prompt_len=int(rng.integers(4, 2000)), output_len=out_len, start=start,
                              chunk_times=times, chunk_tokens=sizes)
        if fail_every and i % fail_every == fail_every - 1:
            if i % 2:
                rec.error = "RuntimeError: boom"
            else:
                rec.chunk_times, rec.chunk_tokens = [], []   # never streamed a token: failed as in vLLM
        recs.append(rec)
    return recs


def reference_metrics(recs, dur):
    """vLLM's calculate_metrics restated: per request ttft/itl/latency from chunk times, pooled lists,
    np.mean/median/std/percentile in ms."""
    ttfts, itls, tpots, e2els = [], [], [], []
    total_in = total_out = done = 0
    for r in recs:
        if r.error is not None or not r.chunk_times:
            continue
        done += 1
        ttft = r.chunk_times[0] - r.start
        latency = r.chunk_times[-1] - r.start
        out = sum(r.chunk_tokens)
        for a, b in zip(r.chunk_times, r.chunk_times[1:]):
            itls.append(b - a)
        if out > 1:
            tpots.append((latency - ttft) / (out - 1))
        ttfts.append(ttft)
        e2els.append(latency)
        total_in += r.prompt_len
        total_out += out
    ref = {"completed": done, "failed": len(recs) - done, "total_input": total_in, "total_output": total_out,
           "request_throughput": done / dur, "output_throughput": total_out / dur,
           "total_token_throughput": (total_in + total_out) / dur}
    for name, v in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2el", e2els)):
        ref[f"mean_{name}_ms"] = np.mean(v or 0) * 1000
        ref[f"median_{name}_ms"] = np.median(v or 0) * 1000
        ref[f"std_{name}_ms"] = np.std(v or 0) * 1000
        for p in (50, 90, 99):
            ref[f"p{p}_{name}_ms"] = np.percentile(v or 0, p) * 1000
    return ref


@pytest.mark.parametrize("n,fail_every", [(1, 0), (7, 0), (300, 0), (300, 5)])
def test_metrics_match_reference(n, fail_every):
    rng = np.random.default_rng([RNG_SEED, n, fail_every])
    recs = synthetic_records(rng, n, fail_every=fail_every)
    dur = float(rng.uniform(5, 50))
    got = M.compute_metrics(recs, dur)
    ref = reference_metrics(recs, dur)
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-12), f"{k} (seed {RNG_SEED})"
    assert got["duration_s"] == dur


def test_per_request_fields():
    rng = np.random.default_rng(RNG_SEED)
    for r in synthetic_records(rng, 50):
        t = np.array(r.chunk_times)
        assert r.ttft == pytest.approx(t[0] - r.start)
        assert r.itl == pytest.approx(np.diff(t).tolist())
        assert len(r.itl) == len(r.chunk_times) - 1          # one sample per chunk gap, not per token
        assert r.latency == pytest.approx(t[-1] - r.start)
        assert r.output_tokens == r.output_len
        if r.output_tokens > 1:
            assert r.tpot == pytest.approx((t[-1] - t[0]) / (r.output_tokens - 1))
        else:
            assert r.tpot is None


def test_single_token_requests_have_no_tpot_and_no_itl():
    recs = [M.RequestRecord(10, 1, start=1.0, chunk_times=[1.25], chunk_tokens=[1]) for _ in range(3)]
    m = M.compute_metrics(recs, 2.0)
    assert m["completed"] == 3 and m["median_ttft_ms"] == pytest.approx(250.0)
    assert m["median_tpot_ms"] == 0.0 and m["median_itl_ms"] == 0.0 and m["p99_itl_ms"] == 0.0   # vLLM: np.x(0)
    assert m["median_e2el_ms"] == pytest.approx(250.0)


def test_hand_computed_example():
    # start 0; chunks at 0.1 (1 tok), 0.15 (1), 0.35 (2 tokens merged) -> ttft 100 ms, itl [50, 200] ms,
    # latency 350 ms, 4 tokens, tpot 250/3 ms
    r = M.RequestRecord(100, 4, start=0.0, chunk_times=[0.1, 0.15, 0.35], chunk_tokens=[1, 1, 2])
    m = M.compute_metrics([r], 1.0)
    assert m["mean_ttft_ms"] == pytest.approx(100)
    assert m["median_itl_ms"] == pytest.approx(125) and m["p99_itl_ms"] == pytest.approx(50 + 0.99 * 150)
    assert m["mean_tpot_ms"] == pytest.approx(250 / 3)
    assert m["mean_e2el_ms"] == pytest.approx(350)
    assert m["multi_token_chunk_frac"] == pytest.approx(1 / 3)
    assert m["output_throughput"] == 4 and m["total_token_throughput"] == 104 and m["output_len_mismatch"] == 0


def test_failures_and_bad_duration():
    ok = M.RequestRecord(5, 2, 0.0, [0.1, 0.2], [1, 1])
    bad = M.RequestRecord(5, 2, 0.0, error="ValueError: too long")
    empty = M.RequestRecord(5, 2, 0.0)
    short = M.RequestRecord(5, 3, 0.0, [0.1], [1])     # stopped early: counted, flagged as a length mismatch
    m = M.compute_metrics([ok, bad, empty, short], 1.0)
    assert (m["completed"], m["failed"], m["output_len_mismatch"]) == (2, 2, 1)
    assert m["errors"] == ["ValueError: too long"]
    for d in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="duration_s"):
            M.compute_metrics([ok], d)


def test_ratio():
    assert M.ratio(1.0, 2.0) == 0.5
    assert M.ratio(None, 2.0) is None and M.ratio(1.0, None) is None and M.ratio(1.0, 0.0) is None


# ---------------------------------------------------------------------------------------------- workload

@pytest.mark.parametrize("dataset,lo,hi", [("u512-2048", 512, 2048), ("u4096-16384", 4096, 16384)])
def test_uniform_lengths_in_bounds_and_deterministic(dataset, lo, hi):
    seed = RNG_SEED
    pairs = W.sample_lengths(dataset, 5000, seed)
    p = np.array([x for x, _ in pairs])
    assert len(pairs) == 5000 and all(o == 256 for _, o in pairs)
    assert p.min() >= lo and p.max() <= hi, f"seed {seed}"
    # both ends reachable and the spread is uniform-like: mean within 4 sigma of the middle
    sigma = (hi - lo) / math.sqrt(12) / math.sqrt(len(p))
    assert abs(p.mean() - (lo + hi) / 2) < 4 * sigma, f"seed {seed}"
    assert W.sample_lengths(dataset, 5000, seed) == pairs
    assert W.sample_lengths(dataset, 5000, seed + 1) != pairs
    assert W.sample_lengths(dataset, 100, seed) == pairs[:100]      # a prefix: fewer prompts, same first ones
    assert W.max_total_len(dataset) == hi + 256


def test_sharegpt_lengths_are_the_trace():
    pairs = W.sample_lengths("sharegpt", 200, 0)
    assert pairs == sg.load_trace(200)
    for p, o in pairs:
        assert sg.is_valid_pair(p, o) and p + o <= W.max_total_len("sharegpt") == 2048
    s = RNG_SEED % 1000 + 1
    assert W.sample_lengths("sharegpt", 50, s) == sg.load_trace(50, s) == W.sample_lengths("sharegpt", 50, s)
    with pytest.raises(ValueError, match="--num-prompts"):
        W.sample_lengths("sharegpt", len(sg.load_trace()) + 1)


def test_shared_prefix_datasets():
    """sharegpt-n8: the trace's pairs, 8 samples each; sysprompt4k-sharegpt: the trace behind one 4096-token system
    prompt, the same in every prompt of a run and new in each run."""
    pairs = sg.load_trace(20)
    assert W.sample_lengths("sharegpt-n8", 20) == [(p, 256) for p, _ in pairs] and W.samples_per_prompt("sharegpt-n8") == 8
    assert W.max_total_len("sharegpt-n8") == 2048 + 256 and W.samples_per_prompt("sharegpt") == 1
    sys_pairs = W.sample_lengths("sysprompt4k-sharegpt", 20)
    assert sys_pairs == [(4096 + p, 256) for p, _ in pairs]
    assert W.max_total_len("sysprompt4k-sharegpt") == 4096 + 2048 + 256
    prompts = W.dataset_prompts("sysprompt4k-sharegpt", sys_pairs, 1000, RNG_SEED, "run")
    assert [len(x) for x in prompts] == [p for p, _ in sys_pairs]
    assert all(x[:4096] == prompts[0][:4096] for x in prompts)
    assert len({tuple(x[4096:4104]) for x in prompts}) == len(prompts)                   # the questions differ
    assert W.dataset_prompts("sysprompt4k-sharegpt", sys_pairs, 1000, RNG_SEED, "other")[0][:4096] != prompts[0][:4096]
    assert W.dataset_prompts("sharegpt", pairs, 1000, RNG_SEED, "k") == W.prompt_token_ids(
        [p for p, _ in pairs], 1000, RNG_SEED, "k")                                         # unchanged where no prefix
    assert W.estimate_run_s(pairs, math.inf, 32, 8) > W.estimate_run_s(pairs, math.inf, 32)


def test_bad_dataset_and_counts():
    with pytest.raises(ValueError, match="accepted: sharegpt, u512-2048, u4096-16384"):
        W.sample_lengths("random", 10)
    for n in (0, -3, 2.5):
        with pytest.raises(ValueError, match="--num-prompts"):
            W.sample_lengths("u512-2048", n)


def test_arrivals():
    assert W.arrival_times(5, math.inf) == [0.0] * 5
    n, rate = 20000, 7.0
    t = np.array(W.arrival_times(n, rate, RNG_SEED, "sharegpt"))
    assert np.all(np.diff(t) >= 0) and t[0] > 0
    assert t[-1] == pytest.approx(n / rate)                   # vLLM rescales to exactly n / rate
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05), f"seed {RNG_SEED}"   # exponential: CV 1
    assert W.arrival_times(n, rate, RNG_SEED, "sharegpt") == t.tolist()
    assert W.arrival_times(n, rate, RNG_SEED, "u512-2048") != t.tolist()
    assert W.arrival_times(n, rate, RNG_SEED + 1, "sharegpt") != t.tolist()
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--rates"):
            W.arrival_times(3, bad)


def test_prompt_token_ids():
    lens = [1, 5, 300, 17]
    a = W.prompt_token_ids(lens, 1000, RNG_SEED, "k")
    assert [len(x) for x in a] == lens
    assert all(0 <= t < 1000 and isinstance(t, int) for x in a for t in x)
    assert W.prompt_token_ids(lens, 1000, RNG_SEED, "k") == a
    assert W.prompt_token_ids(lens, 1000, RNG_SEED, "other") != a       # each run gets its own prompts
    big = np.concatenate(W.prompt_token_ids([20000], 128256, RNG_SEED))
    assert big.max() > 120000 and big.min() < 8000


def test_parsers():
    assert W.parse_rates("1, 4.5,inf") == [1.0, 4.5, math.inf]
    for bad in ("", "0", "-2", "fast"):
        with pytest.raises(ValueError, match="--rates"):
            W.parse_rates(bad)
    ds = ["sharegpt", "u4096-16384"]
    assert W.parse_num_prompts("64", ds) == {"sharegpt": 64, "u4096-16384": 64}
    assert W.parse_num_prompts("u4096-16384=8", ds) == {"sharegpt": 200, "u4096-16384": 8}
    assert W.parse_num_prompts("100,u4096-16384=8", ds) == {"sharegpt": 100, "u4096-16384": 8}
    for bad in ("x", "sharegpt=0", "nope=3"):
        with pytest.raises(ValueError):
            W.parse_num_prompts(bad, ds)
    assert S.parse_backends("custom,FLASH_ATTN,custom", B.ENGINE) == ["CUSTOM", "FLASH_ATTN"]
    with pytest.raises(ValueError, match="accepted: CUSTOM, FLASH_ATTN"):
        S.parse_backends("FA3", B.ENGINE)
    assert W.rate_label(math.inf) == "inf" and W.rate_label(4.0) == "4" and W.rate_label(0.5) == "0.5"


# ----------------------------------------------------------------------------------- plan, report, merge

def test_imports_without_vllm():
    # a None entry makes any `import vllm` fail, even where vLLM is installed
    code = ("import sys; sys.modules['vllm'] = None; import perf.e2e.vllm_bench, perf.e2e.plot; "
            "perf.e2e.vllm_bench.main(['--dry-run'])")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=B.REPO, capture_output=True)


def test_dry_run_plans(capsys):
    assert B.main(["--dry-run", "--smoke", "--backends", "CUSTOM,FLASH_ATTN"]) == 0
    err = capsys.readouterr().err
    assert "16 prompts" in err and "estimated total" in err
    with pytest.raises(SystemExit):
        B.main(["--dry-run", "--dataset", "u4096-16384", "--max-model-len", "8192"])
    assert "--max-model-len 8192 is below 16640" in capsys.readouterr().err


def fake_result(rates, backends, itl, ttft, date="2026-01-01T00:00:00+00:00"):
    runs = []
    for rate in rates:
        for b in backends:
            m = M.compute_metrics([M.RequestRecord(10, 3, 0.0, [ttft[b], ttft[b] + itl[b], ttft[b] + 2 * itl[b]],
                                                   [1, 1, 1])], 1.0)
            runs.append({"dataset": "sharegpt", "rate": rate, "backend": b, "metrics": m})
    settings = {"datasets": ["sharegpt"], "rates": rates, "backends": backends, "num_prompts": {"sharegpt": 1},
                "seed": 0, "smoke": False, "max_model_len": 18432, "gpu_memory_utilization": 0.9,
                "enforce_eager": False, "sampling": "greedy"}
    model = {"config_source": "x", "num_hidden_layers": 2, "architectures": ["LlamaForCausalLM"]}
    res = {b: {"status": "ok", "startup_s": 50.0, "runs": [r for r in runs if r["backend"] == b]} for b in backends}
    out = S.assemble(B.ENGINE, settings, model, {"name": "H100"}, res, "0.26.0")
    out["date"] = date
    return out


def test_ratios_bar_markdown_and_merge(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    itl = {"CUSTOM": 0.010, "FLASH_ATTN": 0.011, "TRITON_ATTN": 0.0115}
    ttft = {"CUSTOM": 0.050, "FLASH_ATTN": 0.049, "TRITON_ATTN": 0.060}
    r = fake_result(["8", "inf"], list(itl), itl, ttft)
    rows = {(x["rate"], x["vs"]): x for x in r["ratios"]}
    assert len(rows) == 4
    assert rows[("8", "FLASH_ATTN")]["median_itl"] == pytest.approx(10 / 11)
    assert rows[("inf", "TRITON_ATTN")]["median_ttft"] == pytest.approx(50 / 60)
    checks = {c["check"]: c["pass"] for c in r["bar"]["checks"]}
    assert checks["median ITL <= FLASH_ATTN (sharegpt @ 8)"]
    assert not checks["median ITL <= 0.85 x TRITON_ATTN (sharegpt @ inf)"]     # 10 / 11.5 = 0.87
    assert checks["median TTFT <= 1.05 x FLASH_ATTN (sharegpt @ 8)"]
    assert not r["bar"]["all_pass"]
    md = S.markdown(r, B.ENGINE)
    assert "| 8 | CUSTOM |" in md and "NOT met" in md and "0.909" in md
    p = S.write_outputs(r, "t1", B.ENGINE)
    assert p == tmp_path / "t1.json" and (tmp_path / "t1.md").exists()
    assert json.loads(p.read_text())["ratios"] == json.loads(json.dumps(r["ratios"]))

    # a second command ran TRITON_ATTN again at rate 16 and a faster CUSTOM at inf: merge keeps the later one
    itl2 = dict(itl, CUSTOM=0.009)
    r2 = fake_result(["inf", "16"], ["CUSTOM", "TRITON_ATTN"], itl2, ttft, date="2026-01-02T00:00:00+00:00")
    p2 = tmp_path / "t2.json"
    p2.write_text(json.dumps(r2))
    out = json.loads(S.merge([str(p), str(p2)], "merged", B.ENGINE).read_text())
    assert out["settings"]["rates"] == ["8", "16", "inf"]
    keys = {(x["rate"], x["backend"]) for x in out["runs"]}
    assert len(keys) == len(out["runs"]) == 3 * 2 + 2
    custom_inf = [x for x in out["runs"] if (x["rate"], x["backend"]) == ("inf", "CUSTOM")][0]
    assert custom_inf["metrics"]["median_itl_ms"] == pytest.approx(9.0)
    assert [m["file"] for m in out["merged_from"]] == ["t1.json", "t2.json"]
    assert (tmp_path / "merged.md").exists()


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from perf.e2e import plot
    itl = {"CUSTOM": 0.010, "FLASH_ATTN": 0.011}
    r = fake_result(["1", "inf"], list(itl), itl, {"CUSTOM": 0.05, "FLASH_ATTN": 0.05})
    src = tmp_path / "r.json"
    src.write_text(json.dumps(r))
    assert plot.main([str(src)]) == 0
    assert (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is importable here")
def test_parent_and_child_report_an_unavailable_backend(tmp_path, monkeypatch):
    """The whole parent path (plan, child process, collection, outputs) with a backend whose child stops
    before importing vLLM: FLASHINFER where flashinfer is not installed."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = B.main(["--smoke", "--backends", "FLASHINFER", "--name", "unavail"])
    assert rc == 1            # no backend produced results
    r = json.loads((tmp_path / "unavail.json").read_text())
    assert r["backends"]["FLASHINFER"]["status"].startswith("unavailable: the flashinfer package")
    assert r["runs"] == [] and r["settings"]["num_prompts"] == {"sharegpt": 16}
    assert r["model"]["num_hidden_layers"] == 2 and r["benchmark"] == "e2e_vllm"
    assert (tmp_path / "unavail.md").exists() and (tmp_path / "unavail_logs" / "FLASHINFER.log").exists()


FAKE_VLLM = {
    "__init__.py": "__version__ = '0.0-fake'\n",
    "inputs.py": "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n",
    "sampling_params.py": """
import enum
class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)
""",
    "engine/__init__.py": "",
    "engine/arg_utils.py": """
class AsyncEngineArgs:
    def __init__(self, **kw):
        self.kw = kw
""",
    "usage/__init__.py": "",
    "usage/usage_lib.py": "import enum\nclass UsageContext(enum.Enum):\n    OPENAI_API_SERVER = 1\n",
    "v1/__init__.py": "",
    "v1/engine/__init__.py": "",
    "v1/engine/async_llm.py": """
import asyncio, json, os
from types import SimpleNamespace as NS

class AsyncLLM:
    # streams one token per 1 ms step; every 7th step two tokens arrive in one chunk, as vLLM's collector merges
    @classmethod
    def from_engine_args(cls, args, usage_context=None):
        log = os.environ.get("FAKE_VLLM_ARGS")
        if log:
            with open(log, "w") as f:
                json.dump({k: str(v) for k, v in args.kw.items()}, f)
        e = cls()
        e.vllm_config = NS(scheduler_config=NS(max_num_seqs=1024, max_num_batched_tokens=8192,
                                               enable_chunked_prefill=True),
                           cache_config=NS(enable_prefix_caching=True, block_size=16, num_gpu_blocks=1000),
                           compilation_config=NS(cudagraph_mode="FULL_AND_PIECEWISE"),
                           attention_config=NS(backend=args.kw["attention_backend"]),
                           model_config=NS(dtype="torch.bfloat16"))
        e.resets = 0
        return e

    async def reset_prefix_cache(self):
        self.resets += 1
        return True

    async def generate(self, prompt, sp, request_id):
        assert sp.output_kind.name == "DELTA" and sp.ignore_eos
        assert sp.temperature == 0.0 if sp.n == 1 else (sp.temperature == 1.0 and sp.seed is not None)  # vLLM: n > 1
        await asyncio.sleep(0.005 + 1e-6 * len(prompt["prompt_token_ids"]))
        left, step = sp.max_tokens, 0
        while left:
            k = 2 if step % 7 == 6 and left >= 2 else 1
            left -= k
            step += 1
            await asyncio.sleep(0.001 * k)
            yield NS(outputs=[NS(token_ids=[7] * k, index=i) for i in range(sp.n)], finished=left == 0)

    def shutdown(self):
        pass
""",
}


def test_parent_and_child_with_a_fake_engine(tmp_path, monkeypatch):
    """The child's request loop, timing, metrics and JSON, end to end through the parent, against a fake
    vllm package whose engine streams tokens on a timer (the real engine runs on the GPU machine)."""
    fake = tmp_path / "fake"
    for rel, text in FAKE_VLLM.items():
        p = fake / "vllm" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", f"{fake}:{B.REPO}")
    monkeypatch.setenv("FAKE_VLLM_ARGS", str(tmp_path / "args.json"))
    rc = B.main(["--smoke", "--backends", "FLASH_ATTN", "--rates", "inf", "--warmup", "2", "--name", "fake",
                 "--tp", "2"])
    assert rc == 0
    r = json.loads((out / "fake.json").read_text())
    b = r["backends"]["FLASH_ATTN"]
    assert b["status"] == "ok" and b["vllm"] == "0.0-fake" and b["startup_s"] >= 0 and b["warmup_s"] > 0
    assert b["engine"]["num_gpu_blocks"] == 1000 and b["engine"]["attention_backend"] == "FLASH_ATTN"
    (run,) = r["runs"]
    m = run["metrics"]
    pairs = sg.load_trace(16)
    assert (run["dataset"], run["rate"], m["completed"], m["failed"]) == ("sharegpt", "inf", 16, 0)
    assert m["total_output"] == sum(o for _, o in pairs) and m["output_len_mismatch"] == 0
    assert m["total_input"] == sum(p for p, _ in pairs)
    assert 0.1 < m["multi_token_chunk_frac"] < 0.2              # one merged chunk in 6 or 7
    assert 0.5 < m["median_itl_ms"] < 50 and m["median_ttft_ms"] > 4
    assert m["p99_itl_ms"] >= m["median_itl_ms"] and m["p99_e2el_ms"] >= m["median_e2el_ms"]
    args = json.loads((tmp_path / "args.json").read_text())
    assert args["load_format"] == "dummy" and args["skip_tokenizer_init"] == "True"
    assert args["attention_backend"] == "FLASH_ATTN" and args["max_model_len"] == "18432"
    assert args["tensor_parallel_size"] == "2" and r["settings"]["tensor_parallel_size"] == 2
    cfg = json.loads(Path(args["model"], "config.json").read_text()) if Path(args["model"]).exists() else None
    assert cfg is None            # the temporary model folder is removed after the run
    assert (out / "fake.md").exists() and "| inf | FLASH_ATTN | 16 |" in (out / "fake.md").read_text()

    # parallel sampling: n = 8 a request, a record a sample
    rc = B.main(["--smoke", "--backends", "FLASH_ATTN", "--rates", "inf", "--warmup", "0", "--name", "fake8",
                 "--dataset", "sharegpt-n8"])
    assert rc == 0
    (run,) = json.loads((out / "fake8.json").read_text())["runs"]
    m = run["metrics"]
    assert (run["dataset"], m["completed"], m["failed"]) == ("sharegpt-n8", 128, 0)
    assert m["total_output"] == 8 * 256 * len(pairs) and m["output_len_mismatch"] == 0
    assert "## sharegpt-n8 (16 prompts x 8 samples)" in (out / "fake8.md").read_text()


def test_run_requests_times_out_and_keeps_finished_requests(monkeypatch):
    """A run past its time limit cancels what is in flight (generate() aborts those in vLLM), keeps the
    finished requests, and the child counts the rest as failed."""
    import asyncio
    import types

    fake = {}
    for name, text in (("vllm", FAKE_VLLM["__init__.py"]), ("vllm.inputs", FAKE_VLLM["inputs.py"]),
                       ("vllm.sampling_params", FAKE_VLLM["sampling_params.py"])):
        mod = types.ModuleType(name)
        exec(text, mod.__dict__)
        fake[name] = mod
        monkeypatch.setitem(sys.modules, name, mod)
    cancelled = []

    class Engine:
        async def generate(self, prompt, sp, request_id):
            try:
                # even-numbered requests stream 3 tokens; odd ones hang after their first token
                for i in range(3):
                    await asyncio.sleep(0.01 if i == 0 or int(request_id.split("-")[1]) % 2 == 0 else 60)
                    yield types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1])], finished=i == 2)
            except asyncio.CancelledError:
                cancelled.append(request_id)
                raise

    prompts = [[1, 2, 3]] * 6
    recs, dur, timed_out = asyncio.run(B._run_requests(Engine(), prompts, [3] * 6, [0.0] * 5 + [30.0], "t", 0.5))
    assert timed_out and 0.5 <= dur < 5
    assert len(recs) == 3 and all(r.success and r.output_tokens == 3 for r in recs)   # requests 0, 2, 4
    assert sorted(cancelled) == ["t-1", "t-3"]     # t-5 was due at 30 s: never sent
    m = M.compute_metrics(recs, dur)
    assert m["completed"] == 3 and m["total_output"] == 9


# ------------------------------------------------------------------------------------------------ SGLang

FAKE_SGLANG = {
    "__init__.py": """
import asyncio, json, os
from types import SimpleNamespace as NS

class _TokenizerManager:
    def __init__(self):
        self.flushes = 0

    async def flush_cache(self):
        self.flushes += 1


class Engine:
    # cumulative output_ids and completion_tokens per chunk (SGLang's default streaming); every 5th step two tokens
    def __init__(self, **kw):
        log = os.environ.get("FAKE_SGLANG_ARGS")
        if log:
            with open(log, "w") as f:
                json.dump(kw, f)
        self.server_args = NS(**{**kw, "chunked_prefill_size": 8192, "page_size": 1})
        self.tokenizer_manager = _TokenizerManager()
        self.loop = asyncio.new_event_loop()

    async def async_generate(self, input_ids=None, sampling_params=None, stream=False):
        assert stream and sampling_params["ignore_eos"] and sampling_params["temperature"] == 0.0
        n = sampling_params["max_new_tokens"]
        samples = sampling_params.get("n", 1)

        async def gen():
            await asyncio.sleep(0.005 + 1e-6 * len(input_ids))
            done, step = 0, 0
            while done < n:
                k = 2 if step % 5 == 4 and n - done >= 2 else 1
                done += k
                step += 1
                await asyncio.sleep(0.001 * k)
                for i in range(samples):   # n > 1: each sample's chunks tagged with its "index", as SGLang does
                    yield {"output_ids": [7] * done, "meta_info": {"completion_tokens": done},
                           **({"index": i} if samples > 1 else {})}
        return gen()

    def shutdown(self):
        with open(os.environ["FAKE_SGLANG_ARGS"] + ".flushes", "w") as f:
            f.write(str(self.tokenizer_manager.flushes))
""",
}


def test_sglang_engine_kwargs_and_backends():
    plan = {"model_dir": "/m", "settings": {"tensor_parallel_size": 4, "max_model_len": 18432, "seed": 3,
                                            "gpu_memory_utilization": 0.8, "enforce_eager": True, "max_num_seqs": 64,
                                            "max_num_batched_tokens": None}}
    kw = SG.engine_kwargs(plan, "fi_backend")
    assert kw["tp_size"] == 4 and kw["attention_backend"] == "fi_backend" and kw["load_format"] == "dummy"
    assert kw["skip_tokenizer_init"] and kw["context_length"] == 18432 and kw["mem_fraction_static"] == 0.8
    assert kw["disable_cuda_graph"] and kw["max_running_requests"] == 64 and "chunked_prefill_size" not in kw
    assert "page_size" not in kw  # the engine's default page size
    plan["settings"]["block_size"] = 32
    assert SG.engine_kwargs(plan, "fi_backend")["page_size"] == 32
    assert S.parse_backends("FI_BACKEND,triton", SG.ENGINE) == ["fi_backend", "triton"]
    with pytest.raises(ValueError, match="accepted: fi_backend, triton, flashinfer"):
        S.parse_backends("CUSTOM", SG.ENGINE)


def test_sglang_dry_run_and_tp_check(capsys):
    assert SG.main(["--dry-run", "--smoke", "--dataset", "sharegpt,u512-2048"]) == 0
    err = capsys.readouterr().err
    assert "backend fi_backend" in err and "backend flashinfer: est" in err and "estimated total" in err
    with pytest.raises(SystemExit):
        SG.main(["--dry-run", "--tp", "0"])
    assert "--tp must be >= 1" in capsys.readouterr().err


def test_sglang_parent_and_child_with_a_fake_engine(tmp_path, monkeypatch):
    """The SGLang child's request loop (cumulative streaming counted as increments), cache flushes between runs,
    metrics and JSON, end to end through the parent, against a fake sglang package; plus ratios of fi_backend
    against the anchors in the report of a merged pair of runs."""
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text(FAKE_SGLANG["__init__.py"])
    (fake / "sglang-0.5.15.dist-info").mkdir()
    (fake / "sglang-0.5.15.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.15\n")
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", f"{fake}:{B.REPO}")
    monkeypatch.setenv("FAKE_SGLANG_ARGS", str(tmp_path / "args.json"))
    rc = SG.main(["--smoke", "--backends", "triton", "--rates", "4,inf", "--warmup", "2", "--name", "sg", "--tp", "2"])
    assert rc == 0
    r = json.loads((out / "sg.json").read_text())
    assert r["benchmark"] == "e2e_sglang" and r["settings"]["tensor_parallel_size"] == 2
    b = r["backends"]["triton"]
    assert b["status"] == "ok" and b["sglang"] == "0.5.15" and b["engine"]["tp_size"] == 2 and b["warmup_s"] > 0
    (run,) = r["runs"]          # --smoke keeps the first rate
    m = run["metrics"]
    pairs = sg.load_trace(16)
    assert (run["dataset"], run["rate"], m["completed"], m["failed"]) == ("sharegpt", "4", 16, 0)
    assert m["total_output"] == sum(o for _, o in pairs) and m["output_len_mismatch"] == 0
    assert 0.1 < m["multi_token_chunk_frac"] < 0.3               # one merged chunk in 4 or 5
    args = json.loads((tmp_path / "args.json").read_text())
    assert args["attention_backend"] == "triton" and args["tp_size"] == 2 and args["skip_tokenizer_init"]
    assert (tmp_path / "args.json.flushes").read_text() == "1"   # one run, one flush before it
    assert "| 4 | triton | 16 |" in (out / "sg.md").read_text() and "SGLang 0.5.15" in (out / "sg.md").read_text()

    # fi_backend without its entry point is unavailable (checked before an engine starts)
    monkeypatch.setattr(SG.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(SG.importlib.metadata, "entry_points", lambda group: [])
    assert SG.backend_unavailable("fi_backend").startswith("fi-backend's sglang.srt.plugins entry point")
    assert SG.backend_unavailable("triton") is None
    monkeypatch.undo()

    # ratios: fi_backend against triton, from figures made up here
    itl = {"fi_backend": 0.010, "triton": 0.0125}
    runs = []
    for bk, x in itl.items():
        mm = M.compute_metrics([M.RequestRecord(10, 3, 0.0, [0.05, 0.05 + x, 0.05 + 2 * x], [1, 1, 1])], 1.0)
        runs.append({"dataset": "sharegpt", "rate": "8", "backend": bk, "metrics": mm})
    res = {bk: {"status": "ok", "runs": [x for x in runs if x["backend"] == bk]} for bk in itl}
    merged = S.assemble(SG.ENGINE, r["settings"], r["model"], {"name": "H100"}, res, "0.5.15")
    (row,) = merged["ratios"]
    assert row["vs"] == "triton" and row["median_itl"] == pytest.approx(0.8) and merged["bar"]["checks"] == []
    assert "## fi_backend / anchor" in S.markdown(merged, SG.ENGINE)

    # a variant of ours against ours and the anchors, with output throughput
    assert S.parse_backends("fi_backend,FI_BACKEND_SHARED", SG.ENGINE) == ["fi_backend", "fi_backend_shared"]
    assert SG.ENGINE.engine_backend("fi_backend_shared") == "fi_backend"
    mm = M.compute_metrics([M.RequestRecord(10, 3, 0.0, [0.05, 0.055, 0.06], [1, 1, 1])], 0.5)
    runs.append({"dataset": "sharegpt", "rate": "8", "backend": "fi_backend_shared", "metrics": mm})
    res["fi_backend_shared"] = {"status": "ok", "runs": runs[-1:]}
    merged = S.assemble(SG.ENGINE, r["settings"], r["model"], {"name": "H100"}, res, "0.5.15")
    rows = {(x["backend"], x["vs"]): x for x in merged["ratios"]}
    assert set(rows) == {("fi_backend", "triton"), ("fi_backend_shared", "triton"), ("fi_backend_shared", "fi_backend")}
    assert rows[("fi_backend_shared", "fi_backend")]["median_itl"] == pytest.approx(0.5)
    assert rows[("fi_backend_shared", "fi_backend")]["output_throughput"] == pytest.approx(2.0)
    assert "| sharegpt | 8 | fi_backend_shared | fi_backend | 0.500 |" in S.markdown(merged, SG.ENGINE)


def test_variant_environment_in_the_child(tmp_path, monkeypatch, request):
    """A variant's child runs with its environment (over the caller's), checks its engine backend's availability
    and starts the engine with that backend; requests of the n = 8 dataset give a record a sample."""
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text(FAKE_SGLANG["__init__.py"] + """
_real_init = Engine.__init__
def _init(self, **kw):
    _real_init(self, **kw)
    with open(os.environ["FAKE_SGLANG_ARGS"] + ".env", "w") as f:
        f.write(str(os.environ.get("FI_BACKEND_SHARED_PREFIX")))
Engine.__init__ = _init
""")
    (fake / "sglang-0.5.15.dist-info").mkdir()
    (fake / "sglang-0.5.15.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.15\n")
    monkeypatch.setenv("FAKE_SGLANG_ARGS", str(tmp_path / "args.json"))
    monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "0")
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    # the fake leaves with the test: later tests must not find an "installed" SGLang
    request.addfinalizer(lambda: [sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == "sglang"])
    plan = {"settings": {"tensor_parallel_size": 1, "max_model_len": 4096, "seed": 0, "gpu_memory_utilization": 0.5,
                         "enforce_eager": False, "max_num_seqs": None, "max_num_batched_tokens": None,
                         "warmup_requests": 0},
            "config": {"vocab_size": 1000}, "rates": [math.inf], "model_dir": "/m",
            "datasets": [{"name": "sharegpt-n8", "num_prompts": 2, "samples": 8, "pairs": [(5, 3), (7, 4)],
                          "estimate_s": {"inf": 1.0}}]}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    out = tmp_path / "child.json"
    checked = []
    rc = S.child_main(str(plan_path), "fi_backend_shared", str(out), SG.ENGINE,
                      lambda b: checked.append(b) or None, SG._serve)
    assert rc == 0 and checked == ["fi_backend"]
    assert (tmp_path / "args.json.env").read_text() == "1"
    assert json.loads((tmp_path / "args.json").read_text())["attention_backend"] == "fi_backend"
    (run,) = json.loads(out.read_text())["runs"]
    assert run["backend"] == "fi_backend_shared" and run["metrics"]["completed"] == 16
    assert run["metrics"]["total_output"] == 8 * (3 + 4)


def test_sglang_bench_imports_without_sglang():
    code = ("import sys; sys.modules['sglang'] = None; import perf.e2e.sglang_bench as b; "
            "assert b.backend_unavailable('triton').startswith('the sglang package'); b.main(['--dry-run'])")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=B.REPO, capture_output=True)


def test_vllm_shared_variant_runs_the_opt_in_worker():
    """CUSTOM_SHARED is CUSTOM with groups on and fi-backend's opt-in worker (vLLM 0.26 gives build() no host
    block table otherwise); CUSTOM is fi-backend as users start it."""
    from fi_backend.adapters import vllm_worker
    assert S.parse_backends("CUSTOM,CUSTOM_SHARED", B.ENGINE) == ["CUSTOM", "CUSTOM_SHARED"]
    assert B.ENGINE.engine_backend("CUSTOM_SHARED") == "CUSTOM"
    assert B.VARIANT_ARGS == {"CUSTOM_SHARED": {"worker_cls": vllm_worker.WORKER_CLASS_PATH}}
    assert B.ENGINE.variants["CUSTOM_SHARED"] == {"FI_BACKEND_SHARED_PREFIX": "1"}
