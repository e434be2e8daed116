"""GPU tests of the decode kernel (csrc/attention/decode.cuh) through BatchAttention, against the float64
reference (fi_backend.reference). Fresh random inputs every run; outputs are poisoned with NaN first.

Matrix: the cheap axes (page size {1, 16, 32} x head_dim {64, 128, 256} x group {1, 4, 8}) in full, each
with a batch from {1, 7, 128} and KV lengths from {1, 17, 1000, 33000} chosen so every value of every
axis appears; dtypes bf16 / fp16 alternate. Then fp8 KV, every variant (with multi-row "speculative"
queries and causal masking), the vLLM-packed, HND and SGLang layouts, CUDA-graph replay after a re-plan
with other lengths and a smaller batch, and the error paths.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from fi_backend import reference as ref
from fi_backend import variants as V
from fi_backend.formats import BSR

from attention_cases import (_VARIANT_NAMES, DEV, TOL, PersistentBatch, _lazy, _variant_case, check, make_bsr, make_wrapper, random_kv, reference,
                             replay_check, run_case, run_variant_case)

pytestmark = pytest.mark.gpu

# ------------------------------------------------------------------------------------ the matrix

_PAGES, _DIMS, _GROUPS = (1, 16, 32), (64, 128, 256), (1, 4, 8)
# (batch, KV lengths): every batch size and every KV length appears; 33000 only with small batches.
_SHAPES = [
    (1, [33000]),
    (7, [1, 17, 1000, 33000, 5, 999, 64]),
    (128, None),  # lengths drawn from {1, 17, 1000} and a few others
]


@pytest.mark.parametrize("page,D,group", list(itertools.product(_PAGES, _DIMS, _GROUPS)))
def test_decode_matrix(page, D, group):
    k = (_PAGES.index(page) + _DIMS.index(D) + _GROUPS.index(group))
    batch, lens = _SHAPES[k % 3]
    dtype = (torch.bfloat16, torch.float16)[k % 2]
    Hkv = 2 if group == 8 else 4
    if lens is None:
        lens = [random.choice([1, 17, 1000, random.randint(1, 1200)]) for _ in range(batch)]
    attn = make_wrapper(Hkv * group, Hkv, D, q_dtype=dtype, page_size=page)
    run_case(attn, lens, [1] * batch, dtype=dtype, what=f"page={page} D={D} group={group} batch={batch}")


def test_big_batch_and_long_sequences():
    """batch 128 with one 33000-token request (uneven), then 7 long requests (splits + merges)."""
    attn = make_wrapper(32, 8, 128, page_size=16, max_tokens=256)
    lens = [random.randint(1, 1100) for _ in range(127)] + [33000]
    random.shuffle(lens)
    run_case(attn, lens, [1] * 128, dtype=torch.bfloat16, what="batch 128 + one 33k")
    run_case(attn, [33000, 20000, 17, 1, 4096, 8191, 12345], [1] * 7, dtype=torch.bfloat16, what="7 long")


@pytest.mark.parametrize("name,Hq,Hkv,D", [("default", 16, 2, 128), ("default", 12, 2, 128), ("default", 2, 2, 64),
                                             ("default", 16, 16, 128), ("default", 8, 2, 256), ("sigmoid", 8, 2, 128),
                                             ("sigmoid", 4, 1, 128)])
def test_merge_lanes(name, Hq, Hkv, D):
    """Few (request, unit) pairs split 16-64 ways: the completing CTA merges a row's states with several lanes a
    (row, head, 8 dims) unit, combined by shuffles (shared.cuh merge_rows). With and without softmax, rows whose
    states outnumber the lanes' batches or fall short of them, a short request among long ones."""
    attn = make_wrapper(Hq, Hkv, D, page_size=16, variant=_variant_case(name, Hq)[1])
    for kv_lens, q_lens in (([8191], [1]), ([20000], [1]), ([33000, 300, 4099], [1, 1, 2]), ([1000, 1], [1, 1])):
        run_variant_case(attn, name, kv_lens, q_lens, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_kv(kv_dtype, D):
    attn = make_wrapper(32, 8, D, q_dtype=torch.bfloat16, kv_dtype=kv_dtype, page_size=16)
    lens = [random.randint(1, 3000) for _ in range(9)] + [17, 1]
    run_case(attn, lens, [1] * len(lens), dtype=torch.bfloat16, kv_dtype=kv_dtype, k_scale=0.37, v_scale=1.9,
             what=f"fp8 {kv_dtype} D={D}")


def test_fp8_kv_fp16_query_multirow():
    attn = make_wrapper(16, 4, 128, q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, page_size=32)
    run_case(attn, [700, 45, 2000], [3, 1, 4], dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, causal=True,
             k_scale=2.0, v_scale=0.5, tol=3e-3, what="fp8 fp16 multirow")


# ------------------------------------------------------------------------------------ variants

@pytest.mark.parametrize("name", _VARIANT_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_variants(name, dtype):
    Hq, Hkv, D = 16, 4, 128
    attn = make_wrapper(Hq, Hkv, D, q_dtype=dtype, page_size=16, variant=_variant_case(name, Hq)[1])
    run_variant_case(attn, name, [1500, 17, 300, 1, 4000], [1, 3, 2, 1, 4], dtype)  # speculative rows, causal


def test_rope_long_positions_fp8():
    cfg = ref.RopeConfig(theta=500000.0, llama31=ref.Llama31Scaling())
    attn = make_wrapper(32, 8, 128, kv_dtype=torch.float8_e4m3fn, variant=V.ROPE)
    run_case(attn, [33000, 9000], [1, 1], dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
             variant_kw={"rope": cfg}, ref_kw={"rope": cfg}, k_scale=0.5, v_scale=1.5, tol=2e-2, what="rope 33k fp8")


# ------------------------------------------------------------------------------------ layouts

@pytest.mark.parametrize("layout,packed,page", [("NHD", True, 16), ("HND", True, 16), ("HND", False, 32),
                                                ("SGL", False, 1), ("NHD", False, 1)])
def test_layouts(layout, packed, page):
    attn = make_wrapper(32, 8, 128, page_size=page, kv_layout="HND" if layout == "HND" else "NHD")
    lens = [random.randint(1, 2500) for _ in range(12)]
    run_case(attn, lens, [1] * 12, dtype=torch.bfloat16, layout=layout, packed=packed, what=f"layout {layout}")


# ------------------------------------------------------------------------------------ CUDA graphs

@pytest.mark.parametrize("name", ["default", "sigmoid", "rope_llama31", "soft_cap_window", "custom_mask", "alibi"])
def test_cuda_graph_replay_after_replan(name):
    """Capture run() once, re-plan with other lengths and a smaller batch (written into the same BSR
    tensors, as engines do), replay, and compare every row with the reference. The graph's q/out views
    are fixed, so a smaller batch is padded with one request that takes the remaining rows."""
    Hq, Hkv, D, page = 16, 4, 128, 16
    _, variant, vkw0, rkw0 = _variant_case(name, Hq)
    attn = make_wrapper(Hq, Hkv, D, page_size=page, variant=variant, max_tokens=64, max_requests=32)
    max_B = 24
    batch = PersistentBatch(max_B, 260, page)
    cache, k, v = random_kv(batch.num_blocks, page, Hkv, D, torch.bfloat16)
    mask_buf = torch.zeros(1 << 17, dtype=torch.uint8, device=DEV)
    mask_ptr = torch.zeros(max_B, dtype=torch.int64, device=DEV)
    rows = 24
    q_buf = torch.zeros(rows, Hq, D, dtype=torch.bfloat16, device=DEV)
    out_buf = torch.zeros_like(q_buf)

    def step(q_lens, kv_lens):
        """Write a step into the persistent buffers and plan it."""
        B = len(q_lens)
        assert sum(q_lens) == rows
        bsr, qo, kv_cpu = batch.write(q_lens, kv_lens)
        vkw, rkw = vkw0, rkw0
        if callable(vkw0):
            masks = vkw0(q_lens, kv_lens)
            packed, indptr = V.pack_custom_mask(masks, device=DEV)
            mask_buf[:packed.numel()] = packed
            mask_ptr[:B] = indptr
            vkw, rkw = {"mask_packed": mask_buf, "mask_indptr": mask_ptr}, {"masks": masks}
        attn.plan(qo, kv_cpu, bsr, causal=True, **vkw)
        return bsr, rkw

    def lens(B):
        q_lens = [1] * (B - 3) + [2, 3]
        q_lens.append(rows - sum(q_lens))  # the padding request takes the remaining rows
        kv_lens = [random.randint(q, 4000) for q in q_lens]
        kv_lens[0] = 1
        return q_lens, kv_lens

    step(*lens(20))
    q_buf.normal_()
    attn.run(q_buf, cache, out=out_buf)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf, cache, out=out_buf)

    for B1 in (20, 9):  # the captured batch with other lengths, then a smaller batch
        bsr, rkw = step(*lens(B1))
        q_buf.normal_()
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        attn.check_errors()
        o_ref, _ = reference(q_buf, k, v, bsr, causal=True, **rkw)
        check(out_buf, None, o_ref, None, TOL[torch.bfloat16] * 2, f"graph replay {name} B={B1}")
    attn.release_graph()


@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (128, 8)])
def test_cuda_graph_across_family_members(Hq, Hkv):
    """The decode family (shapes.decode_family_size): a graph captured on member 0 (64-token tiles) replays a
    plan of fewer requests made for member 1 (128-token tiles, fewer CTAs), and eager runs of both members agree
    with the reference. Llama-3.1-8B's heads (8-row tiles: member 1 below 49 requests on the H100's 392-CTA grid)
    and Llama-3.1-405B's (16-row tiles: below 33 on 264 CTAs)."""
    D, page = 128, 16
    attn = make_wrapper(Hq, Hkv, D, page_size=page, max_tokens=64, max_requests=64)
    if len(attn.module_names) < 2:
        pytest.skip("this build has one decode member for these heads")
    small = max(1, (attn._grids[0] - 1) // attn.num_units)   # the most requests member 1 takes
    big = small + 7
    batch = PersistentBatch(big, 300, page)
    cache, k, v = random_kv(batch.num_blocks, page, Hkv, D, torch.bfloat16)
    q_buf = torch.zeros(big, Hq, D, dtype=torch.bfloat16, device=DEV)
    out_buf = torch.zeros_like(q_buf)

    def step(B):
        q_lens = [1] * B
        q_lens[-1] += big - B   # the graph's rows: the last request takes the padding
        kv_lens = [random.randint(q, 4700) for q in q_lens]
        bsr, qo, kv_cpu = batch.write(q_lens, kv_lens)
        attn.plan(qo, kv_cpu, bsr, causal=True)
        return bsr

    def eager_check(bsr, what):
        q_buf.normal_()
        out_buf.fill_(float("nan"))
        attn.run(q_buf, cache, out=out_buf)
        attn.check_errors()
        o_ref, _ = reference(q_buf, k, v, bsr, causal=True)
        check(out_buf, None, o_ref, None, TOL[torch.bfloat16] * 2, what)

    for B, member in ((big, 0), (small, 1)):   # eager, each member
        bsr = step(B)
        assert attn._member == member and attn.grid[0] == attn._grids[member]
        eager_check(bsr, f"eager member {member} B={B}")
    assert attn._grids[1] < attn._grids[0]
    step(big)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf, cache, out=out_buf)
    for B, member in ((big, 0), (small, 1), (3, 1), (big, 0)):
        bsr = step(B)
        assert attn._member == member
        replay_check(graph, attn, q_buf, out_buf, k, v, bsr, TOL[torch.bfloat16] * 2,
                     f"graph of member 0, plan of member {member} B={B}")
    attn.release_graph()

    # A graph of member 1: other counts plan for member 1 (a graph may replay them), unless the engine replays
    # graphs only at their captured count (graphs_keep_request_count): then they are eager and free.
    step(small)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf, cache, out=out_buf)
    for keep, B, member, replay in ((False, big, 1, False), (True, big, 0, False), (True, small, 1, True)):
        attn.graphs_keep_request_count = keep
        bsr = step(B)
        assert attn._member == member
        what = f"graph of member 1, keep={keep} B={B}"
        if replay:
            replay_check(graph, attn, q_buf, out_buf, k, v, bsr, TOL[torch.bfloat16] * 2, what)
        else:
            eager_check(bsr, what)
    attn.release_graph()


