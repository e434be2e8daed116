"""The planner (Algorithm 1): coverage, merge map, bounds, LPT assignment, determinism, capacities, errors."""
import heapq
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fi_backend import _planner
from fi_backend import scheduler as S

SENTINEL = -0x5A5A5A5B


# ---------------------------------------------------------------------------------------------------
# A plain-Python model of what the plan must be, and a checker of every invariant.

def pairs_of(qo, kv, tile_q, causal):
    """(request, q_begin, q_end, effective KV length) of every (request, query tile) pair, in order."""
    out = []
    for i in range(len(kv)):
        q0, q_len = int(qo[i]), int(qo[i + 1] - qo[i])
        for t0 in range(0, q_len, tile_q):
            t1 = min(q_len, t0 + tile_q)
            out.append((i, q0 + t0, q0 + t1, int(kv[i]) - q_len + t1 if causal else int(kv[i])))
    return out


def expected_chunk(pairs, num_ctas, min_kv_chunk, align):
    """The smallest aligned L >= min_kv_chunk with sum max(1, ceil(len / L)) <= num_ctas, by exhaustion."""
    if not pairs or len(pairs) >= num_ctas:
        return 0
    lens = np.array([p[3] for p in pairs], dtype=np.int64)
    max_len = int(lens.max())
    k0 = -(-min_kv_chunk // align)
    ks = np.arange(k0, max(k0, -(-max_len // align)) + 1, dtype=np.int64)
    L = ks[:, None] * align
    counts = np.where(lens[None, :] > L, -(-lens[None, :] // L), 1).sum(axis=1)
    best = int(L[np.argmax(counts <= num_ctas), 0])
    return best if best < max_len else 0


def lpt_reference(costs, num_ctas):
    """LPT: items by cost descending (ties: creation order) to the least loaded CTA (ties: lowest index)."""
    order = sorted(range(len(costs)), key=lambda k: (-costs[k], k))
    heap = [(0.0, c) for c in range(num_ctas)]
    per_cta = [[] for _ in range(num_ctas)]
    for k in order:
        load, c = heapq.heappop(heap)
        per_cta[c].append(k)
        heapq.heappush(heap, (load + costs[k], c))
    return per_cta, max(load for load, _ in heap)


def check_plan(d, info, qo, kv, *, tile_q, num_ctas, causal, min_kv_chunk, align, cost_q, cost_kv):
    qo = np.asarray(qo, dtype=np.int64)
    kv = np.asarray(kv, dtype=np.int64)
    B, num_rows = len(kv), int(qo[-1])
    pairs = pairs_of(qo, kv, tile_q, causal)
    n_pairs = len(pairs)

    # Header and summary.
    assert (d.num_rows, d.num_requests, d.num_ctas, d.tile_q) == (num_rows, B, num_ctas, tile_q)
    assert (info.num_items, info.num_rows, info.num_partial_rows, info.kv_chunk, info.num_split_rows) == (
        d.num_items, d.num_rows, d.num_partial_rows, d.kv_chunk, d.num_split_rows)
    chunk = expected_chunk(pairs, num_ctas, min_kv_chunk, align)
    assert d.kv_chunk == chunk
    if n_pairs >= num_ctas:
        assert d.kv_chunk == 0, "nothing is split when every CTA already has a pair"

    # cta_indptr.
    assert d.cta_indptr[0] == 0 and d.cta_indptr[-1] == d.num_items and np.all(np.diff(d.cta_indptr) >= 0)

    # Items belong to exactly one pair (whole query tiles).
    it = d.items
    pair_of_begin = {p[1]: j for j, p in enumerate(pairs)}
    n_of_pair = np.zeros(n_pairs, dtype=np.int64)
    item_pair = np.empty(d.num_items, dtype=np.int64)
    for k in range(d.num_items):
        j = pair_of_begin[int(it["q_begin"][k])]
        req, q0, q1, length = pairs[j]
        assert (it["request"][k], it["q_end"][k]) == (req, q1)
        assert 0 <= it["kv_begin"][k] <= it["kv_end"][k] <= length
        item_pair[k] = j
        n_of_pair[j] += 1
    assert np.all(n_of_pair >= 1)

    # Expand the items: every (row, KV position in its pair's effective range) covered exactly once.
    row_len = np.zeros(num_rows, dtype=np.int64)
    for _, q0, q1, length in pairs:
        row_len[q0:q1] = length
    width = int(row_len.max(initial=0)) + 1
    cover = np.zeros((num_rows, width + 1), dtype=np.int64)
    for k in range(d.num_items):
        rows = np.arange(it["q_begin"][k], it["q_end"][k])
        cover[rows, it["kv_begin"][k]] += 1
        cover[rows, it["kv_end"][k]] -= 1
    cover = np.cumsum(cover, axis=1)[:, :width]
    inside = np.arange(width)[None, :] < row_len[:, None]
    assert np.all(cover[inside] == 1) and np.all(cover[~inside] == 0)

    # Chunks: split only into > 1 items when chunk > 0; aligned, non-empty, <= chunk, chunk order.
    for k in range(d.num_items):
        j = item_pair[k]
        n, b, e, c = n_of_pair[j], it["kv_begin"][k], it["kv_end"][k], it["chunk"][k]
        assert it["partial_stride"][k] == n and 0 <= c < n
        if n == 1:
            assert it["partial_base"][k] == -1 and (b, e) == (0, pairs[j][3])
        else:
            assert chunk > 0 and pairs[j][3] > chunk and n == -(-pairs[j][3] // chunk)
            assert b % align == 0 and 0 < e - b <= chunk
            assert chunk % align == 0 and chunk >= min_kv_chunk
    split_items = int(n_of_pair[n_of_pair > 1].sum())
    assert split_items <= num_ctas
    assert d.num_partial_rows <= num_ctas * tile_q <= 2 * num_ctas * tile_q

    # Merge map: row r owns partial rows [merge_indptr[r], merge_indptr[r + 1]), n of them when split.
    mi = d.merge_indptr
    assert len(mi) == num_rows + 1 and mi[0] == 0 and mi[-1] == d.num_partial_rows
    per_row = np.diff(mi)
    expect = np.zeros(num_rows, dtype=np.int64)
    for j, (_, q0, q1, _) in enumerate(pairs):
        expect[q0:q1] = n_of_pair[j] if n_of_pair[j] > 1 else 0
    assert np.array_equal(per_row, expect)
    assert np.array_equal(d.split_rows, np.flatnonzero(per_row > 0)) and d.num_split_rows == len(d.split_rows)
    written = np.zeros(d.num_partial_rows, dtype=np.int64)
    for k in np.flatnonzero(it["partial_base"] >= 0):
        rows = np.arange(it["q_begin"][k], it["q_end"][k])
        prow = it["partial_base"][k] + (rows - it["q_begin"][k]) * it["partial_stride"][k]
        assert np.array_equal(prow, mi[rows] + it["chunk"][k])  # contiguous per row, chunk order
        written[prow] += 1
    assert np.all(written == 1), "every partial row written exactly once"

    # Assignment: exactly LPT, replayed in Python on the items in creation order.
    creation = np.lexsort((it["chunk"], it["q_begin"]))
    costs = [cost_q * float(it["q_end"][k] - it["q_begin"][k]) + cost_kv * float(it["kv_end"][k] - it["kv_begin"][k])
             for k in creation]
    per_cta, makespan = lpt_reference(costs, num_ctas)
    got = [list(range(d.cta_indptr[c], d.cta_indptr[c + 1])) for c in range(num_ctas)]
    assert [[int(creation[k]) for k in ks] for ks in per_cta] == got
    assert info.makespan == pytest.approx(makespan, rel=1e-12, abs=0)

    # Makespan bounds that hold for list scheduling (see test_makespan_small_instances_vs_optimum).
    if d.num_items:
        total, largest = sum(costs), max(costs)
        m = num_ctas
        assert info.makespan <= total / m + (1 - 1 / m) * largest + 1e-9 * (1 + total)
        if largest <= total / (3 * m):
            assert info.makespan <= (4 / 3 - 1 / (3 * m)) * max(total / m, largest) + 1e-9 * (1 + total)
    return pairs


def run_plan(qo, kv, *, tile_q, num_ctas, causal=False, min_kv_chunk=1, align=1, cost_q=1.0, cost_kv=1.0,
             layout_ctas=None, views=None):
    rows = int(qo[-1])
    if views is None:
        views = S.PlanViews.allocate(layout_ctas or num_ctas, max(num_ctas, rows, 1), max(rows, 1),
                                     2 * num_ctas * tile_q)
    info = S.plan_into(views, qo, kv, tile_q=tile_q, num_ctas=num_ctas, causal=causal, min_kv_chunk=min_kv_chunk,
                       kv_chunk_align=align, cost_q=cost_q, cost_kv=cost_kv)
    return views, info


@st.composite
def steps(draw, max_requests=24, max_kv=3000):
    mode = draw(st.sampled_from(["decode", "prefill", "mixed", "long_few"]))
    if mode == "long_few":  # few long requests: the splitting path
        B = draw(st.integers(1, 4))
        kv = draw(st.lists(st.integers(0, 20000), min_size=B, max_size=B))
    else:
        B = draw(st.integers(0, max_requests))
        kv = draw(st.lists(st.integers(0, max_kv), min_size=B, max_size=B))
    if mode in ("decode", "long_few"):
        q = [min(1, k) for k in kv]
    elif mode == "prefill":
        kv = [min(k, 300) for k in kv]
        q = list(kv)
    else:
        q = [draw(st.integers(0, min(k, 200))) for k in kv]
    qo = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    return qo, np.array(kv, dtype=np.int32)


plan_params = dict(
    tile_q=st.sampled_from([1, 2, 3, 8, 16, 64, 128]),
    num_ctas=st.integers(1, 80),
    causal=st.booleans(),
    min_kv_chunk=st.sampled_from([1, 7, 16, 128, 512]),
    align=st.sampled_from([1, 2, 3, 16, 64]),
    cost_q=st.sampled_from([0.0, 0.5, 1.0, 4.0]),
    cost_kv=st.sampled_from([0.0, 1.0, 2.5]),
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), **plan_params)
def test_plan_invariants(step, tile_q, num_ctas, causal, min_kv_chunk, align, cost_q, cost_kv):
    qo, kv = step
    views, info = run_plan(qo, kv, tile_q=tile_q, num_ctas=num_ctas, causal=causal, min_kv_chunk=min_kv_chunk,
                           align=align, cost_q=cost_q, cost_kv=cost_kv)
    check_plan(S.decode_plan(views), info, qo, kv, tile_q=tile_q, num_ctas=num_ctas, causal=causal,
               min_kv_chunk=min_kv_chunk, align=align, cost_q=cost_q, cost_kv=cost_kv)


def test_decode_batches_realistic():
    """Decode batches on the H100 grid (132 SMs * 2 CTAs / 8 KV heads = 33), with and without splitting."""
    rng = np.random.default_rng()
    for B in (1, 2, 7, 32, 33, 34, 256):
        kv = rng.integers(1, 4097, B).astype(np.int32)
        qo = np.arange(B + 1, dtype=np.int32)
        views, info = run_plan(qo, kv, tile_q=1, num_ctas=33, min_kv_chunk=128, align=16)
        check_plan(S.decode_plan(views), info, qo, kv, tile_q=1, num_ctas=33, causal=False, min_kv_chunk=128,
                   align=16, cost_q=1.0, cost_kv=1.0)
        assert (info.kv_chunk > 0) == (B < 33 and int(kv.max()) > 128)


def test_makespan_small_instances_vs_optimum():
    """LPT against the optimum on small instances.

    The issue asks for "makespan within (4/3 - 1/(3m)) of max(total/m, largest item)". That is not a
    theorem: three equal items on two CTAs give LPT (and the optimum) makespan 2 while
    max(total/m, largest) = 1.5, and 2 > (4/3 - 1/6) * 1.5 = 1.75. What holds, and what is tested:
    (i)   Graham's LPT bound against the true optimum, makespan <= (4/3 - 1/(3m)) * OPT, here with OPT by
          brute force over all m^n assignments (n <= 8 items, m <= 4 CTAs);
    (ii)  the list-scheduling bound makespan <= total/m + (1 - 1/m) * largest, on every instance of
          test_plan_invariants (check_plan);
    (iii) a corollary of (ii): when every item is <= total/(3m) (fine chunks), makespan <=
          total/m * (1 + (1 - 1/m)/3) = (4/3 - 1/(3m)) * total/m, so the issue's wording holds then;
          checked in check_plan whenever an instance meets the condition.
    """
    rng = np.random.default_rng()
    checked = 0
    while checked < 60:
        m = int(rng.integers(1, 5))
        B = int(rng.integers(1, 9))
        kv = rng.integers(1, 3000, B).astype(np.int32)
        q = np.ones(B, dtype=np.int64) if rng.integers(2) else rng.integers(0, np.minimum(kv, 3) + 1)
        qo = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        cost_q = float(rng.integers(0, 50))
        views, info = run_plan(qo, kv, tile_q=int(rng.integers(1, 4)), num_ctas=m, causal=bool(rng.integers(2)),
                               min_kv_chunk=int(rng.integers(1, 300)), cost_q=cost_q)
        it = S.decode_plan(views).items
        n = len(it)
        if not 1 <= n <= 8:
            continue
        costs = cost_q * (it["q_end"] - it["q_begin"]) + 1.0 * (it["kv_end"] - it["kv_begin"])
        # All m^n assignments at once: loads[a, c] = sum of the costs of items a puts on CTA c.
        assign = np.array(list(itertools.product(range(m), repeat=n)), dtype=np.int64).reshape(-1, n)
        loads = np.zeros((len(assign), m))
        for k in range(n):
            np.add.at(loads, (np.arange(len(assign)), assign[:, k]), costs[k])
        opt = loads.max(axis=1).min()
        assert info.makespan >= opt - 1e-9
        assert info.makespan <= (4 / 3 - 1 / (3 * m)) * opt + 1e-9
        checked += 1


def test_makespan_counterexample_to_issue_wording():
    """Three equal items on two CTAs: LPT makespan 2 exceeds (4/3 - 1/(3m)) * max(total/m, largest)."""
    qo = np.arange(4, dtype=np.int32)
    kv = np.full(3, 99, dtype=np.int32)  # each item costs 1 + 99 = 100
    _, info = run_plan(qo, kv, tile_q=1, num_ctas=2)
    total, largest, m = 300.0, 100.0, 2
    assert info.makespan == 200.0
    assert info.makespan > (4 / 3 - 1 / (3 * m)) * max(total / m, largest)
    assert info.makespan <= total / m + (1 - 1 / m) * largest


# ---------------------------------------------------------------------------------------------------
# Layout, buffers, determinism.

def test_layout_matches_plan_h():
    rng = np.random.default_rng()
    for _ in range(200):
        c, mi, mr = (int(x) for x in rng.integers(1, 5000, 3))
        L = S.PlanLayout(c, mi, mr)
        assert (L.cta_indptr_offset, L.items_offset, L.merge_indptr_offset, L.split_rows_offset,
                L.num_ints) == _planner.layout(c, mi, mr)
        assert all(o % 4 == 0 for o in (L.items_offset, L.merge_indptr_offset, L.split_rows_offset))
    assert _planner.item_fields() == tuple((name, k) for k, name in enumerate(S.ITEM_FIELDS))
    assert (_planner.HEADER_INTS, _planner.ITEM_INTS) == (S.HEADER_INTS, S.ITEM_INTS)
    for name in ("NUM_ITEMS", "NUM_ROWS", "NUM_PARTIAL_ROWS", "KV_CHUNK", "NUM_REQUESTS", "NUM_CTAS", "TILE_Q",
                 "NUM_SPLIT_ROWS"):
        assert getattr(_planner, name) == getattr(S, name)


def written_mask(views):
    """True where a plan may write: header, cta_indptr, items, merge_indptr, split_rows in use."""
    L, h = views.layout, views.header
    mask = np.zeros(views.section.size, dtype=bool)
    mask[:S.HEADER_INTS] = True
    mask[L.cta_indptr_offset:L.cta_indptr_offset + L.num_ctas + 1] = True
    mask[L.items_offset:L.items_offset + h[S.NUM_ITEMS] * S.ITEM_INTS] = True
    mask[L.merge_indptr_offset:L.merge_indptr_offset + h[S.NUM_ROWS] + 1] = True
    mask[L.split_rows_offset:L.split_rows_offset + h[S.NUM_SPLIT_ROWS]] = True
    return mask


def sentinel_views(num_ctas, max_items, max_rows, max_partial_rows, guard=64, fill=SENTINEL):
    """Views over a sentinel-filled array with `guard` extra ints past the layout."""
    L = S.PlanLayout(num_ctas, max_items, max_rows)
    section = np.full(L.num_ints + guard, fill, dtype=np.int32)
    return S.PlanViews(section, L, max_partial_rows)


@settings(max_examples=60, deadline=None)
@given(step=steps(), **plan_params)
def test_writes_stay_in_use_and_are_deterministic(step, tile_q, num_ctas, causal, min_kv_chunk, align, cost_q,
                                                 cost_kv):
    qo, kv = step
    rows = int(qo[-1])
    kw = dict(tile_q=tile_q, num_ctas=num_ctas, causal=causal, min_kv_chunk=min_kv_chunk, kv_chunk_align=align,
              cost_q=cost_q, cost_kv=cost_kv)
    a = sentinel_views(num_ctas + 3, max(num_ctas, rows) + 5, rows + 7, 2 * num_ctas * tile_q)
    b = sentinel_views(num_ctas + 3, max(num_ctas, rows) + 5, rows + 7, 2 * num_ctas * tile_q)
    c = sentinel_views(num_ctas + 3, max(num_ctas, rows) + 5, rows + 7, 2 * num_ctas * tile_q, fill=12345)
    ia = S.plan_into(a, qo, kv, **kw)
    ib = S.plan_into(b, qo, kv, **kw)
    ic = S.plan_into(c, qo, kv, **kw)
    assert ia == ib == ic
    assert a.section.tobytes() == b.section.tobytes(), "same input, same bytes"
    mask = written_mask(a)
    assert np.all(a.section[~mask] == SENTINEL), "a plan wrote outside the parts in use"
    assert np.array_equal(a.section[mask], c.section[mask]), "the result depends on the buffer's old contents"
    # CTAs of the layout beyond num_ctas have no items, so the full grid reads a valid plan.
    assert np.all(a.cta_indptr[num_ctas:] == ia.num_items)
    # Re-planning over an older plan gives the same bytes where the new plan writes.
    qo2 = np.arange(2, dtype=np.int32)
    S.plan_into(c, qo2, np.array([rows + 1], dtype=np.int32), **kw)
    S.plan_into(c, qo, kv, **kw)
    assert np.array_equal(a.section[mask], c.section[mask])


def test_torch_tensors_are_read_without_copies():
    rng = np.random.default_rng()
    kv = torch.from_numpy(rng.integers(1, 5000, 40).astype(np.int32))
    qo = torch.arange(41, dtype=torch.int32)
    assert S._host_int32(kv, "kv_lens").ctypes.data == kv.data_ptr()
    v1, i1 = run_plan(qo, kv, tile_q=1, num_ctas=33)
    v2, i2 = run_plan(qo.numpy(), kv.numpy(), tile_q=1, num_ctas=33)
    assert i1 == i2 and np.array_equal(v1.section, v2.section)
    with pytest.raises(TypeError, match="kv_lens"):
        run_plan(qo, kv.long(), tile_q=1, num_ctas=33)
    with pytest.raises(TypeError, match="qo_indptr"):
        run_plan(qo.numpy().astype(np.int64), kv.numpy(), tile_q=1, num_ctas=33)
    with pytest.raises(TypeError, match="kv_lens"):
        run_plan(qo.numpy(), kv.numpy()[::-1], tile_q=1, num_ctas=33)  # not C-contiguous


def test_empty_steps_and_empty_queries():
    views, info = run_plan(np.zeros(1, np.int32), np.zeros(0, np.int32), tile_q=4, num_ctas=5)
    d = S.decode_plan(views)
    assert (info.num_items, info.num_rows, info.makespan) == (0, 0, 0.0)
    assert np.all(d.cta_indptr == 0) and list(d.merge_indptr) == [0]
    # Requests with no query rows produce nothing; the others are planned as usual.
    qo = np.array([0, 0, 3, 3, 4], np.int32)
    kv = np.array([10, 50, 0, 9], np.int32)
    views, info = run_plan(qo, kv, tile_q=2, num_ctas=3)
    d = S.decode_plan(views)
    assert set(d.items["request"]) == {1, 3}
    check_plan(d, info, qo, kv, tile_q=2, num_ctas=3, causal=False, min_kv_chunk=1, align=1, cost_q=1.0, cost_kv=1.0)


def test_single_long_request_fills_the_ctas():
    rng = np.random.default_rng()
    for _ in range(20):
        kv_len = int(rng.integers(5000, 200000))
        align = int(rng.choice([1, 16, 64]))
        views, info = run_plan(np.array([0, 1], np.int32), np.array([kv_len], np.int32), tile_q=1, num_ctas=33,
                               min_kv_chunk=128, align=align)
        it = S.decode_plan(views).items
        assert info.num_items <= 33 and info.num_items == -(-kv_len // info.kv_chunk)
        assert info.kv_chunk % align == 0
        # As even as alignment allows: the chunks differ by at most one alignment unit.
        sizes = it["kv_end"] - it["kv_begin"]
        assert sizes.max() - sizes.min() <= align
        assert info.num_partial_rows == info.num_items and list(np.sort(it["chunk"])) == list(range(info.num_items))


# ---------------------------------------------------------------------------------------------------
# Capacities and errors.

@settings(max_examples=40, deadline=None)
@given(step=steps(), **plan_params)
def test_capacity_errors_name_the_bound_and_write_nothing(step, tile_q, num_ctas, causal, min_kv_chunk, align,
                                                          cost_q, cost_kv):
    qo, kv = step
    kw = dict(tile_q=tile_q, num_ctas=num_ctas, causal=causal, min_kv_chunk=min_kv_chunk, kv_chunk_align=align,
              cost_q=cost_q, cost_kv=cost_kv)
    rows = int(qo[-1])
    big = sentinel_views(num_ctas, max(num_ctas, rows), rows, 2 * num_ctas * tile_q)
    info = S.plan_into(big, qo, kv, **kw)
    # Exactly the capacities the plan needs are enough.
    exact = sentinel_views(num_ctas, info.num_items, info.num_rows, info.num_partial_rows, guard=0)
    assert S.plan_into(exact, qo, kv, **kw) == info
    de, db = S.decode_plan(exact), S.decode_plan(big)
    assert np.array_equal(de.items, db.items) and np.array_equal(de.merge_indptr, db.merge_indptr)
    assert np.array_equal(de.split_rows, db.split_rows) and np.array_equal(de.cta_indptr, db.cta_indptr)
    shrunk = []
    if info.num_items:
        shrunk.append(("max_items", (num_ctas, info.num_items - 1, rows, info.num_partial_rows)))
    if info.num_rows:
        shrunk.append(("max_rows", (num_ctas, info.num_items, rows - 1, info.num_partial_rows)))
    if info.num_partial_rows:
        shrunk.append(("max_partial_rows", (num_ctas, info.num_items, rows, info.num_partial_rows - 1)))
    for bound, caps in shrunk:
        v = sentinel_views(*caps, guard=16)
        with pytest.raises(ValueError, match=bound) as e:
            S.plan_into(v, qo, kv, **kw)
        assert str(caps[("max_items", "max_rows", "max_partial_rows").index(bound) + 1]) in str(e.value)
        assert np.all(v.section == SENTINEL), "a failed plan wrote into the section"


@pytest.mark.parametrize("qo, kv, kw, match", [
    ([0, 2, 1], [5, 5], {}, "non-decreasing"),
    ([0, 7, 3], [9, 9], {}, r"non-decreasing, got qo_indptr\[1\]=7 > qo_indptr\[2\]=3"),
    ([1, 2], [5], {}, r"qo_indptr\[0\]"),
    ([0, 1], [-3], {}, "kv_lens must be >= 0"),
    ([0, 6], [5], {}, "q_len=6 > kv_len=5"),
    ([0, 1, 2], [5], {}, r"len\(kv_lens\) \+ 1"),
    ([0, 1], [5], {"tile_q": 0}, "tile_q must be >= 1"),
    ([0, 1], [5], {"num_ctas": 0}, "num_ctas must be >= 1"),
    ([0, 1], [5], {"num_ctas": 9}, "num_ctas=9 exceeds"),
    ([0, 1], [5], {"min_kv_chunk": 0}, "min_kv_chunk"),
    ([0, 1], [5], {"kv_chunk_align": 0}, "kv_chunk_align"),
    ([0, 1], [5], {"cost_q": -1.0}, "cost_q"),
    ([0, 1], [5], {"cost_kv": float("nan")}, "cost_kv"),
])
def test_bad_inputs(qo, kv, kw, match):
    views = sentinel_views(8, 16, 16, 64)
    args = dict(tile_q=2, num_ctas=8)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        S.plan_into(views, np.array(qo, np.int32), np.array(kv, np.int32), **args)
    assert np.all(views.section == SENTINEL)


def test_section_too_small_is_refused():
    L = S.PlanLayout(8, 16, 16)
    views = S.PlanViews(np.zeros(L.num_ints, np.int32), L, 64)
    views.section = views.section[:-1]  # a caller handing the extension a short buffer
    with pytest.raises(ValueError, match="needs"):
        S.plan_into(views, np.arange(2, dtype=np.int32), np.array([4], np.int32), tile_q=1, num_ctas=8)
