"""Composable formats on the CPU (docs/composable.md): shared-prefix groups in the planner (the plan's items
and merge map, replayed in float64 against plain attention), the groups' checks and their detection from a
block table, and which variants run them."""
import numpy as np
import pytest
import torch

from fi_backend import scheduler as S
from fi_backend.attention import shared_prefix_supported
from fi_backend.formats import (check_prefix_groups, from_block_table, prefix_groups_from_links,
                               prefix_groups_from_table)
from fi_backend import variants as V


def _views(rows, num_ctas, units, tile_q, shared_rows):
    return S.PlanViews.allocate(num_ctas, S.max_items_for(rows, num_ctas, units), rows,
                                S.max_partial_rows_for(num_ctas, units, tile_q) + shared_rows)


def _replay(d, q_lens, kv_lens, groups, causal, units, seed=0):
    """The plan's items run as the kernels run them (float64, one head a unit, D = 4), merged per row; returns
    (output, expected) over every (row, unit). A shared item's KV is its first request's; every row sees it."""
    rng = np.random.default_rng(seed)
    B = len(kv_lens)
    qo = np.concatenate(([0], np.cumsum(q_lens)))
    L = {}
    for first, end, plen in groups:
        for r in range(first, end):
            L[r] = plen
    first_of = {r: f for f, e, _ in groups for r in range(f, e)}
    # KV: a member's first L tokens are its group leader's
    K = [rng.standard_normal((kv_lens[b], units, 4)) for b in range(B)]
    for b in range(B):
        if b in first_of and b != first_of[b]:
            K[b][:L[b]] = K[first_of[b]][:L[b]]
    Q = rng.standard_normal((qo[-1], units, 4))
    req_of_row = np.repeat(np.arange(B), q_lens)

    def state(rows_req, r, u, kv_req, lo, hi):
        q_len, kv = q_lens[rows_req], kv_lens[rows_req]
        limit = kv - q_len + (r - qo[rows_req]) if causal else kv
        idx = np.arange(lo, min(hi, kv_lens[kv_req]))
        idx = idx[idx <= limit] if causal else idx
        if idx.size == 0:
            return np.zeros(4), -np.inf
        s = K[kv_req][idx, u] @ Q[r, u]
        m = s.max()
        p = np.exp(s - m)
        return (p[:, None] * K[kv_req][idx, u]).sum(0) / p.sum(), m + np.log(p.sum())

    out = np.full((qo[-1], units, 4), np.nan)
    partial = {}
    for it in d.items:
        shared = bool(it["request"] & S.ITEM_SHARED)
        leader = it["request"] & ~S.ITEM_SHARED
        for r in range(it["q_begin"], it["q_end"]):
            own = req_of_row[r]
            assert shared or own == leader
            o, lse = state(own, r, it["unit"], leader, it["kv_begin"], it["kv_end"])
            if it["partial_base"] < 0:
                assert np.isnan(out[r, it["unit"]]).all(), "a row written twice"
                out[r, it["unit"]] = o
            else:
                slot = it["partial_base"] + (r - it["q_begin"]) * it["partial_stride"]
                assert d.merge_indptr[r] <= slot < d.merge_indptr[r + 1], (r, slot)
                assert (slot, it["unit"]) not in partial, "a partial row written twice"
                partial[(slot, it["unit"])] = (o, lse)
    for r in d.split_rows:
        for u in range(units):
            states = [partial[(j, u)] for j in range(d.merge_indptr[r], d.merge_indptr[r + 1])]
            m = max(l for _, l in states)
            w = np.array([np.exp(l - m) for _, l in states])
            out[r, u] = sum(wi * o for wi, (o, _) in zip(w, states)) / w.sum()
    expect = np.stack([np.stack([state(req_of_row[r], r, u, req_of_row[r], 0, kv_lens[req_of_row[r]])[0]
                                 for u in range(units)]) for r in range(qo[-1])])
    return out, expect


