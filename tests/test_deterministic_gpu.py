"""Deterministic mode on the GPU (issue 31, docs/deterministic.md): a request's output is bit-identical
(torch.equal) across random batches that contain it (companions, batch sizes 1..256, KV 1..32k), for the
decode and the prefill kernel, eager and replayed from a CUDA graph, while the normal plan's output changes
on at least one of the same batches (so the test can fail). Also: the prefill kernel's rows are bit-identical
whether their prefix came from a cache or an earlier chunk (the radix-cache claim).

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


def make(kernel, deterministic, max_tokens, max_requests=260):
    from fi_backend.wrappers import BatchAttention
    ws = BatchAttention.workspace_for(DEV, HQ, HKV, D, max_requests=max_requests, max_tokens=max_tokens,
                                      kernel=kernel, deterministic=deterministic)
    return BatchAttention(ws, HQ, HKV, D, page_size=PAGE, kernel=kernel, deterministic=deterministic)


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
    steps = Steps(260, graph_rows if graph else 260 * max_q + target[0], 32768 + graph_rows, seed=31)
    gen = torch.Generator(device=DEV).manual_seed(7)
    target_q = torch.randn(target[0], HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
    wrappers = {det: make(kernel, det, max_tokens=steps.q.shape[0]) for det in (True, False)}
    out = torch.zeros_like(steps.q)
    cache = (steps.k, steps.v)
    rng = np.random.default_rng(5)
    results = {True: [], False: []}
    graphs = {}
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
        assert torch.equal(o, first), f"deterministic {kernel} output changed in batch {i}"
    assert any(not torch.equal(o, results[False][0]) for o in results[False]), (
        f"the normal plan gave the same {kernel} output in every batch: the test could not fail")


def test_prefill_rows_ignore_cached_prefix_and_chunking():
    """The prefill kernel, deterministic: a request's last rows computed in one prefill, with their prefix from
    a cache (only those rows as queries) and in chunks are bit-identical (the radix-cache claim)."""
    K = 5000
    steps = Steps(4, K, K, seed=3)
    attn = make("prefill", True, max_tokens=K)
    gen = torch.Generator(device=DEV).manual_seed(11)
    q_all = torch.randn(K, HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
    out = torch.zeros_like(steps.q)

    def rows_of(start, end):
        """Rows [start, end) of the request computed as a step of those query rows over KV [0, end)."""
        qo, kv, bsr, rows = steps.write([(end - start, end)], 0, q_all[start:end])
        attn.plan(qo, kv, bsr, causal=True)
        attn.run(steps.q[: end - start], (steps.k, steps.v), out=out[: end - start])
        torch.cuda.synchronize()
        return out[rows].clone()

    whole = rows_of(0, K)
    for start in (4999, 4000, 1234):  # a cached prefix of `start` tokens
        assert torch.equal(rows_of(start, K), whole[start:])
    chunks = torch.cat([rows_of(a, b) for a, b in ((0, 512), (512, 2500), (2500, K))])
    assert torch.equal(chunks, whole)
