"""GPU tests of composable formats (docs/composable.md): shared-prefix groups planned with the per-request
BSR and run by the decode and prefill kernels in one launch, against the float64 reference (fi_backend.reference)
on fresh random inputs, outputs poisoned with NaN and every cache slot no request reads poisoned too.

Groups of 1..64 requests, prefixes of 1..32k tokens, pages of 1 and 16, GQA groups 1 / 4 / 7, every built-in
variant (those whose hooks see query positions plan their groups single-format: still checked), fp8 KV, CUDA-graph
replay after re-plans that change the groups, a graph of a decode and a prefill wrapper where each step runs one
and plans the other idle (the SGLang adapter's decode graphs), and plan(debug=True) refusing inconsistent groups."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from fi_backend import variants as V
from fi_backend.formats import BSR

from attention_cases import (DEV, TOL, _lazy, _variant_case, plan_run_check, poison_unused, random_kv,
                             replay_check)

pytestmark = pytest.mark.gpu


def make_wrapper(Hq, Hkv, D, *, kernel="decode", q_dtype=torch.bfloat16, kv_dtype=None, page_size=16,
                 variant=V.DEFAULT, max_tokens=512, max_requests=256):
    BatchAttention, _ = _lazy()
    ws = BatchAttention.workspace_for(DEV, Hq, Hkv, D, max_requests=max_requests, max_tokens=max_tokens,
                                      q_dtype=q_dtype, kv_dtype=kv_dtype, variant=variant, kernel=kernel,
                                      shared_prefix=True)
    return BatchAttention(ws, Hq, Hkv, D, q_dtype=q_dtype, kv_dtype=kv_dtype, page_size=page_size, variant=variant,
                          kernel=kernel)


def grouped_table(kv_lens, q_lens, page, groups, *, table=None, num_blocks=None):
    """A vLLM-style block table where each group's members hold their first member's page ids over the prefix
    (random distinct pages otherwise), as a device BSR; (bsr, qo_cpu, kv_cpu, num_blocks). table: a persistent
    device table to write into (CUDA graphs)."""
    B = len(kv_lens)
    nblk = [(l + page - 1) // page for l in kv_lens]
    width = max(nblk) + 2
    num_blocks = num_blocks or sum(nblk) + 7
    perm = torch.randperm(num_blocks).to(torch.int32)
    host = torch.full((B, width), -5, dtype=torch.int32)
    off = 0
    for b in range(B):
        host[b, :nblk[b]] = perm[off:off + nblk[b]]
        off += nblk[b]
    for first, end, plen in groups:
        shared = (plen + page - 1) // page
        host[first + 1:end, :shared] = host[first, :shared]
    if table is None:
        table = host.to(DEV)
    else:
        table[:B, :width] = host.to(DEV)
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    kv = torch.tensor(kv_lens, dtype=torch.int32)
    rows = torch.arange(B, dtype=torch.int32, device=DEV) * table.stride(0)
    bsr = BSR(qo_indptr=qo.to(DEV), kv_indices=table.view(-1), kv_block_start=rows, kv_lens=kv.to(DEV),
              block_width=page, num_kv_blocks=num_blocks)
    return bsr, qo, kv, num_blocks


def run_grouped(attn, kv_lens, q_lens, groups, *, dtype=torch.bfloat16, kv_dtype=None, variant_kw=None,
                ref_kw=None, k_scale=1.0, v_scale=1.0, tol=None, what="", expect_shared=None):
    kv_dtype = kv_dtype or dtype
    page = attn.page_size
    bsr, qo, kv, nb = grouped_table(kv_lens, q_lens, page, groups)
    cache, k, v = random_kv(nb, page, attn.num_kv_heads, attn.head_dim, kv_dtype)
    poison_unused(k, v, bsr)
    plan_run_check(attn, bsr, qo, kv, cache, k, v, dtype=dtype, kv_dtype=kv_dtype, causal=True,
                   plan_kw={"prefix_groups": torch.tensor(groups, dtype=torch.int32).view(-1, 3), "debug": True,
                            **(variant_kw or {})},
                   ref_kw=ref_kw, k_scale=k_scale, v_scale=v_scale, tol=tol, what=what)
    if expect_shared is not None:
        assert attn.plan_info.shared_groups == expect_shared, (what, attn.plan_info)
    return attn.plan_info


def _batch(members, prefix, suffix, q_len=1, lone=0):
    """One group of `members` requests sharing `prefix` tokens, each with `suffix` more (plus its query), and
    `lone` requests in no group around it."""
    kv = [prefix + suffix + random.randint(0, 40) + q_len for _ in range(members)]
    lone_kv = [random.randint(q_len, 3000) for _ in range(lone)]
    kv_lens = lone_kv[: lone // 2] + kv + lone_kv[lone // 2:]
    first = lone // 2
    return kv_lens, [q_len] * len(kv_lens), [(first, first + members, prefix)]


_CASES = [  # (members, prefix, suffix, lone)
    (64, 32768, 256, 0),   # the bar's decode cell
    (16, 8192, 100, 3),
    (128, 1024, 64, 0),
    (2, 5000, 7, 5),
    (7, 1, 30, 2),
    (1, 4000, 10, 4),      # a group of one: single-format
]


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("page,group", [(16, 4), (1, 4), (16, 1), (16, 7), (1, 7)])
def test_shared_prefix_matrix(kernel, page, group):
    Hkv = {1: 4, 4: 8, 7: 2}[group]
    attn = make_wrapper(Hkv * group, Hkv, 128, kernel=kernel, page_size=page)
    for members, prefix, suffix, lone in _CASES:
        if page == 1 and prefix > 8192:
            prefix = 8192  # token tables: keep the host table small
        kv_lens, q_lens, groups = _batch(members, prefix, suffix, lone=lone)
        run_grouped(attn, kv_lens, q_lens, groups, what=f"{kernel} page={page} group={group} {members}x{prefix}")


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_many_groups_and_multirow_queries(kernel):
    """Several groups of different sizes and prefixes in one step, requests with 1..5 query rows (a group's
    rows then span query tiles and requests at once), lone requests between the groups."""
    attn = make_wrapper(32, 8, 128, kernel=kernel, page_size=16)
    kv_lens, q_lens, groups, r = [], [], [], 0
    for members, prefix in ((3, 2048), (1, 0), (9, 4096), (1, 0), (20, 700), (5, 16)):
        if prefix:
            groups.append((r, r + members, prefix))
        for _ in range(members):
            ql = random.randint(1, 5)
            kv_lens.append(prefix + ql + random.randint(0, 300))
            q_lens.append(ql)
        r += members
    run_grouped(attn, kv_lens, q_lens, groups, what=f"{kernel} many groups")


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("name", ["default", "soft_cap", "sigmoid", "window", "alibi", "custom_mask", "rope_llama31",
                                  "soft_cap_window"])
def test_variants(kernel, name):
    """Variants whose hooks see no query position run shared items; the others plan the groups single-format
    (plan_info.shared_groups == 0). Both must match the reference with each query at its own position."""
    Hq, Hkv = 16, 4
    _, variant, vkw, rkw = _variant_case(name, Hq)
    attn = make_wrapper(Hq, Hkv, 128, kernel=kernel, page_size=16, variant=variant)
    # decode: one query a request (a decode tile holds as few as 2 tokens, so 2-token queries share no tile)
    kv_lens, q_lens, groups = _batch(12, 3000, 200, q_len=1 if kernel == "decode" else 2, lone=2)
    if callable(vkw):
        masks = vkw(q_lens, kv_lens)
        vkw = dict(zip(("mask_packed", "mask_indptr"), V.pack_custom_mask(masks, device=DEV)))
        rkw = {"masks": masks}
    from fi_backend.attention import shared_prefix_supported
    tol = TOL[torch.bfloat16] * (2 if "rope" in name else 1)
    run_grouped(attn, kv_lens, q_lens, groups, variant_kw=vkw, ref_kw=rkw, tol=tol, what=f"{kernel} {name}",
                expect_shared=1 if shared_prefix_supported(variant) else 0)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_fp8_kv(kernel):
    attn = make_wrapper(32, 8, 128, kernel=kernel, kv_dtype=torch.float8_e4m3fn, page_size=16)
    kv_lens, q_lens, groups = _batch(24, 6000, 128, lone=3)
    run_grouped(attn, kv_lens, q_lens, groups, kv_dtype=torch.float8_e4m3fn, k_scale=0.37, v_scale=1.9,
                what=f"{kernel} fp8", expect_shared=1)


class GraphSteps:
    """Persistent device BSR buffers of a decode batch of up to B requests (as an engine keeps them for CUDA
    graphs), a cache, and query / output buffers; step(n, groups) writes a new step's grouped table and lengths
    into them and returns (bsr, qo_cpu, kv_cpu)."""

    def __init__(self, B=40, width=600, page=16):
        self.page = page
        self.table = torch.zeros(B, width, dtype=torch.int32, device=DEV)
        self.seq = torch.zeros(B, dtype=torch.int32, device=DEV)
        self.qsl = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
        self.starts = torch.arange(B, dtype=torch.int32, device=DEV) * width
        self.num_blocks = B * width
        self.cache, self.k, self.v = random_kv(self.num_blocks, page, 8, 128, torch.bfloat16)
        self.q = torch.randn(B, 32, 128, device=DEV, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)

    def step(self, n, groups):
        prefix = {r: p for f, e, p in groups for r in range(f, e)}
        kv_lens = [prefix.get(r, 0) + random.randint(1, 900) for r in range(n)]
        _, qo, kv, _ = grouped_table(kv_lens, [1] * n, self.page, groups, table=self.table, num_blocks=self.num_blocks)
        self.seq[:n] = kv.to(DEV)
        self.qsl[:n + 1] = qo.to(DEV)
        bsr = BSR(qo_indptr=self.qsl[:n + 1], kv_indices=self.table.view(-1), kv_block_start=self.starts[:n],
                  kv_lens=self.seq[:n], block_width=self.page, num_kv_blocks=self.num_blocks)
        return bsr, qo, kv


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_cuda_graph_replay_after_replans_that_change_groups(kernel):
    """run() captured once (with groups), replayed after plans with other groups, no groups, and a smaller
    batch: the kernel reads the plan and the BSR from the same storage every time."""
    B = 40
    g = GraphSteps(B)
    attn = make_wrapper(32, 8, 128, kernel=kernel, page_size=g.page)
    cache, k, v, q_buf, out_buf = g.cache, g.k, g.v, g.q, g.out

    def step(n, groups):
        bsr, qo, kv = g.step(n, groups)
        attn.plan(qo, kv, bsr, causal=True, prefix_groups=groups or None)
        assert attn.plan_info.shared_groups == len(groups), attn.plan_info
        return bsr

    step(B, [(0, 30, 4096)])
    attn.run(q_buf, cache, out=out_buf)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q_buf, cache, out=out_buf)
    for groups in ([(0, 30, 4096)], [(2, 10, 8192), (12, 40, 2000)], [], [(5, 40, 3000)]):
        replay_check(graph, attn, q_buf, out_buf, k, v, step(B, groups), TOL[torch.bfloat16] * 2,
                     f"{kernel} graph replay {groups}")
    attn.release_graph()


def test_graph_of_two_wrappers_one_active_one_idle():
    """A decode-graph step as the SGLang adapter captures it with groups on: the decode wrapper and a prefill
    wrapper over the same BSR buffers, both launched into one output; each step plans its work on one of them
    (groups on the prefill kernel) and an idle plan (the same rows, no items) on the other, which writes nothing."""
    g = GraphSteps(40)
    dec = make_wrapper(32, 8, 128, kernel="decode", page_size=g.page)
    pre = make_wrapper(32, 8, 128, kernel="prefill", page_size=g.page).for_prefix_groups()   # as the adapters' is
    smallest = min(int(m.rows_per_tile) for m in pre._family)
    assert len(pre._family) > 1 and pre.rows_per_tile == smallest
    cache, k, v, q_buf, out_buf = g.cache, g.k, g.v, g.q, g.out

    def step(groups):
        bsr, qo, kv = g.step(40, groups)
        active, idle = (pre, dec) if groups else (dec, pre)
        active.plan(qo, kv, bsr, causal=True, prefix_groups=groups or None)
        assert active.plan_info.shared_groups == len(groups), active.plan_info
        idle.plan(qo, kv, bsr, causal=True, idle=True)
        assert idle.plan_info.kind == "idle" and idle.plan_info.num_items == 0
        return bsr

    step([])
    dec.run(q_buf, cache, out=out_buf)  # warm-up outside the graph
    pre.run(q_buf, cache, out=out_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(q_buf, cache, out=out_buf)
        pre.run(q_buf, cache, out=out_buf)
    for groups in ([(0, 30, 4096)], [], [(2, 10, 8192), (12, 40, 2000)], []):
        replay_check(graph, dec, q_buf, out_buf, k, v, step(groups), TOL[torch.bfloat16] * 2,
                     f"two wrappers, graph replay {groups}")
        pre.check_errors()
        assert pre.rows_per_tile == smallest   # the kernel the graph holds
    step([])   # eager: the idle wrapper alone leaves the output as it was
    out_buf.fill_(float("nan"))
    pre.run(q_buf, cache, out=out_buf)
    torch.cuda.synchronize()
    assert out_buf.isnan().all()
    dec.release_graph()
    pre.release_graph()


def test_group_steps_plan_on_the_smallest_tile():
    """A prefill wrapper plans a step with groups on its family's smallest query tile (each request's own KV is an
    item of its few rows), any other step by the family's pick; for_prefix_groups() is for prefill wrappers."""
    attn = make_wrapper(32, 8, 128, kernel="prefill", page_size=16, max_tokens=4096)
    smallest = min(int(m.rows_per_tile) for m in attn._family)
    kv_lens, q_lens, groups = _batch(64, 4096, 300)
    run_grouped(attn, kv_lens, q_lens, groups, what="64 x 4096 on the prefill kernel", expect_shared=1)
    assert attn.rows_per_tile == smallest
    bsr, qo, kv, _ = grouped_table([2000] * 16, [128] * 16, 16, [])
    attn.plan(qo, kv, bsr, causal=True)   # no groups: the family's pick (16 x 128 in whole waves: the large tile)
    assert attn.rows_per_tile == max(int(m.rows_per_tile) for m in attn._family)
    with pytest.raises(ValueError, match="for_prefix_groups.*prefill wrappers"):
        make_wrapper(32, 8, 128, kernel="decode", page_size=16).for_prefix_groups()


def test_debug_plan_refuses_inconsistent_groups():
    attn = make_wrapper(32, 8, 128, page_size=16)
    kv_lens = [2000, 2000, 1000, 2000]
    bsr, qo, kv, _ = grouped_table(kv_lens, [1] * 4, 16, [(0, 2, 1024)])
    with pytest.raises(ValueError, match="prefix group 0: request 1 is also in group|prefix group 1: request 1 is "
                                         "also in group 0"):
        attn.plan(qo, kv, bsr, causal=True, prefix_groups=[[0, 2, 512], [1, 3, 512]], debug=True)
    with pytest.raises(ValueError, match="prefix group 0: its prefix of 1500 tokens is longer than request 2's KV"):
        attn.plan(qo, kv, bsr, causal=True, prefix_groups=[[1, 3, 1500]], debug=True)
    with pytest.raises(ValueError, match="prefix group 0: request 2 reads KV block"):
        attn.plan(qo, kv, bsr, causal=True, prefix_groups=[[0, 3, 512]], debug=True)
    with pytest.raises(ValueError, match="group 0: prefix length 1500 exceeds request 2's KV"):  # the planner's own
        attn.plan(qo, kv, bsr, causal=True, prefix_groups=[[1, 3, 1500]])
