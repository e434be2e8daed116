"""fi_backend.adapters.vllm on a machine without vLLM (and without a GPU).

What runs here: the package imports without vLLM; the entry point is declared; register() and the
lazily made vLLM classes, against a small stand-in for vLLM 0.26's registry and base classes (written
from vLLM's source, only the parts the adapter touches); the backend's shape, stride order and refusal
reasons; variant selection; and the whole per-step data path (CommonAttentionMetadata -> BSR -> plan
-> KV append -> attention into vLLM's output) with a reference wrapper in place of the kernels, checked
in float64 against attention written out here from vLLM's definitions. The real engine runs in
integration_tests/vllm/ on the GPU machine.
"""
import abc
import itertools
import enum
import importlib
import importlib.machinery
import importlib.util
import math
import pickle
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fi_backend.ops
from fi_backend import reference, variants
from fi_backend.adapters import vllm as adapter

ROOT = Path(__file__).resolve().parents[1]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


# ------------------------------------------------------------------------------------ import and entry point

def test_imports_without_vllm():
    """Importing the package and the adapter must not import vLLM (vLLM loads us, not the reverse)."""
    code = ("import sys, fi_backend, fi_backend.adapters, fi_backend.adapters.vllm as a; "
            "assert callable(a.register); assert 'vllm' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_entry_point_declared():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"][adapter.ENTRY_POINT_GROUP]
    assert group == {"fi_backend": "fi_backend.adapters.vllm:register"}
    module, attr = group["fi_backend"].split(":")
    assert getattr(importlib.import_module(module), attr) is adapter.register
    assert adapter.BACKEND_CLASS_PATH == "fi_backend.adapters.vllm.FiAttentionBackend"


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_register_without_vllm_raises_import_error():
    with pytest.raises(ImportError, match="needs vLLM 0.26 installed"):
        adapter.register()


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_vllm_classes_without_vllm_raise_import_error():
    with pytest.raises(ImportError, match="need vLLM 0.26 installed"):
        adapter.FiAttentionBackend  # noqa: B018
    with pytest.raises(AttributeError):
        adapter.NoSuchThing  # noqa: B018


def test_head_sizes_match_the_kernels():
    from fi_backend.wrappers import HEAD_DIMS
    assert adapter.HEAD_SIZES == HEAD_DIMS


# ------------------------------------------------------------------------------------ a stand-in for vLLM 0.26

@pytest.fixture(autouse=True)
def prepared(recorded_prepare):
    """The wrappers here are stand-ins: their modules are recorded, not built."""
    return recorded_prepare


@pytest.fixture
def stub_vllm(monkeypatch):
    """vllm.v1.attention.backends.registry, vllm.v1.attention.backend and get_kv_cache_layout, reduced to
    what the adapter uses, with vLLM 0.26's semantics (registry.py, backend.py)."""
    made = {name: vars(adapter).pop(name) for name in adapter._VLLM_CLASSES if name in vars(adapter)}

    def module(name):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        module(name)
    overrides = {}
    calls = []

    class AttentionBackendEnum(enum.Enum):
        FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
        CUSTOM = None

        def get_path(self):
            path = overrides.get(self, self.value)
            if not path:
                raise ValueError(f"Backend {self.name} must be registered before use.")
            return path

        def is_overridden(self):
            return self in overrides

    def register_backend(backend, class_path=None, is_mamba=False):
        calls.append((backend, class_path))
        overrides[backend] = class_path
        return lambda x: x

    registry = module("vllm.v1.attention.backends.registry")
    registry.AttentionBackendEnum, registry.register_backend = AttentionBackendEnum, register_backend

    class AttentionCGSupport(enum.Enum):
        ALWAYS, UNIFORM_BATCH, UNIFORM_SINGLE_TOKEN_DECODE, NEVER = 3, 2, 1, 0

    class AttentionBackend(abc.ABC):
        forward_includes_kv_cache_update = True

        @staticmethod
        @abc.abstractmethod
        def get_name(): ...

        @staticmethod
        @abc.abstractmethod
        def get_impl_cls(): ...

        @staticmethod
        @abc.abstractmethod
        def get_builder_cls(): ...

        @staticmethod
        @abc.abstractmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"): ...

        @classmethod
        def full_cls_name(cls):
            return (cls.__module__, cls.__qualname__)

    class AttentionMetadataBuilder(abc.ABC):
        _cudagraph_support = AttentionCGSupport.NEVER

        @abc.abstractmethod
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (
                kv_cache_spec, layer_names, vllm_config, device)

        @abc.abstractmethod
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False): ...

    class AttentionImpl(abc.ABC):
        def __new__(cls, *args, **kwargs):
            self = super().__new__(cls)
            self.dcp_world_size, self.dcp_rank = 1, 0
            return self

        @abc.abstractmethod
        def __init__(self, *args, **kwargs): ...

        @abc.abstractmethod
        def forward(self, *args, **kwargs): ...

    backend = module("vllm.v1.attention.backend")
    for cls in (AttentionCGSupport, AttentionBackend, AttentionMetadataBuilder, AttentionImpl):
        setattr(backend, cls.__name__, cls)
    layout = ["NHD"]
    module("vllm.v1.attention.backends.utils").get_kv_cache_layout = lambda: layout[0]

    yield SimpleNamespace(overrides=overrides, calls=calls, Enum=AttentionBackendEnum, CG=AttentionCGSupport,
                          layout=layout, AttentionBackend=AttentionBackend, AttentionImpl=AttentionImpl,
                          AttentionMetadataBuilder=AttentionMetadataBuilder)
    for name in adapter._VLLM_CLASSES:  # made from the stand-in: forget them
        vars(adapter).pop(name, None)
    vars(adapter).update(made)


def test_register_is_idempotent_and_silent(stub_vllm, caplog):
    adapter.register()
    adapter.register()
    assert stub_vllm.calls == [(stub_vllm.Enum.CUSTOM, adapter.BACKEND_CLASS_PATH)]
    assert stub_vllm.Enum.CUSTOM.get_path() == adapter.BACKEND_CLASS_PATH
    assert not caplog.records


def test_register_leaves_another_plugins_custom_backend(stub_vllm, caplog):
    stub_vllm.overrides[stub_vllm.Enum.CUSTOM] = "other.plugin.Backend"
    adapter.register()
    assert stub_vllm.Enum.CUSTOM.get_path() == "other.plugin.Backend"
    assert not stub_vllm.calls
    assert "already registered to other.plugin.Backend" in caplog.text


def test_register_warns_on_a_vllm_without_custom(stub_vllm, monkeypatch, caplog):
    class NoCustom(enum.Enum):
        FLASH_ATTN = "x"
    monkeypatch.setattr(sys.modules["vllm.v1.attention.backends.registry"], "AttentionBackendEnum", NoCustom)
    adapter.register()
    assert not stub_vllm.calls
    assert "has no CUSTOM member" in caplog.text


def test_vllm_classes_resolve_by_class_path(stub_vllm):
    """What vLLM does with the registered path: import the module, getattr the class, then again by
    full_cls_name(); the builder and impl classes come from the backend."""
    module_name, cls_name = adapter.BACKEND_CLASS_PATH.rsplit(".", 1)
    backend = getattr(importlib.import_module(module_name), cls_name)
    assert issubclass(backend, stub_vllm.AttentionBackend) and not backend.__abstractmethods__
    assert backend.get_name() == "CUSTOM"
    assert ".".join(backend.full_cls_name()) == adapter.BACKEND_CLASS_PATH
    assert pickle.loads(pickle.dumps(backend)) is backend
    assert backend.forward_includes_kv_cache_update is False
    builder = backend.get_builder_cls()
    assert issubclass(builder, stub_vllm.AttentionMetadataBuilder) and not builder.__abstractmethods__
    assert builder._cudagraph_support is stub_vllm.CG.UNIFORM_BATCH
    assert builder.get_cudagraph_support(None, None) is stub_vllm.CG.UNIFORM_BATCH
    impl = backend.get_impl_cls()(32, 128, 128 ** -0.5, 8, None, None, "auto", None, "decoder", None)
    assert isinstance(impl, stub_vllm.AttentionImpl) and isinstance(impl, adapter._Impl)
    assert adapter.FiAttentionImpl is backend.get_impl_cls()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_kv_cache_layout_as_vllm_allocates_it(stub_vllm, layout):
    """vLLM allocates the physical shape (logical dims in stride order) and permutes it back."""
    stub_vllm.layout[0] = layout
    B = adapter._Backend
    shape = B.get_kv_cache_shape(10, 16, 8, 128)
    assert shape == (10, 16, 8, 256)
    for layers in (False, True):
        full = (3, *shape) if layers else shape
        order = B.get_kv_cache_stride_order(include_num_layers_dimension=layers)
        assert sorted(order) == list(range(len(full)))
        phys = torch.empty([full[i] for i in order])
        logical = phys.permute(*[order.index(i) for i in range(len(order))])
        per_layer = logical[1] if layers else logical
        assert per_layer.shape == shape
        strides = per_layer.stride()
        assert strides[3] == 1 and strides[0] == max(strides)      # blocks outermost, K|V contiguous
        if layout == "NHD":
            assert strides[1] > strides[2]                           # [block, token, head, 2D]
        else:
            assert strides[2] > strides[1]                           # [block, head, token, 2D]
        if layers:  # blocks first: layers live inside a block
            assert phys.stride(0) == max(phys.stride()) and order[0] == 1


def test_kv_cache_shape_refuses_what_the_kernels_cannot_read():
    B = adapter._Backend
    with pytest.raises(ValueError, match="block sizes 16..256"):
        B.get_kv_cache_shape(10, 512, 8, 128)
    with pytest.raises(ValueError, match="block sizes 16..256, got 1"):
        B.get_kv_cache_shape(10, 1, 8, 128)
    with pytest.raises(ValueError, match="head sizes"):
        B.get_kv_cache_shape(10, 16, 8, 112)
    with pytest.raises(ValueError, match="KV-cache dtypes"):
        B.get_kv_cache_shape(10, 16, 8, 128, "fp8_e5m2")
    assert B.get_kv_cache_shape(7, 16, 2, 64, "fp8") == (7, 16, 2, 128)


