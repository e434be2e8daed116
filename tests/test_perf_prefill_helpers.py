"""perf/prefill.py's and perf/common.py's pure helpers on the CPU: FLOP counting for masked variants (against a
brute-force mask with the reference's semantics), repeat and batch sizing, the paged and append pools, alternating
rounds. The GPU runs themselves are `python -m perf kernels` on the GPU machine."""
from __future__ import annotations

import json
import random

import pytest
import torch

from perf import common
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
    for s in (512, 1024, 2048, 4096, 8192, 16384):
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
    assert common.timed_reps(100.0, 100) == 100                # 10 ms of timed calls: all of them
    assert common.timed_reps(100_000.0, 100) == 30             # 100 ms calls: about 3 s
    assert common.timed_reps(10_000_000.0, 100) == 10          # never below the minimum
    assert common.timed_reps(10_000_000.0, 5) == 5             # nor above what was asked
    assert common.timed_reps(0.0, 40) == 40
    assert pf.fit_batch(16, 16384, 16, 128) == 16          # 8 GiB of inputs fit the 24 GiB budget
    assert pf.fit_batch(16, 16384, 16, 128, budget_bytes=2 << 30) == 4
    assert pf.fit_batch(16, 1 << 20, 16, 128, budget_bytes=1) == 1


def test_diff_stats():
    a = torch.zeros(4, 3)
    b = torch.ones(4, 3)
    st = common.diff_stats(a, b)
    assert st["max_abs_diff"] == 1.0 and st["rel_diff"] == pytest.approx(1.0)
    c = b.clone().to(torch.bfloat16)
    assert common.diff_stats(c, b) == {"max_abs_diff": 0.0, "rel_diff": 0.0}


def test_user_variant_is_a_valid_variant():
    from fi_backend.variants import Variant
    from perf.tools import variant_compile
    v = Variant(**variant_compile.USER_VARIANT)
    assert not v.use_softmax and "params.scale" in v.render()["VARIANT_BODY"]


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_pool_holds_the_ragged_kv(page_size):
    """The paged pool, read through its BSR and through FlashInfer's CSR, gives back the ragged K/V."""
    from fi_backend import formats
    case = pf.Case(3, RNG.randint(1, 70), 4, 2, head_dim=16, seed=RNG.randrange(1000), device="cpu")
    paged = pf.Paged(case, page_size, seed=RNG.randrange(1000))
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


@pytest.mark.parametrize("page_size", [1, 16])
def test_append_case_pool(page_size):
    """AppendCase: q rows per request, a pool that is a permutation of pages, our BSR and FlashInfer's CSR naming the
    same pages, a last page holding the remainder; a chunk longer than the cache is refused."""
    b, q_len = RNG.randint(1, 4), RNG.randint(1, 40)
    kv_len = q_len + RNG.randint(0, 90)
    case = pf.AppendCase(b, q_len, kv_len, 4, 2, head_dim=16, page_size=page_size, seed=RNG.randrange(1000),
                         device="cpu")
    pool = case.pool
    blocks = -(-kv_len // page_size)
    assert case.q.shape == (b * q_len, 4, 16) and case.indptr.tolist() == [i * q_len for i in range(b + 1)]
    assert pool.k.shape == (b * blocks, page_size, 2, 16)
    assert sorted(pool.table.reshape(-1).tolist()) == list(range(b * blocks))
    assert pool.csr_indptr.tolist() == [i * blocks for i in range(b + 1)]
    assert torch.equal(pool.csr_indices, pool.table.reshape(-1))
    assert pool.last_page_len.tolist() == [kv_len - (blocks - 1) * page_size] * b
    assert pool.bsr.kv_indices[:blocks].tolist() == pool.table[0].tolist()
    assert case.shape()["kv_bytes"] == 2 * b * kv_len * 2 * 16 * 2
    with pytest.raises(ValueError, match="q_len"):
        pf.AppendCase(1, 9, 8, 4, 2, head_dim=16, device="cpu")


def test_kernels_medians_per_cell(tmp_path):
    """perf/tools/medians.py: each (cell, anchor)'s median, min and max ratio over runs."""
    from perf.tools import medians as md
    cells = ["32/8 4x4096", "soft_cap_30 16x1024"]
    ratios = {c: [RNG.uniform(1.1, 1.3) for _ in range(5)] for c in cells}
    paths = []
    for i in range(5):
        rows = [{"cell": c, "us": {"ours": 100.0 + i, "flex": 100.0 * ratios[c][i]}, "ratios": {"flex": ratios[c][i]}}
                for c in cells]
        run = {"commit": "abc1234", "date": f"2026-11-23T0{i}:00:00", "device": {"name": "H100"},
               "sections": {"prefill": {"rows": rows}}}
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(run))
    res = md.medians(paths)
    assert [(x["cell"], x["anchor"]) for x in res["rows"]] == [(c, "flex") for c in cells]
    for x in res["rows"]:
        r = sorted(ratios[x["cell"]])
        assert x["ratio_median"] == r[2] and x["ratio_min"] == r[0] and x["ratio_max"] == r[4] and x["runs"] == 5
        assert x["ours_us_median"] == 102.0
    assert "| prefill | 32/8 4x4096 | flex |" in md.markdown(res)
    assert md.medians(paths, section="decode")["rows"] == []


