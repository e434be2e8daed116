"""Our prefill kernel's time against the number of back-to-back calls timed (30, 100, 300, interleaved), with
nvidia-smi sampling the SM clock, power and throttle reasons every 100 ms around each measurement: 16x4k causal at
16 heads (the flex shape) and 1x16k at 32. Prints a JSON line per measurement and writes $OUT/clk42.json (or
/tmp/clk42.json).

    python3 -m perf.power_clock          # on the GPU machine (perf/results/power_clock_69820e1.md)
"""
import json
import os
import subprocess
import time

from perf.prefill import Case, measure, ours_fn


def sampled(fn):
    """fn()'s result, its wall seconds, and (min SM clock, mean SM clock, max power, throttle reasons) sampled
    every 100 ms while it ran."""
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                          "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    r = fn()
    dt = time.time() - t0
    p.terminate()
    rows = [[x.strip() for x in line.split(",")] for line in p.communicate()[0].splitlines() if line.strip()]
    clk, pw = [float(x[0]) for x in rows], [float(x[1]) for x in rows]
    return r, dt, (min(clk, default=None), round(sum(clk) / len(clk)) if clk else None, max(pw, default=None),
                   sorted({x[2] for x in rows}))


def main():
    res = []
    for s, b in ((4096, 16), (16384, 1)):
        hq = 16 if s == 4096 else 32
        case = Case(b, s, hq, hq, seed=s)
        fn, _, _ = ours_fn(case)
        for rep in (30, 100, 30, 100, 300):
            r, dt, (cmin, cavg, pmax, thr) = sampled(lambda: measure(fn, rep))
            line = dict(shape=f"{b}x{s} h{hq}", rep=rep, median_us=round(r["median_us"], 1), p10=round(r["p10_us"], 1),
                        p90=round(r["p90_us"], 1), wall_s=round(dt, 2), sm_clock_min=cmin, sm_clock_avg=cavg,
                        power_max_w=pmax, throttle=thr)
            print(json.dumps(line), flush=True)
            res.append(line)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "clk42.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
