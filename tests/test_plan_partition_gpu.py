"""The partition plan (csrc/scheduler/planner.cc, ChoosePartition) on the decode kernel: shapes of issue 26
whose plan is the partition on the H100's decode grid, run through BatchAttention and compared with the
float64 reference (fi_backend.reference) with poisoned outputs (NaN) and poisoned unused cache slots; each
asserts that the plan really was the partition (PlanInfo.kind), and the same step with the partition off
(FI_BACKEND_PLAN_PARTITION=0) is LPT's plan and as correct.

The GPU tests run with `python3 -m pytest -q tests/test_plan_partition_gpu.py` on the GPU machine; the
first test runs anywhere and checks, with the wrapper's own grid formulas for 132 SMs, that these shapes
are partitioned there.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fi_backend import scheduler as S
from fi_backend import shapes

from attention_cases import make_wrapper, run_case

# (q heads, KV heads, head_dim, page size, KV dtype, KV lengths, query rows per request)
CASES = [
    (40, 10, 128, 1, "bf16", [1001] * 7, 1),     # Phi-3-medium / Phi-4: the worst cells of issue 26
    (40, 10, 128, 16, "bf16", [1001] * 7, 1),
    (32, 8, 128, 1, "bf16", [4096] * 13, 1),     # Llama-3-8B heads, 13 requests on 16 CTAs a unit
    (32, 8, 128, 16, "bf16", [4096] * 13, 1),
    (32, 8, 128, 16, "bf16", [4096] * 13, 2),    # two query rows a request: 2-row pieces, merged per row
    (40, 8, 128, 16, "bf16", [4096] * 13, 1),    # group 5
    (56, 8, 128, 1, "bf16", [2500] * 13, 1),     # group 7
    (56, 8, 128, 16, "bf16", [2500] * 13, 1),
    (35, 5, 128, 16, "bf16", [32768] + [512] * 63, 1),  # group 7, one long request among short ones
    (32, 8, 128, 16, "fp8", [4096] * 13, 1),     # fp8 KV
    (40, 10, 128, 1, "fp8", [2500] * 11, 1),
]
_IDS = [f"{hq}-{hkv}-{d}-p{page}-{kvd}-{len(kv)}x{kv[0]}-q{q}" for hq, hkv, d, page, kvd, kv, q in CASES]
_KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _grid(hq, hkv, d, kv_bytes, kv_lens, sms=132):
    """plan_into's grid arguments as the decode wrapper makes them for a step of these KV lengths
    (recommended_num_ctas, _decode_member, _use_member, plan's decode chunk floor), with the CTAs per SM that shared memory allows
    (registers allow at least as many for these shapes)."""
    group = hq // hkv

    def ctas(member):
        shape = shapes._kernel_shape(d, kv_bytes, group, member=member)
        units = hkv * (group // shape["hpc"])
        total = sms * shapes._blocks_by_smem(d, kv_bytes, shape)
        return shape, units, total - total % units
    requests = len(kv_lens)
    shape, units, grid0 = ctas(0)
    member = int(shapes.decode_family_size(d, kv_bytes, group) > 1 and requests * units < grid0)
    shape, units, grid = ctas(member)
    min_chunk = S.decode_min_kv_chunk(requests * units, min(grid, grid0), max(kv_lens))
    tile = 16 * shape["sub"] * shape["warps"]
    return dict(num_ctas=min(grid, grid0), num_units=units, tile_q=shape["rows"] // shape["hpc"],
                kv_chunk_align=tile, cost_q=float(tile), min_kv_chunk=min_chunk)


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_cases_are_partitioned_on_the_h100_grid(case):
    hq, hkv, d, _, kvd, kv, q = case
    g = _grid(hq, hkv, d, 1 if kvd == "fp8" else 2, kv)
    kv = np.asarray(kv, np.int32)
    qo = np.arange(len(kv) + 1, dtype=np.int32) * q
    views = S.PlanViews.allocate(g["num_ctas"], S.max_items_for(int(qo[-1]), g["num_ctas"], g["num_units"]),
                                 int(qo[-1]), S.max_partial_rows_for(g["num_ctas"], g["num_units"], g["tile_q"]))
    on = S.plan_into(views, qo, kv, partition=True, causal=q > 1, **g)
    off = S.plan_into(views, qo, kv, partition=False, causal=q > 1, **g)
    assert on.kind == "partition" and on.num_split_pairs > 0 and on.makespan < off.makespan


def _spy_plans(attn, monkeypatch):
    """The PlanInfo of every plan the wrapper makes (BatchAttention.plan discards it)."""
    infos, ws = [], attn.workspace
    real = ws.plan

    def plan(*args, **kwargs):
        info = real(*args, **kwargs)
        infos.append(info)
        return info
    monkeypatch.setattr(ws, "plan", plan)
    return infos


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_partition_decode_matches_reference(case, monkeypatch):
    hq, hkv, d, page, kvd, kv, q = case
    kv_dtype = _KV_DTYPES[kvd]
    attn = make_wrapper(hq, hkv, d, q_dtype=torch.bfloat16, kv_dtype=kv_dtype, page_size=page)
    infos = _spy_plans(attn, monkeypatch)
    scales = dict(k_scale=0.37, v_scale=1.9) if kvd == "fp8" else {}
    for switch in ("1", "0"):
        monkeypatch.setattr(attn, "_partition", switch == "1")  # FI_BACKEND_PLAN_PARTITION, read when made
        run_case(attn, kv, [q] * len(kv), dtype=torch.bfloat16, kv_dtype=kv_dtype, causal=q > 1, poison=True,
                 what=f"{_IDS[CASES.index(case)]} partition={switch}", **scales)
        info = infos[-1]
        assert info.kind == ("partition" if switch == "1" else "lpt"), info
        if switch == "1":
            plan = attn.workspace.host_plan()
            split = plan.items["partial_base"] >= 0
            assert info.num_split_pairs > 0 and split.any()
            # The merge's contract: per unit, a split row's items cover its KV once, in chunk order.
            for u in range(plan.num_units):
                mine = plan.items[(plan.items["unit"] == u) & split]
                for r in plan.split_rows:
                    rows = mine[(mine["q_begin"] <= r) & (mine["q_end"] > r)]
                    rows = rows[np.argsort(rows["partial_base"])]
                    assert len(rows) == plan.merge_indptr[r + 1] - plan.merge_indptr[r]
                    assert rows["kv_begin"][0] == 0 and np.array_equal(rows["kv_begin"][1:], rows["kv_end"][:-1])