@pytest.mark.parametrize("case", [
    # (q_lens, kv_lens, groups, tile_q, causal)
    ([1] * 64, [32768 + 256] * 64, [(0, 64, 32768)], 4, True),            # the bar's decode cell
    ([1] * 16, [8193 + 7 * i for i in range(16)], [(0, 16, 8192)], 64, True),
    ([1] * 9 + [3] * 4, [4000 + 5 * i for i in range(13)], [(1, 5, 2048), (6, 13, 3000)], 4, True),
    ([2, 5, 1, 7], [600, 700, 650, 900], [(0, 4, 512)], 3, True),          # a request's rows across tiles
    ([1] * 6, [300] * 6, [(0, 6, 256)], 3, False),
])
def test_plan_with_groups_replays_to_attention(case):
    q_lens, kv_lens, groups, tile_q, causal = case
    units, num_ctas = 2, 16
    rows = sum(q_lens)
    views = _views(rows, num_ctas, units, tile_q, 9 * len(kv_lens))
    qo = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
    info = S.plan_into(views, qo, np.array(kv_lens, np.int32), tile_q=tile_q, num_ctas=num_ctas, num_units=units,
                       causal=causal, kv_chunk_align=16, cost_q=2.0, groups=np.array(groups, np.int32))
    d = S.decode_plan(views)
    assert info.shared_groups == len(groups)
    shared = d.items[(d.items["request"] & S.ITEM_SHARED) != 0]
    assert len(shared) and (shared["partial_base"] >= 0).all()
    assert info.num_partial_rows == d.merge_indptr[-1] <= views.max_partial_rows
    if kv_lens[0] > 20000:  # replaying 64 x 32k in float64 is slow: check only the layout there
        return
    out, expect = _replay(d, q_lens, kv_lens, groups, causal, units)
    np.testing.assert_allclose(out, expect, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("tile_q", [16, 32, 64])
def test_extend_groups_kept_for_short_questions_only(tile_q):
    """The SGLang engine test's system-prompt batch (integration_tests/sglang, workload_shared): 12 requests
    under a 1984-token prefix, prefill costs (cost_q = 2 KV tiles a query tile). Questions of 4..15 tokens keep
    the group; of 20..300 tokens every member's own query tiles already amortise the prefix, so none is kept."""
    rng = np.random.default_rng(7)
    for q_lens, kept in ((rng.integers(4, 16, 12), 1), (rng.integers(20, 300, 12), 0)):
        qo = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
        views = _views(int(qo[-1]), 132, 1, tile_q, 64 * 48)
        info = S.plan_into(views, qo, (2000 + q_lens).astype(np.int32), tile_q=tile_q, num_ctas=132, num_units=1,
                           causal=True, kv_chunk_align=64, cost_q=2.0 * 64 / tile_q,
                           groups=np.array([[0, 12, 1984]], np.int32))
        assert info.shared_groups == kept, (q_lens, info)


def test_groups_that_do_not_pay_stay_single_format():
    views = _views(4, 16, 2, 4, 36)
    qo = np.arange(5, dtype=np.int32)
    kv = np.full(4, 200, np.int32)
    info = S.plan_into(views, qo, kv, tile_q=4, num_ctas=16, num_units=2, causal=True, cost_q=128.0,
                       groups=np.array([[0, 4, 16]], np.int32))
    assert info.shared_groups == 0
    info = S.plan_into(views, qo, kv, tile_q=4, num_ctas=16, num_units=2, causal=True, cost_q=1.0,
                       groups=np.array([[0, 1, 160]], np.int32))   # one member: nothing to share
    assert info.shared_groups == 0
    small = _views(4, 16, 2, 4, 0)   # no partial rows beyond the split budget: the group does not fit
    info = S.plan_into(small, qo, np.full(4, 8192, np.int32), tile_q=4, num_ctas=16, num_units=2, causal=True,
                       groups=np.array([[0, 4, 8000]], np.int32))
    assert info.shared_groups <= 1 and info.num_partial_rows <= small.max_partial_rows


def test_shared_gain_forces_the_verdict(monkeypatch):
    """shared_gain (or FI_BACKEND_PLAN_SHARED_GAIN) replaces the verdict's SHARED_GAIN: 0 keeps a group that saves
    any KV, for timing groups the default verdict drops; a negative or non-numeric one is refused by name."""
    views = _views(4, 16, 2, 4, 36)
    qo = np.arange(5, dtype=np.int32)
    kv = np.full(4, 200, np.int32)
    plan = dict(tile_q=4, num_ctas=16, num_units=2, causal=True, cost_q=128.0, groups=np.array([[0, 4, 16]], np.int32))
    assert S.plan_into(views, qo, kv, **plan).shared_groups == 0               # the default verdict: not worth it
    assert S.plan_into(views, qo, kv, shared_gain=0.0, **plan).shared_groups == 1
    monkeypatch.setenv("FI_BACKEND_PLAN_SHARED_GAIN", "0")
    assert S.plan_into(views, qo, kv, **plan).shared_groups == 1
    monkeypatch.setenv("FI_BACKEND_PLAN_SHARED_GAIN", "lots")
    with pytest.raises(ValueError, match="FI_BACKEND_PLAN_SHARED_GAIN must be a number"):
        S.plan_into(views, qo, kv, **plan)
    with pytest.raises(ValueError, match="shared_gain must be >= 0"):
        S.plan_into(views, qo, kv, shared_gain=-1.0, **plan)


def test_item_cost_floor_spreads_one_row_items():
    """16 requests sharing 8192 tokens with 16 own each (parallel sampling's first steps): counted by rows alone,
    the 128 one-row own items fill four CTAs at 29 each (206 us on the H100 against 40 us at 256 own tokens). A
    floor on an item's cost (PlanInputs::cost_item_min) spreads them; the replayed plan still computes attention."""
    from fi_backend.attention import plan_cost_q, prefill_group_item_min
    B, L, S_own, units, ctas, tile_q = 16, 8192, 16, 8, 132, 32
    qo = np.arange(B + 1, dtype=np.int32)
    kv = np.full(B, L + S_own, np.int32)
    plan = dict(tile_q=tile_q, num_ctas=ctas, num_units=units, causal=True, kv_chunk_align=64,
                cost_q=plan_cost_q("prefill", 64, tile_q), groups=np.array([[0, B, L]], np.int32))

    def most_items(cost_item_min):
        views = _views(B, ctas, units, tile_q, 2 * 256)
        S.plan_into(views, qo, kv, cost_item_min=cost_item_min, **plan)
        return int(np.diff(S.decode_plan(views).cta_indptr).max())
    assert most_items(0.0) >= 16
    assert most_items(prefill_group_item_min(64)) <= 5
    views = _views(4, 8, 1, 4, 64)
    q4, kv4 = np.arange(5, dtype=np.int32), np.array([600, 610, 620, 630], np.int32)
    S.plan_into(views, q4, kv4, tile_q=4, num_ctas=8, causal=True, groups=np.array([[0, 4, 512]], np.int32),
                cost_item_min=256.0)
    out, expect = _replay(S.decode_plan(views), [1] * 4, list(kv4), [(0, 4, 512)], True, 1)
    np.testing.assert_allclose(out, expect, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="cost_item_min must be finite and >= 0"):
        S.plan_into(views, q4, kv4, tile_q=4, num_ctas=8, cost_item_min=-1.0)


def test_chunks_leave_room_for_own_items():
    """16 requests sharing 8192 tokens with 256 own each (Llama-3.1-8B's heads, 132 CTAs): cut for a CTA's fair
    share, 88 chunks fill 88 CTAs and the 128 own items the other 44, so a chunk that ends last merges its whole
    tile's rows alone at the step's end. The planner cuts more chunks, one a CTA with an own item after it (the
    queue is in creation order), and flags the plan for the chunks to arrive as they end. 128 requests sharing
    1024 tokens have own items enough after the chunks already: that plan is unchanged and not flagged."""
    from perf.tools.plan_cell import plan_cell
    kw = dict(tile_q=32, kv_tile=64, ctas=132, units=8, heads=32, kv_heads=8, head_dim=128)
    info, p = plan_cell(16, 8192, 256, **kw)
    assert info.shared_groups == 1 and p.chunks_at_once
    shared = (p.items["request"] & S.ITEM_SHARED) != 0
    chunk_ctas, own_ctas = set(p.item_cta[shared]), set(p.item_cta[~shared])
    assert len(chunk_ctas) >= 120 and len(own_ctas & chunk_ctas) >= 100
    for c in own_ctas & chunk_ctas:   # a CTA's chunk runs before its own items
        kinds = shared[p.cta_indptr[c]:p.cta_indptr[c + 1]]
        assert kinds[0] and not kinds[-1]
    info, p = plan_cell(128, 1024, 256, **kw)
    assert info.shared_groups == 1 and not p.chunks_at_once
    assert int(((p.items["request"] & S.ITEM_SHARED) != 0).sum()) == 32   # one chunk a (tile, KV head)
    # the replayed plan still computes attention
    views = _views(16, 132, 8, 32, 16 * 256)
    qo, kv = np.arange(17, dtype=np.int32), np.full(16, 8192 + 256, np.int32)
    S.plan_into(views, qo, kv, tile_q=32, num_ctas=132, num_units=8, causal=True, kv_chunk_align=64,
                groups=np.array([[0, 16, 8192]], np.int32))
    d = S.decode_plan(views)
    assert d.chunks_at_once
    out, expect = _replay(d, [1] * 16, list(kv), [(0, 16, 8192)], True, 8)
    np.testing.assert_allclose(out, expect, rtol=1e-9, atol=1e-12)


def test_group_item_min_env(monkeypatch):
    from fi_backend.attention import PREFILL_GROUP_ITEM_MIN_TILES, prefill_group_item_min
    assert prefill_group_item_min(64) == PREFILL_GROUP_ITEM_MIN_TILES * 64
    monkeypatch.setenv("FI_BACKEND_PLAN_GROUP_ITEM_MIN", "100")
    assert prefill_group_item_min(64) == 100.0
    monkeypatch.setenv("FI_BACKEND_PLAN_GROUP_ITEM_MIN", "-3")
    with pytest.raises(ValueError, match="FI_BACKEND_PLAN_GROUP_ITEM_MIN must be a number >= 0"):
        prefill_group_item_min(64)


def test_planner_refuses_bad_groups():
    views = _views(4, 8, 1, 4, 64)
    qo = np.arange(5, dtype=np.int32)
    kv = np.array([100, 100, 50, 100], np.int32)
    plan = lambda g, **kw: S.plan_into(views, qo, kv, tile_q=4, num_ctas=8, causal=True,
                                       groups=np.array(g, np.int32), **kw)
    with pytest.raises(ValueError, match="group 0: prefix length 64 exceeds request 2's KV"):
        plan([[0, 4, 64]])
    with pytest.raises(ValueError, match="group 1: requests"):
        plan([[0, 2, 32], [1, 3, 32]])
    with pytest.raises(ValueError, match="deterministic"):
        plan([[0, 2, 32]], deterministic_pieces=4)


def _bsr(table, kv_lens, q_lens, page):
    table = torch.as_tensor(table, dtype=torch.int32)
    qo = torch.tensor(np.concatenate(([0], np.cumsum(q_lens))), dtype=torch.int32)
    return from_block_table(table, torch.tensor(kv_lens, dtype=torch.int32), qo, page, num_kv_blocks=64)


def test_check_prefix_groups_names_group_and_request():
    table = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]]
    bsr = _bsr(table, [40, 40, 40, 40], [1, 1, 1, 1], 16)
    check_prefix_groups(bsr, [[0, 2, 32], [2, 4, 0]])
    bsr.validate(prefix_groups=[[0, 3, 16]])
    with pytest.raises(ValueError, match="prefix group 0: request 2 reads KV block 5 at its block 1"):
        check_prefix_groups(bsr, [[0, 3, 32]])
    with pytest.raises(ValueError, match="prefix group 1: request 1 is also in group 0"):
        check_prefix_groups(bsr, [[0, 2, 16], [1, 3, 16]])
    with pytest.raises(ValueError, match="prefix group 0: its prefix of 40 tokens is longer than request 0's KV"):
        check_prefix_groups(bsr, [[0, 2, 40]])
    with pytest.raises(ValueError, match="within the BSR's 4 row blocks"):
        check_prefix_groups(bsr, [[3, 5, 16]])


