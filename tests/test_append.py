"""append_paged_kv_cache on the CPU: the shared KV-cache parse (fi_backend.kv_cache), the reference
semantics, the op's argument checks and the launch arguments it computes (emulated here on CPU
memory), and a real nvcc build of an append module. The kernel itself: tests/test_append_gpu.py."""
import ctypes

import pytest
import torch

from fi_backend import kernels, ops, reference
from fi_backend.kernels.sets import append_spec
from fi_backend.kv_cache import PagedKV, parse_cached, parse_paged_kv_cache

BF16, FP16, E4M3, E5M2 = torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2


def _caches(kind, nb, page, heads, D, dtype):
    """A cache in one of the accepted layouts (poisoned with 0xFF bytes: NaN in every dtype here)."""
    def new(*shape):
        return torch.full(shape, 0xFF, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else \
            torch.full(shape, -1, dtype=torch.int16).view(dtype)
    if kind == "packed_NHD":
        return new(nb, page, heads, 2 * D), "NHD"
    if kind == "packed_HND":
        return new(nb, heads, page, 2 * D), "HND"
    if kind == "pair_NHD":  # FlashInfer's 5-D [blocks, 2, page, heads, D]: strided views
        kv = new(nb, 2, page, heads, D)
        return (kv[:, 0], kv[:, 1]), "NHD"
    if kind == "pair_HND":
        return (new(nb, heads, page, D), new(nb, heads, page, D)), "HND"
    assert kind == "slots" and page == 1
    return (new(nb, heads, D), new(nb, heads, D)), "NHD"


LAYOUTS = ["packed_NHD", "packed_HND", "pair_NHD", "pair_HND", "slots"]


# ----------------------------------------------------------------------------- kv_cache parse

@pytest.mark.parametrize("kind", LAYOUTS)
def test_parse_every_layout(kind):
    nb, page, H, D = 5, 1 if kind == "slots" else 16, 4, 64
    cache, layout = _caches(kind, nb, page, H, D, BF16)
    kv = parse_paged_kv_cache(cache, layout)
    assert isinstance(kv, PagedKV)
    assert (kv.num_blocks, kv.page_size, kv.num_heads, kv.head_dim, kv.dtype) == (nb, page, H, D, BF16)
    k = cache[..., :D] if isinstance(cache, torch.Tensor) else cache[0]
    v = cache[..., D:] if isinstance(cache, torch.Tensor) else cache[1]
    assert (kv.k_ptr, kv.v_ptr) == (k.data_ptr(), v.data_ptr())
    # Element (block 3, offset o, head 2, d 5) through the strides is the one the tensor indexes.
    o = page - 1
    sb, st, sh = kv.strides
    elem = 3 * sb + o * st + 2 * sh + 5
    if kind == "slots":
        want = k[3, 2, 5]
    elif layout == "NHD":
        want = k[3, o, 2, 5]
    else:
        want = k[3, 2, o, 5]
    assert want.data_ptr() == kv.k_ptr + elem * 2
    # The same parse with the expected values given.
    assert parse_paged_kv_cache(cache, layout, head_dim=D, page_size=page) == kv


@pytest.mark.parametrize("cache,layout,kwargs,error,match", [
    (torch.zeros(4, 16, 2, 129, dtype=BF16), "NHD", {}, ValueError, "packed"),
    (torch.zeros(4, 16, 2, 128, dtype=BF16), "NHD", {"head_dim": 32}, ValueError, "2\\*head_dim = 64"),
    (torch.zeros(4, 16, 2, 128, dtype=BF16), "NHD", {"page_size": 32}, ValueError, "page dimension is 16"),
    (torch.zeros(4, 16, 2, 128, dtype=BF16), "HND", {"page_size": 16}, ValueError, "page dimension is 2"),
    (torch.zeros(4, 16, 2, 128, dtype=BF16), "NDH", {}, ValueError, "'NHD' or 'HND'"),
    ((torch.zeros(4, 2, 64, dtype=BF16),) * 3, "NHD", {}, ValueError, "pair"),
    ((torch.zeros(4, 2, 64, dtype=BF16), "v"), "NHD", {}, TypeError, "torch.Tensors"),
    ((torch.zeros(4, 2, 64, dtype=BF16), torch.zeros(4, 2, 72, dtype=BF16)), "NHD", {}, ValueError, "same shape"),
    ((torch.zeros(4, 2, 64, dtype=BF16), torch.zeros(4, 2, 64, dtype=FP16)), "NHD", {}, ValueError, "same dtype"),
    ((torch.zeros(4, 2, 64, dtype=BF16),) * 2, "NHD", {"page_size": 16}, ValueError, "page_size 1"),
    ((torch.zeros(4, 2, 64, dtype=BF16),) * 2, "NHD", {"head_dim": 128}, ValueError, "head_dim is 64"),
    ((torch.zeros(2, 4, 2, 2, 64, dtype=BF16),) * 2, "NHD", {}, ValueError, "4-D"),
    ((torch.zeros(4, 2, 64, dtype=BF16).transpose(0, 2),) * 2, "NHD", {}, ValueError, "contiguous"),
    ((torch.zeros(4, 2, 68, dtype=BF16)[..., :60],) * 2, "NHD", {}, ValueError, "16-byte"),
    (torch.zeros(4, 16, 2, 2 * 72, dtype=E4M3), "NHD", {}, ValueError, "16-byte"),  # fp8 V at byte 72
    ([torch.zeros(4, 2, 64)], "NHD", {}, ValueError, "pair"),
    ("cache", "NHD", {}, TypeError, "tensor or a \\(k, v\\) pair"),
])
def test_parse_rejects(cache, layout, kwargs, error, match):
    with pytest.raises(error, match=match):
        parse_paged_kv_cache(cache, layout, **kwargs)


def test_parse_v_strides_of_its_own():
    """A step's own key / value (a ragged wrapper's): K a tensor of its own, V a view of a fused QKV buffer. Refused by
    default (every paged kernel reads V by K's strides); v_strides_free records V's."""
    qkv = torch.zeros(10, 32 + 2 * 8, 128, dtype=BF16)
    k, v = qkv[:, 32:40].contiguous().unsqueeze(1), qkv[:, 40:].unsqueeze(1)
    with pytest.raises(ValueError, match="same shape and strides"):
        parse_paged_kv_cache((k, v), "NHD")
    kv = parse_paged_kv_cache((k, v), "NHD", page_size=1, v_strides_free=True)
    assert kv.strides == (8 * 128, 8 * 128, 128) and kv.v_strides == (48 * 128, 8 * 128, 128)
    assert (kv.k_ptr, kv.v_ptr) == (k.data_ptr(), v.data_ptr())
    same = parse_paged_kv_cache((qkv[:, 32:40].unsqueeze(1), v), "NHD", v_strides_free=True)
    assert same.v_strides == same.strides
    with pytest.raises(ValueError, match="v's head_dim must be contiguous"):
        parse_paged_kv_cache((k, v.transpose(2, 3).contiguous().transpose(2, 3)), "NHD", v_strides_free=True)
    with pytest.raises(ValueError, match="16-byte"):
        parse_paged_kv_cache((k, torch.zeros(10, 1, 8, 132, dtype=BF16)[..., :128]), "NHD", v_strides_free=True)


# ----------------------------------------------------------------------------- reference

def test_reference_by_hand():
    """Tokens into a 2-block, page-2 NHD pair: slot 3 = block 1 offset 1; -1 and 99 are skipped."""
    k = torch.zeros(2, 2, 1, 8, dtype=BF16)
    key = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 1, 8).to(BF16)
    value = -key
    out = reference.append_paged_kv_cache(key, value, (k, k.clone()), torch.tensor([3, -1, 0, 2]))
    assert isinstance(out, tuple) and (k == 0).all()  # inputs untouched
    assert torch.equal(out[0][1, 1, 0], key[0, 0]) and torch.equal(out[1][1, 1, 0], value[0, 0])
    assert torch.equal(out[0][0, 0, 0], key[2, 0]) and torch.equal(out[0][1, 0, 0], key[3, 0])
    assert (out[0][0, 1] == 0).all()
    out = reference.append_paged_kv_cache(key, value, (k, k.clone()), torch.tensor([3, 99]))
    assert (out[0][1, 1] != 0).any() and int((out[0] != 0).sum()) == 7  # key[0] has one zero


