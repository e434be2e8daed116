"""fi_backend.adapters.sglang on a machine without SGLang (and without a GPU).

What runs here: the package imports without SGLang; the entry point is declared; register() and the
lazily made SGLang class, against a small stand-in for SGLang 0.5.15's registry, server-args choices and
AttentionBackend base (written from SGLang's source, only the parts the adapter touches); layer settings,
variants and refusal reasons; and the whole per-step data path as SGLang drives it (ForwardBatch ->
BSR over req_to_token -> plan -> set_kv_buffer -> attention, for extend, mixed, decode and CUDA-graph
decode steps with padding, at page sizes 1 and 4, with one and two layer groups) with a reference
wrapper in place of the kernels, checked in float64 against attention written out here from SGLang's
definitions. The real engine runs in integration_tests/sglang/ on the GPU machine.
"""
import enum
import importlib
import importlib.machinery
import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fi_backend.ops
from fi_backend import reference, variants
from fi_backend.adapters import sglang as adapter
from fi_backend.formats import check_prefix_groups

ROOT = Path(__file__).resolve().parents[1]
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


# ------------------------------------------------------------------------------------ import and entry point

def test_imports_without_sglang():
    """Importing the package and the adapter must not import SGLang (SGLang loads us, not the reverse)."""
    code = ("import sys, fi_backend, fi_backend.adapters, fi_backend.adapters.sglang as a; "
            "assert callable(a.register) and callable(a.create_backend); "
            "a.LayerSettings(8, 2, 64, 0.125, 31, 50.0).variant(); "
            "assert 'sglang' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_entry_point_declared():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"][adapter.ENTRY_POINT_GROUP]
    assert adapter.ENTRY_POINT_GROUP == "sglang.srt.plugins"
    assert group == {"fi_backend": "fi_backend.adapters.sglang:register"}
    module, attr = group["fi_backend"].split(":")
    assert getattr(importlib.import_module(module), attr) is adapter.register
    assert adapter.BACKEND_NAME == "fi_backend"


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed here")
def test_register_without_sglang_raises_import_error():
    with pytest.raises(ImportError, match="needs SGLang 0.5.15 installed"):
        adapter.register()


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed here")
def test_sglang_class_without_sglang_raises_import_error():
    with pytest.raises(ImportError, match="needs SGLang 0.5.15"):
        adapter.FiAttnBackend  # noqa: B018
    with pytest.raises(AttributeError):
        adapter.NoSuchThing  # noqa: B018


def test_head_sizes_match_the_kernels():
    from fi_backend.wrappers import HEAD_DIMS
    assert adapter.HEAD_SIZES == HEAD_DIMS


# ------------------------------------------------------------------------------------ a stand-in for SGLang 0.5.15

class ForwardMode(enum.IntEnum):
    """sglang.srt.model_executor.forward_batch_info.ForwardMode (0.5.15), its predicates included."""
    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()
    PREBUILT = enum.auto()
    SPLIT_PREFILL = enum.auto()
    DLLM_EXTEND = enum.auto()

    def is_extend(self, include_draft_extend_v2=False):
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.SPLIT_PREFILL,
                        ForwardMode.DLLM_EXTEND) or (include_draft_extend_v2 and self == ForwardMode.DRAFT_EXTEND_V2)

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_mixed(self):
        return self == ForwardMode.MIXED

    def is_idle(self):
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self):
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self):
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_split_prefill(self):
        return self == ForwardMode.SPLIT_PREFILL

    def is_dllm_extend(self):
        return self == ForwardMode.DLLM_EXTEND


class AttentionBackendBase:
    """SGLang 0.5.15's AttentionBackend, the parts a backend inherits (base_attn_backend.py)."""

    needs_cpu_seq_lens = True

    def init_forward_metadata(self, forward_batch):
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        raise NotImplementedError()

    def get_cuda_graph_seq_len_fill_value(self):
        raise NotImplementedError()

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        elif forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, *args, **kwargs):
        raise NotImplementedError()

    def forward_extend(self, *args, **kwargs):
        raise NotImplementedError()


@pytest.fixture(autouse=True)
def _groups_on(monkeypatch):
    """Shared-prefix groups are opt-in in SGLang (SGLANG_SHARED_PREFIX_DEFAULT): these tests run with them on,
    test_shared_prefix_off_by_default without the variable."""
    monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "1")


@pytest.fixture
def stub_sglang(monkeypatch):
    """sglang.srt.server_args (choices), attention_registry and base_attn_backend, reduced to what the adapter
    uses, with SGLang 0.5.15's semantics."""
    made = {name: vars(adapter).pop(name) for name in adapter._SGLANG_CLASSES if name in vars(adapter)}

    def module(name):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, m)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, m)
        return m

    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention"):
        module(name)
    sa = module("sglang.srt.server_args")
    sa.ATTENTION_BACKEND_CHOICES = ["triton", "flashinfer"]
    sa.add_attention_backend_choices = lambda choices: sa.ATTENTION_BACKEND_CHOICES.extend(choices)
    reg = module("sglang.srt.layers.attention.attention_registry")
    reg.ATTENTION_BACKENDS = {"triton": lambda runner: "triton"}

    def register_attention_backend(name):
        def decorator(fn):
            reg.ATTENTION_BACKENDS[name] = fn
            return fn
        return decorator

    reg.register_attention_backend = register_attention_backend
    module("sglang.srt.layers.attention.base_attn_backend").AttentionBackend = AttentionBackendBase
    yield SimpleNamespace(server_args=sa, registry=reg)
    for name in adapter._SGLANG_CLASSES:
        vars(adapter).pop(name, None)
    vars(adapter).update(made)


def test_register_is_idempotent(stub_sglang):
    adapter.register()
    adapter.register()
    assert stub_sglang.registry.ATTENTION_BACKENDS["fi_backend"] is adapter.create_backend
    assert stub_sglang.server_args.ATTENTION_BACKEND_CHOICES.count("fi_backend") == 1
    assert stub_sglang.registry.ATTENTION_BACKENDS["triton"]("r") == "triton"


def test_register_lists_fi_backend_as_deterministic(stub_sglang):
    """--enable-deterministic-inference accepts fi_backend with the radix cache on: register() adds it to SGLang's
    deterministic list and to its radix-cache one (once each), and a SGLang without the lists is left as it is."""
    sa = stub_sglang.server_args
    adapter.register()   # the stub has no deterministic lists yet: nothing to add to
    sa.DETERMINISTIC_ATTENTION_BACKEND_CHOICES = ["fa3", "flashinfer", "triton"]
    sa.add_deterministic_attention_backend_choices = sa.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.extend
    sa.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND = ["fa3", "triton"]
    sa.add_radix_supported_deterministic_attention_backend_choices = sa.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND.extend
    adapter.register()
    adapter.register()
    assert sa.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.count("fi_backend") == 1
    assert sa.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND.count("fi_backend") == 1


def test_register_leaves_another_plugins_backend(stub_sglang, caplog):
    other = lambda runner: "other"  # noqa: E731
    stub_sglang.registry.ATTENTION_BACKENDS["fi_backend"] = other
    adapter.register()
    assert stub_sglang.registry.ATTENTION_BACKENDS["fi_backend"] is other
    assert "already registered" in caplog.text


def test_sglang_class_subclasses_the_base(stub_sglang):
    cls = adapter.FiAttnBackend
    assert issubclass(cls, AttentionBackendBase) and issubclass(cls, adapter._Backend)
    assert cls.__module__ == adapter.__name__ and adapter._sglang_class("FiAttnBackend") is cls
    # ours first in the MRO: SGLang's defaults (NotImplementedError) are overridden
    assert cls.get_cuda_graph_seq_len_fill_value is adapter._Backend.get_cuda_graph_seq_len_fill_value
    assert cls.init_forward_metadata is adapter._Backend.init_forward_metadata
    assert cls.forward is AttentionBackendBase.forward


# ------------------------------------------------------------------------------------ layers and variants

class Radix(torch.nn.Module):
    """sglang.srt.layers.radix_attention.RadixAttention's attributes (0.5.15)."""

    def __init__(self, num_heads, head_dim, scaling, num_kv_heads, layer_id, logit_cap=0.0, v_head_dim=-1,
                 sliding_window_size=-1, is_cross_attention=False, attn_type="decoder"):
        super().__init__()
        self.tp_q_head_num, self.tp_k_head_num, self.tp_v_head_num = num_heads, num_kv_heads, num_kv_heads
        self.head_dim = self.qk_head_dim = head_dim
        self.v_head_dim = v_head_dim if v_head_dim != -1 else head_dim
        self.scaling, self.layer_id, self.logit_cap = scaling, layer_id, logit_cap
        self.sliding_window_size = sliding_window_size or -1
        self.is_cross_attention = is_cross_attention
        self.use_irope = False
        self.k_scale = self.v_scale = self.k_scale_float = self.v_scale_float = None
        self.attn_type = SimpleNamespace(value=attn_type)
        self.pos_encoding_mode = "NONE"
        self.logit_capping_method = "tanh"
        self.xai_temperature_len = -1


