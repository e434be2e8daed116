"""The model zoo (fi_backend.models) on the CPU: its entries, the support check, the variants and modules a
model needs, HF config.json parsing, and `fi-backend models` / `fi-backend build --model`'s refusals."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fi_backend import cute_member, models, variants, wrappers
from fi_backend.adapters.vllm import layer_variant
from fi_backend.models import Model, ZOO, check, find, from_hf_config, modules_of, variants_of

REPO = Path(__file__).resolve().parents[1]
LLAMA_CONFIG = Path("/work/shared/models/llama-3.1-8b/config.json")

REQUIRED = [
    "Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B", "Llama-3.2-1B", "Llama-3.2-3B",
    "Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B", "Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen2.5-72B",
    "Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B",
    "Mistral-7B", "Mistral-Nemo-12B", "Mixtral-8x7B", "Gemma-2-2B", "Gemma-2-9B", "Gemma-2-27B",
    "Gemma-3-1B", "Gemma-3-4B", "Gemma-3-12B", "Gemma-3-27B", "Phi-3-mini", "Phi-3-medium", "Phi-4",
    "Yi-1.5-34B", "StarCoder2-15B", "Command-R", "DeepSeek-V2-Lite",
]

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "sliding_window": 131072, "use_sliding_window": False,
    "max_window_layers": 28, "rope_scaling": None, "rope_theta": 1000000.0,
}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "head_dim": 256,
    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "sliding_window": 4096,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
}
GEMMA3_27B = {   # the multimodal checkpoint: the language model's settings under text_config
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376, "num_attention_heads": 32,
                    "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "attn_logit_softcapping": None},
    "vision_config": {"model_type": "siglip_vision_model", "num_attention_heads": 16},
}
PHI3_MINI = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "rope_scaling": None, "sliding_window": 2047,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 27, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
}


def _attention(m: Model) -> tuple:
    """What the kernels see of a model (not its name or id)."""
    return (m.num_qo_heads, m.num_kv_heads, m.head_dim, m.num_layers, m.sliding_window,
            tuple(m.windowed_layers()), m.attn_logit_softcapping, m.rope_scaling, m.sm_scale, m.kind)


@pytest.fixture
def sm90a(monkeypatch):
    """Name modules as for an H100 (the prefill family follows the architectures in effect)."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")


# ----------------------------------------------------------------------------- the zoo

def test_zoo_has_the_required_models():
    names = [m.name for m in ZOO]
    assert len(ZOO) >= 30
    assert len(set(n.lower() for n in names)) == len(names), "zoo names must be unique (case-insensitive)"
    assert [n for n in REQUIRED if n not in names] == []


@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_every_head_config_is_sane(model):
    assert model.num_qo_heads >= 1 and model.num_kv_heads >= 1 and model.num_layers >= 1
    assert model.num_qo_heads % model.num_kv_heads == 0, "query heads must split evenly over KV heads"
    assert model.head_dim % 16 == 0 and 32 <= model.head_dim <= 256
    assert model.hf_id.count("/") == 1
    assert model.kind in ("gqa", "mha", "mqa", "mla")
    if model.sliding_window is not None:
        assert model.sliding_window >= 1 and model.windowed_layers(), "a window on no layer"
    else:
        assert model.window_layers == "none"
    if model.sm_scale is not None:
        assert model.sm_scale != pytest.approx(model.head_dim ** -0.5)


def test_zoo_facts():
    """Spot checks of the configs that are easy to get wrong."""
    assert find("mistral-nemo-12b").head_dim == 128                       # not 5120 / 32
    assert (find("Phi-3-mini").head_dim, find("phi-3-mini").kind) == (96, "mha")
    assert find("Command-R").kind == "mha" and find("Gemma-3-1B").kind == "mqa"
    assert find("Yi-1.5-34B").group == 7 and find("StarCoder2-15B").group == 12
    assert find("Gemma-2-27B").sm_scale == pytest.approx(144 ** -0.5)
    assert find("Gemma-3-27B").sm_scale == pytest.approx(168 ** -0.5)
    assert find("Gemma-2-9B").sm_scale is None                            # query_pre_attn_scalar 256 = head_dim
    assert find("meta-llama/Llama-3.1-8B").name == "Llama-3.1-8B"         # by HF id too
    with pytest.raises(KeyError, match="fi-backend models"):
        find("GPT-5")


