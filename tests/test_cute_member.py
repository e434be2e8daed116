"""fi_backend.cute_member on the CPU: which wrappers load the CuTe member (and why not), and which steps it takes."""
from __future__ import annotations

import torch

from fi_backend import cute_member as C
from fi_backend import variants as V

CPU = torch.device("cpu")


def _why(**kw):
    args = dict(variant=V.DEFAULT, head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=16,
                device=CPU)
    args.update(kw)
    return C.unsupported(args.pop("variant"), args.pop("head_dim"), args.pop("q_dtype"), args.pop("kv_dtype"),
                         args.pop("page_size"), args.pop("device"), **args)


def test_unsupported_names_the_reason(monkeypatch):
    assert "PREFILL_CUTE" in (monkeypatch.setenv("FI_BACKEND_PREFILL_CUTE", "0") or _why())
    monkeypatch.delenv("FI_BACKEND_PREFILL_CUTE")
    assert "tuning" in _why(tuning={"warps": 8})
    assert "deterministic" in _why(deterministic=True)
    for variant in (V.ALIBI, V.SIGMOID, V.ROPE, V.CUSTOM_MASK, V.BUILTIN_VARIANTS["alibi_window"]):
        assert f"variant {variant.name}" in _why(variant=variant)
    assert "head_dim 80" in _why(head_dim=80)
    assert "head_dim 192" in _why(head_dim=192)
    assert "KV dtype" in _why(kv_dtype=torch.float8_e4m3fn)
    for page in (-1, 24, 512):
        assert f"page_size {page}" in _why(page_size=page)
    assert "page_size" not in _why(page_size=0)  # 0: ragged K / V (a BatchAttention made with ragged=True)
    # pages of fewer than 16 tokens: refused, unless gathered (below GATHER_BELOW: off by default, slower than the
    # TMA boxes and the tile family, docs/prefill.md)
    for page in (1, 8):
        assert f"page_size {page} (the member takes ragged K / V, a BatchAttention made with ragged=True, or pages " \
            "of 16..256" in _why(page_size=page)
    monkeypatch.setattr(C, "GATHER_BELOW", 16)
    assert C.gathers(1) and C.gathers(8) and not C.gathers(16) and "page_size" not in _why(page_size=1)
    assert "sm_90" in _why()  # this machine's device is the CPU


def test_variants_it_computes():
    """The default, the window, the soft-cap and both (built-ins compared as values: a combine() of the same parts
    is the same variant); a soft-cap is the modules' template parameter, a window is not."""
    for variant in (V.DEFAULT, V.SLIDING_WINDOW, V.SOFT_CAP, V.combine(V.SOFT_CAP, V.SLIDING_WINDOW)):
        assert C._supported(variant)
    assert not C._supported(V.ALIBI) and not C._supported(V.combine(V.SLIDING_WINDOW, V.SOFT_CAP))  # other order
    tags = lambda v: [s.tag for s in C.specs(128, torch.bfloat16, 16, v)]  # noqa: E731
    assert tags(V.DEFAULT) == tags(V.SLIDING_WINDOW) and all("_so0_" in t for t in tags(V.DEFAULT))
    assert tags(V.SOFT_CAP) == tags(V.BUILTIN_VARIANTS["soft_cap_window"]) and all("_so1_" in t for t in tags(V.SOFT_CAP))


class _Member(C.CuteMember):
    def __init__(self, heads=32, kv_heads=8, sms=132, softcap=False, wide=False):  # the step rule only: no modules
        self.heads, self.kv_heads, self.sms, self._step, self.softcap = heads, kv_heads, sms, None, softcap
        self.wide, self._stage_rows, self._staged = wide, 0, None


def _t(xs):
    return torch.tensor(xs, dtype=torch.int32)


