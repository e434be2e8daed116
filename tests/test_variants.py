"""Variants (fi_backend/variants.py) on the CPU: rendering, compilation of the decode template with nvcc for
sm_90a (one session-scoped build cache, a handful of modules), the ctypes/C parameter layout check, and
clear errors for bad variants. GPU behaviour is in tests/test_decode_gpu.py."""
from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch

from fi_backend import kernels
from fi_backend import reference as ref
from fi_backend import variants as V
from fi_backend import wrappers as W

nvcc = pytest.mark.skipif(kernels.find_nvcc() is None, reason="needs nvcc")

# A user variant in the paper's FlashSigmoid style, with scalar and tensor params and an OutputTransform.
USER = V.Variant(
    "user_sigmoid_gain",
    use_softmax=False,
    params={"scale": "float", "bias": "float32[]", "gain": "float"},
    logits_transform="return 1.f / (1.f + __expf(-(logits * params.scale + __ldg(params.bias + ctx.qo_head))));",
    output_transform="return o * params.gain;",
)


@pytest.fixture(scope="session")
def build_env(tmp_path_factory):
    """One build cache for the session; architectures fixed to sm_90a (no GPU needed)."""
    saved = {k: os.environ.get(k) for k in ("FI_BACKEND_CACHE_DIR", "FI_BACKEND_CUDA_ARCH_LIST", "FI_BACKEND_QUIET")}
    os.environ["FI_BACKEND_CACHE_DIR"] = str(tmp_path_factory.mktemp("fi_cache"))
    os.environ["FI_BACKEND_CUDA_ARCH_LIST"] = "90a"
    os.environ["FI_BACKEND_QUIET"] = "1"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# (variant, head_dim, q dtype, kv dtype, group): every hook kind, a tensor param, no-softmax, fp8 and
# 16-row tiles each appear once.
_COMPILED = [
    (V.DEFAULT, 128, "bf16", "bf16", 4),
    (V.ROPE, 128, "fp16", "fp16", 8),
    (V.BUILTIN_VARIANTS["soft_cap_window"], 64, "bf16", "fp8_e4m3", 16),
    (V.CUSTOM_MASK, 256, "bf16", "bf16", 2),
    (V.SIGMOID, 128, "bf16", "fp8_e5m2", 1),
    (USER, 128, "fp16", "fp16", 4),
]


@nvcc
def test_variants_compile_and_layouts_match(build_env):
    specs = [W.decode_spec(v, d, q, kv, g) for v, d, q, kv, g in _COMPILED]
    results = kernels.build_many(specs, archs="90a", jobs=2)
    failed = [(s.tag, r) for s, r in zip(specs, results) if isinstance(r, Exception)]
    assert not failed, failed
    for v, d, q, kv, g in _COMPILED:
        launcher = W._launcher(v, d, q, kv, g)  # loads the .so and checks the C layout against ctypes
        assert launcher.threads % 32 == 0 and launcher.smem_bytes <= W.SMEM_PER_CTA
        assert launcher.rows * 1 >= launcher.heads_per_chunk
        shape = W._kernel_shape(d, 1 if kv.startswith("fp8") else 2, g, bool(v.key_transform))
        assert launcher.smem_bytes == W._smem_bytes(d, 1 if kv.startswith("fp8") else 2, shape)
        assert g % launcher.heads_per_chunk == 0


# Deterministic decode modules (decode_spec(deterministic=True)): the plain shape, a window (the loader's tile
# alignment), head_dim 256 (two fold slots a pass), 16-row tiles over fp8 KV.
_DET_COMPILED = [
    (V.DEFAULT, 128, "bf16", "bf16", 4),
    (V.SLIDING_WINDOW, 128, "bf16", "bf16", 1),
    (V.CUSTOM_MASK, 256, "bf16", "bf16", 2),
    (V.BUILTIN_VARIANTS["soft_cap_window"], 64, "bf16", "fp8_e4m3", 16),
]


