"""The prefill family's CuTe member (fi_backend.cute_member) through BatchAttention: model shapes of several GQA groups,
head sizes 64 and 128, pages of 16..256 tokens, the cache layouts, bf16 and fp16, chunked-prefill lengths, against
the float64 reference with the slots no request reads poisoned (NaN); the steps it leaves to the tile family; CUDA
graph capture (the family's kernel goes into the graph). Needs an sm_90a GPU and the nvidia-cutlass wheel."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from attention_cases import DEV, TOL, make_bsr, plan_run_check, poison_unused, random_kv, replay_check
from fi_backend import variants as V

pytestmark = pytest.mark.gpu
CUTE_MEMBER = True  # conftest: the member stays on in this file


@pytest.fixture(scope="module", autouse=True)
def _built(request):
    """The modules the collected tests load (the member's and the tile family's), built in parallel first: one at a
    time, as wrappers are made, the member's take about 40 s each. All of them for the whole file, a few for a -k
    selection."""
    if importlib.util.find_spec("cutlass_library") is None or not torch.cuda.is_available():
        return
    from fi_backend import cute_member, kernels
    from fi_backend.specs import attention_specs
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    bf16 = torch.bfloat16
    # test name -> its (variant, query heads, KV heads, head size, page (0: ragged), dtype, how the test sets the
    # member: "gather" (GATHER_BELOW), "lazy" (schedule), or "") from its params
    of = {
        "test_member_matches_reference": lambda p: [(V.DEFAULT, p["Hq"], p["Hkv"], p["D"], p["page"], p["dtype"], 0)],
        "test_member_stages_pages": lambda p: [(V.DEFAULT, p["Hq"], p["Hkv"], p["D"], p["page"], p["dtype"], 0)],
        "test_member_stages_variants": lambda p: [(_VARIANTS[p["name"]][0], 32, 16, 128, 16, bf16, 0)],
        "test_member_wide_steps": lambda p: [(V.DEFAULT, 4, 1, 64, 16, bf16, 0)],
        "test_member_gathers": lambda p: [(V.DEFAULT, p["Hq"], p["Hkv"], p["D"], p["page"], bf16, "gather")],
        "test_member_lazy_rescale": lambda p: [(_VARIANTS[p["name"]][0] if p["name"] else V.DEFAULT, p["Hq"], p["Hkv"],
                                                p["D"], p["page"], bf16, "lazy")],
        "test_narrow_window_goes_to_the_family": lambda p: [(V.SLIDING_WINDOW, 32, 8, p["D"], 16, bf16, 0)],
        "test_member_variants": lambda p: [(_VARIANTS[p["name"]][0], p["Hq"], p["Hkv"], p["D"], 16, bf16, 0)],
        "test_member_ragged": lambda p: [(V.DEFAULT, p["Hq"], p["Hkv"], p["D"], 0, p["dtype"], 0)],
        "test_member_ragged_variants": lambda p: [(_VARIANTS[p["name"]][0], p["Hq"], p["Hkv"], p["D"], 0, bf16, 0)],
        "test_ragged_wrapper_refuses_other_bsrs": lambda p: [(V.DEFAULT, 32, 8, 128, 0, bf16, 0)],
        "test_ragged_bad_bsr_is_flagged": lambda p: [(V.DEFAULT, 32, 8, 128, 0, bf16, 0)],
        "test_member_ragged_key_of_its_own": lambda p: [(V.DEFAULT, p["Hq"], p["Hkv"], p["D"], 0, p["dtype"], 0)],
        "test_ragged_different_strides_off_the_member": lambda p: [(V.DEFAULT, 32, 8, 128, 0, bf16, 0)],
        "test_bad_bsr_is_flagged_and_never_read_past":
            lambda p: [(V.DEFAULT, 32, 8, 128, 16, bf16, "gather" if p["how"] == "gather" else 0)],
    }
    default = [(V.DEFAULT, 32, 8, 128, 16, bf16, 0)]  # the other tests' wrappers
    wanted = []
    for item in request.session.items:
        if item.module is request.module:
            params = getattr(getattr(item, "callspec", None), "params", {})
            wanted += of.get(getattr(item, "originalname", item.name), lambda p: default)(params)
    specs = {}
    for variant, Hq, Hkv, D, page, dtype, how in wanted:  # (specs, by memo_key, come once)
        saved = cute_member.GATHER_BELOW, cute_member.schedule
        if how == "gather":
            cute_member.GATHER_BELOW = _GATHER_BELOW
        if how == "lazy":
            cute_member.schedule = _LAZY_SCHEDULE
        try:
            for s in cute_member.specs(D, dtype, page, variant) + attention_specs(
                    variant, D, names[dtype], names[dtype], Hq // Hkv, None, "prefill", False):
                specs[s.memo_key] = s
        finally:
            cute_member.GATHER_BELOW, cute_member.schedule = saved
    failed = [(s.tag, r) for s, r in zip(specs.values(), kernels.build_many(list(specs.values())))
              if isinstance(r, Exception)]
    assert not failed, f"modules failed to build: {failed}"


def _wrapper(Hq, Hkv, D, *, page, dtype=torch.bfloat16, layout="NHD", max_tokens=8192, variant=None, ragged=False):
    if importlib.util.find_spec("cutlass_library") is None:
        pytest.skip("the nvidia-cutlass wheel is not installed")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a only")
    from attention_cases import make_wrapper
    return make_wrapper(Hq, Hkv, D, q_dtype=dtype, page_size=page, kv_layout=layout, kernel="prefill",
                        max_tokens=max_tokens, variant=variant or V.DEFAULT, ragged=ragged)


# (query heads, KV heads, head size, page, dtype, layout, packed, causal): Llama-3.1-8B, Qwen2.5-7B (group 7),
# Qwen2.5-14B (5), Llama-3.2-3B (3) at head size 64, MHA, an fp16 non-causal one, head size 96, HND and packed caches
_SHAPES = [
    (32, 8, 128, 16, torch.bfloat16, "NHD", False, True),
    (28, 4, 128, 16, torch.bfloat16, "NHD", True, True),
    (40, 8, 128, 32, torch.float16, "HND", False, True),
    (24, 8, 64, 64, torch.bfloat16, "NHD", False, True),
    (16, 16, 64, 256, torch.float16, "NHD", True, True),
    (12, 2, 128, 128, torch.float16, "NHD", False, False),
    (32, 32, 96, 16, torch.bfloat16, "NHD", True, True),   # Phi-3-mini / Phi-3.5-mini (64-byte swizzle atoms)
    (24, 8, 96, 64, torch.float16, "HND", False, False),
    (8, 4, 256, 16, torch.bfloat16, "NHD", False, True),    # Gemma-3-4B's global layers (64-token KV tiles)
    (16, 8, 256, 64, torch.float16, "NHD", True, False),
]
# chunked prefill and prefix hits: KV longer than the queries, none a multiple of a page or a tile
_Q_LENS = [1000, 333, 517, 129, 77]
_KV_LENS = [1000, 410, 2017, 132, 3001]


def _check_step(attn, q_lens, kv_lens, *, dtype=torch.bfloat16, packed=False, causal=True, what="", params=None):
    """One step of these lengths over a fresh cache whose unread slots hold NaN, against the reference (params: the
    variant's, given to plan() and the reference alike)."""
    bsr, qo_cpu, kv_cpu, nb = make_bsr(kv_lens, q_lens, attn.page_size)
    cache, k, v = random_kv(nb, attn.page_size, attn.num_kv_heads, attn.head_dim, dtype, layout=attn.kv_layout,
                            packed=packed)
    poison_unused(k, v, bsr)
    plan_run_check(attn, bsr, qo_cpu, kv_cpu, cache, k, v, dtype=dtype, kv_dtype=dtype, causal=causal, what=what,
                   plan_kw=params, ref_kw=params)


@pytest.mark.parametrize("Hq,Hkv,D,page,dtype,layout,packed,causal", _SHAPES)
def test_member_matches_reference(Hq, Hkv, D, page, dtype, layout, packed, causal):
    attn = _wrapper(Hq, Hkv, D, page=page, dtype=dtype, layout=layout)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    _check_step(attn, _Q_LENS, _KV_LENS, dtype=dtype, packed=packed, causal=causal,
                what=f"{Hq}/{Hkv} D={D} page={page} {layout}{' packed' if packed else ''} causal={causal}")
    assert attn.cute_step, "the step should have run on the CuTe member"


@pytest.mark.parametrize("causal", [True, False])
def test_member_wide_steps(causal):
    """Head size 64: a step whose requests average WIDE_MIN_QUERY query rows or more runs the CTA of three consumer
    warpgroups (192-row query tiles), here with a request of rows not a multiple of 192 and a short one beside it."""
    from fi_backend import cute_member
    attn = _wrapper(4, 1, 64, page=16, max_tokens=26000)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    q_lens = [cute_member.WIDE_MIN_QUERY + 4000, cute_member.WIDE_MIN_QUERY + 3000, 2000]
    _check_step(attn, q_lens, [q + 37 for q in q_lens], causal=causal, what=f"wide causal={causal}")
    assert attn.cute_step and attn._cute._step[0] == int(causal) + 2, "the step should have run three warpgroups"


@pytest.mark.parametrize("Hq,Hkv,D,page,dtype,layout,packed,causal",
                         [s for s in _SHAPES if 16 <= s[3] < 128])
def test_member_stages_pages(monkeypatch, Hq, Hkv, D, page, dtype, layout, packed, causal):
    """Every step staged (STAGE_MIN_REUSE 0): the pages copied into rows, the slots past each request's KV written as
    zeros (here NaN in the cache: 0 x NaN in P.V would show), then the ragged CTA over the rows, against the
    reference; the same wrapper's next step below the reuse bound reads its pages again."""
    from fi_backend import cute_member
    monkeypatch.setattr(cute_member, "STAGE_MIN_REUSE", 0)
    attn = _wrapper(Hq, Hkv, D, page=page, dtype=dtype, layout=layout)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    what = f"staged {Hq}/{Hkv} D={D} page={page} {layout}{' packed' if packed else ''} causal={causal}"
    _check_step(attn, _Q_LENS, _KV_LENS, dtype=dtype, packed=packed, causal=causal, what=what)
    assert attn.cute_step and attn.cute_staged
    monkeypatch.setattr(cute_member, "STAGE_MIN_REUSE", 1 << 60)
    _check_step(attn, _Q_LENS, _KV_LENS, dtype=dtype, packed=packed, causal=causal, what=what + " unstaged")
    assert attn.cute_step and not attn.cute_staged


@pytest.mark.parametrize("name", ["window", "soft_cap_window"])
def test_member_stages_variants(monkeypatch, name):
    """Staged pages with the window (its KV tiles skipped on the staged rows) and the soft-cap + window."""
    from fi_backend import cute_member
    monkeypatch.setattr(cute_member, "STAGE_MIN_REUSE", 0)
    variant, params = _VARIANTS[name]
    attn = _wrapper(32, 16, 128, page=16, variant=variant)
    _check_step(attn, _Q_LENS, _KV_LENS, params=params, what=f"staged {name}")
    assert attn.cute_step and attn.cute_staged


def test_staging_bound(monkeypatch):
    """A step with more staged rows than the wrapper's STAGE_BYTES holds reads its pages, right; the rule's reuse
    bound decides by default (these lengths' reuse is below it); the rows grow with a larger step, the start offsets
    with a batch of more than 256 requests."""
    from fi_backend import cute_member
    attn = _wrapper(32, 8, 128, page=16)
    _check_step(attn, _Q_LENS, _KV_LENS, what="default reuse bound")
    assert attn.cute_step and not attn.cute_staged
    monkeypatch.setattr(cute_member, "STAGE_MIN_REUSE", 0)
    monkeypatch.setattr(cute_member, "STAGE_BYTES", 2 * 8 * 128 * 2 * 4096)  # 4096 rows: fewer than these steps'
    small = _wrapper(32, 8, 128, page=16)
    assert small._cute._stage_rows == 4096 and small._cute._stage_kv is None  # made by the first staged step
    _check_step(small, _Q_LENS, _KV_LENS, what="past the staging bound")
    assert small.cute_step and not small.cute_staged
    _check_step(small, [1000, 333], [1000, 410], what="within the staging bound")
    assert small.cute_staged and small._cute._stage_kv.shape[1] == 4096
    monkeypatch.setattr(cute_member, "STAGE_BYTES", 256 << 20)
    grows = _wrapper(32, 8, 128, page=16, max_tokens=17000)
    _check_step(grows, [1000, 333], [1000, 410], what="first staged step")
    assert grows.cute_staged and grows._cute._stage_kv.shape[1] == 4096
    _check_step(grows, _Q_LENS, _KV_LENS, what="a larger staged step")  # 6560 rows
    assert grows.cute_staged and grows._cute._stage_kv.shape[1] == 8192
    _check_step(grows, [64] * 260, [100 + i % 37 for i in range(260)], what="260 requests staged")
    assert grows.cute_staged and grows._cute._start_dev.numel() >= 261


def test_staged_requests_without_queries(monkeypatch):
    """Requests with no query rows this step (one with KV, one empty) get no staged pages: their table entries are
    never read, so bad ones there are not flagged (as on pages); the others' results are right."""
    from fi_backend import cute_member
    monkeypatch.setattr(cute_member, "STAGE_MIN_REUSE", 0)
    attn = _wrapper(32, 8, 128, page=16)
    q_lens, kv_lens = [1000, 0, 333, 0, 77], [1000, 500, 410, 0, 3001]
    bsr, qo_cpu, kv_cpu, nb = make_bsr(kv_lens, q_lens, 16)
    cache, k, v = random_kv(nb, 16, 8, 128, torch.bfloat16)
    poison_unused(k, v, bsr)
    start = int(bsr.kv_block_start[1])
    bsr.kv_indices[start:start + 32] = nb + 1000  # request 1's pages: outside the cache, never to be read
    plan_run_check(attn, bsr, qo_cpu, kv_cpu, cache, k, v, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                   causal=True, what="staged, requests without queries")
    assert attn.cute_staged and attn._cute._staged == (1000 + 15) // 16 + (410 + 15) // 16 + (3001 + 15) // 16
    attn.check_errors()


# (query heads, KV heads, head size, page) gathered with GATHER_BELOW = _GATHER_BELOW
_GATHER_SHAPES = [(32, 8, 128, 1), (32, 8, 128, 16), (28, 4, 128, 1), (32, 32, 96, 1), (8, 4, 256, 16), (24, 8, 64, 1),
                  (24, 8, 64, 32)]
_GATHER_BELOW = 128


@pytest.mark.parametrize("Hq,Hkv,D,page", _GATHER_SHAPES)
def test_member_gathers(monkeypatch, Hq, Hkv, D, page):
    """Pages below GATHER_BELOW: the producer warpgroup's threads gather K / V rows (pages of one token, SGLang's,
    included), against the reference on the chunked-prefill lengths; the modules are the gathering ones."""
    from fi_backend import cute_member
    monkeypatch.setattr(cute_member, "GATHER_BELOW", _GATHER_BELOW)
    attn = _wrapper(Hq, Hkv, D, page=page)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    assert all("_ga1_" in name for name in attn._cute.module_names), attn._cute.module_names
    _check_step(attn, _Q_LENS, _KV_LENS, what=f"gather {Hq}/{Hkv} D={D} page={page}")
    assert attn.cute_step


_VARIANTS = {"window": (V.SLIDING_WINDOW, {"window_left": 2047}),     # its KV tiles skipped in the 3001-token one
             "window_wide": (V.SLIDING_WINDOW, {"window_left": 4095}),    # wider than every request: nothing skipped
             "soft_cap": (V.SOFT_CAP, {"logits_soft_cap": 5.0}),           # low: the cap changes the logits
             "soft_cap_window": (V.BUILTIN_VARIANTS["soft_cap_window"], {"logits_soft_cap": 5.0, "window_left": 2100}),
             "window_narrow": (V.SLIDING_WINDOW, {"window_left": 299})}   # below cute_member.WINDOW_MIN_KEYS
# (variant, query heads, KV heads, head size): Mistral-7B's window, Gemma-2-27B's soft-cap + window, Phi-3-mini's
# window at head size 96, Gemma-2-9B's soft-cap + window at 256
_VARIANT_SHAPES = [("window", 32, 8, 128), ("window_wide", 32, 8, 128), ("soft_cap", 32, 16, 128),
                   ("soft_cap_window", 32, 16, 128), ("window", 32, 32, 96), ("soft_cap_window", 16, 8, 256)]


@pytest.mark.parametrize("name,Hq,Hkv,D", _VARIANT_SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_member_variants(name, Hq, Hkv, D, causal):
    """The sliding window (KV tiles below every row's window skipped, the rest masked per row) and the soft-cap (a
    template parameter), alone and together, against the reference on the same chunked-prefill lengths."""
    variant, params = _VARIANTS[name]
    attn = _wrapper(Hq, Hkv, D, page=16, variant=variant)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    _check_step(attn, _Q_LENS, _KV_LENS, causal=causal, params=params, what=f"{name} {Hq}/{Hkv} D={D} causal={causal}")
    assert attn.cute_step


@pytest.mark.parametrize("D", [128, 256])
def test_narrow_window_goes_to_the_family(D):
    """A window narrower than cute_member.WINDOW_MIN_KEYS and than the step's longest KV: the tile family runs the
    step (the member was slower there), right against the reference; the same wrapper's next step without a window
    that narrow goes back to the member."""
    variant, params = _VARIANTS["window_narrow"]
    attn = _wrapper(32, 8, D, page=16, variant=variant)
    _check_step(attn, _Q_LENS, _KV_LENS, params=params, what=f"narrow window D={D}")
    assert not attn.cute_step
    _check_step(attn, _Q_LENS, _KV_LENS, params=_VARIANTS["window"][1], what=f"window D={D}")
    assert attn.cute_step


def _LAZY_SCHEDULE(head_dim, paged):  # test_member_lazy_rescale's cute_member.schedule: lazy, no ping-pong
    return False, True


@pytest.mark.parametrize("name,Hq,Hkv,D,page", [(None, 32, 8, 128, 16), (None, 24, 8, 64, 64), (None, 8, 4, 256, 16),
                                                 (None, 32, 32, 96, 16), ("soft_cap_window", 32, 16, 128, 16)])
def test_member_lazy_rescale(monkeypatch, name, Hq, Hkv, D, page):
    """attn_ws.cu LAZY without the ping-pong in every member module (cute_member.schedule has both at head size 128
    only): the member's modules keep a row's maximum until it grows by more than 2^8 and skip O's rescale where a
    warp's rows kept theirs; the same results as the reference, causal and not, a variant too (the CTA's own test has
    keys that raise the maximum tile after tile)."""
    from fi_backend import cute_member
    monkeypatch.setattr(cute_member, "schedule", _LAZY_SCHEDULE)
    variant, params = _VARIANTS[name] if name else (None, None)
    attn = _wrapper(Hq, Hkv, D, page=page, variant=variant)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    assert all("_la1_" in n for n in attn._cute.module_names), attn._cute.module_names
    for causal in (True, False):
        _check_step(attn, _Q_LENS, _KV_LENS, causal=causal, params=params,
                    what=f"lazy {name} {Hq}/{Hkv} D={D} page={page} causal={causal}")
        assert attn.cute_step


# (query heads, KV heads, head size, dtype, causal) of ragged wrappers: the same models' shapes
_RAGGED_SHAPES = [(32, 8, 128, torch.bfloat16, True), (28, 4, 128, torch.bfloat16, True),
                  (24, 8, 64, torch.bfloat16, True), (32, 32, 96, torch.float16, True),
                  (8, 4, 256, torch.bfloat16, True), (12, 2, 128, torch.float16, False),
                  (40, 8, 128, torch.bfloat16, False),
                  (12, 12, 64, torch.bfloat16, False)]   # BERT-base: vLLM's encoder-only layers
_RAGGED_VARIANT_SHAPES = [("window", 32, 8, 128), ("soft_cap_window", 16, 8, 256), ("soft_cap", 32, 16, 128)]


def _fused_qkv(rows, Hq, Hkv, D, dtype, pad=300):
    """q, k, v [rows, heads, D] as views of one [rows + pad, Hq + 2 Hkv, D] buffer (vLLM's split QKV projection:
    a K row every (Hq + 2 Hkv) x D elements), the pad rows past them NaN: nothing reads past the tensors' rows."""
    buf = torch.full((rows + pad, Hq + 2 * Hkv, D), float("nan"), device=DEV, dtype=dtype)
    buf[:rows] = (1.5 * torch.randn(rows, Hq + 2 * Hkv, D, device=DEV)).to(dtype)
    return buf[:rows, :Hq], buf[:rows, Hq:Hq + Hkv], buf[:rows, Hq + Hkv:]


def _check_ragged(attn, q_lens, kv_lens, *, dtype=torch.bfloat16, causal=True, params=None, what="",
                  own_key=False):
    """One step over ragged K / V (formats.from_ragged; queries of their own rows) into NaN-poisoned outputs, against
    the float64 reference, O and the LSE. own_key: K a tensor of its own, V still a view of the fused buffer."""
    from attention_cases import check, reference
    from fi_backend import formats
    params = params or {}
    kv_indptr = torch.tensor([0, *kv_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    qo_cpu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    bsr = formats.from_ragged(kv_indptr.to(DEV), qo_cpu.to(DEV))
    rows, total = int(qo_cpu[-1]), int(kv_indptr[-1])
    _, k, v = _fused_qkv(total, attn.num_qo_heads, attn.num_kv_heads, attn.head_dim, dtype)
    if own_key:
        k = k.contiguous()
        assert k.stride() != v.stride()
    q, _, _ = _fused_qkv(rows, attn.num_qo_heads, attn.num_kv_heads, attn.head_dim, dtype)
    attn.plan(qo_cpu, torch.tensor(kv_lens, dtype=torch.int32), bsr, causal=causal, **params)
    out = torch.full((rows, attn.num_qo_heads, attn.head_dim), float("nan"), device=DEV, dtype=dtype)
    lse = torch.full((rows, attn.num_qo_heads), float("nan"), device=DEV)
    attn.run(q, (k.unsqueeze(1), v.unsqueeze(1)), out=out, lse=lse)
    torch.cuda.synchronize()
    attn.check_errors()
    o_ref, lse_ref = reference(q, k.unsqueeze(1), v.unsqueeze(1), bsr, causal=causal, **params)
    check(out, lse, o_ref, lse_ref, TOL[dtype], what)


@pytest.mark.parametrize("Hq,Hkv,D,dtype,causal", _RAGGED_SHAPES)
def test_member_ragged(Hq, Hkv, D, dtype, causal):
    """A ragged wrapper (ragged=True): K / V strided views of a fused QKV buffer, one TMA box a KV tile. New prompts
    (keys = the request's own rows, vLLM's fresh steps) and appends over longer ragged KV, against the reference."""
    attn = _wrapper(Hq, Hkv, D, page=1, dtype=dtype, ragged=True)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    assert all("_pa0_" in name for name in attn._cute.module_names), attn._cute.module_names
    for q_lens, kv_lens in ((_Q_LENS, _Q_LENS), (_Q_LENS, _KV_LENS)):
        _check_ragged(attn, q_lens, kv_lens, dtype=dtype, causal=causal,
                      what=f"ragged {Hq}/{Hkv} D={D} causal={causal} kv={kv_lens[:2]}")
        assert attn.cute_step, "the step should have run on the CuTe member"


@pytest.mark.parametrize("name,Hq,Hkv,D", _RAGGED_VARIANT_SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_member_ragged_variants(name, Hq, Hkv, D, causal):
    variant, params = _VARIANTS[name]
    attn = _wrapper(Hq, Hkv, D, page=1, variant=variant, ragged=True)
    assert attn.cute_unsupported is None, attn.cute_unsupported
    _check_ragged(attn, _Q_LENS, _KV_LENS, causal=causal, params=params,
                  what=f"ragged {name} {Hq}/{Hkv} D={D} causal={causal}")
    assert attn.cute_step


@pytest.mark.parametrize("Hq,Hkv,D,dtype,causal", [_RAGGED_SHAPES[i] for i in (0, 3, 4, 5)])
def test_member_ragged_key_of_its_own(Hq, Hkv, D, dtype, causal):
    """K and V of different strides, as vLLM hands them over: its key after the rotary embedding is a tensor of its
    own, its value a view of the QKV projection's output. V is read by its own strides."""
    attn = _wrapper(Hq, Hkv, D, page=1, dtype=dtype, ragged=True)
    for q_lens, kv_lens in ((_Q_LENS, _Q_LENS), (_Q_LENS, _KV_LENS)):
        _check_ragged(attn, q_lens, kv_lens, dtype=dtype, causal=causal, own_key=True,
                      what=f"ragged, own key, {Hq}/{Hkv} D={D} causal={causal} kv={kv_lens[:2]}")
        assert attn.cute_step


def test_ragged_different_strides_off_the_member():
    """A ragged step the member does not take (too few query tiles) runs on the tile family, which reads V by K's
    strides: K and V of different strides go through the wrapper's kept buffer first; both layouts match the
    reference."""
    from attention_cases import check, reference
    from fi_backend import formats
    attn = _wrapper(32, 8, 128, page=1, ragged=True)
    lens = torch.tensor([0, 3, 5], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    bsr = formats.from_ragged(lens.to(DEV), lens.to(DEV))
    attn.plan(lens, lens[1:] - lens[:-1], bsr, causal=True)
    assert not attn.cute_step
    q, k, v = _fused_qkv(8, 32, 8, 128, torch.bfloat16)
    o_ref, _ = reference(q, k.unsqueeze(1), v.unsqueeze(1), bsr, causal=True)
    # own key first (the buffer), then equal strides again (the caller's tensors, not the buffer's), then own key
    for key, what in ((k.contiguous(), "own key"), (k, "fused views"), (k.contiguous(), "own key again")):
        assert (key.stride() == v.stride()) == (what == "fused views")
        out = torch.full_like(q, float("nan"))
        attn.run(q, (key.unsqueeze(1), v.unsqueeze(1)), out=out)
        check(out, None, o_ref, None, TOL[torch.bfloat16], f"ragged on the tile family, {what}")


def test_ragged_wrapper_refuses_other_bsrs():
    """ragged=True takes page_size 1 and contiguous BSRs only, said at construction and at plan()."""
    from attention_cases import make_bsr
    with pytest.raises(ValueError, match="page_size must be 1"):
        _wrapper(32, 8, 128, page=16, ragged=True)
    attn = _wrapper(32, 8, 128, page=1, ragged=True)
    bsr, qo_cpu, kv_cpu, _ = make_bsr(_KV_LENS, _Q_LENS, 1)
    with pytest.raises(ValueError, match="contiguous"):
        attn.plan(qo_cpu, kv_cpu, bsr, causal=True)


def test_ragged_bad_bsr_is_flagged():
    """A contiguous BSR whose last request runs past K / V's rows: the member flags it (check_errors) and reads zeros
    there (TMA's bounds; the NaN rows past the tensors are never read), so the output stays finite."""
    from fi_backend import formats
    attn = _wrapper(32, 8, 128, page=1, ragged=True)
    lens = torch.tensor([0, *_Q_LENS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    bsr = formats.from_ragged(lens.to(DEV), lens.to(DEV))
    rows = int(lens[-1])
    q, k, v = _fused_qkv(rows, 32, 8, 128, torch.bfloat16)
    bsr.kv_block_start[-1] = rows - 5  # its 77 keys from 5 rows before the end
    attn.plan(lens, lens[1:] - lens[:-1], bsr, causal=True)
    assert attn.cute_step
    out = attn.run(q, (k.unsqueeze(1), v.unsqueeze(1)))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="past the end of kv_indices"):
        attn.check_errors()
    assert torch.isfinite(out).all()


def test_mixed_step_stays_on_the_family():
    """A prefill chunk among many decode rows: the member would give each decode row a 128-row tile a query head,
    so the tile family runs it (cute_step False), and it is still right."""
    attn = _wrapper(32, 8, 128, page=16)
    _check_step(attn, [700] + [1] * 60, [1500] + [900 + 37 * i for i in range(60)], what="mixed")
    assert not attn.cute_step


def test_switched_off(monkeypatch):
    """FI_BACKEND_PREFILL_CUTE=0: the wrapper says why it has no member, and the tile family runs the same step
    right."""
    monkeypatch.setenv("FI_BACKEND_PREFILL_CUTE", "0")
    attn = _wrapper(32, 8, 128, page=16)
    assert "FI_BACKEND_PREFILL_CUTE" in attn.cute_unsupported
    _check_step(attn, _Q_LENS, _KV_LENS, what="switched off")
    assert not attn.cute_step


@pytest.mark.parametrize("how", ["boxes", "gather", "staged"])
def test_bad_bsr_is_flagged_and_never_read_past(monkeypatch, how):
    """A page id outside the cache and a request whose pages run past kv_indices: the member flags them in the
    wrapper's error word (check_errors names them, as the tile family's kernel does), reads zeros for those pages
    and nothing past kv_indices (compute-sanitizer memcheck in .ci/gpu's cute step), and the output stays finite;
    TMA boxes, gathered rows and staged pages alike."""
    from fi_backend import cute_member
    monkeypatch.setattr(cute_member, "GATHER_BELOW", _GATHER_BELOW if how == "gather" else 0)
    monkeypatch.setattr(cute_member, "STAGE_MIN_REUSE", 0 if how == "staged" else 1 << 60)
    attn = _wrapper(32, 8, 128, page=16)
    assert all(("_ga1_" in name) == (how == "gather") for name in attn._cute.module_names)
    bsr, qo_cpu, kv_cpu, nb = make_bsr(_KV_LENS, _Q_LENS, 16)
    cache, k, v = random_kv(nb, 16, 8, 128, torch.bfloat16)
    q = torch.randn(int(qo_cpu[-1]), 32, 128, device=DEV, dtype=torch.bfloat16)
    bsr.kv_indices[int(bsr.kv_block_start[1]) + 3] = nb + 1000
    attn.plan(qo_cpu, kv_cpu, bsr, causal=True)
    assert attn.cute_step and attn.cute_staged == (how == "staged")
    out = attn.run(q, cache)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="outside"):
        attn.check_errors()
    assert torch.isfinite(out).all()
    # the last request's pages start past the table: every one of its entries is outside kv_indices
    last = bsr.kv_block_start.numel() - 1
    bsr.kv_block_start[last] = bsr.kv_indices.numel() - 1
    attn.plan(qo_cpu, kv_cpu, bsr, causal=True)
    out = attn.run(q, cache)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="past the end of kv_indices"):
        attn.check_errors()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("staged", [False, True])
def test_graph_capture_runs_the_family(monkeypatch, staged):
    """run() captured in a CUDA graph on a step the member takes (its pages staged or not): the member refuses the
    capturing stream and the tile family's kernel (planned too) goes into the graph, which replays right; later plans
    keep the family."""
    from fi_backend import cute_member
    monkeypatch.setattr(cute_member, "STAGE_MIN_REUSE", 0 if staged else 1 << 60)
    attn = _wrapper(32, 8, 128, page=16)
    bsr, qo_cpu, kv_cpu, nb = make_bsr(_KV_LENS, _Q_LENS, 16)
    cache, k, v = random_kv(nb, 16, 8, 128, torch.bfloat16)
    rows = int(qo_cpu[-1])
    q = torch.randn(rows, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    attn.plan(qo_cpu, kv_cpu, bsr, causal=True)
    assert attn.cute_step and attn.cute_staged == staged
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attn.run(q, cache, out=out)  # eager, on the member
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, cache, out=out)
    replay_check(graph, attn, q, out, k, v, bsr, TOL[torch.bfloat16], "graph replay")
    attn.plan(qo_cpu, kv_cpu, bsr, causal=True)
    assert not attn.cute_step, "a captured graph keeps the family's kernel and plans"
