"""The engines' tensor-parallel integration tests (integration_tests/vllm, integration_tests/sglang, kind
llama70b_tp2) on the CPU: the model they build, the weights each rank redraws (the functions that travel to
vLLM's workers by value, SGLang's load hook), and the per-rank dump. The engines themselves run on a 2-GPU
machine: IT_MODELS=llama70b_tp2 bash .ci/gpu vllm-it, and the SGLang commands in its IT's docstring."""
import importlib.util
import json
import math
import sys
import types
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name, path):
    """The IT file as a module; the sys.path entry it adds (integration_tests/, for compare.py) is taken back,
    else its vllm/ and sglang/ folders would pass for the engines (importlib.util.find_spec) in other tests."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # cloudpickle pickles by value only modules it finds imported
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


V = _load("fi_vllm_it", "integration_tests/vllm/test_vllm_backend.py")
S = _load("fi_sglang_it", "integration_tests/sglang/test_sglang_backend.py")


class Tiny(torch.nn.Module):
    """Parameters named as vLLM's and SGLang's Llama name them, one rank's shards of a TP 2 model."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Parameter(torch.zeros(96, 512))      # column-parallel: the whole fan-in
        self.o = torch.nn.Parameter(torch.zeros(512, 256))     # row-parallel: half the fan-in on each rank
        self.norm = torch.nn.Parameter(torch.zeros(512))

    def named_parameters(self, *args, **kwargs):
        names = {"q": "model.layers.0.self_attn.qkv_proj.weight", "o": "model.layers.0.self_attn.o_proj.weight",
                 "norm": "model.layers.0.input_layernorm.weight"}
        for short, p in super().named_parameters(*args, **kwargs):
            yield names[short], p


def test_loading_the_its_leaves_the_engines_unimportable():
    assert str(REPO / "integration_tests") not in sys.path
    if importlib.util.find_spec("vllm") is not None:
        assert "integration_tests" not in str(importlib.util.find_spec("vllm").submodule_search_locations)


def test_the_tp_kind_is_llama_70b_over_two_gpus():
    for module in (V, S):
        config = module.LLAMA_31_70B
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (64, 8)
        assert config["hidden_size"] // config["num_attention_heads"] == 128 and config["hidden_size"] == 8192
        assert module.TP_ENV["NCCL_NVLS_ENABLE"] == "0" and module.TP_ENV["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert module.TP_ENV["NVSHMEM_DISABLE_NVLS"] == "1"
    config = V.model_config("llama70b_tp2")
    assert V.TP_KINDS["llama70b_tp2"][1] == 2 and config["num_hidden_layers"] == V.LAYERS
    assert "llama70b_tp2" in V.KINDS and "llama70b_tp2" in S.KINDS
    labels = [k for k, e in S.ENGINES.items() if e[4].get("tp_size") == 2]
    assert sorted(labels) == ["llama70b_tp2_fi_backend_graphs", "llama70b_tp2_flashinfer_graphs",
                              "llama70b_tp2_triton_graphs"]
    assert all(S.ENGINES[label][1] for label in labels), "CUDA graphs on in every TP engine"


def test_vllm_redraw_per_rank():
    one, r0, r1 = Tiny(), Tiny(), Tiny()
    V._redraw_weights(one)
    V._redraw_weights(r0, tp=2, rank=0)
    V._redraw_weights(r1, tp=2, rank=1)
    # one GPU: seeded by name alone, as before tensor parallelism
    gen = torch.Generator().manual_seed(zlib.crc32(b"model.layers.0.self_attn.o_proj.weight"))
    assert torch.equal(one.o.data, torch.randn(512, 256, generator=gen) / math.sqrt(256))
    assert not torch.equal(r0.o.data, r1.o.data) and not torch.equal(r0.q.data, r1.q.data)   # each rank its own
    assert r0.o.data.std().item() == pytest.approx(1 / math.sqrt(512), rel=0.03)   # the whole fan-in, 2 x 256
    assert r0.q.data.std().item() == pytest.approx(1 / math.sqrt(512), rel=0.03)   # column-parallel: its own
    assert torch.equal(r0.norm.data, torch.ones(512))


def test_vllm_worker_functions_travel_by_value(monkeypatch):
    """collective_rpc cloudpickles a callable; in the engine process this file is __main__, so its functions
    go by value (here registered so, as the module is not __main__) and run against the worker's model."""
    cloudpickle = pytest.importorskip("cloudpickle")
    dist = types.ModuleType("vllm.distributed")
    dist.get_tensor_model_parallel_rank = lambda: 1
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", dist)
    cloudpickle.register_pickle_by_value(V)
    try:
        blob = cloudpickle.dumps(V._rank_redraw)
    finally:
        cloudpickle.unregister_pickle_by_value(V)
    model, want = Tiny(), Tiny()
    worker = SimpleNamespace(get_model=lambda: model)
    assert cloudpickle.loads(blob)(worker, 1.0, 2) == sum(p.numel() for p in model.parameters())
    V._redraw_weights(want, 1.0, 2, 1)
    assert torch.equal(model.o.data, want.o.data)
    layers = V._rank_attention_layers(SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2)))
    assert layers == {}


