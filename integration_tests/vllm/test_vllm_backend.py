"""vLLM 0.26 end to end with `attention_backend="CUSTOM"` (fi-backend), on the GPU machine.

    source /tmp/vllm-env.sh                      # vLLM 0.26 importable (../shared/device/ENGINES.md)
    python3 -m pytest -q integration_tests/vllm  # not collected by the default run (testpaths = tests)

Model: Llama-3.1-8B's shapes (32 query / 8 KV heads, head_dim 128, GQA 4) with FI_VLLM_TEST_LAYERS
layers (default 4) and vLLM's dummy weights, which are then redrawn in place (_redraw_weights): vLLM's
dummy weights (uniform +-1e-3, norms included) make attention contribute almost nothing to the
residual stream, so logprobs would agree whatever attention computed. Redrawn with unit-variance
activations (norm weights 1, matrices N(0, 1/fan_in)), attention logits are O(1) and each layer's
attention output is as large as its input: a wrong mask, block or length moves logprobs by O(1).

Each engine runs in its own process (this file run as a script; two engines in one process fail), in
process with its worker (VLLM_ENABLE_V1_MULTIPROCESSING=0) so it can redraw weights, read CUDA memory
and the adapter's counters. Engines: FLASH_ATTN (FlashAttention-3), TRITON_ATTN and CUSTOM eager, CUSTOM
with CUDA graphs, and a sliding-window variant of the model (FLASH_ATTN and CUSTOM). Prefix caching and
chunked prefill (512-token steps) are on in all of them.

Other models' shapes (test_model_shapes_match_flash_attn[kind], configs/<kind>.json: the models' HF
config.json with torch_dtype bfloat16 and max_position_embeddings at most 8192; the test cuts the layers
to FI_VLLM_TEST_LAYERS):
    qwen2_7b    Qwen2.5-7B       28 / 4 heads (GQA 7), head_dim 128, q/k/v biases, no sliding window
    phi3_mini   Phi-3-mini-4k    32 / 32 heads (MHA), head_dim 96, sliding window 2047 -> 127
    mistral_7b  Mistral-7B-v0.1  32 / 8 heads, head_dim 128, sliding window 4096 -> 256
    gemma2_9b   Gemma-2-9B       16 / 8 heads, head_dim 256, scale 256^-0.5, layers alternate sliding
                                 (4096 -> 128) and full attention, attention soft-cap 50 -> 4
The windows and Gemma-2's attention soft-cap are cut (->) so they bite on this workload's prompts
(3-1300 tokens, generations to 1248) and on unit-variance logits (a cap of 50 changes O(1) logits by
less than 1e-3); FI_VLLM_TEST_REAL_VARIANTS=1 keeps the models' own and adds one prompt 300 tokens past the
window to the prompt-logprob requests (max_model_len 8192 where that needs more than 4096). Each kind
runs three eager engines (FLASH_ATTN, TRITON_ATTN, CUSTOM); its noise bound is its own TRITON_ATTN vs
FLASH_ATTN distance. Token ids are drawn below the vocabulary size (Phi-3, Mistral: 32k). A reference
backend that refuses a kind at start-up (vLLM: "Selected backend ... is not valid for this
configuration") skips it, naming the backend; CUSTOM refusing one fails (the README lists these shapes
as supported). The test also checks what vLLM handed fi-backend's layers (heads, head size, scale,
windows, soft-cap), so a variant vLLM dropped cannot pass unnoticed.

IT_MODELS=kind,kind,... runs only those kinds (llama: the three Llama tests; window: the sliding-window
one; the four above; llama70b_tp2 and deterministic below), e.g. IT_MODELS=qwen2_7b,phi3_mini, so that one GPU command of at
most 10 minutes runs a part (a kind is three engines, about 2-3 minutes).

Tensor parallelism (test_tensor_parallel_matches_flash_attn, kind llama70b_tp2; collected where
torch.cuda.device_count() >= 2, skipped otherwise): Llama-3.1-70B's shapes (64 query / 8 KV heads, head_dim
128, hidden 8192) with FI_VLLM_TEST_LAYERS layers (default 4) and tensor_parallel_size=2, so each rank's
attention runs 32 query / 4 KV heads. Three engines, CUDA graphs on in all (FLASH_ATTN, TRITON_ATTN for the
noise, CUSTOM); the workers are separate processes, so weights are redrawn in each worker through
LLM.collective_rpc with a function of this file (cloudpickled by value), seeded by parameter name and rank
(each rank's shards differ; every engine draws the same ones), row-parallel matrices (o_proj, down_proj)
scaled by the whole fan-in; the per-rank attention settings and fi-backend's plan counts and kernel error
flags are read the same way. NCCL runs with NVLink multicast off (TP_ENV) as the GPU machines require:
    IT_MODELS=llama70b_tp2 python3 -m pytest -q integration_tests/vllm

Speculative decoding (test_speculative_decoding_matches_flash_attn, kind spec): Llama-3.1-8B's shapes, CUDA graphs
on, a draft model of the same shapes (speculative_config method draft_model, 3 tokens; its dummy weights are not
redrawn, so most drafts are rejected, but every target step verifies 1 + 3 tokens a request: vLLM's uniform
batches, captured in full graphs). Greedy generations of 8 prompts, CUSTOM against FLASH_ATTN (both speculating)
within twice TRITON_ATTN's distance plus the floor, up to the first differing token (a near-tie); vLLM's
spec-decode counters must show drafts:
    IT_MODELS=spec python3 -m pytest -q integration_tests/vllm

Batch invariance (issue 31's engine bar; kind deterministic, engines DET_ENGINES): Llama-3.1-8B's shapes, CUDA
graphs on (vLLM's default FULL_AND_PIECEWISE; batch-invariant mode changes no graph setting), prefix caching and
chunked prefill on. vLLM 0.26 with VLLM_BATCH_INVARIANT=1 swaps in its batch-invariant matmul / log-softmax /
RMSNorm kernels, turns cascade attention off, and turns prefix caching off for FLASHINFER and TRITON_MLA only
(CUSTOM keeps it: each engine records what it ran with, engine_config); it asks attention backends through
validate_configuration(use_batch_invariant=True), which fi-backend accepts. One engine process runs
compare.det_workload: targets of 7, 300 and 1500 tokens, each as two requests, `full` (prompt logprobs, which
vLLM never serves from the prefix cache) and `cached` (no prompt logprobs: its prefix comes from the cache, all
but the last 12 tokens for 300 and 1500), both with 64 greedy tokens and their top-5 logprobs; served alone one
after the other (twice), then inside three companion sets per target (fresh random companions each time):
"decoding" (15 companions stepped 12 engine steps before the target arrives: it meets their decodes),
"prefilling" (8 companions of 200-1400 tokens stepped 3 steps, 4 more arriving with the target) and "queued"
(28 companions: more than the 16 slots, so the target waits and then runs in a changing batch); companions
generate 16-320 tokens, so the batch keeps mixing prefill chunks and decodes while the target runs.
test_batch_invariant_alone_vs_busy: with VLLM_BATCH_INVARIANT=1 every prompt logprob and every generated step's
logprobs are == alone and busy (and alone twice); the same engine without it (deterministic_custom_nodet) is
recorded with its count of differing positions and max |difference|, expected to be nonzero (a warning, not a
failure, where it is 0); vLLM's FLASH_ATTN in batch-invariant mode is recorded as the reference (does vLLM's
own stack hold on this workload?). test_batch_invariant_cached_prefix_matches_whole: the `cached` target's
generation == the `full` one's (a cached prefix changes no bit). One engine per command, then the tests reuse
the records (FI_VLLM_TEST_REUSE=1); each engine takes about 2-4 minutes:
    python3 integration_tests/vllm/test_vllm_backend.py --engine deterministic_custom_det
    python3 integration_tests/vllm/test_vllm_backend.py --engine deterministic_custom_nodet
    python3 integration_tests/vllm/test_vllm_backend.py --engine deterministic_flash_attn_det
    IT_MODELS=deterministic FI_VLLM_TEST_REUSE=1 python3 -m pytest -q integration_tests/vllm
Results: vllm_batch_invariant.json and vllm_batch_invariant_cached_prefix.json.

Shared-prefix groups (issue 28, docs/composable.md; kind shared, engines SHARED_ENGINES): Llama-3.1-8B's shapes,
CUDA graphs on (FULL decode graphs up to 32 requests), prefix caching and chunked prefill on. workload_shared: four
prompts (40..1100 tokens) sent as 8 identical greedy requests each, one after the other in one generate() call (vLLM
refuses n > 1 with temperature 0, and seeded sampling would compare sampled tokens far from the top 5; identical
greedy requests are what n = 8 is to the engine, consecutive add_request calls whose prompt blocks the later copies
find in the prefix cache, minus the last partial block, and they stay neighbours in the batch), then a 2000-token
system prompt cached by one request before 12 questions of 4..15 tokens; 32 greedy tokens each, top-5 logprobs at
every step (no prompt logprobs: those requests never read the prefix cache). fi-backend runs with the opt-in worker
(worker_cls fi_backend.adapters.vllm_worker.Worker, the V2 runner mirroring its block table) with groups on, and with
FI_BACKEND_SHARED_PREFIX=0; FLASH_ATTN is the reference and TRITON_ATTN on the same workload the noise.
test_shared_prefix_groups_match_flash_attn: groups on within the bound of FLASH_ATTN and of groups off; the runner
was the worker's subclass; decode steps ran grouped on graph_prefill and extend steps kept groups (plan counts
grouped_decode / grouped_extend > 0); groups off planned none. One engine per command (about 2-3 minutes each):
    python3 integration_tests/vllm/test_vllm_backend.py --engine shared_flash_attn
    python3 integration_tests/vllm/test_vllm_backend.py --engine shared_triton_attn
    python3 integration_tests/vllm/test_vllm_backend.py --engine shared_custom
    python3 integration_tests/vllm/test_vllm_backend.py --engine shared_custom_off
    IT_MODELS=shared FI_VLLM_TEST_REUSE=1 python3 -m pytest -q integration_tests/vllm
Result: vllm_shared_prefix.json.

Weights: matrices N(0, gain^2 / fan_in), seeded by the parameter's name (so every engine of a kind draws the
same ones), gain 4 for a separate lm_head; norm weights 1 (0 for Gemma's (1 + w) norms); biases (Qwen2's
q/k/v) N(0, 0.5^2), seeded by name too.

Tolerance. Two correct attention kernels differ by rounding only (bf16 inputs and P, fp32
accumulation in another order, split-KV merges); the FLASH_ATTN vs TRITON_ATTN difference on the same
workload measures that noise. CUSTOM must stay within 2x that noise plus a small floor (0.02 max,
0.002 mean, in nats) of FLASH_ATTN, and CUSTOM with CUDA graphs within the same bound of CUSTOM eager
(torch.compile changes the rounding of the other ops too). Greedy generations are compared until
the first differing token, which must be a near-tie: each side's token in the other's top 5.

Results (one JSON per engine and per test) go to $OUT if set, else integration_tests/results/.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # integration_tests/compare.py
from compare import bound as _bound, generation_diffs as _generation_diffs  # noqa: E402
from compare import logprob_diffs as _logprob_diffs, stats as _stats  # noqa: E402
from compare import DET_GEN, DET_TOP, det_plan, det_report, det_workload, engine_records, optional  # noqa: E402
from compare import check_shared_prefix, cute_member_expected, fresh_expected, require_engine_and_gpu  # noqa: E402
from compare import embedding_diffs, write_wordpiece_vocab  # noqa: E402
LAYERS = int(os.environ.get("FI_VLLM_TEST_LAYERS", "4"))
RESULTS = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "integration_tests" / "results"
ENGINE_TIMEOUT_S = int(os.environ.get("FI_VLLM_TEST_ENGINE_TIMEOUT", "480"))
# Llama-3.1-8B's config.json (../shared/models/llama-3.1-8b), used when that file is not beside the checkout.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
# Llama-3.1-70B's config.json: Llama-3.1-8B's but for the widths and heads (64 query / 8 KV heads, head_dim 128).
LLAMA_31_70B = {**LLAMA_31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                "num_key_value_heads": 8}
# Tensor-parallel kinds: kind -> (config, tensor_parallel_size).
TP_KINDS = {"llama70b_tp2": (LLAMA_31_70B, 2)}
# Every TP engine's environment: NCCL without NVLink multicast (NVLS), as the GPU machines require.
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
          "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
WINDOW = 64      # the sliding-window model: layers alternate sliding (64 tokens) and full attention
CONFIGS = Path(__file__).resolve().parent / "configs"
# Other models' shapes: kind -> (config file, test sliding window, test attention soft-cap); None keeps the
# config's. The windows and the cap are cut so that they bite (module docstring).
SHAPES = {
    "qwen2_7b": ("qwen2_7b.json", None, None),
    "phi3_mini": ("phi3_mini.json", 127, None),
    "mistral_7b": ("mistral_7b.json", 256, None),
    "gemma2_9b": ("gemma2_9b.json", 128, 4.0),
}
REAL_VARIANTS = os.environ.get("FI_VLLM_TEST_REAL_VARIANTS", "0") == "1"
# Encoder-only kinds (test_encoder_only_embeddings_match_flash_attn): kind -> config file; pooling runner, embeddings
ENCODER_KINDS = {"bert": "bert_base.json"}
KINDS = ("llama", "window") + tuple(SHAPES) + tuple(TP_KINDS) + tuple(ENCODER_KINDS) + ("deterministic", "shared",
                                                                                       "spec")
# kind spec: the target's own shapes as the draft model (dummy weights), 3 tokens a step; verify batches are 1 + 3
# tokens a request, so the captured sizes (tokens) reach max_num_seqs x 4
SPEC_TOKENS = 3
SPEC_CAPTURE_SIZES = [4, 8, 16, 32, 64]
# Issue 31's engine bar (kind deterministic; module docstring): label -> (backend, the engine process's environment).
# Llama-3.1-8B's shapes, CUDA graphs on, prefix caching and chunked prefill on as in every engine here.
DET_ENGINES = {
    "deterministic_custom_det": ("CUSTOM", {"VLLM_BATCH_INVARIANT": "1"}),
    "deterministic_custom_nodet": ("CUSTOM", {"VLLM_BATCH_INVARIANT": "0", "FI_BACKEND_DETERMINISTIC": "0"}),
    # vLLM's own batch-invariant FlashAttention: the reference (are vLLM's other layers invariant here?)
    "deterministic_flash_attn_det": ("FLASH_ATTN", {"VLLM_BATCH_INVARIANT": "1"}),
}
# Issue 28's shared-prefix groups (kind shared; module docstring): label -> (backend, environment, worker_cls).
WORKER_CLS = "fi_backend.adapters.vllm_worker.Worker"
SHARED_ENGINES = {
    "shared_flash_attn": ("FLASH_ATTN", {}, None),
    "shared_triton_attn": ("TRITON_ATTN", {}, None),   # the noise on this workload
    "shared_custom": ("CUSTOM", {"FI_BACKEND_SHARED_PREFIX": "1"}, WORKER_CLS),
    "shared_custom_off": ("CUSTOM", {"FI_BACKEND_SHARED_PREFIX": "0"}, WORKER_CLS),
}
SHARED_ARGS = dict(max_num_seqs=32)                 # 32 parallel copies decode in one batch
SHARED_CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32]
SHARED_SYSTEM_TOKENS = 2000
REUSE = os.environ.get("FI_VLLM_TEST_REUSE") == "1"   # the deterministic and shared kinds: reuse engine records found
SELECTED = tuple(k.strip() for k in os.environ.get("IT_MODELS", "").split(",") if k.strip()) or KINDS
if set(SELECTED) - set(KINDS):
    raise ValueError(f"IT_MODELS names unknown kinds {sorted(set(SELECTED) - set(KINDS))}; known: {', '.join(KINDS)}")
BIAS_STD = 0.5
ENGINE_ARGS = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                   gpu_memory_utilization=0.5, enable_prefix_caching=True, enable_chunked_prefill=True,
                   max_num_batched_tokens=512, max_num_seqs=16, seed=0)
CAPTURE_SIZES = [1, 2, 4, 8, 16]   # max_num_seqs 16: every decode batch replays a captured graph


# ------------------------------------------------------------------------------------ the engine process

def _llama_config() -> dict:
    for candidate in (os.environ.get("FI_VLLM_TEST_CONFIG"), ROOT.parent / "shared/models/llama-3.1-8b/config.json",
                      ROOT / "shared/models/llama-3.1-8b/config.json"):
        if candidate and Path(candidate).is_file():
            return json.loads(Path(candidate).read_text())
    return dict(LLAMA_31_8B)


def model_config(kind: str) -> dict:
    """The config.json of a kind, layers cut to LAYERS (and, for SHAPES, window and soft-cap as the test sets them)."""
    if kind in SHAPES:
        name, window, softcap = SHAPES[kind]
        config = json.loads((CONFIGS / name).read_text())
        if not REAL_VARIANTS:
            if window is not None:
                config["sliding_window"] = window
                if "sliding_window_size" in config:
                    config["sliding_window_size"] = window
            if softcap is not None:
                config["attn_logit_softcapping"] = softcap
        if config["model_type"] == "gemma2":   # Gemma-2: even layers sliding, odd ones full (as transformers derives)
            config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)]
    elif kind in TP_KINDS:
        config = dict(TP_KINDS[kind][0])
    elif kind in ENCODER_KINDS:
        config = json.loads((CONFIGS / ENCODER_KINDS[kind]).read_text())
    else:
        config = _llama_config()
    config["num_hidden_layers"] = LAYERS
    if kind == "window":
        config["sliding_window"] = WINDOW
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)]
    return config


def _window(config: dict):
    """The model's sliding window as vLLM reads it (Qwen2: only with use_sliding_window), or None."""
    if not config.get("use_sliding_window", True):
        return None
    return config.get("sliding_window")