@nvcc
def test_deterministic_decode_modules_compile_and_layouts_match(build_env):
    specs = [W.decode_spec(v, d, q, kv, g, deterministic=True) for v, d, q, kv, g in _DET_COMPILED]
    results = kernels.build_many(specs, archs="90a", jobs=2)
    failed = [(s.tag, r) for s, r in zip(specs, results) if isinstance(r, Exception)]
    assert not failed, failed
    for v, d, q, kv, g in _DET_COMPILED:
        det = W._launcher(v, d, q, kv, g, deterministic=True)  # the C layout against ctypes, as above
        assert "_det_" in det.module.name
        shape = W._kernel_shape(d, 1 if kv.startswith("fp8") else 2, g, bool(v.key_transform))
        assert det.smem_bytes == W._smem_bytes(d, 1 if kv.startswith("fp8") else 2, shape)


_PREFILL_COMPILED = [  # every head_dim's largest member on Hopper, fp8 KV, a QueryTransform
    (V.DEFAULT, 128, "bf16", "bf16", 1, 0),
    (V.DEFAULT, 128, "bf16", "bf16", 4, 1),
    (V.DEFAULT, 64, "fp16", "fp16", 1, 0),
    (V.DEFAULT, 256, "bf16", "bf16", 8, 0),
    (V.ROPE, 128, "bf16", "fp8_e4m3", 4, 0),
    (V.ALIBI, 128, "bf16", "bf16", 4, 0),  # the bias MMA at 8 x 2 (and 8 x 1 below)
    (V.ALIBI, 128, "bf16", "bf16", 1, 1),
    (V.SLIDING_WINDOW, 128, "bf16", "bf16", 4, 0),  # 12 warps, hooks with the query copy
    (V.SLIDING_WINDOW, 128, "bf16", "bf16", 4, 1),
    (V.DEFAULT, 128, "bf16", "bf16", 3, 0),  # "aligned": 12 x 1, 64 tokens a tile at 3 heads a chunk
]


