"""Deterministic mode on the GPU (issue 31, docs/deterministic.md): a request's output is bit-identical
(torch.equal) across random batches that contain it (companions, batch sizes 1..256, KV 1..32k), for the
decode and the prefill kernel, eager and replayed from a CUDA graph, while the normal plan's output changes
on at least one of the same batches (so the test can fail). Also: the prefill kernel's rows are bit-identical
whether their prefix came from a cache or an earlier chunk (the radix-cache claim), and the decode kernel's
fold of a whole request's pieces gives the same bits (output and LSE) as the merge of the same pieces run as
items of their own.

Run on the GPU machine: python3 -m pytest -q tests/test_deterministic_gpu.py   (about a minute on an H100)
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fi_backend.formats import BSR

pytestmark = pytest.mark.gpu

DEV = "cuda"
HQ, HKV, D, PAGE = 32, 8, 128, 16
POOL_PAGES = 8192                    # 128k tokens of KV the companions' pages are drawn from
BATCHES = 24


def _lazy():
    """(BatchAttention, Workspace), imported when a test runs (tests/spec_recorder.py stands in for them)."""
    from fi_backend.workspace import Workspace
    from fi_backend.wrappers import BatchAttention
    return BatchAttention, Workspace


def make(kernel, deterministic, max_tokens, max_requests=260, variant=None):
    from fi_backend import variants as V
    BatchAttention, _ = _lazy()
    variant = V.DEFAULT if variant is None else variant
    ws = BatchAttention.workspace_for(DEV, HQ, HKV, D, max_requests=max_requests, max_tokens=max_tokens,
                                      kernel=kernel, deterministic=deterministic, variant=variant)
    return BatchAttention(ws, HQ, HKV, D, page_size=PAGE, kernel=kernel, deterministic=deterministic,
                          variant=variant)


def bits(x):
    """x's bits as integers (torch.equal takes -0 for +0)."""
    x = x.contiguous()
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def target_runs(attn, q_begin):
    """How the last plan runs the request whose rows start at q_begin: "split" (an item per piece, merged) or
    "whole" (one item folding pieces of partial_stride tokens), with that piece length (0: split)."""
    d = attn.workspace.host_plan()
    mine = d.items[(d.items["q_begin"] == q_begin) & (d.items["unit"] == 0)]
    if len(mine) > 1:
        return "split", 0
    assert mine["partial_base"][0] < 0
    return "whole", int(mine["partial_stride"][0])