def test_window_layers():
    g2, g3, mistral, llama = find("Gemma-2-2B"), find("Gemma-3-27B"), find("Mistral-7B"), find("Llama-3.1-8B")
    assert g2.windowed_layers() == list(range(0, 26, 2)) and g2.window_layers == "alternate (even layers local)"
    assert [i for i in range(g3.num_layers) if not g3.is_windowed(i)] == list(range(5, 62, 6))
    assert g3.window_layers == "5 local : 1 global"
    assert mistral.window_layers == "all" and len(mistral.windowed_layers()) == 32
    assert llama.windowed_layers() == [] and llama.window_layers == "none"
    with pytest.raises(IndexError):
        llama.is_windowed(32)


# ----------------------------------------------------------------------------- check

def test_check_refuses_mla_by_name():
    ok, reason = check(find("DeepSeek-V2-Lite"))
    assert not ok
    assert "multi-head latent attention (MLA)" in reason and "rank 512" in reason and "64-dim RoPE key" in reason
    assert check(find("Llama-3.1-8B")) == (True, "")


def test_check_reads_head_dims_at_call_time(monkeypatch):
    phi3 = find("Phi-3-mini")
    monkeypatch.setattr(wrappers, "HEAD_DIMS", (64, 128, 256))
    ok, reason = check(phi3)
    assert not ok and "head_dim 96" in reason and "64, 128, 256" in reason
    monkeypatch.setattr(wrappers, "HEAD_DIMS", (64, 80, 96, 128, 256))
    assert check(phi3) == (True, "")


def test_check_refuses_uneven_groups():
    ok, reason = check(Model("odd", "x/odd", 12, 5, 128, 2))
    assert not ok and "12 query heads" in reason and "5 KV heads" in reason


# ----------------------------------------------------------------------------- variants and modules

@pytest.mark.parametrize("name, expected", [
    ("Llama-3.1-8B", [(None, None)]),
    ("Mistral-7B", [(4096, None)]),
    ("Gemma-2-9B", [(None, 50.0), (4096, 50.0)]),
    ("Gemma-3-4B", [(None, None), (1024, None)]),
])
def test_variants_of_mirror_the_vllm_adapter(name, expected):
    got = variants_of(find(name))
    assert got == [layer_variant(None, window, softcap)[0] for window, softcap in expected]
    names = [v.name for v in got]
    assert len(set(names)) == len(names)


def test_variants_of_gemma2_are_soft_cap_and_soft_cap_with_window():
    assert [v.name for v in variants_of(find("Gemma-2-2B"))] == [
        variants.SOFT_CAP.name, variants.combine(variants.SOFT_CAP, variants.SLIDING_WINDOW).name]


def test_modules_of_llama(sm90a):
    specs = modules_of(find("Llama-3.1-8B"))
    families = [s.family for s in specs]
    members = wrappers.prefill_family_size(128, "bf16") + wrappers.prefill_family_size(128, "fp8_e4m3")
    # decode: the family of two for bf16 KV (shapes.decode_family_size), one module for fp8; the CuTe member's two
    # for bf16 KV on pages of 16 and two ragged (fresh prompts, and staged pages) where CUTLASS's headers are installed
    cute = {s.memo_key for page in (16, 0) for s in cute_member.specs_for(variants.DEFAULT, 128, "bf16", "bf16", page)}
    assert families.count("decode") == 3 and families.count("prefill") == members
    assert families.count("cute_attn_ws") == len(cute) and len(cute) in (0, 4)
    paged_only = modules_of(find("Llama-3.1-8B"), ragged=False)  # the paged member's staging needs the ragged two
    assert len([s for s in paged_only if s.family == "cute_attn_ws"]) == len(cute)
    assert len({s.memo_key for s in specs}) == len(specs)
    tags = [s.readable_tag() for s in specs if s.family != "cute_attn_ws"]
    assert all("_d128_" in t and t.startswith("default_bf16_") for t in tags)
    assert any("_bf16_fp8_e4m3_" in t for t in tags) and any("_bf16_bf16_" in t for t in tags)
    for member in (0, 1):
        expected = wrappers.decode_spec(variants.DEFAULT, 128, "bf16", "bf16", 4, member=member)
        assert expected.memo_key in {s.memo_key for s in specs}
    only_bf16 = modules_of(find("Llama-3.1-8B"), kv_dtypes=("auto",))
    assert {s.memo_key for s in only_bf16} < {s.memo_key for s in specs}


