"""The model zoo: the attention-relevant configuration of real models, and whether fi-backend runs them.

Each entry is what the attention kernels see of a model: query / KV heads, head size, layers, which layers
have a sliding window and how wide, attention-logit soft-capping, the softmax scale where it is not
1/sqrt(head_dim), RoPE scaling (applied by the engine before attention; listed for reference) and the kind of
attention. The numbers are those of each model's HF config.json (`hf_id` names the checkpoint); a model
whose layers mix windowed and global attention lists the repeating pattern of its layers.

    check(model)        (ok, reason): whether fi-backend's kernels take the model's attention
    variants_of(model)  the variants the vLLM adapter runs the model's layers with
    modules_of(model)   every decode and prefill kernel module the model needs (for ahead-of-time builds;
                        deterministic=True adds the decode modules of deterministic mode)
    from_hf_config(d)   a Model from a HF config.json dict (for models not in the zoo)
    find(name)          a zoo model by name or HF id, case-insensitive
    tp_slice(model, tp) what one rank of tensor parallelism over `tp` GPUs runs (ValueError if heads do not divide)
    tp_slices()         the TP-sliced configurations of the zoo's large models (TP_MODELS x TP_DEGREES)

`fi-backend models [--tp N]` prints the zoo (or each model's rank at TP N) as a table; `fi-backend build
--model NAME|config.json [--tp N]` builds a model's (or one rank's) modules ahead of time.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Model", "ZOO", "find", "check", "variants_of", "modules_of", "from_hf_config", "TP_DEGREES", "TP_MODELS",
           "tp_heads", "tp_slice", "tp_slices"]


@dataclass(frozen=True)
class Model:
    """A model's attention configuration (the fields of its HF config.json that attention depends on).

    head_dim        the query/key head size (for MLA: qk_nope_head_dim + qk_rope_head_dim)
    sliding_window  tokens a query attends to, itself included (HF's and vLLM's meaning), or None
    window_pattern  which layers have the window: layer i is windowed iff window_pattern[i % len]; (True,)
                    is every layer, (True, False) the even ones; a config's per-layer list is its own pattern
    sm_scale        softmax scale where it is not 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar ** -0.5)
    rope_scaling    "<type> x<factor>" of the config's rope_scaling, or None
    mla             MLA's dimensions (kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim), or None
    tp              tensor-parallel degree: 1 for a whole model, N for what one of N ranks runs (tp_slice)
    """

    name: str
    hf_id: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    sliding_window: Optional[int] = None
    window_pattern: Tuple[bool, ...] = (True,)
    attn_logit_softcapping: Optional[float] = None
    rope_scaling: Optional[str] = None
    sm_scale: Optional[float] = None
    mla: Optional[Dict[str, int]] = field(default=None, hash=False)
    note: str = ""
    tp: int = 1

    @property
    def group(self) -> float:
        """Query heads per KV head (not a whole number for a malformed config)."""
        q, kv = self.num_qo_heads, self.num_kv_heads
        return q // kv if kv and q % kv == 0 else (q / kv if kv else 0)

    @property
    def kind(self) -> str:
        """"mla", "mha" (a KV head per query head), "mqa" (one KV head) or "gqa"."""
        if self.mla:
            return "mla"
        if self.num_kv_heads == self.num_qo_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    def is_windowed(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) attends through the sliding window."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"{self.name} has layers 0..{self.num_layers - 1}, not {layer}")
        return self.sliding_window is not None and self.window_pattern[layer % len(self.window_pattern)]

    def windowed_layers(self) -> List[int]:
        return [i for i in range(self.num_layers) if self.is_windowed(i)]

    @property
    def window_layers(self) -> str:
        """Which layers are windowed, in words: "all", "none", "alternate (even layers local)", "5 local : 1 global"..."""
        local = self.windowed_layers()
        n = self.num_layers
        if not local:
            return "none"
        if len(local) == n:
            return "all"
        pattern = tuple(self.window_pattern)
        if pattern == (True, False):
            return "alternate (even layers local)"
        if pattern == (False, True):
            return "alternate (odd layers local)"
        if len(pattern) > 1 and all(pattern[:-1]) and not pattern[-1]:
            return f"{len(pattern) - 1} local : 1 global"
        if local == list(range(local[0], local[-1] + 1)):
            return f"layers {local[0]}-{local[-1]}"
        return f"{len(local)} of {n} layers"


_GEMMA3 = (True,) * 5 + (False,)   # layer_types: global where (i + 1) % sliding_window_pattern (6) == 0
_ALT = (True, False)               # Gemma-2: even layers local (HF: not bool(layer_idx % 2))

# Source: each model's HF config.json (hf_id); head_dim = hidden_size // num_attention_heads where the
# config has no head_dim. Qwen2.5's configs carry sliding_window but use_sliding_window false: no window.
ZOO: Tuple[Model, ...] = (
    Model("Llama-3.1-8B", "meta-llama/Llama-3.1-8B", 32, 8, 128, 32, rope_scaling="llama3 x8"),
    Model("Llama-3.1-70B", "meta-llama/Llama-3.1-70B", 64, 8, 128, 80, rope_scaling="llama3 x8"),
    Model("Llama-3.1-405B", "meta-llama/Llama-3.1-405B", 128, 8, 128, 126, rope_scaling="llama3 x8"),
    Model("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", 32, 8, 64, 16, rope_scaling="llama3 x32"),
    Model("Llama-3.2-3B", "meta-llama/Llama-3.2-3B", 24, 8, 128, 28, rope_scaling="llama3 x32"),
    Model("Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", 14, 2, 64, 24),
    Model("Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B", 12, 2, 128, 28),
    Model("Qwen2.5-3B", "Qwen/Qwen2.5-3B", 16, 2, 128, 36),
    Model("Qwen2.5-7B", "Qwen/Qwen2.5-7B", 28, 4, 128, 28),
    Model("Qwen2.5-14B", "Qwen/Qwen2.5-14B", 40, 8, 128, 48),
    Model("Qwen2.5-32B", "Qwen/Qwen2.5-32B", 40, 8, 128, 64),
    Model("Qwen2.5-72B", "Qwen/Qwen2.5-72B", 64, 8, 128, 80),
    Model("Qwen3-0.6B", "Qwen/Qwen3-0.6B", 16, 8, 128, 28),
    Model("Qwen3-1.7B", "Qwen/Qwen3-1.7B", 16, 8, 128, 28),
    Model("Qwen3-4B", "Qwen/Qwen3-4B", 32, 8, 128, 36),
    Model("Qwen3-8B", "Qwen/Qwen3-8B", 32, 8, 128, 36),
    Model("Qwen3-14B", "Qwen/Qwen3-14B", 40, 8, 128, 40),
    Model("Qwen3-32B", "Qwen/Qwen3-32B", 64, 8, 128, 64),
    Model("Mistral-7B", "mistralai/Mistral-7B-v0.1", 32, 8, 128, 32, sliding_window=4096,
         note="v0.1 (sliding_window 4096); v0.2 / v0.3 have no window"),
    Model("Mistral-Nemo-12B", "mistralai/Mistral-Nemo-Base-2407", 32, 8, 128, 40,
         note="head_dim 128 with hidden_size 5120 (not 5120 / 32)"),
    Model("Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1", 32, 8, 128, 32),
    Model("Gemma-2-2B", "google/gemma-2-2b", 8, 4, 256, 26, sliding_window=4096, window_pattern=_ALT,
         attn_logit_softcapping=50.0),
    Model("Gemma-2-9B", "google/gemma-2-9b", 16, 8, 256, 42, sliding_window=4096, window_pattern=_ALT,
         attn_logit_softcapping=50.0),
    Model("Gemma-2-27B", "google/gemma-2-27b", 32, 16, 128, 46, sliding_window=4096, window_pattern=_ALT,
         attn_logit_softcapping=50.0, sm_scale=144 ** -0.5, note="query_pre_attn_scalar 144"),
    Model("Gemma-3-1B", "google/gemma-3-1b-pt", 4, 1, 256, 26, sliding_window=512, window_pattern=_GEMMA3),
    Model("Gemma-3-4B", "google/gemma-3-4b-pt", 8, 4, 256, 34, sliding_window=1024, window_pattern=_GEMMA3,
         rope_scaling="linear x8"),
    Model("Gemma-3-12B", "google/gemma-3-12b-pt", 16, 8, 256, 48, sliding_window=1024, window_pattern=_GEMMA3,
         rope_scaling="linear x8"),
    Model("Gemma-3-27B", "google/gemma-3-27b-pt", 32, 16, 128, 62, sliding_window=1024, window_pattern=_GEMMA3,
         rope_scaling="linear x8", sm_scale=168 ** -0.5, note="query_pre_attn_scalar 168"),
    Model("Phi-3-mini", "microsoft/Phi-3-mini-4k-instruct", 32, 32, 96, 32, sliding_window=2047),
    Model("Phi-3-medium", "microsoft/Phi-3-medium-4k-instruct", 40, 10, 128, 40, sliding_window=2047),
    Model("Phi-4", "microsoft/phi-4", 40, 10, 128, 40),
    Model("Yi-1.5-34B", "01-ai/Yi-1.5-34B", 56, 8, 128, 60),
    Model("StarCoder2-15B", "bigcode/starcoder2-15b", 48, 4, 128, 40, sliding_window=4096),
    Model("Command-R", "CohereForAI/c4ai-command-r-v01", 64, 64, 128, 40),
    Model("DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite", 16, 16, 192, 27, rope_scaling="yarn x40",
         mla={"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}),
)


# ------------------------------------------------------------------------------------ tensor parallelism

TP_DEGREES: Tuple[int, ...] = (2, 4, 8)
# The zoo's models of 12B parameters and more: those served with tensor parallelism in practice.
TP_MODELS: Tuple[str, ...] = (
    "Llama-3.1-70B", "Llama-3.1-405B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen2.5-72B", "Qwen3-14B", "Qwen3-32B",
    "Mistral-Nemo-12B", "Mixtral-8x7B", "Gemma-2-27B", "Gemma-3-12B", "Gemma-3-27B", "Phi-3-medium", "Phi-4",
    "Yi-1.5-34B", "StarCoder2-15B", "Command-R",
)


def tp_heads(num_qo_heads: int, num_kv_heads: int, tp: int) -> Tuple[int, int]:
    """(query heads, KV heads) of one rank when vLLM or SGLang split attention over `tp` ranks: query heads
    divided evenly, KV heads divided evenly while there are at least `tp` of them, else each replicated over
    tp // num_kv_heads ranks (one per rank: max(1, num_kv_heads // tp)). ValueError, naming the counts and the
    degrees that work, where the engines refuse the split."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive whole number of GPUs, got {tp!r}")
    q, kv = num_qo_heads, num_kv_heads

    def splits(t):
        return q % t == 0 and (kv % t == 0 if kv >= t else t % kv == 0)

    if not splits(tp):
        ok = [t for t in (1, 2, 4, 8, 16) if splits(t)]
        why = (f"{q} query heads do not divide by {tp}" if q % tp else
               f"{kv} KV heads do not divide by {tp}" if kv >= tp else
               f"{tp} ranks do not divide into copies of {kv} KV heads")
        raise ValueError(f"tensor parallelism over {tp} GPUs cannot split {q} query / {kv} KV heads: {why} "
                         f"(degrees that split them: {', '.join(map(str, ok))})")
    return q // tp, max(1, kv // tp)