def test_sliding_window_layers_get_pages_of_16():
    """vLLM 0.26 gives a sliding-window layer the smallest kernel block size the backend lists (attention.py's
    _largest_kernel_block_within without a padded page): Mistral's and Phi-3's layers got pages of one, which the
    CuTe member does not read, when the list reached down to 1. Every listed size is also one vLLM may pick for a
    manager block of that size, so each must be one the kernels read."""
    sizes = adapter._Backend.get_supported_kernel_block_sizes()
    assert min(sizes) == 16 and max(sizes) == adapter.MAX_BLOCK_SIZE
    assert all(adapter._Backend.supports_block_size(b) for b in sizes)
    try:
        from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    except ImportError:
        return   # no vLLM here: the rule above is its, read from its source
    assert _largest_kernel_block_within(adapter._Backend, 4096, None, 16) == 16


# ------------------------------------------------------------------------------------ refusal reasons

H100 = SimpleNamespace(major=9, minor=0)
LLAMA = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
             has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
             device_capability=H100, attn_type="decoder", has_sliding_window=False, use_non_causal=False,
             use_batch_invariant=False, use_kv_connector=False, use_pcp=False)


@pytest.mark.parametrize("change", [
    {}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": None},
    {"kv_cache_dtype": "bfloat16"}, {"dtype": torch.float16, "kv_cache_dtype": "float16"}, {"head_size": 64},
    {"head_size": 256}, {"head_size": 80}, {"head_size": 96}, {"block_size": 16}, {"block_size": 256}, {"block_size": 48}, {"block_size": None},
    {"has_sliding_window": True}, {"attn_type": "encoder_only"}, {"device_capability": SimpleNamespace(major=8, minor=0)},
    {"device_capability": SimpleNamespace(major=8, minor=9)},
])
def test_supported_configurations(change):
    assert adapter._Backend.validate_configuration(**{**LLAMA, **change}) == []


@pytest.mark.parametrize("change, words", [
    ({"use_mla": True}, "MLA"),
    ({"head_size": 112}, "head size 112"),
    ({"dtype": torch.float32}, "model dtype torch.float32"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype 'fp8_e5m2'"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype float16 with model dtype torch.bfloat16"),
    ({"block_size": 512}, "block size 512"),
    ({"block_size": 8}, "block size 8 is not supported (fi-backend: 16..256)"),
    ({"attn_type": "encoder"}, "attention type encoder"),
    ({"attn_type": "encoder_decoder"}, "cross-attention"),
    ({"use_non_causal": True}, "non-causal"),
    ({"attn_type": "encoder_only", "has_sliding_window": True}, "two-sided window"),
    ({"has_sink": True}, "sinks"),
    ({"use_sparse": True}, "sparse"),
    ({"use_mm_prefix": True}, "multimodal"),
    ({"use_per_head_quant_scales": True}, "per-head"),
    ({"device_capability": SimpleNamespace(major=7, minor=5)}, "compute capability 7.5"),
    ({"device_capability": SimpleNamespace(major=10, minor=0)}, "Hopper"),
    ({"use_kv_connector": True}, "KV connectors"),
    ({"use_pcp": True}, "context parallelism"),
    ({"use_future_feature": True}, "use_future_feature=True"),
])
def test_refusal_reasons_name_the_problem(change, words):
    reasons = adapter._Backend.validate_configuration(**{**LLAMA, **change})
    assert len(reasons) == 1 and words in reasons[0], reasons


# ------------------------------------------------------------------------------------ variants and groups

@pytest.mark.parametrize("alibi, window, cap, name, params", [
    (None, None, None, "default", {}),
    (None, None, 0.0, "default", {}),
    (None, 4096, None, "window", {"window_left": 4095}),
    (None, None, 50.0, "soft_cap", {"logits_soft_cap": 50.0}),
    ([0.5, 0.25], None, None, "alibi", {"alibi_slopes": (0.5, 0.25)}),
    (None, 128, 30.0, "soft_cap_window", {"logits_soft_cap": 30.0, "window_left": 127}),
    (torch.tensor([0.5, 0.25]), 64, None, "alibi_window", {"alibi_slopes": (0.5, 0.25), "window_left": 63}),
])
def test_layer_variant(alibi, window, cap, name, params):
    variant, got = adapter.layer_variant(alibi, window, cap)
    assert variant.name == name and got == params
    assert set(got) == set(variant.params)
    if name in variants.BUILTIN_VARIANTS:
        assert variant == variants.BUILTIN_VARIANTS[name]


def test_layer_variant_rejects_a_bad_window():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        adapter.layer_variant(None, 0, None)


def impl(num_heads=8, head_size=64, num_kv_heads=2, **kw):
    return adapter._Impl(num_heads, head_size, head_size ** -0.5, num_kv_heads, **kw)


def test_impl_refuses_what_the_kernels_cannot_run():
    with pytest.raises(ValueError, match="head sizes"):
        impl(head_size=112)
    with pytest.raises(NotImplementedError, match="attention types decoder, encoder_only, got encoder_decoder"):
        impl(attn_type="encoder_decoder")
    assert impl(attn_type="encoder_only").attn_type == "encoder_only"
    with pytest.raises(NotImplementedError, match="encoder-only attention with a sliding window or ALiBi"):
        impl(attn_type="encoder_only", sliding_window=128)
    with pytest.raises(NotImplementedError, match="encoder-only attention with a sliding window or ALiBi"):
        impl(attn_type="encoder_only", alibi_slopes=[0.5] * 8)
    with pytest.raises(NotImplementedError, match="sinks"):
        impl(sinks=torch.zeros(8))
    with pytest.raises(NotImplementedError, match="use_alibi_sqrt"):
        impl(use_alibi_sqrt=True)
    with pytest.raises(ValueError, match="alibi_slopes has 2 entries"):
        impl(alibi_slopes=[1.0, 2.0])
    with pytest.raises(ValueError, match="KV-cache dtypes"):
        impl(kv_cache_dtype="int8_per_token_head")


def test_group_settings_must_agree():
    same = adapter._group_settings({f"layers.{i}.attn": impl(sliding_window=32) for i in range(3)})
    assert same.variant.name == "window" and dict(same.plan_params) == {"window_left": 31}
    with pytest.raises(ValueError, match="layers.1.attn.*layers.0.attn|layers.0.attn.*layers.1.attn"):
        adapter._group_settings({"layers.0.attn": impl(sliding_window=32), "layers.1.attn": impl(sliding_window=64)})
    with pytest.raises(TypeError, match="layers.0.attn uses object"):
        adapter._group_settings({"layers.0.attn": object()})
    with pytest.raises(ValueError, match="no attention layers"):
        adapter._group_settings({})


# ------------------------------------------------------------------------------------ the per-step data path

class RefWrapper:
    """BatchAttention's plan/run contract, computed with fi_backend.reference (float64) from the BSR. Shared-prefix
    groups are checked against the BSR and kept by a stand-in verdict (keep_groups, prefill kernel only:
    plan_info.shared_groups); an idle plan's run() writes nothing."""

    module_names = []
    keep_groups = True
    cute_unsupported = "a reference wrapper"  # no CuTe member (CuteRefWrapper has a stand-in)
    cute_step = False                         # whether the last plan went to the member

    def __init__(self, name):
        self.name, self.plans, self.runs, self.idle_runs = name, [], 0, 0

    def plan(self, qo_indptr, kv_lens, bsr, *, causal, sm_scale, debug=False, prefix_groups=None, idle=False,
             **variant_params):
        assert qo_indptr.device.type == "cpu" and kv_lens.device.type == "cpu"
        assert qo_indptr.dtype == kv_lens.dtype == torch.int32
        assert bsr.kv_lens.numel() == kv_lens.numel() == qo_indptr.numel() - 1
        bsr.validate(prefix_groups=prefix_groups)  # the groups the adapter found hold for this BSR
        assert (kv_lens >= bsr.kv_lens).all(), "the plan's KV lengths must bound the device's"
        assert not (idle and prefix_groups is not None), "an idle plan has no items, so no groups"
        kept = len(prefix_groups) if prefix_groups is not None and self.name != "decode" and self.keep_groups else 0
        self.plan_info = SimpleNamespace(shared_groups=kept, kind="idle" if idle else "lpt")
        self.plans.append(dict(qo=qo_indptr.clone(), kv=kv_lens.clone(), bsr=bsr, causal=causal, sm_scale=sm_scale,
                               vp=variant_params, idle=idle,
                               groups=None if prefix_groups is None else [list(map(int, g)) for g in prefix_groups]))

    def run(self, q, kv_cache, *, out, k_scale=1.0, v_scale=1.0):
        p = self.plans[-1]
        assert q.shape[0] == out.shape[0] == int(p["qo"][-1])
        if p["idle"]:
            self.idle_runs += 1
            return out
        D = q.shape[-1]
        o, _ = reference.attention_bsr(q, kv_cache[..., :D], kv_cache[..., D:], p["bsr"], causal=p["causal"],
                                       sm_scale=p["sm_scale"], **p["vp"])
        out.copy_(o.to(out.dtype))
        self.runs += 1
        return out


def ref_append(key, value, kv_cache, slot_mapping, *, kv_layout="NHD", k_scale=None, v_scale=None):
    """fi_backend.ops.append_paged_kv_cache's contract: first slot_mapping.numel() rows, slots < 0 skipped."""
    assert kv_layout == "NHD"
    n = slot_mapping.numel()
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    flat[slots[keep]] = torch.cat([key[:n][keep], value[:n][keep]], dim=-1).to(kv_cache.dtype)