def test_graph_rejects_new_bsr_storage():
    attn = make_wrapper(8, 8, 64, page_size=16, max_tokens=16, max_requests=16)
    bsr, qo, kl, nb = make_bsr([40, 50], [1, 1], 16)
    cache, _, _ = random_kv(nb, 16, 8, 64, torch.bfloat16)
    attn.plan(qo, kl, bsr)
    q = torch.randn(2, 8, 64, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    attn.run(q, cache, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn.run(q, cache, out=out)
    bsr2, qo2, kl2, _ = make_bsr([40, 50], [1, 1], 16, num_blocks=nb)
    with pytest.raises(ValueError, match="captured in a CUDA graph"):
        attn.plan(qo2, kl2, bsr2)
    with pytest.raises(ValueError, match="captured in a CUDA graph"):
        attn.plan(qo, kl, bsr, causal=True)
    attn.release_graph()
    attn.plan(qo2, kl2, bsr2)


# ------------------------------------------------------------------------------------ errors

def test_errors():
    BatchAttention, Workspace = _lazy()
    ws = Workspace(DEV, max_requests=8, max_tokens=8, num_ctas=8, max_tile_q=16, num_qo_heads=8, num_kv_heads=2,
                   head_dim=128)
    with pytest.raises(ValueError, match=r"num_kv_heads/head_dim \(8, 2, 128\) must equal the wrapper's \(8, 8, 128\)"):
        BatchAttention(ws, 8, 8, 128)
    with pytest.raises(ValueError, match="head_dim"):
        BatchAttention(ws, 8, 8, 96)
    with pytest.raises(TypeError, match="q_dtype"):
        BatchAttention(ws, 8, 8, 128, q_dtype=torch.float32)
    with pytest.raises(TypeError, match="kv_dtype"):
        BatchAttention(ws, 8, 8, 128, q_dtype=torch.bfloat16, kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="page_size"):
        BatchAttention(ws, 8, 8, 128, page_size=300)
    with pytest.raises(ValueError, match="multiple"):
        BatchAttention(ws, 8, 3, 128)
    attn = BatchAttention(ws, 8, 2, 128, page_size=16)
    bsr, qo, kl, nb = make_bsr([100, 20, 3], [1, 1, 1], 16)
    cache, _, _ = random_kv(nb, 16, 2, 128, torch.bfloat16)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(torch.zeros(3, 8, 128, device=DEV, dtype=torch.bfloat16), cache)
    attn.plan(qo, kl, bsr)
    q = torch.randn(3, 8, 128, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        attn.run(q.half(), cache)
    with pytest.raises(ValueError, match="rows"):
        attn.run(q[:2], cache)
    with pytest.raises(ValueError, match="is on"):
        attn.run(q.cpu(), cache)
    with pytest.raises(ValueError, match="KV heads"):
        attn.run(q, random_kv(nb, 16, 4, 128, torch.bfloat16)[0])
    with pytest.raises(ValueError, match="page"):
        attn.run(q, random_kv(nb, 32, 2, 128, torch.bfloat16)[0])
    with pytest.raises(ValueError, match="block_width"):
        attn.plan(qo, kl, make_bsr([100, 20, 3], [1, 1, 1], 32)[0])
    with pytest.raises(V.VariantError, match="no parameter"):
        attn.plan(qo, kl, bsr, window_left=3)
    # an out-of-range page id: flagged, never dereferenced, and caught by debug planning
    bsr.kv_indices[bsr.kv_block_start[0].item() + 2] = nb + 1000
    attn.plan(qo, kl, bsr)
    out = torch.full_like(q, float("nan"))
    attn.run(q, cache, out=out)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="outside"):
        attn.check_errors()
    attn.check_errors()  # cleared
    assert not torch.isnan(out).any()
    with pytest.raises(ValueError):
        attn.plan(qo, kl, bsr, debug=True)


def test_plan_keeps_its_bsr_alive():
    """run() reads the BSR by address: the wrapper must hold the tensors it planned with, even when the
    caller's BSR (built from temporaries) is dropped and its memory is offered to new allocations."""
    attn = make_wrapper(32, 8, 128, page_size=16)
    kv_lens = [4096, 17, 1000, 2500]
    bsr, qo_cpu, kv_cpu, nb = make_bsr(kv_lens, [1] * len(kv_lens), 16)
    fields = {f: getattr(bsr, f) for f in ("qo_indptr", "kv_indices", "kv_block_start", "kv_lens")}
    kept = BSR(**{f: t.clone() for f, t in fields.items()}, block_width=16, num_kv_blocks=nb)
    # the caller's BSR holds the only references to its tensors
    bsr = BSR(**{f: t.clone() for f, t in fields.items()}, block_width=16, num_kv_blocks=nb)
    del fields
    cache, k, v = random_kv(nb, 16, 8, 128, torch.bfloat16)
    q = torch.randn(len(kv_lens), 32, 128, device=DEV, dtype=torch.bfloat16)
    attn.plan(qo_cpu, kv_cpu, bsr)
    del bsr
    junk = [torch.full((n,), -7, dtype=torch.int32, device=DEV) for n in (8, 16, 64, 256, 1024) for _ in range(8)]
    out = torch.full_like(q, float("nan"))
    attn.run(q, cache, out=out)
    torch.cuda.synchronize()
    del junk
    o_ref, _ = ref.attention_bsr(q, k, v, kept)
    check(out, None, o_ref, None, TOL[torch.bfloat16], "BSR dropped by the caller after plan()")