def test_prefix_groups_from_table():
    t = np.array([[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 4, 7], [5, 6, 7, 8], [5, 6, 0, 0], [9, 9, 9, 9], [9, 9, 9, 9]])
    cached = np.array([64, 64, 64, 64, 30, 64, 10])
    np.testing.assert_array_equal(prefix_groups_from_table(t, cached, 16), [[0, 3, 32], [3, 5, 16]])
    np.testing.assert_array_equal(prefix_groups_from_table(t, cached, 16, min_prefix_tokens=32), [[0, 3, 32]])
    assert prefix_groups_from_table(t[:1], cached[:1], 16).shape == (0, 3)
    # rows= (vLLM's mirror by request index): the same groups as the gathered rows, with no copy of them
    rng = np.random.default_rng(3)
    for _ in range(50):
        big = rng.integers(0, 4, (12, 6)).astype(np.int32)
        rows = rng.permutation(12)[: rng.integers(2, 12)]
        c = rng.integers(0, 100, rows.size).astype(np.int32)
        np.testing.assert_array_equal(prefix_groups_from_table(big, c, 16, rows=rows),
                                      prefix_groups_from_table(big[rows], c, 16))
    with pytest.raises(ValueError, match="cached_tokens has 3 entries for 2 requests"):
        prefix_groups_from_table(big, np.zeros(3, np.int32), 16, rows=[0, 1])
    # the groups found are the ones check_prefix_groups accepts
    bsr = _bsr(np.pad(t, ((0, 0), (0, 1))), cached + 1, [1] * 7, 16)
    check_prefix_groups(bsr, prefix_groups_from_table(t, cached, 16))