class Block(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.attn = attn
        self.self_attn.o_proj = torch.nn.Linear(2, 2, bias=False)


class Model(torch.nn.Module):
    def __init__(self, attns):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(a) for a in attns])


@pytest.mark.parametrize("window, cap, name, params", [
    (-1, 0.0, "default", {}),
    (63, 0.0, "window", {"window_left": 63}),
    (-1, 50.0, "soft_cap", {"logits_soft_cap": 50.0}),
    (4095, 50.0, "soft_cap_window", {"logits_soft_cap": 50.0, "window_left": 4095}),
    (0, 0.0, "default", {}),   # RadixAttention turns 0 into -1 (no window)
])
def test_layer_settings_and_variant(window, cap, name, params):
    s, reasons = adapter.layer_settings(Radix(16, 256, 256 ** -0.5, 8, 3, logit_cap=cap, sliding_window_size=window))
    assert reasons == []
    assert (s.num_qo_heads, s.num_kv_heads, s.head_dim) == (16, 8, 256)
    variant, got = s.variant()
    assert variant.name == name and got == params and set(got) == set(variant.params)
    assert variant == variants.BUILTIN_VARIANTS[name]


@pytest.mark.parametrize("kw, words", [
    ({"head_dim": 112}, "head size 112"),
    ({"v_head_dim": 64}, "value head size 64"),
    ({"is_cross_attention": True}, "cross-attention"),
    ({"attn_type": "encoder_only", "sliding_window_size": 64}, "two-sided window"),
    ({"attn_type": "decoder_bidirectional"}, "bidirectional"),
    ({"num_kv_heads": 3}, "not a multiple of 3 KV heads"),
])
def test_layer_settings_refusals(kw, words):
    args = dict(num_heads=8, head_dim=128, scaling=0.1, num_kv_heads=2, layer_id=5)
    args.update(kw)
    _, reasons = adapter.layer_settings(Radix(**args))
    assert len(reasons) == 1 and words in reasons[0] and "layer 5" in reasons[0], reasons


def test_layer_settings_refuses_other_capping_and_scalings():
    layer = Radix(8, 128, 0.1, 2, 0, logit_cap=30.0)
    layer.logit_capping_method = "sigmoid"
    layer.xai_temperature_len = 1024
    layer.use_irope = True
    _, reasons = adapter.layer_settings(layer)
    assert len(reasons) == 3 and "capping method" in reasons[0] and "xai" in reasons[1] and "irope" in reasons[2]


# ------------------------------------------------------------------------------------ the engine stand-in

class Pool:
    """SGLang's MHATokenToKVPool (NHD): per layer k_buffer / v_buffer [size + page, heads, D]; slot 0's page
    absorbs padding writes. set_kv_buffer writes rows at loc; fp8 pools store uint8 and hand out views."""

    kv_cache_layout = "nhd"

    def __init__(self, num_layers, size, page, hkv, d, dtype=torch.float32, gen=None):
        self.size, self.page_size, self.dtype = size, page, dtype
        self.store_dtype = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
        self.k_buffer = [torch.randn(size + page, hkv, d, generator=gen).to(self.store_dtype)
                         for _ in range(num_layers)]
        self.v_buffer = [torch.randn(size + page, hkv, d, generator=gen).to(self.store_dtype)
                         for _ in range(num_layers)]
        self.writes = 0

    def get_key_buffer(self, layer_id):
        b = self.k_buffer[layer_id]
        return b.view(self.dtype) if self.store_dtype != self.dtype else b

    def get_value_buffer(self, layer_id):
        b = self.v_buffer[layer_id]
        return b.view(self.dtype) if self.store_dtype != self.dtype else b

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        self.writes += 1
        self.k_buffer[layer.layer_id][loc] = cache_k.to(self.store_dtype)
        self.v_buffer[layer.layer_id][loc] = cache_v.to(self.store_dtype)


Pool.__name__ = "MHATokenToKVPool"


def server_args(**kw):
    args = dict(chunked_prefill_size=16, max_prefill_tokens=32, speculative_algorithm=None,
                enable_deterministic_inference=False, enable_two_batch_overlap=False, enable_pdmux=False,
                dllm_algorithm=None, enable_mis=False, dcp_size=1, attn_cp_size=1,
                cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(backend="breakable", bs=[4, 8, 40]),
                                                  decode=SimpleNamespace(backend="full", max_bs=4)))
    args.update(kw)
    return SimpleNamespace(**args)


def model_runner(attns, *, page=1, pool_rows=6, max_len=48, hkv=2, d=64, pool_size=160, gen=None, **over):
    """The ModelRunner attributes a backend reads (SGLang 0.5.15)."""
    pool = Pool(len(attns), pool_size, page, hkv, d, dtype=over.pop("pool_dtype", torch.float32), gen=gen)
    runner = SimpleNamespace(
        model=Model(attns), model_config=SimpleNamespace(is_encoder_decoder=False, context_len=max_len),
        server_args=server_args(**over.pop("server_args", {})), use_mla_backend=False,
        spec_algorithm=SimpleNamespace(is_none=lambda: True), is_draft_worker=False, dcp_size=1,
        dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, page_size=page, token_to_kv_pool=pool,
        token_to_kv_pool_allocator=SimpleNamespace(),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(pool_rows, max_len, dtype=torch.int32),
                                          size=pool_rows),
        device="cpu", gpu_id=0)
    for k, v in over.items():
        setattr(runner, k, v)
    return runner


def llama_layers(n=2, hq=4, hkv=2, d=64, scale=0.3):
    return [Radix(hq, d, scale, hkv, i) for i in range(n)]


def gemma2_layers(hq=4, hkv=2, d=64, scale=0.3, window=5, cap=3.0):
    """Gemma-2's pattern: even layers sliding-window, all soft-capped (two layer groups)."""
    return [Radix(hq, d, scale, hkv, i, logit_cap=cap, sliding_window_size=window if i % 2 == 0 else -1)
            for i in range(2)]


# ------------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("change, words", [
    ({"use_mla_backend": True}, "MLA"),
    ({"model_config": SimpleNamespace(is_encoder_decoder=True, context_len=48)}, "encoder-decoder"),
    ({"spec_algorithm": SimpleNamespace(is_none=lambda: False)}, "speculative decoding"),
    ({"server_args": {"enable_deterministic_inference": True, "enable_mixed_chunk": True}}, "--enable-mixed-chunk"),
    ({"server_args": {"enable_two_batch_overlap": True}}, "two-batch-overlap"),
    ({"server_args": {"enable_pdmux": True}}, "pdmux"),
    ({"server_args": {"dllm_algorithm": "LowConfidence"}}, "diffusion"),
    ({"server_args": {"enable_mis": True}}, "multi-item"),
    ({"server_args": {"attn_cp_size": 2}}, "attention context parallelism"),
    ({"dcp_size": 2}, "decode context parallelism"),
    ({"server_args": {"cuda_graph_config": SimpleNamespace(prefill=SimpleNamespace(backend="full", bs=[8]))}},
     "full prefill CUDA graph"),
    ({"dtype": torch.float32, "kv_cache_dtype": torch.float32}, "model dtype torch.float32"),
    ({"kv_cache_dtype": torch.float8_e5m2}, "KV-cache dtype torch.float8_e5m2"),
    ({"page_size": 512}, "page size 512"),
    ({"token_to_kv_pool_allocator": SimpleNamespace(translate_kv_loc=lambda x: x)}, "unified"),
])
def test_refusal_reasons_name_the_problem(change, words):
    runner = model_runner(llama_layers(), **change)
    reasons = adapter._refusal_reasons(runner, adapter._attention_layers(runner.model))
    assert len(reasons) == 1 and words in reasons[0], reasons


def test_refusals_of_the_pool_layers_and_sinks():
    runner = model_runner(llama_layers() + [Radix(4, 112, 0.3, 2, 2)])
    runner.token_to_kv_pool.translate_loc_from_full_to_swa = lambda loc: loc
    runner.token_to_kv_pool.kv_cache_layout = "vectorized_5d"
    runner.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    reasons = adapter._refusal_reasons(runner, adapter._attention_layers(runner.model))
    assert len(reasons) == 4, reasons
    assert "--disable-hybrid-swa-memory" in reasons[0] and "vectorized_5d" in reasons[1]
    assert "sinks" in reasons[2] and "layer 2: head size 112" in reasons[3]
    with pytest.raises(ValueError, match="cannot run this model in SGLang: the hybrid SWA"):
        adapter._Backend(runner)
    empty = model_runner([])
    assert adapter._refusal_reasons(empty, []) == ["the model has no RadixAttention layers"]


