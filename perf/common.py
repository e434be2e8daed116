"""What every GPU benchmark here shares: timing with CUDA events (alternating rounds), the copy-rate ceiling,
output checks and results JSON.

Results carry device, date, commit, our figure, the anchor's figure from the same run and their ratio.
The commit comes from `git rev-parse HEAD`, or from FI_COMMIT where the tree travels without .git (the
GPU machine).
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TIMED_BUDGET_S = 3.0   # timed calls of one figure, seconds at most (long calls get fewer repeats)


def log(msg) -> None:
    print(msg, file=sys.stderr, flush=True)


def commit() -> str:
    env = os.environ.get("FI_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=RESULTS.parent,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_info() -> dict:
    import torch
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "sms": p.multi_processor_count, "l2_bytes": getattr(p, "L2_cache_size", None),
            "torch": torch.__version__, "cuda": torch.version.cuda}


def stamp() -> dict:
    """What every result records about where and when it ran."""
    return {"device": device_info(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit()}


_SLEEP_US_PER_MCYCLE = None


def _gpu_sleep(us: float) -> None:
    """Enqueue a spin kernel of about `us` microseconds (torch.cuda._sleep counts clock cycles)."""
    global _SLEEP_US_PER_MCYCLE
    import torch
    if _SLEEP_US_PER_MCYCLE is None:
        torch.cuda._sleep(1_000_000)  # the clock rises under load; calibrate on the second call
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(1_000_000)
        e.record()
        e.synchronize()
        _SLEEP_US_PER_MCYCLE = s.elapsed_time(e) * 1e3
    torch.cuda._sleep(int(us / _SLEEP_US_PER_MCYCLE * 1e6))


def time_us(fn, *, warmup: int = 10, rep: int = 100, setup=None, max_queue_us: float = 100_000.0) -> dict:
    """Median (and p10/p90) of `rep` timed calls of fn() in microseconds, each between two CUDA events.

    setup(i), when given, runs before call i outside the timed region (e.g. to pick the i-th input set so
    that rotating sets keeps the L2 cache from flattering anyone).

    The events time the device: a spin kernel enqueued before the timed calls (as long as the host needs
    to enqueue them, measured in the warm-up, at most max_queue_us) keeps the device busy while the host
    runs ahead, so a call's host-side cost (Python, argument checks, launch) does not show up as device
    idle time between its events. Without it, a call shorter than its host cost (decode at batch 1-16)
    timed the host: what a CUDA-graph replay, which serving engines use for decode, does not pay.
    """
    import time

    import torch
    # Warm up for at least `warmup` calls and 200 ms: an idle H100 sits at 345 MHz, and a few short
    # calls end before its clocks rise (seen: first small shapes of a process timed 1.5-2x slow).
    t0 = time.perf_counter()
    t_end = t0 + 0.2
    i = 0
    while i < warmup or time.perf_counter() < t_end:
        if setup:
            setup(i)
        fn()
        i += 1
        if i % 16 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    per_call_us = (time.perf_counter() - t0) / i * 1e6  # host or device, whichever is slower
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    sleep_us = min(max_queue_us, 1.5 * rep * per_call_us)
    for _ in range(4):  # spin, enqueue, check; longer spin if the host fell behind
        _gpu_sleep(sleep_us)
        slept = torch.cuda.Event()
        slept.record()
        for i in range(rep):
            if setup:
                setup(i)
            starts[i].record()
            fn()
            ends[i].record()
        # The spin must outlast the host's enqueueing, else the device waited on the host between events
        # (seen: a process's first decode shape timed 89 us where its device time is ~12). Retry longer.
        covered = not slept.query()
        torch.cuda.synchronize()
        if covered or sleep_us >= max_queue_us:
            break
        sleep_us = min(max_queue_us, 4 * sleep_us)
    t = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return {"median_us": statistics.median(t), "p10_us": t[len(t) // 10], "p90_us": t[(9 * len(t)) // 10],
            "rep": rep}


def timed_reps(estimate_us: float, rep: int, budget_s: float = TIMED_BUDGET_S, minimum: int = 10) -> int:
    """Repeats for time_us: `rep`, fewer when one call is long, so that a figure takes about budget_s."""
    if estimate_us <= 0:
        return rep
    return max(min(minimum, rep), min(rep, int(budget_s * 1e6 / estimate_us)))


def measure(fn, rep: int) -> dict:
    """time_us with repeats scaled to the call's length (one untimed call, then one timed, for the estimate)."""
    import time

    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time_us(fn, rep=timed_reps((time.perf_counter() - t0) * 1e6, rep))


def time_rounds(fns: dict, rounds: int, rep: int, on_round=None) -> dict:
    """{label: [median us, one a round]}: each fn timed once a round, in order, the rounds one after another,
    so the figures compared within a round were taken seconds apart (a shape's time moves by up to 8% within
    minutes on an H100). on_round(i, times) after each round (progress)."""
    times = {k: [] for k in fns}
    for i in range(rounds):
        for k, f in fns.items():
            times[k].append(measure(f, rep)["median_us"])
        if on_round:
            on_round(i, times)
    return times


