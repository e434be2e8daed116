"""append_paged_kv_cache (the KV write path) against fi_backend.reference on the GPU.

Caches are poisoned with 0xFF bytes (NaN in bf16, fp16 and both fp8 formats) and compared with the
reference bit for bit, whole: written entries must be exact (a copy, or the same fp32 divide and
round-to-nearest-even fp8 conversion) and every other entry must still hold the poison. Modules are
built on first use, or found in a shipped cache (FI_BACKEND_CUDA_ARCH_LIST=90a fi-backend build append).
"""
import pytest
import torch

from fi_backend import ops, reference

pytestmark = pytest.mark.gpu

BF16, FP16, E4M3, E5M2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
LAYOUTS = ["packed_NHD", "packed_HND", "pair_NHD", "pair_HND", "slots"]


def _poisoned(shape, dtype):
    return torch.full(shape, 0xFF, dtype=torch.uint8, device="cuda").view(dtype) if dtype.itemsize == 1 else \
        torch.full(shape, -1, dtype=torch.int16, device="cuda").view(dtype)


def _cache(kind, nb, page, heads, D, dtype):
    """(kv_cache, kv_layout) in one of the accepted layouts, poisoned."""
    if kind == "packed_NHD":
        return _poisoned((nb, page, heads, 2 * D), dtype), "NHD"
    if kind == "packed_HND":
        return _poisoned((nb, heads, page, 2 * D), dtype), "HND"
    if kind == "pair_NHD":  # FlashInfer's 5-D [blocks, 2, page, heads, D]: K and V are strided views
        kv = _poisoned((nb, 2, page, heads, D), dtype)
        return (kv[:, 0], kv[:, 1]), "NHD"
    if kind == "pair_HND":
        return (_poisoned((nb, heads, page, D), dtype), _poisoned((nb, heads, page, D), dtype)), "HND"
    assert kind == "slots" and page == 1  # SGLang's k_buffer / v_buffer
    return (_poisoned((nb, heads, D), dtype), _poisoned((nb, heads, D), dtype)), "NHD"


def _bits(t):
    return t.contiguous().view(torch.uint8)


