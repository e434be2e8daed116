"""`python -m perf kernels` and `python -m perf compare` on the CPU: the grids, anchors and time estimate, the
figures from alternating rounds, merging, the before / after comparison and its exit code, the JSON, markdown and
plot of a run (GPU cells faked), and the `python -m perf` dispatcher. The GPU cells run on the GPU machine."""
from __future__ import annotations

import json
import random
import statistics
import sys

import pytest

from perf import __main__ as cli
from perf import kernels as K

RNG = random.Random(random.SystemRandom().randrange(2**32))


def test_grids_and_keys():
    for quick in (True, False):
        cells = K.grid(K.SECTIONS, quick)
        keys = [(c["section"], c["cell"]) for c in cells]
        assert len(keys) == len(set(keys)), "cell names must be unique: perf compare keys on them"
        assert {c["section"] for c in cells} == set(K.SECTIONS)
    quick, full = K.grid(K.SECTIONS, True), K.grid(K.SECTIONS, False)
    assert len(quick) < len(full) and {c["cell"] for c in quick if c["section"] != "merge"} < {c["cell"] for c in full}
    assert K.grid(["merge"], True) == K.merge_grid(True)
    d = {c["cell"]: c for c in K.decode_grid(False)}
    assert d["skewed"]["kv_lens"] == [32768] + [512] * 63
    assert len(d["sharegpt64"]["kv_lens"]) == 64 and min(d["sharegpt64"]["kv_lens"]) > 1
    assert d["64x4096 p16 fp8_e4m3"]["kv_dtype"] == "fp8_e4m3" and d["64x4096 p1"]["page_size"] == 1
    variants = [c for c in K.prefill_grid(False) if c["variant"] != "causal"]
    assert {c["variant"] for c in variants} == set(K.FLEX_VARIANTS) and all(c["num_qo_heads"] == 16 for c in variants)
    assert "16/16 16x4096" in {c["cell"] for c in K.prefill_grid(False)}
    with pytest.raises(ValueError, match="skewed, sharegpt64"):
        K.uneven_kv_lens("nope")


def test_anchors_for_each_cell():
    dec16, dec1 = K._decode_cell(64, 4096), K._decode_cell(64, 4096, page=1)
    fp8 = K._decode_cell(64, 4096, kv_dtype="fp8_e4m3")
    assert K.anchors_for(dec16) == ["flashinfer", "vllm_fa3"]
    assert K.anchors_for(dec1) == ["flashinfer"] and K.anchors_for(fp8) == ["flashinfer"]
    assert K.anchors_for(dec16, vllm=False) == ["flashinfer"]
    causal, alibi = K._prefill_cell(4, 4096, 32, 8), K._prefill_cell(16, 1024, 16, 16, "alibi")
    assert K.anchors_for(causal) == ["flashinfer_fa2", "vllm_fa3", "flex"]
    assert K.anchors_for(causal, fa3=True, vllm=False) == ["flashinfer_fa2", "flashinfer_fa3", "flex"]
    assert K.anchors_for(alibi) == ["flex"] and K.primary_anchor(alibi) == "flex"
    assert K.primary_anchor(causal) == "flashinfer_fa2" and K.primary_anchor(dec16) == "flashinfer"
    assert K.anchors_for(K._append_cell(8, 512, 4096)) == ["flashinfer_fa2", "vllm_fa3"]
    assert K.anchors_for(K.merge_grid(True)[0]) == ["flashinfer", "torch"]