def truth(q, k, v, q_pos, *, scale, window=None, cap=None, slopes=None):
    """Causal attention of one request as vLLM defines its layer settings: a query at position p sees KV
    positions p - window + 1 .. p; soft-cap on the scaled logits; ALiBi adds slope * (kv_pos - q_pos)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    rel = torch.arange(k.shape[0])[None, :] - q_pos[:, None]
    if slopes is not None:
        s = s + torch.tensor(slopes, dtype=torch.float64)[:, None, None] * rel
    allowed = rel <= 0
    if window:
        allowed &= rel > -window
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


class Engine:
    """vLLM's V2 model runner, reduced to its buffers: persistent query_start_loc, seq_lens and block table
    (padded rows zeroed), CPU copies, slot mapping padded with -1, and a packed KV cache."""

    P, MAX_REQS, MAX_BLOCKS, NUM_BLOCKS = 4, 8, 8, 40

    def __init__(self, hq, hkv, d, gen):
        self.hq, self.hkv, self.d, self.gen = hq, hkv, d, gen
        self.qsl = torch.zeros(self.MAX_REQS + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(self.MAX_REQS, dtype=torch.int32)
        self.tables = torch.zeros(self.MAX_REQS, self.MAX_BLOCKS, dtype=torch.int32)
        self.kv = torch.randn(self.NUM_BLOCKS, self.P, hkv, 2 * d, generator=gen)

    def step(self, reqs, pad_to=None):
        """reqs: [(blocks, cached tokens, new tokens)]. Returns (metadata, q, k, v, slots, truth inputs)."""
        n = len(reqs)
        n_pad = pad_to or n
        q_lens = [r[2] for r in reqs] + [0] * (n_pad - n)
        seq = [r[1] + r[2] for r in reqs] + [0] * (n_pad - n)
        qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        tokens = int(qsl[-1])
        n_tok = tokens + (n_pad - n)                 # padded decode: one token per padded request
        self.qsl.fill_(tokens)
        self.qsl[: n_pad + 1] = qsl
        self.seq_lens.zero_()
        self.seq_lens[:n_pad] = torch.tensor(seq, dtype=torch.int32)
        self.tables.zero_()
        slots = torch.full((n_tok,), -1, dtype=torch.int64)
        for i, (blocks, cached, new) in enumerate(reqs):
            self.tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            pos = torch.arange(cached, cached + new)
            slots[int(qsl[i]): int(qsl[i + 1])] = torch.tensor(blocks)[pos // self.P] * self.P + pos % self.P
        cm = SimpleNamespace(
            query_start_loc=self.qsl[: n_pad + 1], query_start_loc_cpu=qsl.clone(), seq_lens=self.seq_lens[:n_pad],
            seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32), num_reqs=n_pad, num_actual_tokens=n_tok,
            max_query_len=max(q_lens), max_seq_len=max(seq), block_table_tensor=self.tables[:n_pad],
            slot_mapping=slots, causal=True)
        q = torch.randn(n_tok, self.hq, self.d, generator=self.gen)
        k = torch.randn(n_tok, self.hkv, self.d, generator=self.gen)
        v = torch.randn(n_tok, self.hkv, self.d, generator=self.gen)
        return cm, q, k, v

    def history(self, blocks, length):
        """A request's K and V, tokens 0..length-1, read back through its blocks (shared blocks included)."""
        rows = self.kv[torch.tensor(blocks)].reshape(-1, self.hkv, 2 * self.d)[:length]
        return rows[..., : self.d], rows[..., self.d:]


@pytest.mark.parametrize("settings", [
    {}, {"sliding_window": 5}, {"logits_soft_cap": 2.0}, {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]},
    {"sliding_window": 6, "logits_soft_cap": 3.0},
])
def test_step_data_path_matches_vllm_attention(settings, monkeypatch):
    """Two steps through the adapter as vLLM drives it: a mixed step (fresh prefill, prefix-cache hit with a
    shared block, decode) on the prefill wrapper, then a CUDA-graph-padded decode step on the decode wrapper,
    with the engine's buffers rewritten in place. Outputs equal causal attention over each request's tokens."""
    monkeypatch.setattr(fi_backend.ops, "append_paged_kv_cache", ref_append, raising=False)
    hq, hkv, d = 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    eng = Engine(hq, hkv, d, gen)
    layer_impl = adapter._Impl(hq, d, 0.3, hkv, kv_cache_dtype="auto", **settings)
    s = adapter._group_settings({"model.layers.0.self_attn.attn": layer_impl})
    params = dict(s.plan_params)
    if "alibi_slopes" in params:
        params["alibi_slopes"] = torch.tensor(params["alibi_slopes"], dtype=torch.float32)
    dec, pre = RefWrapper("decode"), RefWrapper("prefill")
    planner = adapter._StepPlanner(dec, pre, page_size=Engine.P, sm_scale=s.sm_scale, variant_params=params)
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    tv = dict(scale=0.3, window=settings.get("sliding_window"), cap=settings.get("logits_soft_cap"),
              slopes=settings.get("alibi_slopes"))
    # Request blocks: r1 and r2 share block 5 (a cached prefix); r0 is a fresh prompt.
    blocks = {0: [3, 17], 1: [5, 2, 9, 11], 2: [5, 20, 21, 22]}
    steps = [([(blocks[0], 0, 7), (blocks[1], 9, 5), (blocks[2], 12, 1)], None, pre),
             ([(blocks[0], 7, 1), (blocks[1], 14, 1), (blocks[2], 13, 1)], 5, dec)]
    counts = adapter.plan_counts()
    ptrs = None
    for reqs, pad_to, wrapper in steps:
        cm, q, k, v = eng.step(reqs, pad_to)
        md = planner.plan(cm)
        assert md.wrapper is wrapper and md.num_rows == sum(r[2] for r in reqs)
        bsr = wrapper.plans[-1]["bsr"]
        now = tuple(t.data_ptr() for t in (bsr.qo_indptr, bsr.kv_lens, bsr.kv_indices, bsr.kv_block_start))
        assert ptrs in (None, now), "BSR addresses must not change between steps (CUDA-graph replay)"
        ptrs = now
        assert bsr.kv_indices.numel() == eng.tables.numel()
        assert torch.equal(bsr.kv_block_start, torch.arange(cm.num_reqs, dtype=torch.int32) * Engine.MAX_BLOCKS)
        assert wrapper.plans[-1]["causal"] is True and wrapper.plans[-1]["sm_scale"] == 0.3
        assert set(wrapper.plans[-1]["vp"]) == set(s.variant.params)

        layer_impl.do_kv_cache_update(layer, k, v, eng.kv, cm.slot_mapping)
        out = torch.full((cm.num_actual_tokens, hq, d), math.nan)
        assert layer_impl.forward(layer, q, k, v, eng.kv, md, out) is out
        qsl = cm.query_start_loc_cpu
        for i, (blk, cached, new) in enumerate(reqs):
            hk, hv = eng.history(blk, cached + new)
            rows = slice(int(qsl[i]), int(qsl[i + 1]))
            assert torch.equal(hk[cached:], k[rows]) and torch.equal(hv[cached:], v[rows])  # the append
            want = truth(q[rows], hk, hv, torch.arange(cached, cached + new), **tv)
            torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-6)
        assert out[md.num_rows:].isnan().all(), "padding rows are not the plan's: left as they are"
    assert adapter.plan_counts() == {**counts, "decode": counts["decode"] + 1, "prefill": counts["prefill"] + 1}
    assert dec.runs == pre.runs == 1


def _forward_and_check(layer_impl, eng, reqs, cm, md, q, k, v):
    """Append the step's K / V, run the layer on its metadata into a NaN-filled output, and check every request's rows
    against attention over its own tokens (scale 0.3)."""
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0, _k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    layer_impl.do_kv_cache_update(layer, k, v, eng.kv, cm.slot_mapping)
    out = torch.full((cm.num_actual_tokens, layer_impl.num_heads, layer_impl.head_size), math.nan)
    layer_impl.forward(layer, q, k, v, eng.kv, md, out)
    qsl = cm.query_start_loc_cpu
    for i, (blk, cached, new) in enumerate(reqs):
        hk, hv = eng.history(blk, cached + new)
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        want = truth(q[rows], hk, hv, torch.arange(cached, cached + new), scale=0.3)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-6)


def test_batch_invariant_mixed_step_runs_decodes_on_the_decode_kernel(monkeypatch):
    """VLLM_BATCH_INVARIANT=1: validate_configuration accepts it, and a mixed step (decodes first, as vLLM
    orders them with reorder_batch_threshold = 1) is planned in two parts, the decodes on the decode wrapper
    and the rest on the prefill wrapper with its qo_indptr rebased to 0; the outputs are still attention over
    each request's tokens. Without the switch the whole step goes to the prefill wrapper."""
    monkeypatch.setattr(fi_backend.ops, "append_paged_kv_cache", ref_append, raising=False)
    assert adapter._Backend.validate_configuration(**{**LLAMA, "use_batch_invariant": True}) == []
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert adapter.batch_invariant()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not adapter.batch_invariant()
    hq, hkv, d = 4, 2, 64
    eng = Engine(hq, hkv, d, torch.Generator().manual_seed(3))
    layer_impl = adapter._Impl(hq, d, 0.3, hkv, kv_cache_dtype="auto")
    reqs = [([3, 17], 7, 1), ([5, 2, 9, 11], 14, 1), ([5, 20, 21, 22], 6, 9), ([8, 30], 0, 5)]
    for det in (True, False):
        dec, pre = RefWrapper("decode"), RefWrapper("prefill")
        planner = adapter._StepPlanner(dec, pre, page_size=Engine.P, sm_scale=0.3, variant_params={}, deterministic=det)
        cm, q, k, v = eng.step(reqs)
        md = planner.plan(cm)
        assert md.num_decode_rows == (2 if det else 0) and len(dec.plans) == (1 if det else 0) and len(pre.plans) == 1
        if det:
            assert md.decode_wrapper is dec and dec.plans[-1]["qo"].tolist() == [0, 1, 2]
            assert dec.plans[-1]["kv"].tolist() == [8, 15]
            assert pre.plans[-1]["qo"].tolist() == [0, 9, 14] and pre.plans[-1]["kv"].tolist() == [15, 5]
            assert pre.plans[-1]["bsr"].qo_indptr.tolist() == [0, 9, 14]
        _forward_and_check(layer_impl, eng, reqs, cm, md, q, k, v)
        assert dec.runs == (1 if det else 0) and pre.runs == 1