def assert_cache_equal(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for name, g, w in zip(("k", "v"), got, want):
        bad = _bits(g) != _bits(w)
        assert not bad.any(), f"{name}: {int(bad.sum())} bytes differ from the reference (first at " \
                              f"{torch.nonzero(bad)[0].tolist()})"


def _clone(cache):
    return cache.clone() if isinstance(cache, torch.Tensor) else tuple(t.clone() for t in cache)


def _kv(T, H, D, dtype, *, fused=False, magnitude=1.0):
    """key, value [T, H, D]; fused=True: slices of a fused QKV projection output (strided rows)."""
    if fused:
        Hq = 2 * H
        qkv = (torch.randn(T, (Hq + 2 * H) * D, device="cuda") * magnitude).to(dtype)
        return qkv[:, Hq * D:(Hq + H) * D].view(T, H, D), qkv[:, (Hq + H) * D:].view(T, H, D)
    return ((torch.randn(T, H, D, device="cuda") * magnitude).to(dtype),
            (torch.randn(T, H, D, device="cuda") * magnitude).to(dtype))


def _slots(n, capacity, *, pad=0, dtype=torch.int64):
    """n distinct slots of [0, capacity) (fresh random), `pad` of them replaced by -1."""
    s = torch.randperm(capacity, device="cuda")[:n]
    if pad:
        s[torch.randperm(n, device="cuda")[:pad]] = -1
    return s.to(dtype)


def _run(kind, page, D, dtype, cache_dtype, *, H=4, T=37, n=None, fused=False, pad=3, slot_dtype=torch.int64,
         k_scale=None, v_scale=None, magnitude=1.0, nb=None):
    n = T if n is None else n
    nb = nb or max(2, -(-2 * T // page))
    cache, layout = _cache(kind, nb, page, H, D, cache_dtype)
    key, value = _kv(T, H, D, dtype, fused=fused, magnitude=magnitude)
    slots = _slots(n, nb * page, pad=min(pad, n), dtype=slot_dtype)
    want = reference.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=k_scale,
                                           v_scale=v_scale)
    ops.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=k_scale, v_scale=v_scale)
    ops.check_append_errors()
    assert_cache_equal(cache, want)
    return cache


# ----------------------------------------------------------------------------- copies

@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("page", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_layouts_pages_head_dims(kind, page, head_dim):
    if kind == "slots" and page != 1:
        pytest.skip("3-D [slots, heads, D] caches have page size 1")
    _run(kind, page, head_dim, BF16, BF16)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("kind", ["packed_NHD", "pair_HND", "slots"])
@pytest.mark.parametrize("T", [1, 5, 3000])  # one block per token .. several tokens per block
def test_dtypes_and_token_counts(dtype, kind, T):
    _run(kind, 1 if kind == "slots" else 16, 128, dtype, dtype, T=T, pad=T // 10)


@pytest.mark.parametrize("H", [1, 2, 8, 32])
@pytest.mark.parametrize("head_dim", [8, 72, 512])
def test_heads_and_unusual_head_dims(H, head_dim):
    _run("packed_HND", 16, head_dim, FP16, FP16, H=H, T=70)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_strided_key_value_int32_slots_and_rows_past_n(kind):
    """Slices of a fused QKV output; int32 slots; slot_mapping shorter than key (rows past n unread)."""
    _run(kind, 1 if kind == "slots" else 16, 128, BF16, BF16, T=50, n=41, fused=True, slot_dtype=torch.int32)


def test_only_padding_and_empty_slot_mapping():
    cache, layout = _cache("packed_NHD", 4, 16, 2, 64, BF16)
    key, value = _kv(8, 2, 64, BF16)
    before = _clone(cache)
    ops.append_paged_kv_cache(key, value, cache, torch.full((8,), -1, device="cuda"), kv_layout=layout)
    ops.append_paged_kv_cache(key, value, cache, torch.empty(0, dtype=torch.int32, device="cuda"), kv_layout=layout)
    ops.check_append_errors()
    assert_cache_equal(cache, before)


# ----------------------------------------------------------------------------- fp8

@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("scales", ["none", "float", "tensor"])
def test_fp8(dtype, cache_dtype, kind, scales):
    """Magnitudes up to ~400 / scale 0.05: many values saturate; small ones land in subnormals."""
    if scales == "none":
        k_scale = v_scale = None
    elif scales == "float":
        k_scale, v_scale = 0.05, 3.3
    else:
        k_scale = torch.tensor([0.05], device="cuda")
        v_scale = torch.tensor([0.37], device="cuda")
    _run(kind, 1 if kind == "slots" else 16, 128, dtype, cache_dtype, k_scale=k_scale, v_scale=v_scale,
         magnitude=100.0, fused=kind == "pair_NHD", T=200, pad=20)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("page", [1, 32])
def test_fp8_head_dims_and_pages(head_dim, page):
    _run("packed_NHD", page, head_dim, BF16, E4M3, k_scale=0.5, v_scale=2.0)


def test_no_host_sync_and_scale_tensor_read_on_the_device():
    """The op returns while the stream is still busy (no sync, no .item()), and a tensor scale is read
    when the kernel runs: the fill queued before it on the stream applies."""
    scale = torch.tensor([1.0], device="cuda")
    cache, layout = _cache("packed_NHD", 4, 16, 2, 64, E4M3)
    key, value = _kv(8, 2, 64, BF16)
    slots = torch.arange(8, device="cuda")
    want = reference.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=0.25, v_scale=4.0)
    ops.append_paged_kv_cache(key, value, _clone(cache), slots, kv_layout=layout, k_scale=scale)  # warm: build
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of everything below
    scale.fill_(0.25)
    ops.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=scale, v_scale=4.0)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "append_paged_kv_cache waited for the GPU"
    ops.check_append_errors()
    assert_cache_equal(cache, want)


# ----------------------------------------------------------------------------- out-of-range slots

@pytest.mark.parametrize("kind", ["packed_HND", "slots"])
def test_out_of_range_slots_are_reported_and_skipped(kind):
    page = 1 if kind == "slots" else 16
    nb, H, D, T = 6 if page == 16 else 96, 2, 128, 40  # at least T slots
    cache, layout = _cache(kind, nb, page, H, D, BF16)
    key, value = _kv(T, H, D, BF16)
    slots = _slots(T, nb * page, pad=4)
    bad = torch.tensor([0, 7, 19], device="cuda")
    slots[bad] = torch.tensor([nb * page, nb * page + 5, 10**12], device="cuda")
    want = reference.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout)
    ops.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout)
    with pytest.raises(RuntimeError, match=rf"3 token\(s\).*largest {10**12}.*holds {nb * page} slots"):
        ops.check_append_errors()
    ops.check_append_errors()  # cleared
    assert_cache_equal(cache, want)  # the other tokens were written