def test_cell_work():
    b, L = RNG.randint(1, 64), RNG.randint(1, 5000)
    nbytes, flops = K.cell_work(K._decode_cell(b, L))
    assert flops == 0 and nbytes == b * L * 8 * 128 * 2 * 2 + 2 * 2 * b * 32 * 128
    assert K.cell_work(K._decode_cell(b, L, kv_dtype="fp8_e4m3"))[0] == b * L * 8 * 128 * 2 + 2 * 2 * b * 32 * 128
    s = RNG.randint(1, 4096)
    assert K.cell_work(K._prefill_cell(2, s, 32, 8))[1] == 4 * 32 * 128 * 2 * s * (s + 1) // 2
    win = K.cell_work(K._prefill_cell(1, 4096, 16, 16, "sliding_window_1024"))[1]
    assert win < K.cell_work(K._prefill_cell(1, 4096, 16, 16, "alibi"))[1]
    q, kv = 128, 2048   # the chunk's rows see the cached prefix and the chunk causally
    assert K.cell_work(K._append_cell(1, q, kv))[1] == 4 * 32 * 128 * (q * (kv - q) + q * (q + 1) // 2)
    m = K.merge_grid(True)[0]
    assert K.cell_work(m)[0] == 3 * 32768 * 32 * (128 * 2 + 4)


def test_estimate_is_monotone_and_quick_fits_the_bar_budget():
    quick = K.estimate(K.grid(K.SECTIONS, True), 5, 50)
    full = K.estimate(K.grid(K.SECTIONS, False), 5, 100)
    assert len(quick["cells"]) == len(K.grid(K.SECTIONS, True))
    assert quick["total_s"] == pytest.approx(sum(quick["cells"]) + sum(quick["jit"].values()))
    assert 60 < quick["total_s"] < 330 < full["total_s"]    # the quick grid: about 3-4 minutes plus cold JIT builds
    more = K.estimate(K.grid(K.SECTIONS, True), 10, 50)
    assert more["total_s"] > quick["total_s"]
    assert "flashinfer_fa3" in K.estimate(K.grid(["prefill"], True), 5, 50, fa3=True)["jit"]
    assert K.estimate(K.grid(["merge"], True), 5, 50)["jit"] == {"flashinfer_merge": K.EST_JIT_S["flashinfer_merge"]}
    c = K._decode_cell(64, 4096)
    assert K.estimate_call_us(K._decode_cell(256, 32768)) > K.estimate_call_us(c)


def test_prebuild_asks_for_each_module_once(monkeypatch):
    """The grid's own modules (decode bf16 and fp8 KV, the prefill family per variant and group) built in parallel
    before any timing, each once."""
    from fi_backend import kernels
    from fi_backend.wrappers import prefill_family_size
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    seen = []

    def fake_build_many(specs, jobs=None, on_done=None, **kw):
        seen.extend(specs)
        for sp in specs:
            on_done(sp, kernels.BuildResult("x", None, False, 0.0))
        return []
    monkeypatch.setattr(kernels, "build_many", fake_build_many)
    cells = K.grid(K.SECTIONS, False)
    need = K.modules_needed(cells)
    assert ("decode", "default", 128, "fp8_e4m3", 4) in need and ("prefill", "alibi", 128, "bf16", 1) in need
    assert ("prefill", "causal", 128, "bf16", 4) in need and len(need) == len(set(need)) == 7
    res = K.prebuild(cells + cells)
    members = prefill_family_size(128, "bf16")
    assert res["modules"] == len(seen) == 2 + 5 * members and not res["errors"]
    assert len({sp.memo_key for sp in seen}) == len(seen)
    assert K.modules_needed(K.merge_grid(True)) == []


def test_device_tag():
    assert K.device_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert K.device_tag("NVIDIA H200") == "h200"
    assert K.device_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert K.device_tag("Some GPU") == "some_gpu"


def test_summarise_rounds():
    n = RNG.randint(1, 6)
    ours = [RNG.uniform(90, 110) for _ in range(n)]
    tc = [RNG.uniform(80, 120) for _ in range(n)]
    cuda = [RNG.uniform(80, 120) for _ in range(n)]
    fa3 = [RNG.uniform(80, 120) for _ in range(n)]
    us, ratios, rounds = K.summarise({"ours": ours, "fi_tc": tc, "fi_cuda": cuda, "vllm_fa3": fa3},
                                     {"flashinfer": ["fi_tc", "fi_cuda"]})
    best = [min(a, b) for a, b in zip(tc, cuda)]
    assert rounds["flashinfer"] == best and "fi_tc" not in us
    assert us["ours"] == statistics.median(ours) and us["flashinfer"] == statistics.median(best)
    assert ratios["flashinfer"] == pytest.approx(statistics.median(b / o for b, o in zip(best, ours)))
    assert ratios["vllm_fa3"] == pytest.approx(statistics.median(f / o for f, o in zip(fa3, ours)))
    assert "ours" not in ratios
    us, ratios, _ = K.summarise({"ours": ours})   # anchors that all failed: ours alone
    assert ratios == {} and us == {"ours": statistics.median(ours)}


def _row(section, cell, ours, anchor_us, anchor="flashinfer"):
    ratios = {anchor: anchor_us / ours} if anchor else {}
    return {"section": section, "cell": cell, "us": {"ours": ours, **({anchor: anchor_us} if anchor else {})},
            "ratios": ratios, "anchor": anchor, "ratio": ratios.get(anchor)}


def _doc(rows_by_section, commit="abc", date="2026-11-26"):
    return {"benchmark": "kernels_h100_quick", "device": {"name": "NVIDIA H100 80GB HBM3"}, "date": date,
            "commit": commit, "rounds": 5, "quick": True,
            "sections": {s: {"primary_anchor": K.PRIMARY[s], "rows": rows} for s, rows in rows_by_section.items()},
            "anchors": {"flashinfer": "FlashInfer 0.6.14"}}


def test_compare_normalises_by_the_anchor():
    before = _doc({"decode": [_row("decode", "a", 100.0, 100.0), _row("decode", "b", 50.0, 60.0),
                              _row("decode", "c", 10.0, 10.0)],
                   "merge": [_row("merge", "m", 20.0, 0, anchor=None)]})
    # a: everything 5% slower (the machine): unmoved against the anchor; b: ours 3% slower, anchor unchanged: moved;
    # c: ours 1.5% faster: within 2%; m: no anchor, raw time 10% slower: moved.
    after = _doc({"decode": [_row("decode", "a", 105.0, 105.0), _row("decode", "b", 51.5, 60.0),
                             _row("decode", "c", 9.85, 10.0), _row("decode", "new", 1.0, 1.0)],
                  "merge": [_row("merge", "m", 22.0, 0, anchor=None)]}, commit="def")
    res = K.compare(before, after, 0.02)
    by = {r["cell"]: r for r in res["rows"]}
    assert by["a"]["change"] == pytest.approx(0.0) and by["a"]["raw_change"] == pytest.approx(0.05)
    assert by["b"]["change"] == pytest.approx(0.03) and by["b"]["moved"]
    assert by["c"]["change"] == pytest.approx(-0.015) and not by["c"]["moved"]
    assert by["m"]["basis"] == "raw" and by["m"]["change"] == pytest.approx(0.1) and by["m"]["moved"]
    assert {r["cell"] for r in res["moved"]} == {"b", "m"} and res["missing"] == ["decode new"]
    md = K.compare_markdown(res)
    assert "| decode | b | flashinfer | 1.200 | 1.165 | +3.0% | +3.0% | MOVED |" in md
    assert "2 of 4 cells moved more than 2.0%" in md
    assert not K.compare(before, before, 0.02)["moved"]


def test_compare_cli_exit_codes(tmp_path, capsys):
    before = _doc({"prefill": [_row("prefill", "32/8 4x4096", 1000.0, 1100.0, "flashinfer_fa2")]})
    same = _doc({"prefill": [_row("prefill", "32/8 4x4096", 1010.0, 1111.0, "flashinfer_fa2")]})
    worse = _doc({"prefill": [_row("prefill", "32/8 4x4096", 1050.0, 1100.0, "flashinfer_fa2")]})
    paths = {}
    for name, doc in (("before", before), ("same", same), ("worse", worse)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    assert cli.main(["compare", str(paths["before"]), str(paths["same"])]) == 0
    assert cli.main(["compare", str(paths["before"]), str(paths["worse"])]) == 1
    assert cli.main(["compare", str(paths["before"]), str(paths["worse"]), "--tolerance", "0.06"]) == 0
    out = tmp_path / "cmp.md"
    assert cli.main(["compare", str(paths["before"]), str(paths["worse"]), "--markdown", str(out)]) == 1
    assert "MOVED" in out.read_text()
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", str(paths["before"]), str(paths["same"]), "--tolerance", "2"])
    assert e.value.code == 2 and "--tolerance" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": []}))
    with pytest.raises(SystemExit):
        cli.main(["compare", str(bad), str(paths["same"])])
    assert "not a `perf kernels` result" in capsys.readouterr().err


def test_merge_results_keeps_other_sections():
    old = _doc({"decode": [_row("decode", "a", 1.0, 1.0), _row("decode", "b", 2.0, 2.0)],
                "merge": [_row("merge", "m", 3.0, 3.0)]})
    new = _doc({"decode": [_row("decode", "b", 2.5, 2.0)], "prefill": [_row("prefill", "p", 4.0, 4.0)]}, date="later")
    out = K.merge_results(old, new)
    assert list(out["sections"]) == ["decode", "prefill", "merge"] and out["date"] == "later"
    assert [(r["cell"], r["us"]["ours"]) for r in out["sections"]["decode"]["rows"]] == [("a", 1.0), ("b", 2.5)]
    assert out["summary"]["decode"]["cells"] == 2 and out["summary"]["merge"]["flashinfer"]["median_ratio"] == 1.0


def test_resolve_args(tmp_path):
    a = K.resolve_args(["--quick"])
    assert a.section_list == list(K.SECTIONS) and a.rounds == 5 and a.rep == 50 and a.quick
    a = K.resolve_args(["--sections", "merge,decode", "--rounds", "3", "--rep", "7", "--no-vllm", "--fa3"])
    assert a.section_list == ["decode", "merge"] and (a.rounds, a.rep, a.no_vllm, a.fa3) == (3, 7, True, True)
    assert a.command == "python -m perf kernels --sections merge,decode --rounds 3 --rep 7 --no-vllm --fa3"
    assert K.resolve_args(["--quick"]).fa3_member is None
    assert K.resolve_args(["--fa3-member", "--quick"]).fa3_member == [{}]
    a = K.resolve_args(["--fa3-member", '[{"fa3": 1}, {"fa3": 2}]'])
    assert [K.fa3_member_name(o) for o in a.fa3_member] == ["ours_fa3_fa3_1", "ours_fa3_fa3_2"]
    assert K.fa3_member_name({}) == "ours_fa3"
    for bad in (["--sections", "decode,nope"], ["--sections", ""], ["--rounds", "0"],
                ["--merge", str(tmp_path / "missing.json")], ["--fa3-member", "[1]"], ["--fa3-member", "{}"]):
        with pytest.raises(SystemExit):
            K.resolve_args(bad)


def test_estimate_only_prints_the_plan(capsys):
    assert cli.main(["kernels", "--quick", "--estimate"]) == 0
    err = capsys.readouterr().err
    assert "decode: 7 cells" in err and "estimate: about" in err and "min) on an H100" in err


def fake_runner(cell, ctx, rounds, rep):
    """A cell's row as the GPU runners build it, from made-up rounds."""
    names = K.anchors_for(cell, vllm=not ctx.a.no_vllm, fa3=ctx.a.fa3)
    times = {"ours": [100.0 + i for i in range(rounds)]}
    for j, n in enumerate(names):
        times[n] = [110.0 + j + i for i in range(rounds)]
    return _fake_timed_row(cell, times, rounds)


def _fake_timed_row(cell, times, rounds):
    import perf.common as common
    real = common.time_rounds
    common.time_rounds = lambda fns, r, rep: times
    try:
        return K._timed_row(cell, dict.fromkeys(times), {}, rounds, 1)
    finally:
        common.time_rounds = real


def test_main_writes_json_markdown_and_plot(tmp_path, monkeypatch):
    """The run path with the GPU cells faked: one JSON with device, date, commit, figures and ratios per cell, the
    markdown and the plot beside it, copies under $OUT, a failing cell recorded and the exit code 1."""
    pytest.importorskip("matplotlib")
    import perf.common as common
    import torch
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("FI_COMMIT", "0123456789abcdef")
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common, "stamp", lambda: {"device": {"name": "NVIDIA H100 80GB HBM3"}, "date": "d",
                                                  "commit": "c"})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    class FakeAnchors:
        def __init__(self, a):
            self.a = a
            self.broken = {}

        def describe(self):
            return {"flashinfer": "FlashInfer (fake)"}
    monkeypatch.setattr(K, "Anchors", FakeAnchors)
    monkeypatch.setattr(K, "prebuild", lambda cells: {"modules": len(K.modules_needed(cells))})
    runners = {s: fake_runner for s in K.SECTIONS}

    def broken(cell, ctx, rounds, rep):
        raise RuntimeError("no kernel")
    runners["append"] = broken
    monkeypatch.setattr(K, "RUNNERS", runners)
    assert K.main(["--quick", "--rounds", "3", "--name", "kq"]) == 1   # the append cells failed
    doc = json.loads((tmp_path / "results" / "kq.json").read_text())
    assert doc["commit"] == "0123456789abcdef" and doc["device"]["name"].startswith("NVIDIA H100")
    assert doc["quick"] and doc["rounds"] == 3 and len(doc["errors"]) == 2 and "no kernel" in doc["errors"][0]
    dec = doc["sections"]["decode"]["rows"]
    assert len(dec) == 7 and dec[0]["anchor"] == "flashinfer"
    assert dec[0]["ratio"] == pytest.approx(statistics.median((110.0 + i) / (100.0 + i) for i in range(3)))
    assert doc["sections"]["append"]["rows"] == [] and doc["summary"]["prefill"]["cells"] == 3
    assert doc["prebuild"] == {"modules": 3}   # decode group 4; prefill groups 4 (append too) and 1
    assert "ours_tflops" in doc["sections"]["prefill"]["rows"][0] and "ours_gbps" in dec[0]
    md = (tmp_path / "results" / "kq.md").read_text()
    assert "## decode" in md and "| 64x4096 p16 | 101.0 |" in md and "## Errors" in md
    assert (tmp_path / "results" / "kq.png").stat().st_size > 1000
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"kq.json", "kq.md", "kq.png"}
    # a second run of one section merged into the first
    monkeypatch.setattr(K, "RUNNERS", {s: fake_runner for s in K.SECTIONS})
    assert K.main(["--quick", "--sections", "append", "--merge", str(tmp_path / "results" / "kq.json"),
                   "--name", "kq2"]) == 0
    doc2 = json.loads((tmp_path / "results" / "kq2.json").read_text())
    assert len(doc2["sections"]["append"]["rows"]) == 2 and len(doc2["sections"]["decode"]["rows"]) == 7
    assert cli.main(["plot", str(tmp_path / "results" / "kq2.json"), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_dispatcher(monkeypatch, capsys):
    assert cli.main([]) == 2 and cli.main(["--help"]) == 0
    assert "kernels" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2 and "accepted: kernels" in capsys.readouterr().err
    seen = {}
    from perf.e2e import sglang_bench, vllm_bench
    monkeypatch.setattr(vllm_bench, "main", lambda argv: seen.setdefault("vllm", argv) and 0)
    monkeypatch.setattr(sglang_bench, "main", lambda argv: seen.setdefault("sglang", argv) and 0)
    cli.main(["e2e", "--engine", "vllm", "--smoke", "--tp", "2"])
    cli.main(["e2e", "--smoke", "--engine=sglang"])
    assert seen == {"vllm": ["--smoke", "--tp", "2"], "sglang": ["--smoke"]}
    assert cli.main(["e2e", "--smoke"]) == 2 and "--engine must be one of vllm, sglang" in capsys.readouterr().err
    from perf import plan, sharegpt, zoo
    monkeypatch.setattr(zoo, "main", lambda argv: seen.setdefault("zoo", argv) and 0)
    monkeypatch.setattr(plan, "main", lambda argv: seen.setdefault("plan", argv) and None)
    monkeypatch.setattr(sharegpt, "main", lambda argv: seen.setdefault("trace", argv) and 0)
    assert cli.main(["zoo", "--quick"]) == 0 and cli.main(["plan", "--batch", "256"]) == 0
    assert cli.main(["trace", "--show"]) == 0
    assert seen["zoo"] == ["--quick"] and seen["plan"] == ["--batch", "256"] and seen["trace"] == ["--show"]
    assert cli.main(["plot"]) == 2


def test_every_tool_imports():
    """perf/tools' scripts import (their GPU work runs only from main())."""
    import importlib
    from pathlib import Path
    tools = sorted(p.stem for p in (Path(K.__file__).parent / "tools").glob("*.py") if p.stem != "__init__")
    assert len(tools) >= 8
    for t in tools:
        importlib.import_module(f"perf.tools.{t}")
    readme = (Path(K.__file__).parent / "tools" / "README.md").read_text()
    assert all(f"{t}.py" in readme for t in tools), "each tool has its line in perf/tools/README.md"
    del sys.modules["perf.tools.ncu_prefill"]


def test_tree_ab_makes_a_base_tree_and_refuses_without_one(tmp_path, capsys):
    """perf.tools.tree_ab: --make-base writes HEAD's source parts (and the planner extension) into the base tree; a
    run without a command, or with a base tree that lacks a part, is refused with the reason."""
    import subprocess
    from perf.tools import tree_ab
    if subprocess.run(["git", "-C", str(tree_ab.ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    base = tmp_path / "base"
    assert tree_ab.main(["--base", str(base), "--make-base", "HEAD"]) == 0
    for part in tree_ab.TREE_PARTS:
        assert (base / part).exists(), part
    assert (base / "csrc" / "attention" / "decode.cuh").is_file()
    assert (base / tree_ab.REVISION).read_text().strip()   # the base runs' FI_COMMIT
    with pytest.raises(SystemExit):
        tree_ab.main(["--base", str(base)])
    assert "the perf command goes after --" in capsys.readouterr().err
    (base / "pyproject.toml").unlink()
    with pytest.raises(SystemExit):
        tree_ab.main(["--base", str(base), "--", "zoo"])
    assert "lacks pyproject.toml" in capsys.readouterr().err


def test_timeline_summary_splits_the_compute_warps_time():
    """perf.tools.timeline's split of the compute warps' time on a CTA whose stamps are known, timed by its clock
    (2 cycles a ns): waiting 0-100 and 1100-1200 ns, computing 100-1100
    and 1200-1700, finishing 1700-2700, the queue's end at 2700 (a producer stamp first, at -100)."""
    import numpy as np
    from perf.tools.timeline import summarise
    ev = np.zeros((2, 2, 8, 2), dtype=np.uint64)
    compute = [(0, 9), (100, 8), (1100, 9), (1200, 1), (1700, 2), (2700, 3), (2700, 9), (2700, 4)]
    for w, stamps in ((0, compute), (1, [(-100, 5), (-50, 6)])):
        for i, (t, tag) in enumerate(stamps):
            ev[0, w, i] = (1_000_000 + t, (tag << 56) | (5000 + 2 * (t + 100)))
    s = summarise(ev, 1)
    assert abs(s["span_ns"] - 2800) < 1e-6 and s["cycles_per_ns"] == 2.0
    assert s["ctas"][0]["items"] == 1 and s["ctas"][0]["tiles"] == 2
    share = s["compute_share"]
    for key, ns in (("waiting", 200), ("computing", 1500), ("finishing", 1000)):
        assert abs(share[key] - ns / 2700) < 1e-9, (key, share)