@nvcc
def test_prefill_shared_memory_mirror_matches(build_env, monkeypatch):
    """wrappers._prefill_smem_bytes with _prefill_q_buffers is prefill::Config::kSmemBytes."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")  # the wgmma family
    specs = [W.prefill_spec(v, d, q, kv, g, member=m) for v, d, q, kv, g, m in _PREFILL_COMPILED]
    results = kernels.build_many(specs, archs="90a", jobs=2)
    failed = [(s.tag, r) for s, r in zip(specs, results) if isinstance(r, Exception)]
    assert not failed, failed
    for v, d, q, kv, g, m in _PREFILL_COMPILED:
        launcher = W._launcher(v, d, q, kv, g, kernel="prefill", member=m)
        kv_bytes = 1 if kv.startswith("fp8") else 2
        shape = W._prefill_shape(d, kv_bytes, g, m, v)
        assert shape["wgmma"]
        hooks = bool(v.logits_transform or v.logits_mask)
        ws = d == 128 and m == 0 and kv_bytes == 2 and not (v.query_transform or v.key_transform)
        # the smaller member too, for variants without logits hooks or the bias MMA
        ws_small = (d == 128 and m > 0 and kv_bytes == 2 and not (v.query_transform or v.key_transform or hooks
                                                                   or v.mask_is_kv_range or v.alibi_slope))
        assert shape["producer"] == int(ws or ws_small), (v.name, d, kv, m)
        # (a KV-range mask, the sliding window, counts as a hook: 12 x 1 measured faster, ab47w_*)
        if ws_small:
            assert (shape["warps"], shape["mfrags"]) == (8, 1), (v.name, shape)
        elif ws:  # warp-specialised member 0 (_PREFILL_WS_MEMBER0): 12 x 1 with logits hooks or 3 heads a chunk,
            aligned = g == 3  # else 8 x 2
            assert (shape["warps"], shape["mfrags"]) == ((12, 1) if hooks or aligned else (8, 2)), (v.name, shape)
        else:
            assert shape["warps"] == (12 if v.mask_is_kv_range and d == 128 and m == 0
                                      else W._prefill_family(d, kv_bytes)[m]["warps"])
        qb = W._prefill_q_buffers(v, d, kv_bytes, shape)
        hooks_at_16 = hooks and shape["warps"] >= 16
        assert qb == (W.PREFILL_PRODUCER_Q_BUFFERS if ws or ws_small else
                      1 if v.query_transform or hooks_at_16 or d == 256 else shape["stages"]), (v.name, d, qb)
        assert launcher.smem_bytes == W._prefill_smem_bytes(d, kv_bytes, shape, qb) <= W.SMEM_PER_CTA, (v.name, d, kv, m)


@nvcc
def test_bad_user_variant_names_the_compiler_error(build_env):
    bad = V.Variant("bad_user", logits_transform="return logits * undefined_thing;")
    with pytest.raises(kernels.BuildError, match="undefined_thing"):
        kernels.build(W.decode_spec(bad, 128, "bf16", "bf16", 4), archs="90a")


def test_render_each_builtin():
    for name, v in V.BUILTIN_VARIANTS.items():
        r = v.render()
        assert set(r) == {"VARIANT_PARAMS", "VARIANT_BODY", "VARIANT_LAYOUT"}
        body = r["VARIANT_BODY"]
        assert f"kUseSoftmax = {'true' if v.use_softmax else 'false'}" in body
        for hook, (_, _, flag) in V.HOOKS.items():
            assert f"{flag} = {'true' if getattr(v, hook) else 'false'}" in body, (name, hook)
            assert f" {hook}(const VariantParams& params" in body  # every hook is present
        for pname, ptype in v.params.items():
            assert f"{V.PARAM_TYPES[ptype][0]} {pname};" in r["VARIANT_PARAMS"]
            assert f"offsetof(VariantParams, {pname})" in r["VARIANT_LAYOUT"]
        spec = W.decode_spec(v, 128, "bf16", "bf16", 4)
        assert "{{" not in kernels.render(spec)


def test_combine_chains_in_order():
    shift = V.Variant("shift", params={"shift": "float"}, logits_transform="return logits + params.shift;")
    v = V.combine(V.SOFT_CAP, V.ALIBI, shift, V.SLIDING_WINDOW, V.CUSTOM_MASK)
    body = v.render()["VARIANT_BODY"]
    chain = body[body.index("float logits_transform(const"):]
    assert chain.index("logits_transform_0") < chain.index("logits_transform_1")
    assert "logits_mask_0(params, ctx) && logits_mask_1(params, ctx)" in body
    assert list(v.params) == ["logits_soft_cap", "alibi_slopes", "shift", "window_left", "mask_packed", "mask_indptr"]
    assert v.use_softmax and V.combine(V.SOFT_CAP, V.SIGMOID).use_softmax is False
    # ALiBi slopes add up; they bias softmax logits only
    two = V.combine(V.ALIBI, V.Variant("half", alibi_slope="return 0.5f;"))
    assert "return alibi_slope_0(params, qo_head) + alibi_slope_1(params, qo_head);" in two.render()["VARIANT_BODY"]
    with pytest.raises(V.VariantError, match="alibi_slope biases softmax logits"):
        V.combine(V.ALIBI, V.SIGMOID)


def test_mask_is_kv_range_survives_only_range_masks():
    """A window's mask is its KV range (the kernel may skip the mask inside every row's range); ANDed with a
    mask that is not a range (a custom mask), it no longer is."""
    assert V.SLIDING_WINDOW.mask_is_kv_range
    assert "kMaskIsKvRange = true" in V.SLIDING_WINDOW.render()["VARIANT_BODY"]
    assert "kMaskIsKvRange = false" in V.CUSTOM_MASK.render()["VARIANT_BODY"]
    assert V.combine(V.SOFT_CAP, V.SLIDING_WINDOW).mask_is_kv_range
    assert not V.combine(V.SLIDING_WINDOW, V.CUSTOM_MASK).mask_is_kv_range
    assert not V.combine(V.SOFT_CAP, V.ALIBI).mask_is_kv_range
    with pytest.raises(V.VariantError, match="mask_is_kv_range"):
        V.Variant("only_mask", logits_mask="return true;", mask_is_kv_range=True)


def test_bad_variants_give_clear_errors():
    with pytest.raises(V.VariantError, match="name"):
        V.Variant("has space")
    with pytest.raises(V.VariantError, match="accepted types"):
        V.Variant("x", params={"p": "double"})
    with pytest.raises(V.VariantError, match="C identifier"):
        V.Variant("x", params={"logits": "float"})
    with pytest.raises(V.VariantError, match="non-empty"):
        V.Variant("x", logits_mask="   ")
    with pytest.raises(V.VariantError, match="reserves"):
        V.Variant("x", logits_transform="return {{X}};")
    with pytest.raises(V.VariantError, match="unknown parameter"):
        V.Variant("x", defaults={"nope": 1})
    with pytest.raises(V.VariantError, match="more than one"):
        V.combine(V.SLIDING_WINDOW, V.SLIDING_WINDOW)
    with pytest.raises(V.VariantError, match="rotary_interleave"):
        V.combine(V.ROPE, V.Variant("r2", rotary_interleave=True, key_transform="x0 = -x0;"))
    with pytest.raises(V.VariantError, match="needs parameter 'window_left'"):
        V.SLIDING_WINDOW.resolve({}, head_dim=128, device="cpu")
    with pytest.raises(V.VariantError, match="has no parameter"):
        V.DEFAULT.resolve({"window_left": 3}, head_dim=128, device="cpu")
    with pytest.raises(V.VariantError, match="ROPE_INTERLEAVE"):
        V.ROPE.resolve({"rope": ref.RopeConfig(interleave=True)}, head_dim=128, device="cpu")
    with pytest.raises(ValueError, match="head_dim"):
        W.decode_spec(V.DEFAULT, 112, "bf16", "bf16", 4)
    for spec in (W.decode_spec, W.prefill_spec):  # 80 / 96 run in 128-wide rows: no fused rotary on the pad
        with pytest.raises(ValueError, match="rotary.*head_dim 64, 128 or 256, got 96"):
            spec(V.ROPE, 96, "bf16", "bf16", 4)
    with pytest.raises(ValueError, match="shared memory"):
        W.decode_spec(V.DEFAULT, 256, "bf16", "bf16", 4, tuning={"warps": 8, "stages": 2})
    with pytest.raises(ValueError, match="tuning"):
        W.decode_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={"stagez": 2})


def test_prefill_tile_family_specs():
    """The prefill family: one module per member (largest query tile first), a tuning override is a
    family of one, and a member outside the family is refused by name."""
    n = W.prefill_family_size(128, "bf16")
    assert n >= 2 and W.prefill_family_size(128, "bf16", {"warps": 4}) == 1
    specs = [W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, member=m) for m in range(n)]
    assert len({s.memo_key for s in specs}) == n
    rows = [int(s.params["CONFIG"].split(", ")[4]) * int(s.params["CONFIG"].split(", ")[5]) for s in specs]
    assert rows == sorted(rows, reverse=True) and rows[0] > rows[-1], f"warps x fragments per member: {rows}"
    with pytest.raises(ValueError, match="member"):
        W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, member=n)
    with pytest.raises(ValueError, match="member"):
        W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={"warps": 4}, member=1)


def test_prefill_tuning_keys():
    """Only the shape overrides are tuning keys; the row sums and ALiBi by MMA follow from the shape, and an
    unknown key is refused with the accepted ones."""
    for bad in ({"pingpong": 1}, {"rowsum": 0}, {"bias": 0}, {"defines": {"FI_PREFILL_KV_VOTE": 0}}):
        with pytest.raises(ValueError, match=f"unknown prefill tuning keys.*{next(iter(bad))}.*accepted"):
            W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 1, tuning=bad)
    with pytest.raises(ValueError, match="unknown decode tuning keys.*l2_prefetch"):
        W.decode_spec(V.DEFAULT, 128, "bf16", "bf16", 1, tuning={"l2_prefetch": 64})


@pytest.mark.parametrize("llama31", [None, ref.Llama31Scaling()])
def test_rope_table_matches_reference(llama31):
    theta, scale = random.choice([10000.0, 500000.0]), random.choice([1.0, 2.0])
    cfg = ref.RopeConfig(theta=theta, scale=scale, llama31=llama31)
    table = V.ROPE.resolve({"rope": cfg}, head_dim=128, device="cpu")["rope_rev_freq"]
    expect = ref.rope_frequencies(128, cfg) / (2 * math.pi * scale)
    assert table.dtype == torch.float64
    torch.testing.assert_close(table, expect, rtol=1e-12, atol=0)
    again = V.ROPE.resolve({"rope": cfg}, head_dim=128, device="cpu")["rope_rev_freq"]
    assert again is table  # memoised: a re-plan hands a captured graph the same pointer


def test_pack_custom_mask_bits():
    masks = [torch.rand(random.randint(1, 4), random.randint(1, 40)) < 0.5 for _ in range(5)]
    packed, indptr = V.pack_custom_mask(masks)
    bits = np.unpackbits(packed.numpy(), bitorder="little")
    for m, start in zip(masks, indptr.tolist()):
        flat = m.reshape(-1).numpy()
        assert np.array_equal(bits[start:start + flat.size].astype(bool), flat)
    with pytest.raises(V.VariantError, match="bool"):
        V.pack_custom_mask([torch.zeros(2, 2)])


def test_fastdiv_matches_division():
    for d in list(range(1, 300)) + [1000, 4096]:
        f = W._fastdiv(d)
        n = np.array([0, 1, d - 1, d, d + 1, 12345, 2 ** 31 - 1] + random.sample(range(2 ** 31), 50), dtype=np.uint64)
        q = (((n * np.uint64(f.m)) >> np.uint64(32)) + n) >> np.uint64(f.s)
        assert np.array_equal(q, n // np.uint64(d)), d


def test_prefill_family_follows_the_arch_list(monkeypatch):
    """Hopper's warpgroup-MMA family only when every architecture built for is sm_90a; asking for it
    otherwise is refused with the setting to change."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    assert W.prefill_uses_wgmma() and all(s["wgmma"] == 1 for s in W.prefill_family_shapes(128, "bf16"))
    assert "true" in W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4).params["CONFIG"]
    for archs in ("80", "90a,100a"):
        monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", archs)
        assert not W.prefill_uses_wgmma() and all(s["wgmma"] == 0 for s in W.prefill_family_shapes(128, "bf16"))
        with pytest.raises(ValueError, match="FI_BACKEND_CUDA_ARCH_LIST=90a"):
            W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={"wgmma": 1})
    assert W.prefill_family_shapes(128, "bf16", wgmma=True)[0]["wgmma"] == 1  # explicit beats the list


