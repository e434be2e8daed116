"""What the serving benchmarks share (perf.e2e.vllm_bench, perf.e2e.sglang_bench): the plan and its time estimate,
the request loop of a child (Poisson arrivals, streamed tokens time-stamped on arrival, a time limit), one child
process per backend, the result JSON / markdown / plot, merging runs split over commands, and the command line.

An Engine says what differs: its backends, which one is fi-backend's and which are the anchors, the child module
and its engine-specific settings; the engine itself is only imported in the child (perf.e2e.<engine>_bench).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from perf.common import RESULTS, commit
from perf.e2e import metrics as M
from perf.e2e import workload as W


@dataclasses.dataclass(frozen=True)
class Engine:
    name: str                        # "vllm": results e2e_<name>.json, the version key in them
    label: str                       # "vLLM", for titles
    module: str                      # the bench module the child runs (python -m MODULE --child ...)
    backends: tuple                  # accepted --backends
    ours: str                        # fi-backend's backend
    anchors: tuple                   # ours is compared with each of these
    default_backends: str
    method: str                      # one sentence for the markdown: how requests reach the engine
    settings: dict = dataclasses.field(default_factory=dict)   # engine-specific entries of settings
    child_env: dict = dataclasses.field(default_factory=dict)  # environment defaults of a child
    bar: Callable | None = None      # ratios -> {"checks", "all_pass"}, an issue's bar where one applies
    normalise: Callable = str.upper  # how a --backends name is spelt
    # More names for ours run with settings of its own: name -> environment of its child (e.g. shared-prefix
    # groups on or off); compared with ours and with the anchors.
    variants: dict = dataclasses.field(default_factory=dict)

    def engine_backend(self, name: str) -> str:
        """The engine's attention backend behind a --backends name."""
        return self.ours if name in self.variants else name


REPO = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).resolve().parent / "configs"   # --model-config NAME: configs/NAME.json
MODEL_CONFIG_CANDIDATES = (
    Path("/work/shared/models/llama-3.1-8b/config.json"),
    REPO.parent / "shared" / "models" / "llama-3.1-8b" / "config.json",
    REPO / "shared" / "models" / "llama-3.1-8b" / "config.json",
)
# NCCL without NVLink multicast (NVLS) for tensor-parallel engines, as the GPU machines require.
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Llama-3.1-8B's shapes (same as ../shared/models/llama-3.1-8b/config.json), used when no config file is
# found: the GPU machine gets the working tree only, and dummy weights need nothing but these shapes.
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
DEVICE_COMMAND_LIMIT_S = 570     # one command on the GPU machine may run 10 minutes; keep a margin


def log(msg: str) -> None:
    # "[e2e]" marks the lines the parent echoes from a child's (otherwise logged) output
    print(f"[e2e] {msg}", file=sys.stderr, flush=True)


def out_dir() -> Path:
    d = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    return d


def gpu_info() -> dict:
    """Name, memory and driver from nvidia-smi: the parent must not create a CUDA context of its own,
    which would hold GPU memory while the children run."""
    try:
        line = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            text=True, timeout=30, stderr=subprocess.DEVNULL).splitlines()[0]
        name, mem, driver = (s.strip() for s in line.split(","))
        return {"name": name, "memory": mem, "driver": driver}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError) as e:
        return {"name": f"unknown ({type(e).__name__})"}


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------ plan

def resolve_model_config(path: str | None) -> tuple[dict, str]:
    if path:
        p = Path(path)
        if not p.is_file() and (CONFIGS / f"{path}.json").is_file():
            p = CONFIGS / f"{path}.json"   # a name of perf/e2e/configs
        if not p.is_file():
            names = ", ".join(sorted(c.stem for c in CONFIGS.glob("*.json")))
            raise SystemExit(f"--model-config: no file at {p}, and not a name of perf/e2e/configs ({names})")
        return json.loads(p.read_text()), str(p)
    for p in MODEL_CONFIG_CANDIDATES:
        if p.is_file():
            return json.loads(p.read_text()), str(p)
    return dict(LLAMA_3_1_8B), "built-in Llama-3.1-8B shapes (perf/e2e/vllm_bench.py LLAMA_3_1_8B)"