def test_takes_step():
    m = _Member()
    assert m.plan(_t([1000, 333]), _t([1000, 2000]), causal=True, window_left=2047)
    assert m.planned and m._step == (1, 2, 1000, 1333, 3000, 2047, 0.0)
    # a window narrower than WINDOW_MIN_KEYS and than the longest KV goes to the family; one covering every KV does not
    assert not m.plan(_t([1000, 333]), _t([1000, 2000]), causal=True, window_left=99) and not m.planned
    assert m.plan(_t([1000, 333]), _t([1000, 1200]), causal=True, window_left=1199)
    assert not m.plan(_t([1000, 333]), _t([1000, 1200]), causal=True, window_left=1198)
    assert not m.takes_step(_t([1000, 333]), _t([1000, 1200]), True, 1198)   # what cute_takes asks, for adapters
    assert m.takes_step(_t([1000, 333]), _t([1000, 1200]), True, 1199) and m.takes_step(_t([1000]), _t([3000]), True)
    # too few tiles for 132 SMs: 1 x 32 heads (0.4 an SM: at least 53); 2 x 32 heads are enough
    assert not m.plan(_t([128]), _t([128]), causal=True) and not m.planned
    assert m.plan(_t([200]), _t([200]), causal=True)
    assert not m.plan(_t([200]), _t([200]), causal=True, allowed=False) and not m.planned
    # KV shorter than the queries (causal), an empty KV (any mask)
    assert not m.plan(_t([1000, 500]), _t([1000, 400]), causal=True)
    assert not m.plan(_t([1000, 500]), _t([1000, 0]), causal=False)
    assert m.plan(_t([1000, 500]), _t([1000, 400]), causal=False)
    # a request with no query rows this step is no obstacle
    assert m.plan(_t([1000, 0]), _t([1000, 0]), causal=True)
    # decode rows: a few ride along, many go to the tile family
    assert m.plan(_t([4000] + [1] * 4), _t([4000] + [2000] * 4), causal=True)
    assert not m.plan(_t([700] + [1] * 60), _t([1500] + [900] * 60), causal=True)
    # ... unless there is no GQA to pack: then the family's tiles of decode rows are no fuller than the member's
    assert _Member(kv_heads=32).plan(_t([700] + [1] * 60), _t([1500] + [900] * 60), causal=True)
    assert not m.plan(_t([1000]), _t([1000]), causal=True, allowed=False)
    assert not m.plan(_t([]), _t([]), causal=True)
    # a soft-capping member with no cap (> 0) leaves the step to the family
    # head size 64 (wide): steps of long prompts on the modules of three warpgroups (2: non-causal, 3: causal)
    wide = _Member(wide=True)
    assert wide.plan(_t([16384]), _t([16384]), causal=True) and wide._step[0] == 3
    assert wide.plan(_t([16384, 0]), _t([16384, 5]), causal=False) and wide._step[0] == 2  # empty rows: not counted
    assert wide.plan(_t([4096] * 4), _t([4096] * 4), causal=True) and wide._step[0] == 1
    assert m.plan(_t([16384]), _t([16384]), causal=True) and m._step[0] == 1  # not wide: two warpgroups
    capped = _Member(softcap=True)
    assert not capped.plan(_t([1000]), _t([1000]), causal=True, logits_soft_cap=0.0)
    assert capped.plan(_t([1000]), _t([1000]), causal=True, logits_soft_cap=30.0) and capped._step[-1] == 30.0