def test_modules_of_windowed_and_refused(sm90a):
    gemma3 = modules_of(find("Gemma-3-4B"))
    assert {s.readable_tag().split("_bf16_")[0] for s in gemma3 if s.family != "cute_attn_ws"} == {"default", "window"}
    assert modules_of(find("DeepSeek-V2-Lite")) == []
    with pytest.raises(ValueError, match="query's dtype"):
        modules_of(find("Llama-3.1-8B"), kv_dtypes=("fp16",))


# ----------------------------------------------------------------------------- HF config.json

def test_from_hf_config_llama():
    config = json.loads(LLAMA_CONFIG.read_text()) if LLAMA_CONFIG.is_file() else LLAMA_31_8B
    m = from_hf_config(config, name="llama-3.1-8b")
    assert m.name == "llama-3.1-8b"
    assert _attention(m) == _attention(find("Llama-3.1-8B"))
    assert m.rope_scaling == "llama3 x8"


def test_from_hf_config_qwen2():
    assert _attention(from_hf_config(QWEN25_7B)) == _attention(find("Qwen2.5-7B"))
    windowed = from_hf_config({**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096,
                               "max_window_layers": 21})
    assert windowed.sliding_window == 4096 and windowed.windowed_layers() == list(range(21, 28))
    assert windowed.window_layers == "layers 21-27"


def test_from_hf_config_gemma2():
    m = from_hf_config(GEMMA2_9B)
    assert _attention(m) == _attention(find("Gemma-2-9B"))
    assert m.attn_logit_softcapping == 50.0 and m.window_layers == "alternate (even layers local)"
    g27 = from_hf_config({**GEMMA2_9B, "hidden_size": 4608, "head_dim": 128, "num_attention_heads": 32,
                          "num_key_value_heads": 16, "num_hidden_layers": 46, "query_pre_attn_scalar": 144})
    assert _attention(g27) == _attention(find("Gemma-2-27B"))
    # newer configs list the layers
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(42)]
    assert _attention(from_hf_config({**GEMMA2_9B, "layer_types": types})) == _attention(m)


def test_from_hf_config_gemma3_text_config():
    m = from_hf_config(GEMMA3_27B)
    assert _attention(m) == _attention(find("Gemma-3-27B"))
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]
    text = {k: v for k, v in GEMMA3_27B["text_config"].items() if k != "sliding_window_pattern"}
    assert _attention(from_hf_config({**text, "layer_types": types})) == _attention(m)


def test_from_hf_config_phi3():
    m = from_hf_config(PHI3_MINI)
    assert _attention(m) == _attention(find("Phi-3-mini"))
    assert (m.head_dim, m.kind, m.window_layers) == (96, "mha", "all")


def test_from_hf_config_deepseek_v2_is_mla_and_refused():
    m = from_hf_config(DEEPSEEK_V2_LITE)
    assert m.kind == "mla" and m.mla["kv_lora_rank"] == 512 and m.head_dim == 192
    assert m.rope_scaling == "yarn x40"
    assert _attention(m) == _attention(find("DeepSeek-V2-Lite"))
    ok, reason = check(m)
    assert not ok and "MLA" in reason


def test_from_hf_config_refuses_non_decoders():
    with pytest.raises(ValueError, match="num_attention_heads"):
        from_hf_config({"model_type": "siglip_vision_model"})


# ----------------------------------------------------------------------------- CLI

def _cli(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fi_backend.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_cli_models_lists_every_model():
    proc = _cli("models")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["model", "heads"]
    for m in ZOO:
        row = next((l for l in lines if l.split()[0] == m.name), None)
        assert row is not None, f"{m.name} not listed"
        assert f"{m.num_qo_heads}/{m.num_kv_heads}" in row
        assert row.rstrip().endswith("runs") == check(m)[0]
    assert "refused: multi-head latent attention (MLA)" in next(l for l in lines if l.startswith("DeepSeek-V2-Lite"))
    md = _cli("models", "--markdown")
    assert md.returncode == 0, md.stderr
    rows = [l for l in md.stdout.splitlines() if l.startswith("|")]
    assert len(rows) == 2 + len(ZOO) and rows[1].startswith("|---")
    assert all(r.count(" | ") == rows[0].count(" | ") for r in rows[2:])


def test_cli_build_model_refusals():
    proc = _cli("build", "--model", "deepseek-v2-lite")
    assert proc.returncode == 2 and "refused: multi-head latent attention (MLA)" in proc.stderr
    proc = _cli("build", "--model", "no-such-model")
    assert proc.returncode == 2 and "fi-backend models" in proc.stderr


def test_cli_build_model_refuses_an_mla_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V2_LITE))
    proc = _cli("build", "--model", str(tmp_path), "--arch", "90a")
    assert proc.returncode == 2 and "MLA" in proc.stderr