def parse_backends(text: str, engine: Engine) -> list[str]:
    out = []
    accepted = (*engine.backends, *engine.variants)
    for b in (engine.normalise(s.strip()) for s in text.split(",") if s.strip()):
        if b not in accepted:
            raise ValueError(f"--backends: unknown backend {b!r}; accepted: {', '.join(accepted)}")
        if b not in out:
            out.append(b)
    if not out:
        raise ValueError(f"--backends: give at least one of {', '.join(accepted)}")
    return out


def build_plan(a: argparse.Namespace, engine: Engine) -> dict:
    datasets = [W.check_dataset(d.strip()) for d in a.dataset.split(",") if d.strip()]
    if not datasets:
        raise ValueError(f"--dataset: give at least one of {', '.join(W.DATASETS)}")
    rates = W.parse_rates(a.rates)
    backends = parse_backends(a.backends, engine)
    if a.tp < 1:
        raise ValueError(f"--tp must be >= 1; got {a.tp}")
    counts = W.parse_num_prompts(a.num_prompts, datasets)
    if a.smoke:
        rates = rates[:1]
        counts = {d: 16 for d in datasets}
    config, config_source = resolve_model_config(a.model_config)
    num_layers = 2 if a.smoke and a.num_layers is None else a.num_layers
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1; got {num_layers}")
        config["num_hidden_layers"] = num_layers
    need = max(W.max_total_len(d) for d in datasets)
    if a.max_model_len < need:
        raise ValueError(f"--max-model-len {a.max_model_len} is below {need}, the longest prompt + output of "
                         f"--dataset {','.join(datasets)}")
    plan_datasets = []
    for d in datasets:
        pairs = W.sample_lengths(d, counts[d], a.seed)
        n = W.samples_per_prompt(d)
        est = {W.rate_label(r): W.estimate_run_s(pairs, r, config["num_hidden_layers"], n) for r in rates}
        plan_datasets.append({"name": d, "num_prompts": len(pairs), "samples": n, "pairs": pairs, "estimate_s": est})
    settings = {
        "datasets": datasets, "rates": [W.rate_label(r) for r in rates], "backends": backends,
        "num_prompts": counts, "seed": a.seed, "smoke": a.smoke,
        "max_model_len": a.max_model_len, "gpu_memory_utilization": a.gpu_memory_utilization,
        "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
        "block_size": a.block_size, "enforce_eager": a.enforce_eager, "warmup_requests": a.warmup,
        "tensor_parallel_size": a.tp, **engine.settings,
        "sampling": ("temperature=0 (vLLM with n > 1: temperature=1, seeded per request), ignore_eos=True, "
                     "max_tokens=output_len, detokenize=False, output_kind=DELTA"),
        "arrivals": "Poisson (vLLM get_request, burstiness 1, rescaled to n/rate)",
    }
    model = {"config_source": config_source, "num_hidden_layers": config["num_hidden_layers"],
             "hidden_size": config.get("hidden_size"), "num_attention_heads": config.get("num_attention_heads"),
             "num_key_value_heads": config.get("num_key_value_heads"), "vocab_size": config.get("vocab_size"),
             "architectures": config.get("architectures"), "weights": "dummy (random)"}
    return {"settings": settings, "model": model, "config": config, "datasets": plan_datasets,
            "rates": rates, "backends": backends}


def _samples(d: dict) -> str:
    n = d.get("samples", 1)
    return f" x {n} samples" if n > 1 else ""


