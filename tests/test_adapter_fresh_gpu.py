"""The vLLM adapter's steps of new prompts (_StepPlanner.fresh) with the real wrappers on the GPU, without vLLM: the
adapter's own wrappers (decode, paged prefill, the ragged fresh one), its K / V write into a packed cache, and its
forward over a key of its own and a value that is a strided view of a fused QKV projection, as vLLM hands them
over. A step of new prompts and a mixed step (decodes first, then new prompts) against the float64 reference,
outputs NaN-poisoned; the fresh wrapper's CuTe member runs them. Needs an sm_90a GPU and the nvidia-cutlass wheel."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from attention_cases import DEV, TOL
from fi_backend import reference as ref

pytestmark = pytest.mark.gpu
CUTE_MEMBER = True  # conftest: the member stays on in this file

HQ, HKV, D, P = 32, 8, 128, 16


@pytest.fixture(scope="module")
def planner():
    if importlib.util.find_spec("cutlass_library") is None:
        pytest.skip("the nvidia-cutlass wheel is not installed")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a only")
    from fi_backend.adapters import vllm as adapter
    from fi_backend.variants import DEFAULT
    from fi_backend.wrappers import BatchAttention
    BatchAttention.prepare(HQ, HKV, D, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=P, variant=DEFAULT,
                           device=DEV, also_ragged=True)
    common = dict(device=torch.device(DEV), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, q_dtype=torch.bfloat16,
                  kv_dtype=torch.bfloat16, page_size=P, variant=DEFAULT, max_requests=64)
    dec = adapter._make_wrapper("decode", max_rows=64, **common)
    pre = adapter._make_wrapper("prefill", max_rows=8192, **common)
    fresh = adapter._make_wrapper("prefill", max_rows=8192, ragged=True, **common)
    assert pre.cute_unsupported is None and fresh.cute_unsupported is None, (pre.cute_unsupported,
                                                                             fresh.cute_unsupported)
    return adapter, adapter._StepPlanner(dec, pre, page_size=P, sm_scale=D ** -0.5, variant_params={},
                                         split_mixed=True, fresh=fresh)


def _step(cached, new, blocks_per_req=160, num_blocks=1024):
    """vLLM's step metadata for requests of `cached` tokens in the cache and `new` this step (random distinct
    blocks), the packed cache [blocks, P, HKV, 2 D] holding the cached tokens, and the step's q / v as views of one
    fused buffer, k a tensor of its own (so K's strides are not V's). Returns (cm, cache, q, k, v, each request's
    full K / V for the reference)."""
    n = len(new)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    table = perm[: n * blocks_per_req].view(n, blocks_per_req).contiguous()
    cache = torch.randn(num_blocks, P, HKV, 2 * D, device=DEV).to(torch.bfloat16)
    rows = sum(new)
    qkv = (1.5 * torch.randn(rows, HQ + 2 * HKV, D, device=DEV)).to(torch.bfloat16)
    # vLLM's key comes out of the rotary embedding as a tensor of its own; its query and value stay views of qkv
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV].contiguous(), qkv[:, HQ + HKV:]
    seq = [c + m for c, m in zip(cached, new)]
    qsl = torch.tensor([0, *new], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    slots, history = [], []
    for i, (c, m) in enumerate(zip(cached, new)):
        pos = torch.arange(c, c + m, device=DEV)
        slots.append(table[i, pos // P].long() * P + pos % P)
        old = torch.arange(c, device=DEV)
        kc = cache[table[i, old // P].long(), old % P]
        history.append((kc[..., :D], kc[..., D:]))
    cm = SimpleNamespace(query_start_loc=qsl.to(DEV), query_start_loc_cpu=qsl,
                         seq_lens=torch.tensor(seq, dtype=torch.int32, device=DEV),
                         seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32), num_reqs=n,
                         num_actual_tokens=rows, max_query_len=max(new), max_seq_len=max(seq),
                         block_table_tensor=table, slot_mapping=torch.cat(slots), causal=True)
    full = [(torch.cat([hk, k[int(qsl[i]):int(qsl[i + 1])]]), torch.cat([hv, v[int(qsl[i]):int(qsl[i + 1])]]))
            for i, (hk, hv) in enumerate(history)]
    return cm, cache, q, k, v, full


@pytest.mark.parametrize("cached,new,decodes", [
    ([0, 0, 0, 0], [1000, 333, 517, 2049], 0),   # new prompts only: the fresh wrapper alone
    ([700, 1500, 0, 0], [1, 1, 1024, 777], 2),  # two decodes first, then new prompts: decode + fresh
])
def test_fresh_steps_through_the_adapter(planner, cached, new, decodes):
    adapter, step = planner
    cm, cache, q, k, v, full = _step(cached, new)
    md = step.plan(cm)
    assert md.fresh and md.wrapper is step.fresh and md.num_decode_rows == decodes
    assert step.fresh.cute_step, "the ragged member should take the step"
    impl = adapter._Impl(HQ, D, D ** -0.5, HKV, kv_cache_dtype="auto")
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, _k_scale=torch.tensor(1.0, device=DEV),
                            _v_scale=torch.tensor(1.0, device=DEV))
    impl.do_kv_cache_update(layer, k, v, cache, cm.slot_mapping)
    out = torch.full((q.shape[0], HQ, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    impl.forward(layer, q, k, v, cache, md, out)
    torch.cuda.synchronize()
    adapter.check_errors()
    qsl = cm.query_start_loc_cpu.tolist()
    for i, (kf, vf) in enumerate(full):
        rows = slice(qsl[i], qsl[i + 1])
        n = qsl[i + 1] - qsl[i]
        want, _ = ref.attention(q[rows], kf, vf, causal=True, sm_scale=D ** -0.5)  # queries: the KV's last n
        got = out[rows].double()
        assert not torch.isnan(got).any(), f"request {i}: rows not written"
        err = ((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-3)).max().item()
        assert err < TOL[torch.bfloat16], f"request {i} ({cached[i]} cached, {n} new): max relative error {err:.3g}"