def _encoder_only(config: dict) -> bool:
    return config.get("model_type") == "bert"


def workload_options(config: dict) -> dict:
    """What the logprob workload adapts to a model: the token-id range (below its vocabulary) and, when its
    window is longer than the workload's prompts (FI_VLLM_TEST_REAL_VARIANTS=1), one prompt 300 tokens past
    it and the max_model_len that takes it."""
    if _encoder_only(config):   # prompts up to the model's positions (BERT: 512), each whole in one step
        return {"token_hi": config["vocab_size"], "long_prompts": [], "max_model_len": config["max_position_embeddings"]}
    window = _window(config)
    long = [window + 300] if window and window + 300 > 1300 else []
    max_len = ENGINE_ARGS["max_model_len"]
    if long and long[0] + 1 > max_len:
        max_len = min(8192, config.get("max_position_embeddings", 8192))
        assert long[0] + 1 <= max_len, (long, max_len)
    return {"token_hi": min(120000, config["vocab_size"]), "long_prompts": long, "max_model_len": max_len}


def make_model_dir(kind: str) -> str:
    """A model folder with config.json (dummy weights), in /tmp. Decoders get no tokenizer (prompts are token ids);
    an encoder-only model gets a WordPiece vocabulary of its size, since vLLM's pooling runner builds its scoring
    processor from a tokenizer at start-up even when every prompt is token ids."""
    config = model_config(kind)
    path = Path(tempfile.mkdtemp(prefix=f"fi-vllm-{kind}-"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    if _encoder_only(config):
        write_wordpiece_vocab(path, config["vocab_size"], config["max_position_embeddings"])
    return str(path)


ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")   # split along their input: a rank's shard has fan_in / tp


def _redraw_weights(model, norm_fill: float = 1.0, tp: int = 1, rank: int = 0) -> int:
    """Unit-variance activations (see the module docstring); deterministic per parameter name (and tensor-
    parallel rank: each rank's shards differ), in place (CUDA graphs and compiled code keep reading the same
    storage). norm_fill: 1 for RMSNorm's w, 0 for Gemma's 1 + w."""
    import torch

    def seed(name):
        return zlib.crc32((name if tp == 1 else f"{name}@{rank}").encode())

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith(".bias"):   # Qwen2's q/k/v biases (Llama has none)
                gen = torch.Generator(device=p.device)
                gen.manual_seed(seed(name))
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * BIAS_STD)
                continue
            if p.dim() == 1:   # otherwise norm weights
                p.fill_(norm_fill)
                continue
            gen = torch.Generator(device=p.device)
            gen.manual_seed(seed(name))
            gain = 4.0 if "lm_head" in name else 1.0   # sharper next-token distributions
            fan_in = p.shape[1] * (tp if name.endswith(ROW_PARALLEL) else 1)
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * (gain / math.sqrt(fan_in)))
    return sum(p.numel() for p in model.parameters())