def test_deterministic_inference_is_accepted_where_it_holds():
    """--enable-deterministic-inference: accepted; with mixed chunks refused; with sliding-window layers only
    without the radix cache (a cached prefix moves a window's first KV tile)."""
    def reasons(layers, **sa):
        runner = model_runner(layers, server_args={"enable_deterministic_inference": True, **sa})
        return adapter._refusal_reasons(runner, adapter._attention_layers(runner.model))
    assert reasons(llama_layers()) == []
    assert reasons(gemma2_layers(), disable_radix_cache=True) == []
    got = reasons(gemma2_layers())
    assert len(got) == 1 and "--disable-radix-cache" in got[0]
    got = reasons(llama_layers(), enable_mixed_chunk=True)
    assert len(got) == 1 and "--enable-mixed-chunk" in got[0]


@pytest.mark.parametrize("over, rows", [
    ({}, 40 + 6),                                                   # the largest prefill graph size
    ({"cuda_graph_config": None}, 32 + 6),                          # max_prefill_tokens
    ({"chunked_prefill_size": 64, "cuda_graph_config": None}, 64 + 6),
    ({"chunked_prefill_size": -1, "cuda_graph_config": None}, 48 + 6),   # no chunking: a whole context
])
def test_prefill_rows(over, rows):
    runner = model_runner(llama_layers(), server_args=over)
    assert adapter._prefill_rows(runner, 6) == rows


# ------------------------------------------------------------------------------------ the per-step data path

class RefWrapper:
    """BatchAttention's plan/run contract, computed with fi_backend.reference (float64) from the BSR. Shared-prefix
    groups are checked against the BSR (check_prefix_groups: the members hold the same blocks over the prefix) and
    kept by a stand-in verdict (keep_groups, prefill kernel only: plan_info.shared_groups); an idle plan's run()
    writes nothing."""

    module_names = []
    keep_groups = True

    def __init__(self, kernel, **kw):
        self.kernel, self.kw, self.plans, self.runs, self.idle_runs = kernel, kw, [], 0, 0

    def plan(self, qo_indptr, kv_lens, bsr, *, causal, sm_scale, debug=False, prefix_groups=None, idle=False,
             **variant_params):
        assert qo_indptr.device.type == "cpu" and kv_lens.device.type == "cpu"
        assert qo_indptr.dtype == kv_lens.dtype == torch.int32
        assert bsr.kv_lens.numel() == kv_lens.numel() == qo_indptr.numel() - 1
        assert bsr.block_width == self.kw["page_size"]
        bsr.validate()
        assert torch.equal(bsr.qo_indptr, qo_indptr) and torch.equal(bsr.kv_lens, kv_lens)
        if prefix_groups is not None:
            assert self.kw.get("shared_prefix"), "groups passed to a wrapper whose workspace has no shared rows"
            check_prefix_groups(bsr, prefix_groups, qo_indptr, kv_lens)
        kept = len(prefix_groups) if prefix_groups is not None and self.kernel == "prefill" and self.keep_groups else 0
        self.plan_info = SimpleNamespace(shared_groups=kept, kind="idle" if idle else "lpt")
        self.plans.append(dict(qo=qo_indptr.clone(), kv=kv_lens.clone(), bsr=bsr, causal=causal, sm_scale=sm_scale,
                               vp=variant_params, groups=None if prefix_groups is None else prefix_groups.tolist(),
                               idle=idle))

    def run(self, q, kv_cache, *, out, k_scale=1.0, v_scale=1.0):
        p = self.plans[-1]
        assert q.shape[0] == out.shape[0] == int(p["qo"][-1])
        if p["idle"]:
            self.idle_runs += 1
            return out
        k, v = kv_cache
        if k.dim() == 3:   # SGLang's slots [slots, heads, D]: page size 1
            k, v = k[:, None], v[:, None]
        o, _ = reference.attention_bsr(q, k, v, p["bsr"], causal=p["causal"], sm_scale=p["sm_scale"], **p["vp"])
        out.copy_(o.to(out.dtype))
        self.runs += 1
        return out

    def ptrs(self, i=-1):
        bsr = self.plans[i]["bsr"]
        return tuple(t.data_ptr() for t in (bsr.qo_indptr, bsr.kv_lens, bsr.kv_indices, bsr.kv_block_start))


@pytest.fixture(autouse=True)
def prepared(recorded_prepare):
    """The wrappers here are stand-ins: their modules are recorded, not built."""
    return recorded_prepare


@pytest.fixture
def ref_wrappers(monkeypatch):
    made = []

    def make(kernel, **kw):
        w = RefWrapper(kernel, **kw)
        made.append(w)
        return w

    monkeypatch.setattr(adapter, "_make_wrapper", make)
    return made