def test_time_rounds_interleaves(monkeypatch):
    """Every fn once a round, in the given order, round after round (perf kernels' and perf zoo's method)."""
    calls = []
    monkeypatch.setattr(common, "measure", lambda f, rep: {"median_us": float(f())})
    labels = [f"f{i}" for i in range(RNG.randint(2, 4))]
    fns = {k: (lambda k=k: calls.append(k) or len(calls)) for k in labels}
    rounds = RNG.randint(2, 5)
    seen = []
    times = common.time_rounds(fns, rounds, 10, on_round=lambda i, t: seen.append(i))
    assert calls == labels * rounds and seen == list(range(rounds))
    assert times == {k: [float(r * len(labels) + j + 1) for r in range(rounds)] for j, k in enumerate(labels)}


def test_step_case_and_member_step_cells():
    """perf.prefill.StepCase: any mix of query and KV lengths over pages in random order (each request's pages
    distinct, its BSR's lengths and query rows as given); member_steps' cells `BxQxK[+N]` (N decode requests) and
    their errors; the forced rule lifts the member's thresholds only while it runs."""
    from fi_backend import cute_member
    from perf.tools import member_steps as M
    c = pf.StepCase([3, 1, 5], [10, 33, 5], 4, 2, 64, page_size=4, device="cpu")
    assert c.rows == 9 and c.indptr.tolist() == [0, 3, 4, 9] and c.q.shape == (9, 4, 64)
    assert c.pool.bsr.kv_lens.tolist() == [10, 33, 5] and c.pool.k.shape == (3 + 9 + 2, 4, 2, 64)
    used = torch.cat([c.pool.table[i, :n] for i, n in enumerate((3, 9, 2))])
    assert sorted(used.tolist()) == list(range(14))
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        pf.StepCase([4], [3], 4, 2, 64, device="cpu")
    assert M.parse_cell("2x1024x4096") == ([1024, 1024], [4096, 4096])
    assert M.parse_cell("1x2048x8192+3") == ([2048, 1, 1, 1], [8192] * 4)
    for bad in ("2x1024", "1x4096x1024", "0x1x1", "ax1x1", "1x1x1+x"):
        with pytest.raises(ValueError, match=bad.replace("+", r"\+")):
            M.parse_cell(bad)
    now = lambda: (cute_member.MIN_TILES_PER_SM, cute_member.SHORT_SHARE, cute_member.WINDOW_MIN_KEYS)
    before = now()
    assert M.forced(now) == (0.0, 1.0, 0)
    assert now() == before


def test_wgmma_waits_finds_where_the_pv_wait_sits():
    """perf.tools.wgmma_waits reads cuobjdump's SASS: per wait on S, the softmax's opcodes before and after the P.V's
    wait (here 2 FMNMX and 1 MUFU before it, 1 F2FP after, up to the next HGMMA)."""
    from perf.tools import wgmma_waits as W
    sass = "\n".join(f"        /*{a:04x}*/                   {t} ;" for a, t in enumerate([
        "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR12].tnspB, R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "FMNMX R4, R88, R7, !PT", "@P0 FMNMX R5, R89, R4, !PT", "MUFU.EX2 R9, R6", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "F2FP.BF16.F32.PACK_AB R152, R89, R88", "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR40], RZ, !UPT"], start=16))
    ins = W.instructions(sass)
    assert len(ins) == 8 and W.opcode(ins[3][1]) == "FMNMX"
    (s_wait, pv_wait, before, after), = W.waits(ins)
    assert (s_wait, pv_wait) == (0x11, 0x15)
    assert dict(before) == {"FMNMX": 2, "MUFU": 1} and dict(after) == {"F2FP": 1}