def _rank_redraw(worker, norm_fill: float, tp: int) -> int:
    """_redraw_weights in one tensor-parallel worker (LLM.collective_rpc)."""
    from vllm.distributed import get_tensor_model_parallel_rank
    return _redraw_weights(worker.get_model(), norm_fill, tp, get_tensor_model_parallel_rank())


def _rank_attention_layers(worker) -> dict:
    return _attention_layers(worker.get_model())


def _rank_fi_backend(worker) -> dict:
    """fi-backend's plan counts in one worker, after raising if one of its kernels met an out-of-range index."""
    import torch
    from fi_backend.adapters import vllm as adapter
    adapter.check_errors()
    return {"plan_counts": adapter.plan_counts(), "device": str(torch.cuda.current_device())}


def _attention_layers(model) -> dict:
    """What vLLM built: per attention layer, its impl class and the settings it was handed."""
    layers = {}
    for name, m in model.named_modules():
        impl = getattr(m, "impl", None)
        if impl is None or not hasattr(impl, "scale"):
            continue
        rec = {"impl": f"{type(impl).__module__}.{type(impl).__qualname__}",
               "layer_sliding_window": getattr(m, "sliding_window", None)}
        for key in ("num_heads", "num_kv_heads", "head_size", "scale", "sliding_window", "logits_soft_cap"):
            value = getattr(impl, key, None)
            rec[key] = value if value is None or isinstance(value, (int, float, str)) else repr(value)
        if not isinstance(rec["layer_sliding_window"], (int, type(None))):
            rec["layer_sliding_window"] = repr(rec["layer_sliding_window"])
        layers[name] = rec
    return layers


def _tokens(rng: random.Random, n: int, hi: int = 120000) -> list:
    return [rng.randrange(1000, hi) for _ in range(n)]


def _top(logprobs: dict) -> dict:
    return {str(t): float(lp.logprob) for t, lp in logprobs.items()}


def workload_logprobs(llm, token_hi: int = 120000, long_prompts=()) -> dict:
    """Prompt logprobs of mixed-length prompts (1300 tokens: chunked over 3 steps; long_prompts added after
    them) and of one 480-token prompt alone, first-token top-5 logprobs of prompts that hit the prefix cache,
    and greedy generations (mixed prefill + decode steps, then pure decode steps). Token ids in [1000,
    token_hi)."""
    from vllm import SamplingParams, TokensPrompt
    rng = random.Random(1234)
    prompts = [_tokens(rng, n, token_hi) for n in (3, 17, 64, 200, 511, 1300)]
    every = prompts + [_tokens(random.Random(4321 + n), n, token_hi) for n in long_prompts]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in every], sp, use_tqdm=False)
    # One new 480-token prompt alone: a step of new prompts that the CuTe member takes (the first step above mixes
    # short prompts, which it leaves to the tile family), so fi-backend runs it on the layers' own key / value
    alone = _tokens(random.Random(77), 480, token_hi)
    outs = list(outs) + llm.generate([TokensPrompt(prompt_token_ids=alone)], sp, use_tqdm=False)
    every = every + [alone]
    prompt_lp = [[float(d[t].logprob) for t, d in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(every, outs)]

    # Prompt-logprob requests never read the prefix cache; these requests fill it (or hit it) first,
    # so that the next ones hit it with cached prefixes of 192 to 1296 tokens.
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[3:]], sp, use_tqdm=False)
    hits = [prompts[5][:800] + _tokens(rng, 40, token_hi), prompts[4][:496] + _tokens(rng, 5, token_hi),
            prompts[3] + _tokens(rng, 1, token_hi), prompts[5][:1296] + _tokens(rng, 3, token_hi)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in hits], sp, use_tqdm=False)
    first = [_top(o.outputs[0].logprobs[0]) for o in outs]
    cached = [o.num_cached_tokens for o in outs]

    gen_prompts = [_tokens(rng, n, token_hi) for n in (5, 33, 100, 257, 400, 640, 900, 1200)]
    sp = SamplingParams(max_tokens=48, temperature=0.0, logprobs=5, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in gen_prompts], sp, use_tqdm=False)
    gens = [{"tokens": list(o.outputs[0].token_ids), "logprobs": [_top(d) for d in o.outputs[0].logprobs]}
            for o in outs]
    return {"prompt_logprobs": prompt_lp, "prefix_hit_first_token": first, "prefix_hit_cached_tokens": cached,
            "generations": gens}


def workload_embed(llm, token_hi: int) -> dict:
    """Embeddings (the pooling runner's; BERT: the first token's, normalised) of prompts of 1 to 511 tokens in one
    call (two steps of at most 512 tokens), five of 100 tokens (one step), then three short ones. With fi-backend
    the 100-token step is the one the CuTe member takes where it runs (5 query tiles x 12 heads: past its
    MIN_TILES_PER_SM on 132 SMs); the others go to the tile family (too few tiles, or short prompts' share).
    Token ids in [1000, token_hi)."""
    from vllm import TokensPrompt
    rng = random.Random(2024)
    batches = [[_tokens(rng, n, token_hi) for n in lens] for lens in ((1, 7, 64, 200, 511), (100,) * 5, (3, 9, 30))]
    vectors = []
    for prompts in batches:
        outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
        vectors += [[float(x) for x in o.outputs.embedding] for o in outs]
    return {"embeddings": vectors, "prompt_lens": [len(p) for b in batches for p in b]}


