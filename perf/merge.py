"""Attention-state merge: kernel bandwidth and host overhead. python -m perf.merge [--json]

Kernel: merge_state (two states) and merge_states (S = 8) at seq 32768, 32 heads, head_dim 128, bf16,
timed with CUDA events (median); bytes = every input read once + every output written once; compared
with the device copy rate and with the same merge in PyTorch ops (the anchor).
Host: wall time per call of ops.merge_state on a decode-sized input (1 row, 32 heads), launches queued
without synchronising, against the PyTorch anchor, the bare ctypes launcher call, and that call when it returns before
touching CUDA (the ctypes cost alone).
"""
from __future__ import annotations

import argparse

import torch

from fi_backend import ops
from perf.common import copy_rate_gbps, device_info, host_us, time_us, write_result


def torch_merge_state(v_a, s_a, v_b, s_b):
    """The anchor: the same math in PyTorch ops (fp32), without -inf handling."""
    m = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)
    d = w_a + w_b
    v = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / d[..., None]
    return v.to(v_a.dtype), m + torch.log(d)


def torch_merge_states(v, s):
    m = s.amax(dim=1, keepdim=True)
    w = torch.exp(s - m)
    d = w.sum(dim=1)
    out = (v.float() * w[..., None]).sum(dim=1) / d[..., None]
    return out.to(v.dtype), m.squeeze(1) + torch.log(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true", help="write perf/results/merge.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dt, seq, heads, d, states = torch.bfloat16, 32768, 32, 128, 8
    esz = torch.tensor([], dtype=dt).element_size()
    results = {"device": device_info(), "copy_rate_gbps": copy_rate_gbps(), "cases": {}}
    ceiling = results["copy_rate_gbps"]

    v_a, v_b = (torch.randn(seq, heads, d, device="cuda", dtype=dt) for _ in range(2))
    s_a, s_b = (torch.randn(seq, heads, device="cuda") * 3 for _ in range(2))
    out, out_lse = torch.empty_like(v_a), torch.empty_like(s_a)
    nbytes = 3 * seq * heads * d * esz + 3 * seq * heads * 4
    ours = time_us(lambda: ops.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse))
    anchor = time_us(lambda: torch_merge_state(v_a, s_a, v_b, s_b))
    results["cases"]["merge_state"] = _case(nbytes, ours, anchor, ceiling)

    v = torch.randn(seq // 4, states, heads, d, device="cuda", dtype=dt)
    s = torch.randn(seq // 4, states, heads, device="cuda") * 3
    outs, outs_lse = torch.empty(seq // 4, heads, d, device="cuda", dtype=dt), torch.empty(seq // 4, heads, device="cuda")
    nbytes = (states + 1) * (seq // 4) * heads * (d * esz + 4)
    ours = time_us(lambda: ops.merge_states(v, s, out=outs, out_lse=outs_lse))
    anchor = time_us(lambda: torch_merge_states(v, s))
    results["cases"][f"merge_states_S{states}"] = _case(nbytes, ours, anchor, ceiling)

    # Host overhead at decode size (launch-bound).
    a, b = torch.randn(1, heads, d, device="cuda", dtype=dt), torch.randn(1, heads, d, device="cuda", dtype=dt)
    la, lb = torch.randn(1, heads, device="cuda"), torch.randn(1, heads, device="cuda")
    o, lo = torch.empty_like(a), torch.empty_like(la)
    module, fn, _ = ops._merge_launchers(dt)
    raw_args = (a.data_ptr(), la.data_ptr(), b.data_ptr(), lb.data_ptr(), o.data_ptr(), lo.data_ptr(), 1, heads, d,
                a.stride(0), la.stride(0), b.stride(0), lb.stride(0), o.stride(0), lo.stride(0),
                torch.cuda.current_stream().cuda_stream)
    noop_args = raw_args[:6] + (0,) + raw_args[7:]
    host = {
        "ops.merge_state_us": host_us(lambda: ops.merge_state(a, la, b, lb, out=o, out_lse=lo)),
        "ctypes_launcher_us": host_us(lambda: fn(*raw_args)),
        "ctypes_noop_us": host_us(lambda: fn(*noop_args)),  # seq = 0: returns before any CUDA call
        "torch_anchor_us": host_us(lambda: torch_merge_state(a, la, b, lb)),
    }
    host["ratio_anchor_over_ours"] = host["torch_anchor_us"] / host["ops.merge_state_us"]
    results["host"] = host

    print(f"device {results['device']['name']}, copy rate {ceiling:.0f} GB/s")
    print(f"{'case':<18}{'ours us':>10}{'GB/s':>8}{'% copy':>8}{'torch us':>10}{'speedup':>9}")
    for name, c in results["cases"].items():
        print(f"{name:<18}{c['ours_us']:>10.1f}{c['ours_gbps']:>8.0f}{c['pct_of_copy_rate']:>8.1f}"
              f"{c['anchor_us']:>10.1f}{c['ratio_anchor_over_ours']:>9.2f}")
    print("host per call (us): " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    if args.json:
        write_result("merge", results)


def _case(nbytes, ours, anchor, ceiling):
    gbps = nbytes / (ours["median_us"] * 1e-6) / 1e9
    return {"bytes": nbytes, "ours_us": ours["median_us"], "ours_p90_us": ours["p90_us"], "ours_gbps": gbps,
            "pct_of_copy_rate": 100 * gbps / ceiling, "anchor_us": anchor["median_us"],
            "ratio_anchor_over_ours": anchor["median_us"] / ours["median_us"]}


if __name__ == "__main__":
    main()