def truth(q, k, v, q_pos, *, scale, window=None, cap=None):
    """Causal attention of one request as SGLang's triton backend defines it: a query at position p sees
    KV positions p - window .. p (window = sliding_window_size); soft-cap on the scaled logits."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    rel = q_pos[:, None] - torch.arange(k.shape[0])[None, :]
    allowed = rel >= 0
    if window is not None and window >= 0:
        allowed &= rel <= window
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


class Engine:
    """SGLang's scheduler, reduced to what attention sees: req_to_token rows of pool slots allocated by page
    (slot = page * P + offset; page 0 is the padding page), ForwardBatch fields, and the decode graph
    runner's padded static buffers."""

    def __init__(self, runner, gen, modes=ForwardMode):
        self.runner, self.gen, self.modes = runner, gen, modes
        self.P = runner.page_size
        self.r2t = runner.req_to_token_pool.req_to_token
        self.pool = runner.token_to_kv_pool
        self.pages = {}                       # pool row -> its pages
        self.next_page = 1
        self.lens = {}                        # pool row -> tokens in the cache

    def share(self, row, other, tokens):
        """A radix-cache hit: `row` starts with `other`'s first `tokens` tokens (whole pages), slots shared."""
        assert self.lens.get(row, 0) == 0 and tokens % self.P == 0
        self.pages[row] = self.pages[other][: tokens // self.P]
        self.r2t[row, :tokens] = self.r2t[other, :tokens]
        self.lens[row] = tokens

    def alloc(self, row, n):
        """Slots for the next n tokens of `row`, written into its req_to_token row."""
        pages = self.pages.setdefault(row, [])
        start = self.lens.get(row, 0)
        slots = []
        for t in range(start, start + n):
            if t // self.P >= len(pages):
                pages.append(self.next_page)
                self.next_page += 1
            slots.append(pages[t // self.P] * self.P + t % self.P)
        self.r2t[row, start: start + n] = torch.tensor(slots, dtype=torch.int32)
        self.lens[row] = start + n
        return slots

    def extend(self, reqs, mode=None):
        """reqs: [(row, new tokens)] or [(row, new tokens, (other row, shared tokens))] for a radix-cache hit;
        rows keep their cached tokens. Returns the ForwardBatch."""
        prefix, loc = [], []
        for row, n, *share in reqs:
            if share:
                self.share(row, *share[0])
            prefix.append(self.lens.get(row, 0))
            loc += self.alloc(row, n)
        q_lens = [r[1] for r in reqs]
        seq = [p + n for p, n in zip(prefix, q_lens)]
        return SimpleNamespace(
            forward_mode=self.modes.EXTEND if mode is None else mode, batch_size=len(reqs),
            req_pool_indices=torch.tensor([r[0] for r in reqs]),
            seq_lens=torch.tensor(seq), seq_lens_cpu=torch.tensor(seq), seq_lens_sum=sum(seq),
            out_cache_loc=torch.tensor(loc), extend_seq_lens=torch.tensor(q_lens, dtype=torch.int32),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32), extend_seq_lens_cpu=q_lens,
            extend_prefix_lens_cpu=prefix, extend_num_tokens=sum(q_lens))

    def decode(self, rows):
        fb = self.extend([(r, 1) for r in rows], mode=self.modes.DECODE)
        for name in ("extend_seq_lens", "extend_prefix_lens", "extend_seq_lens_cpu", "extend_prefix_lens_cpu"):
            setattr(fb, name, None)
        return fb

    def graph_view(self, fb, bs, fill):
        """The decode graph runner's replay view (build_replay_fb_view): the batch padded to the captured bs
        with pool row 0, seq_len `fill` and out_cache_loc 0, in the runner's static buffers."""
        if not hasattr(self, "bufs"):
            self.bufs = dict(rpi=torch.zeros(8, dtype=torch.int64), sl=torch.full((8,), fill, dtype=torch.int64),
                             slc=torch.full((8,), fill, dtype=torch.int64), loc=torch.zeros(8, dtype=torch.int64))
        b, raw = self.bufs, fb.batch_size
        for name, src in (("rpi", fb.req_pool_indices), ("sl", fb.seq_lens), ("slc", fb.seq_lens_cpu),
                          ("loc", fb.out_cache_loc)):
            b[name][:raw] = src
        b["rpi"][raw:], b["sl"][raw:], b["slc"][raw:], b["loc"][raw:] = 0, fill, fill, 0
        return SimpleNamespace(batch_size=bs, forward_mode=self.modes.DECODE, actual_forward_mode=fb.forward_mode,
                               req_pool_indices=b["rpi"][:bs], seq_lens=b["sl"][:bs], seq_lens_cpu=b["slc"][:bs],
                               seq_lens_sum=fb.seq_lens_sum + (bs - raw) * fill, num_padding=bs - raw,
                               out_cache_loc=b["loc"][:bs], encoder_lens=None, spec_info=None)

    def qkv(self, tokens, hq, hkv, d):
        return (torch.randn(tokens, hq * d, generator=self.gen), torch.randn(tokens, hkv, d, generator=self.gen),
                torch.randn(tokens, hkv, d, generator=self.gen))

    def history(self, layer_id, row, length):
        slots = self.r2t[row, :length].long()
        return self.pool.get_key_buffer(layer_id)[slots], self.pool.get_value_buffer(layer_id)[slots]


def run_layers(backend, eng, fb, layers, rows, q_rows, *, graph_fb=None, forward="extend"):
    """Each layer as a model would run it: q/k/v for the step's tokens, attention, then the outputs
    checked against truth() per request (rows: the requests' pool rows; q_rows: their query counts)."""
    hq, hkv, d = layers[0].tp_q_head_num, layers[0].tp_k_head_num, layers[0].head_dim
    view = graph_fb or fb
    tokens = view.out_cache_loc.numel()
    for layer in layers:
        q, k, v = eng.qkv(tokens, hq, hkv, d)
        fn = backend.forward_extend if forward == "extend" else backend.forward_decode
        out = fn(q, k, v, layer, view)
        assert out.shape == (tokens, hq * d)
        out = out.view(tokens, hq, d)
        start = 0
        window = layer.sliding_window_size if layer.sliding_window_size >= 0 else None
        for row, n in zip(rows, q_rows):
            length = eng.lens[row]
            hk, hv = eng.history(layer.layer_id, row, length)
            torch.testing.assert_close(hk[length - n:], k[start: start + n])   # the KV write
            want = truth(q.view(tokens, hq, d)[start: start + n], hk, hv, torch.arange(length - n, length),
                         scale=layer.scaling, window=window, cap=layer.logit_cap)
            torch.testing.assert_close(out[start: start + n].double(), want, rtol=1e-5, atol=1e-5)
            start += n
        if graph_fb is not None and start < tokens:   # padded requests: pool row 0, one token at slot 0
            pad = slice(start, tokens)
            pk, pv = eng.pool.get_key_buffer(layer.layer_id), eng.pool.get_value_buffer(layer.layer_id)
            slot = int(eng.r2t[0, 0])
            assert slot == 0 and torch.equal(pk[0], k[tokens - 1])
            want = pv[slot].double().repeat_interleave(hq // hkv, 0)
            torch.testing.assert_close(out[pad].double(), want.expand(tokens - start, hq, d), rtol=1e-5, atol=1e-5)


def test_deterministic_steps_keep_extend_rows_on_the_prefill_kernel(ref_wrappers):
    """Deterministic inference: both wrappers are made deterministic, an extend step of single tokens runs the
    prefill kernel (its rows' kernel must not follow its companions' lengths), decode steps the decode kernel;
    outputs are still causal attention over each request's tokens."""
    gen = torch.Generator().manual_seed(5)
    layers = llama_layers()
    runner = model_runner(layers, gen=gen, server_args={"enable_deterministic_inference": True})
    backend = adapter._Backend(runner)
    assert [w.kw["deterministic"] for w in ref_wrappers] == [True, True]
    eng = Engine(runner, gen)
    for q_rows, kernel in (([6, 3], "prefill"), ([1, 1], "prefill"), (None, "decode")):
        fb = eng.extend([(1, q_rows[0]), (2, q_rows[1])]) if q_rows else eng.decode([1, 2])
        backend.init_forward_metadata(fb)
        assert backend.forward_metadata.kernel == kernel
        run_layers(backend, eng, fb, layers, [1, 2], q_rows or [1, 1], forward="extend" if q_rows else "decode")


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_steps_as_sglang_drives_them(page, kind, ref_wrappers, prepared):
    """A model's steps through the backend: an extend step (a fresh prompt, a radix-cache hit sharing another
    request's slots, a chunked prompt's second chunk), a mixed step (a chunk and two decodes), an eager
    decode step, then decode CUDA graphs (capture at bs 4 and 2, replays padded from 3 to 4 and at 2) with
    the engine's static buffers, and an idle step. Outputs equal causal attention over each request's
    tokens; the decode wrapper's BSR arrays keep their addresses from capture on."""
    gen = torch.Generator().manual_seed(page)
    layers = llama_layers() if kind == "llama" else gemma2_layers()
    runner = model_runner(layers, page=page, gen=gen)
    backend = adapter._Backend(runner)
    groups = 1 if kind == "llama" else 2
    assert len(backend._groups) == groups and len(ref_wrappers) == 3 * groups
    assert [w.kernel for w in ref_wrappers] == ["decode", "prefill", "prefill"] * groups   # + graph_prefill
    assert ref_wrappers[1].kw["max_rows"] == 40 + 6 and ref_wrappers[0].kw["max_rows"] == 6
    assert ref_wrappers[2].kw["max_rows"] == 6 and ref_wrappers[2].kw["shared_prefix"]
    # each group's modules built in parallel before its wrappers, for the engine's page size
    assert [(a, kw["page_size"], kw["variant"]) for a, kw in prepared] == [
        ((w.kw["settings"].num_qo_heads, w.kw["settings"].num_kv_heads, w.kw["settings"].head_dim), page,
         w.kw["variant"]) for w in ref_wrappers[::3]]
    eng = Engine(runner, gen)
    # cached prefixes: row 4 (a finished request whose first 8 tokens the radix cache holds), row 3 (chunk 1)
    eng.alloc(4, 10)
    eng.alloc(3, 12)
    counts = adapter.plan_counts()

    fb = eng.extend([(1, 7), (2, 5, (4, 8)), (3, 3)])   # row 2 hits row 4's first 8 tokens
    assert fb.extend_prefix_lens_cpu == [0, 8, 12]
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.kernel == "prefill" and backend.forward_metadata.num_rows == 15
    run_layers(backend, eng, fb, layers, [1, 2, 3], [7, 5, 3])
    bsr = ref_wrappers[1].plans[-1]["bsr"]
    assert bsr.kv_lens.tolist() == [7, 13, 15] and bsr.qo_indptr.tolist() == [0, 7, 12, 15]
    if page == 1:   # zero-copy: req_to_token itself, rows at req_pool_indices * stride
        assert bsr.kv_indices.data_ptr() == eng.r2t.data_ptr() and bsr.kv_indices.numel() == eng.r2t.numel()
        assert bsr.kv_block_start.tolist() == [48, 96, 144]

    fb = eng.extend([(3, 4), (1, 1), (2, 1)], mode=ForwardMode.MIXED)
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.kernel == "prefill"
    run_layers(backend, eng, fb, layers, [3, 1, 2], [4, 1, 1])

    fb = eng.decode([1, 2, 3])
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.kernel == "decode" and backend.forward_metadata.num_rows == 3
    run_layers(backend, eng, fb, layers, [1, 2, 3], [1, 1, 1], forward="decode")

    fb = eng.extend([(1, 1), (2, 1)])   # an extend step of single tokens runs the decode kernel
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.kernel == "decode"
    run_layers(backend, eng, fb, layers, [1, 2], [1, 1])

    # decode CUDA graphs: state for bs up to 8 (> the 6 pool rows: the buffers grow before any capture)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    assert fill == 1
    backend.init_cuda_graph_state(8, 8)
    assert backend._planner.max_requests == 8
    decode_wrappers = [g.decode for g in backend._groups]
    ptrs = None
    for bs, rows, capture in ((4, [1, 2, 3], True), (2, [1, 2], True), (4, [1, 2, 3], False), (2, [2, 3], False)):
        fb = eng.decode(rows)
        view = eng.graph_view(fb, bs, fill)
        backend.init_forward_metadata_out_graph(view, in_capture=capture)
        backend.init_forward_metadata_in_graph(view)
        md = backend.forward_metadata
        assert md.kernel == "decode" and md.num_rows == bs and md.wrappers == tuple(decode_wrappers)
        now = [w.ptrs() for w in decode_wrappers]
        assert ptrs in (None, now), "BSR addresses must not change between captures and replays"
        ptrs = now
        assert decode_wrappers[0].plans[-1]["kv"].tolist() == fb.seq_lens.tolist() + [fill] * (bs - len(rows))
        run_layers(backend, eng, fb, layers, rows, [1] * len(rows), graph_fb=view, forward="decode")
    fb = eng.decode([1, 2, 3])            # an eager decode step after the graphs: the same buffers
    backend.init_forward_metadata(fb)
    assert [w.ptrs() for w in decode_wrappers] == ptrs
    run_layers(backend, eng, fb, layers, [1, 2, 3], [1, 1, 1], forward="decode")

    idle = SimpleNamespace(forward_mode=ForwardMode.IDLE, batch_size=0)
    backend.init_forward_metadata(idle)
    assert backend.forward_metadata is None
    with pytest.raises(RuntimeError, match="without a plan"):
        backend.forward_decode(*eng.qkv(1, 4, 2, 64), layers[0], idle)
    got = adapter.plan_counts()
    assert got["prefill"] - counts["prefill"] == 2 * groups
    assert got["decode"] - counts["decode"] == 7 * groups
    assert got["graph_steps"] - counts["graph_steps"] == 4
    assert runner.token_to_kv_pool.writes == 9 * len(layers)


class FreshRefWrapper(RefWrapper):
    """The ragged prefill wrapper's contract (BatchAttention(ragged=True)): contiguous BSRs over the layer's k / v
    rows; its CuTe member (a stand-in rule) takes steps with no one-row request."""

    def cute_takes(self, q_lens, kv_lens, causal=True, **variant_params):
        return bool(q_lens.numel()) and bool((q_lens >= 2).all())

    def plan(self, qo_indptr, kv_lens, bsr, **kw):
        assert bsr.contiguous and bsr.block_width == 1 and torch.equal(kv_lens, qo_indptr[1:] - qo_indptr[:-1])
        self.kw = {**self.kw, "page_size": 1}
        super().plan(qo_indptr, kv_lens, bsr, **kw)

    def run(self, q, kv_cache, *, out, k_scale=1.0, v_scale=1.0):
        k, v = kv_cache
        assert k.dim() == 4 and k.shape[1] == 1 and k.shape[0] == q.shape[0], "the step's own rows"
        return super().run(q, kv_cache, out=out)


@pytest.fixture
def fresh_ref_wrappers(monkeypatch):
    """The adapter's wrappers as stand-ins: ragged ones FreshRefWrapper, the rest RefWrapper; the list of those made."""
    made = []

    def make(kernel, **kw):
        w = (FreshRefWrapper if kw.get("ragged") else RefWrapper)(kernel, **kw)
        made.append(w)
        return w
    monkeypatch.setattr(adapter, "_make_wrapper", make)
    return made


@pytest.mark.parametrize("page", [1, 4])
def test_fresh_extend_steps_read_their_own_k_and_v(page, monkeypatch, fresh_ref_wrappers):
    """Where the ragged member applies, each layer group has a fresh wrapper: an extend step of new prompts only runs
    on it over the layer's k / v; a step with a radix-cache hit, or with a one-token request (the member's rule),
    runs on the pool as before; a layer passing no k / v in a fresh step (another layer's cache) gets its group's
    paged plan, made then. Deterministic inference makes no fresh wrappers. Outputs are attention over each request's
    tokens."""
    made = fresh_ref_wrappers
    monkeypatch.setattr(adapter._cute_member, "unsupported", lambda *a, **kw: None)
    gen = torch.Generator().manual_seed(11 + page)
    layers = gemma2_layers()
    runner = model_runner(layers, page=page, gen=gen)
    backend = adapter._Backend(runner)
    fresh = [g.fresh for g in backend._groups]
    assert len(fresh) == 2 and all(isinstance(w, FreshRefWrapper) and w.kw["ragged"] for w in fresh)
    eng = Engine(runner, gen)
    eng.alloc(4, 10)
    counts = adapter.plan_counts()
    fb = eng.extend([(1, 7), (2, 5)])
    backend.init_forward_metadata(fb)
    md = backend.forward_metadata
    assert md.fresh == (True, True) and md.wrappers == tuple(fresh)
    run_layers(backend, eng, fb, layers, [1, 2], [7, 5])
    assert [w.runs for w in fresh] == [1, 1] and all(g.prefill.runs == 0 for g in backend._groups)
    assert fresh[0].plans[-1]["bsr"].kv_block_start.tolist() == [0, 7]
    assert adapter.plan_counts()["fresh"] - counts["fresh"] == 2
    for reqs, q_rows in (([(3, 6), (5, 4, (4, 8))], [6, 4]),   # row 5 hits row 4's first 8 tokens
                         ([(0, 6), (2, 1)], [6, 1])):           # a one-token request: the member's rule says no
        fb = eng.extend(reqs)
        backend.init_forward_metadata(fb)
        assert backend.forward_metadata.fresh == () and backend.forward_metadata.paged is None
        assert backend.forward_metadata.wrappers == tuple(g.prefill for g in backend._groups)
        run_layers(backend, eng, fb, layers, [r[0] for r in reqs], q_rows)
    # a layer with no k / v of its own in a fresh step: its K / V already in the pool, the paged plan made on demand
    runner.req_to_token_pool.req_to_token.zero_()
    eng2 = Engine(runner, gen)   # the same pool, rows 1 and 3 new again
    fb = eng2.extend([(1, 5), (3, 9)])
    backend.init_forward_metadata(fb)
    md = backend.forward_metadata
    assert md.fresh == (True, True)
    hq, hkv, d = 4, 2, 64
    q, k, v = eng2.qkv(14, hq, hkv, d)
    backend._write_kv(layers[1], fb, k, v)
    before, plans = backend._groups[1].prefill.runs, len(backend._groups[1].prefill.plans)
    out = backend.forward_extend(q, None, None, layers[1], fb).view(14, hq, d)
    backend.forward_extend(q, None, None, layers[1], fb)   # another such layer of the group: planned once a step
    assert backend._groups[1].prefill.runs == before + 2 and fresh[1].runs == 1
    assert len(backend._groups[1].prefill.plans) == plans + 1
    start = 0
    for row, n in ((1, 5), (3, 9)):
        hk, hv = eng2.history(1, row, n)
        want = truth(q.view(14, hq, d)[start: start + n], hk, hv, torch.arange(n), scale=layers[1].scaling,
                     cap=layers[1].logit_cap)
        torch.testing.assert_close(out[start: start + n].double(), want, rtol=1e-5, atol=1e-5)
        start += n
    made.clear()
    det = adapter._Backend(model_runner(llama_layers(), page=page, gen=gen,
                                        server_args={"enable_deterministic_inference": True}))
    assert all(g.fresh is None for g in det._groups) and not any(isinstance(w, FreshRefWrapper) for w in made)


def test_graph_padding_decode_pointers_page1_extend_after_graphs(ref_wrappers):
    """After decode graphs are captured, extend steps still plan on the prefill wrapper (its own buffers)
    and decode steps keep the decode wrapper's addresses."""
    gen = torch.Generator().manual_seed(7)
    layers = llama_layers(1)
    runner = model_runner(layers, gen=gen)
    backend = adapter._Backend(runner)
    eng = Engine(runner, gen)
    fb = eng.extend([(1, 5), (2, 9)])
    backend.init_forward_metadata(fb)
    run_layers(backend, eng, fb, layers, [1, 2], [5, 9])
    backend.init_cuda_graph_state(4, 4)          # within the pool: nothing reallocated
    dec = backend._groups[0].decode
    view = eng.graph_view(eng.decode([1, 2]), 4, 1)
    backend.init_forward_metadata_out_graph(view, in_capture=True)
    captured = dec.ptrs()
    fb = eng.extend([(1, 3), (2, 1)])
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.kernel == "prefill"
    run_layers(backend, eng, fb, layers, [1, 2], [3, 1])
    fb = eng.decode([1, 2])
    backend.init_forward_metadata(fb)
    assert dec.ptrs() == captured


def test_forward_through_sglang_dispatch(stub_sglang, ref_wrappers):
    """create_backend() as SGLang's registry calls it, and SGLang's forward() dispatch: idle -> empty,
    decode -> forward_decode, extend -> forward_extend (writing into the layer's _attn_output buffer)."""
    gen = torch.Generator().manual_seed(3)
    layers = llama_layers(1)
    runner = model_runner(layers, gen=gen)
    adapter.register()
    backend = stub_sglang.registry.ATTENTION_BACKENDS["fi_backend"](runner)
    assert isinstance(backend, adapter.FiAttnBackend) and isinstance(backend, AttentionBackendBase)
    eng = Engine(runner, gen)
    fb = eng.extend([(1, 6)])
    backend.init_forward_metadata(fb)
    q, k, v = eng.qkv(6, 4, 2, 64)
    fb._attn_output = torch.full((6, 4 * 64), math.nan)
    out = backend.forward(q, k, v, layers[0], fb)
    assert out.data_ptr() == fb._attn_output.data_ptr() and not out.isnan().any()
    fb = eng.decode([1])
    backend.init_forward_metadata(fb)
    assert backend.forward(*eng.qkv(1, 4, 2, 64), layers[0], fb).shape == (1, 256)
    idle = SimpleNamespace(forward_mode=ForwardMode.IDLE, batch_size=0)
    backend.init_forward_metadata(idle)
    assert backend.forward(torch.zeros(0, 256), None, None, layers[0], idle).shape == (0, 256)


def test_kv_write_by_append(monkeypatch, ref_wrappers):
    """FI_BACKEND_SGLANG_KV_WRITE=append writes K/V with fi_backend.ops.append_paged_kv_cache into the pool's
    own buffers (here its reference, applied in place) instead of set_kv_buffer."""
    calls = []

    def append(key, value, kv_cache, slot_mapping, *, kv_layout="NHD", k_scale=None, v_scale=None):
        calls.append(kv_layout)
        new = reference.append_paged_kv_cache(key, value, kv_cache, slot_mapping, kv_layout=kv_layout,
                                              k_scale=k_scale, v_scale=v_scale)
        for dst, src in zip(kv_cache, new):
            dst.copy_(src)

    monkeypatch.setattr(fi_backend.ops, "append_paged_kv_cache", append, raising=False)
    monkeypatch.setenv(adapter.KV_WRITE_ENV, "append")
    gen = torch.Generator().manual_seed(5)
    layers = gemma2_layers()
    runner = model_runner(layers, page=4, gen=gen)
    backend = adapter._Backend(runner)
    assert backend.kv_write == "append"
    eng = Engine(runner, gen)
    fb = eng.extend([(1, 9), (2, 2)])
    backend.init_forward_metadata(fb)
    run_layers(backend, eng, fb, layers, [1, 2], [9, 2])
    assert calls == ["NHD", "NHD"] and runner.token_to_kv_pool.writes == 0
    monkeypatch.setenv(adapter.KV_WRITE_ENV, "nonsense")
    with pytest.raises(ValueError, match="FI_BACKEND_SGLANG_KV_WRITE"):
        adapter._Backend(runner)


def test_fp8_pool_views_and_scales(ref_wrappers):
    """fp8 e4m3 pools store uint8 and hand out a float8 view on every call: the adapter keeps one (k, v)
    pair per layer, and run() gets the layer's float scales."""
    layers = llama_layers(1)
    layers[0].k_scale_float, layers[0].v_scale_float = 0.5, 0.25
    runner = model_runner(layers, kv_cache_dtype=torch.float8_e4m3fn, pool_dtype=torch.float8_e4m3fn)
    backend = adapter._Backend(runner)
    assert backend._fp8
    runs = []
    backend._groups[0].decode.run = lambda q, kv, **kw: runs.append((q, kv, kw))
    backend.forward_metadata = adapter.StepMetadata("decode", (backend._groups[0].decode,), 2)
    fb = SimpleNamespace(out_cache_loc=torch.tensor([3, 4]))
    for _ in range(2):
        backend.forward_decode(torch.zeros(2, 256), None, None, layers[0], fb)
    (q0, kv0, kw0), (_, kv1, _) = runs
    assert kv0 is kv1 and kv0[0].dtype == torch.float8_e4m3fn
    assert kv0[0].data_ptr() == runner.token_to_kv_pool.k_buffer[0].data_ptr()
    assert (kw0["k_scale"], kw0["v_scale"]) == (0.5, 0.25) and q0.shape == (2, 4, 64)
    # rows past the plan (padding of a batch SGLang padded further): not run, zeroed
    backend.forward_metadata = adapter.StepMetadata("decode", (backend._groups[0].decode,), 1)
    out = backend.forward_decode(torch.ones(3, 256), None, None, layers[0], fb)
    assert runs[-1][0].shape == (1, 4, 64) and runs[-1][2]["out"].shape == (1, 4, 64)
    assert out.shape == (3, 256) and (out[1:] == 0).all()


def test_step_errors(ref_wrappers):
    gen = torch.Generator().manual_seed(2)
    layers = llama_layers(1)
    runner = model_runner(layers, gen=gen)
    backend = adapter._Backend(runner)
    eng = Engine(runner, gen)
    fb = eng.extend([(1, 4)])
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(fb)
    fb.forward_mode = ForwardMode.EXTEND
    fb.extend_seq_lens_cpu = None
    with pytest.raises(RuntimeError, match="extend_seq_lens_cpu"):
        backend.init_forward_metadata(fb)
    fb = eng.decode([1])
    fb.seq_lens_cpu = None
    with pytest.raises(RuntimeError, match="seq_lens_cpu"):
        backend.init_forward_metadata(fb)
    fb = eng.decode([1])
    backend.init_forward_metadata(fb)
    with pytest.raises(NotImplementedError, match="sinks"):
        backend.forward_decode(*eng.qkv(1, 4, 2, 64), layers[0], fb, sinks=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="without saving"):
        backend.forward_decode(*eng.qkv(1, 4, 2, 64), layers[0], fb, save_kv_cache=False)
    stranger = Radix(4, 64, 0.5, 2, 9)   # a layer not seen at start-up, with other settings
    with pytest.raises(RuntimeError, match="layer 9"):
        backend.forward_decode(*eng.qkv(1, 4, 2, 64), stranger, fb)
    twin = Radix(4, 64, 0.3, 2, 7)       # same settings as the planned group: runs with its plan
    assert backend._group_of(twin) == 0 and backend._layer_group[7] == 0
    big = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=99)
    with pytest.raises(ValueError, match="99 requests"):
        backend.init_forward_metadata(big)


def test_planner_checks_req_to_token():
    with pytest.raises(TypeError, match="int32"):
        adapter._StepPlanner([], torch.zeros(4, 8, dtype=torch.int64), page_size=1, max_requests=4)
    with pytest.raises(ValueError, match="contiguous rows"):
        adapter._StepPlanner([], torch.zeros(8, 4, dtype=torch.int32).t(), page_size=1, max_requests=4)


# ------------------------------------------------------------------------------------ shared-prefix groups

class Node:
    """A radix-tree node as SGLang 0.5.15's RadixCache keeps it (mem_cache/radix_cache.py TreeNode): parent and
    key (the node's own tokens); the root has no parent and no tokens."""

    def __init__(self, parent=None, tokens=0):
        self.parent, self.key = parent, list(range(tokens))

    def split(self, n):
        """RadixCache._split_node: a new node takes this node's first n tokens between it and its parent; this
        node keeps its identity and the rest of its tokens."""
        new = Node(self.parent, n)
        self.parent, self.key = new, self.key[n:]
        return new


def reqs_at(*nodes):
    return [SimpleNamespace(last_node=n) for n in nodes]


def test_radix_shared_tokens():
    """Neighbours share the tokens up to their last nodes' lowest common ancestor: siblings on one node share
    all of it, a continuation shares its parent's, requests under one system prompt share it, and a request
    without a node (radix cache off, retracted) shares nothing. A split elsewhere in the tree changes nothing."""
    root = Node()
    system = Node(root, 4000)
    q1, q2 = Node(system, 100), Node(system, 50)
    q1_more = Node(q1, 7)
    other = Node(root, 30)
    reqs = reqs_at(q1, q1, q1_more, q2, None, q2, other, root)
    want = [4100, 4100, 4000, 0, 0, 0, 0]
    assert adapter.radix_shared_tokens(reqs).tolist() == want
    assert adapter.radix_shared_tokens(reqs_at(q1)).tolist() == []
    assert adapter.radix_shared_tokens([]).tolist() == []
    system.split(1000)   # another prompt that diverged after 1000 tokens of the system prompt
    q2.split(10)
    assert adapter.radix_shared_tokens(reqs).tolist() == want


def test_prefix_groups_from_shares():
    """The planner's groups: neighbours' shared tokens capped at both ones' cached tokens (kv_len - q_len), in
    whole pages; runs of sharing neighbours, each with its smallest share; rows past the hooked batch (graph
    padding) in none."""
    planner = adapter._StepPlanner([], torch.zeros(8, 64, dtype=torch.int32), page_size=4, max_requests=8,
                                   shared_prefix=True)
    fb = SimpleNamespace(out_cache_loc=torch.zeros(3))
    adapter._STEP.loc, adapter._STEP.shares = fb.out_cache_loc, torch.tensor([40, 13, 0, 9, 9]).numpy()
    qo = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    kv = torch.tensor([41, 50, 50, 20, 10, 12, 1], dtype=torch.int32)   # the 7th: padding
    try:
        assert planner._prefix_groups(fb, qo, kv).tolist() == [[0, 3, 12], [3, 6, 8]]
        kv[4] = 6   # request 4 holds 5 cached tokens: one page
        assert planner._prefix_groups(fb, qo, kv).tolist() == [[0, 3, 12], [3, 6, 4]]
        assert planner._prefix_groups(SimpleNamespace(out_cache_loc=torch.zeros(3)), qo, kv) is None   # another batch
        planner.shared_prefix = False
        assert planner._prefix_groups(fb, qo, kv) is None
    finally:
        adapter._STEP.loc = adapter._STEP.shares = None


def hook(fb, nodes):
    """SGLang's HookRegistry calling the AFTER hook of the classmethod ForwardBatch.init_new(batch, runner)."""
    assert adapter._after_forward_batch_init(fb, "ForwardBatch", SimpleNamespace(reqs=reqs_at(*nodes)), "runner") is None


@pytest.mark.parametrize("page", [1, 4])
def test_groups_flow_from_the_radix_tree_to_the_wrappers(page, ref_wrappers, monkeypatch):
    """Parallel samples of a cached prompt through the backend: the ForwardBatch.init_new hook reads the requests'
    radix nodes, and the step's plan gets the groups (checked against the BSR by the stand-in wrapper): an extend
    step on the prefill wrapper; eager decode steps on graph_prefill where the planner keeps the groups, else on
    the decode wrapper (each step runs only that one); decode graphs plan both, the other one idle, and run both
    into one output (the capture batch, which the hook never saw, single-format); groups that save less KV than
    the prefill kernel's items cost (scheduler.decode_groups_pay) stay on the decode wrapper, graph_prefill unplanned.
    Outputs equal causal attention."""
    from fi_backend import scheduler
    monkeypatch.setattr(scheduler, "PREFILL_DECODE_ITEM_TOKENS", 5)   # the 12-token prompt saves 24 > 5 x 4 rows' tokens
    gen = torch.Generator().manual_seed(10 + page)
    layers = llama_layers()
    runner = model_runner(layers, page=page, gen=gen)
    backend = adapter._Backend(runner)
    g = backend._groups[0]
    eng = Engine(runner, gen)
    counts = adapter.plan_counts()
    root = Node()
    prompt = Node(root, 12)
    eng.alloc(4, 12)   # the prompt, cached first (SGLang's n > 1: a max_new_tokens=0 request)

    fb = eng.extend([(1, 3, (4, 12)), (2, 2, (4, 12)), (3, 5, (4, 12))])
    hook(fb, [prompt] * 3)
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.wrappers == (g.prefill,) and g.prefill.plans[-1]["groups"] == [[0, 3, 12]]
    run_layers(backend, eng, fb, layers, [1, 2, 3], [3, 2, 5])
    tails = [Node(prompt, 3), Node(prompt, 2), Node(prompt, 5)]   # cache_unfinished_req moved last_node

    fb = eng.decode([1, 2, 3])
    hook(fb, tails)
    decode_plans = len(g.decode.plans)
    backend.init_forward_metadata(fb)
    md = backend.forward_metadata
    assert md.kernel == "decode" and md.wrappers == (g.graph_prefill,) and md.partners == ()
    assert g.graph_prefill.plans[-1]["groups"] == [[0, 3, 12]] and len(g.decode.plans) == decode_plans
    run_layers(backend, eng, fb, layers, [1, 2, 3], [1, 1, 1], forward="decode")
    assert g.decode.runs == 0 and g.graph_prefill.runs == len(layers)

    fb = eng.decode([1, 2, 3])
    hook(fb, tails)
    g.graph_prefill.keep_groups = False   # the planner's verdict: not worth it
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.wrappers == (g.decode,) and g.decode.plans[-1]["groups"] == [[0, 3, 12]]
    run_layers(backend, eng, fb, layers, [1, 2, 3], [1, 1, 1], forward="decode")
    g.graph_prefill.keep_groups = True

    fb = eng.decode([1, 2, 3])
    hook(fb, tails)
    monkeypatch.setattr(scheduler, "PREFILL_DECODE_ITEM_TOKENS", 8)   # 24 saved = 8 x 3: not worth the prefill kernel
    plans = len(g.graph_prefill.plans)
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata.wrappers == (g.decode,) and g.decode.plans[-1]["groups"] == [[0, 3, 12]]
    assert len(g.graph_prefill.plans) == plans
    run_layers(backend, eng, fb, layers, [1, 2, 3], [1, 1, 1], forward="decode")
    monkeypatch.setattr(scheduler, "PREFILL_DECODE_ITEM_TOKENS", 5)

    fill = backend.get_cuda_graph_seq_len_fill_value()
    backend.init_cuda_graph_state(4, 4)
    capture = eng.graph_view(eng.decode([1, 2]), 4, fill)
    backend.init_forward_metadata_out_graph(capture, in_capture=True)
    md = backend.forward_metadata
    assert md.wrappers == (g.decode,) and md.partners == (g.graph_prefill,) and g.graph_prefill.plans[-1]["idle"]
    for keep in (True, False):
        g.graph_prefill.keep_groups = keep
        fb = eng.decode([1, 2, 3])
        hook(fb, tails)
        view = eng.graph_view(fb, 4, fill)
        replay = SimpleNamespace(**vars(view))
        replay.out_cache_loc = fb.out_cache_loc   # build_replay_fb_view: the batch's own out_cache_loc
        idle_runs = g.decode.idle_runs + g.graph_prefill.idle_runs
        backend.init_forward_metadata_out_graph(replay)
        md = backend.forward_metadata
        active, idle = (g.graph_prefill, g.decode) if keep else (g.decode, g.graph_prefill)
        assert md.wrappers == (active,) and md.partners == (idle,) and md.num_rows == 4
        assert idle.plans[-1]["idle"] and not active.plans[-1]["idle"]
        assert torch.equal(idle.plans[-1]["kv"], active.plans[-1]["kv"])   # the same rows
        assert g.graph_prefill.plans[-1 if keep else -2]["groups"] == [[0, 3, 12]]   # not the padding row
        run_layers(backend, eng, fb, layers, [1, 2, 3], [1, 1, 1], graph_fb=view, forward="decode")
        assert g.decode.idle_runs + g.graph_prefill.idle_runs - idle_runs == len(layers)
    got = adapter.plan_counts()
    assert got["grouped_extend"] - counts["grouped_extend"] == 1
    assert got["grouped_decode"] - counts["grouped_decode"] == 2


def test_shared_prefix_off(monkeypatch, ref_wrappers):
    """FI_BACKEND_SHARED_PREFIX=0: two wrappers a layer group, no shared rows, no groups whatever the hook saw;
    deterministic inference: the same."""
    monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "0")
    gen = torch.Generator().manual_seed(1)
    layers = llama_layers(1)
    runner = model_runner(layers, gen=gen)
    backend = adapter._Backend(runner)
    assert [w.kernel for w in ref_wrappers] == ["decode", "prefill"] and not ref_wrappers[1].kw["shared_prefix"]
    eng = Engine(runner, gen)
    eng.alloc(4, 8)
    fb = eng.extend([(1, 2, (4, 8)), (2, 2, (4, 8))])
    prompt = Node(Node(), 8)
    hook(fb, [prompt, prompt])
    backend.init_forward_metadata(fb)
    assert ref_wrappers[1].plans[-1]["groups"] is None
    monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "1")
    det = adapter._Backend(model_runner(layers, gen=gen, server_args={"enable_deterministic_inference": True}))
    assert det._groups[0].graph_prefill is None and not det._planner.shared_prefix