def tp_slice(model: Model, tp: int) -> Model:
    """What one rank of `model` under tensor parallelism over `tp` GPUs runs: its heads per tp_heads, every
    other field the model's; named "<name> TP<tp>" (tp 1: the model itself). ValueError naming the model if the
    heads do not split; an MLA model is sliced by heads too (check() still refuses it)."""
    if tp == 1:
        return model
    if model.tp != 1:
        raise ValueError(f"{model.name} is already one rank of TP {model.tp}; slice the whole model")
    try:
        q, kv = tp_heads(model.num_qo_heads, model.num_kv_heads, tp)
    except ValueError as e:
        raise ValueError(f"{model.name}: {e}") from None
    return replace(model, name=f"{model.name} TP{tp}", num_qo_heads=q, num_kv_heads=kv, tp=tp)


def tp_slices(names: Sequence[str] = TP_MODELS, degrees: Sequence[int] = TP_DEGREES) -> List[Model]:
    """Every rank configuration of the named zoo models at the given degrees where the heads split (the rest
    are skipped: tp_slice says why)."""
    out = []
    for name in names:
        model = find(name)
        for tp in degrees:
            try:
                out.append(tp_slice(model, tp))
            except ValueError:
                continue
    return out


def find(name: str) -> Model:
    """The zoo model named `name` or with HF id `name`, case-insensitive (KeyError if none)."""
    key = name.strip().lower()
    for m in ZOO:
        if key in (m.name.lower(), m.hf_id.lower()):
            return m
    raise KeyError(f"no model {name!r} in the zoo (`fi-backend models` lists them)")