def print_estimate(plan: dict) -> dict[str, float]:
    """Log the plan and a rough time per backend; returns {backend: seconds}."""
    runs = [s for d in plan["datasets"] for s in d["estimate_s"].values()]
    per = {}
    for d in plan["datasets"]:
        p = [x for x, _ in d["pairs"]]
        o = [y for _, y in d["pairs"]]
        log(f"dataset {d['name']}: {len(p)} prompts{_samples(d)}, prompt len mean {sum(p) / len(p):.0f} (max {max(p)}), "
            f"output len mean {sum(o) / len(o):.0f} (max {max(o)}); per run est "
            + ", ".join(f"rate {k}: {v:.0f}s" for k, v in d["estimate_s"].items()))
    for b in plan["backends"]:
        t = per[b] = W.estimate_backend_s(b, runs)
        log(f"backend {b}: est {t:.0f}s (start-up ~{W.EST_STARTUP_S + W.EST_EXTRA_STARTUP_S.get(b.upper(), 0):.0f}s "
            f"+ {len(runs)} runs)")
    total = sum(per.values())
    log(f"estimated total {total:.0f}s ({total / 60:.1f} min) for {len(plan['backends'])} backends x "
        f"{len(plan['datasets'])} datasets x {len(plan['rates'])} rates  [rough H100 figures]")
    if total > DEVICE_COMMAND_LIMIT_S:
        log(f"WARNING: more than one GPU-machine command may run ({DEVICE_COMMAND_LIMIT_S}s with margin); "
            f"split with --backends/--dataset and join with --merge")
    return per



# ------------------------------------------------------------------------------------------------ child

async def run_requests(send, n: int, send_times, timeout_s: float):
    """Start send(i) (a coroutine giving request i's RequestRecord, or a list of them for a request of several
    samples) at send_times[i] after the start, i < n; wait for all. Returns (records, duration_s, timed_out), one
    record a sample: past timeout_s what is in flight is cancelled (the engines abort a cancelled request) and only
    the finished requests are kept."""
    start = time.perf_counter()
    tasks = []

    async def dispatch():
        for i, t_send in zip(range(n), send_times):
            delay = start + t_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i)))
        return await asyncio.gather(*tasks)

    timed_out = False
    try:
        records = await asyncio.wait_for(dispatch(), timeout=timeout_s)
    except asyncio.TimeoutError:
        timed_out = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        records = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
    flat = [x for r in records for x in (r if isinstance(r, list) else [r])]
    return flat, time.perf_counter() - start, timed_out


async def measure_runs(plan: dict, backend: str, result: dict, out_path: Path, t_child: float, run, reset) -> None:
    """The child's work once its engine is up: warm-up requests, then every (dataset, rate) run with the prefix cache
    reset before it, each run's metrics written to out_path as it ends. run(prompts, output_lens, send_times, tag,
    timeout_s, samples) -> (records, duration_s, timed_out), a record a sample (samples: the n of every request);
    reset() empties the engine's prefix cache."""
    s = plan["settings"]
    vocab = plan["config"]["vocab_size"]
    seed = s["seed"]
    if s["warmup_requests"] > 0:
        per = max(1, math.ceil(s["warmup_requests"] / len(plan["datasets"])))
        lens = [p for d in plan["datasets"] for p, _ in d["pairs"][:per]][: s["warmup_requests"]]
        t0 = time.perf_counter()
        recs, _, _ = await run(W.prompt_token_ids(lens, vocab, seed, "warmup"), [16] * len(lens), [0.0] * len(lens),
                               "warmup", 600)
        result["warmup_s"] = time.perf_counter() - t0
        bad = [r.error for r in recs if not r.success]
        if bad or len(recs) != len(lens):
            raise RuntimeError(f"warm-up requests failed: {bad[:3]}")
        log(f"{backend}: warm-up {len(lens)} requests in {result['warmup_s']:.1f}s")

    for d in plan["datasets"]:
        pairs = d["pairs"]
        for rate in plan["rates"]:
            label = W.rate_label(rate)
            key = f"{d['name']}@{label}"
            await reset()
            prompts = W.dataset_prompts(d["name"], pairs, vocab, seed, key)
            sends = W.arrival_times(len(pairs), rate, seed, d["name"])
            timeout = max(180.0, 4 * d["estimate_s"][label] + 60)
            n = d.get("samples", 1)
            recs, dur, timed_out = await run(prompts, [o for _, o in pairs], sends, key, timeout, n)
            m = M.compute_metrics(recs, dur)
            m["failed"] += n * len(pairs) - len(recs)    # samples cancelled by the time-out
            entry = {"dataset": d["name"], "rate": label, "backend": backend, "metrics": m}
            if timed_out:
                entry["timed_out_after_s"] = timeout
            if plan.get("save_requests"):
                entry["requests"] = [r.to_json() for r in recs]
            result["runs"].append(entry)
            write_json(out_path, result)
            log(f"{backend} {d['name']} rate {label}: {m['completed']}/{n * len(pairs)} ok in {dur:.1f}s, "
                f"{m['output_throughput']:.0f} tok/s; TTFT med {m['median_ttft_ms']:.1f} p99 "
                f"{m['p99_ttft_ms']:.1f} ms; ITL med {m['median_itl_ms']:.2f} p99 {m['p99_itl_ms']:.2f} ms; "
                f"TPOT med {m['median_tpot_ms']:.2f} ms{' TIMED OUT' if timed_out else ''} "
                f"[elapsed {time.perf_counter() - t_child:.0f}s]")


