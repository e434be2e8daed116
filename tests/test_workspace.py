"""The workspace: fixed section addresses, plan copies, declared bounds, sizes, no stray writes."""
import numpy as np
import pytest
import torch

from fi_backend import _planner
from fi_backend import scheduler as S
from fi_backend.workspace import SECTION_ALIGN, Workspace

SENTINEL = 0xA5


def make(device="cpu", **kw):
    args = dict(max_requests=256, max_tokens=2048, num_ctas=33, max_tile_q=64, num_qo_heads=8, num_kv_heads=2,
                head_dim=128)
    args.update(kw)
    return Workspace(device, **args)


def random_steps(rng, ws, n):
    """n steps within ws's bounds: decode 1..max_requests, prefill, mixed; causal or not; random tile_q."""
    for k in range(n):
        kind = k % 3
        if kind == 0:
            B = int(rng.integers(1, ws.max_requests + 1))
            kv = rng.integers(1, 8192, B)
            q = np.ones(B, dtype=np.int64)
        elif kind == 1:
            B = int(rng.integers(1, 5))
            q = rng.integers(1, ws.max_tokens // B + 1, B)
            kv = q + rng.integers(0, 1000, B)
        else:
            B = int(rng.integers(1, 64))
            kv = rng.integers(1, 4000, B)
            q = np.minimum(kv, rng.integers(0, ws.max_tokens // B + 1, B))
        qo = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        tile_q = int(rng.choice([1, 16, ws.max_tile_q]))
        units = int(rng.choice([ws.num_kv_heads, ws.num_qo_heads]))
        yield qo, kv.astype(np.int32), dict(tile_q=tile_q, num_units=units, causal=bool(rng.integers(2)),
                                              kv_chunk_align=int(rng.choice([1, 16])))


def used(ws, info):
    """The plan section's prefix a plan uses (what plan() copies to the device)."""
    return ws.layout.used_ints(info.num_items)


def test_section_layout_and_sizes():
    rng = np.random.default_rng()
    for _ in range(10):
        c, t, H, D = (int(rng.integers(1, 140)), int(rng.integers(1, 5000)), int(rng.integers(1, 65)),
                      int(rng.choice([64, 96, 128, 256])))
        Hkv = int(rng.choice([k for k in range(1, H + 1) if H % k == 0]))
        tq = int(rng.integers(1, 129))
        ws = make(num_ctas=c, max_tokens=t, max_tile_q=tq, num_qo_heads=H, num_kv_heads=Hkv, head_dim=D)
        # per unit (at most H of them) one item per pair, plus split chunks: 2 ceil(c / units) per unit
        assert ws.max_items == H * t + 2 * (c + H) and ws.num_ctas == c
        assert ws.plan_section.numel() == _planner.layout(c, ws.max_items, t)[4]
        P = 2 * (-(-c // Hkv)) * tq  # split items of one unit's share of the CTAs, tq rows each
        assert ws.max_partial_rows == P
        assert ws.partial_o.shape == (P, H, D) and ws.partial_o.dtype == torch.float32
        assert ws.partial_lse.shape == (P, H) and ws.partial_lse.dtype == torch.float32
        assert (ws.partial_o.numel() + ws.partial_lse.numel()) * 4 == P * H * (D + 1) * 4
        base = ws.buffer.data_ptr()
        ends = []
        for t_, ptr in ((ws.plan_section, ws.plan_ptr), (ws.partial_o, ws.partial_o_ptr),
                        (ws.partial_lse, ws.partial_lse_ptr)):
            assert t_.data_ptr() == ptr and (ptr - base) % SECTION_ALIGN == 0
            ends.append((ptr - base, ptr - base + t_.numel() * 4))
        assert ends[0][1] <= ends[1][0] and ends[1][1] <= ends[2][0] and ends[2][1] <= ws.nbytes
        assert ws.nbytes == ws.buffer.numel() and ws.nbytes % SECTION_ALIGN == 0
        assert ws.staging.numel() == ws.plan_section.numel() * 4


def test_addresses_fixed_and_device_section_equals_staging():
    rng = np.random.default_rng()
    ws = make()
    ptrs = (ws.buffer.data_ptr(), ws.plan_ptr, ws.partial_o_ptr, ws.partial_lse_ptr, ws.staging.data_ptr())
    for qo, kv, kw in random_steps(rng, ws, 30):
        info = ws.plan(qo, kv, **kw)
        assert (ws.buffer.data_ptr(), ws.plan_ptr, ws.partial_o_ptr, ws.partial_lse_ptr,
                ws.staging.data_ptr()) == ptrs
        assert (ws.plan_section.data_ptr(), ws.partial_o.data_ptr(), ws.partial_lse.data_ptr()) == ptrs[1:4]
        n = used(ws, info)
        assert torch.equal(ws.plan_section[:n].cpu(), ws.staging.view(torch.int32)[:n])
        d = ws.host_plan()
        assert (d.num_items, d.num_rows, d.num_partial_rows) == (info.num_items, int(qo[-1]), info.num_partial_rows)
        assert d.num_ctas == ws.num_ctas and info.num_partial_rows <= ws.max_partial_rows
        assert d.num_units == kw["num_units"] and info.num_items <= ws.max_items


def test_idle_plan_has_the_rows_and_no_items():
    """Workspace.plan_idle after a real plan: the header names the step's rows and no items, every CTA's queue is
    empty, and the device section holds the header and cta_indptr (all a kernel reads of a plan without items)."""
    rng = np.random.default_rng(3)
    ws = make()
    qo, kv, kw = next(random_steps(rng, ws, 1))
    assert ws.plan(qo, kv, **kw).num_items > 0
    info = ws.plan_idle(int(qo[-1]), len(kv), tile_q=kw["tile_q"], num_units=kw["num_units"])
    assert (info.num_items, info.num_rows, info.kind, info.shared_groups) == (0, int(qo[-1]), "idle", 0)
    d = ws.host_plan()
    assert (d.num_items, d.num_rows, d.num_requests, d.num_ctas, d.tile_q, d.num_units, d.num_split_rows) == (
        0, int(qo[-1]), len(kv), ws.num_ctas, kw["tile_q"], kw["num_units"], 0)
    assert not d.cta_indptr.any() and not d.merge_indptr.any() and d.items.size == 0
    n = ws.layout.merge_indptr_offset
    assert torch.equal(ws.plan_section[:n], ws.staging.view(torch.int32)[:n])
    with pytest.raises(ValueError, match="max_requests"):
        ws.plan_idle(1, ws.max_requests + 1, tile_q=1)


def test_decode_batch_sizes_1_to_256_share_addresses():
    ws = make()
    rng = np.random.default_rng()
    ptrs = (ws.plan_ptr, ws.partial_o_ptr, ws.partial_lse_ptr)
    for B in range(1, 257):
        qo = np.arange(B + 1, dtype=np.int32)
        info = ws.plan(qo, rng.integers(1, 32768, B).astype(np.int32), tile_q=1)
        assert (ws.plan_ptr, ws.partial_o_ptr, ws.partial_lse_ptr) == ptrs
    n = used(ws, info)
    assert torch.equal(ws.plan_section[:n].cpu(), ws.staging.view(torch.int32)[:n])


def test_plans_never_write_outside_the_plan_section():
    rng = np.random.default_rng()
    ws = make(max_tokens=1024, num_ctas=20, max_tile_q=16, num_qo_heads=2, num_kv_heads=1, head_dim=64)
    plan_end = ws.plan_offset + ws.plan_section.numel() * 4
    ws.buffer[plan_end:] = SENTINEL
    for qo, kv, kw in random_steps(rng, ws, 60):
        ws.plan(qo, kv, **kw)
    assert bool((ws.buffer[plan_end:] == SENTINEL).all())


def test_bounds_name_themselves():
    ws = make(max_requests=8, max_tokens=64, max_tile_q=16)
    with pytest.raises(ValueError, match="max_requests=8 but the step has 9 requests"):
        ws.plan(np.arange(10, dtype=np.int32), np.full(9, 5, np.int32), tile_q=1)
    with pytest.raises(ValueError, match="max_tokens=64 but the step has 65 query rows"):
        ws.plan(np.array([0, 65], np.int32), np.array([100], np.int32), tile_q=1)
    with pytest.raises(ValueError, match="max_tile_q=16 but tile_q=17"):
        ws.plan(np.array([0, 1], np.int32), np.array([100], np.int32), tile_q=17)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        make(max_tokens=0)
    with pytest.raises(ValueError, match=r"num_units=1 must be in \[num_kv_heads, num_qo_heads\] = \[2, 8\]"):
        ws.plan(np.array([0, 1], np.int32), np.array([100], np.int32), tile_q=1, num_units=1)
    with pytest.raises(ValueError, match=r"num_qo_heads \(8\) must be a multiple of num_kv_heads \(3\)"):
        make(num_kv_heads=3)
    # A failed plan leaves the last good plan in place.
    ws.plan(np.array([0, 3], np.int32), np.array([100], np.int32), tile_q=2)
    before = ws.plan_section.clone()
    with pytest.raises(ValueError):
        ws.plan(np.array([0, 3], np.int32), np.array([2], np.int32), tile_q=2, causal=True)  # q_len > kv_len
    assert torch.equal(ws.plan_section, before)


def test_max_items_bound_holds_for_every_tile_q():
    """max_items and max_partial_rows suffice for every tile_q and unit count: fill max_tokens with 1-row
    requests, tile_q = 1, as many units as query heads."""
    rng = np.random.default_rng()
    for num_ctas, max_tokens in ((64, 16), (8, 300), (33, 33)):
        ws = make(max_requests=max_tokens, max_tokens=max_tokens, num_ctas=num_ctas, max_tile_q=8)
        for tile_q in range(1, 9):
            for B in (1, max_tokens // 2 or 1, max_tokens):
                qo = np.arange(B + 1, dtype=np.int32)
                qo[-1] = max_tokens
                kv = (np.diff(qo) + rng.integers(0, 50000, B)).astype(np.int32)
                for units in (ws.num_kv_heads, ws.num_qo_heads):
                    info = ws.plan(qo, kv, tile_q=tile_q, num_units=units, causal=bool(rng.integers(2)),
                                   min_kv_chunk=1)
                    assert info.num_items <= ws.max_items
                    assert info.num_partial_rows <= 2 * (-(-num_ctas // units)) * tile_q <= ws.max_partial_rows


def test_torch_inputs():
    ws = make()
    qo = torch.arange(5, dtype=torch.int32)
    kv = torch.tensor([10, 2000, 30, 4000], dtype=torch.int32)
    a = ws.plan(qo, kv, tile_q=1)
    sa = ws.staging.clone()
    b = ws.plan(qo.numpy(), kv.numpy(), tile_q=1)
    assert a == b and torch.equal(sa, ws.staging)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pin_memory_needs_cuda():
    assert not make().staging.is_pinned()
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        make(pin_memory=True)


@pytest.mark.gpu
def test_cuda_workspace_copies_each_plan():
    rng = np.random.default_rng()
    ws = make("cuda")
    assert ws.buffer.is_cuda and ws.staging.is_pinned()
    ptrs = (ws.plan_ptr, ws.partial_o_ptr, ws.partial_lse_ptr)
    plan_end = ws.plan_section.numel() * 4
    ws.buffer[plan_end:] = SENTINEL
    for qo, kv, kw in random_steps(rng, ws, 40):
        ws.plan_section.fill_(-7)
        info = ws.plan(qo, kv, **kw)
        expect = ws.staging.view(torch.int32).clone()  # staging is only rewritten after the copy finished
        torch.cuda.current_stream().synchronize()
        n = used(ws, info)  # the used prefix is copied, nothing else
        got = ws.plan_section.cpu()
        assert torch.equal(got[:n], expect[:n]) and bool((got[n:] == -7).all())
        assert (ws.plan_ptr, ws.partial_o_ptr, ws.partial_lse_ptr) == ptrs
    # Back-to-back plans without synchronizing: each waits on the previous copy before reusing staging.
    steps = list(random_steps(rng, ws, 20))
    for qo, kv, kw in steps:
        info = ws.plan(qo, kv, **kw)
    torch.cuda.synchronize()
    n = used(ws, info)
    assert torch.equal(ws.plan_section[:n].cpu(), ws.staging.view(torch.int32)[:n])
    assert bool((ws.buffer[plan_end:] == SENTINEL).all())
    ref = S.PlanViews.allocate(ws.num_ctas, ws.max_items, ws.max_tokens, ws.max_partial_rows)
    qo, kv, kw = steps[-1]
    S.plan_into(ref, qo, kv, num_ctas=ws.num_ctas, **kw)
    d = ws.host_plan()
    assert np.array_equal(d.items, S.decode_plan(ref).items)


def test_plan_on_fewer_ctas_than_the_grid():
    """Workspace.plan(num_ctas=...): the decode family's member 1 plans over a prefix of the grid; the CTAs past it
    get empty queues, and a count past the grid is refused naming num_ctas."""
    ws = make(num_ctas=40)
    qo = np.arange(9, dtype=np.int32)
    kv = np.full(8, 3000, dtype=np.int32)
    info = ws.plan(qo, kv, tile_q=8, num_units=2, kv_chunk_align=128, cost_q=128.0, num_ctas=13)
    plan = ws.host_plan()
    assert info.num_items > 16   # split: more items than the 16 (request, unit) pairs
    assert (plan.cta_indptr[14:] == plan.cta_indptr[13]).all() and plan.cta_indptr[13] == info.num_items
    with pytest.raises(ValueError, match="num_ctas must be in"):
        ws.plan(qo, kv, tile_q=8, num_units=2, num_ctas=41)


def test_decode_member_pick_and_cuda_graphs():
    """BatchAttention._decode_member: member 1 below the first member's CTAs in (request, unit) pairs; a request
    count captured in a graph keeps its member; other counts after a member-1 capture plan for member 1 (its
    plans run on both kernels), unless the engine replays graphs only at their captured counts."""
    from types import SimpleNamespace
    from fi_backend.attention import BatchAttention
    w = SimpleNamespace(num_units=8, _grids=[392, 128], _captured={}, graphs_keep_request_count=False)
    pick = lambda b: BatchAttention._decode_member(w, b)
    assert [pick(b) for b in (1, 48, 49, 512)] == [1, 1, 0, 0]
    w._captured = {512: 0}
    assert [pick(b) for b in (1, 48, 49, 512)] == [1, 1, 0, 0]   # member-1 plans run on member 0's kernel
    w._captured = {512: 0, 8: 1}
    assert [pick(b) for b in (1, 8, 100, 512)] == [1, 1, 1, 0]
    w.graphs_keep_request_count = True
    assert [pick(b) for b in (1, 8, 100, 512, 1024)] == [1, 1, 0, 0, 0]
