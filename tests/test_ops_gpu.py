"""merge_state / merge_states kernels against the float64 reference (fi_backend.reference).

GPU only. Modules are built on first use (nvcc on the GPU machine), or found in a cache shipped from
a build machine: FI_BACKEND_CUDA_ARCH_LIST=90a fi-backend build merge, then FI_BACKEND_CACHE_DIR=<copy>.
Every test poisons its outputs with NaN and draws fresh random inputs; LSEs include -inf (empty states,
whose O is NaN-poisoned too: it must never be read).
"""
import pytest
import torch

from fi_backend import ops, reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Bound on |out - ref| / (|ref| + 1) against float64 (inputs are O(1)): fp32 math + output rounding.
RTOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
LSE_RTOL = 1e-5  # LSE is fp32 in every dtype


def _lse(shape, empty_frac=0.2, scale=4.0, offset=0.0):
    s = torch.randn(shape, device="cuda") * scale + offset
    s[torch.rand(shape, device="cuda") < empty_frac] = -float("inf")
    return s


def _v(shape, dtype, lse):
    """O of random states; O of empty states (LSE = -inf) is NaN: a kernel that reads it fails."""
    v = torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)
    v[torch.isinf(lse)] = float("nan")
    return v


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def assert_state_close(out, out_lse, ref_o, ref_lse, dtype):
    assert not torch.isnan(out).any(), "some of O was not written (or NaN leaked from an empty state)"
    assert not torch.isnan(out_lse).any(), "some of LSE was not written"
    rel = ((out.double() - ref_o).abs() / (ref_o.abs() + 1)).max().item() if out.numel() else 0.0
    assert rel <= RTOL[dtype], f"O relative error {rel:.3g} > {RTOL[dtype]} for {dtype}"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(out_lse), empty) and bool((out_lse[empty] < 0).all())
    assert bool((out[empty] == 0).all()), "all-empty rows must give O = 0"
    lse_err = ((out_lse.double() - ref_lse)[~empty].abs() / (ref_lse[~empty].abs() + 1))
    assert lse_err.numel() == 0 or lse_err.max().item() <= LSE_RTOL


# ----------------------------------------------------------------------------- merge_state

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seq", [1, 7, 1000])
def test_merge_state(dtype, head_dim, seq):
    heads = 4
    s_a, s_b = _lse((seq, heads)), _lse((seq, heads))
    v_a, v_b = _v((seq, heads, head_dim), dtype, s_a), _v((seq, heads, head_dim), dtype, s_b)
    out, out_lse = _poisoned((seq, heads, head_dim), dtype), _poisoned((seq, heads), torch.float32)
    got, got_lse = ops.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    assert got is out and got_lse is out_lse
    ref_o, ref_lse = reference.merge_state(v_a, s_a, v_b, s_b)
    assert_state_close(out, out_lse, ref_o, ref_lse, dtype)
    # One side empty: the other side, bit for bit.
    only_a = torch.isinf(s_b) & ~torch.isinf(s_a)
    only_b = torch.isinf(s_a) & ~torch.isinf(s_b)
    assert torch.equal(out[only_a], v_a[only_a]) and torch.equal(out_lse[only_a], s_a[only_a])
    assert torch.equal(out[only_b], v_b[only_b]) and torch.equal(out_lse[only_b], s_b[only_b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 72, 512])
def test_merge_state_unusual_head_dims_and_allocates(dtype, head_dim):
    seq, heads = 33, 3
    s_a, s_b = _lse((seq, heads)), _lse((seq, heads))
    v_a, v_b = _v((seq, heads, head_dim), dtype, s_a), _v((seq, heads, head_dim), dtype, s_b)
    out, out_lse = ops.merge_state(v_a, s_a, v_b, s_b)
    assert out.dtype == dtype and out.shape == v_a.shape and out_lse.dtype == torch.float32
    assert_state_close(out, out_lse, *reference.merge_state(v_a, s_a, v_b, s_b), dtype)