def child_main(plan_path: str, backend: str, out_path: str, engine: Engine, unavailable, serve) -> int:
    """A child: unavailable(backend) -> why it cannot run here (or None); serve(plan, backend, result, out, t_child)
    starts the engine, records it in result and runs measure_runs (it may be a coroutine function)."""
    for k, v in engine.child_env.items():
        os.environ.setdefault(k, v)
    os.environ.update(engine.variants.get(backend, {}))   # a variant's own settings win
    t_child = time.perf_counter()
    plan = json.loads(Path(plan_path).read_text())
    out = Path(out_path)
    result = {"backend": backend, "status": "ok", "device": gpu_info(), "runs": []}
    reason = unavailable(engine.engine_backend(backend))
    if reason:
        result["status"] = f"unavailable: {reason}"
        write_json(out, result)
        log(f"{backend}: {result['status']}")
        return 0
    write_json(out, result)
    try:
        done = serve(plan, backend, result, out, t_child)
        if asyncio.iscoroutine(done):
            asyncio.run(done)
    except BaseException as e:  # noqa: BLE001 - reported to the parent through the JSON, then re-raised as rc
        msg = f"{type(e).__name__}: {e}"[:500]
        # FlashInfer that imports but fails to start (a missing kernel, a JIT error) is "unavailable" too
        flashinfer = backend.lower() == "flashinfer"
        result["status"] = ("unavailable: " if flashinfer and not result["runs"] else "error: ") + msg
        write_json(out, result)
        log(f"{backend}: {result['status']}")
        return 1
    result["wall_s"] = time.perf_counter() - t_child
    write_json(out, result)
    return 0


# ----------------------------------------------------------------------------------------------- parent