@pytest.fixture
def hook_registry(monkeypatch):
    """A stand-in sglang.srt.plugins.hook_registry recording register() calls: (the calls, the module)."""
    hooks = []
    mod = types.ModuleType("sglang.srt.plugins.hook_registry")
    mod.HookType = enum.Enum("HookType", "BEFORE AFTER AROUND REPLACE")
    mod.HookRegistry = SimpleNamespace(register=lambda target, fn, kind: hooks.append((target, fn, kind)))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins", types.ModuleType("sglang.srt.plugins"))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", mod)
    monkeypatch.setattr(adapter, "_hook_registered", False)
    return hooks, mod


def test_shared_prefix_off_by_default(stub_sglang, monkeypatch, ref_wrappers, hook_registry):
    """Without FI_BACKEND_SHARED_PREFIX: no hook, two wrappers a layer group, no shared rows."""
    hooks, _ = hook_registry
    monkeypatch.delenv("FI_BACKEND_SHARED_PREFIX")
    adapter.register()
    assert hooks == []
    backend = adapter._Backend(model_runner(llama_layers(1), gen=torch.Generator().manual_seed(2)))
    assert [w.kernel for w in ref_wrappers] == ["decode", "prefill"] and not ref_wrappers[1].kw["shared_prefix"]
    assert backend._groups[0].graph_prefill is None and not backend._planner.shared_prefix


