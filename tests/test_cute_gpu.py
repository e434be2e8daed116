"""The CuTe probe (csrc/attention/cute/attn_ws.cu: FlashAttention-3's CTA on CUTLASS / CuTe SM90 atoms, issue 30's
CuTe member in the making, docs/prefill.md) against fi_backend.reference in float64. Needs an sm_90a GPU and
the nvidia-cutlass wheel's headers (fi_backend.kernels.cutlass); the CPU tests of the header lookup are in
test_kernels_build.py."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu


def _ws_spec(D, causal, overlap, pingpong, warpgroups, lazy=0):
    from fi_backend.kernels import cutlass
    return cutlass.attn_ws_spec(D, causal, overlap=bool(overlap), pingpong=bool(pingpong), warpgroups=warpgroups,
                                lazy=bool(lazy))


def _paged_spec(D, warpgroups, causal, page, gather):
    from fi_backend.kernels import cutlass
    return cutlass.attn_ws_spec(D, causal, overlap=True, pingpong=False, page_size=page, warpgroups=warpgroups,
                                gather=gather)


@pytest.fixture(scope="module", autouse=True)
def _built(request):
    """The probe's modules the collected tests load, built in parallel first (one at a time, lazily, they take about
    40 s each): all of them for the whole file, a few for a -k selection."""
    if importlib.util.find_spec("cutlass_library") is None or not torch.cuda.is_available():
        return
    from fi_backend import kernels
    from fi_backend.kernels import cutlass
    of = {"test_attn_ws": _ws_spec, "test_attn_ws_paged": _paged_spec}
    wanted = set()
    for item in request.session.items:
        if item.module is request.module and getattr(item, "originalname", None) in of:
            params = {k: v for k, v in item.callspec.params.items() if k != "case"}
            try:
                wanted.add(of[item.originalname](**params).memo_key)
            except ValueError:  # a combination the CTA does not build: the test skips it
                pass
    specs = [s for s in cutlass.probe_specs() if s.memo_key in wanted]  # nor those the tests skip
    failed = [(s.tag, r) for s, r in zip(specs, kernels.build_many(specs)) if isinstance(r, Exception)]
    assert not failed, f"CuTe probe modules failed to build: {failed}"


def _check_requests(o, lse, q, k, v, qo_indptr, kv_indptr, q_lens, kv_lens, causal, scale, what):
    """O and the LSE of every request against fi_backend.reference.batch_attention (float64) over ragged K / V."""
    from fi_backend import reference
    ref, ref_lse = reference.batch_attention(q, qo_indptr, k, v, kv_indptr, causal=causal, sm_scale=scale)
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        err = ((o[rows].double() - ref[rows]).abs() / (ref[rows].abs() + 1)).max().item()
        lse_err = (lse[rows].double() - ref_lse[rows]).abs().max().item()
        assert err < 2e-2 and lse_err < 1e-3, (f"{what} request {b} ({ql} / {kl}) causal={causal}: "
                                              f"O error {err}, LSE error {lse_err}")


_WS_CASES = {  # (query lengths, KV lengths, heads, KV heads)
    "1x128": ([128], [128], 4, 4),
    "3x384": ([384] * 3, [384] * 3, 8, 2),
    "2x2048": ([2048] * 2, [2048] * 2, 7, 1),  # 224 work tiles: CTAs take several, the producer runs ahead
    "varlen": ([1, 130, 257, 1000, 64, 129], [1, 300, 257, 1500, 64, 4000], 8, 2),
    # KV of 8 / 16 MB a KV head, sections of 32 MB: 4 / 2 KV heads, the last one short at head size 64 (the other
    # cases: sections of one KV head)
    "sections": ([512], [32768], 12, 6),
}


@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(_WS_CASES))
@pytest.mark.parametrize("overlap,pingpong,warpgroups,lazy", [(0, 0, 2, 0), (1, 0, 2, 0), (1, 1, 2, 0), (1, 0, 3, 0),
                                                               (1, 1, 3, 0), (1, 0, 2, 1), (1, 1, 2, 1), (1, 0, 3, 1)])
def test_attn_ws(D, causal, case, overlap, pingpong, warpgroups, lazy):
    """The warp-specialised CTA: a TMA producer warp, K and V pipelines of 2 stages, two (three: 192-row tiles, head
    size 64) consumer warpgroups, on a persistent grid; GQA by the KV head's index; ragged requests of any length (KV
    at least the query's), causal bottom-right with the masked tiles found per tile, rows past a request's end not
    stored; the intra-warpgroup overlap and the ping-pong on and off (1 x 128: one KV tile, the overlapped loop's first
    and last steps only); the lazy O rescale (a row's maximum kept until it grows by more than 2^8)."""
    pytest.importorskip("cutlass_library")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a only")
    if D in (96, 256) and (overlap, pingpong) != (1, 0) and not (D == 96 and warpgroups == 3 and overlap):
        pytest.skip("head sizes 96 (64-byte swizzle atoms) and 256 (64-token KV tiles): the member's loop only")
    if warpgroups == 3 and D not in (64, 96):
        pytest.skip("three consumer warpgroups: head sizes 64 and 96 (96-token KV tiles) only")
    from fi_backend import kernels
    from fi_backend.kernels import cutlass
    module = kernels.load(_ws_spec(D, causal, overlap, pingpong, warpgroups, lazy))
    run = module.function("fi_cute_attn_ws", cutlass.ATTN_WS_ARGS)
    q_lens, kv_lens, heads, kv_heads = _WS_CASES[case]
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total_q, total_kv, scale = int(qo_indptr[-1]), int(kv_indptr[-1]), D ** -0.5
    q = torch.randn(total_q, heads, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total_kv, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    if lazy:  # keys larger the earlier they come: the KV tiles, last first, raise the maximum by up to 8x the logits
        k *= torch.linspace(8.0, 1.0, total_kv, device="cuda", dtype=torch.bfloat16)[:, None, None]
    v = torch.randn(total_kv, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((total_q, heads), float("nan"), device="cuda", dtype=torch.float32)
    qi, ki = qo_indptr.cuda(), kv_indptr.cuda()
    counter = torch.full((1,), 12345, device="cuda", dtype=torch.int32)  # the call zeroes it
    rc = run(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), qi.data_ptr(), ki.data_ptr(),
             counter.data_ptr(), len(q_lens), max(q_lens), heads, kv_heads, total_q, total_kv,
             32 << 20 if case == "sections" else 0, scale, torch.cuda.current_stream().cuda_stream)
    assert rc == 0, f"launch failed: {rc}"
    torch.cuda.synchronize()
    _check_requests(o, lse, q, k, v, qo_indptr, kv_indptr, q_lens, kv_lens, causal, scale, f"{case} D={D}")


_PAGED_CASES = {  # (query lengths, KV lengths, heads, KV heads)
    "1x200": ([200], [200], 4, 4),
    "varlen": ([1, 130, 257, 1000, 64], [1, 300, 257, 1500, 4000], 8, 2),
}


@pytest.mark.parametrize("D,warpgroups", [(64, 2), (64, 3), (96, 2), (96, 3), (128, 2), (256, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page,gather", [(16, False), (64, False), (256, False), (1, True), (16, True), (64, True)])
@pytest.mark.parametrize("case", sorted(_PAGED_CASES))
def test_attn_ws_paged(D, warpgroups, causal, page, gather, case):
    """Paged K / V (vLLM's layout: K and V of a page in one [pages, 2, page, kv_heads, D] tensor, so each view has a
    page stride of twice its page), pages of each request in random order over a pool with pages of no request,
    through the BSR entry (fi_cute_attn_bsr): a TMA box a page and 64-dim block below 128 tokens a page, several KV
    tiles a page above; the tail of a request's last page (NaN here) and the boxes past it masked, their V zeroed;
    or (gather) rows copied by the producer warpgroup's threads, pages of one token too, rows past the KV zeros."""
    pytest.importorskip("cutlass_library")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a only")
    if D == 96 and warpgroups == 3 and page != 16 and not gather:
        pytest.skip("three warpgroups at head size 96 (96-token KV tiles): TMA pages of 16 or 32 only")
    if D == 256 and page == 64 and not gather:
        pytest.skip("head size 256: pages of 16 (several boxes a 64-token tile) and 256 (several tiles a page) only")
    from fi_backend import kernels
    from fi_backend.kernels import cutlass
    module = kernels.load(_paged_spec(D, warpgroups, causal, page, gather))
    run = module.function("fi_cute_attn_bsr", cutlass.ATTN_BSR_ARGS)
    q_lens, kv_lens, heads, kv_heads = _PAGED_CASES[case]
    gen = torch.Generator().manual_seed(page * 7 + D)
    n_pages = [(kl + page - 1) // page for kl in kv_lens]
    pool = sum(n_pages) + 5                                        # pages of no request too
    order = torch.randperm(pool, generator=gen).to(torch.int32)
    kv_page_indptr = torch.tensor([0] + n_pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_page_indices = order[:sum(n_pages)].contiguous()
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + kv_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total_q, scale = int(qo_indptr[-1]), D ** -0.5
    cache = torch.randn(pool, 2, page, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    used = torch.zeros(pool, page, dtype=torch.bool)  # slots past each request's KV hold NaN: never in the output
    for p_, kl in zip(kv_page_indices.split(n_pages), kv_lens):
        used[p_.long()] = (torch.arange(len(p_) * page) < kl).view(-1, page)
    for kv in (0, 1):
        cache[:, kv][~used.cuda()] = float("nan")
    q = torch.randn(total_q, heads, D, device="cuda", dtype=torch.bfloat16)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((total_q, heads), float("nan"), device="cuda", dtype=torch.float32)
    # the BSR: request b's KV length and its first page's entry in kv_page_indices
    qi, kl_dev, idx, start = (t.cuda() for t in (qo_indptr, torch.tensor(kv_lens, dtype=torch.int32),
                                                  kv_page_indices, kv_page_indptr[:-1].contiguous()))
    counter = torch.full((1,), 12345, device="cuda", dtype=torch.int32)
    k_view, v_view = cache[:, 0], cache[:, 1]
    rc = run(q.data_ptr(), o.data_ptr(), lse.data_ptr(), k_view.data_ptr(), v_view.data_ptr(), qi.data_ptr(),
             kl_dev.data_ptr(), idx.data_ptr(), start.data_ptr(), counter.data_ptr(), None, idx.numel(), q.stride(0),
             q.stride(1), o.stride(0), o.stride(1), lse.stride(0), *k_view.stride()[:3], *v_view.stride()[:3], pool, 0,
             len(q_lens), max(q_lens), heads, kv_heads, total_q, int(kv_indptr[-1]), 32 << 20, -1, scale, 0.0,
             torch.cuda.current_stream().cuda_stream)
    assert rc == 0, f"launch failed: {rc}"
    torch.cuda.synchronize()
    # each request's pages gathered in order: a ragged K / V for the reference
    bounds = kv_page_indptr.tolist()
    pages = [kv_page_indices[a:z].long().cuda() for a, z in zip(bounds, bounds[1:])]
    k = torch.cat([cache[p, 0].reshape(-1, kv_heads, D)[:kl] for p, kl in zip(pages, kv_lens)])
    v = torch.cat([cache[p, 1].reshape(-1, kv_heads, D)[:kl] for p, kl in zip(pages, kv_lens)])
    _check_requests(o, lse, q, k, v, qo_indptr, kv_indptr, q_lens, kv_lens, causal, scale,
                    f"{case} page {page} D={D}")