def _config(spec) -> list:
    """prefill::Config's arguments up to kRowSumMma (the last, kBiasMma, has its own test)."""
    return spec.params["CONFIG"].split(", ")[:-1]


def _producer(spec) -> str:
    return _config(spec)[-2]  # prefill::Config's kProducer (then kRowSumMma)


def test_alibi_bias_mma_specs(monkeypatch):
    """bias (prefill::Config::kBiasMma, ALiBi by warpgroup MMAs): on by default for an alibi_slope without a
    logits_transform on Hopper shapes of at most 12 warps with heads per chunk dividing 8, then the plain
    (no-hook) shape; per element (and the hook shape) otherwise; refused by name where it cannot run."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    def bias(spec):
        return spec.params["CONFIG"].split(", ")[-1]
    alibi = W.prefill_spec(V.ALIBI, 128, "bf16", "bf16", 1)
    assert bias(alibi) == "true" and _config(alibi)[4:6] == ["8", "2"], alibi.params["CONFIG"]
    assert bias(W.prefill_spec(V.ALIBI, 128, "bf16", "bf16", 8)) == "true"
    assert bias(W.prefill_spec(V.BUILTIN_VARIANTS["alibi_window"], 128, "bf16", "bf16", 4)) == "true"
    assert bias(W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 1)) == "false"
    # per element: 16 heads a chunk, a logits_transform (soft-cap, which ALiBi follows), fp8 KV's 16 warps
    assert bias(W.prefill_spec(V.ALIBI, 128, "bf16", "bf16", 16)) == "false"
    capped = W.prefill_spec(V.combine(V.SOFT_CAP, V.ALIBI), 128, "bf16", "bf16", 1)
    assert bias(capped) == "false" and _config(capped)[4:6] == ["12", "1"]
    assert bias(W.prefill_spec(V.ALIBI, 128, "bf16", "fp8_e4m3", 1)) == "false"
    assert bias(W.prefill_spec(V.ALIBI, 128, "bf16", "bf16", 1, tuning={"warps": 16, "mfrags": 1, "producer": 0})) == "false"


def test_warp_specialised_prefill_specs(monkeypatch):
    """producer=1 (a producer warpgroup, prefill::Config::kProducer): its own module with the query copy into
    PREFILL_PRODUCER_Q_BUFFERS buffers (or q_buffers >= 2), refused by name where it cannot run (fp8 KV, RoPE,
    mma.sync, GQA groups that do not divide the producer's query rows per copy round, shared memory)."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    ws = {"warps": 12, "mfrags": 1, "producer": 1}
    spec = W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning=ws)
    config = _config(spec)
    # ..., q_buffers, producer, rowsum
    assert config[-2] == "true" and config[-3] == str(W.PREFILL_PRODUCER_Q_BUFFERS) and config[-1] == "true", config
    three = _config(W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={**ws, "stages": 3}))
    assert three[7] == "3" and three[-3] == "2", three  # more stages than query buffers
    assert _config(W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={**ws, "stages": 2, "q_buffers": 3}))[-3] == "3"
    no_producer = {"warps": 12, "mfrags": 1, "producer": 0}
    # row sums by MMA wherever there are warpgroup MMAs; mma.sync: FADD sums
    assert "_rs" in spec.tag
    assert _config(W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={"wgmma": 0, "producer": 0}))[-1] == "false"
    assert spec.memo_key != W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning=no_producer).memo_key
    # member 0 by default where it can (_PREFILL_WS_MEMBER0), any heads per chunk; not with fp8 KV or RoPE
    assert _producer(W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4)) == "true"
    assert _producer(W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, member=1)) == "true"   # 8 x 1 too
    assert _producer(W.prefill_spec(V.SLIDING_WINDOW, 128, "bf16", "bf16", 4, member=1)) == "false"  # hooks: not
    assert _producer(W.prefill_spec(V.ALIBI, 128, "bf16", "bf16", 1, member=1)) == "false"  # the bias MMA: not
    assert _producer(W.prefill_spec(V.DEFAULT, 128, "bf16", "fp8_e4m3", 4)) == "false"
    assert _producer(W.prefill_spec(V.ROPE, 128, "bf16", "bf16", 4)) == "false"
    for group in (3, 5, 6, 7, 16, 64):  # the query copy derives each packed row's (row, head)
        assert _producer(W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", group)) == "true", group
        assert _producer(W.prefill_spec(V.DEFAULT, 96, "bf16", "bf16", group)) == "true", group
    with pytest.raises(ValueError, match="producer=1.*16-bit KV"):
        W.prefill_spec(V.DEFAULT, 128, "bf16", "fp8_e4m3", 4, tuning=ws)
    with pytest.raises(ValueError, match="producer=1.*RoPE"):
        W.prefill_spec(V.ROPE, 128, "bf16", "bf16", 4, tuning=ws)
    # a copy round of 4 rows (head_dim 256) with 8 heads a chunk: rows derived one by one
    assert _producer(W.prefill_spec(V.DEFAULT, 256, "bf16", "bf16", 8, tuning={"warps": 4, "mfrags": 1, "producer": 1})) == "true"
    with pytest.raises(ValueError, match="q_buffers >= 2"):
        W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={**ws, "q_buffers": 1})
    with pytest.raises(ValueError, match="q_buffers 4 .* at most"):  # 4 x 48 KB of queries + 2 stages
        W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={**ws, "stages": 2, "q_buffers": 4})
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "80")
    with pytest.raises(ValueError, match="producer=1.*wgmma=1"):
        W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning=ws)