def check(model: Model) -> Tuple[bool, str]:
    """(True, "") if fi-backend's kernels run the model's attention, else (False, why not)."""
    if model.mla:
        return False, (f"multi-head latent attention (MLA) has a compressed KV cache of rank "
                       f"{model.mla.get('kv_lora_rank')} plus a {model.mla.get('qk_rope_head_dim')}-dim RoPE key: "
                       "fi-backend runs MHA/GQA/MQA KV caches only")
    q, kv = model.num_qo_heads, model.num_kv_heads
    if q < 1 or kv < 1 or q % kv:
        return False, f"{q} query heads do not split evenly over {kv} KV heads"
    from fi_backend import wrappers   # read at call time: the supported head sizes grow
    if model.head_dim not in wrappers.HEAD_DIMS:
        return False, (f"head_dim {model.head_dim} is not supported (fi-backend: "
                       f"{', '.join(map(str, wrappers.HEAD_DIMS))})")
    if model.sliding_window is not None and model.sliding_window < 1:
        return False, f"sliding_window must be >= 1 tokens, got {model.sliding_window}"
    return True, ""


def variants_of(model: Model) -> list:
    """The fi_backend.variants Variants the vLLM adapter runs the model's layers with (adapters.vllm.layer_variant,
    the one source of them): one per distinct layer kind, global layers' first; a model with windowed and
    global layers needs both."""
    from fi_backend.adapters.vllm import layer_variant
    kinds = sorted({model.is_windowed(i) for i in range(model.num_layers)})   # False (global) first
    out = []
    for windowed in kinds:
        v, _ = layer_variant(None, model.sliding_window if windowed else None, model.attn_logit_softcapping)
        if v not in out:
            out.append(v)
    return out