# ----------------------------------------------------------------------------- tensor parallelism

@pytest.mark.parametrize("name, tp, heads", [
    ("Llama-3.1-70B", 8, (8, 1)), ("Llama-3.1-70B", 2, (32, 4)), ("Qwen2.5-32B", 4, (10, 2)),
    ("Llama-3.1-405B", 8, (16, 1)), ("StarCoder2-15B", 8, (6, 1)),     # 4 KV heads, each on 2 of 8 ranks
    ("Command-R", 8, (8, 8)), ("Gemma-2-27B", 8, (4, 2)), ("Phi-4", 2, (20, 5)),
])
def test_tp_slice_heads(name, tp, heads):
    whole = find(name)
    rank = models.tp_slice(whole, tp)
    assert (rank.num_qo_heads, rank.num_kv_heads) == heads
    assert rank.name == f"{name} TP{tp}" and rank.tp == tp and whole.tp == 1
    # everything else is the model's: head size, layers, window, soft-cap, scale
    assert (rank.head_dim, rank.num_layers, rank.sliding_window, rank.window_pattern, rank.attn_logit_softcapping,
            rank.sm_scale, rank.hf_id) == (whole.head_dim, whole.num_layers, whole.sliding_window,
                                           whole.window_pattern, whole.attn_logit_softcapping, whole.sm_scale,
                                           whole.hf_id)
    assert models.tp_slice(whole, 1) is whole