def test_fa3_member_specs(monkeypatch):
    """tuning fa3 (FlashAttention-3's consumer loop, 2 with ping-pong): its own module (kOverlap, kPingPong at the
    end of the config), row sums by FADD and no bias MMA, the query buffers the producer fills (one at head size
    128, where two do not fit beside three 128-token stages; two at 64), refused by name where it cannot run."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    t128, t64 = W.PREFILL_FA3_TUNINGS[128], W.PREFILL_FA3_TUNINGS[64]

    def cfg(spec):   # every prefill::Config argument
        return spec.params["CONFIG"].split(", ")
    pp = W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning=t128)
    one = W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={**t128, "fa3": 1})
    # ..., q_buffers, producer, rowsum, bias, overlap[, ping-pong]
    assert cfg(pp)[-6:] == ["1", "true", "false", "false", "true", "true"], cfg(pp)
    assert cfg(one)[-5:] == ["1", "true", "false", "false", "true"], cfg(one)
    assert pp.tag.endswith("_fa3pp") and one.tag.endswith("_fa3") and pp.memo_key != one.memo_key
    assert cfg(W.prefill_spec(V.DEFAULT, 64, "bf16", "bf16", 1, tuning=t64))[-6] == "2"
    q1 = W.prefill_spec(V.DEFAULT, 64, "bf16", "bf16", 1, tuning={**t64, "q_buffers": 1})
    assert cfg(q1)[-6] == "1" and q1.tag.endswith("_q1")
    with pytest.raises(ValueError, match="fa3=2 .*warps=8"):
        W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={**t128, "warps": 12})
    with pytest.raises(ValueError, match="fa3=1 .*a variant with softmax"):
        W.prefill_spec(V.ALIBI, 128, "bf16", "bf16", 4, tuning={**t128, "fa3": 1})
    with pytest.raises(ValueError, match="fa3=2 takes q_buffers 1 or 2"):
        W.prefill_spec(V.DEFAULT, 64, "bf16", "bf16", 1, tuning={**t64, "q_buffers": 3})
    with pytest.raises(ValueError, match="fa3 must be 0, 1"):
        W.prefill_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={**t128, "fa3": 3})
    # head sizes 80 and 96 (P.V as a 64-column MMA and a 16- or 32-column one); 256 is refused by name
    assert W.prefill_spec(V.DEFAULT, 96, "bf16", "bf16", 1, tuning=W.PREFILL_FA3_TUNINGS[96]).tag.endswith("_fa3pp")
    with pytest.raises(ValueError, match="fa3=2 .*head_dim 64, 80, 96 or 128"):
        W.prefill_spec(V.DEFAULT, 256, "bf16", "bf16", 2, tuning=t128)


def test_window_member0_runs_four_stages(monkeypatch):
    """A window mask without a logits transform runs member 0 at 12 x 1 with 4 stages (_PREFILL_WS_MEMBER0's
    "window", measured faster in perf/results/ab48s_*.md); soft-cap (alone or with the window) keeps 3, and
    ALiBi + window, whose bias MMA operands leave no room for a fourth stage, falls back to 3."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    def shape(variant, group):
        return W._prefill_shape(128, 2, group, 0, variant)
    for group in (1, 4, 8):
        assert {k: shape(V.SLIDING_WINDOW, group)[k] for k in ("warps", "mfrags", "stages", "producer")} == \
            {"warps": 12, "mfrags": 1, "stages": 4, "producer": 1}
        for name in ("soft_cap", "soft_cap_window", "alibi_window", "custom_mask"):
            got = shape(V.BUILTIN_VARIANTS[name], group)
            assert (got["warps"], got["stages"], got["producer"]) == (12, 3, 1), (name, group, got)
        assert shape(V.DEFAULT, group)["stages"] == 3 and shape(V.DEFAULT, group)["mfrags"] == 2
    assert shape(V.BUILTIN_VARIANTS["alibi_window"], 4)["bias"] == 1
    config = _config(W.prefill_spec(V.SLIDING_WINDOW, 128, "bf16", "bf16", 4))
    assert config[4:8] == ["12", "1", "64", "4"]


