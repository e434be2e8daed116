"""The SGLang adapter's EXTEND steps of new prompts (its layer group's fresh wrapper) with the real wrappers on the
GPU, without SGLang: the backend made from tests/test_adapter_sglang.py's ModelRunner stand-in (a bf16 token pool of
page 1 on the GPU), a step of new prompts, its K / V written into the pool by the backend, and forward over k / v as
SGLang hands them over ([tokens, KV heads, D] views of a fused QKV projection, or a key of its own), against the
float64 reference, the output buffer NaN-poisoned. The fresh wrapper's CuTe member runs it. Needs an sm_90a GPU and
the nvidia-cutlass wheel."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from attention_cases import TOL
from test_adapter_sglang import Engine, llama_layers, model_runner, truth

pytestmark = pytest.mark.gpu
CUTE_MEMBER = True  # conftest: the member stays on in this file

HQ, HKV, D = 32, 8, 128
LENS = [700, 333, 1029]   # new prompts: 6 + 3 + 9 query tiles of 128 rows x 32 heads, which the member takes


@pytest.fixture(scope="module")
def backend():
    if importlib.util.find_spec("cutlass_library") is None:
        pytest.skip("the nvidia-cutlass wheel is not installed")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a only")
    from fi_backend.adapters import sglang as adapter
    gen = torch.Generator().manual_seed(13)
    layers = llama_layers(n=2, hq=HQ, hkv=HKV, d=D, scale=D ** -0.5)
    runner = model_runner(layers, page=1, pool_rows=len(LENS) + 1, max_len=max(LENS), hkv=HKV, d=D,
                          pool_size=sum(LENS) + 8, gen=gen, pool_dtype=torch.bfloat16, device="cuda",
                          server_args={"chunked_prefill_size": 4096, "max_prefill_tokens": 4096})
    pool = runner.token_to_kv_pool
    pool.k_buffer = [b.cuda() for b in pool.k_buffer]
    pool.v_buffer = [b.cuda() for b in pool.v_buffer]
    runner.req_to_token_pool.req_to_token = runner.req_to_token_pool.req_to_token.cuda()
    return adapter, adapter._Backend(runner), runner, layers, gen


def _on_gpu(fb):
    """The ForwardBatch's device tensors on the GPU (the *_cpu fields stay on the host, as SGLang keeps them)."""
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_seq_lens", "extend_prefix_lens"):
        setattr(fb, name, getattr(fb, name).cuda())
    return fb


@pytest.mark.parametrize("own_key", [False, True])
def test_fresh_extend_steps_on_the_gpu(backend, own_key):
    adapter, be, runner, layers, gen = backend
    assert all(g.fresh is not None and g.fresh.cute_unsupported is None for g in be._groups)
    runner.req_to_token_pool.req_to_token.zero_()
    eng = Engine(runner, gen)   # every row new again
    rows = list(range(1, len(LENS) + 1))
    fb = _on_gpu(eng.extend(list(zip(rows, LENS))))
    before = adapter.plan_counts()["fresh"]
    be.init_forward_metadata(fb)
    md = be.forward_metadata
    assert md.fresh == (True,) and adapter.plan_counts()["fresh"] == before + 1
    fresh = be._groups[0].fresh
    assert fresh.cute_step, "the ragged member should take the step"
    tokens = sum(LENS)
    for layer in layers:
        qkv = (1.5 * torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen)).to(torch.bfloat16).cuda()
        # RadixAttention hands q over as [tokens, heads x D], k and v viewed as [tokens, KV heads, D]
        q = qkv[:, :HQ * D]
        k, v = qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D), qkv[:, (HQ + HKV) * D:].view(tokens, HKV, D)
        if own_key:   # a rotary embedding that returns a new key
            k = k.contiguous()
        fb._attn_output = torch.full((tokens, HQ * D), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = be.forward_extend(q, k, v, layer, fb).view(tokens, HQ, D)
        torch.cuda.synchronize()
        adapter.check_errors()
        start = 0
        for row, n in zip(rows, LENS):
            hk, hv = eng.history(layer.layer_id, row, n)   # the backend's K / V write into the pool
            torch.testing.assert_close(hk, k[start: start + n])
            torch.testing.assert_close(hv, v[start: start + n])
            want = truth(q[start: start + n].view(n, HQ, D).cpu(), hk.cpu(), hv.cpu(), torch.arange(n),
                         scale=layer.scaling)
            got = out[start: start + n].double().cpu()
            assert not torch.isnan(got).any(), f"layer {layer.layer_id}, request {row}: rows not written"
            err = ((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-3)).max().item()
            assert err < TOL[torch.bfloat16], f"layer {layer.layer_id}, request {row} ({n} tokens): error {err:.3g}"
            start += n
