"""perf/zoo.py's pure helpers on the CPU: config enumeration from the zoo, argument parsing, the decode case's
page tables and reference (against a token-by-token gather), ratios, group-4 ratios, merging and the markdown
report of a synthetic results JSON. The GPU sections themselves run on the GPU machine (python -m perf.zoo)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from perf import zoo


def test_parse_configs():
    assert zoo.parse_configs(None) is None
    assert zoo.parse_configs("") is None
    assert zoo.parse_configs("32/8/128, 28/4/128,32/8/128") == [(32, 8, 128), (28, 4, 128)]
    for bad in ("32/8", "32/7/128", "0/1/64", "a/b/c"):
        with pytest.raises(ValueError):
            zoo.parse_configs(bad)


def test_parse_shapes():
    assert zoo.parse_shapes("7x1000,64X2047") == [(7, 1000), (64, 2047)]
    for bad in ("7", "7x0", "7x1x2"):
        with pytest.raises(ValueError):
            zoo.parse_shapes(bad)


def test_decode_configs_full_zoo():
    from fi_backend.models import ZOO, check
    configs, refused = zoo.decode_configs()
    keys = [(c["num_qo_heads"], c["num_kv_heads"], c["head_dim"]) for c in configs]
    expected = {(m.num_qo_heads, m.num_kv_heads, m.head_dim) for m in ZOO if check(m)[0]}
    assert len(keys) == len(set(keys)) and set(keys) == expected
    assert {name for name, _ in refused} == {m.name for m in ZOO if not check(m)[0]}
    for c in configs:
        assert c["anchor"] == ("flashinfer" if c["head_dim"] in (64, 128, 256) else "none")
        assert c["group"] == c["num_qo_heads"] // c["num_kv_heads"]
        assert c["config"] == f"{c['num_qo_heads']}/{c['num_kv_heads']}/{c['head_dim']}"
    assert [(c["head_dim"], c["group"]) for c in configs] == sorted((c["head_dim"], c["group"]) for c in configs)
    by = {c["config"]: c for c in configs}
    assert "Phi-3-mini" in by["32/32/96"]["models"] and by["32/32/96"]["anchor"] == "none"
    assert {"Llama-3.1-8B", "Qwen3-8B"} <= set(by["32/8/128"]["models"])


def test_decode_configs_quick_and_filter():
    configs, _ = zoo.decode_configs(quick=True)
    assert {c["config"] for c in configs} == {"32/8/128", "28/4/128", "40/8/128", "24/8/128", "12/2/128",
                                              "16/8/256", "128/8/128", "4/1/256"}
    only, _ = zoo.decode_configs(only=[(28, 4, 128), (32, 8, 96)], quick=True)   # only overrides quick
    assert [c["config"] for c in only] == ["32/8/96", "28/4/128"]
    assert only[0]["models"] == ["(not in the zoo)"] and only[0]["anchor"] == "none"
    assert zoo.decode_configs(only=[(16, 8, 256)], fi_head_dims=(128,))[0][0]["anchor"] == "none"


def test_prefill_configs():
    cfgs = zoo.prefill_configs()
    groups = {c["group"] for c in cfgs if c["head_dim"] == 128}
    assert groups == {3, 4, 5, 6, 7}
    assert {(c["num_qo_heads"], c["num_kv_heads"], c["head_dim"]) for c in cfgs if c["head_dim"] != 128} == \
        {(32, 32, 96), (32, 32, 80)}
    assert [c["config"] for c in zoo.prefill_configs(only=[(28, 4, 128)])] == ["28/4/128"]
    extra = zoo.prefill_configs(extra=[(32, 8, 96), (28, 4, 128)])
    assert [c["label"] for c in extra] == ["group 4", "group 7 (Qwen2.5-7B)"]


def test_decode_kv_bytes():
    assert zoo.decode_kv_bytes(64, 2047, 8, 128) == 64 * 2047 * 8 * 128 * 4


def test_round_ratio():
    assert zoo.round_ratio([10, 12, 30], [10, 10, 10]) == pytest.approx(1.2)
    assert zoo.round_ratio([], [1]) is None
    assert zoo.round_ratio(None, [1]) is None


def test_rotating_cycles_sets():
    seen = []
    fn = zoo.rotating(seen.append, 3)
    for _ in range(7):
        fn()
    assert seen == [1, 2, 0, 1, 2, 0, 1]


@pytest.mark.parametrize("page", [1, 16, 64, 128])
def test_decode_case_tables_and_reference(page):
    hq, hkv, d = 8, 2, 64
    lens = [7, 130, 1]
    case = zoo.DecodeCase(hq, hkv, d, lens, page, sets=2, seed=3, device="cpu")
    blocks = [(L + page - 1) // page for L in lens]
    assert case.num_pages == sum(blocks)
    assert case.indptr.tolist() == [0] + list(torch.cumsum(torch.tensor(blocks), 0).tolist())
    assert sorted(case.indices.tolist()) == list(range(case.num_pages))       # a permutation of the pool
    assert case.last_page_len.tolist() == [L - (n - 1) * page for L, n in zip(lens, blocks)]
    for r, n in enumerate(blocks):   # CSR (FlashInfer) and block table (ours) name the same pages in order
        assert case.block_table[r, :n].tolist() == case.indices[case.indptr[r]:case.indptr[r + 1]].tolist()
    assert case.caches[0].shape == (case.num_pages, 2, page, hkv, d)
    for req, L in enumerate(lens):
        c = case.caches[1]
        toks = [(int(case.block_table[req, t // page]), t % page) for t in range(L)]
        k = torch.stack([c[p, 0, o] for p, o in toks]).float()   # [L, hkv, d]
        v = torch.stack([c[p, 1, o] for p, o in toks]).float()
        q = case.q[req].float()
        ref = torch.empty(hq, d)
        for h in range(hq):
            kh = h // (hq // hkv)
            p = torch.softmax(k[:, kh] @ q[h] / math.sqrt(d), dim=0)
            ref[h] = p @ v[:, kh]
        assert torch.allclose(zoo.decode_reference(case, req, set_index=1), ref, atol=1e-5, rtol=1e-4)


def _prefill_row(hq, hkv, d, tf, **kw):
    return {"config": f"{hq}/{hkv}/{d}", "label": f"g{hq // hkv}", "num_qo_heads": hq, "num_kv_heads": hkv,
            "head_dim": d, "group": hq // hkv, "batch": 4, "seq_len": 4096, "ours_us": 1000.0, "ours_tflops": tf, **kw}


def test_add_group_ratios():
    rows = [_prefill_row(32, 8, 128, 500.0), _prefill_row(28, 4, 128, 470.0), _prefill_row(24, 8, 128, 480.0),
            _prefill_row(32, 32, 96, 400.0), _prefill_row(32, 8, 80, 300.0), _prefill_row(32, 32, 80, 270.0)]
    zoo.add_group_ratios(rows)
    by = {r["config"]: r for r in rows}
    assert by["32/8/128"]["over_group4"] == pytest.approx(1.0) and "bar_group4_met" not in by["32/8/128"]
    assert by["28/4/128"]["over_group4"] == pytest.approx(0.94) and by["28/4/128"]["bar_group4_met"] is False
    assert by["24/8/128"]["bar_group4_met"] is True
    assert by["32/32/96"]["group4_ref"] == "32/8/128" and "bar_group4_met" not in by["32/32/96"]
    assert by["32/32/80"]["group4_ref"] == "32/8/80" and by["32/32/80"]["over_group4"] == pytest.approx(0.9)


def _results():
    dev = {"name": "NVIDIA H100 80GB HBM3", "sms": 132}
    stamp = {"device": dev, "date": "2026-11-25T00:00:00+00:00", "commit": "abc" * 14}
    drow = lambda cfg, page, ratio: {  # noqa: E731
        "config": cfg, "num_qo_heads": int(cfg.split("/")[0]), "num_kv_heads": int(cfg.split("/")[1]),
        "head_dim": int(cfg.split("/")[2]), "group": 4, "models": ["A", "B", "C", "D"], "page_size": page,
        "batch": 64, "kv_len": 2047, "ours_us": 100.0, "ours_gbps": 2700.0,
        **({"fi_us": 100.0 * ratio, "ratio": ratio, "checks": {"fi": {"rel_diff": 1e-3}}} if ratio else {})}
    return {"benchmark": "zoo_test", **stamp, "decode": {**stamp, "dtype": "bf16", "kv": "rotated", "anchor": "fi",
                                                         "configs": {"32/8/128": {"fi_first_call_s": 26.0}},
                                                         "rows": [drow("32/8/128", 16, 1.02), drow("32/8/128", 1, 0.97),
                                                                  drow("32/32/96", 16, None)]},
            "prefill": {**stamp, "flops": "pairs", "kv": "ragged", "vllm_fa3": "n/a",
                        "rows": [_prefill_row(32, 8, 128, 500.0, ratio_fi_fa2=1.2, bar_fi_fa2_met=True),
                                 _prefill_row(28, 4, 128, 490.0, ratio_fi_fa2=1.05, bar_fi_fa2_met=False)]}}


def test_summarize_and_report(tmp_path):
    r = zoo.summarize(_results())
    zoo.add_group_ratios(r["prefill"]["rows"])
    zoo.summarize(r)
    sd = r["decode"]["summary"]
    assert sd["cells"] == 3 and sd["cells_with_anchor"] == 2 and sd["min_ratio"] == pytest.approx(0.97)
    assert sd["bar_met"] is False and len(sd["cells_below_bar"]) == 1 and "page 1 " in sd["cells_below_bar"][0]
    sp = r["prefill"]["summary"]
    assert any("FlashInfer FA2" in x for x in sp["bars_missed"])
    path = tmp_path / "zoo_test.json"
    path.write_text(json.dumps(r))
    md = zoo.write_report(path).read_text()
    assert "| 32/8 | 128 | 4 | A, B, C +1 | 1 | 64x2047 | 100.0 | 2700 | 97.0 | 0.970 |" in md
    assert "| 32/32 | 96 |" in md and "NOT met" in md
    assert "| g7 | 28/4 | 128 | 4x4096 |" in md


def test_merge_results():
    old = _results()
    new = _results()
    new["decode"]["rows"] = [dict(old["decode"]["rows"][1], ratio=1.01, fi_us=101.0),
                             dict(old["decode"]["rows"][0], page_size=128)]
    new["decode"]["configs"] = {"28/4/128": {"fi_first_call_s": 3.0}}
    del new["prefill"]
    m = zoo.merge_results(old, new)
    keys = [zoo.decode_row_key(r) for r in m["decode"]["rows"]]
    assert len(keys) == len(set(keys)) == 4
    page1 = [r for r in m["decode"]["rows"] if r["page_size"] == 1 and r["head_dim"] == 128][0]
    assert page1["ratio"] == 1.01
    assert set(m["decode"]["configs"]) == {"32/8/128", "28/4/128"}
    assert m["decode"]["summary"]["bar_met"] is True
    assert m["prefill"]["rows"] == old["prefill"]["rows"] and "summary" in m["prefill"]


def test_resolve_args():
    a = zoo.resolve_args(["--quick"])
    assert a.section_list == ["decode", "prefill"] and a.rounds == 3 and a.rep == 50
    assert a.fi_head_dims == (64, 128, 256)
    a = zoo.resolve_args(["--sections", "prefill", "--rounds", "7", "--configs", "32/8/128", "--no-flashinfer"])
    assert a.section_list == ["prefill"] and a.rounds == 7 and a.rep == 100 and a.no_flashinfer
    assert zoo.resolve_args(["--prefill-tunings", '[{"warps": 12}]']).prefill_tuning_list == [{"warps": 12}]
    assert zoo.resolve_args([]).prefill_tuning_list == []
    for bad in (["--sections", "decode,flex"], ["--configs", "32/7/128"], ["--cells", "64"],
                ["--prefill-tunings", "{warps: 12}"], ["--prefill-tunings", '{"warps": 12}'], ["--prefill-tunings", "[{}]"]):
        with pytest.raises(SystemExit):
            zoo.resolve_args(bad)


def test_help_runs(capsys):
    with pytest.raises(SystemExit) as e:
        zoo.main(["--help"])
    assert e.value.code == 0
    assert "--configs" in capsys.readouterr().out


def test_main_flow_with_fakes(tmp_path, monkeypatch, capsys):
    """main() end to end on the CPU with the GPU parts faked (our kernels, FlashInfer, timing): the sections'
    control flow, the JSON, the report, --merge and the exit status. Fake 'kernels' compute the references."""
    from perf import common
    from perf import prefill as pf

    monkeypatch.setattr(zoo, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(zoo, "device_info", lambda: {"name": "fake", "sms": 1})
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(zoo, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(zoo, "_failures", [])

    def fake_ours_decode(case):
        out = torch.empty_like(case.q)

        def run(i):
            out.copy_(torch.stack([zoo.decode_reference(case, r, i) for r in range(case.B)]).to(out.dtype))
        fn = zoo.rotating(run, case.sets)
        fn.num_ctas = 1
        return fn, out, run

    class FakeFI:
        def __init__(self):
            self.first_call_s = {}

        def fn(self, case):
            f, out, run = fake_ours_decode(case)
            self.first_call_s.setdefault(zoo.config_key(case.hq, case.hkv, case.d), 1.0)
            return f, out, run

    def fake_rounds(fns, rounds, rep, on_round=None):
        for f in fns.values():
            f()
        return {k: [speed[k]] * rounds for k in fns}

    speed = {"ours": 100.0, "fi": 101.0, "fi_fa2": 125.0, "fi_fa3": 90.0, "vllm_fa3": 95.0, "ours_t0": 80.0,
             "ours_family": 110.0}

    real_case = pf.Case

    def sdpa_out(case, causal=True):
        s, g = case.seq_len, case.hq // case.hkv
        outs = []
        for r in range(case.batch):
            sl = slice(r * s, (r + 1) * s)
            q = case.q[sl].transpose(0, 1)[None]
            k = case.k[sl].repeat_interleave(g, 1).transpose(0, 1)[None]
            v = case.v[sl].repeat_interleave(g, 1).transpose(0, 1)[None]
            outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)[0].transpose(0, 1))
        return torch.cat(outs)

    def fake_ours_fn(case, tuning=None, paged=None, causal=True):  # with pages, a CuTe member unless switched off
        if tuning == {"warps": 5}:
            raise ValueError("no such shape")
        out = torch.empty_like(case.q)
        cute = paged is not None and os.environ.get("FI_BACKEND_PREFILL_CUTE") != "0"
        return (lambda: out.copy_(sdpa_out(case, causal))), out, {"num_ctas": 1, "rows_per_tile": 64, "cute_step": cute,
                                                          "cute_unsupported": None if cute else "a fake"}

    class FakeRagged:
        def __init__(self, backend):
            self.first_call_s = 2.0

        def fn(self, case, causal=True):
            if case.d != 128:
                raise RuntimeError("no kernel for this head_dim")
            out = torch.empty_like(case.q)
            return (lambda: out.copy_(sdpa_out(case, causal))), out

    monkeypatch.setattr(zoo, "ours_decode", fake_ours_decode)
    monkeypatch.setattr(zoo, "FlashInferDecode", FakeFI)
    monkeypatch.setattr(common, "time_rounds", fake_rounds)
    monkeypatch.setattr(pf, "Case", lambda *a, **k: real_case(*a, **k, device="cpu"))
    monkeypatch.setattr(pf, "ours_fn", fake_ours_fn)
    monkeypatch.setattr(pf, "FlashInferRagged", FakeRagged)
    monkeypatch.setattr(pf, "vllm_fa3", lambda: (None, "not importable (fake)"))
    import sys
    import types
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.6.14-fake"))

    args = ["--name", "zoo_fake", "--no-prebuild", "--configs", "8/2/64,32/32/96,32/8/128,28/4/128",
            "--cells", "2x33,1x5", "--pages", "1,16", "--prefill-shapes", "1x64", "--rounds", "2"]
    assert zoo.main(args) == 0, zoo._failures
    r = json.loads((tmp_path / "zoo_fake.json").read_text())
    rows = r["decode"]["rows"]
    assert len(rows) == 4 * 2 * 2 and not r["decode"]["errors"]
    assert all(x["ratio"] == pytest.approx(1.01) for x in rows if x["head_dim"] != 96)
    assert all("ratio" not in x and x["anchor"] == "none" for x in rows if x["head_dim"] == 96)
    assert all(c["ok"] for x in rows for c in x["checks"].values())
    assert r["decode"]["summary"]["bar_met"] is True
    p = {x["config"]: x for x in r["prefill"]["rows"]}
    assert set(p) == {"32/8/128", "28/4/128", "32/32/96"}
    assert p["28/4/128"]["ratio_fi_fa2"] == pytest.approx(1.25) and p["28/4/128"]["bar_fi_fa2_met"] is True
    assert "fi_fa2_us" not in p["32/32/96"] and p["32/32/96"]["group4_ref"] == "32/8/128"
    assert all(x["checks"]["sdpa_req0"]["ok"] for x in p.values())
    assert (tmp_path / "zoo_fake.md").is_file()

    # a second run merged in: decode of one more config only
    args2 = ["--name", "zoo_fake", "--no-prebuild", "--sections", "decode", "--configs", "4/1/256",
             "--cells", "1x5", "--pages", "128", "--rounds", "1", "--merge"]
    assert zoo.main(args2) == 0
    m = json.loads((tmp_path / "zoo_fake.json").read_text())
    assert len(m["decode"]["rows"]) == 17 and len(m["prefill"]["rows"]) == 3
    assert "4/1/256" in m["decode"]["configs"] and "8/2/64" in m["decode"]["configs"]

    # other kernel shapes timed beside ours (--prefill-tunings); one that cannot be built is recorded, not fatal
    assert zoo.main(["--name", "zoo_tun", "--no-prebuild", "--sections", "prefill", "--configs", "24/8/128",
                     "--prefill-shapes", "1x64", "--rounds", "2",
                     "--prefill-tunings", '[{"warps": 12, "mfrags": 1, "producer": 1}, {"warps": 5}]']) == 0
    (t,) = json.loads((tmp_path / "zoo_tun.json").read_text())["prefill"]["rows"]
    assert t["ours_t0_tuning"] == {"warps": 12, "mfrags": 1, "producer": 1} and t["ours_t0_us"] == 80.0
    assert t["ratio_ours_t0"] == pytest.approx(1.25) and t["checks"]["ours_t0"]["ok"]
    assert "no such shape" in t["ours_t1_error"] and "ours_t1_us" not in t

    # --prefill-page: ours on pages (the CuTe member where it applies), the tile family alone beside it
    assert zoo.main(["--name", "zoo_page", "--no-prebuild", "--sections", "prefill", "--configs", "32/8/128",
                     "--prefill-shapes", "1x64", "--rounds", "2", "--prefill-page", "16"]) == 0
    (g,) = json.loads((tmp_path / "zoo_page.json").read_text())["prefill"]["rows"]
    assert g["page_size"] == 16 and g["cute_step"] is True and g["cute_unsupported"] is None
    assert g["ratio_ours_family"] == pytest.approx(1.1) and g["checks"]["ours_family"]["ok"]
    assert os.environ.get("FI_BACKEND_PREFILL_CUTE") is None, "the switch is restored"

    # both masks, FlashInfer's FA3 beside FA2; the group bars on causal rows only; a bad mask named
    assert zoo.main(["--name", "zoo_masks", "--no-prebuild", "--sections", "prefill", "--configs", "32/8/128,24/8/128",
                     "--prefill-shapes", "1x64", "--rounds", "2", "--prefill-masks", "causal,full",
                     "--fi-prefill", "fa2,fa3"]) == 0
    rows = json.loads((tmp_path / "zoo_masks.json").read_text())["prefill"]["rows"]
    assert sorted((x["config"], x["mask"]) for x in rows) == [(c, m) for c in ("24/8/128", "32/8/128")
                                                              for m in ("causal", "full")]
    full = next(x for x in rows if x["config"] == "24/8/128" and x["mask"] == "full")
    causal = next(x for x in rows if x["config"] == "24/8/128" and x["mask"] == "causal")
    assert full["flops"] == pytest.approx(2 * causal["flops"] * 64 / 65) and full["checks"]["sdpa_req0"]["ok"]
    assert full["ratio_fi_fa3"] == pytest.approx(0.9) and "over_group4" not in full
    assert causal["over_group4"] == pytest.approx(24 / 32) and "bar_fi_fa2_met" not in full
    with pytest.raises(SystemExit):
        zoo.resolve_args(["--prefill-masks", "causal,sliding"])

    # with pages, vLLM FA3 on the same pages through its block table beside its ragged run
    def fake_fa3(q, k, v, *, out, causal, max_seqlen_q, block_table=None, **kw):
        if block_table is not None:   # the requests' pages back in order: ragged K / V
            rows = lambda pool: pool[block_table.long()].flatten(1, 2)[:, :max_seqlen_q].flatten(0, 1)
            k, v = rows(k), rows(v)
        case = types.SimpleNamespace(q=q, k=k, v=v, seq_len=max_seqlen_q, hq=q.shape[1], hkv=k.shape[1],
                               batch=q.shape[0] // max_seqlen_q)
        out.copy_(sdpa_out(case, causal))

    speed["vllm_fa3_paged"] = 105.0
    monkeypatch.setattr(pf, "vllm_fa3", lambda: (fake_fa3, None))
    assert zoo.main(["--name", "zoo_vpaged", "--no-prebuild", "--sections", "prefill", "--configs", "32/8/128",
                     "--prefill-shapes", "2x40", "--rounds", "2", "--prefill-page", "16",
                     "--prefill-masks", "causal,full"]) == 0, zoo._failures
    for x in json.loads((tmp_path / "zoo_vpaged.json").read_text())["prefill"]["rows"]:
        assert x["checks"]["vllm_fa3"]["ok"] and x["checks"]["vllm_fa3_paged"]["ok"]
        assert x["ratio_vllm_fa3_paged"] == pytest.approx(1.05) and x["ratio_vllm_fa3"] == pytest.approx(0.95)

    # FlashInfer missing: ours only, still exit 0
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert zoo.main(["--name", "zoo_nofi", "--no-prebuild", "--configs", "8/2/64", "--cells", "1x5", "--pages", "16",
                     "--prefill-shapes", "1x64", "--rounds", "1"]) == 0
    n = json.loads((tmp_path / "zoo_nofi.json").read_text())
    assert "ratio" not in n["decode"]["rows"][0] and n["decode"]["anchor"].startswith("none (flashinfer not importable")


def test_prebuild_specs(monkeypatch):
    """prebuild() asks kernels.build_many for each distinct decode module and prefill family member once, and the
    CuTe member's ragged modules per head size where it loads them (ours ragged: BatchAttention(ragged=True))."""
    from fi_backend import cute_member, kernels
    from fi_backend import variants as V
    from fi_backend.wrappers import prefill_family_size
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    seen = []

    def fake_build_many(specs, jobs=None, on_done=None, **kw):
        seen.extend(specs)
        for s in specs:
            on_done(s, kernels.BuildResult("x", None, False, 0.0))
        return []
    monkeypatch.setattr(kernels, "build_many", fake_build_many)
    dcfg = zoo.decode_configs(quick=True)[0]
    pcfg = zoo.prefill_configs()
    res = zoo.prebuild(dcfg + dcfg, pcfg)
    decode_keys = {(c["head_dim"], c["group"]) for c in dcfg}
    prefill_n = sum(prefill_family_size(d, "bf16") for d, g in {(c["head_dim"], c["group"]) for c in pcfg})
    cute_n = sum(len(cute_member.specs_for(V.DEFAULT, d, "bf16", "bf16", 0)) for d in {c["head_dim"] for c in pcfg})
    assert res["modules"] == len(seen) == len(decode_keys) + prefill_n + cute_n and not res["errors"]
    assert len({s.memo_key for s in seen}) == len(seen)


def test_estimate_grows_with_the_grid():
    def est(args):
        e = zoo.estimate(zoo.resolve_args(args))
        assert e["total_s"] == pytest.approx(e["timing_s"] + e["jit_s"])
        return e
    quick, full = est(["--quick"]), est([])
    assert 30 < quick["total_s"] < full["total_s"]
    one = est(["--sections", "decode", "--configs", "32/8/128", "--cells", "64x2047", "--pages", "16",
               "--no-flashinfer"])
    assert 0 < one["timing_s"] < quick["timing_s"] and one["jit_s"] == 0
    more = est(["--sections", "decode", "--configs", "32/8/128", "--cells", "64x2047", "--pages", "16",
                "--no-flashinfer", "--rounds", "10"])
    assert more["timing_s"] > one["timing_s"]
    # the committed zoo run (160 decode cells, 3 rounds) took 330 s with a warm FlashInfer cache
    assert 150 < est(["--cells", "7x1001,64x2047", "--rounds", "3"])["timing_s"] < 660