class CuteRefWrapper(RefWrapper):
    """A prefill RefWrapper whose CuTe member (a stand-in rule) takes steps with no one-row request."""

    cute_unsupported = None

    def cute_takes(self, q_lens, kv_lens, causal=True, **variant_params):
        return bool(q_lens.numel()) and bool((q_lens >= 2).all())

    def plan(self, qo_indptr, kv_lens, bsr, **kw):
        super().plan(qo_indptr, kv_lens, bsr, **kw)
        self.cute_step = self.cute_takes(qo_indptr[1:] - qo_indptr[:-1], kv_lens)


def test_split_mixed_sends_the_prefill_part_to_the_cute_member(monkeypatch):
    """split_mixed (the prefill wrapper has a CuTe member): a mixed step whose prefill part the member takes, and
    the whole step not, runs in two launches (decodes first on the decode wrapper); a step the member takes whole,
    or whose prefill part it would not take, stays one launch; outputs are attention over each request's tokens."""
    monkeypatch.setattr(fi_backend.ops, "append_paged_kv_cache", ref_append, raising=False)
    hq, hkv, d = 4, 2, 64
    eng = Engine(hq, hkv, d, torch.Generator().manual_seed(5))
    layer_impl = adapter._Impl(hq, d, 0.3, hkv, kv_cache_dtype="auto")
    cases = [  # (requests, decode rows split off)
        ([([3, 17], 7, 1), ([5, 2, 9, 11], 14, 1), ([5, 20, 21, 22], 6, 9), ([8, 30], 0, 5)], 2),
        ([([5, 20, 21, 22], 6, 9), ([8, 30], 0, 5)], 0),                     # taken whole: one launch
        ([([3, 17], 7, 1), ([8, 30], 0, 5), ([5, 2, 9, 11], 14, 1)], 0),     # the rest has a one-row request
    ]
    for reqs, nd in cases:
        dec, pre = RefWrapper("decode"), CuteRefWrapper("prefill")
        planner = adapter._StepPlanner(dec, pre, page_size=Engine.P, sm_scale=0.3, variant_params={}, split_mixed=True)
        cm, q, k, v = eng.step(reqs)
        cute_plans = adapter.plan_counts()["cute"]
        md = planner.plan(cm)
        assert md.num_decode_rows == nd and len(dec.plans) == (1 if nd else 0) and len(pre.plans) == 1
        # plan_counts counts the steps the member took: the first two cases' prefill plans, not the third's
        assert pre.cute_step == (reqs is not cases[2][0])
        assert adapter.plan_counts()["cute"] - cute_plans == int(pre.cute_step)
        _forward_and_check(layer_impl, eng, reqs, cm, md, q, k, v)
        assert dec.runs == (1 if nd else 0) and pre.runs == 1


class FreshRefWrapper(CuteRefWrapper):
    """The ragged prefill wrapper (BatchAttention(ragged=True)): contiguous BSRs over forward's K / V rows, run()
    given (k.unsqueeze(1), v.unsqueeze(1))."""

    def plan(self, qo_indptr, kv_lens, bsr, **kw):
        assert bsr.contiguous and bsr.block_width == 1
        assert torch.equal(bsr.kv_lens, bsr.qo_indptr[1:] - bsr.qo_indptr[:-1]), "new prompts: keys = queries"
        super().plan(qo_indptr, kv_lens, bsr, **kw)

    def run(self, q, kv_cache, *, out, k_scale=1.0, v_scale=1.0):
        k, v = kv_cache
        assert k.dim() == 4 and k.shape[1] == 1 and k.shape[0] == q.shape[0] and not self.plans[-1]["idle"]
        p = self.plans[-1]
        o, _ = reference.attention_bsr(q, k, v, p["bsr"], causal=p["causal"], sm_scale=p["sm_scale"], **p["vp"])
        out.copy_(o.to(out.dtype))
        self.runs += 1
        return out


def test_fresh_steps_read_their_own_key_and_value(monkeypatch):
    """With a fresh wrapper, a step of new prompts only (no cached token) runs on it over forward's key / value
    (a contiguous BSR of the step's rows); a mixed step whose decodes come first and whose rest is new prompts runs
    the decodes on the decode wrapper and the rest on it (rows rebased); a step with a prefix hit, or one the
    member would not take, stays on the paged prefill wrapper. Outputs are attention over each request's tokens."""
    monkeypatch.setattr(fi_backend.ops, "append_paged_kv_cache", ref_append, raising=False)
    hq, hkv, d = 4, 2, 64
    eng = Engine(hq, hkv, d, torch.Generator().manual_seed(9))
    layer_impl = adapter._Impl(hq, d, 0.3, hkv, kv_cache_dtype="auto")
    cases = [  # (requests, which wrapper runs the prefill rows, decode rows split off)
        ([([5, 20, 21, 22], 0, 13), ([8, 30], 0, 5)], "fresh", 0),
        ([([3, 17], 7, 1), ([5, 2, 9, 11], 14, 1), ([5, 20, 21, 22], 0, 9), ([8, 30], 0, 5)], "fresh", 2),
        ([([5, 20, 21, 22], 6, 9), ([8, 30], 0, 5)], "prefill", 0),       # a prefix hit: the cache's pages
        ([([8, 30], 0, 5), ([3, 17], 0, 1)], "prefill", 0),               # the member would not take it
    ]
    for reqs, where, nd in cases:
        dec, pre, fresh = RefWrapper("decode"), CuteRefWrapper("prefill"), FreshRefWrapper("fresh")
        planner = adapter._StepPlanner(dec, pre, page_size=Engine.P, sm_scale=0.3, variant_params={}, split_mixed=True,
                                       fresh=fresh)
        cm, q, k, v = eng.step(reqs)
        before = adapter.plan_counts()["fresh"]
        md = planner.plan(cm)
        assert md.fresh == (where == "fresh") and md.num_decode_rows == nd
        assert md.wrapper is (fresh if where == "fresh" else pre)
        assert adapter.plan_counts()["fresh"] - before == int(where == "fresh")
        if where == "fresh":
            rows = sum(r[2] for r in reqs[nd:])
            assert fresh.plans[-1]["bsr"].qo_indptr.tolist() == fresh.plans[-1]["qo"].tolist()
            assert int(fresh.plans[-1]["qo"][-1]) == rows and fresh.plans[-1]["bsr"].num_kv_blocks == rows
        _forward_and_check(layer_impl, eng, reqs, cm, md, q, k, v)
        assert (fresh.runs, pre.runs) == ((1, 0) if where == "fresh" else (0, 1)) and dec.runs == int(nd > 0)
    # a fresh wrapper is never planned for a capture, nor in batch-invariant mode
    for kw in (dict(split_mixed=True), dict(deterministic=True)):
        dec, pre, fresh = RefWrapper("decode"), CuteRefWrapper("prefill"), FreshRefWrapper("fresh")
        planner = adapter._StepPlanner(dec, pre, page_size=Engine.P, sm_scale=0.3, variant_params={}, fresh=fresh, **kw)
        cm, q, k, v = eng.step(cases[0][0])
        md = planner.plan(cm, capture=bool(kw.get("split_mixed")))
        assert not md.fresh and not fresh.plans


# ------------------------------------------------------------------------------------ encoder-only layers

class EncoderRefWrapper(FreshRefWrapper):
    """The encoder-only group's ragged wrapper: its CuTe stand-in takes steps with no one-row request (the real
    wrapper runs the others on the tile family, over K / V of any strides: test_cute_member_gpu.py)."""


def _encoder_step(lens, hq, hkv, d, gen, rotary_key):
    """vLLM's metadata of an encoder-only step (causal False, each prompt whole: keys = its own rows, no KV cache,
    a block table of zeros) and the step's q / k / v, views of one fused QKV buffer (k a tensor of its own with
    rotary_key, as a rotary embedding makes it)."""
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = int(qsl[-1])
    qkv = torch.randn(rows, hq + 2 * hkv, d, generator=gen)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    if rotary_key:
        k = k.contiguous()
    cm = SimpleNamespace(query_start_loc=qsl.clone(), query_start_loc_cpu=qsl,
                         seq_lens=torch.tensor(lens, dtype=torch.int32),
                         seq_lens_cpu_upper_bound=torch.tensor(lens, dtype=torch.int32), num_reqs=len(lens),
                         num_actual_tokens=rows, max_query_len=max(lens), max_seq_len=max(lens),
                         block_table_tensor=torch.zeros(len(lens), 1, dtype=torch.int32),
                         slot_mapping=torch.zeros(rows, dtype=torch.int64), causal=False)
    return cm, q, k, v


@pytest.mark.parametrize("lens, on_member", [([5, 1, 9], False), ([5, 2, 9], True)])
@pytest.mark.parametrize("rotary_key", [False, True])
def test_encoder_only_steps_attend_both_ways(lens, on_member, rotary_key):
    """Encoder-only layers: each step plans one non-causal ragged plan over the step's own rows and forward runs it
    over key / value (no KV cache to write or read), on the member or not, key and value of equal strides or not.
    Outputs: bidirectional attention over each prompt's tokens."""
    hq, hkv, d = 4, 2, 64
    gen = torch.Generator().manual_seed(21)
    wrapper = EncoderRefWrapper("encoder")
    planner = adapter._EncoderPlanner(wrapper, sm_scale=0.3, variant_params={})
    cm, q, k, v = _encoder_step(lens, hq, hkv, d, gen, rotary_key)
    before = adapter.plan_counts()["encoder_only"]
    md = planner.plan(cm)
    assert md.fresh and md.wrapper is wrapper and adapter.plan_counts()["encoder_only"] == before + 1
    p = wrapper.plans[-1]
    assert p["causal"] is False and p["bsr"].contiguous and p["kv"].tolist() == lens
    assert wrapper.cute_step == on_member
    layer_impl = adapter._Impl(hq, d, 0.3, hkv, attn_type="encoder_only")
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    empty = torch.tensor([])   # vLLM's encoder-only layers have no KV cache
    layer_impl.do_kv_cache_update(layer, k, v, empty, cm.slot_mapping)
    out = torch.full((cm.num_actual_tokens, hq, d), math.nan)
    layer_impl.forward(layer, q, k, v, empty, md, out)
    qsl = cm.query_start_loc_cpu.tolist()
    for i, n in enumerate(lens):
        rows = slice(qsl[i], qsl[i + 1])
        want = truth(q[rows], k[rows], v[rows], torch.full((n,), n - 1), scale=0.3)   # every key visible
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-6)