def test_modules_of_names_the_members_modules(monkeypatch):
    """models.modules_of (fi-backend build --model, CI's zoo build) adds the member's two modules (four at head size
    64) for a plain model of head size 64 / 128 and 16-bit KV, per page size and for ragged K / V (the adapters'
    steps of new prompts), where modules are built for sm_90a alone and CUTLASS's headers are installed; none for a
    model with hooks, other architectures or the switch off."""
    import pytest
    pytest.importorskip("cutlass_library")
    from fi_backend import models
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    cute = lambda m, **kw: [s.tag for s in models.modules_of(models.find(m), **kw) if s.family == "cute_attn_ws"]
    assert cute("Llama-3.1-8B") == ["d128_bf1_ca0_ga0_la1_ov1_pa16_pi1_so0_sp1_st2_vb1_wa2",
                                    "d128_bf1_ca1_ga0_la1_ov1_pa16_pi1_so0_sp1_st2_vb1_wa2",
                                    "d128_bf1_ca0_ga0_la1_ov1_pa0_pi1_so0_sp1_st2_vb1_wa2",
                                    "d128_bf1_ca1_ga0_la1_ov1_pa0_pi1_so0_sp1_st2_vb1_wa2"]
    # a paged wrapper stages its steps of many queries a key into rows for the ragged modules (cute_member.stages)
    assert cute("Llama-3.1-8B", ragged=False) == cute("Llama-3.1-8B")
    monkeypatch.setenv("FI_BACKEND_PREFILL_STAGE", "0")
    assert cute("Llama-3.1-8B", ragged=False) == cute("Llama-3.1-8B")[:2]
    # head size 64: two warpgroups and three (steps of long prompts), per page size; ping-pong + lazy on pages only
    assert [t[-3:] for t in cute("Llama-3.2-1B", ragged=False)] == ["wa2", "wa2", "wa3", "wa3"]
    assert all("_pi1_" in t and "_la1_" in t for t in cute("Llama-3.2-1B", ragged=False))
    monkeypatch.delenv("FI_BACKEND_PREFILL_STAGE")
    assert len(cute("Qwen2.5-0.5B", page_sizes=(16, 32))) == 12 and cute("Llama-3.2-1B")[0].startswith("d64_")
    assert ["_pa0_pi0_" in t for t in cute("Llama-3.2-1B", ragged=False)] == [False] * 4 + [True] * 4
    assert len(cute("Gemma-2-9B")) == 4 and all(t.startswith("d256_") for t in cute("Gemma-2-9B"))
    assert len(cute("Gemma-2-27B")) == 4 and all("_so1_" in t for t in cute("Gemma-2-27B"))  # soft-cap (+ window)
    assert cute("Mistral-7B") == cute("Llama-3.1-8B")  # a window: the same modules
    monkeypatch.setenv("FI_BACKEND_PREFILL_CUTE", "0")
    assert cute("Llama-3.1-8B") == []
    monkeypatch.delenv("FI_BACKEND_PREFILL_CUTE")
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a 100a")
    assert cute("Llama-3.1-8B") == []


def test_wrappers_modules_are_prepared_in_parallel(monkeypatch, capsys):
    """BatchAttention.module_specs names what a wrapper loads (the tile family; for prefill on pages the member
    takes, the member's two modules too); BatchAttention.prepare builds both kernels' modules in one parallel
    kernels.prepare (duplicates once, at most PREPARE_JOBS at a time), one line per module built, none cached."""
    import pytest
    pytest.importorskip("cutlass_library")
    from fi_backend import kernels
    from fi_backend.kernels import builder
    from fi_backend.specs import attention_specs
    from fi_backend.wrappers import BatchAttention
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    monkeypatch.delenv("FI_BACKEND_QUIET", raising=False)
    tags = lambda specs: [(s.family, s.tag) for s in specs]
    family = attention_specs(V.DEFAULT, 128, "bf16", "bf16", 4, kernel="prefill")
    paged = BatchAttention.module_specs(32, 8, 128, page_size=16, kernel="prefill")
    assert tags(paged) == tags(family + C.specs(128, torch.bfloat16, 16))
    # pages of one token: the tile family only, or with gathering on the gathering member's modules too
    assert tags(BatchAttention.module_specs(32, 8, 128, page_size=1, kernel="prefill")) == tags(family)
    monkeypatch.setattr(C, "GATHER_BELOW", 16)
    one = BatchAttention.module_specs(32, 8, 128, page_size=1, kernel="prefill")
    assert tags(one) == tags(family + C.specs(128, torch.bfloat16, 1)) and all("_ga1_" in s.tag for s in one[-2:])
    monkeypatch.setattr(C, "GATHER_BELOW", 0)
    assert tags(BatchAttention.module_specs(32, 8, 128, page_size=1, kernel="decode")) == tags(
        attention_specs(V.DEFAULT, 128, "bf16", "bf16", 4, kernel="decode"))
    assert tags(BatchAttention.module_specs(32, 8, 128, kv_dtype=torch.float8_e4m3fn, kernel="prefill")) == tags(
        attention_specs(V.DEFAULT, 128, "bf16", "fp8_e4m3", 4, kernel="prefill"))
    decode = BatchAttention.module_specs(32, 8, 128, kernel="decode")
    assert tags(decode) == tags(attention_specs(V.DEFAULT, 128, "bf16", "bf16", 4, kernel="decode"))

    calls = []

    def fake_build_many(specs, *, jobs, quiet, on_done):
        calls.append((tags(specs), jobs, quiet))
        results = [builder.BuildResult(f"m{i}", None, i % 2 == 0, 1.5) for i in range(len(specs))]
        for s, r in zip(specs, results):
            on_done(s, r)
        return results

    monkeypatch.setattr(builder, "build_many", fake_build_many)
    monkeypatch.setattr(builder.os, "cpu_count", lambda: 64)
    BatchAttention.prepare(32, 8, 128, page_size=16)
    ((built, jobs, quiet),) = calls
    assert built == tags(decode + paged) and jobs == builder.PREPARE_JOBS and quiet is True
    err = capsys.readouterr().err
    assert f"{len(built)} kernel modules" in err and err.count("fi-backend: built ") == (len(built) + 1) // 2
    kernels.prepare(decode + decode)   # duplicates: once
    assert calls[-1][0] == tags(decode)
    capsys.readouterr()
    monkeypatch.setenv("FI_BACKEND_QUIET", "1")
    kernels.prepare(decode)
    assert capsys.readouterr().err == ""