def profile_once(fn, warmup: int = 3) -> None:
    """fn() `warmup` times, then once between cudaProfilerStart / Stop: the one launch an ncu run with
    --profile-from-start off records (perf.tools.ncu_prefill, ncu_decode)."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def rotating(run, sets):
    """fn() that calls run(i) with the next input set each call (host-side bookkeeping only: time_us times the
    device with the host running ahead), so that time_rounds / measure rotate sets past the L2 cache."""
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % sets
        run(state["i"])
    return fn


def diff_stats(ours, other) -> dict:
    """max |ours - other| and ||ours - other|| / ||other||, in float32."""
    a, b = ours.float(), other.float()
    d = a - b
    return {"max_abs_diff": d.abs().max().item(), "rel_diff": (d.norm() / b.norm().clamp_min(1e-30)).item()}


def host_us(fn, n: int = 20000) -> float:
    """Host wall time per call of fn() in microseconds, launches queued without synchronising (the median of
    five batches of n / 5 calls, after 200 warm-up calls): the host cost of a launcher where the GPU keeps up."""
    import time
    import torch
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n // 5):
            fn()
        samples.append((time.perf_counter_ns() - t0) / (n // 5) / 1e3)
        torch.cuda.synchronize()
    return statistics.median(samples)


def copy_rate_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate counting bytes read plus written: the bandwidth ceiling we compare to."""
    import torch
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    r = time_us(lambda: b.copy_(a), warmup=5, rep=30)
    return 2 * nbytes / (r["median_us"] * 1e-6) / 1e9


def add_build_argument(ap, what: str) -> None:
    """The repeatable `--build NAME=FLAGS` of the in-process A/B tools (perf composable, perf.tools.prefill_ab): `what`
    also built with these extra nvcc flags (FI_BACKEND_NVCC_FLAGS), e.g. a kernel change behind a macro on a branch."""
    ap.add_argument("--build", action="append", default=[], metavar="NAME=FLAGS",
                    help=f"{what} built with these extra nvcc flags too (FI_BACKEND_NVCC_FLAGS, same process); NAME an "
                         "identifier; repeatable")


def parse_builds(ap, values) -> list:
    """`--build` values as (name, flags) pairs; a malformed one is an argparse error naming it."""
    builds = [tuple(v.split("=", 1)) for v in values]
    bad = [v for v, b in zip(values, builds) if len(b) != 2 or not b[0].isidentifier()]
    if bad:
        ap.error(f"--build: NAME=FLAGS with NAME an identifier; got {bad}")
    return builds


def write_result(name: str, payload: dict) -> Path:
    """Write perf/results/<name>.json (and a copy under $OUT when it is set, for the GPU machine)."""
    payload = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "commit": commit(), **payload}
    text = json.dumps(payload, indent=1, sort_keys=False) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(text)
    print(f"wrote {path}", file=sys.stderr)
    return path


def prebuild_specs(wanted, jobs=None, cute_pages=()) -> dict:
    """Build (or find cached) our kernel modules in parallel (kernels.build_many), so that timed runs do not build
    them one at a time. wanted: (kernel "decode" | "prefill", variant, head_dim, kv dtype, group) tuples, bf16
    queries; a prefill entry means every member of its tile family, and the CuTe member's modules for each page size
    of cute_pages (0: a ragged wrapper's)."""
    import time

    from fi_backend import cute_member, kernels
    from fi_backend.wrappers import decode_spec, prefill_family_size, prefill_spec
    specs, seen = [], set()

    def add(spec):
        if spec.memo_key not in seen:
            seen.add(spec.memo_key)
            specs.append(spec)
    for kernel, variant, d, kv, group in wanted:
        if kernel == "decode":
            add(decode_spec(variant, d, "bf16", kv, group))
        else:
            for m in range(prefill_family_size(d, kv)):
                add(prefill_spec(variant, d, "bf16", kv, group, member=m))
            for page in cute_pages:  # the CuTe member's, where prefill wrappers of that page size (0: ragged) load it
                for spec in cute_member.specs_for(variant, d, "bf16", kv, page):
                    add(spec)
    if not specs:
        return {"modules": 0, "seconds": 0.0, "errors": []}
    jobs = jobs or min(16, os.cpu_count() or 1)
    log(f"prebuild: {len(specs)} kernel modules, {jobs} at a time (cached ones load at once)")
    t0 = time.perf_counter()
    errors = []

    def done(spec, res):
        if isinstance(res, Exception):
            errors.append(f"{spec.readable_tag()}: {type(res).__name__}: {res}")
            log(f"  prebuild failed {spec.family} {spec.readable_tag()}: {res}")
        else:
            log(f"  {spec.family} {spec.readable_tag()}: "
                + (f"built in {res.seconds:.1f} s" if getattr(res, "built", False) else "cached"))
    kernels.build_many(specs, jobs=jobs, on_done=done)
    secs = time.perf_counter() - t0
    log(f"prebuild: {len(specs)} modules in {secs:.1f} s" + (f", {len(errors)} failed" if errors else ""))
    return {"modules": len(specs), "seconds": secs, "errors": errors}
