"""BSR formats: builders, validation, dense masks, query positions and the shared-prefix split.

Oracles are plain Python loops over requests (independent of the vectorised code under test) and the
float64 reference attention (fi_backend.reference). Inputs are fresh random draws; the seed is printed
and FI_TEST_SEED=<seed> replays it.
"""
from __future__ import annotations

import dataclasses

import os

import pytest
import torch

from fi_backend.formats import (
    BSR,
    Ragged,
    from_block_table,
    from_dense_mask,
    from_ragged,
    from_token_table,
    query_positions,
    shared_prefix_groups,
    split_shared_prefix,
    to_dense_mask,
)
from fi_backend.reference import alibi_slopes, attention, attention_bsr, batch_attention, merge_state

I32, I64 = torch.int32, torch.int64
HQ, HKV, D = 4, 2, 16
JUNK = 10**6  # poison for table entries no request uses: reading one fails range checks or indexing


@pytest.fixture
def gen():
    seed = int(os.environ.get("FI_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"FI_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def randint(gen, lo, hi, size=()):
    """Uniform integers in [lo, hi] (inclusive), int64."""
    return torch.randint(lo, hi + 1, size, generator=gen)


def rint(gen, lo, hi) -> int:
    return int(randint(gen, lo, hi))


def ceil_div(a, b):
    return -(-a // b)


def used_blocks(bsr: BSR, i: int) -> list[int]:
    """Row block i's KV block ids, read the slow way."""
    n = ceil_div(int(bsr.kv_lens[i]), bsr.block_width)
    s = int(bsr.kv_block_start[i])
    return bsr.kv_indices[s : s + n].tolist()


def rows_of(bsr: BSR, i: int) -> list[int]:
    r0, r1 = int(bsr.qo_indptr[i]), int(bsr.qo_indptr[i + 1])
    return list(range(r0, r1)) if bsr.qo_rows is None else bsr.qo_rows[r0:r1].tolist()


def assert_same_bsr(a: BSR, b: BSR):
    for name in ("qo_indptr", "kv_indices", "kv_block_start", "kv_lens", "qo_rows", "kv_pos_start"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype, name
            assert torch.equal(x.cpu(), y.cpu()), name
    assert a.block_width == b.block_width and a.num_kv_blocks == b.num_kv_blocks


def make_block_table(gen, num_reqs, max_blocks, block_size, row_pad=0, min_len=0):
    """A vLLM-style batch: distinct random pages per request, junk past each request's length."""
    num_pages = num_reqs * max_blocks + rint(gen, 0, 8)
    pages = torch.randperm(num_pages, generator=gen)[: num_reqs * max_blocks].view(num_reqs, max_blocks)
    seq_lens = randint(gen, min_len, max_blocks * block_size, (num_reqs,))
    q_lens = torch.minimum(randint(gen, 1, 3 * block_size, (num_reqs,)), seq_lens)
    nblk = ceil_div(seq_lens, block_size)
    pages = torch.where(torch.arange(max_blocks)[None, :] < nblk[:, None], pages, JUNK)
    buf = torch.full((num_reqs, max_blocks + row_pad), -JUNK, dtype=I32)
    buf[:, :max_blocks] = pages.to(I32)
    table = buf[:, :max_blocks]  # row stride max_blocks + row_pad: a slice of a persistent buffer
    qsl = torch.cat((torch.zeros(1, dtype=I64), torch.cumsum(q_lens, 0))).to(I32)
    return table, seq_lens.to(I32), qsl, num_pages


# ------------------------------------------------------------------------------------------ builders


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("row_pad", [0, 5])
def test_from_block_table(gen, block_size, row_pad):
    n, max_blocks = rint(gen, 1, 9), rint(gen, 1, 6)
    table, seq_lens, qsl, num_pages = make_block_table(gen, n, max_blocks, block_size, row_pad)
    bsr = from_block_table(table, seq_lens.to(I64), qsl, block_size, num_kv_blocks=num_pages)

    assert bsr.kv_indices.dtype == I32 and bsr.kv_lens.dtype == I32 and bsr.qo_indptr.dtype == I32
    assert bsr.kv_block_start.dtype in (I32, I64) and bsr.kv_block_start.shape == (n,)
    assert bsr.block_width == block_size and bsr.num_row_blocks == n
    assert bsr.num_q_rows == int(qsl[-1])
    assert torch.equal(bsr.qo_indptr, qsl) and torch.equal(bsr.kv_lens, seq_lens)
    for i in range(n):
        L = int(seq_lens[i])
        nb = ceil_div(L, block_size)
        assert used_blocks(bsr, i) == table[i, :nb].tolist()
        assert int(bsr.kv_num_blocks[i]) == nb
        assert int(bsr.last_block_len[i]) == (L - (nb - 1) * block_size if nb else 0)
    # Zero-copy: kv_indices lives in the table's storage, so writes to the table are seen.
    assert bsr.kv_indices.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    i = int(torch.argmax(seq_lens))
    if int(seq_lens[i]):
        table[i, 0] = 12345
        assert used_blocks(bsr, i)[0] == 12345
    moved = bsr.to("cpu")
    assert_same_bsr(moved, bsr)


def test_from_block_table_rejects_strided_columns(gen):
    table, seq_lens, qsl, _ = make_block_table(gen, 3, 4, 16)
    strided = torch.zeros(3, 8, dtype=I32)[:, ::2]
    strided.copy_(table)
    with pytest.raises(ValueError, match="block_table"):
        from_block_table(strided, seq_lens, qsl, 16)
    assert_same_bsr(from_block_table(strided.contiguous(), seq_lens, qsl, 16), from_block_table(table, seq_lens, qsl, 16))


def make_token_table(gen, B, max_len, page_size, num_pages, decode):
    """An SGLang-style pool: slots of a page contiguous (slot = page * P + offset), junk past seq_len."""
    P = page_size
    pool_rows = B + rint(gen, 1, 4)
    pages_per_row = ceil_div(max_len, P)
    pages = torch.randperm(num_pages, generator=gen)[: pool_rows * pages_per_row].view(pool_rows, pages_per_row)
    t = torch.arange(max_len)
    req_to_token = (pages.repeat_interleave(P, dim=1)[:, :max_len] * P + t % P).to(I32)
    req_pool_indices = torch.randperm(pool_rows, generator=gen)[:B]
    seq_lens = randint(gen, 1, max_len, (B,))
    junk = t[None, :] >= seq_lens[:, None]
    rows = req_to_token[req_pool_indices]
    req_to_token[req_pool_indices] = torch.where(junk, torch.full_like(rows, -7), rows)
    if decode:
        qo_indptr = None
    else:
        q_lens = torch.minimum(randint(gen, 1, 20, (B,)), seq_lens)
        qo_indptr = torch.cat((torch.zeros(1, dtype=I64), torch.cumsum(q_lens, 0)))
    return req_to_token, req_pool_indices, seq_lens, qo_indptr, pages


@pytest.mark.parametrize("page_size", [1, 16, 32])
@pytest.mark.parametrize("decode", [True, False])
def test_from_token_table(gen, page_size, decode):
    P = page_size
    B, max_len = rint(gen, 1, 8), rint(gen, 1, 5) * 32 + rint(gen, 0, 7)
    num_pages = 64 * ceil_div(max_len, P)
    r2t, idx, seq_lens, qo_indptr, pages = make_token_table(gen, B, max_len, P, num_pages, decode)
    bsr = from_token_table(r2t, idx, seq_lens, qo_indptr, page_size=P, num_kv_slots=num_pages * P)

    assert bsr.block_width == P and bsr.num_kv_blocks == num_pages
    assert bsr.kv_indices.dtype == I32 and bsr.kv_lens.dtype == I32 and bsr.qo_indptr.dtype == I32
    expected_qo = torch.arange(B + 1) if decode else qo_indptr
    assert torch.equal(bsr.qo_indptr.to(I64), expected_qo)
    for b in range(B):
        L, r = int(seq_lens[b]), int(idx[b])
        if P == 1:
            assert used_blocks(bsr, b) == r2t[r, :L].tolist()  # slots
        else:
            assert used_blocks(bsr, b) == pages[r, : ceil_div(L, P)].tolist()
            slots = [p * P + o for p in used_blocks(bsr, b) for o in range(P)][:L]
            assert slots == r2t[r, :L].tolist()
    if P == 1:
        assert bsr.kv_indices.untyped_storage().data_ptr() == r2t.untyped_storage().data_ptr()
        assert torch.equal(bsr.kv_block_start, idx * max_len)
    else:
        # A used slot moved to another page's offset is not page-aligned; junk past seq_len is ignored.
        b = int(torch.argmax(seq_lens))
        r, tok = int(idx[b]), rint(gen, 0, int(seq_lens[b]) - 1)
        bad = r2t.clone()
        bad[r, tok] += (tok + 1) % P - tok % P  # same page, wrong offset
        with pytest.raises(ValueError, match="req_to_token"):
            from_token_table(bad, idx, seq_lens, qo_indptr, page_size=P)
        assert from_token_table(bad, idx, seq_lens, qo_indptr, page_size=P, check=False).kv_lens.shape == (B,)


def test_from_token_table_strided_pool(gen):
    r2t, idx, seq_lens, _, _ = make_token_table(gen, 4, 40, 1, 400, True)
    buf = torch.full((r2t.shape[0], 56), -JUNK, dtype=I32)
    buf[:, :40] = r2t
    bsr = from_token_table(buf[:, :40], idx, seq_lens)
    assert torch.equal(bsr.kv_block_start, idx * 56)
    for b in range(4):
        assert used_blocks(bsr, b) == r2t[int(idx[b]), : int(seq_lens[b])].tolist()


def test_ragged_and_from_ragged(gen):
    B = rint(gen, 1, 8)
    kv_lens = randint(gen, 0, 30, (B,))
    q_lens = torch.minimum(randint(gen, 0, 6, (B,)), kv_lens)
    kv, qo = Ragged.from_lens(kv_lens), Ragged.from_lens(q_lens.to(I32))
    assert kv.indptr.dtype == I32 and kv.batch_size == B and kv.total == int(kv_lens.sum())
    assert torch.equal(kv.lens.to(I64), kv_lens) and int(kv.indptr[0]) == 0
    bsr = from_ragged(kv, qo)
    assert bsr.block_width == 1 and bsr.num_kv_blocks == kv.total
    assert torch.equal(bsr.kv_indices, torch.arange(kv.total, dtype=I32))
    assert bsr.kv_block_start.data_ptr() == kv.indptr.data_ptr()  # a view of the indptr
    assert torch.equal(bsr.kv_lens.to(I64), kv_lens)
    assert torch.equal(from_ragged(kv).qo_indptr, torch.arange(B + 1, dtype=I32))

    q = torch.randn(qo.total, HQ, D, generator=gen)
    k = torch.randn(kv.total, HKV, D, generator=gen)
    v = torch.randn(kv.total, HKV, D, generator=gen)
    o, lse = attention_bsr(q, k.unsqueeze(1), v.unsqueeze(1), bsr, causal=True)
    o_ref, lse_ref = batch_attention(q, qo.indptr, k, v, kv.indptr, causal=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="kv_indptr"):
        from_ragged(torch.tensor([0, 5, 3]))
    # contiguous: readers may take rows kv_block_start .. directly, so validate() checks kv_indices is the identity
    assert bsr.contiguous and not from_token_table(
        torch.arange(64, dtype=I32).view(2, 32), torch.tensor([0, 1]), torch.tensor([3, 5])).contiguous
    if kv.total > 1:  # every entry names another row
        with pytest.raises(ValueError, match="contiguous"):
            dataclasses.replace(bsr, kv_indices=(bsr.kv_indices + 1) % kv.total).validate()
    with pytest.raises(ValueError, match="block_width 1"):
        dataclasses.replace(bsr, block_width=2, kv_indices=torch.arange(2 * kv.total, dtype=I32)).validate()


# ---------------------------------------------------------------------------------------- validation


def _valid(gen):
    """A valid 4-request BSR (16-token pages): row blocks 0 and 3 use 3 of their 4 entries."""
    num_pages = 16 + rint(gen, 0, 8)
    table = torch.randperm(num_pages, generator=gen)[:16].view(4, 4).to(I32)
    seq_lens = randint(gen, 1, 64, (4,)).to(I32)
    seq_lens[0] = seq_lens[3] = 40
    qsl = torch.tensor([0, 1, 3, 3, 5], dtype=I32)
    return from_block_table(table, seq_lens, qsl, 16, num_kv_blocks=num_pages), num_pages


def _set(t, i, x):
    t = t.clone()
    t[i] = x
    return t


# (what is wrong, how to break a valid BSR, error type, field named in the message, accepted value named)
VALIDATION_CASES = [
    ("page id out of range", lambda b, n: b.kv_indices.__setitem__(1, n), ValueError, "kv_indices", "num_kv_blocks"),
    ("negative page id", lambda b, n: b.kv_indices.__setitem__(2, -1), ValueError, "kv_indices", "[0,"),
    ("non-monotone qo_indptr", lambda b, n: setattr(b, "qo_indptr", _set(b.qo_indptr, 2, 0)), ValueError, "qo_indptr", "non-decreasing"),
    ("qo_indptr not from 0", lambda b, n: setattr(b, "qo_indptr", b.qo_indptr + 1), ValueError, "qo_indptr", "start at 0"),
    ("kv_lens int64", lambda b, n: setattr(b, "kv_lens", b.kv_lens.to(I64)), TypeError, "kv_lens", "int32"),
    ("kv_indices int64", lambda b, n: setattr(b, "kv_indices", b.kv_indices.to(I64)), TypeError, "kv_indices", "int32"),
    ("kv_block_start float", lambda b, n: setattr(b, "kv_block_start", b.kv_block_start.float()), TypeError, "kv_block_start", "int64"),
    ("qo_indptr numpy", lambda b, n: setattr(b, "qo_indptr", b.qo_indptr.numpy()), TypeError, "qo_indptr", "int32"),
    ("kv_lens wrong length", lambda b, n: setattr(b, "kv_lens", b.kv_lens[:-1]), ValueError, "kv_lens", "[4]"),
    ("kv_block_start 2-D", lambda b, n: setattr(b, "kv_block_start", b.kv_block_start[None]), ValueError, "kv_block_start", "1-D"),
    ("qo_rows wrong length", lambda b, n: setattr(b, "qo_rows", torch.arange(4, dtype=I32)), ValueError, "qo_rows", "[5]"),
    ("kv_pos_start wrong length", lambda b, n: setattr(b, "kv_pos_start", torch.zeros(5, dtype=I32)), ValueError, "kv_pos_start", "[4]"),
    ("negative kv_lens", lambda b, n: setattr(b, "kv_lens", _set(b.kv_lens, 1, -3)), ValueError, "kv_lens", ">= 0"),
    ("block_width 0", lambda b, n: setattr(b, "block_width", 0), ValueError, "block_width", ">= 1"),
    ("block_width float", lambda b, n: setattr(b, "block_width", 16.0), TypeError, "block_width", "int"),
    ("entries past kv_indices", lambda b, n: setattr(b, "kv_block_start", _set(b.kv_block_start, 3, b.kv_indices.numel() - 1)), ValueError, "kv_block_start", "kv_indices"),
    ("negative kv_pos_start", lambda b, n: setattr(b, "kv_pos_start", torch.tensor([0, -1, 0, 0], dtype=I32)), ValueError, "kv_pos_start", ">= 0"),
    ("qo_rows negative", lambda b, n: setattr(b, "qo_rows", torch.tensor([0, 1, -2, 3, 4], dtype=I32)), ValueError, "qo_rows", ">= 0"),
]


@pytest.mark.parametrize("case", VALIDATION_CASES, ids=[c[0] for c in VALIDATION_CASES])
def test_validate_rejects(gen, case):
    _, breaker, exc, field, accepted = case
    bsr, num_pages = _valid(gen)
    breaker(bsr, num_pages)
    with pytest.raises(exc) as err:
        bsr.validate()
    assert field in str(err.value) and accepted in str(err.value), str(err.value)


def test_validate_checks_only_used_entries(gen):
    bsr, num_pages = _valid(gen)
    bsr.kv_indices[3] = num_pages + 5  # row block 0's fourth entry: past its 40 tokens
    bsr.validate()
    with pytest.raises(ValueError, match="qo_rows"):
        BSR(bsr.qo_indptr, bsr.kv_indices, bsr.kv_block_start, bsr.kv_lens, 16, None,
            qo_rows=torch.arange(5, dtype=I32)).validate(num_q_rows=4)


def test_builders_reject(gen):
    table, seq_lens, qsl, _ = make_block_table(gen, 3, 2, 16, min_len=1)
    with pytest.raises(ValueError, match="seq_lens.*block_table"):
        from_block_table(table, _set(seq_lens, 1, 33), qsl, 16)
    with pytest.raises(TypeError, match="block_table.*int32"):
        from_block_table(table.to(I64), seq_lens, qsl, 16)
    with pytest.raises(TypeError, match="seq_lens"):
        from_block_table(table, seq_lens.float(), qsl, 16)
    with pytest.raises(ValueError, match="query_start_loc"):
        from_block_table(table, seq_lens, qsl[:-1], 16)
    with pytest.raises(ValueError, match="block_size"):
        from_block_table(table, seq_lens, qsl, 0)
    with pytest.raises(ValueError, match="kv_indices"):
        from_block_table(table, seq_lens, qsl, 16, num_kv_blocks=1)
    r2t, idx, lens, _, _ = make_token_table(gen, 3, 40, 1, 400, True)
    with pytest.raises(ValueError, match="seq_lens.*req_to_token"):
        from_token_table(r2t, idx, _set(lens, 0, 41))
    with pytest.raises(ValueError, match="req_pool_indices"):
        from_token_table(r2t, _set(idx, 1, r2t.shape[0]), lens)
    with pytest.raises(ValueError, match="qo_indptr"):
        from_token_table(r2t, idx, lens, qo_indptr=torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="num_kv_slots"):
        from_token_table(r2t, idx, lens, page_size=16, num_kv_slots=100)


# --------------------------------------------------------------------------------------- dense masks


def block_any(mask, Br, Bc):
    """Oracle: each (Br x Bc) tile that holds a True becomes all True (clipped to the mask's shape)."""
    Lq, Lkv = mask.shape
    out = torch.zeros_like(mask)
    for r0 in range(0, Lq, Br):
        for c0 in range(0, Lkv, Bc):
            if mask[r0 : r0 + Br, c0 : c0 + Bc].any():
                out[r0 : r0 + Br, c0 : c0 + Bc] = True
    return out


@pytest.mark.parametrize("Br,Bc", [(1, 1), (4, 16), (3, 5), (16, 1)])
def test_dense_mask_roundtrip(gen, Br, Bc):
    Lq, Lkv = rint(gen, 1, 40), rint(gen, 1, 70)
    mask = torch.rand(Lq, Lkv, generator=gen) < torch.rand((), generator=gen) * 0.3
    bsr = from_dense_mask(mask, Br, Bc)
    assert bsr.num_row_blocks == ceil_div(Lq, Br) and bsr.num_kv_blocks == ceil_div(Lkv, Bc)
    slots = ceil_div(Lkv, Bc) * Bc
    dense = to_dense_mask(bsr, slots, num_q_rows=Lq)
    assert dense.shape == (Lq, slots) and not dense[:, Lkv:].any()  # padding past num_kv is never read
    dense = dense[:, :Lkv]
    assert (dense | ~mask).all()  # covers the mask
    assert torch.equal(dense, block_any(mask, Br, Bc))  # and is exactly its block closure

    # A block-aligned mask (constant on every tile) comes back unchanged.
    nrb, ncb = ceil_div(Lq, Br), ceil_div(Lkv, Bc)
    tiles = torch.rand(nrb, ncb, generator=gen) < 0.4
    aligned = tiles.repeat_interleave(Br, 0).repeat_interleave(Bc, 1)[:Lq, :Lkv]
    assert torch.equal(to_dense_mask(from_dense_mask(aligned, Br, Bc), slots, num_q_rows=Lq)[:, :Lkv], aligned)


def random_paged_bsr(gen, block_size, with_rows=True):
    """A per-request BSR over a random page table, optionally with permuted query rows and positions."""
    n, max_blocks = rint(gen, 1, 6), rint(gen, 1, 4)
    table, seq_lens, qsl, num_pages = make_block_table(gen, n, max_blocks, block_size, min_len=1)
    bsr = from_block_table(table, seq_lens, qsl, block_size, num_kv_blocks=num_pages)
    if with_rows:
        bsr.qo_rows = torch.randperm(int(qsl[-1]), generator=gen).to(I32)
        bsr.kv_pos_start = randint(gen, 0, 50, (n,)).to(I32)
        bsr.validate()
    return bsr, num_pages


@pytest.mark.parametrize("block_size", [1, 16])
def test_to_dense_mask_exact(gen, block_size):
    bsr, num_pages = random_paged_bsr(gen, block_size)
    slots = num_pages * block_size
    expected = torch.zeros(bsr.num_q_rows, slots, dtype=torch.bool)
    for i in range(bsr.num_row_blocks):
        L = int(bsr.kv_lens[i])
        toks = [p * block_size + o for p in used_blocks(bsr, i) for o in range(block_size)][:L]
        for r in rows_of(bsr, i):
            expected[r, toks] = True
    assert torch.equal(to_dense_mask(bsr, slots), expected)
    with pytest.raises(ValueError, match="num_kv_slots"):
        top = max(b for i in range(bsr.num_row_blocks) for b in used_blocks(bsr, i))
        to_dense_mask(bsr, top * block_size)  # cuts off the highest used block


def test_query_positions(gen):
    bsr, _ = random_paged_bsr(gen, 16)
    pos = query_positions(bsr)
    assert pos.dtype == I32 and pos.shape == (bsr.num_q_rows,)
    for i in range(bsr.num_row_blocks):
        rows = rows_of(bsr, i)
        for j, r in enumerate(rows):
            assert int(pos[r]) == int(bsr.kv_pos_start[i]) + int(bsr.kv_lens[i]) - len(rows) + j


# -------------------------------------------------------------------------- equivalence (a): masks


def _random_cache(gen, num_blocks, Bc):
    k = torch.randn(num_blocks, Bc, HKV, D, generator=gen)
    v = torch.randn(num_blocks, Bc, HKV, D, generator=gen)
    return k, v


def _dense_masked(q, k_cache, v_cache, bsr, dense):
    """attention() per row block over the whole cache flattened to slots, masked by `dense`."""
    k = k_cache.reshape(-1, HKV, D)
    v = v_cache.reshape(-1, HKV, D)
    o = torch.zeros(q.shape[0], HQ, D, dtype=torch.float64)
    lse = torch.full((q.shape[0], HQ), float("-inf"), dtype=torch.float64)
    for i in range(bsr.num_row_blocks):
        rows = torch.tensor(rows_of(bsr, i), dtype=I64)
        if rows.numel():
            o[rows], lse[rows] = attention(q[rows], k, v, mask=dense[rows])
    return o, lse


@pytest.mark.parametrize("Br,Bc", [(1, 1), (4, 16), (3, 8)])
def test_bsr_attention_equals_dense_masked_attention(gen, Br, Bc):
    Lq, Lkv = rint(gen, 1, 24), rint(gen, 1, 80)
    mask = torch.rand(Lq, Lkv, generator=gen) < 0.15
    mask[torch.arange(Lq), randint(gen, 0, Lkv - 1, (Lq,))] = True  # no empty row
    bsr = from_dense_mask(mask, Br, Bc)
    k_cache, v_cache = _random_cache(gen, bsr.num_kv_blocks, Bc)
    q = torch.randn(Lq, HQ, D, generator=gen)
    dense = to_dense_mask(bsr, bsr.num_kv_blocks * Bc, num_q_rows=Lq)
    o, lse = attention_bsr(q, k_cache, v_cache, bsr)
    o_ref, lse_ref = _dense_masked(q, k_cache, v_cache, bsr, dense)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_bsr_attention_equals_dense_masked_attention(gen, block_size):
    bsr, num_pages = random_paged_bsr(gen, block_size)  # every row block reads >= 1 token: no empty row
    k_cache, v_cache = _random_cache(gen, num_pages, block_size)
    q = torch.randn(bsr.num_q_rows, HQ, D, generator=gen)
    dense = to_dense_mask(bsr, num_pages * block_size)
    o, lse = attention_bsr(q, k_cache, v_cache, bsr)
    o_ref, lse_ref = _dense_masked(q, k_cache, v_cache, bsr, dense)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------- equivalence (b): shared prefix


def shared_prefix_batch(gen, P):
    """Requests whose KV really shares leading pages, shuffled, with what the split should find.

    Groups (tag: members, shared pages, expected prefix pages):
      A  parallel-sampling decode: 3 members share S_a pages, q_len 1          -> S_a
      B  chunked prefill: 2 members share S_b pages; one queries into them     -> its cap, < S_b
      C  2 members share 1 page but query everything after it (cap 0)          -> dropped
      D  radix hit: 3 share 2 pages, two of them share 2 more                 -> 2 (the common run)
      E  a single member                                                       -> dropped (min_group_size)
      -  2 requests sharing nothing
    """
    scale = 6 if P == 1 else 1
    fresh = iter(torch.randperm(4096, generator=gen).tolist())
    new = lambda n: [next(fresh) for _ in range(n)]  # noqa: E731
    reqs = []  # dict(blocks, kv_len, q_len, tag)

    def add(shared, own_tokens, q_len, tag):
        reqs.append(dict(blocks=shared + new(ceil_div(own_tokens, P)), kv_len=len(shared) * P + own_tokens,
                         q_len=q_len, tag=tag))

    S_a = rint(gen, 2, 4) * scale
    shared = new(S_a)
    for _ in range(3):
        add(shared, rint(gen, 1, 2 * P + 1), 1, "A")
    S_b = rint(gen, 3, 5) * scale
    shared = new(S_b)
    own = rint(gen, 1, 2 * P)
    add(shared, own, own, "B")
    back = P + rint(gen, 0, P - 1)  # the second member also queries the last 1-2 shared pages' tokens
    add(shared, own, own + back, "B")
    cap_b = (S_b * P - back) // P
    shared = new(1)
    for _ in range(2):
        own = rint(gen, 1, P + 1)
        add(shared, own, own + rint(gen, 1, P), "C")  # kv_len - q_len < P
    common, more = new(2 * scale), new(2 * scale)
    add(common + more, rint(gen, 1, P), rint(gen, 1, 2), "D")
    add(common + more, rint(gen, 1, P), 1, "D")
    add(common, rint(gen, 1, P), 1, "D")
    add(new(2), rint(gen, 1, P), 1, "E")
    for _ in range(2):
        kv = rint(gen, 1, 3 * P)
        add([], kv, rint(gen, 1, kv), "-")
    for r in reqs:
        r["q_len"] = min(r["q_len"], r["kv_len"])
    order = torch.randperm(len(reqs), generator=gen).tolist()
    reqs = [reqs[i] for i in order]
    expected = {"A": S_a, "B": cap_b, "D": 2 * scale}
    claimed = {"A": S_a * P + rint(gen, 0, P - 1), "B": S_b * P, "C": P, "D": 2 * scale * P + rint(gen, 0, P - 1),
               "E": 2 * P}
    return reqs, expected, claimed


def build_bsr(gen, reqs, P, num_pages):
    """The batch as vLLM (P > 1, block table) or SGLang (P = 1, token table) would hand it over."""
    max_blocks = max(len(r["blocks"]) for r in reqs) + 2
    table = torch.full((len(reqs), max_blocks), JUNK, dtype=I32)
    for i, r in enumerate(reqs):
        table[i, : len(r["blocks"])] = torch.tensor(r["blocks"], dtype=I32)
    kv_lens = torch.tensor([r["kv_len"] for r in reqs], dtype=I32)
    q_lens = torch.tensor([r["q_len"] for r in reqs], dtype=I64)
    qo_indptr = torch.cat((torch.zeros(1, dtype=I64), torch.cumsum(q_lens, 0))).to(I32)
    if P > 1:
        return from_block_table(table, kv_lens, qo_indptr, P, num_kv_blocks=num_pages)
    pool = torch.full((len(reqs) + 3, max_blocks), JUNK, dtype=I32)
    pool_idx = torch.randperm(pool.shape[0], generator=gen)[: len(reqs)]
    pool[pool_idx] = table
    return from_token_table(pool, pool_idx, kv_lens.to(I64), qo_indptr, num_kv_slots=num_pages)


VARIANTS = {
    "causal": dict(causal=True),
    "causal+window+alibi+softcap": dict(causal=True, window_left=37, logits_soft_cap=8.0,
                                        alibi_slopes=alibi_slopes(HQ)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["detected", "explicit"])
@pytest.mark.parametrize("P", [1, 16])
def test_shared_prefix_split_merges_to_single_bsr(gen, P, mode, variant):
    num_pages = 4096
    reqs, expected, claimed = shared_prefix_batch(gen, P)
    bsr = build_bsr(gen, reqs, P, num_pages)
    tags = [r["tag"] for r in reqs]
    if mode == "explicit":
        names = sorted(set(tags) - {"-"})
        group_ids = torch.tensor([names.index(t) if t in names else -1 for t in tags], dtype=I64)
        prefix_lens = torch.tensor([claimed[t] for t in names], dtype=I64)
        prefix, suffix = split_shared_prefix(bsr, (group_ids, prefix_lens))
    else:
        prefix, suffix = split_shared_prefix(bsr)

    # Structure: one prefix row block per kept group, covering all its members' rows, Br > 1.
    row_tag = {}
    for i, t in enumerate(tags):
        row_tag.update({r: t for r in rows_of(bsr, i)})
    found = {}
    for g in range(prefix.num_row_blocks):
        members = {row_tag[r] for r in rows_of(prefix, g)}
        assert len(members) == 1
        (t,) = members
        assert rows_of(prefix, g) == sorted(r for i, tg in enumerate(tags) if tg == t for r in rows_of(bsr, i))
        assert len(rows_of(prefix, g)) > 1
        found[t] = int(prefix.kv_lens[g])
        assert int(prefix.kv_pos_start[g]) == 0
    assert found == {t: n * P for t, n in expected.items()}
    # Suffix: same rows, KV advanced past the prefix, every row still sees its whole request.
    assert torch.equal(suffix.qo_indptr, bsr.qo_indptr) and suffix.kv_indices is bsr.kv_indices
    pre = torch.tensor([found.get(t, 0) for t in tags], dtype=I32)
    assert torch.equal(suffix.kv_lens + pre, bsr.kv_lens) and torch.equal(suffix.kv_pos_start, pre)
    assert ((bsr.kv_lens - bsr.qo_lens) >= pre).all()  # prefix cached before this step's queries
    for i, r in enumerate(reqs):
        n = int(pre[i]) // P
        assert used_blocks(suffix, i) == r["blocks"][n:]

    # Numerics: prefix state merged with suffix state == the single BSR's state.
    k_cache, v_cache = _random_cache(gen, num_pages, P)
    q = torch.randn(bsr.num_q_rows, HQ, D, generator=gen)
    q_pos = query_positions(bsr)
    kw = VARIANTS[variant]
    o_ref, lse_ref = attention_bsr(q, k_cache, v_cache, bsr, q_pos=q_pos, **kw)
    o_p, lse_p = attention_bsr(q, k_cache, v_cache, prefix, q_pos=q_pos, **kw)
    o_s, lse_s = attention_bsr(q, k_cache, v_cache, suffix, q_pos=q_pos, **kw)
    o, lse = merge_state(o_p, lse_p, o_s, lse_s)
    assert torch.isfinite(lse_p).sum() > 0  # the prefix matrix did real work
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-10)


def test_shared_prefix_groups_detection(gen):
    reqs, expected, _ = shared_prefix_batch(gen, 16)
    bsr = build_bsr(gen, reqs, 16, 4096)
    group_ids, prefix_lens = shared_prefix_groups(bsr)
    assert group_ids.dtype == I32 and prefix_lens.dtype == I32
    got = {}
    for i, r in enumerate(reqs):
        g = int(group_ids[i])
        if r["tag"] in expected:
            got.setdefault(r["tag"], set()).add(g)
        else:
            assert g == -1, r["tag"]
    assert all(len(s) == 1 for s in got.values()) and len({next(iter(s)) for s in got.values()}) == len(got)
    assert {t: int(prefix_lens[next(iter(s))]) for t, s in got.items()} == {t: n * 16 for t, n in expected.items()}
    # Detected groups passed back explicitly give the same split.
    a = split_shared_prefix(bsr)
    b = split_shared_prefix(bsr, (group_ids, prefix_lens))
    assert_same_bsr(a[0], b[0])
    assert_same_bsr(a[1], b[1])


def test_split_shared_prefix_rejects_false_claims_and_respects_min_group_size(gen):
    P = 16
    shared, pages = [0, 1, 2], iter(range(3, 100))
    reqs = [dict(blocks=shared + [next(pages)], kv_len=3 * P + 5, q_len=1, tag="A") for _ in range(3)]
    reqs[2]["blocks"][2] = next(pages)  # member 2 shares only 2 pages
    bsr = build_bsr(gen, reqs, P, 100)
    ids = torch.zeros(3, dtype=I64)
    with pytest.raises(ValueError, match="groups"):
        split_shared_prefix(bsr, (ids, torch.tensor([3 * P])))
    prefix, _ = split_shared_prefix(bsr, (ids, torch.tensor([2 * P + 7])))
    assert prefix.kv_lens.tolist() == [2 * P] and prefix.qo_lens.tolist() == [3]
    with pytest.raises(ValueError, match="group_ids"):
        split_shared_prefix(bsr, (torch.tensor([0, 0, 2]), torch.tensor([P])))
    assert split_shared_prefix(bsr, min_group_size=4)[0].num_row_blocks == 0
    # min_group_size=1: every request that cached a block groups with its peers or alone.
    prefix, suffix = split_shared_prefix(bsr, (torch.tensor([0, 1, -1]), torch.tensor([P, 3 * P])), min_group_size=1)
    assert prefix.kv_lens.tolist() == [P, 3 * P] and suffix.kv_lens.tolist() == [2 * P + 5, 5, 3 * P + 5]


# --------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_builders_on_cuda_match_cpu(gen):
    cuda = torch.device("cuda")
    table, seq_lens, qsl, num_pages = make_block_table(gen, 6, 5, 16, row_pad=3)
    table_gpu = torch.full((6, 8), -JUNK, dtype=I32, device=cuda)[:, :5]  # the same strided layout
    table_gpu.copy_(table)
    cpu = from_block_table(table, seq_lens, qsl, 16, num_kv_blocks=num_pages)
    gpu = from_block_table(table_gpu, seq_lens.cuda(), qsl.cuda(), 16, num_kv_blocks=num_pages)
    assert gpu.kv_indices.untyped_storage().data_ptr() == table_gpu.untyped_storage().data_ptr()
    assert gpu.kv_indices.is_cuda and gpu.kv_block_start.is_cuda
    assert_same_bsr(cpu, gpu)
    assert_same_bsr(cpu.to(cuda), gpu)
    assert torch.equal(query_positions(cpu), query_positions(gpu).cpu())
    assert torch.equal(to_dense_mask(cpu, num_pages * 16), to_dense_mask(gpu, num_pages * 16).cpu())
    for P in (1, 16):
        r2t, idx, lens, qo, _ = make_token_table(gen, 5, 70, P, 64 * ceil_div(70, P), False)
        args = dict(page_size=P, num_kv_slots=64 * ceil_div(70, P) * P)
        assert_same_bsr(from_token_table(r2t, idx, lens, qo, **args),
                        from_token_table(r2t.cuda(), idx.cuda(), lens.cuda(), qo.cuda(), **args))
    kv = Ragged.from_lens(randint(gen, 0, 9, (7,)))
    assert_same_bsr(from_ragged(kv), from_ragged(kv.to(cuda)))
    mask = torch.rand(33, 50, generator=gen) < 0.2
    assert_same_bsr(from_dense_mask(mask, 4, 16), from_dense_mask(mask.cuda(), 4, 16))
    for P in (1, 16):
        reqs, _, claimed = shared_prefix_batch(gen, P)
        bsr = build_bsr(gen, reqs, P, 4096)
        for a, b in zip(split_shared_prefix(bsr), split_shared_prefix(bsr.to(cuda))):
            assert_same_bsr(a, b)
        ids, lens = shared_prefix_groups(bsr)
        for a, b in zip(split_shared_prefix(bsr, (ids, lens)), split_shared_prefix(bsr.to(cuda), (ids.cuda(), lens.cuda()))):
            assert_same_bsr(a, b)