def _plugin(monkeypatch, rank):
    dist = types.ModuleType("sglang.srt.distributed")
    dist.get_tensor_model_parallel_rank = lambda: rank
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", dist)
    namespace = {}
    exec(compile(S.PLUGIN, "fi_sglang_it_plugin.py", "exec"), namespace)
    return namespace


def test_sglang_redraw_per_rank_matches_vllms(monkeypatch):
    """Every rank's scheduler redraws its own shards in the load hook, as the vLLM test's workers do."""
    monkeypatch.setenv("FI_SGLANG_IT_TP", "2")
    monkeypatch.setenv("FI_SGLANG_IT_NORM_FILL", "1.0")
    got, want = Tiny(), Tiny()
    _plugin(monkeypatch, 1)["_redraw"](got)
    V._redraw_weights(want, 1.0, 2, 1)
    assert torch.equal(got.o.data, want.o.data) and torch.equal(got.q.data, want.q.data)
    monkeypatch.setenv("FI_SGLANG_IT_TP", "1")   # one GPU: by name alone, as before
    single = Tiny()
    _plugin(monkeypatch, 0)["_redraw"](single)
    one = Tiny()
    V._redraw_weights(one)
    assert torch.equal(single.o.data, one.o.data)


def test_sglang_dump_gathers_every_rank(monkeypatch):
    plugin = _plugin(monkeypatch, 0)
    for name, value in (("synchronize", lambda: None), ("memory_allocated", lambda: 1), ("memory_reserved", lambda: 2),
                        ("mem_get_info", lambda: (3, 4))):
        monkeypatch.setattr(torch.cuda, name, value)

    def scheduler(rank):
        attn = SimpleNamespace(tp_q_head_num=32, tp_k_head_num=4, head_dim=128)
        model = SimpleNamespace(modules=lambda: [attn, object()])
        runner = SimpleNamespace(model=model, attn_backend=SimpleNamespace(), page_size=1, kv_cache_dtype="bf16")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: rank)
        return SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner), tp_rank=rank, tp_size=2)

    paths = []

    def collective_rpc(method, path):
        assert method == "fi_it_dump"
        paths.append(path)
        for rank in (1, 0):
            plugin["_dump"](scheduler(rank), path)

    rec = S.dump(SimpleNamespace(collective_rpc=collective_rpc))
    assert [r["tp_rank"] for r in rec["ranks"]] == [0, 1] and [r["gpu"] for r in rec["ranks"]] == [0, 1]
    assert all(r["heads"] == [[32, 4, 128]] for r in json.loads(json.dumps(rec["ranks"])))
    assert not Path(paths[0]).exists() and not Path(f"{paths[0]}.rank1").exists()   # the answers are read once


def test_logprob_diffs_refuses_records_of_another_workload():
    """A reused engine record from an older workload (other prompts) is an error that says so, not a silent zip."""
    compare = _load("fi_it_compare", "integration_tests/compare.py")
    run = {"prompt_logprobs": [[-1.0, -2.0], [-0.5]], "prefix_hit_first_token": [{"7": -0.1}]}
    older = {**run, "prompt_logprobs": run["prompt_logprobs"][:1]}
    assert compare.logprob_diffs(run, {**run, "prompt_logprobs": [[-1.0, -2.5], [-0.5]]}) == [0.0, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="different workloads"):
        compare.logprob_diffs(older, run)