def modules_of(model: Model, kv_dtypes: Sequence[str] = ("bf16", "fp8_e4m3"), q_dtype: str = "bf16",
               deterministic: bool = False, page_sizes: Sequence[int] = (16,), ragged: bool = True) -> list:
    """Every decode and prefill kernel module (kernels.ModuleSpec) the model needs, for each variant of
    variants_of(model) and KV dtype ("auto": the query's), deduplicated; [] if check(model) refuses it.
    The prefill family's CuTe member's modules (fi_backend.cute_member, Hopper, where CUTLASS's headers are
    installed) for each of page_sizes (the engine's KV block size: vLLM's default 16), and with ragged its ragged
    modules too (both adapters' steps of new prompts, over their own K / V).
    deterministic: also the decode modules deterministic wrappers load (the adapters with FI_BACKEND_DETERMINISTIC,
    VLLM_BATCH_INVARIANT or SGLang's --enable-deterministic-inference; docs/deterministic.md).
    The prefill family depends on the architectures in effect ($FI_BACKEND_CUDA_ARCH_LIST): set it to
    the target's before calling. Errors for an accepted model propagate: they are bugs."""
    if not check(model)[0]:
        return []
    from fi_backend import cute_member
    from fi_backend.wrappers import attention_specs, decode_spec, prefill_family_size, prefill_spec
    d, group = model.head_dim, model.num_qo_heads // model.num_kv_heads
    specs, seen = [], set()

    def add(spec):
        if spec.memo_key not in seen:
            seen.add(spec.memo_key)
            specs.append(spec)

    for variant in variants_of(model):
        for kv in kv_dtypes:
            kv = q_dtype if kv == "auto" else kv
            if not kv.startswith("fp8") and kv != q_dtype:
                raise ValueError(f"KV dtype {kv} with query dtype {q_dtype}: the kernels read KV in the query's "
                                 "dtype or in fp8")
            for spec in attention_specs(variant, d, q_dtype, kv, group, kernel="decode"):
                add(spec)
            if deterministic:
                add(decode_spec(variant, d, q_dtype, kv, group, deterministic=True))
            for m in range(prefill_family_size(d, kv)):
                add(prefill_spec(variant, d, q_dtype, kv, group, member=m))
            for page in (*page_sizes, 0) if ragged else page_sizes:  # (0: ragged K / V)
                for spec in cute_member.specs_for(variant, d, q_dtype, kv, page):
                    add(spec)
    return specs