def test_encoder_only_plan_refuses_what_it_cannot_run():
    """A causal step, a prompt split over steps (its earlier tokens are in no cache) and a CUDA-graph capture are
    errors that name the problem."""
    planner = adapter._EncoderPlanner(EncoderRefWrapper("encoder"), sm_scale=0.3, variant_params={})
    gen = torch.Generator().manual_seed(3)
    cm, _, _, _ = _encoder_step([4, 6], 4, 2, 64, gen, False)
    with pytest.raises(ValueError, match="non-causal"):
        planner.plan(SimpleNamespace(**{**vars(cm), "causal": True}))
    split = SimpleNamespace(**{**vars(cm), "seq_lens_cpu_upper_bound": torch.tensor([4, 9], dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"whole in one step.*requests \[1\]"):
        planner.plan(split)
    with pytest.raises(NotImplementedError, match="CUDA graphs"):
        planner.plan(cm, capture=True)


def test_builder_of_an_encoder_only_group(stub_vllm, monkeypatch, caplog, prepared):
    """An encoder-only group (vLLM's EncoderOnlyAttentionSpec, impls of attn_type encoder_only) gets one ragged
    prefill wrapper (page 1, K / V in the model's dtype), its modules built first, the encoder planner, and no CUDA
    graphs; a group mixing attention types is refused."""
    impls = {f"layers.{i}.attn": adapter._Impl(12, 64, 0.125, 12, attn_type="encoder_only") for i in range(2)}
    _stub_layer_lookup(monkeypatch, impls)
    made = []
    monkeypatch.setattr(adapter, "_make_wrapper", lambda kernel, **kw: made.append((kernel, kw)) or SimpleNamespace(
        module_names=[f"{kernel}_module"], cute_unsupported=None))
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=512,
                                                           enable_chunked_prefill=False),
                          model_config=SimpleNamespace(dtype=torch.float16, max_model_len=512),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1))
    EncoderOnlyAttentionSpec = type("EncoderOnlyAttentionSpec", (), {})
    spec = EncoderOnlyAttentionSpec()
    spec.num_kv_heads, spec.head_size, spec.block_size = 12, 64, 16
    caplog.set_level("INFO", logger="vllm.fi_backend")
    builder = adapter.FiAttentionMetadataBuilder(spec, list(impls), cfg, "cuda:0")
    ((kernel, kw),) = made
    assert kernel == "prefill" and kw["ragged"] and kw["page_size"] == 1 and kw["max_rows"] == 512
    assert kw["q_dtype"] == kw["kv_dtype"] == torch.float16
    ((args, pkw),) = prepared
    assert args == (12, 12, 64) and pkw["kinds"] == ("prefill",) and pkw["ragged"] and pkw["page_size"] == 1
    assert isinstance(builder._step, adapter._EncoderPlanner) and not builder.use_cascade_attention(64)
    assert adapter.FiAttentionMetadataBuilder.get_cudagraph_support(cfg, spec) == stub_vllm.CG.NEVER
    decoder_spec = SimpleNamespace(num_kv_heads=12, head_size=64, block_size=16)
    assert adapter.FiAttentionMetadataBuilder.get_cudagraph_support(cfg, decoder_spec) == stub_vllm.CG.UNIFORM_BATCH
    assert "encoder-only attention (2 layers" in caplog.text
    cfg.scheduler_config.enable_chunked_prefill, cfg.model_config.max_model_len = True, 2048
    with pytest.raises(ValueError, match="whole prompts: chunked prefill with max_num_batched_tokens 512"):
        adapter.FiAttentionMetadataBuilder(spec, list(impls), cfg, "cuda:0")
    cfg.scheduler_config.enable_chunked_prefill = False
    cfg.cache_config = SimpleNamespace(enable_prefix_caching=True)
    with pytest.raises(ValueError, match="whole prompts: prefix caching is on"):
        adapter.FiAttentionMetadataBuilder(spec, list(impls), cfg, "cuda:0")
    impls["layers.1.attn"] = adapter._Impl(12, 64, 0.125, 12)
    with pytest.raises(ValueError, match="mixes attention types"):
        adapter.FiAttentionMetadataBuilder(spec, list(impls), cfg, "cuda:0")


def test_batch_invariant_warns_when_decodes_are_not_first(monkeypatch, caplog):
    """A mixed step whose one-token requests are not all first: the leading ones go to the decode wrapper, the
    rest stay with the prefill wrapper, and a warning says so (once)."""
    monkeypatch.setattr(adapter, "_warned_unordered", False)
    eng = Engine(4, 2, 64, torch.Generator().manual_seed(4))
    dec, pre = RefWrapper("decode"), RefWrapper("prefill")
    planner = adapter._StepPlanner(dec, pre, page_size=Engine.P, sm_scale=0.3, variant_params={}, deterministic=True)
    cm, *_ = eng.step([([3, 17], 7, 1), ([8, 30], 0, 5), ([5, 2, 9, 11], 14, 1)])
    with caplog.at_level("WARNING", logger="vllm.fi_backend"):
        md = planner.plan(cm)
        planner.plan(cm)
    assert md.num_decode_rows == 1 and pre.plans[-1]["qo"].tolist() == [0, 5, 6]
    assert sum("did not put decodes first" in r.message for r in caplog.records) == 1


def test_plan_uses_upper_bounds_and_never_the_device():
    """seq_lens_cpu_upper_bound feeds the plan (an upper bound; the device holds the truth); without it the
    step's max_seq_len bounds every request. The device tensors go to the BSR as they are (no copies)."""
    gen = torch.Generator().manual_seed(1)
    eng = Engine(4, 2, 64, gen)
    dec, pre = RefWrapper("decode"), RefWrapper("prefill")
    planner = adapter._StepPlanner(dec, pre, page_size=Engine.P, sm_scale=1.0, variant_params={})
    cm, *_ = eng.step([([1, 2], 5, 1), ([3], 2, 1)])
    cm.seq_lens_cpu_upper_bound = torch.tensor([8, 4], dtype=torch.int32)   # async spec-decode style bound
    planner.plan(cm)
    p = dec.plans[-1]
    assert p["kv"].tolist() == [8, 4] and p["bsr"].kv_lens is cm.seq_lens and p["bsr"].qo_indptr is cm.query_start_loc
    cm.seq_lens_cpu_upper_bound = None
    planner.plan(cm)
    assert dec.plans[-1]["kv"].tolist() == [6, 6]
    cm.causal = False
    with pytest.raises(NotImplementedError, match="causal"):
        planner.plan(cm)


def test_block_table_checks():
    planner = adapter._StepPlanner(RefWrapper("d"), RefWrapper("p"), page_size=16, sm_scale=1.0, variant_params={})
    with pytest.raises(TypeError, match="int32"):
        planner._bind_block_table(torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous rows"):
        planner._bind_block_table(torch.zeros(8, 4, dtype=torch.int32).t())
    wide = torch.zeros(6, 10, dtype=torch.int32)
    planner._bind_block_table(wide[:3, :7])     # a slice of a wider persistent buffer: viewed, not copied
    assert planner._kv_indices.data_ptr() == wide.data_ptr() and planner._kv_indices.numel() == 60
    assert planner._kv_block_start.tolist() == [0, 10, 20, 30, 40, 50]


# ------------------------------------------------------------------------------------ the impl's edges

def test_profiling_run_zeroes_the_output():
    out = torch.full((5, 8, 64), 3.0)
    assert impl().forward(None, torch.zeros(5, 8, 64), None, None, torch.empty(0), None, out) is out
    assert (out == 0).all()


def test_fused_output_quantization_is_refused():
    with pytest.raises(NotImplementedError, match="output quantization"):
        impl().forward(None, None, None, None, None, None, None, output_scale=torch.ones(1))


def test_fp8_cache_view_and_scales(monkeypatch):
    """vLLM stores fp8 KV as uint8: viewed once per cache as float8_e4m3fn; attention gets the float
    scales, the append op the device scale tensors (read at replay time inside CUDA graphs)."""
    seen = []
    monkeypatch.setattr(fi_backend.ops, "append_paged_kv_cache", lambda *a, **kw: seen.append((a, kw)), raising=False)
    layer = SimpleNamespace(_k_scale_float=0.5, _v_scale_float=0.25, _k_scale=torch.tensor(0.5),
                            _v_scale=torch.tensor(0.25))
    fp8 = impl(kv_cache_dtype="fp8")
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.uint8)
    runs = []
    wrapper = SimpleNamespace(run=lambda q, kv, **kw: runs.append((q, kv, kw)))
    md = SimpleNamespace(wrapper=wrapper, num_rows=3)
    q, out = torch.zeros(5, 8, 64), torch.zeros(5, 8, 64)
    fp8.forward(layer, q, None, None, cache, md, out)
    fp8.forward(layer, q, None, None, cache, md, out)
    (q0, kv0, kw0), (_, kv1, _) = runs
    assert kv0.dtype == torch.float8_e4m3fn and kv0 is kv1 and kv0.data_ptr() == cache.data_ptr()
    assert q0.shape[0] == 3 and kw0["out"].shape[0] == 3 and kw0["out"].data_ptr() == out.data_ptr()
    assert (kw0["k_scale"], kw0["v_scale"]) == (0.5, 0.25)
    k = torch.zeros(5, 2, 64)
    fp8.do_kv_cache_update(layer, k, k, cache, torch.zeros(5, dtype=torch.int64))
    (args, kw), = seen
    assert args[2] is kv0 and kw == {"kv_layout": "NHD", "k_scale": layer._k_scale, "v_scale": layer._v_scale}
    bf16 = impl()
    bf16.do_kv_cache_update(layer, k, k, torch.zeros(4, 16, 2, 128), torch.zeros(5, dtype=torch.int64))
    assert seen[-1][1]["k_scale"] is None and seen[-1][1]["v_scale"] is None
    bf16.do_kv_cache_update(layer, k, k, torch.empty(0), torch.zeros(5, dtype=torch.int64))
    assert len(seen) == 2, "no append before vLLM binds the KV caches"