def run_child(engine: Engine, backend: str, plan_path: Path, logs: Path, timeout_s: float, verbose: bool) -> dict:
    out_path = logs / f"{backend}.json"
    log_path = logs / f"{backend}.log"
    out_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", engine.module, "--child", str(plan_path), "--backend", backend,
           "--child-out", str(out_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k, v in engine.child_env.items():
        env.setdefault(k, v)
    if json.loads(plan_path.read_text())["settings"]["tensor_parallel_size"] > 1:
        for k, v in TP_ENV.items():
            env.setdefault(k, v)
    t0 = time.perf_counter()
    tail = collections.deque(maxlen=40)
    log(f"{backend}: starting child (log {log_path})")
    with open(log_path, "w") as logf:
        # own session: on a time-out the child and the engine-core processes it started go down together
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             bufsize=1, start_new_session=True)

        def pump():
            for line in p.stdout:
                logf.write(line)
                tail.append(line)
                if verbose or line.startswith("[e2e]"):
                    sys.stderr.write(line)
                    sys.stderr.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(p, signal.SIGTERM)
            try:
                rc = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_group(p, signal.SIGKILL)
                rc = p.wait()
        # engine-core processes left behind would keep GPU memory from the next backend
        _kill_group(p, signal.SIGKILL)
        reader.join(timeout=10)
    wall = time.perf_counter() - t0
    res = json.loads(out_path.read_text()) if out_path.exists() else {"backend": backend, "status": "ok", "runs": []}
    res["wall_s"] = wall
    res["log"] = str(log_path.relative_to(log_path.parent.parent))
    if timed_out:
        res["status"] = f"error: timed out after {timeout_s:.0f}s ({len(res['runs'])} runs finished)"
    elif rc != 0 and res["status"] == "ok":
        res["status"] = f"error: child exited with {rc}: " + "".join(list(tail)[-5:]).strip()[-400:]
    log(f"{backend}: {res['status']} after {wall:.0f}s")
    return res


def _kill_group(p: subprocess.Popen, sig) -> None:
    try:
        os.killpg(p.pid, sig)     # the group of the child we started (start_new_session=True)
    except (ProcessLookupError, PermissionError):
        pass


def assemble(engine: Engine, plan_settings: dict, model: dict, device: dict, backend_results: dict,
             version: str | None, extra: dict | None = None) -> dict:
    runs = [r for b in backend_results.values() for r in b.get("runs", [])]
    backends = {b: {k: v for k, v in r.items() if k not in ("runs", "device")} for b, r in backend_results.items()}
    out = {"benchmark": f"e2e_{engine.name}",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "device": device, engine.name: version, "settings": plan_settings, "model": model,
           "backends": backends, "runs": runs}
    out.update(extra or {})
    rescore(out, engine)
    return out


def rescore(r: dict, engine: Engine) -> dict:
    """r's ratios and bar from its runs (in place): today's anchors on the stored figures."""
    r["ratios"] = ratios(r["runs"], engine)
    r["bar"] = engine.bar(r["ratios"]) if engine.bar else {"checks": [], "all_pass": None}
    return r