# ------------------------------------------------------------------------------------ HF config.json

def _period(flags: Sequence[bool]) -> Tuple[bool, ...]:
    """The shortest pattern that repeats into `flags` (a config's per-layer list, e.g. Gemma-3's 5 + 1)."""
    flags = tuple(bool(f) for f in flags)
    for p in range(1, len(flags) + 1):
        if all(flags[i] == flags[i % p] for i in range(len(flags))):
            return flags[:p]
    return flags or (True,)


def _rope(d: dict) -> Optional[str]:
    rs = d.get("rope_scaling")
    if not isinstance(rs, dict):
        params = d.get("rope_parameters")   # newer transformers; "default" is no scaling
        rs = params if isinstance(params, dict) and params.get("rope_type", "default") != "default" else None
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "scaled"
    kind = "longrope" if kind == "su" else kind
    factor = rs.get("factor")
    return f"{kind} x{factor:g}" if isinstance(factor, (int, float)) else kind


def from_hf_config(config: dict, name: Optional[str] = None) -> Model:
    """A Model from a HF config.json dict: num_attention_heads, num_key_value_heads (default: the heads),
    head_dim (default hidden_size // heads), num_hidden_layers, sliding_window (with Qwen2's
    use_sliding_window / max_window_layers, and the per-layer layer_types or Gemma's sliding_window_pattern;
    Gemma-2 configs without either alternate), attn_logit_softcapping, query_pre_attn_scalar, rope_scaling,
    kv_lora_rank (MLA). A multimodal config's text_config is read when the top level has no heads."""
    d = dict(config)
    if "num_attention_heads" not in d and isinstance(d.get("text_config"), dict):
        d = {**d, **d["text_config"]}
    try:
        heads = int(d["num_attention_heads"])
        layers = int(d["num_hidden_layers"])
    except KeyError as e:
        raise ValueError(f"config has no {e.args[0]}: not a decoder's HF config.json") from None
    kv = d.get("num_key_value_heads") or heads
    mla = None
    if d.get("kv_lora_rank"):
        mla = {k: int(d.get(k) or 0) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")}
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    else:
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
    head_dim = int(head_dim)

    window = d.get("sliding_window") or None
    if "use_sliding_window" in d and not d["use_sliding_window"]:
        window = None
    pattern: Tuple[bool, ...] = (True,)
    if window is not None:
        types = d.get("layer_types")
        if isinstance(types, (list, tuple)) and types:
            pattern = _period([t == "sliding_attention" for t in types[:layers]])
        elif isinstance(d.get("sliding_window_pattern"), int) and d["sliding_window_pattern"] > 1:
            p = d["sliding_window_pattern"]
            pattern = (True,) * (p - 1) + (False,)
        elif d.get("model_type") == "gemma2":
            pattern = _ALT
        elif "use_sliding_window" in d and d.get("max_window_layers") is not None:
            # Qwen2: the layers from max_window_layers on have the window
            pattern = _period([i >= d["max_window_layers"] for i in range(layers)])
        if not any(pattern):
            window = None
    if window is None:
        pattern = (True,)

    scalar = d.get("query_pre_attn_scalar")
    sm_scale = float(scalar) ** -0.5 if scalar and scalar != head_dim else None
    softcap = d.get("attn_logit_softcapping") or None
    name = name or d.get("_name_or_path") or d.get("model_type") or "model"
    return Model(name=name, hf_id=d.get("_name_or_path", ""), num_qo_heads=heads, num_kv_heads=int(kv),
                 head_dim=head_dim, num_layers=layers, sliding_window=int(window) if window else None,
                 window_pattern=pattern, attn_logit_softcapping=float(softcap) if softcap else None,
                 rope_scaling=_rope(d), sm_scale=sm_scale, mla=mla)