def workload_spec(llm, token_hi: int) -> dict:
    """Greedy generations of 48 tokens from 8 prompts of 5-300 tokens under speculative decoding, top-5 logprobs a
    step, and vLLM's spec-decode counters (drafts proposed and accepted)."""
    from vllm import SamplingParams, TokensPrompt
    rng = random.Random(31)
    prompts = [_tokens(rng, n, token_hi) for n in (5, 40, 150, 300, 17, 90, 220, 8)]
    sp = SamplingParams(max_tokens=48, temperature=0.0, logprobs=5, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    gens = [{"tokens": list(o.outputs[0].token_ids), "logprobs": [_top(d) for d in o.outputs[0].logprobs]}
            for o in outs]
    counters = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            value = getattr(m, "value", None)
            counters[m.name] = value if value is not None else list(getattr(m, "values", []) or [])
    return {"generations": gens, "prompt_lens": [len(p) for p in prompts], "spec_counters": counters}


def workload_long(llm, rounds: int = 3, token_hi: int = 120000) -> dict:
    """Three rounds of 40 requests (prompts 8..600 tokens, 16..320 sampled tokens each) through 16 batch
    slots: the batch fills, mixes prefill chunks with decodes, and drains over hundreds of steps. CUDA
    memory is read after each round (rounds 2 and 3 see the same prefix-cache state)."""
    import torch
    from vllm import SamplingParams, TokensPrompt
    rng = random.Random(99)
    lens = [rng.randrange(8, 600) for _ in range(40)]
    out_lens = [rng.randrange(16, 320) for _ in range(39)] + [320]
    prompts = [TokensPrompt(prompt_token_ids=_tokens(rng, n, token_hi)) for n in lens]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, detokenize=False) for m in out_lens]
    memory, seconds = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != out_lens:
            raise AssertionError(f"generated lengths {got} != requested {out_lens}")
        torch.cuda.synchronize()
        gc.collect()
        memory.append({"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                       "free": torch.cuda.mem_get_info()[0]})
    return {"rounds": rounds, "requests": len(prompts), "tokens_per_round": sum(out_lens),
            "max_steps_lower_bound": max(out_lens), "memory": memory, "seconds": seconds}


def _det_params(prompt_logprobs: bool, max_tokens: int = DET_GEN, logprobs: bool = True):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                          logprobs=DET_TOP if logprobs else None, prompt_logprobs=1 if prompt_logprobs else None)


def _det_target(o, prompt: list, prompt_logprobs: bool) -> dict:
    """A target's RequestOutput as compare.det_workload's record (exact floats: JSON keeps a double's bits)."""
    assert list(o.prompt_token_ids) == prompt, "not the target's output"
    c = o.outputs[0]
    rec = {"tokens": list(c.token_ids), "logprobs": [_top(d) for d in c.logprobs],
           "cached_tokens": int(o.num_cached_tokens or 0)}
    if prompt_logprobs:
        rec["prompt_logprobs"] = [float(d[t].logprob) for t, d in zip(prompt[1:], o.prompt_logprobs[1:])]
    return rec


def _det_alone(llm, prompt: list) -> tuple:
    from vllm import TokensPrompt
    out = []
    for full in (True, False):
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], _det_params(full), use_tqdm=False)
        out.append(_det_target(o, prompt, full))
    return tuple(out)


def _det_busy(llm, prompt: list, entry: dict) -> tuple:
    """The target (both flavours) inside entry's companions: the early ones are enqueued and the engine stepped
    entry["wait"][0] times, then the targets and the late companions are enqueued and the engine run until
    every request has finished (LLM.enqueue, LLMEngine.step: the loop of LLM._run_engine)."""
    from vllm import TokensPrompt
    engine = llm.llm_engine
    done = {}

    def step():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o

    def enqueue(pairs):
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in pairs]
        ids = llm.enqueue(prompts, [params for _, params in pairs], use_tqdm=False)
        # enqueue returns the engine's internal ids, "<external>-<16 hex>"; outputs carry the external one
        return [i.rsplit("-", 1)[0] for i in ids]

    assert not engine.has_unfinished_requests(), "the engine is not idle before a busy run"
    enqueue([(p, _det_params(False, gen, logprobs=False)) for p, gen in entry["early"]])
    steps = 0
    while steps < entry["wait"][0] and engine.has_unfinished_requests():
        step()
        steps += 1
    info = {"steps_before_target": steps, "companions_finished_before_target": len(done),
            "unfinished_at_arrival": engine.get_num_unfinished_requests()}
    ids = enqueue([(prompt, _det_params(True)), (prompt, _det_params(False))]
                  + [(p, _det_params(False, gen, logprobs=False)) for p, gen in entry["late"]])
    while engine.has_unfinished_requests():
        step()
        steps += 1
    info["steps"] = steps
    return _det_target(done[ids[0]], prompt, True), _det_target(done[ids[1]], prompt, False), info


def workload_det(llm, token_hi: int = 120000) -> dict:
    """Issue 31's engine bar (compare.det_workload): targets of 7, 300 and 1500 tokens served alone, then inside
    three companion sets each (module docstring)."""
    return det_workload(det_plan(token_hi), functools.partial(_det_alone, llm), functools.partial(_det_busy, llm))