def ratios(runs: list[dict], engine: Engine) -> list[dict]:
    """ours (and each variant of ours) / anchor for median ITL, median TTFT, median TPOT, p99 ITL and output
    throughput, per (dataset, rate); a variant is compared with ours too."""
    by = {(r["dataset"], r["rate"], r["backend"]): r["metrics"] for r in runs}
    out = []
    for (d, rate, b), m in by.items():
        if b != engine.ours and b not in engine.variants:
            continue
        for anchor in (*engine.anchors, *((engine.ours,) if b != engine.ours else ())):
            a = by.get((d, rate, anchor))
            if a is None:
                continue
            out.append({"dataset": d, "rate": rate, "backend": b, "vs": anchor,
                        "median_itl": M.ratio(m["median_itl_ms"], a["median_itl_ms"]),
                        "median_ttft": M.ratio(m["median_ttft_ms"], a["median_ttft_ms"]),
                        "p99_itl": M.ratio(m["p99_itl_ms"], a["p99_itl_ms"]),
                        "median_tpot": M.ratio(m["median_tpot_ms"], a["median_tpot_ms"]),
                        "output_throughput": M.ratio(m["output_throughput"], a["output_throughput"])})
    return sorted(out, key=lambda x: (x["dataset"], float(x["rate"]), x["backend"] != engine.ours, x["backend"],
                                      x["vs"]))


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def markdown(r: dict, engine: Engine) -> str:
    s = r["settings"]
    page = "" if s.get("block_size") is None else f", KV page size {s['block_size']}"
    lines = [f"# End-to-end serving on {engine.label} {r.get(engine.name)}, {r['device'].get('name')}, {r['date'][:10]}, "
             f"commit {str(r['commit'])[:12]}", "",
             f"Model: {', '.join(r['model'].get('architectures') or ['?'])} shapes, {r['model']['num_hidden_layers']} layers, dummy "
             f"weights ({r['model']['config_source']}). {engine.method} Token-id prompts, Poisson arrivals, "
             f"streamed tokens; metrics as `vllm bench serve` defines them. Tensor parallel "
             f"{s.get('tensor_parallel_size', 1)}, CUDA graphs {'off' if s.get('enforce_eager') else 'on'}, max_model_len {s['max_model_len']}, "
             f"gpu_memory_utilization {s['gpu_memory_utilization']}{page}; {s['sampling']}; seed {s['seed']}.", ""]
    lines += ["| backend | status | start-up s | warm-up s | wall s | cudagraph mode | KV blocks |",
              "|---|---|---|---|---|---|---|"]
    for b, info in r["backends"].items():
        e = info.get("engine", {})
        lines.append(f"| {b} | {info.get('status')} | {_fmt(info.get('startup_s'))} | {_fmt(info.get('warmup_s'))} "
                     f"| {_fmt(info.get('wall_s'), '.0f')} | {e.get('cudagraph_mode', '-')} | {e.get('num_gpu_blocks', '-')} |")
    for d in s["datasets"]:
        rows = [x for x in r["runs"] if x["dataset"] == d]
        if not rows:
            continue
        n = s["num_prompts"].get(d) if isinstance(s["num_prompts"], dict) else s["num_prompts"]
        k = W.samples_per_prompt(d) if d in W.DATASETS else 1
        lines += ["", f"## {d} ({n} prompts{f' x {k} samples' if k > 1 else ''})", "",
                  "| rate req/s | backend | done | req/s | out tok/s | TTFT med | TTFT p99 | ITL med | ITL p99 "
                  "| TPOT med | TPOT p99 | E2E med | E2E p99 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        order = {rate: i for i, rate in enumerate(s["rates"])}
        border = {b: i for i, b in enumerate(r["backends"])}
        for x in sorted(rows, key=lambda x: (order.get(x["rate"], 99), border.get(x["backend"], 99))):
            m = x["metrics"]
            done = f"{m['completed']}" + (f" ({m['failed']} failed)" if m["failed"] else "")
            lines.append(f"| {x['rate']} | {x['backend']} | {done} | {m['request_throughput']:.2f} | "
                         f"{m['output_throughput']:.0f} | {m['median_ttft_ms']:.1f} | {m['p99_ttft_ms']:.1f} | "
                         f"{m['median_itl_ms']:.2f} | {m['p99_itl_ms']:.2f} | {m['median_tpot_ms']:.2f} | "
                         f"{m['p99_tpot_ms']:.2f} | {m['median_e2el_ms']:.0f} | {m['p99_e2el_ms']:.0f} |")
        lines.append("")
        lines.append("Times in ms. ITL: gaps between streamed chunks after the first; TPOT: (E2E - TTFT) / "
                     "(output tokens - 1) per request.")
    if r["ratios"]:
        lines += ["", f"## {engine.ours} / anchor (times: below 1 is fi-backend faster; throughput: above 1)", "",
                  "| dataset | rate | backend | vs | median ITL | median TTFT | median TPOT | p99 ITL | out tok/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for x in r["ratios"]:
            lines.append(f"| {x['dataset']} | {x['rate']} | {x.get('backend', engine.ours)} | {x['vs']} | "
                         f"{_fmt(x['median_itl'], '.3f')} | {_fmt(x['median_ttft'], '.3f')} | "
                         f"{_fmt(x['median_tpot'], '.3f')} | {_fmt(x['p99_itl'], '.3f')} | "
                         f"{_fmt(x.get('output_throughput'), '.3f')} |")
    if r["bar"]["checks"]:
        lines += ["", f"## The bar: {'met' if r['bar']['all_pass'] else 'NOT met'}", ""]
        for c in r["bar"]["checks"]:
            lines.append(f"- {'pass' if c['pass'] else 'FAIL'}: {c['check']}: {c['ratio']:.3f} (limit {c['limit']})")
    return "\n".join(lines) + "\n"


def write_outputs(r: dict, name: str, engine: Engine, quiet: bool = False) -> Path:
    d = out_dir()
    path = d / f"{name}.json"
    write_json(path, r)
    (d / f"{name}.md").write_text(markdown(r, engine))
    try:
        if r["runs"]:
            from perf.e2e import plot
            plot.plot(r, d / f"{name}.png")
    except ImportError as e:
        if not quiet:
            log(f"no plot ({e}); make it elsewhere with `python -m perf plot {path}` (pip install matplotlib)")
    except Exception as e:  # noqa: BLE001 - a plot is a convenience; never lose the run over it
        log(f"plot failed ({type(e).__name__}: {e}); the JSON and markdown are written")
    if not quiet:
        log(f"wrote {path} and {name}.md beside it")
    return path


def merge(paths: list[str], name: str, engine: Engine) -> Path:
    """Join result JSONs of runs split over several commands; a later file wins for the same
    (dataset, rate, backend). Settings other than datasets/rates/backends/num_prompts must agree."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    base = docs[0]
    same = lambda s: {k: v for k, v in s.items() if k not in ("datasets", "rates", "backends", "num_prompts")}
    for p, doc in zip(paths[1:], docs[1:]):
        if same(doc["settings"]) != same(base["settings"]) or doc["model"] != base["model"]:
            log(f"WARNING: {p} was run with other settings or model than {paths[0]}; merged anyway")
    runs, backends = {}, {}
    settings = json.loads(json.dumps(base["settings"]))
    for doc in docs:
        for r in doc["runs"]:
            runs[(r["dataset"], r["rate"], r["backend"])] = r
        backends.update(doc["backends"])
        for key in ("datasets", "rates", "backends"):
            settings[key] += [x for x in doc["settings"][key] if x not in settings[key]]
        settings["num_prompts"].update(doc["settings"]["num_prompts"])
    settings["rates"].sort(key=float)      # float("inf") sorts last
    merged = {b: {**info, "runs": [r for r in runs.values() if r["backend"] == b]} for b, info in backends.items()}
    out = assemble(engine, settings, base["model"], base["device"], merged, base.get(engine.name),
                   {"merged_from": [{"file": Path(p).name, "date": d["date"], "commit": d["commit"]}
                                    for p, d in zip(paths, docs)]})
    return write_outputs(out, name, engine)


def build_parser(engine: Engine, doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m perf e2e --engine {engine.name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=engine.default_backends, help=f"comma list of {', '.join(engine.backends)}")
    ap.add_argument("--dataset", default="sharegpt", help=f"comma list of {', '.join(W.DATASETS)}")
    ap.add_argument("--rates", default="8,inf", help="request rates in req/s, comma list; 'inf' sends all at once")
    ap.add_argument("--num-prompts", default="200", help="N, or DATASET=N,... per dataset")
    ap.add_argument("--seed", type=int, default=0, help="lengths, arrivals and token ids (0: ShareGPT trace order)")
    ap.add_argument("--model-config", help="config.json of the model, or a name in perf/e2e/configs (llama-3.1-70b); default: Llama-3.1-8B's shapes")
    ap.add_argument("--num-layers", type=int, help="override num_hidden_layers (smaller = faster smoke runs)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (GPUs per engine; default 1)")
    ap.add_argument("--max-model-len", type=int, default=18432)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-seqs", type=int, help="most requests running at once (default: the engine's)")
    ap.add_argument("--max-num-batched-tokens", type=int, help="tokens a step (chunked prefill; default: the engine's)")
    ap.add_argument("--block-size", type=int, help="KV cache page size in tokens (vLLM's block_size, SGLang's "
                                                   "page_size; default: the engine's)")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA graphs off (debugging only)")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests per engine before measuring")
    ap.add_argument("--smoke", action="store_true", help="2 layers, 16 prompts, the first rate only")
    ap.add_argument("--name", help=f"output name (default e2e_{engine.name}, or e2e_{engine.name}_smoke with --smoke)")
    ap.add_argument("--timeout-per-backend", type=float, help="seconds before a backend's child is killed")
    ap.add_argument("--save-requests", action="store_true", help="keep every request's chunk times in the JSON")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and time estimate; start nothing")
    ap.add_argument("--verbose", action="store_true", help=f"echo the children's full {engine.label} logs")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join result JSONs into --name")
    ap.add_argument("--report", metavar="JSON", help="rewrite the markdown (and plot) of a result JSON")
    ap.add_argument("--child", metavar="PLAN", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    return ap


def main(argv, engine: Engine, doc: str, child) -> int:
    """The bench's command line: child(plan_path, backend, out_path) runs one backend in a child process."""
    ap = build_parser(engine, doc)
    a = ap.parse_args(argv)

    if a.child:
        return child(a.child, a.backend, a.child_out)
    name = a.name or (f"e2e_{engine.name}_smoke" if a.smoke else f"e2e_{engine.name}")
    if a.report:
        r = rescore(json.loads(Path(a.report).read_text()), engine)
        write_outputs(r, a.name or Path(a.report).stem, engine)
        return 0
    if a.merge:
        merge(a.merge, name, engine)
        return 0
    try:
        plan = build_plan(a, engine)
    except ValueError as e:
        ap.error(str(e))
    est_per = print_estimate(plan)
    est = sum(est_per.values())
    if a.dry_run:
        return 0

    d = out_dir()
    logs = d / f"{name}_logs"
    logs.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="fi-e2e-model-"))
    try:
        (model_dir / "config.json").write_text(json.dumps(plan["config"], indent=1))
        child_plan = {**{k: plan[k] for k in ("settings", "config", "datasets", "rates")},
                      "model_dir": str(model_dir), "save_requests": a.save_requests}
        plan_path = logs / "plan.json"
        plan_path.write_text(json.dumps(child_plan))
        try:
            version = importlib.metadata.version(engine.name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        device = gpu_info()
        log(f"device {device.get('name')}, {engine.label} {version}, commit {commit()[:12]}, writing to {d}")
        results = {}
        t0 = time.perf_counter()
        for b in plan["backends"]:
            timeout = a.timeout_per_backend or (300 + 3 * est_per[b])
            results[b] = run_child(engine, b, plan_path, logs, timeout, a.verbose)
            version = results[b].get(engine.name, version)
            r = assemble(engine, plan["settings"], plan["model"], device, results, version,
                         {"estimate_s": round(est), "wall_s": round(time.perf_counter() - t0)})
            write_outputs(r, name, engine, quiet=b != plan["backends"][-1])   # rewritten after each backend
            log(f"after {b}: elapsed {time.perf_counter() - t0:.0f}s of est {est:.0f}s")
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    for x in r["ratios"]:
        log(f"{x.get('backend', engine.ours)}/{x['vs']} {x['dataset']} @ {x['rate']}: median ITL "
            f"{_fmt(x['median_itl'], '.3f')}, median TTFT {_fmt(x['median_ttft'], '.3f')}, output throughput "
            f"{_fmt(x.get('output_throughput'), '.3f')}")
    ok = any(res.get("runs") for res in results.values())
    return 0 if ok else 1


def entry_point(engine: Engine, doc: str, unavailable, serve):
    """A bench's main(argv=None): the parent's command line, and its --child mode running one backend."""
    def child(plan_path, backend, out_path):
        return child_main(plan_path, backend, out_path, engine, unavailable, serve)

    def main_(argv=None) -> int:
        return main(argv, engine, doc, child)
    return main_