def test_prefix_groups_from_links():
    """Runs of neighbours sharing >= 1 block, each with its smallest share, in tokens; short runs dropped."""
    links = [3, 2, 0, 0, 5, 5, 0, 1]
    np.testing.assert_array_equal(prefix_groups_from_links(links, 16), [[0, 3, 32], [4, 7, 80], [7, 9, 16]])
    np.testing.assert_array_equal(prefix_groups_from_links(links, 16, min_requests=3), [[0, 3, 32], [4, 7, 80]])
    np.testing.assert_array_equal(prefix_groups_from_links(links, 1, min_prefix_tokens=3), [[4, 7, 5]])
    assert prefix_groups_from_links([0, 0], 16).shape == (0, 3) and prefix_groups_from_links([], 16).shape == (0, 3)


def test_which_variants_run_shared_items():
    ok = {n for n, v in V.BUILTIN_VARIANTS.items() if shared_prefix_supported(v)}
    assert {"default", "soft_cap", "sigmoid"} <= ok
    assert not ok & {"window", "alibi", "custom_mask", "rope", "rope_interleave"}
    pos = V.Variant("by_pos", logits_transform="return logits + 0.01f * ctx.q_pos;")
    assert not shared_prefix_supported(pos)


def test_decode_groups_pay_where_the_prefill_kernel_is_measured_faster():
    """The H100 cells of perf/results/composable_n8_*.json and composable_member1_8051960.json: parallel samples of short
    prompts (64 groups of 8 sharing 160 tokens) ran slower on the prefill kernel's smallest tile than single-format
    on the decode kernel (0.63x); 128 x 1k faster (1.25x), long shared prefixes more so (64 x 4k: 2.5x)."""
    n8 = np.array([[8 * i, 8 * i + 8, 160] for i in range(64)], np.int32)
    assert not S.decode_groups_pay(n8, 512)
    assert S.decode_groups_pay(np.array([[0, 64, 4096]]), 64)
    assert S.decode_groups_pay(np.array([[0, 128, 1024]]), 128)             # 1016 saved a request
    assert not S.decode_groups_pay(np.array([[0, 128, 400]]), 128)
    assert S.decode_groups_pay(np.array([[0, 16, 8192]]), 16)
    assert not S.decode_groups_pay(np.array([[3, 4, 32768]]), 8)            # a group of one saves nothing
    assert not S.decode_groups_pay(np.array([[0, 2, 200]]), 1000)          # a small group in a large batch
    assert S.decode_groups_pay([[0, 4, 4000], [4, 8, 4000]], 8)          # lists too