def test_register_adds_the_forward_batch_hook(stub_sglang, monkeypatch, hook_registry):
    """register() puts one AFTER hook on ForwardBatch.init_new into SGLang's plugin HookRegistry (which applies it
    once every plugin has registered), none with FI_BACKEND_SHARED_PREFIX=0."""
    hooks, mod = hook_registry
    monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "0")
    adapter.register()
    assert hooks == []
    monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "1")
    adapter.register()
    adapter.register()
    assert hooks == [("sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
                      adapter._after_forward_batch_init, mod.HookType.AFTER)]


def test_hook_failure_leaves_steps_single_format(monkeypatch, caplog):
    """A batch the hook cannot read logs one warning and publishes nothing from then on; SGLang's step goes on."""
    monkeypatch.setattr(adapter, "_shared_prefix_backends", 1)
    monkeypatch.setattr(adapter, "_hook_failed", False)
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=2, out_cache_loc=torch.zeros(2))
    bad = SimpleNamespace(reqs=[SimpleNamespace(last_node=SimpleNamespace(parent=Node(), key=None))] * 2)
    assert adapter._after_forward_batch_init(fb, "cls", bad, "runner") is None
    assert adapter._hook_failed and "shared-prefix groups are off" in caplog.text and adapter._STEP.shares is None
    hook(fb, [None, None])
    assert adapter._STEP.shares is None