@pytest.mark.parametrize("kind", LAYOUTS)
def test_reference_layouts_agree(kind):
    """Every layout stores the same (block, offset, head, d) values as an NHD pair."""
    g = torch.Generator().manual_seed(1)
    page = 1 if kind == "slots" else 4
    nb, H, D, T = 6, 3, 16, 11
    key, value = torch.randn(T, H, D, generator=g).to(FP16), torch.randn(T, H, D, generator=g).to(FP16)
    slots = torch.randperm(nb * page, generator=g)[:T - 2]
    slots[1] = -1
    cache, layout = _caches(kind, nb, page, H, D, FP16)
    out = reference.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout)
    if isinstance(out, torch.Tensor):
        out = (out[..., :D], out[..., D:])
    nhd = [t.transpose(1, 2) if layout == "HND" else (t[:, None] if t.dim() == 3 else t) for t in out]
    base = tuple(torch.full((nb, page, H, D), -1, dtype=torch.int16).view(FP16) for _ in range(2))
    want = reference.append_paged_kv_cache(key, value, base, slots)
    for got, ref in zip(nhd, want):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_reference_fp8_saturates_and_scales():
    key = torch.tensor([[[1.0, -1000.0, 3.0, float("inf"), 0.5, -0.001, 100.0, 2.0]]], dtype=BF16)
    cache = (torch.zeros(1, 1, 8, dtype=E4M3), torch.zeros(1, 1, 8, dtype=E5M2))
    k8 = reference.append_paged_kv_cache(key, key, (cache[0], cache[0].clone()), torch.tensor([0]),
                                         k_scale=0.5, v_scale=torch.tensor([2.0]))
    assert k8[0][0, 0].float().tolist() == [2.0, -448.0, 6.0, 448.0, 1.0, -0.001953125, 192.0, 4.0]
    assert k8[1][0, 0].float().tolist() == [0.5, -448.0, 1.5, 448.0, 0.25, 0.0, 48.0, 1.0]
    e5 = reference.append_paged_kv_cache(key * 100, key, (cache[1], cache[1].clone()), torch.tensor([0]))
    assert e5[0][0, 0, 1].item() == -57344.0 and e5[0][0, 0, 3].item() == 57344.0
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        reference.append_paged_kv_cache(key, key, (torch.zeros(1, 1, 8, dtype=FP16),) * 2, torch.tensor([0]))