class Steps:
    """Persistent step buffers (fixed addresses, as an engine keeps them, so a captured run() replays) over one
    KV pool: the target request always reads the same pages (the pool's first), the companions random ones."""

    def __init__(self, max_requests, max_rows, max_kv, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.k = torch.randn(POOL_PAGES, PAGE, HKV, D, device=DEV, generator=g).to(torch.bfloat16)
        self.v = torch.randn(POOL_PAGES, PAGE, HKV, D, device=DEV, generator=g).to(torch.bfloat16)
        self.max_blocks = math.ceil(max_kv / PAGE)
        self.table = torch.zeros(max_requests, self.max_blocks, dtype=torch.int32, device=DEV)
        self.kv_lens = torch.zeros(max_requests, dtype=torch.int32, device=DEV)
        self.qo = torch.zeros(max_requests + 1, dtype=torch.int32, device=DEV)
        self.kbs = torch.arange(max_requests, dtype=torch.int32, device=DEV) * self.max_blocks
        self.q = torch.zeros(max_rows, HQ, D, dtype=torch.bfloat16, device=DEV)
        self.target_q = None

    def write(self, reqs, at, target_q):
        """reqs: [(q_len, kv_len)], the target at index `at` (its pages and query rows fixed). Returns
        (qo_cpu, kv_cpu, bsr, rows of the target)."""
        B = len(reqs)
        table = torch.from_numpy(self.rng.integers(0, POOL_PAGES, (B, self.max_blocks), dtype=np.int32))
        table[at] = torch.arange(self.max_blocks, dtype=torch.int32)
        self.table[:B] = table.to(DEV)
        kv = torch.tensor([r[1] for r in reqs], dtype=torch.int32)
        qo = torch.zeros(B + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor([r[0] for r in reqs], dtype=torch.int32), 0, out=qo[1:])
        self.kv_lens[:B] = kv.to(DEV)
        self.qo[:B + 1] = qo.to(DEV)
        rows = slice(int(qo[at]), int(qo[at + 1]))
        self.q[: int(qo[-1])].normal_(generator=None)
        self.q[rows] = target_q
        bsr = BSR(qo_indptr=self.qo[:B + 1], kv_indices=self.table.view(-1), kv_block_start=self.kbs[:B],
                  kv_lens=self.kv_lens[:B], block_width=PAGE, num_kv_blocks=POOL_PAGES)
        return qo, kv, bsr, rows


def companions(rng, n, kind, max_q):
    """n random (q_len, kv_len): decodes (kind "decode") or decodes and prefills, KV 1..32k."""
    out = []
    for _ in range(n):
        kv = int(rng.integers(1, 32769)) if rng.random() < 0.25 else int(rng.integers(1, 4097))
        prefill = kind != "decode" and rng.random() < 0.5
        out.append((int(rng.integers(1, min(kv, max_q) + 1)) if prefill else 1, kv))
    return out


KINDS = {  # kernel -> target (q_len, kv_len), companions' kind and largest q_len, rows a graph is captured for
    "decode": ((1, 20000), "decode", 1, 320),
    "prefill": ((300, 6000), "mixed", 128, 2048),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_output_is_bit_identical_across_batches(kernel, graph):
    target, kind, max_q, graph_rows = KINDS[kernel]
    max_rows = graph_rows if graph else 260 * max_q + target[0]
    wrappers = {det: make(kernel, det, max_tokens=max_rows) for det in (True, False)}
    steps = Steps(260, max_rows, 32768 + graph_rows, seed=31)
    gen = torch.Generator(device=DEV).manual_seed(7)
    target_q = torch.randn(target[0], HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
    out = torch.zeros_like(steps.q)
    cache = (steps.k, steps.v)
    rng = np.random.default_rng(5)
    results = {True: [], False: []}
    graphs = {}
    how = set()  # decode: the target ran split (merged) and whole (folded)
    for i in range(BATCHES):
        size = 1 if i == 0 else int(np.exp(rng.uniform(0, np.log(256))))
        reqs = companions(rng, size - 1, kind, max_q)
        at = int(rng.integers(0, size))
        reqs.insert(at, target)
        if graph:  # a fixed number of rows: companions dropped until they fit, one more takes the rest (padding)
            while sum(q for q, _ in reqs) > graph_rows:
                drop = int(rng.choice([j for j in range(len(reqs)) if j != at]))
                reqs.pop(drop)
                at -= drop < at
            rest = graph_rows - sum(q for q, _ in reqs)
            if rest:
                reqs.append((rest, rest + int(rng.integers(0, 4096))))
        qo, kv, bsr, rows = steps.write(reqs, at, target_q)
        n = int(qo[-1])
        for det, attn in wrappers.items():
            attn.plan(qo, kv, bsr, causal=True)
            if det and kernel == "decode":
                how.add(target_runs(attn, rows.start)[0])
            out.fill_(float("nan"))
            if not graph:
                attn.run(steps.q[:n], cache, out=out[:n])
            else:
                if det not in graphs:
                    attn.run(steps.q, cache, out=out)  # warm-up outside the graph
                    graphs[det] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graphs[det]):
                        attn.run(steps.q, cache, out=out)
                graphs[det].replay()
            torch.cuda.synchronize()
            attn.check_errors()
            assert not out[rows].isnan().any()
            results[det].append(out[rows].clone())
    for w in wrappers.values():
        w.release_graph()
    first = results[True][0]
    for i, o in enumerate(results[True]):
        assert torch.equal(bits(o), bits(first)), f"deterministic {kernel} output changed in batch {i}"
    if kernel == "decode":
        assert how == {"split", "whole"}, f"the target ran {how} only: the fold and the merge were not both used"
    assert any(not torch.equal(o, results[False][0]) for o in results[False]), (
        f"the normal plan gave the same {kernel} output in every batch: the test could not fail")


@pytest.mark.parametrize("window", [None, 700], ids=["default", "window"])
def test_prefill_rows_ignore_cached_prefix_and_chunking(window):
    """The prefill kernel, deterministic: a request's last rows computed in one prefill, with their prefix from
    a cache (only those rows as queries) and in chunks are bit-identical (the radix-cache claim); with a
    sliding window too (its edge inside a KV tile: the tiles stay on the multiples of the tile)."""
    from fi_backend import variants as V
    K = 5000
    attn = make("prefill", True, max_tokens=K, variant=None if window is None else V.SLIDING_WINDOW)
    steps = Steps(4, K, K, seed=3)
    params = {} if window is None else {"window_left": window}
    gen = torch.Generator(device=DEV).manual_seed(11)
    q_all = torch.randn(K, HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
    out = torch.zeros_like(steps.q)

    def rows_of(start, end):
        """Rows [start, end) of the request computed as a step of those query rows over KV [0, end)."""
        qo, kv, bsr, rows = steps.write([(end - start, end)], 0, q_all[start:end])
        attn.plan(qo, kv, bsr, causal=True, **params)
        attn.run(steps.q[: end - start], (steps.k, steps.v), out=out[: end - start])
        torch.cuda.synchronize()
        return out[rows].clone()

    whole = rows_of(0, K)
    for start in (4999, 4000, 1234, 77):  # a cached prefix of `start` tokens
        assert torch.equal(bits(rows_of(start, K)), bits(whole[start:])), f"a cached prefix of {start} tokens"
    chunks = torch.cat([rows_of(a, b) for a, b in ((0, 512), (512, 2500), (2500, K))])
    assert torch.equal(bits(chunks), bits(whole))


FOLD_LENGTHS = (129, 1000, 2048, 4097, 16389, 20000, 32768)   # pieces of 128 .. 2048 tokens, last partial or not


@pytest.mark.parametrize("variant", ["default", "window", "sigmoid"])
def test_decode_fold_matches_split_merge(variant):
    """The decode kernel, deterministic: a request alone on the grid runs its pieces as items of their own
    (partial states merged in piece order); among companions of its length, a whole number of (request, KV
    head) pairs a CTA of the grid, it runs whole, the kernel folding the same pieces. Output and LSE must
    agree in every bit (the fold and the merge do the same float operations on the same values), for KV
    lengths whose pieces run 128..2048 tokens; both against the reference too (the fold is the only path of
    a large batch). window: its edge inside a KV tile."""
    from fi_backend import reference as R
    from fi_backend import variants as V
    var = {"default": V.DEFAULT, "window": V.SLIDING_WINDOW, "sigmoid": V.SIGMOID}[variant]
    params = {"window": {"window_left": 700}, "sigmoid": {"sigmoid_bias": -1.0}}.get(variant, {})
    ref_kw = {"window": {"window_left": 700}, "sigmoid": {"use_sigmoid": True, "sigmoid_bias": -1.0}}.get(variant, {})
    attn = make("decode", True, max_tokens=1024, max_requests=1024, variant=var)
    B = attn.workspace.num_ctas   # HKV pairs a CTA: balanced without splitting
    steps = Steps(B, B, max(FOLD_LENGTHS), seed=17)
    lse_on = var.use_softmax
    out = torch.zeros_like(steps.q)
    lse = torch.zeros(B, HQ, dtype=torch.float32, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(23)
    rng = np.random.default_rng(29)
    for K in FOLD_LENGTHS:
        target_q = torch.randn(1, HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
        got = {}
        for size in (1, B):
            at = int(rng.integers(0, size))
            qo, kv, bsr, rows = steps.write([(1, K)] * size, at, target_q)
            attn.plan(qo, kv, bsr, causal=True, **params)
            how, chunk = target_runs(attn, rows.start)
            assert how == ("split" if size == 1 else "whole"), f"KV {K}, batch {size}: the target ran {how}"
            assert size == 1 or chunk < K, "whole with more than one piece (the fold is under test)"
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            if lse_on:
                attn.run(steps.q[:size], (steps.k, steps.v), out=out[:size], lse=lse[:size])
            else:
                attn.run(steps.q[:size], (steps.k, steps.v), out=out[:size])
            torch.cuda.synchronize()
            attn.check_errors()
            got[how] = (out[rows].clone(), lse[rows].clone())
        (o_split, l_split), (o_whole, l_whole) = got["split"], got["whole"]
        assert torch.equal(bits(o_split), bits(o_whole)), f"KV {K}: the fold and the merge differ in the output"
        if lse_on:
            assert torch.equal(bits(l_split), bits(l_whole)), f"KV {K}: the fold and the merge differ in the LSE"
        blocks = -(-K // PAGE)
        k = steps.k[:blocks].reshape(-1, HKV, D)[:K]
        v = steps.v[:blocks].reshape(-1, HKV, D)[:K]
        o_ref, l_ref = R.attention(target_q, k, v, causal=True, **ref_kw)
        # without softmax an output row is a sum of up to 32k terms: its error is bf16's at the row's scale
        scale = 1.0 if lse_on else max(1.0, o_ref.pow(2).mean().sqrt().item())
        torch.testing.assert_close(o_whole.double(), o_ref, atol=2e-2 * scale, rtol=2e-2)
        if lse_on:
            torch.testing.assert_close(l_whole.double(), l_ref, atol=1e-3, rtol=1e-3)