def workload_shared(llm, token_hi: int = 120000) -> dict:
    """Shared prefixes as parallel sampling and system prompts make them (module docstring): four prompts sent as 8
    identical greedy requests each, consecutively; then a SHARED_SYSTEM_TOKENS system prompt, cached by one request
    first, before 12 questions of 4..15 tokens sent at once (short: with long questions each member's own query tiles
    already amortise the prefix and the planner keeps no extend group). 32 greedy tokens each with top-5 logprobs, in
    workload_logprobs' record shape."""
    from vllm import SamplingParams, TokensPrompt
    rng = random.Random(2028)
    sp = SamplingParams(max_tokens=32, temperature=0.0, logprobs=5, ignore_eos=True, detokenize=False)
    gens, cached = [], []

    def keep(outs):
        for o in outs:
            gens.append({"tokens": list(o.outputs[0].token_ids), "logprobs": [_top(d) for d in o.outputs[0].logprobs]})
            cached.append(int(o.num_cached_tokens or 0))

    sampled = [_tokens(rng, n, token_hi) for n in (40, 300, 700, 1100)]
    copies = [p for p in sampled for _ in range(8)]
    keep(llm.generate([TokensPrompt(prompt_token_ids=p) for p in copies], sp, use_tqdm=False))
    system = _tokens(rng, SHARED_SYSTEM_TOKENS, token_hi)
    llm.generate([TokensPrompt(prompt_token_ids=system + _tokens(rng, 4, token_hi))],
                 SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    questions = [system + _tokens(rng, rng.randrange(4, 16), token_hi) for _ in range(12)]
    keep(llm.generate([TokensPrompt(prompt_token_ids=p) for p in questions], sp, use_tqdm=False))
    return {"prompt_logprobs": [], "prefix_hit_first_token": [g["logprobs"][0] for g in gens], "generations": gens,
            "prefix_hit_cached_tokens": cached, "copies": len(copies), "system_prompt_requests": len(questions)}


def _rank_runner(worker) -> str:
    """The model runner class a worker runs (the opt-in worker's V2 subclass, or vLLM's own)."""
    t = type(worker.model_runner)
    return f"{t.__module__}.{t.__qualname__}"


def _engine_config(config) -> dict:
    """What the engine settled on where batch invariance may change it (vLLM turns cascade attention off, and
    prefix caching off for FLASHINFER; the V2 model runner puts decodes first)."""
    import vllm.envs as envs
    return {"VLLM_BATCH_INVARIANT": bool(envs.VLLM_BATCH_INVARIANT),
            "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
            "block_size": config.cache_config.block_size,
            "disable_cascade_attn": bool(getattr(config.model_config, "disable_cascade_attn", False)),
            "use_v2_model_runner": bool(getattr(config, "use_v2_model_runner", False)),
            "async_scheduling": bool(getattr(config.scheduler_config, "async_scheduling", False)),
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": config.scheduler_config.max_num_seqs}


def run_engine(backend: str, graphs: bool, model: str, workloads: list, out: str, tp: int = 1,
               worker_cls: Optional[str] = None) -> None:
    import torch
    import vllm
    from vllm import LLM
    config = json.loads(Path(model, "config.json").read_text())
    options = workload_options(config)
    record = {"backend": backend, "graphs": graphs, "model": config, "workload_options": options,
              "vllm": vllm.__version__, "torch": torch.__version__, "tensor_parallel_size": tp}
    if tp == 1:   # with TP the workers own the GPUs: CUDA stays uninitialised here until they are up
        record["device"] = torch.cuda.get_device_name()
    if backend == "CUSTOM":
        from importlib.metadata import entry_points
        import fi_backend
        installed = any(ep.value == "fi_backend.adapters.vllm:register"
                        for ep in entry_points(group="vllm.general_plugins"))
        record.update(fi_backend=fi_backend.__version__, entry_point_installed=installed)
        if not installed and tp > 1:
            raise RuntimeError("tensor parallelism: vLLM's worker processes find fi-backend through its entry point "
                               "(vllm.general_plugins); install the wheel first (.ci/gpu vllm-it does)")
        if not installed:   # a source checkout: register by hand (the engine runs in this process)
            from fi_backend.adapters.vllm import register
            register()
    kwargs = dict(ENGINE_ARGS, max_model_len=options["max_model_len"])
    if _encoder_only(config):   # no KV cache: nothing to cache, each prompt whole in one step
        kwargs.update(runner="pooling", enable_prefix_caching=False, enable_chunked_prefill=False,
                      skip_tokenizer_init=False)
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
    shared = "shared" in workloads
    if shared:
        kwargs.update(SHARED_ARGS)
    if "spec" in workloads:
        kwargs["speculative_config"] = {"method": "draft_model", "model": model,
                                        "num_speculative_tokens": SPEC_TOKENS}
        kwargs["disable_log_stats"] = False   # LLM.get_metrics (the spec-decode counters) needs the stats
    if worker_cls:
        kwargs["worker_cls"] = worker_cls
    if graphs:
        sizes = SHARED_CAPTURE_SIZES if shared else SPEC_CAPTURE_SIZES if "spec" in workloads else CAPTURE_SIZES
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    else:
        kwargs["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(model=model, attention_backend=backend, **kwargs)
    record["worker_cls"] = llm.llm_engine.vllm_config.parallel_config.worker_cls
    record["model_runner"] = llm.collective_rpc(_rank_runner)
    record["engine_start_s"] = time.perf_counter() - t0
    record["cudagraph_mode"] = str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    record["engine_config"] = _engine_config(llm.llm_engine.vllm_config)
    norm_fill = 0.0 if config["model_type"].startswith("gemma") else 1.0
    if tp > 1:   # workers in their own processes: this file's functions travel by value (cloudpickle)
        record["device"] = torch.cuda.get_device_name(0)
        record["parameters_per_rank"] = llm.collective_rpc(_rank_redraw, args=(norm_fill, tp))
        record["parameters"] = sum(record["parameters_per_rank"])
        record["attention_per_rank"] = llm.collective_rpc(_rank_attention_layers)
        record["attention"] = record["attention_per_rank"][0]
    else:
        record["parameters"] = llm.apply_model(functools.partial(_redraw_weights, norm_fill=norm_fill))[0]
        record["attention"] = llm.apply_model(_attention_layers)[0]
    for name in workloads:
        t0 = time.perf_counter()
        if name == "logprobs":
            record[name] = workload_logprobs(llm, options["token_hi"], options["long_prompts"])
        elif name == "det":
            record[name] = workload_det(llm, options["token_hi"])
        elif name == "shared":
            record[name] = workload_shared(llm, options["token_hi"])
        elif name == "embed":
            record[name] = workload_embed(llm, options["token_hi"])
        elif name == "spec":
            record[name] = workload_spec(llm, options["token_hi"])
        else:
            record[name] = workload_long(llm, token_hi=options["token_hi"])
        record[name + "_s"] = time.perf_counter() - t0
    if backend == "CUSTOM" and tp > 1:
        record["fi_backend_per_rank"] = llm.collective_rpc(_rank_fi_backend)
        record["plan_counts"] = record["fi_backend_per_rank"][0]["plan_counts"]
    elif backend == "CUSTOM":
        from fi_backend.adapters import vllm as adapter
        record["plan_counts"] = adapter.plan_counts()
        record["fi_backend_deterministic"] = sorted({bool(getattr(w, "deterministic", False)) for w in adapter._wrappers})
        record["fi_backend_warned_unordered"] = bool(getattr(adapter, "_warned_unordered", False))
        adapter.check_errors()   # raises if a kernel met an out-of-range KV index or slot
    Path(out).write_text(json.dumps(record))


# ------------------------------------------------------------------------------------ comparisons

def _write(name: str, record: dict) -> None:
    """A test's record, stamped with when, where and at which commit it ran (FI_COMMIT where the tree travels
    without .git, as on the GPU machine)."""
    import datetime
    import torch
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from perf.common import commit  # FI_COMMIT, else git
    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"vllm_{name}.json").write_text(json.dumps({**stamp, **record}, indent=1))


# ------------------------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def engines():
    require_engine_and_gpu("vllm")
    models, done = {}, {}

    def get(backend: str, graphs: bool = False, kind: str = "llama", workloads=("logprobs",)) -> dict:
        key = (backend, graphs, kind, tuple(workloads))
        if key not in done:
            if kind not in models:
                models[kind] = make_model_dir(kind)
            label = f"{kind}_{backend.lower()}_{'graphs' if graphs else 'eager'}"
            tp = TP_KINDS[kind][1] if kind in TP_KINDS else 1
            done[key] = run_engine_process(label, backend, models[kind], workloads, graphs, tp)
        if "refused" in done[key]:
            pytest.skip(f"{backend} cannot run {kind}: {done[key]['refused']}")
        return done[key]

    return get


def run_engine_process(label: str, backend: str, model: str, workloads, graphs: bool, tp: int = 1,
                       env_extra: Optional[dict] = None, worker_cls: Optional[str] = None) -> dict:
    """One engine in its own process (this file as a script): its record, or {"refused": reason} where a reference
    backend refused the model at start-up (CUSTOM refusing fails)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"vllm_engine_{label}.json"
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if tp > 1:
        env.update(TP_ENV)
    env.update(env_extra or {})
    cmd = [sys.executable, __file__, "--backend", backend, "--model", model, "--out", str(out),
           "--workloads", ",".join(workloads), "--tp", str(tp)] + (["--graphs"] if graphs else []) + (
               ["--worker-cls", worker_cls] if worker_cls else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S)
    (RESULTS / f"vllm_engine_{label}.log").write_text(proc.stdout + proc.stderr)
    refused = _refusal(proc.stdout + proc.stderr) if proc.returncode != 0 else None
    if refused and backend != "CUSTOM":   # a reference backend that cannot run this model
        return {"refused": refused}
    assert proc.returncode == 0, f"{label} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    record = json.loads(out.read_text())
    record["wall_s"] = time.perf_counter() - t0
    record["log_unordered_warning"] = "a mixed step has one-token requests after longer ones" in proc.stdout + proc.stderr
    out.write_text(json.dumps(record))
    return record


def run_det_engine(label: str) -> dict:
    """An engine of DET_ENGINES (the deterministic kind): CUDA graphs on, the det workload."""
    backend, env = DET_ENGINES[label]
    return run_engine_process(label, backend, make_model_dir("deterministic"), ("det",), True, 1, env)


def run_shared_engine(label: str) -> dict:
    """An engine of SHARED_ENGINES (the shared kind): Llama-3.1-8B's shapes, CUDA graphs on, the shared workload."""
    backend, env, worker_cls = SHARED_ENGINES[label]
    return run_engine_process(label, backend, make_model_dir("shared"), ("shared",), True, 1, env, worker_cls)


@pytest.fixture(scope="module")
def shared_engines():
    """SHARED_ENGINES' records: read back where FI_VLLM_TEST_REUSE=1 finds one, else run (one process each)."""
    require_engine_and_gpu("vllm")
    return engine_records(RESULTS, "vllm_engine_", REUSE, run_shared_engine)


@pytest.fixture(scope="module")
def det_engines():
    """DET_ENGINES' records: read back where FI_VLLM_TEST_REUSE=1 finds one, else run (one process each)."""
    require_engine_and_gpu("vllm")
    return engine_records(RESULTS, "vllm_engine_", REUSE, run_det_engine)


_REFUSALS = (r"Selected backend \S+ is not valid for this configuration\.?\s*(?:Reason:\s*)?(.*)",
             r"(?:ValueError|NotImplementedError): (.*\b(?:not supported|does not support|unsupported)\b.*)")


def _refusal(log: str):
    """The reason an engine gave for refusing the model at start-up, if its log's last lines carry one."""
    for line in reversed(log.splitlines()[-200:]):
        for pattern in _REFUSALS:
            m = re.search(pattern, line)
            if m:
                return m.group(1).strip()[:300] or line.strip()[:300]
    return None


def _selected(kind: str) -> None:
    if kind not in SELECTED:
        pytest.skip(f"IT_MODELS={','.join(SELECTED)} leaves out {kind}")


def _noise(engines, kind: str = "llama") -> dict:
    """FLASH_ATTN vs TRITON_ATTN on a kind's workload: what rounding alone moves."""
    fa, triton = engines("FLASH_ATTN", kind=kind)["logprobs"], engines("TRITON_ATTN", kind=kind)["logprobs"]
    noise = _stats(_logprob_diffs(fa, triton))
    gen, _, _ = _generation_diffs(fa, triton)
    return {"logprobs": noise, "generation": _stats(gen) if gen else None}


@pytest.mark.gpu
def test_prompt_logprobs_match_flash_attn(engines):
    _selected("llama")
    fa, custom = engines("FLASH_ATTN")["logprobs"], engines("CUSTOM")["logprobs"]
    noise = _noise(engines)
    bound = _bound(noise["logprobs"])
    got = _stats(_logprob_diffs(fa, custom))
    gen, compared, total = _generation_diffs(fa, custom)
    values = [x for lp in fa["prompt_logprobs"] for x in lp]
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
    counts = engines("CUSTOM")["plan_counts"]
    _write("prompt_logprobs", {"noise_triton_vs_fa": noise, "bound": bound, "custom_vs_fa": got,
                               "generation": {**_stats(gen), "compared": compared, "generated": total},
                               "fa_prompt_logprob_std": spread, "cached_tokens": custom["prefix_hit_cached_tokens"],
                               "plan_counts": counts})
    assert min(custom["prefix_hit_cached_tokens"]) >= 16, "the prefix-cache prompts did not hit the cache"
    # the workload's second prompt step (283 + 229 rows: 5 query tiles x 32 heads) is one the CuTe member takes
    assert counts.get("cute", 0) > 0 or not cute_member_expected(), counts
    # the 480-token prompt alone is a step of new prompts: the fresh wrapper over the layers' own key / value
    assert counts.get("fresh", 0) > 0 or not fresh_expected(), counts
    assert spread > 0.5, "degenerate model: prompt logprobs too uniform to tell attention apart"
    assert got["max"] <= bound["max"] and got["mean"] <= bound["mean"], (got, bound)
    assert max(gen, default=0.0) <= bound["max"], (gen, bound)


@pytest.mark.gpu
def test_cuda_graphs_match_eager(engines):
    _selected("llama")
    eager = engines("CUSTOM")
    graphs = engines("CUSTOM", graphs=True, workloads=("logprobs", "long"))
    assert "FULL" in graphs["cudagraph_mode"], graphs["cudagraph_mode"]
    assert graphs["plan_counts"]["decode"] > 0 and graphs["plan_counts"]["prefill"] > 0
    bound = _bound(_noise(engines)["logprobs"])
    got = _stats(_logprob_diffs(eager["logprobs"], graphs["logprobs"]))
    gen, compared, total = _generation_diffs(eager["logprobs"], graphs["logprobs"])
    _write("cuda_graphs", {"cudagraph_mode": graphs["cudagraph_mode"], "bound": bound, "graphs_vs_eager": got,
                           "generation": {**_stats(gen), "compared": compared, "generated": total},
                           "plan_counts": graphs["plan_counts"]})
    assert got["max"] <= bound["max"] and got["mean"] <= bound["mean"], (got, bound)
    assert max(gen, default=0.0) <= bound["max"], (gen, bound)


@pytest.mark.gpu
def test_long_generation_no_errors_no_leak(engines):
    _selected("llama")
    run = engines("CUSTOM", graphs=True, workloads=("logprobs", "long"))
    long = run["long"]
    mem = long["memory"]
    growth = mem[-1]["allocated"] - mem[1]["allocated"]
    free_drop = mem[0]["free"] - mem[-1]["free"]
    _write("long_generation", {**long, "allocated_growth_round2_to_3": growth, "free_drop_round1_to_3": free_drop,
                               "plan_counts": run["plan_counts"]})
    assert long["max_steps_lower_bound"] >= 300
    assert growth <= 8 << 20, f"CUDA memory allocated grew by {growth} bytes between identical rounds"
    assert free_drop <= 128 << 20, f"free GPU memory dropped by {free_drop} bytes over the rounds"


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("FI_VLLM_TEST_VARIANTS", "1") == "0", reason="FI_VLLM_TEST_VARIANTS=0")
def test_sliding_window_matches_flash_attn(engines):
    """Layers alternate sliding (64-token window) and full attention: two KV-cache groups, two builders,
    the window variant. Same bound as the Llama test (same shapes and weight scale)."""
    _selected("window")
    fa, custom = engines("FLASH_ATTN", kind="window")["logprobs"], engines("CUSTOM", kind="window")["logprobs"]
    bound = _bound(_noise(engines)["logprobs"])
    got = _stats(_logprob_diffs(fa, custom))
    gen, compared, total = _generation_diffs(fa, custom)
    _write("sliding_window", {"window": WINDOW, "bound": bound, "custom_vs_fa": got,
                              "generation": {**_stats(gen), "compared": compared, "generated": total}})
    assert got["max"] <= bound["max"] and got["mean"] <= bound["mean"], (got, bound)
    assert max(gen, default=0.0) <= bound["max"], (gen, bound)


def _check_layers(kind: str, config: dict, layers: dict) -> dict:
    """What vLLM handed fi-backend's layers must be the model's: heads, head size, scale, windows, soft-cap."""
    assert layers, "found no attention layers in the CUSTOM engine's model"
    assert all(r["impl"].startswith("fi_backend.") for r in layers.values()), {r["impl"] for r in layers.values()}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    scale = config.get("query_pre_attn_scalar", head_dim) ** -0.5
    max_len = workload_options(config)["max_model_len"]
    window = _window(config)
    if window is not None and window >= max_len:
        window = None
    if config.get("layer_types"):
        want_windows = {window if t == "sliding_attention" else None for t in config["layer_types"]}
    else:
        want_windows = {window}
    got_windows = {w if w and w < max_len else None for w in (r["sliding_window"] for r in layers.values())}
    softcap = config.get("attn_logit_softcapping") or None
    got = {"layers": len(layers), "num_heads": {r["num_heads"] for r in layers.values()},
           "num_kv_heads": {r["num_kv_heads"] for r in layers.values()},
           "head_size": {r["head_size"] for r in layers.values()}, "windows": got_windows,
           "soft_cap": {r["logits_soft_cap"] or None for r in layers.values()},
           "scale": {round(r["scale"], 6) for r in layers.values()}}
    want = {"layers": config["num_hidden_layers"], "num_heads": {config["num_attention_heads"]},
            "num_kv_heads": {config["num_key_value_heads"]}, "head_size": {head_dim}, "windows": want_windows,
            "soft_cap": {softcap}, "scale": {round(scale, 6)}}
    assert got == want, f"{kind}: vLLM built attention layers {got}, the config says {want}"
    return {k: sorted(v, key=str) if isinstance(v, set) else v for k, v in got.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(SHAPES))
def test_model_shapes_match_flash_attn(engines, kind):
    """Another model's shapes (SHAPES; module docstring): CUSTOM within 2x this model's own TRITON_ATTN vs
    FLASH_ATTN distance (plus the floor) of FLASH_ATTN, all three eager."""
    _selected(kind)
    fa = engines("FLASH_ATTN", kind=kind)
    noise = _noise(engines, kind)
    custom = engines("CUSTOM", kind=kind)
    config = custom["model"]
    layers = _check_layers(kind, config, custom["attention"])
    bound = _bound(noise["logprobs"])
    got = _stats(_logprob_diffs(fa["logprobs"], custom["logprobs"]))
    gen, compared, total = _generation_diffs(fa["logprobs"], custom["logprobs"])
    values = [x for lp in fa["logprobs"]["prompt_logprobs"] for x in lp]
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
    cached = custom["logprobs"]["prefix_hit_cached_tokens"]
    _write(f"model_shapes_{kind}", {
        "kind": kind, "config_file": SHAPES[kind][0], "real_variants": REAL_VARIANTS, "layers": LAYERS,
        "sliding_window": _window(config), "attn_logit_softcapping": config.get("attn_logit_softcapping"),
        "workload_options": custom["workload_options"], "attention_layers": layers,
        "noise_triton_vs_fa": noise, "bound": bound, "custom_vs_fa": got,
        "generation": {**_stats(gen), "compared": compared, "generated": total},
        "fa_prompt_logprob_std": spread, "cached_tokens": cached, "plan_counts": custom["plan_counts"],
        "engine_start_s": {b: r.get("engine_start_s") for b, r in
                           (("FLASH_ATTN", fa), ("TRITON_ATTN", engines("TRITON_ATTN", kind=kind)), ("CUSTOM", custom))}})
    counts = custom["plan_counts"]
    assert counts["prefill"] > 0 and counts["decode"] > 0, counts
    # the KV pages FLASH_ATTN gets (vLLM gives sliding-window layers a backend's smallest listed block)
    assert custom["engine_config"]["block_size"] == fa["engine_config"]["block_size"], (
        custom["engine_config"]["block_size"], fa["engine_config"]["block_size"])
    # as in the Llama test: the second prompt step on the CuTe member, the alone prompt on the fresh wrapper
    assert counts.get("cute", 0) > 0 or not cute_member_expected(), counts
    assert counts.get("fresh", 0) > 0 or not fresh_expected(), counts
    if _window(config) is None:   # sliding-window layers may keep less of a prefix in the cache
        assert min(cached) >= 16, f"the prefix-cache prompts did not hit the cache: {cached}"
    assert spread > 0.5, "degenerate model: prompt logprobs too uniform to tell attention apart"
    assert got["max"] <= bound["max"] and got["mean"] <= bound["mean"], (got, bound)
    assert max(gen, default=0.0) <= bound["max"], (gen, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(ENCODER_KINDS))
def test_encoder_only_embeddings_match_flash_attn(engines, kind):
    """An encoder-only model (BERT-base's shapes: 12 heads of 64, bidirectional attention over each prompt, no KV
    cache), eager, pooling runner: CUSTOM's embeddings within 2x this model's TRITON_ATTN vs FLASH_ATTN distance
    (plus the floor) of FLASH_ATTN's, entries over their vector's RMS. fi-backend planned encoder-only steps only,
    the 100-token prompts' step on the CuTe member and the rest on the tile family where the member runs here."""
    _selected(kind)
    fa, triton, custom = (engines(b, kind=kind, workloads=("embed",)) for b in ("FLASH_ATTN", "TRITON_ATTN", "CUSTOM"))
    noise = _stats(embedding_diffs(fa["embed"], triton["embed"]))
    bound = _bound(noise)
    got = _stats(embedding_diffs(fa["embed"], custom["embed"]))
    # how far apart different prompts' embeddings are, by the same measure (each against the next prompt's)
    vecs = fa["embed"]["embeddings"]
    spread = _stats(embedding_diffs({"embeddings": vecs[:-1]}, {"embeddings": vecs[1:]}))
    counts = custom["plan_counts"]
    _write(f"encoder_only_{kind}", {"kind": kind, "config_file": ENCODER_KINDS[kind], "layers": LAYERS,
                                    "prompt_lens": fa["embed"]["prompt_lens"], "noise_triton_vs_fa": noise,
                                    "bound": bound, "custom_vs_fa": got, "fa_prompt_spread": spread,
                                    "attention_layers": custom["attention"], "plan_counts": counts})
    assert counts["encoder_only"] > 0 and counts["decode"] == 0, counts
    if cute_member_expected():   # the 100-token prompts' step on the member, the others on the tile family
        assert 0 < counts["cute"] < counts["encoder_only"], counts
    # dummy weights make embeddings alike (BERT's CLS, about 0.999 cosine): the bound must still tell prompts apart
    assert spread["mean"] >= 5 * bound["mean"], ("prompts' embeddings too alike to test attention", spread, bound)
    assert got["max"] <= bound["max"] and got["mean"] <= bound["mean"], (got, bound)


@pytest.mark.gpu
def test_tensor_parallel_matches_flash_attn(engines):
    """Llama-3.1-70B's shapes at tensor_parallel_size 2 (module docstring), CUDA graphs on: each rank was handed
    32 query / 4 KV heads, planned its own steps and met no kernel error; CUSTOM within 2x the TRITON_ATTN vs
    FLASH_ATTN distance (plus the floor) of FLASH_ATTN, all three with graphs."""
    _selected("llama70b_tp2")
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"tensor parallelism over 2 GPUs needs 2, this machine has {torch.cuda.device_count()}")
    kind = "llama70b_tp2"
    config, tp = TP_KINDS[kind]
    fa = engines("FLASH_ATTN", graphs=True, kind=kind)
    triton = engines("TRITON_ATTN", graphs=True, kind=kind)
    custom = engines("CUSTOM", graphs=True, kind=kind)
    assert "FULL" in custom["cudagraph_mode"], custom["cudagraph_mode"]
    per_rank = custom["attention_per_rank"]
    assert len(per_rank) == tp
    heads = [{(r["num_heads"], r["num_kv_heads"], r["head_size"]) for r in layers.values()} for layers in per_rank]
    want = {(config["num_attention_heads"] // tp, config["num_key_value_heads"] // tp, 128)}
    assert heads == [want] * tp, f"each rank's attention layers: {heads}, expected {want}"
    assert all(r["impl"].startswith("fi_backend.") for layers in per_rank for r in layers.values())
    ranks = custom["fi_backend_per_rank"]
    assert len(ranks) == tp and all(r["plan_counts"]["decode"] > 0 and r["plan_counts"]["prefill"] > 0 for r in ranks)
    assert sorted(r["device"] for r in ranks) == [str(i) for i in range(tp)], ranks   # one rank per GPU
    noise = _stats(_logprob_diffs(fa["logprobs"], triton["logprobs"]))
    bound = _bound(noise)
    got = _stats(_logprob_diffs(fa["logprobs"], custom["logprobs"]))
    gen, compared, total = _generation_diffs(fa["logprobs"], custom["logprobs"])
    values = [x for lp in fa["logprobs"]["prompt_logprobs"] for x in lp]
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
    _write("tensor_parallel_llama70b_tp2", {
        "kind": kind, "tensor_parallel_size": tp, "layers": LAYERS, "heads_per_rank": sorted(want),
        "noise_triton_vs_fa": noise, "bound": bound, "custom_vs_fa": got,
        "generation": {**_stats(gen), "compared": compared, "generated": total}, "fa_prompt_logprob_std": spread,
        "cached_tokens": custom["logprobs"]["prefix_hit_cached_tokens"], "fi_backend_per_rank": ranks,
        "engine_start_s": {"FLASH_ATTN": fa["engine_start_s"], "TRITON_ATTN": triton["engine_start_s"],
                           "CUSTOM": custom["engine_start_s"]},
        "wall_s": {"FLASH_ATTN": fa["wall_s"], "TRITON_ATTN": triton["wall_s"], "CUSTOM": custom["wall_s"]}})
    assert min(custom["logprobs"]["prefix_hit_cached_tokens"]) >= 16, "the prefix-cache prompts did not hit the cache"
    assert spread > 0.5, "degenerate model: prompt logprobs too uniform to tell attention apart"
    assert got["max"] <= bound["max"] and got["mean"] <= bound["mean"], (got, bound)
    assert max(gen, default=0.0) <= bound["max"], (gen, bound)


@pytest.mark.gpu
def test_shared_prefix_groups_match_flash_attn(shared_engines):
    """Issue 28 in vLLM (module docstring): parallel copies and a shared system prompt with fi-backend's shared-prefix
    groups, found in the opt-in worker's host block table, within 2x this workload's TRITON_ATTN vs FLASH_ATTN
    distance (plus the floor) of FLASH_ATTN, CUDA graphs on; grouped steps planned in decode (graph_prefill, inside
    the FULL decode graphs) and in extend; with FI_BACKEND_SHARED_PREFIX=0 none, and the two within the same bound."""
    _selected("shared")
    fa, triton = shared_engines("shared_flash_attn"), shared_engines("shared_triton_attn")
    run = shared_engines("shared_custom")
    off = optional(shared_engines, "shared_custom_off")
    noise = _stats(_logprob_diffs(fa["shared"], triton["shared"]) + _generation_diffs(fa["shared"], triton["shared"])[0])
    bound = _bound(noise)
    got = _stats(_logprob_diffs(fa["shared"], run["shared"]))
    gen, compared, total = _generation_diffs(fa["shared"], run["shared"])
    record = {"bound": bound, "noise_triton_vs_fa": noise, "custom_vs_fa": got,
              "generation": {**_stats(gen), "compared": compared, "generated": total},
              "plan_counts": run["plan_counts"], "model_runner": run["model_runner"],
              "engine_config": run["engine_config"], "cudagraph_mode": run["cudagraph_mode"],
              "cached_tokens": run["shared"]["prefix_hit_cached_tokens"]}
    if "shared" in off:
        off_gen, off_compared, _ = _generation_diffs(off["shared"], run["shared"])
        record.update(groups_on_vs_off=_stats(_logprob_diffs(off["shared"], run["shared"])),
                      groups_on_vs_off_generation={**_stats(off_gen), "compared": off_compared},
                      plan_counts_off=off["plan_counts"])
    else:
        record["groups_off"] = off
    _write("shared_prefix", record)
    assert run["engine_config"]["use_v2_model_runner"], "the worker's host tables are for vLLM's V2 model runner"
    assert run["worker_cls"] == WORKER_CLS and all("FiHostTableModelRunner" in r for r in run["model_runner"]), (
        run["worker_cls"], run["model_runner"])
    assert "FULL" in run["cudagraph_mode"], run["cudagraph_mode"]
    has_off = "shared" in off
    check_shared_prefix(run["plan_counts"], run["shared"], got, gen, bound, SHARED_SYSTEM_TOKENS,
                        off["plan_counts"] if has_off else None, record.get("groups_on_vs_off"))
    if has_off:
        assert max(off_gen, default=0.0) <= bound["max"], (off_gen, bound)


def _det_summary(record: dict) -> dict:
    """An engine's det record, compared (compare.det_report), with what the engine was set to."""
    if "det" not in record:
        return {k: record[k] for k in ("error", "refused") if k in record}
    keys = ("backend", "engine_config", "cudagraph_mode", "plan_counts", "fi_backend_deterministic",
            "fi_backend_warned_unordered", "log_unordered_warning", "engine_start_s", "det_s", "wall_s")
    return {**{k: record.get(k) for k in keys}, **det_report(record["det"])}


def _det_reports(det_engines) -> tuple:
    det = _det_summary(det_engines("deterministic_custom_det"))
    normal = _det_summary(det_engines("deterministic_custom_nodet"))
    reference = _det_summary(optional(det_engines, "deterministic_flash_attn_det"))
    return det, normal, reference


@pytest.mark.gpu
def test_batch_invariant_alone_vs_busy(det_engines):
    """Issue 31's engine bar: VLLM_BATCH_INVARIANT=1, CUSTOM, CUDA graphs and prefix caching on: each target's
    prompt logprobs and generated tokens' logprobs bit-identical alone and in every busy batch (module
    docstring). The normal mode (same engine settings, no VLLM_BATCH_INVARIANT) is recorded and expected to
    differ somewhere, so that the test can fail; where it does not, the record and a warning say so."""
    import warnings
    _selected("deterministic")
    det, normal, reference = _det_reports(det_engines)
    normal_differs = normal["alone_vs_busy"]["differing"] > 0
    _write("batch_invariant", {
        "bar": "VLLM_BATCH_INVARIANT=1: identical logprobs for the same prompt served alone and inside a busy batch",
        "layers": LAYERS, "target_lens": sorted({r["target_len"] for r in det["runs"]}),
        "det_alone_vs_busy": det["alone_vs_busy"], "normal_alone_vs_busy": normal["alone_vs_busy"],
        "normal_mode_differs": normal_differs,
        "flash_attn_det_alone_vs_busy": reference.get("alone_vs_busy", reference),
        "custom_det": det, "custom_normal": normal, "flash_attn_det": reference})
    assert det["engine_config"]["VLLM_BATCH_INVARIANT"] and det["fi_backend_deterministic"] == [True], det
    assert not normal["engine_config"]["VLLM_BATCH_INVARIANT"] and normal["fi_backend_deterministic"] == [False]
    assert "FULL" in det["cudagraph_mode"], det["cudagraph_mode"]
    assert det["plan_counts"]["decode"] > 0 and det["plan_counts"]["prefill"] > 0, det["plan_counts"]
    assert det["alone_vs_busy"]["gen_positions"] > 0 and det["alone_vs_busy"]["prompt_positions"] > 0
    got = det["alone_vs_busy"]
    assert got["differing"] == 0, (
        f"VLLM_BATCH_INVARIANT=1: {got['differing']} of {got['positions']} positions differ alone vs busy (max "
        f"|diff| {got['max_abs']:.3g}) in {got['runs_differing']} of {got['runs']} runs, first: "
        f"{[(r['batch'], r['target_len'], r['flavor'], r['first_differing']) for r in det['runs'] if r['differing']][:6]}"
        f"; vLLM's FLASH_ATTN in the same mode: {reference.get('alone_vs_busy', reference)}")
    assert det["alone_vs_alone_again"]["differing"] == 0, det["alone_vs_alone_again"]
    if not normal_differs:
        warnings.warn("the normal mode gave identical logprobs alone and busy too on this workload: the bar's "
                      "test did not show that it can fail (recorded in vllm_batch_invariant.json)")


@pytest.mark.gpu
def test_batch_invariant_cached_prefix_matches_whole(det_engines):
    """VLLM_BATCH_INVARIANT=1 with prefix caching on: a target whose prompt came from the prefix cache (all but
    its last 12 tokens for 300 and 1500) generates the same tokens with the same logprobs, bit for bit, as the
    same prompt computed whole (the prompt-logprob request, which never reads the cache)."""
    _selected("deterministic")
    det, normal, _ = _det_reports(det_engines)
    _write("batch_invariant_cached_prefix", {"enable_prefix_caching": det["engine_config"]["enable_prefix_caching"],
                                             "det": det["cached_vs_whole"], "normal": normal["cached_vs_whole"]})
    if not det["engine_config"]["enable_prefix_caching"]:
        pytest.skip("vLLM turned prefix caching off in batch-invariant mode (recorded)")
    assert min(det["cached_vs_whole"]["cached_tokens"][1:]) > 0, det["cached_vs_whole"]["cached_tokens"]
    got = det["cached_vs_whole"]
    assert got["differing"] == 0, got


@pytest.mark.gpu
def test_speculative_decoding_matches_flash_attn(engines):
    """Speculative decoding with a draft model (kind spec, module docstring): CUSTOM's greedy generations against
    FLASH_ATTN's within twice TRITON_ATTN's distance plus the floor, up to the first differing token (a near-tie);
    drafts were proposed (vLLM's counters) and fi-backend planned prefill steps (the verify batches)."""
    _selected("spec")
    fa, triton, custom = (engines(b, graphs=True, kind="spec", workloads=("spec",))
                          for b in ("FLASH_ATTN", "TRITON_ATTN", "CUSTOM"))
    noise_diffs, _, _ = _generation_diffs(fa["spec"], triton["spec"], near_tie=False)
    bound = _bound(_stats(noise_diffs))
    got, compared, total = _generation_diffs(fa["spec"], custom["spec"])
    drafts = {k: v for k, v in custom["spec"]["spec_counters"].items() if "draft" in k}
    _write("speculative_decoding", {"spec_tokens": SPEC_TOKENS, "bound": bound, "noise_triton_vs_fa": _stats(noise_diffs),
                                    "custom_vs_fa": {**_stats(got), "compared": compared, "generated": total},
                                    "spec_counters": custom["spec"]["spec_counters"],
                                    "plan_counts": custom["plan_counts"], "cudagraph_mode": custom["cudagraph_mode"]})
    assert any(isinstance(v, (int, float)) and v > 0 for v in drafts.values()), ("no drafts proposed", drafts)
    assert custom["plan_counts"]["prefill"] > 0, custom["plan_counts"]
    assert compared >= total // 4, f"only {compared} of {total} generated tokens compared before a divergence"
    assert max(got, default=0.0) <= bound["max"], (got, bound)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one vLLM engine run (used by the tests above)")
    parser.add_argument("--engine", choices=sorted(DET_ENGINES) + sorted(SHARED_ENGINES),
                        help="run one engine of DET_ENGINES or SHARED_ENGINES in its own process and write its record")
    parser.add_argument("--backend")
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("--workloads", default="logprobs")
    parser.add_argument("--graphs", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--worker-cls", help="vLLM's worker_cls (the shared kind: fi-backend's opt-in worker)")
    a = parser.parse_args()
    if a.engine in SHARED_ENGINES:
        rec = run_shared_engine(a.engine)
        print(json.dumps({k: rec.get(k) for k in ("backend", "worker_cls", "model_runner", "cudagraph_mode",
                                                  "plan_counts", "engine_start_s", "shared_s", "wall_s")}, indent=1))
    elif a.engine:
        rec = run_det_engine(a.engine)
        print(json.dumps(_det_summary(rec) if "det" in rec else rec, indent=1)[:4000])
    else:
        if not (a.backend and a.model and a.out):
            parser.error("--backend, --model and --out (or --engine)")
        run_engine(a.backend, a.graphs, a.model, a.workloads.split(","), a.out, a.tp, a.worker_cls)