# ----------------------------------------------------------------------------- the op's checks

def _args(kind="packed_NHD", page=16, H=4, D=64, T=8, dtype=BF16, cache_dtype=None, slots=None, **kw):
    cache, layout = _caches(kind, 8, page, H, D, cache_dtype or dtype)
    key = torch.randn(T, H, D).to(dtype)
    value = torch.randn(T, H, D).to(dtype)
    slots = torch.arange(T, dtype=torch.int32) if slots is None else slots
    return dict(key=key, value=value, kv_cache=cache, slot_mapping=slots, kv_layout=layout,
                k_scale=None, v_scale=None) | kw


def _check(**kw):
    a = _args(**kw)
    return ops._append_arguments(a["key"], a["value"], a["kv_cache"], a["slot_mapping"], a["kv_layout"],
                                 a["k_scale"], a["v_scale"], require_cuda=False)


def test_checks_accept_and_return_launch_arguments():
    dtype, cache_dtype, dev, n, args = _check(cache_dtype=E4M3, k_scale=0.25, slots=torch.arange(5))
    assert (dtype, cache_dtype, dev, n) == (BF16, E4M3, -1, 5)
    assert len(args) == len(ops._APPEND_ARGS) - 1  # all but the stream
    assert args[-4:] == (0, 0, 0.25, 1.0) and args[15] == 1  # int64 slots
    # Scales are ignored for a same-dtype cache.
    assert _check(k_scale=torch.ones(2))[4][-4:] == (0, 0, 1.0, 1.0)