# ------------------------------------------------------------------------------------ with SGLang 0.5.15 itself

def test_with_sglang_registration_arguments_and_dispatch(ref_wrappers):
    """Where SGLang 0.5.15 imports (the GPU machine; no GPU needed): the plugin entry point (when fi-backend is
    installed) or register() puts fi_backend in SGLang's registry and argument choices, SGLang's parser takes
    --attention-backend fi_backend, FiAttnBackend subclasses SGLang's AttentionBackend, and SGLang's own
    ForwardMode and forward() dispatch drive an extend, a decode, a graph-padded decode and an idle step."""
    pytest.importorskip("sglang")
    try:
        import argparse
        from importlib.metadata import entry_points
        from sglang.srt import server_args as sa
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
        from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLangForwardMode
        from sglang.srt.plugins import load_plugins
    except ImportError as e:   # a partial SGLang install (e.g. source without its dependencies)
        pytest.skip(f"SGLang not fully importable: {e}")
    if any(ep.value == "fi_backend.adapters.sglang:register" for ep in entry_points(group=adapter.ENTRY_POINT_GROUP)):
        load_plugins()
    adapter.register()
    adapter.register()
    assert ATTENTION_BACKENDS[adapter.BACKEND_NAME] is adapter.create_backend
    assert sa.ATTENTION_BACKEND_CHOICES.count(adapter.BACKEND_NAME) == 1
    parser = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--attention-backend", "fi_backend",
                              "--decode-attention-backend", "fi_backend", "--prefill-attention-backend", "fi_backend"])
    assert args.attention_backend == args.decode_attention_backend == args.prefill_attention_backend == "fi_backend"

    gen = torch.Generator().manual_seed(11)
    layers = gemma2_layers()
    runner = model_runner(layers, gen=gen)
    backend = ATTENTION_BACKENDS[adapter.BACKEND_NAME](runner)
    assert isinstance(backend, AttentionBackend) and type(backend).__name__ == "FiAttnBackend"
    eng = Engine(runner, gen, modes=SGLangForwardMode)
    eng.alloc(4, 8)
    fb = eng.extend([(1, 6), (2, 3, (4, 8))])
    backend.init_forward_metadata(fb)
    run_layers(backend, eng, fb, layers, [1, 2], [6, 3])
    fb = eng.extend([(1, 1), (2, 2)], mode=SGLangForwardMode.MIXED)
    backend.init_forward_metadata(fb)
    q, k, v = eng.qkv(3, 4, 2, 64)
    assert backend.forward(q, k, v, layers[0], fb).shape == (3, 256)   # SGLang's dispatch: forward_extend
    fb = eng.decode([1, 2])
    backend.init_forward_metadata(fb)
    run_layers(backend, eng, fb, layers, [1, 2], [1, 1], forward="decode")
    backend.init_cuda_graph_state(4, 4)
    view = eng.graph_view(eng.decode([1, 2]), 4, backend.get_cuda_graph_seq_len_fill_value())
    backend.init_forward_metadata_out_graph(view, in_capture=True)
    run_layers(backend, eng, fb, layers, [1, 2], [1, 1], graph_fb=view, forward="decode")
    idle = SimpleNamespace(forward_mode=SGLangForwardMode.IDLE, batch_size=0)
    backend.init_forward_metadata(idle)
    assert backend.forward(torch.zeros(0, 256), None, None, layers[0], idle).shape == (0, 256)