def test_member0_rows_hold_whole_tokens(monkeypatch):
    """The default variant's member 0 at 8 x 2 (256 packed rows) unless its heads per chunk cut those rows
    mid-token and 12 x 1's 192 rows hold whole tokens (3, 6, 12 heads: 64, 32, 16 tokens a tile); other
    groups keep 8 x 2, whatever the head size that runs the 128-wide rows (96 too)."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    for head_dim in (96, 128):
        for group in list(range(1, 17)) + [32, 64]:
            got = W._prefill_shape(head_dim, 2, group, 0, V.DEFAULT)
            rows = 16 * got["warps"] * got["mfrags"]
            want = (12, 1) if got["hpc"] in (3, 6, 12) else (8, 2)
            assert (got["warps"], got["mfrags"], got["producer"]) == (*want, 1), (head_dim, group, got)
            assert rows % got["hpc"] == 0 or 192 % got["hpc"], (head_dim, group, rows)
    assert W._prefill_shape(128, 2, 3, 0, V.BUILTIN_VARIANTS["soft_cap"])["warps"] == 12   # hooks: 12 x 1 anyway


def test_pick_member_takes_large_tiles_in_whole_waves():
    """plan()'s tile pick: the large tile when each CTA gets FAMILY_TILES_PER_CTA of them or they fill whole
    waves of CTAs; the small one when large tiles would leave CTAs idle (the H100 measurements in
    wrappers.py: 1x2048 and 16x128 large, 8x300 and 1x1291 small, at 64 / 32 query rows and 16 CTAs)."""
    from types import SimpleNamespace
    fake = SimpleNamespace(_family=[SimpleNamespace(rows_per_tile=64), SimpleNamespace(rows_per_tile=32)],
                           grid=(128, 1), num_units=8)  # 16 CTAs per unit's share, as measured
    pick = lambda lens: W.BatchAttention._pick_member(fake, torch.tensor(lens, dtype=torch.int32))  # noqa: E731
    assert pick([2048]) == 0 and pick([128] * 16) == 0 and pick([1291] * 4) == 0 and pick([64] * 64) == 0
    assert pick([300] * 8) == 1 and pick([1291]) == 1 and pick([512]) == 1 and pick([256]) == 1
    # every request in half the large tile or less: the small one (200 x 1, 64 x 17 measured), unless a request
    # of the step is longer (a mixed step's chunk)
    assert pick([1] * 200) == 1 and pick([17] * 64) == 1 and pick([32] * 128) == 1
    assert pick([33] * 128) == 0 and pick([2048] + [1] * 64) == 0
    # a step with shared-prefix groups: the small one, whatever its lengths
    grouped = lambda lens: W.BatchAttention._pick_member(fake, torch.tensor(lens, dtype=torch.int32), True)  # noqa: E731
    assert grouped([1] * 512) == 1 and grouped([2048] * 8) == 1 and grouped([]) == 1