# ------------------------------------------------------------------------------------ with vLLM 0.26 itself

def test_with_vllm_registration_selection_and_v2_metadata():
    """Where vLLM 0.26 imports (the GPU machine; no GPU needed): the real registry resolves CUSTOM to our
    class, vLLM's selector arguments validate, vLLM picks block sizes, and the V2 runner's own
    InputBatch.make_dummy + build_attn_metadata drive the builder for a CUDA-graph capture (decode) and a
    dummy prefill step."""
    pytest.importorskip("vllm")
    try:
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.selector import AttentionSelectorConfig
        from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
        from vllm.v1.worker.utils import select_common_block_size
    except ImportError as e:  # a partial vLLM install (e.g. source without its dependencies)
        pytest.skip(f"vLLM not fully importable: {e}")
    adapter.register()
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend is adapter.FiAttentionBackend and backend.get_name() == "CUSTOM"
    cfg = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None)
    assert backend.validate_configuration(device_capability=DeviceCapability(9, 0), **cfg._asdict()) == []
    bad = cfg._replace(head_size=112, attn_type="encoder_only")._asdict()
    assert len(backend.validate_configuration(device_capability=DeviceCapability(9, 0), **bad)) == 2
    assert backend.get_kv_cache_block_dim(16, 8, 128) == 0
    assert [select_common_block_size(b, [backend]) for b in (16, 64, 528)] == [16, 64, 176]
    impl = backend.get_impl_cls()(32, 128, 128 ** -0.5, 8, None, None, "auto", None, "decoder", None)
    assert impl.dcp_world_size == 1

    builder = object.__new__(backend.get_builder_cls())   # the planning half only: no kernels here
    dec, pre = RefWrapper("decode"), RefWrapper("prefill")
    builder._step = adapter._StepPlanner(dec, pre, page_size=16, sm_scale=0.1, variant_params={})
    bufs = InputBuffers(max_num_reqs=8, max_num_tokens=64, device=torch.device("cpu"))
    tables = torch.zeros(8, 16, dtype=torch.int32)
    group = SimpleNamespace(get_metadata_builder=lambda i=0: builder, layer_names=["a", "b"])
    kv_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["a", "b"])])
    for reqs, tokens, capture, wrapper in ((8, 8, True, dec), (2, 10, False, pre)):
        batch = InputBatch.make_dummy(num_reqs=reqs, num_tokens=tokens, input_buffers=bufs)
        md = build_attn_metadata(
            attn_groups=[[group]], num_reqs=reqs, num_tokens=tokens, query_start_loc_gpu=batch.query_start_loc,
            query_start_loc_cpu=torch.from_numpy(batch.query_start_loc_np), max_query_len=tokens // reqs,
            seq_lens=batch.seq_lens, max_seq_len=tokens // reqs, block_tables=[tables[:reqs]],
            slot_mappings=torch.full((1, tokens), -1, dtype=torch.int64), kv_cache_config=kv_config,
            seq_lens_cpu_upper_bound=batch.seq_lens_cpu_upper_bound, for_cudagraph_capture=capture)
        assert md["a"] is md["b"] and md["a"].wrapper is wrapper and md["a"].num_rows == tokens
        assert wrapper.plans[-1]["bsr"].qo_indptr.data_ptr() == bufs.query_start_loc.data_ptr()


# ------------------------------------------------------------------------------------ tensor parallelism

def _stub_layer_lookup(monkeypatch, impls: dict) -> None:
    """vllm.config.get_layers_from_vllm_config (and the layer base class) as the builder calls them: impls by name."""
    m = types.ModuleType("vllm.config")
    m.get_layers_from_vllm_config = lambda cfg, cls, names: {n: SimpleNamespace(impl=impls[n]) for n in names}
    monkeypatch.setitem(sys.modules, "vllm.config", m)
    base = types.ModuleType("vllm.model_executor.layers.attention_layer_base")
    base.AttentionLayerBase = object
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.attention_layer_base", base)


@pytest.mark.parametrize("given, current, expected", [
    ("cuda:3", 0, "cuda:3"),      # vLLM's rank device (cuda:<local rank>) as it is
    ("cuda", 2, "cuda:2"),        # an index-less one: the rank's current device, never device 0 by default
])
def test_builder_puts_a_ranks_workspaces_on_its_device(stub_vllm, monkeypatch, caplog, prepared, given, current,
                                                        expected):
    """A tensor-parallel rank's metadata builder builds both wrappers' modules in parallel first (for its KV block
    size), then makes both wrappers (workspaces, ALiBi slopes) on the rank's GPU and says in its start-up log which
    device and how many ranks."""
    impls = {f"layers.{i}.attn": adapter._Impl(16, 128, 128 ** -0.5, 1) for i in range(2)}   # Llama-3.1-405B TP8
    _stub_layer_lookup(monkeypatch, impls)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    made = []
    monkeypatch.setattr(adapter, "_make_wrapper", lambda kernel, **kw: made.append((kernel, kw)) or SimpleNamespace(
        module_names=[f"{kernel}_module"], cute_unsupported="a stand-in"))
    monkeypatch.setattr(adapter, "_logged_active", False)
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64),
                          model_config=SimpleNamespace(dtype=torch.bfloat16),
                          parallel_config=SimpleNamespace(tensor_parallel_size=8))
    spec = SimpleNamespace(num_kv_heads=1, head_size=128, block_size=16)
    caplog.set_level("INFO", logger="vllm.fi_backend")
    adapter.FiAttentionMetadataBuilder(spec, list(impls), cfg, given)
    assert [(k, str(kw["device"]), kw["num_qo_heads"], kw["num_kv_heads"]) for k, kw in made] == [
        ("decode", expected, 16, 1), ("prefill", expected, 16, 1)]
    ((args, kw),) = prepared
    assert args == (16, 1, 128) and kw["page_size"] == 16 and str(kw["device"]) == expected
    assert kw["q_dtype"] == torch.bfloat16 and kw["variant"] == made[0][1]["variant"]
    assert f"on {expected} (one of 8 tensor-parallel ranks)" in caplog.text
    assert "fi-backend attention is active (vLLM backend CUSTOM) on " + expected in caplog.text


# ------------------------------------------------------------------------------------ shared prefixes


def _shared_cm(tables, seq, q_lens, with_cpu_table):
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    cm = SimpleNamespace(causal=True, num_reqs=len(seq), query_start_loc=qsl, query_start_loc_cpu=qsl,
                         seq_lens=torch.tensor(seq, dtype=torch.int32), seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32),
                         max_query_len=max(q_lens), max_seq_len=max(seq), num_actual_tokens=int(qsl[-1]),
                         block_table_tensor=tables, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))
    if with_cpu_table:
        cm.block_table_cpu = tables.clone()
    return cm


@pytest.mark.parametrize("source", ["cpu_table", "cascade", "off"])
def test_shared_prefix_groups_reach_the_plan(source):
    """Groups from a host copy of the block table (any number, consecutive requests with identical leading ids),
    else vLLM's cascade prefix common to the batch as one group; FI_BACKEND_SHARED_PREFIX=0 (shared_prefix=False)
    plans single-format. The groups hold for the step's BSR (RefWrapper validates them) and outputs match."""
    dec, pre = RefWrapper("decode"), RefWrapper("prefill")
    step = adapter._StepPlanner(dec, pre, page_size=4, sm_scale=0.3, variant_params={}, shared_prefix=source != "off")
    tables = torch.arange(6 * 8, dtype=torch.int32).view(6, 8)
    tables[1:3, :3] = tables[0, :3]          # requests 0-2 share 3 blocks
    tables[4, :2] = tables[3, :2]            # requests 3-4 share 2
    tables[:, :1] = tables[0, :1] if source == "cascade" else tables[:, :1]
    seq = [30, 29, 31, 20, 22, 9]
    cm = _shared_cm(tables, seq, [1] * 6, source == "cpu_table")
    step.plan(cm, common_prefix_len=4 if source == "cascade" else 0)
    groups = dec.plans[-1]["groups"]
    if source == "cpu_table":
        assert [list(g) for g in groups] == [[0, 3, 12], [3, 5, 8]]
    elif source == "cascade":
        assert [list(g) for g in groups] == [[0, 6, 4]]
    else:
        assert groups is None


def test_use_cascade_attention_asks_for_the_common_prefix():
    builder = object.__new__(adapter._MetadataBuilder)
    builder._step = adapter._StepPlanner(None, None, page_size=16, sm_scale=0.1, variant_params={}, shared_prefix=True)
    assert builder.use_cascade_attention(64, None, 32, 8, False, False, False, 132, 1)
    assert not builder.use_cascade_attention(8)
    builder._step = adapter._StepPlanner(None, None, page_size=16, sm_scale=0.1, variant_params={}, shared_prefix=False)
    assert not builder.use_cascade_attention(64)


# ------------------------------------------------------------------------------------ the opt-in worker (host tables)

from fi_backend.adapters import vllm_worker  # noqa: E402