# ------------------------------------------------------------------------------------ tensor parallelism

def test_a_ranks_wrappers_live_on_its_gpu(ref_wrappers, caplog, monkeypatch):
    """SGLang names the device by type alone ("cuda") and the rank's GPU by gpu_id: every wrapper (workspace) of
    rank 3 of 4 is made on cuda:3, not on device 0, and its start-up log says so with the rank."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # no GPU 3 to ask for its capability
    runner = model_runner(llama_layers(hq=2, hkv=1), hkv=1, device="cuda", gpu_id=3, tp_size=4, tp_rank=3)
    caplog.set_level("INFO", logger="sglang.fi_backend")
    backend = adapter._Backend(runner)
    assert backend.device == torch.device("cuda", 3)
    assert [str(w.kw["device"]) for w in ref_wrappers] == ["cuda:3"] * 3
    assert "on cuda:3, tensor-parallel rank 3 of 4:" in caplog.text


def test_rank_device():
    from fi_backend.adapters import rank_device
    assert rank_device("cuda:1") == torch.device("cuda", 1)
    assert rank_device("cuda", 5) == torch.device("cuda", 5)
    assert rank_device(torch.device("cuda", 2), 5) == torch.device("cuda", 2)   # an explicit index wins
    assert rank_device("cpu", 3) == torch.device("cpu")


def test_encoder_only_layers_attend_over_each_prompts_own_k_and_v(fresh_ref_wrappers):
    """Encoder-only layers (SGLang's BERT: attn_type ENCODER_ONLY): one group with a ragged wrapper alone (no decode
    or paged wrappers; K / V in the model's dtype, rows of one token), planned non-causal over each step's own rows
    (a one-token prompt is a prompt, not a decode step); outputs are bidirectional attention over each prompt's own
    K / V (float64 reference), the KV pool untouched. A step with cached tokens (a radix-cache hit or a chunked
    prompt) or a decode step is refused naming the flags; a layer passing no key / value is refused. At start-up the
    radix cache and chunked prefill are refused (they split or cache prompts), with the flags that turn them off, and
    so is a model mixing encoder-only and decoder layers."""
    made = fresh_ref_wrappers
    gen = torch.Generator().manual_seed(29)
    hq = hkv = 4
    d = 64
    layers = [Radix(hq, d, d ** -0.5, hkv, i, attn_type="encoder_only") for i in range(2)]
    s, reasons = adapter.layer_settings(layers[0])
    assert reasons == [] and not s.causal and "encoder-only" in s.describe()
    with pytest.raises(ValueError, match="--disable-radix-cache.*--chunked-prefill-size -1"):
        adapter._Backend(model_runner(layers, page=1, gen=gen, hkv=hkv, d=d))   # SGLang's defaults
    mixed = [layers[0], Radix(hq, d, d ** -0.5, hkv, 1)]
    off = {"disable_radix_cache": True, "chunked_prefill_size": -1}
    reasons = adapter._refusal_reasons(model_runner(mixed, hkv=hkv, d=d, server_args=off), mixed)
    assert any("mixing encoder-only and decoder" in r for r in reasons), reasons
    runner = model_runner(layers, page=1, gen=gen, hkv=hkv, d=d, server_args=off)
    backend = adapter._Backend(runner)
    (g,) = backend._groups
    assert g.decode is None and g.prefill is None and g.graph_prefill is None
    assert isinstance(g.fresh, FreshRefWrapper) and g.fresh.kw["ragged"] and g.fresh.kw["kv_dtype"] == torch.bfloat16
    assert [w.kernel for w in made] == ["prefill"]
    pool_k = [runner.token_to_kv_pool.get_key_buffer(i).clone() for i in range(2)]
    eng = Engine(runner, gen)
    counts = adapter.plan_counts()
    reqs = [(1, 7), (2, 1), (3, 5)]
    fb = eng.extend(reqs)
    backend.init_forward_metadata(fb)
    md = backend.forward_metadata
    assert md.kernel == "prefill" and md.fresh == (True,) and md.wrappers == (g.fresh,)
    assert g.fresh.plans[-1]["causal"] is False
    assert adapter.plan_counts()["encoder_only"] - counts["encoder_only"] == 1
    tokens = 13
    for layer in layers:
        q, k, v = eng.qkv(tokens, hq, hkv, d)
        out = backend.forward_extend(q, k, v, layer, fb).view(tokens, hq, d)
        start = 0
        for _, n in reqs:
            qs, ks, vs = (t[start: start + n].double() for t in (q.view(tokens, hq, d), k, v))
            p = torch.softmax(torch.einsum("qhd,khd->hqk", qs, ks) * layer.scaling, dim=-1)
            torch.testing.assert_close(out[start: start + n].double(), torch.einsum("hqk,khd->qhd", p, vs),
                                       rtol=1e-5, atol=1e-5)
            start += n
        assert torch.equal(runner.token_to_kv_pool.get_key_buffer(layer.layer_id), pool_k[layer.layer_id])
        with pytest.raises(ValueError, match="passed no key / value"):
            backend.forward_extend(q, None, None, layer, fb)
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        backend.init_forward_metadata(eng.extend([(1, 3)]))   # row 1's 7 tokens are cached: 10 against 3
    with pytest.raises(ValueError, match="not decode steps"):
        backend.init_forward_metadata(eng.decode([2, 3]))