@pytest.mark.parametrize("change,error,match", [
    (dict(dtype=torch.float32), TypeError, "torch.bfloat16 or torch.float16"),
    (dict(cache_dtype=FP16), TypeError, "float8_e4m3fn or torch.float8_e5m2"),
    (dict(cache_dtype=torch.int8), TypeError, "float8_e4m3fn"),
    (dict(key=torch.zeros(8, 4, 64, dtype=BF16)[None]), ValueError, "3-D"),
    (dict(key=torch.zeros(8, 2, 64, dtype=BF16)), ValueError, r"\[2, 64\] but the KV cache holds \[4, 64\]"),
    (dict(value=torch.zeros(8, 4, 64, dtype=FP16)), TypeError, "value must have key's dtype"),
    (dict(value=torch.zeros(7, 4, 64, dtype=BF16)), ValueError, "same shape"),
    (dict(value=torch.zeros(8, 4, 64, dtype=BF16).transpose(0, 1).contiguous().transpose(0, 1)[..., :]),
     None, None),  # token-strided views are fine
    (dict(value=torch.zeros(8, 4, 72, dtype=BF16)[..., 4:68]), ValueError, "16-byte aligned"),
    (dict(value=torch.zeros(8, 64, 4, dtype=BF16).transpose(1, 2)), ValueError, "contiguous head_dim"),
    (dict(slot_mapping=torch.arange(8.0)), TypeError, "torch.int32 or torch.int64"),
    (dict(slot_mapping=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "1-D"),
    (dict(slot_mapping=torch.arange(9)), ValueError, "9 entries but key/value only 8"),
    (dict(slot_mapping=[0, 1]), TypeError, "slot_mapping must be a torch.Tensor"),
    (dict(cache_dtype=E4M3, k_scale="1"), TypeError, "k_scale must be None, a float"),
    (dict(cache_dtype=E4M3, v_scale=torch.ones(2)), ValueError, "v_scale as a tensor must be a 1-element"),
    (dict(cache_dtype=E4M3, v_scale=torch.ones(1, dtype=torch.float64)), ValueError, "torch.float32"),
])
def test_checks_reject(change, error, match):
    if error is None:
        _check(**change)
        return
    with pytest.raises(error, match=match):
        _check(**change)


def test_fused_qkv_slices_are_accepted():
    T, Hq, H, D = 5, 8, 2, 128
    qkv = torch.randn(T, (Hq + 2 * H) * D).to(BF16)
    key = qkv[:, Hq * D:(Hq + H) * D].view(T, H, D)
    value = qkv[:, (Hq + H) * D:].view(T, H, D)
    cache, layout = _caches("packed_HND", 4, 16, H, D, BF16)
    args = ops._append_arguments(key, value, cache, torch.arange(T), layout, None, None, require_cuda=False)[4]
    assert args[2:6] == ((Hq + 2 * H) * D, D) * 2


def test_cpu_tensors_are_refused_by_the_op():
    a = _args()
    with pytest.raises(ValueError, match="CUDA tensors"):
        ops.append_paged_kv_cache(**a)


def test_check_append_errors_without_appends_is_a_no_op(monkeypatch):
    monkeypatch.setattr(ops, "_append_used", {})
    ops.check_append_errors()


def test_parse_memo_follows_the_tensor():
    cache, layout = _caches("packed_NHD", 4, 16, 2, 64, BF16)
    first = parse_cached(cache, layout)
    assert parse_cached(cache, layout) is first
    cache.data = torch.zeros(4, 32, 2, 128, dtype=BF16)  # same object, new storage and shape
    assert parse_cached(cache, layout).page_size == 32
    k, v = torch.zeros(9, 2, 64, dtype=BF16), torch.zeros(9, 2, 64, dtype=BF16)
    assert parse_cached((k, v), "NHD") is parse_cached([k, v], "NHD")
    assert parse_cached((v, k), "NHD").k_ptr == v.data_ptr()


# ----------------------------------------------------------------------------- launch arguments

def _span(tensors):
    """[start, end) byte ranges of the storages behind `tensors`."""
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
            for t in tensors]


def _inside(spans, address, nbytes):
    assert any(a <= address and address + nbytes <= b for a, b in spans), "address outside the tensors"