def test_staging_rule(monkeypatch):
    """Which pages the member stages (16..127 tokens, boxes not gathers, the switch on) and the reuse a step's
    staged key gets: group x (query, key) pairs over whole pages' rows, the figure STAGE_MIN_REUSE bounds."""
    assert C.stages(16, 128) and C.stages(64, 128) and not C.stages(128, 128) and not C.stages(0, 128)
    assert not C.stages(8, 128) and C.stages(32, 256) and not C.stages(64, 256)  # 64-key tiles at 256: one box
    monkeypatch.setattr(C, "GATHER_BELOW", 32)
    assert not C.stages(16, 128) and C.stages(32, 128)
    monkeypatch.setenv("FI_BACKEND_PREFILL_STAGE", "0")
    assert not C.stages(32, 128)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    # the probe's cells: 16 x 1k causal at 32/8 (group 4) reuses a key 2050 times, 4 x 4k 8194, at 32/32 a quarter
    assert C.stage_reuse(i64([1024] * 16), i64([1024] * 16), True, 4, 16) == 4 * 1025 / 2
    assert C.stage_reuse(i64([4096] * 4), i64([4096] * 4), True, 1, 16) == 4097 / 2
    assert C.stage_reuse(i64([4096] * 4), i64([4096] * 4), False, 1, 16) == 4096
    # a 2048-row chunk over 16k cached keys: about the chunk's rows x group; a partial page counts whole
    assert C.stage_reuse(i64([2048]), i64([18432]), True, 4, 16) == 4 * (2048 * 18432 - 2048 * 2047 // 2) / 18432
    assert C.stage_reuse(i64([1]), i64([17]), True, 4, 16) == 4 * 17 / 32
    # the bound: 3072 at head size 128 on pages of 16, a third at 64, twice on pages of 32
    assert C.stage_min_reuse(128, 16) == 3072 and C.stage_min_reuse(64, 16) == 1024
    assert C.stage_min_reuse(256, 32) == 6144 and C.stage_min_reuse(96, 64) == 12288
    # a window: each row's keys at most window_left + 1 (brute force over rows and keys); a request without query
    # rows stages nothing
    def brute(q, kv, causal, w):
        n = 0
        for qi, ki in zip(q, kv):
            for i in range(qi):
                hi = ki - qi + i if causal else ki - 1
                lo = max(0, hi - w) if w >= 0 else 0
                n += hi - lo + 1 if causal else (min(ki, w + 1) if w >= 0 else ki)
        return n
    for q, kv, causal, w in (([300, 5, 77], [4100, 900, 77], True, 1000), ([300, 5], [4100, 900], True, -1),
                             ([40], [40], True, 10), ([300, 7], [1000, 2000], False, 511), ([3], [9], True, 0)):
        rows = sum(-(-k // 16) * 16 for qi, k in zip(q, kv) if qi > 0)
        assert C.stage_reuse(i64(q), i64(kv), causal, 2, 16, w) == 2 * brute(q, kv, causal, w) / rows, (q, kv, w)
    assert C.stage_pages(i64([0, 5, 3]), i64([100, 17, 16]), 16).tolist() == [0, 2, 1]
    # decode rows riding along add keys and almost no pairs
    assert C.stage_reuse(i64([2048] + [1] * 64), i64([18432] + [16384] * 64), True, 4, 16) < C.STAGE_MIN_REUSE