class VllmBlockTables:
    """vLLM 0.26's BlockTables (v1/worker/gpu/block_table.py), what the runner sees of it: append_block_ids writes a
    row by request index from its count (or from 0: overwrite), each id expanded to bpk kernel blocks (:107-120);
    gather_block_tables copies each batch row's counted ids into the persistent input table, padded rows zeroed
    (:134-159, 229-234). The device rows keep stale ids past a reused row's count, as vLLM's do."""

    def __init__(self, block_sizes, kernel_block_sizes, max_reqs=8, max_blocks=6):
        self.block_sizes, self.kernel_block_sizes = block_sizes, kernel_block_sizes
        self.blocks_per_kv_block = [b // k for b, k in zip(block_sizes, kernel_block_sizes)]
        self.block_tables = [SimpleNamespace(gpu=torch.zeros(max_reqs, max_blocks * bpk, dtype=torch.int32))
                             for bpk in self.blocks_per_kv_block]
        self.num_blocks = [[0] * max_reqs for _ in block_sizes]
        self.input_block_tables = [torch.zeros_like(b.gpu) for b in self.block_tables]

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        for i in range(len(self.block_sizes)):
            start = self.num_blocks[i][req_index] if not overwrite else 0
            block_ids = new_block_ids[i]
            bpk = self.blocks_per_kv_block[i]
            if bpk > 1:
                block_ids = [b * bpk + k for b in block_ids for k in range(bpk)]
            if block_ids:
                self.block_tables[i].gpu[req_index, start: start + len(block_ids)] = torch.tensor(block_ids)
            self.num_blocks[i][req_index] = start + len(block_ids)

    def gather_block_tables(self, idx_mapping, num_reqs_padded):
        for i, out in enumerate(self.input_block_tables):
            for b, r in enumerate(idx_mapping.tolist()):
                nb = self.num_blocks[i][r]
                out[b, :nb] = self.block_tables[i].gpu[r, :nb]
            out[len(idx_mapping): num_reqs_padded] = 0
        return tuple(t[:num_reqs_padded] for t in self.input_block_tables)


def test_block_table_mirror_matches_vllms_rows():
    """The mirror holds what vLLM's device table holds over each row's count (new rows, appends, a reused row
    overwritten with fewer blocks: its old tail zeroed), per KV-cache group with its own bpk expansion; a step's
    rows are the batch's in idx_mapping order, published as the mirror and idx_mapping (no rows copied)."""
    import numpy as np
    bt = VllmBlockTables(block_sizes=[8, 16], kernel_block_sizes=[8, 4])   # bpk 1 and 4
    mirror = vllm_worker.BlockTableMirror(bt)
    assert mirror.bpk == [1, 4]
    keys = [t.data_ptr() for t in bt.input_block_tables]
    bt.append_block_ids = vllm_worker._mirrored_append(bt.append_block_ids, mirror)
    bt.append_block_ids(3, ([7, 8], [2]), overwrite=True)
    bt.append_block_ids(1, ([5], [9, 3]), overwrite=True)
    bt.append_block_ids(3, ([4], [6]), overwrite=False)
    bt.append_block_ids(3, ([], []), overwrite=False)
    bt.append_block_ids(1, ([2], [1]), overwrite=True)          # row 1 reused by a new request
    for i in range(2):
        for r in range(8):
            nb = bt.num_blocks[i][r]
            assert mirror.counts[i, r] == nb
            assert np.array_equal(mirror.tables[i][r, :nb], bt.block_tables[i].gpu[r, :nb].numpy())
            assert not mirror.tables[i][r, nb:].any()
    assert mirror.tables[1][3, :8].tolist() == [8, 9, 10, 11, 24, 25, 26, 27]
    assert mirror.tables[1][1].tolist()[:8] == [4, 5, 6, 7, 0, 0, 0, 0]   # the reused row: no ids of before
    idx = np.array([3, 1], dtype=np.int32)
    rows = mirror.rows(idx)
    assert set(rows) == set(keys) and all(r.rows is idx for r in rows.values())   # no rows copied
    assert rows[keys[0]].table[idx, :2].tolist() == [[7, 8], [2, 0]]
    assert rows[keys[1]].table[idx, :4].tolist() == [[8, 9, 10, 11], [4, 5, 6, 7]]   # kernel blocks of 4
    bt.input_block_tables = [t.clone() for t in bt.input_block_tables]   # reallocated (a KV-cache wake-up)
    assert set(mirror.rows(idx)) == {t.data_ptr() for t in bt.input_block_tables}
    with pytest.raises(ValueError, match="request index 2: 7 blocks"):
        mirror.append(2, ([1] * 7, []), overwrite=True)


class V2Runner:
    """vLLM 0.26's V2 GPUModelRunner, reduced to the flow the worker's subclass hooks: initialize_kv_cache makes the
    metadata builders and then the BlockTables (model_runner.py:448-460), execute_model applies the step's block ids
    (:817, 848), runs prepare_attn (:1212, the gather; input_batch.idx_mapping_np from prepare_inputs :896) and then
    every builder's build() (model_state.prepare_attn, :1257) with the gathered table; captures call
    build_for_cudagraph_capture on the same persistent table (cudagraph_utils.py:614)."""

    def __init__(self, make_builder):
        self.make_builder, self.pcp_manager = make_builder, None

    def initialize_kv_cache(self, kv_cache_config):
        self.builder = self.make_builder()
        self.block_tables = VllmBlockTables(block_sizes=[8], kernel_block_sizes=[4], max_reqs=8, max_blocks=8)

    def prepare_attn(self, input_batch):
        return self.block_tables.gather_block_tables(input_batch.idx_mapping, input_batch.num_reqs_after_padding), None

    def execute_model(self, appends, batch, pad_to=None):
        """appends: [(req index, manager block ids, overwrite)]; batch: [(req index, cached tokens, new tokens)]."""
        import numpy as np
        for r, ids, overwrite in appends:
            self.block_tables.append_block_ids(r, (ids,), overwrite)
        n = len(batch)
        idx = np.array([b[0] for b in batch], dtype=np.int32)
        ib = SimpleNamespace(idx_mapping=torch.from_numpy(idx), idx_mapping_np=idx, num_reqs=n,
                             num_reqs_after_padding=pad_to or n, num_computed_tokens_np=np.array([b[1] for b in batch]))
        (table,), _ = self.prepare_attn(ib)
        self.last = self.builder.build(0, _step_cm(table, batch, pad_to))
        return self.last

    def capture(self, n):
        return self.builder.build_for_cudagraph_capture(_step_cm(self.block_tables.input_block_tables[0][:n],
                                                                 [(0, 4, 1)] * n, None))


def _step_cm(table, batch, pad_to):
    n_pad = pad_to or len(batch)
    q = [b[2] for b in batch] + [0] * (n_pad - len(batch))
    seq = [b[1] + b[2] for b in batch] + [0] * (n_pad - len(batch))
    qsl = torch.tensor([0] + list(itertools.accumulate(q)), dtype=torch.int32)
    return SimpleNamespace(causal=True, num_reqs=n_pad, query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
                           seq_lens=torch.tensor(seq, dtype=torch.int32),
                           seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32), max_query_len=max(q),
                           max_seq_len=max(seq), num_actual_tokens=int(qsl[-1]), block_table_tensor=table,
                           slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64))


@pytest.fixture
def fi_builder(stub_vllm, monkeypatch):
    """fi-backend's real metadata builder (page 4, 8 requests) whose wrappers are RefWrappers, named by kernel
    ("graph_prefill" for the third); the process's table provider and readers reset around the test."""
    impls = {f"layers.{i}.attn": adapter._Impl(4, 64, 0.125, 2) for i in range(2)}
    _stub_layer_lookup(monkeypatch, impls)
    monkeypatch.setattr(adapter, "_table_provider", False)
    monkeypatch.setattr(adapter, "_table_readers", 0)
    made = []

    def make_wrapper(kernel, **kw):
        made.append((kernel, kw["max_rows"], kw["shared_prefix"]))
        return RefWrapper("graph_prefill" if kernel == "prefill" and len(made) == 3 else kernel)

    monkeypatch.setattr(adapter, "_make_wrapper", make_wrapper)
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=64),
                          model_config=SimpleNamespace(dtype=torch.bfloat16), parallel_config=None)
    spec = SimpleNamespace(num_kv_heads=2, head_size=64, block_size=4)

    def make():
        made.clear()
        return adapter.FiAttentionMetadataBuilder(spec, list(impls), cfg, "cpu")

    yield SimpleNamespace(make=make, made=made, cfg=cfg)
    adapter.publish_step_tables(None)


def test_shared_rows_only_where_groups_can_come(fi_builder):
    """The workspaces get shared-prefix rows (GPU memory) only where build() can receive groups: the opt-in worker's
    tables, or the V1 runner asking for cascade (--no-disable-cascade-attn); V2 without the worker gets none."""
    fi_builder.make()
    assert [m[2] for m in fi_builder.made] == [False, False]                 # V2, no worker
    fi_builder.cfg.use_v2_model_runner = False
    fi_builder.cfg.model_config.disable_cascade_attn = False
    builder = fi_builder.make()
    assert [m[2] for m in fi_builder.made] == [True, True] and builder._step.shared_prefix
    assert builder._step.graph_prefill is None                             # no tables: no third wrapper
    fi_builder.cfg.model_config.disable_cascade_attn = True                  # V1's default: it never asks
    fi_builder.make()
    assert [m[2] for m in fi_builder.made] == [False, False]
    adapter.provide_step_tables(True)
    fi_builder.make()
    assert [m[2] for m in fi_builder.made] == [True, True, True]


def test_speculative_decoding_plans_single_format(fi_builder, caplog):
    """With speculative decoding vLLM's host KV lengths are upper bounds (every draft accepted), so a group could
    reach past a member's computed KV: the builder turns groups off, also with the worker's tables, and says so."""
    adapter.provide_step_tables(True)
    fi_builder.cfg.speculative_config = SimpleNamespace(num_speculative_tokens=3)
    caplog.set_level("INFO", logger="vllm.fi_backend")
    builder = fi_builder.make()
    assert [m[2] for m in fi_builder.made] == [False, False] and builder._step.graph_prefill is None
    assert not builder._step.shared_prefix and adapter.step_table_readers() == 0
    assert "shared-prefix groups off with speculative decoding" in caplog.text