def test_merge_state_large_lse_is_stable():
    seq, heads, d = 64, 8, 128
    s_a = _lse((seq, heads), empty_frac=0.1, scale=30.0, offset=500.0)
    s_b = _lse((seq, heads), empty_frac=0.1, scale=30.0, offset=-500.0)
    v_a, v_b = _v((seq, heads, d), torch.float32, s_a), _v((seq, heads, d), torch.float32, s_b)
    out, out_lse = ops.merge_state(v_a, s_a, v_b, s_b)
    assert_state_close(out, out_lse, *reference.merge_state(v_a, s_a, v_b, s_b), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_row_strided_views(dtype):
    seq, heads, d = 100, 4, 128
    s_a = _lse((seq, heads + 3))[:, 1:heads + 1]          # row stride heads + 3, offset 1
    s_b = _lse((2 * seq, heads))[::2]                     # row stride 2 * heads
    v_a = torch.randn(seq, heads + 2, d, device="cuda").to(dtype)[:, 1:heads + 1]
    v_a[torch.isinf(s_a)] = float("nan")
    v_b = torch.randn(2 * seq, heads, d, device="cuda").to(dtype)[::2]
    v_b[torch.isinf(s_b)] = float("nan")
    out_base = _poisoned((seq, 2 * heads, d), dtype)
    out = out_base[:, heads:]
    lse_base = _poisoned((seq, heads + 1), torch.float32)
    out_lse = lse_base[:, :heads]
    assert not v_a.is_contiguous() and not s_a.is_contiguous() and not out.is_contiguous()
    ops.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
    assert_state_close(out, out_lse, *reference.merge_state(v_a, s_a, v_b, s_b), dtype)
    assert torch.isnan(out_base[:, :heads]).all() and torch.isnan(lse_base[:, heads]).all(), \
        "wrote outside the output view"


def test_merge_state_on_side_stream_and_empty():
    seq, heads, d = 257, 2, 64
    s_a, s_b = _lse((seq, heads)), _lse((seq, heads))
    v_a, v_b = _v((seq, heads, d), torch.float16, s_a), _v((seq, heads, d), torch.float16, s_b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, out_lse = ops.merge_state(v_a, s_a, v_b, s_b)
    torch.cuda.current_stream().wait_stream(side)
    assert_state_close(out, out_lse, *reference.merge_state(v_a, s_a, v_b, s_b), torch.float16)
    e = torch.empty((0, heads, d), device="cuda", dtype=torch.float16)
    o, l = ops.merge_state(e, torch.empty((0, heads), device="cuda"), e, torch.empty((0, heads), device="cuda"))
    assert o.shape == (0, heads, d) and l.shape == (0, heads)


# ----------------------------------------------------------------------------- merge_states

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seq", [1, 7, 1000])
@pytest.mark.parametrize("num_states", [1, 2, 5, 33])
def test_merge_states(dtype, head_dim, seq, num_states):
    heads = 4
    s = _lse((seq, num_states, heads), empty_frac=0.3)
    if seq > 1:
        s[0] = -float("inf")  # a row with every state empty
    v = _v((seq, num_states, heads, head_dim), dtype, s)
    out, out_lse = _poisoned((seq, heads, head_dim), dtype), _poisoned((seq, heads), torch.float32)
    got, got_lse = ops.merge_states(v, s, out=out, out_lse=out_lse)
    assert got is out and got_lse is out_lse
    assert_state_close(out, out_lse, *reference.merge_states(v, s), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_row_strided_views_and_large_lse(dtype):
    seq, num_states, heads, d = 50, 6, 8, 128
    s_base = _lse((seq, num_states + 1, heads), empty_frac=0.2, scale=40.0, offset=300.0)
    s = s_base[:, 1:]
    v = _v((seq, num_states + 1, heads, d), dtype, s_base)[:, 1:]
    out_base = _poisoned((2 * seq, heads, d), dtype)
    out, out_lse = out_base[1::2], _poisoned((2 * seq, heads), torch.float32)[::2]
    ops.merge_states(v, s, out=out, out_lse=out_lse)
    assert_state_close(out, out_lse, *reference.merge_states(v, s), dtype)
    assert torch.isnan(out_base[0::2]).all(), "wrote outside the output view"


def test_merge_states_agrees_with_pairwise_merge_state():
    seq, heads, d = 300, 4, 128
    s = _lse((seq, 2, heads))
    v = _v((seq, 2, heads, d), torch.float32, s)
    out, out_lse = ops.merge_states(v, s)
    pair, pair_lse = ops.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    torch.testing.assert_close(out, pair, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_lse, pair_lse, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- errors

def _good(dtype=torch.bfloat16, seq=4, heads=2, d=64):
    s_a, s_b = _lse((seq, heads)), _lse((seq, heads))
    return _v((seq, heads, d), dtype, s_a), s_a, _v((seq, heads, d), dtype, s_b), s_b


@pytest.mark.parametrize("case,error,match", [
    ("v_a float64", TypeError, r"v_a must have dtype torch.bfloat16, torch.float16, torch.float32"),
    ("v_a on cpu", ValueError, r"v_a must be a CUDA tensor"),
    ("v_b other dtype", TypeError, r"v_b must have dtype torch.bfloat16"),
    ("v_b other shape", ValueError, r"v_b must have shape \[4, 2, 64\]"),
    ("s_a float16", TypeError, r"s_a \(LSE\) must have dtype torch.float32"),
    ("s_b other shape", ValueError, r"s_b must have shape \[4, 2\]"),
    ("head_dim 12", ValueError, r"head_dim .* multiple of 8 in \[8, 512\] \(got 12\)"),
    ("head_dim 520", ValueError, r"\(got 520\)"),
    ("v_a 2-D", ValueError, r"v_a must be 3-D"),
    ("v_a heads transposed", ValueError, r"v_a must be contiguous within each row"),
    ("v_b misaligned", ValueError, r"v_b must be 16-byte aligned"),
    ("out fp16", TypeError, r"out must have dtype torch.bfloat16"),
    ("out_lse other shape", ValueError, r"out_lse must have shape \[4, 2\]"),
])
def test_merge_state_errors(case, error, match):
    v_a, s_a, v_b, s_b = _good()
    kwargs = {}
    if case == "v_a float64":
        v_a = v_a.double()
    elif case == "v_a on cpu":
        v_a = v_a.cpu()
    elif case == "v_b other dtype":
        v_b = v_b.half()
    elif case == "v_b other shape":
        v_b = _good(heads=3)[2]
    elif case == "s_a float16":
        s_a = s_a.half()
    elif case == "s_b other shape":
        s_b = s_b[:, :1]
    elif case.startswith("head_dim"):
        d = int(case.split()[1])
        v_a, s_a, v_b, s_b = _good(d=d)
    elif case == "v_a 2-D":
        v_a = v_a[0]
    elif case == "v_a heads transposed":
        v_a = v_a.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "v_b misaligned":
        flat = torch.randn(v_b.numel() + 1, device="cuda").to(v_b.dtype)
        v_b = flat[1:].view(v_b.shape)
    elif case == "out fp16":
        kwargs["out"] = torch.empty(v_a.shape, device="cuda", dtype=torch.float16)
    elif case == "out_lse other shape":
        kwargs["out_lse"] = torch.empty((4, 3), device="cuda")
    with pytest.raises(error, match=match):
        ops.merge_state(v_a, s_a, v_b, s_b, **kwargs)


def test_merge_states_errors():
    v = torch.randn(3, 2, 4, 64, device="cuda", dtype=torch.float16)
    s = torch.randn(3, 2, 4, device="cuda")
    with pytest.raises(ValueError, match=r"v must be 4-D"):
        ops.merge_states(v[0], s)
    with pytest.raises(ValueError, match=r"num_states \(dim 1\) must be at least 1"):
        ops.merge_states(v[:, :0], s[:, :0])
    with pytest.raises(ValueError, match=r"s must have shape \[3, 2, 4\]"):
        ops.merge_states(v, s[:, :1])
    with pytest.raises(ValueError, match=r"v must be contiguous within each row"):
        ops.merge_states(v.transpose(1, 2).contiguous().transpose(1, 2), s)
    with pytest.raises(ValueError, match=r"out must have shape \[3, 4, 64\]"):
        ops.merge_states(v, s, out=torch.empty(3, 2, 4, 64, device="cuda", dtype=torch.float16))


# ----------------------------------------------------------------------------- CUDA graphs

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_launches_capture_and_replay_in_cuda_graph(dtype):
    seq, num_states, heads, d = 129, 3, 8, 128
    s_a, s_b = _lse((seq, heads)), _lse((seq, heads))
    v_a, v_b = _v((seq, heads, d), dtype, s_a), _v((seq, heads, d), dtype, s_b)
    s = _lse((seq, num_states, heads))
    v = _v((seq, num_states, heads, d), dtype, s)
    out, out_lse = _poisoned((seq, heads, d), dtype), _poisoned((seq, heads), torch.float32)
    outs, outs_lse = _poisoned((seq, heads, d), dtype), _poisoned((seq, heads), torch.float32)

    side = torch.cuda.Stream()  # warm up (loads the modules) off the default stream, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
        ops.merge_states(v, s, out=outs, out_lse=outs_lse)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.merge_state(v_a, s_a, v_b, s_b, out=out, out_lse=out_lse)
        ops.merge_states(v, s, out=outs, out_lse=outs_lse)

    for _ in range(2):  # new inputs in the same buffers, replay, check
        for dst, src in ((s_a, _lse((seq, heads))), (s_b, _lse((seq, heads))), (s, _lse(s.shape))):
            dst.copy_(src)
        v_a.copy_(_v(v_a.shape, dtype, s_a))
        v_b.copy_(_v(v_b.shape, dtype, s_b))
        v.copy_(_v(v.shape, dtype, s))
        for t in (out, out_lse, outs, outs_lse):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_state_close(out, out_lse, *reference.merge_state(v_a, s_a, v_b, s_b), dtype)
        assert_state_close(outs, outs_lse, *reference.merge_states(v, s), dtype)