# ----------------------------------------------------------------------------- CUDA graphs

@pytest.mark.parametrize("cache_dtype", [BF16, E4M3])
def test_cuda_graph_replay_with_new_slots_and_values(cache_dtype):
    nb, page, H, D, T = 16, 16, 4, 128, 24
    cache, layout = _cache("packed_NHD", nb, page, H, D, cache_dtype)
    key, value = _kv(T, H, D, BF16)
    slots = _slots(T, nb * page)
    k_scale = torch.tensor([0.5], device="cuda")
    ops.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=k_scale, v_scale=2.0)  # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=k_scale, v_scale=2.0)
    for step in range(3):
        cache_ref = _poisoned(cache.shape, cache_dtype)
        cache.copy_(cache_ref)
        key.copy_(torch.randn_like(key, dtype=torch.float32))
        value.copy_(torch.randn_like(value, dtype=torch.float32))
        slots.copy_(_slots(T, nb * page, pad=step))
        k_scale.fill_(0.5 + step)
        graph.replay()
        want = reference.append_paged_kv_cache(key, value, cache_ref, slots, kv_layout=layout, k_scale=k_scale,
                                               v_scale=2.0)
        ops.check_append_errors()
        assert_cache_equal(cache, want)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        with pytest.raises(RuntimeError, match="outside CUDA-graph capture"):
            ops.check_append_errors()


# ----------------------------------------------------------------------------- 64-bit offsets

def test_offsets_past_two_to_the_31_elements():
    """A 4.3 GB bf16 cache: elements past 2^31 are addressed with 64-bit offsets."""
    page, H, D = 16, 8, 128
    nb = (1 << 31) // (page * H * 2 * D) + 4
    cache = _poisoned((nb, page, H, 2 * D), BF16)
    key, value = _kv(3, H, D, BF16)
    slots = torch.tensor([(nb - 1) * page + 15, (nb - 2) * page, nb * page - page - 1], device="cuda")
    ops.append_paged_kv_cache(key, value, cache, slots)
    ops.check_append_errors()
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, page)
        assert torch.equal(cache[b, o, :, :D], key[t]) and torch.equal(cache[b, o, :, D:], value[t])
    assert torch.isnan(cache[nb - 1, 14]).all() and torch.isnan(cache[nb - 3]).all()
    del cache


# ----------------------------------------------------------------------------- errors on the GPU

def test_devices_must_agree():
    cache, layout = _cache("packed_NHD", 4, 16, 2, 64, BF16)
    key, value = _kv(8, 2, 64, BF16)
    with pytest.raises(ValueError, match="slot_mapping must be on"):
        ops.append_paged_kv_cache(key, value, cache, torch.arange(8), kv_layout=layout)
    with pytest.raises(ValueError, match="value must be on"):
        ops.append_paged_kv_cache(key, value.cpu(), cache, torch.arange(8, device="cuda"), kv_layout=layout)
    with pytest.raises(ValueError, match="kv_cache must be on"):
        ops.append_paged_kv_cache(key, value, cache.cpu(), torch.arange(8, device="cuda"), kv_layout=layout)
    fp8, _ = _cache("packed_NHD", 4, 16, 2, 64, E4M3)
    with pytest.raises(ValueError, match="k_scale as a tensor"):
        ops.append_paged_kv_cache(key, value, fp8, torch.arange(8, device="cuda"), k_scale=torch.ones(1))