# requests 0 and 1 share manager blocks 5, 6 (kernel blocks 10..13: 16 tokens); request 2 shares nothing
_SHARED_APPENDS = [(0, [5, 6, 7], True), (1, [5, 6, 9], True), (2, [1, 2], True)]


def test_worker_tables_reach_the_plans_and_grouped_decode_runs_on_graph_prefill(fi_builder, monkeypatch):
    """The opt-in worker's runner end to end on vLLM's flow (V2Runner): its mirror of the appended ids, published for
    the step in batch order, gives _StepPlanner the groups (kernel blocks of bpk 2, capped at cached blocks; the
    graph-padded row in none). A grouped decode step runs on graph_prefill with the decode wrapper idle; with the
    verdict shared_groups == 0 on the decode wrapper, graph_prefill idle; eager steps launch one wrapper. A capture
    plans no groups and launches both into one output (the idle one writes nothing). Mixed steps pass the groups
    to the prefill wrapper. Nothing is left published after a step. Groups that save less KV than the prefill
    kernel's items cost (scheduler.decode_groups_pay) stay on the decode kernel without planning graph_prefill."""
    from fi_backend import scheduler
    monkeypatch.setattr(scheduler, "PREFILL_DECODE_ITEM_TOKENS", 3)   # these tiny groups save 16 > 3 x 4 rows' tokens
    runner = vllm_worker._runner_class(V2Runner)(fi_builder.make)
    runner.initialize_kv_cache(None)
    assert [k for k, _, _ in fi_builder.made] == ["decode", "prefill", "prefill"]
    assert fi_builder.made[2] == ("prefill", 8, True)              # graph_prefill: max_num_seqs rows, shared rows
    step = runner.builder._step
    dec, gp, pre = step.decode, step.graph_prefill, step.prefill
    assert gp.name == "graph_prefill" and adapter.step_table_readers() == 1 and runner._fi_mirror is not None
    counts = adapter.plan_counts()

    # batch order 2, 0, 1 (idx_mapping), CUDA-graph padded to 4 rows
    md = runner.execute_model(_SHARED_APPENDS, [(2, 7, 1), (0, 22, 1), (1, 21, 1)], pad_to=4)
    assert gp.plans[-1]["groups"] == [[1, 3, 16]] and not gp.plans[-1]["idle"]
    assert md.wrapper is gp and md.partner is None and dec.plans[-1]["idle"]
    assert torch.equal(dec.plans[-1]["kv"], gp.plans[-1]["kv"]) and dec.plans[-1]["bsr"] is gp.plans[-1]["bsr"]
    assert adapter._step_table(runner.block_tables.input_block_tables[0]) is None, "left published after the step"
    after = adapter.plan_counts()
    assert (after["grouped_decode"], after["prefill"], after["decode"]) == (
        counts["grouped_decode"] + 1, counts["prefill"] + 1, counts["decode"])

    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
    impl = adapter._Impl(4, 64, 0.125, 2)
    kv = torch.randn(20, 4, 2, 128, dtype=torch.float64)
    q = torch.randn(4, 4, 64, dtype=torch.float64)
    out = torch.full((4, 4, 64), math.nan, dtype=torch.float64)
    impl.forward(layer, q, None, None, kv, md, out)                 # eager (or replayed) step: the active one only
    assert (gp.runs, dec.runs, dec.idle_runs, gp.idle_runs) == (1, 0, 0, 0) and not out[:3].isnan().any()

    gp.keep_groups = False                                          # the planner's verdict: not worth it
    md = runner.execute_model([], [(2, 8, 1), (0, 23, 1), (1, 22, 1)])
    assert gp.plans[-2]["groups"] == [[1, 3, 16]] and gp.plans[-1]["idle"]
    assert md.wrapper is dec and not dec.plans[-1]["idle"] and dec.plans[-1]["groups"] == [[1, 3, 16]]   # its verdict
    gp.keep_groups = True

    monkeypatch.setattr(scheduler, "PREFILL_DECODE_ITEM_TOKENS", 6)   # 16 saved < 6 x 3: not worth the prefill kernel
    n = len(gp.plans)
    md = runner.execute_model([], [(2, 9, 1), (0, 24, 1), (1, 23, 1)])
    assert md.wrapper is dec and dec.plans[-1]["groups"] == [[1, 3, 16]] and not dec.plans[-1]["idle"]
    assert len(gp.plans) == n + 1 and gp.plans[-1]["idle"]               # only its idle plan
    dec.name = "decode, keeping groups"                                  # the decode kernel's verdict keeps them
    before = adapter.plan_counts()["grouped_decode"]
    md = runner.execute_model([], [(2, 10, 1), (0, 25, 1), (1, 24, 1)])
    assert md.wrapper is dec and dec.plans[-1]["groups"] == [[1, 3, 16]]
    assert adapter.plan_counts()["grouped_decode"] == before + 1
    dec.name = "decode"
    monkeypatch.setattr(scheduler, "PREFILL_DECODE_ITEM_TOKENS", 3)

    adapter.publish_step_tables(runner._fi_mirror.rows(np_idx([2, 0, 1])))
    cap = runner.capture(4)                                         # a capture plans no groups, launches both
    assert cap.wrapper is dec and cap.partner is gp and gp.plans[-1]["idle"] and dec.plans[-1]["groups"] is None
    out = torch.full((4, 4, 64), math.nan, dtype=torch.float64)
    impl.forward(layer, q, None, None, kv, cap, out)
    assert dec.runs == 1 and gp.idle_runs == 1 and not out.isnan().any()
    adapter.publish_step_tables(None)

    md = runner.execute_model([], [(0, 24, 2), (1, 23, 1), (2, 9, 1)])   # a mixed step: the prefill wrapper
    assert md.wrapper is pre and pre.plans[-1]["groups"] == [[0, 2, 16]]
    assert adapter.plan_counts()["grouped_extend"] == counts["grouped_extend"] + 1

    # row 1 reused by a new request that shares nothing: no group (the mirror forgot the old ids)
    md = runner.execute_model([(1, [3, 4, 8], True)], [(0, 24, 1), (1, 20, 1)])
    assert md.wrapper is dec and dec.plans[-1]["groups"] is None and gp.plans[-1]["idle"]


def np_idx(values):
    import numpy as np
    return np.array(values, dtype=np.int32)


@pytest.mark.parametrize("case", ["no_worker", "off", "other_backend"])
def test_without_the_worker_tables_nothing_changes(fi_builder, monkeypatch, case):
    """Without the worker (no tables provided), with FI_BACKEND_SHARED_PREFIX=0, or where no fi-backend builder reads
    the tables (another backend): two wrappers only, decode steps plan and launch the decode wrapper alone (no idle
    plan, no partner in captures), and the runner publishes nothing."""
    if case == "off":
        monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "0")
    make = (lambda: None) if case == "other_backend" else fi_builder.make
    runner = (V2Runner if case == "no_worker" else vllm_worker._runner_class(V2Runner))(make)
    runner.initialize_kv_cache(None)
    assert adapter.step_table_readers() == 0 and getattr(runner, "_fi_mirror", None) is None
    if case == "other_backend":
        assert adapter._table_provider   # said, but nobody reads: no mirror, nothing published
        return
    assert [k for k, _, _ in fi_builder.made] == ["decode", "prefill"] and runner.builder._step.graph_prefill is None
    published = []
    monkeypatch.setattr(adapter, "publish_step_tables", lambda t: published.append(t))
    md = runner.execute_model(_SHARED_APPENDS, [(2, 7, 1), (0, 22, 1), (1, 21, 1)], pad_to=4)
    dec = runner.builder._step.decode
    assert md.wrapper is dec and md.partner is None and dec.plans[-1]["groups"] is None
    assert [p["idle"] for p in dec.plans] == [False]
    assert runner.capture(4).partner is None
    assert all(t is None for t in published)


def test_worker_changes_only_vllms_v2_runner(monkeypatch):
    """Worker.init_device (gpu_worker.py:297, the runner built at :402-410): vLLM's V2 runner becomes the mirroring
    subclass, keeping its state; the V1 runner (cascade path) and another class stay; FI_BACKEND_SHARED_PREFIX=0
    changes nothing. Worker is made lazily, and without vLLM its error names the worker path."""
    class V1Runner:
        def __init__(self, make_builder):
            pass

    class Other(V2Runner):
        pass

    class GpuWorker:
        def __init__(self, runner_cls):
            self.runner_cls = runner_cls

        def init_device(self):
            self.model_runner = self.runner_cls(None)

    Worker = vllm_worker._worker_class(GpuWorker, V2Runner)
    w = Worker(V2Runner)
    w.init_device()
    assert isinstance(w.model_runner, V2Runner) and type(w.model_runner) is not V2Runner
    assert type(w.model_runner).prepare_attn is not V2Runner.prepare_attn and w.model_runner.pcp_manager is None
    for cls in (V1Runner, Other):
        w = Worker(cls)
        w.init_device()
        assert type(w.model_runner) is cls
    monkeypatch.setenv("FI_BACKEND_SHARED_PREFIX", "0")
    w = Worker(V2Runner)
    w.init_device()
    assert type(w.model_runner) is V2Runner
    if not HAVE_VLLM:
        with pytest.raises(ImportError, match="fi_backend.adapters.vllm_worker.Worker subclasses vLLM"):
            vllm_worker.Worker  # noqa: B018
    with pytest.raises(AttributeError):
        vllm_worker.NoSuchThing  # noqa: B018


def test_worker_module_imports_without_vllm():
    code = ("import sys, fi_backend.adapters.vllm_worker as w; assert w.WORKER_CLASS_PATH.endswith('.Worker'); "
            "assert 'vllm' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