def _emulate(args, cache_dtype, key, reads, writes):
    """What fi_append_paged_kv_cache does with `args` (Python addressing over CPU memory): the check
    that pointers and strides computed by the op address the elements the reference writes. Every
    access is first checked to lie inside the `reads` / `writes` tensors' storage."""
    reads, writes = _span(reads), _span(writes)
    (kp, vp, k_ts, k_hs, v_ts, v_hs, kc, vc, sb, st, sh, nb, page, sp, s_stride, s64, n, H, D,
     _, _, ks, vs) = args
    esz_in, esz_out = 2, torch.empty((), dtype=cache_dtype).element_size()
    slot_t = ctypes.c_int64 if s64 else ctypes.c_int32
    for t in range(n):
        _inside(reads, sp + t * s_stride * ctypes.sizeof(slot_t), ctypes.sizeof(slot_t))
        s = slot_t.from_address(sp + t * s_stride * ctypes.sizeof(slot_t)).value
        if s < 0 or s >= nb * page:
            continue
        off = (s // page) * sb + (s % page) * st
        for src, ts, hs, dst, scale in ((kp, k_ts, k_hs, kc, ks), (vp, v_ts, v_hs, vc, vs)):
            for h in range(H):
                _inside(reads, src + (t * ts + h * hs) * esz_in, D * esz_in)
                row = (ctypes.c_uint8 * (D * esz_in)).from_address(src + (t * ts + h * hs) * esz_in)
                x = torch.frombuffer(bytearray(row), dtype=key.dtype)
                y = reference._stored(x, cache_dtype, scale).view(torch.uint8)
                _inside(writes, dst + (off + h * sh) * esz_out, D * esz_out)
                ctypes.memmove(dst + (off + h * sh) * esz_out, bytes(y.numpy()), D * esz_out)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("cache_dtype", [BF16, E4M3])
def test_launch_arguments_address_the_reference_layout(kind, cache_dtype):
    g = torch.Generator().manual_seed(7)
    page = 1 if kind == "slots" else 4
    nb, Hq, H, D, T = 24 // page, 4, 2, 32, 9
    qkv = (torch.randn(T, (Hq + 2 * H) * D, generator=g) * 50).to(BF16)
    key, value = qkv[:, Hq * D:(Hq + H) * D].view(T, H, D), qkv[:, (Hq + H) * D:].view(T, H, D)
    slots = torch.randperm(nb * page, generator=g)[:T - 1].to(torch.int32)
    slots[2], slots[4] = -1, nb * page + 3
    cache, layout = _caches(kind, nb, page, H, D, cache_dtype)
    k_scale = torch.tensor([0.37])
    want = reference.append_paged_kv_cache(key, value, cache, slots, kv_layout=layout, k_scale=k_scale,
                                           v_scale=2.5)
    dtype, cd, _, n, args = ops._append_arguments(key, value, cache, slots, layout, k_scale, 2.5,
                                                  require_cuda=False)
    assert n == T - 1
    if cd != dtype:  # the emulation reads a tensor scale through its pointer, as the kernel does
        assert args[19] == k_scale.data_ptr()
        args = args[:19] + (0, 0, k_scale.item(), args[22])
    got = cache if isinstance(cache, tuple) else (cache,)
    _emulate(args, cd, key, (qkv, slots), got)
    for a, b in zip(got, want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ----------------------------------------------------------------------------- module build

def test_append_specs_and_set():
    specs = kernels.specs_of(["append"])
    assert [s.tag for s in specs] == ["bf16_bf16", "bf16_fp8_e4m3", "bf16_fp8_e5m2",
                                      "fp16_fp16", "fp16_fp8_e4m3", "fp16_fp8_e5m2"]
    for s in specs:
        src = kernels.render(s)
        assert "{{" not in src and f"using CacheT = {s.params['CACHE_DTYPE']};" in src
    with pytest.raises(ValueError, match="bf16, fp16"):
        append_spec("fp32", "fp32")
    with pytest.raises(ValueError, match="fp8_e4m3 or fp8_e5m2"):
        append_spec("bf16", "fp16")


@pytest.mark.skipif(kernels.find_nvcc() is None, reason="needs nvcc")
def test_append_module_builds_and_refuses_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("FI_BACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    monkeypatch.setenv("FI_BACKEND_QUIET", "1")
    monkeypatch.delenv("FI_BACKEND_JIT", raising=False)
    module = kernels.load(append_spec("bf16", "fp8_e4m3"))
    fn = module.function("fi_append_paged_kv_cache", ops._APPEND_ARGS)
    module.function("fi_append_errors", ops._ERRORS_ARGS)
    base = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 16, 0, 1, 0, 0, 4, 128, 0, 0, 1.0, 1.0, None]
    assert fn(*base) == 0  # n == 0: nothing launched, no CUDA call
    bad = list(base)
    bad[18] = 72  # fp8 caches need head_dim % 16 == 0
    with pytest.raises(kernels.KernelError, match="invalid argument"):
        module.check(fn(*bad), "fi_append_paged_kv_cache")
