"""perf/prefill.py's pure helpers on the CPU: FLOP counting for masked variants (against a brute-force mask with
the reference's semantics), repeat and batch sizing, result merging and the markdown report of a synthetic
results JSON. The GPU sections themselves run on the GPU machine (python -m perf.prefill)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from perf import prefill as pf

RNG = random.Random(random.SystemRandom().randrange(2**32))


def brute_pairs(q_len, kv_len, causal, window_left):
    """Count of the mask fi_backend.reference.attention builds (bottom-right aligned query positions)."""
    kv_pos = torch.arange(kv_len)
    q_pos = kv_len - q_len + torch.arange(q_len)
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if causal:
        allowed &= kv_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        allowed &= kv_pos[None, :] >= q_pos[:, None] - window_left
    return int(allowed.sum())


@pytest.mark.parametrize("causal", [True, False])
def test_unmasked_pairs_matches_brute_force(causal):
    cases = [(1, 1, -1), (0, 5, -1), (5, 0, 3), (7, 3, -1), (7, 3, 1), (3, 7, 0), (64, 64, 16), (17, 1017, 128)]
    cases += [(RNG.randint(0, 300), RNG.randint(0, 300), RNG.choice([-1, 0, 1, RNG.randint(0, 400)]))
              for _ in range(200)]
    for q_len, kv_len, w in cases:
        assert pf.unmasked_pairs(q_len, kv_len, causal=causal, window_left=w) == brute_pairs(q_len, kv_len, causal, w), \
            (q_len, kv_len, causal, w)


def test_unmasked_pairs_closed_forms_at_benchmark_sizes():
    for s in pf.FLEX_LENGTHS:
        assert pf.unmasked_pairs(s, s) == s * (s + 1) // 2
        w = pf.WINDOW
        expect = s * (s + 1) // 2 if s <= w + 1 else (w + 1) * (w + 2) // 2 + (s - w - 1) * (w + 1)
        assert pf.unmasked_pairs(s, s, window_left=w) == expect
    with pytest.raises(ValueError, match="q_len"):
        pf.unmasked_pairs(-1, 3)


def test_flop_conventions():
    b, h, d, s = 16, 32, 128, 1024
    assert pf.issue_flops(b, h, d, s) == 2 * b * h * d * s * s
    # exact causal pairs exceed the issue's s^2 / 2 by a factor (1 + 1/s)
    exact = b * pf.attention_flops(pf.unmasked_pairs(s, s), h, d)
    assert exact == pytest.approx(pf.issue_flops(b, h, d, s) * (1 + 1 / s))
    assert pf.tflops(1e12, 1e6) == pytest.approx(1.0)
    assert pf.tflops(pf.issue_flops(b, h, d, s), 458.0) == pytest.approx(300.0, rel=1e-3)


def test_timed_reps_and_fit_batch():
    assert pf.timed_reps(100.0, 100) == 100                # 10 ms of timed calls: all of them
    assert pf.timed_reps(100_000.0, 100) == 30             # 100 ms calls: about 3 s
    assert pf.timed_reps(10_000_000.0, 100) == 10          # never below the minimum
    assert pf.timed_reps(10_000_000.0, 5) == 5             # nor above what was asked
    assert pf.timed_reps(0.0, 40) == 40
    assert pf.fit_batch(16, 16384, 16, 128) == 16          # 8 GiB of inputs fit the 24 GiB budget
    assert pf.fit_batch(16, 16384, 16, 128, budget_bytes=2 << 30) == 4
    assert pf.fit_batch(16, 1 << 20, 16, 128, budget_bytes=1) == 1


def test_diff_stats():
    a = torch.zeros(4, 3)
    b = torch.ones(4, 3)
    st = pf.diff_stats(a, b)
    assert st["max_abs_diff"] == 1.0 and st["rel_diff"] == pytest.approx(1.0)
    c = b.clone().to(torch.bfloat16)
    assert pf.diff_stats(c, b) == {"max_abs_diff": 0.0, "rel_diff": 0.0}


def test_user_variant_is_a_valid_variant():
    from fi_backend.variants import Variant
    v = Variant(**pf.USER_VARIANT)
    assert not v.use_softmax and "params.scale" in v.render()["VARIANT_BODY"]


def _flex_row(variant, s):
    return {"variant": variant, "batch": 16, "seq_len": s, "ours_us": 100.0, "ours_tflops": 400.0, "flex_us": 130.0,
            "flex_tflops": 300.0, "ratio_flex_over_ours": 1.3, "flex_first_call_s": 12.0,
            "check_vs_flex": {"max_abs_diff": 1e-2, "rel_diff": 1e-3, "ok": True}}


def _stamp():
    return {"device": {"name": "NVIDIA H100 80GB HBM3"}, "date": "2026-11-23T00:00:00+00:00", "commit": "abc" * 14}


def synthetic_results():
    fa2_row = {"batch": 16, "seq_len": 1024, "num_qo_heads": 32, "num_kv_heads": 8, "ours_us": 450.0,
               "ours_tflops": 305.0, "fi_fa2_tflops": 300.0, "ratio_fi_fa2_over_ours": 1.02,
               "check_vs_fi_fa2": {"max_abs_diff": 7.8e-3, "rel_diff": 2e-3, "ok": True}}
    paged_row = {"batch": 4, "seq_len": 4096, "ragged_us": 1000.0, "page16_us": 1050.0, "page16_over_ragged": 1.05,
                 "page1_us": 1080.0, "page1_over_ragged": 1.08}
    return {"benchmark": "prefill_test", **_stamp(),
            "fa2": {**_stamp(), "flashinfer": "0.6.14", "vllm_fa3": "not importable", "flops": "f",
                    "first_call_s": {"fi_fa2": 110.0, "fi_fa3": None}, "bar": "b", "rows": [fa2_row]},
            "paged": {**_stamp(), "num_qo_heads": 32, "num_kv_heads": 32, "layout": "l", "bar": "b",
                      "rows": [paged_row]},
            "flex": {**_stamp(), "heads": 16, "head_dim": 128, "batch": 16, "soft_cap": 30.0, "window_left": 1024,
                     "flops": "f", "flex": "x", "bar": "b", "rows": [_flex_row("causal", 1024)]},
            "family": {**_stamp(), "num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128, "tiles_per_cta": 3,
                       "members": [{"warps": 8, "mfrags": 2}, {"warps": 8, "mfrags": 1}],
                       "rows": [{"batch": 1, "seq_len": 512, "picked_rows_per_tile": 32, "pick_us": 40.0,
                                 "member0_us": 50.0, "member1_us": 38.0, "pick_over_fastest": 40.0 / 38.0}]},
            "variant_compile": {**_stamp(), "variant": pf.USER_VARIANT, "build_s": 21.5, "first_run_s": 0.2,
                                "total_s": 21.7, "bar_met": True, "bar": "b", "nvcc": "13.0", "cpus": 16,
                                "check_vs_reference": {"max_abs_diff": 0.1, "rel_diff": 3e-3, "ok": True},
                                "modules": [{"name": "prefill_x", "build_seconds": 21.0, "bytes": 1}]}}


def test_report_of_a_synthetic_results_json(tmp_path):
    path = tmp_path / "prefill_test.json"
    path.write_text(json.dumps(synthetic_results()))
    md = pf.write_report(path).read_text()
    assert md.count("\n## ") == 5
    assert "| 1x512 | 32 | 40.0 | 50.0 | 38.0 | 1.053 |" in md
    assert "| 32/8 | 16x1024 | 450.0 | 305 | 300 | 1.020 | - | - | - | - | 7.80e-03 |" in md
    assert "| 4x4096 | 1000.0 | 1050.0 | 1.050 | 1080.0 | 1.080 |" in md
    assert "| causal | 16x1024 | 100.0 | 400 | 130.0 | 300 | 1.300 | 12.0 | 1.00e-02 |" in md
    assert "| 21.5 | 0.20 | 21.7 | True |" in md
    # a run of one section reports that section alone
    only = {k: v for k, v in synthetic_results().items() if k not in ("fa2", "paged", "family", "variant_compile")}
    path.write_text(json.dumps(only))
    md = pf.write_report(path).read_text()
    assert md.count("\n## ") == 1 and "FlexAttention" in md


def test_merge_keeps_old_sections_and_merges_flex_rows():
    old = synthetic_results()
    old["flex"]["rows"] = [_flex_row("causal", 512), _flex_row("alibi", 512), _flex_row("causal", 1024)]
    new_row = {**_flex_row("causal", 1024), "ours_us": 90.0}
    new = {"device": {"name": "H100"}, "flex": {**_stamp(), "date": "2026-11-24", "rows": [new_row,
                                                                                           _flex_row("alibi", 2048)]}}
    merged = pf._merge(old, new)
    assert merged["fa2"] is old["fa2"] and merged["variant_compile"] is old["variant_compile"]
    assert merged["device"] == {"name": "H100"} and merged["flex"]["date"] == "2026-11-24"
    keys = [(x["variant"], x["seq_len"]) for x in merged["flex"]["rows"]]
    assert keys == [("causal", 512), ("causal", 1024), ("alibi", 512), ("alibi", 2048)]
    assert [x["ours_us"] for x in merged["flex"]["rows"] if x["seq_len"] == 1024] == [90.0]


def test_cli_rejects_unknown_sections(capsys):
    with pytest.raises(SystemExit) as e:
        pf.main(["--sections", "fa2,nope"])
    assert e.value.code == 2 and "nope" in capsys.readouterr().err


@pytest.mark.parametrize("page_size,group", [(1, 0), (16, 0), (1, 8)])
def test_paged_pool_holds_the_ragged_kv(page_size, group):
    """The paged section's pool, read through its BSR and through FlashInfer's CSR, gives back the ragged K/V
    (group: pages shuffled only within groups, perf/page1_gather.py)."""
    from fi_backend import formats
    case = pf.Case(3, RNG.randint(1, 70), 4, 2, head_dim=16, seed=RNG.randrange(1000), device="cpu")
    paged = pf.Paged(case, page_size, seed=RNG.randrange(1000), group=group)
    if group:  # every page stays within its group of `group` consecutive pages
        table = paged.table.reshape(-1)
        assert torch.equal(table // group, torch.arange(len(table)) // group)
    # our BSR: request i's blocks, expanded to slots of the flattened pool, are its tokens in order
    bsr = paged.bsr
    slots = []
    for i in range(case.batch):
        n = int(bsr.kv_num_blocks[i])
        blocks = bsr.kv_indices[int(bsr.kv_block_start[i]):int(bsr.kv_block_start[i]) + n].long()
        slots.append((blocks[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:case.seq_len])
    slots = torch.cat(slots)
    assert torch.equal(paged.k.reshape(-1, case.hkv, case.d)[slots], case.k)
    assert torch.equal(paged.v.reshape(-1, case.hkv, case.d)[slots], case.v)
    # FlashInfer's CSR: every request's pages, and a last page holding the remainder
    assert paged.csr_indptr.tolist() == [i * int(bsr.kv_num_blocks[0]) for i in range(case.batch + 1)]
    assert torch.equal(paged.csr_indices, paged.table.reshape(-1))
    assert torch.equal(paged.last_page_len, bsr.last_block_len)
    assert sorted(paged.table.reshape(-1).tolist()) == list(range(paged.num_pages))  # a permutation of the pool
    assert isinstance(bsr, formats.BSR) and bsr.block_width == page_size


def test_flex_medians_per_cell(tmp_path):
    """perf/flex_medians.py: each cell's median, min and max over runs, and the bar judged on the median."""
    from perf import flex_medians as fm
    cells = [("causal", 4096), ("alibi", 8192)]
    ratios = {c: [RNG.uniform(1.1, 1.3) for _ in range(5)] for c in cells}
    paths = []
    for i in range(5):
        rows = [{"variant": v, "batch": 16, "seq_len": s, "ratio_flex_over_ours": ratios[(v, s)][i],
                 "ours_us": 100.0 + i, "flex_us": 100.0 * ratios[(v, s)][i]} for v, s in cells]
        run = {"commit": "abc1234", "date": f"2026-11-23T0{i}:00:00", "device": {"name": "H100"},
               "bars": {"flex_ratio_min": 1.2}, "flex": {"rows": rows}}
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(run))
    res = fm.medians(paths)
    assert [(x["variant"], x["seq_len"]) for x in res["rows"]] == [("causal", 4096), ("alibi", 8192)]
    for x in res["rows"]:
        r = sorted(ratios[(x["variant"], x["seq_len"])])
        assert x["ratio_median"] == r[2] and x["ratio_min"] == r[0] and x["ratio_max"] == r[4] and x["runs"] == 5
        assert x["bar_met_by_median"] == (r[2] >= 1.2) and x["ours_us_median"] == 102.0
    assert "| causal | 16x4096 |" in fm.markdown(res)


def test_time_rounds_interleaves(monkeypatch):
    """Every fn once a round, in the given order, round after round (the paged and flex sections' method)."""
    calls = []
    monkeypatch.setattr(pf, "measure", lambda f, rep: {"median_us": float(f())})
    labels = [f"f{i}" for i in range(RNG.randint(2, 4))]
    fns = {k: (lambda k=k: calls.append(k) or len(calls)) for k in labels}
    rounds = RNG.randint(2, 5)
    seen = []
    times = pf.time_rounds(fns, rounds, 10, on_round=lambda i, t: seen.append(i))
    assert calls == labels * rounds and seen == list(range(rounds))
    assert times == {k: [float(r * len(labels) + j + 1) for r in range(rounds)] for j, k in enumerate(labels)}