def test_tp_heads_follow_the_engines_rule():
    """vLLM's and SGLang's split: query heads / tp; KV heads / tp while tp <= KV heads, else one each."""
    for q, kv in ((64, 8), (40, 8), (128, 8), (48, 4), (32, 32), (32, 16), (40, 10), (4, 1)):
        for tp in (1, 2, 4, 8, 16):
            engine_ok = q % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0)
            if engine_ok:
                assert models.tp_heads(q, kv, tp) == (q // tp, max(1, kv // tp))
            else:
                with pytest.raises(ValueError, match=f"over {tp} GPUs cannot split {q} query / {kv} KV heads"):
                    models.tp_heads(q, kv, tp)


@pytest.mark.parametrize("name, tp, why, degrees", [
    ("Phi-3-medium", 4, "10 KV heads do not divide by 4", "1, 2"),
    ("Qwen2.5-7B", 8, "28 query heads do not divide by 8", "1, 2, 4"),
    ("Yi-1.5-34B", 16, "56 query heads do not divide by 16", "1, 2, 4, 8"),
    ("Qwen2.5-0.5B", 4, "14 query heads do not divide by 4", "1, 2"),
])
def test_tp_slice_refusals_name_the_model_and_the_degrees_that_work(name, tp, why, degrees):
    with pytest.raises(ValueError) as e:
        models.tp_slice(find(name), tp)
    assert str(e.value).startswith(f"{name}: tensor parallelism over {tp} GPUs")
    assert why in str(e.value) and f"(degrees that split them: {degrees})" in str(e.value)


def test_tp_heads_refuses_bad_degrees():
    for tp in (0, -2, 2.0, True, "8"):
        with pytest.raises(ValueError, match="tp must be a positive whole number of GPUs"):
            models.tp_heads(64, 8, tp)
    with pytest.raises(ValueError, match="already one rank of TP 2"):
        models.tp_slice(models.tp_slice(find("Llama-3.1-70B"), 2), 2)


def test_tp_slices_cover_the_large_models():
    ranks = models.tp_slices()
    names = {m.name for m in ranks}
    assert {"Llama-3.1-70B TP8", "Qwen2.5-32B TP4", "Llama-3.1-405B TP8", "Qwen2.5-72B TP2"} <= names
    assert "Phi-4 TP2" in names and "Phi-4 TP4" not in names      # 10 KV heads: TP 2 only
    assert all(check(m)[0] for m in ranks), [m.name for m in ranks if not check(m)[0]]
    for name in models.TP_MODELS:   # every large model has at least TP 2
        assert f"{name} TP2" in names
    by_name = {m.name: m for m in ranks}
    assert (by_name["Llama-3.1-70B TP8"].num_qo_heads, by_name["Llama-3.1-70B TP8"].num_kv_heads) == (8, 1)
    # KV heads replicated past their count change the group, so the modules too
    assert by_name["StarCoder2-15B TP8"].group == 6 and find("StarCoder2-15B").group == 12


def test_modules_of_a_rank(sm90a):
    """A rank's modules are those of its own head configuration (group 8 for Llama-3.1-70B TP8)."""
    rank = models.tp_slice(find("Llama-3.1-70B"), 8)
    specs = modules_of(rank, kv_dtypes=("auto",))
    assert wrappers.decode_spec(variants.DEFAULT, 128, "bf16", "bf16", 8).memo_key in {s.memo_key for s in specs}
    assert len(specs) == (wrappers.decode_family_size(128, 2, 8) + wrappers.prefill_family_size(128, "bf16")
                          + len({s.memo_key for page in (16, 0)
                                 for s in cute_member.specs_for(variants.DEFAULT, 128, "bf16", "bf16", page)}))
    starcoder = {s.memo_key for s in modules_of(models.tp_slice(find("StarCoder2-15B"), 8))}
    assert starcoder != {s.memo_key for s in modules_of(find("StarCoder2-15B"))}


def test_cli_models_tp():
    proc = _cli("models", "--tp", "8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row = next(l for l in lines if l.startswith("Llama-3.1-70B TP8 "))
    assert " 8/1 " in row and row.rstrip().endswith("runs")
    assert " 16/1 " in next(l for l in lines if l.startswith("Llama-3.1-405B TP8 "))
    assert "refused: tensor parallelism over 8 GPUs cannot split 40 query / 10 KV heads" in next(
        l for l in lines if l.startswith("Phi-4 TP8 "))
    assert "heads per rank at tensor parallelism 8" in lines[-1] and "--tp 8" in lines[-1]
    assert " 10/2 " in next(l for l in _cli("models", "--tp", "4").stdout.splitlines() if l.startswith("Qwen2.5-32B TP4"))
    md = _cli("models", "--tp", "2", "--markdown")
    assert md.returncode == 0 and "[Llama-3.1-70B](https://huggingface.co/meta-llama/Llama-3.1-70B) TP2 | 32/4 |" in md.stdout
    bad = _cli("models", "--tp", "0")
    assert bad.returncode == 2 and "--tp must be a number of GPUs >= 1, got 0" in bad.stderr


def test_cli_build_model_tp_refusals():
    proc = _cli("build", "--model", "phi-4", "--tp", "4")
    assert proc.returncode == 2 and "--tp 4: Phi-4: tensor parallelism over 4 GPUs cannot split" in proc.stderr
    proc = _cli("build", "--tp", "2")
    assert proc.returncode == 2 and "--tp go with --model" in proc.stderr


@pytest.mark.parametrize("how", ["flag", "FI_BACKEND_DETERMINISTIC", "VLLM_BATCH_INVARIANT", "off"])
def test_cli_build_model_deterministic(sm90a, monkeypatch, how):
    """`fi-backend build --model` adds the deterministic decode modules with --deterministic or where the
    environment turns deterministic mode on (as the adapters read it); else the model's normal modules only."""
    from fi_backend import cli
    for name in ("FI_BACKEND_DETERMINISTIC", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    if how in ("FI_BACKEND_DETERMINISTIC", "VLLM_BATCH_INVARIANT"):
        monkeypatch.setenv(how, "1")
    built = []
    monkeypatch.setattr(cli, "_build_specs", lambda specs, archs, jobs, label: built.append((specs, label)) or 0)
    assert cli.main(["build", "--model", "Llama-3.1-8B", "--arch", "90a"] + (["--deterministic"] if how == "flag" else [])) == 0
    (specs, label), = built
    on = how != "off"
    assert [s.memo_key for s in specs] == [s.memo_key for s in modules_of(find("Llama-3.1-8B"), deterministic=on)]
    assert any(s.tag.endswith("_det") for s in specs) is on and ("deterministic" in label) is on
    assert cli.main(["build", "merge", "--deterministic"]) == 2
