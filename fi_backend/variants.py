"""Attention variants: short CUDA functors inserted at fixed hooks of the attention template.

DESIGN.md, idea 3. The online-softmax loops of csrc/attention/decode.cuh and prefill.cuh are fixed; a variant only says
what happens at its hooks, and the built-in variants below go through exactly the same mechanism as a
user's. A hook is the BODY of a C++ function (the signature is fixed by the hook):

    hook               signature of the body                                         returns
    query_transform    (params, float& x0, float& x1, int i, fi::RotaryCtx ctx)      -  (x0, x1 in place)
    key_transform      (params, float& x0, float& x1, int i, fi::RotaryCtx ctx)      -  (x0, x1 in place)
    logits_transform   (params, float logits, fi::LogitsCtx ctx)                     float
    logits_mask        (params, fi::LogitsCtx ctx)                                   bool (true = attend)
    output_transform   (params, float o, fi::OutputCtx ctx)                          float
    kv_range           (params, int q_pos_min, int q_pos_max, int& lo, int& hi)      -  (shrink [lo, hi))
    alibi_slope        (params, int qo_head)                                         float

* Query/KeyTransform see q (k) in fp32 as it is loaded, as pairs of dimensions: (d, d + D/2) with
  i = d < D/2 (HF "rotate_half" pairing), or (2i, 2i + 1) when rotary_interleave=True. ctx.pos is the
  position of the query (key), ctx.head its head. k is seen before the fp8 k_scale is applied.
* logits = q.k * sm_scale (* k_scale) in natural units; LogitsCtx has request, q_row, q_idx, q_pos,
  kv_idx, kv_pos, qo_head, kv_head, q_len, kv_len, and rel_pos = kv_pos - q_pos as a float (exact below
  2^24; cheaper than converting the ints per element), split as rel_pos = rel_row + rel_col: rel_row the
  same across a row's elements, rel_col a compile-time constant in the prefill kernel, so a hook linear in
  rel_pos costs one multiply-add an element written as fmaf(a, ctx.rel_col, logits + a * ctx.rel_row)
  (as the prefill kernel's per-element ALiBi does). Positions: query row r of request i is at
  kv_pos_start[i] + kv_len_i - q_len_i + (r - qo_indptr[i]); KV token t at kv_pos_start[i] + t.
* alibi_slope is a linear bias by relative position (ALiBi): logits += slope(qo_head) * rel_pos, after
  the logits_transform (as FlashAttention applies a soft-cap, then ALiBi) and before the mask; softmax
  attention only. It says what a logits_transform could say per element, in a form the prefill kernel
  folds into its tensor cores: on Hopper, without a logits_transform, the bias's column part rides the
  Q.K^T MMA (one more k step: slope / sm_scale against the step's column indices) and its row part the
  softmax's per-row offsets: no instruction per element, an eighth more Q.K^T tensor work (ALiBi then runs
  about 5% behind no bias, against 12% per element; perf/results/ab47_*.md). Several alibi_slope hooks
  add up. With it sm_scale must be nonzero.
* use_softmax=False: the output is sum_j p_j v_j with p_j = logits_transform(...) (0 where masked),
  unnormalised, and there is no LSE (sigmoid attention).
* kv_range is an optimisation: KV positions outside [lo, hi) must already be masked for every query
  position in [q_pos_min, q_pos_max]; tiles outside are then never loaded.
* mask_is_kv_range=True (a sliding window) says more: logits_mask is exactly "kv_pos in [lo, hi) of
  kv_range(q_pos, q_pos)" for the query's own position, and lo and hi never decrease as q_pos grows.
  The prefill kernel then runs the per-element mask only on steps that cross some row's range edge.
* params are the variant's extra kernel arguments, by name: `params.<name>`. Scalars: "float",
  "int" (int32). Tensors (device pointers): "float32[]", "float64[]", "int32[]", "int64[]", "uint8[]",
  "bfloat16[]", "float16[]". Values are passed to BatchAttention.plan(...) by the same names.

Combining: `combine(a, b, ...)` chains transforms in order, ANDs masks, intersects KV ranges and
merges params (the same name twice is an error), e.g. `combine(SOFT_CAP, SLIDING_WINDOW)`.

A user variant, FlashSigmoid-style, with a per-head bias tensor:

    from fi_backend.variants import Variant
    sigmoid_per_head = Variant(
        "sigmoid_per_head",
        use_softmax=False,
        params={"scale": "float", "bias": "float32[]"},
        logits_transform="return 1.f / (1.f + __expf(-(logits * params.scale + params.bias[ctx.qo_head])));",
    )
    attn = BatchAttention(ws, 32, 8, 128, ..., variant=sigmoid_per_head)
    attn.plan(qo_indptr, kv_lens, bsr, scale=1.0, bias=bias_tensor)
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

__all__ = [
    "Variant", "VariantError", "combine", "PARAM_TYPES", "HOOKS", "BUILTIN_VARIANTS",
    "DEFAULT", "SOFT_CAP", "SLIDING_WINDOW", "ALIBI", "SIGMOID", "CUSTOM_MASK", "ROPE", "ROPE_INTERLEAVE",
    "rope_rev_freq", "pack_custom_mask",
]


class VariantError(ValueError):
    """A variant spec that cannot be rendered (bad name, hook, parameter or parameter value)."""


# parameter type -> (C type in VariantParams, ctypes type name, torch dtype name or None for scalars)
PARAM_TYPES: Dict[str, Tuple[str, str, Optional[str]]] = {
    "float": ("float", "c_float", None),
    "int": ("int32_t", "c_int32", None),
    "float32[]": ("const float*", "c_void_p", "float32"),
    "float64[]": ("const double*", "c_void_p", "float64"),
    "int32[]": ("const int32_t*", "c_void_p", "int32"),
    "int64[]": ("const int64_t*", "c_void_p", "int64"),
    "uint8[]": ("const uint8_t*", "c_void_p", "uint8"),
    "bfloat16[]": ("const __nv_bfloat16*", "c_void_p", "bfloat16"),
    "float16[]": ("const __half*", "c_void_p", "float16"),
}

# hook -> (C return type, C parameter list after `const VariantParams& params`, template flag)
HOOKS: Dict[str, Tuple[str, str, str]] = {
    "query_transform": ("void", "float& x0, float& x1, int i, const fi::RotaryCtx& ctx", "kHasQueryTransform"),
    "key_transform": ("void", "float& x0, float& x1, int i, const fi::RotaryCtx& ctx", "kHasKeyTransform"),
    "logits_transform": ("float", "float logits, const fi::LogitsCtx& ctx", "kHasLogitsTransform"),
    "logits_mask": ("bool", "const fi::LogitsCtx& ctx", "kHasLogitsMask"),
    "output_transform": ("float", "float o, const fi::OutputCtx& ctx", "kHasOutputTransform"),
    "kv_range": ("void", "int q_pos_min, int q_pos_max, int& lo, int& hi", "kHasKvRange"),
    "alibi_slope": ("float", "int qo_head", "kHasAlibiSlope"),
}
# How a chain of several bodies of one hook combines (the dispatcher's body): statements in turn ({calls}),
# or one expression joining the calls ({joined}, with _JOIN's operator).
_CHAIN = {
    "query_transform": "{calls}",
    "key_transform": "{calls}",
    "logits_transform": "{calls}return logits;",
    "logits_mask": "return {joined};",
    "output_transform": "{calls}return o;",
    "kv_range": "{calls}",
    "alibi_slope": "return {joined};",
}
_JOIN = {"logits_mask": " && ", "alibi_slope": " + "}  # every mask must hold; slopes add up
_CALL = {
    "query_transform": "{f}(params, x0, x1, i, ctx);\n",
    "key_transform": "{f}(params, x0, x1, i, ctx);\n",
    "logits_transform": "logits = {f}(params, logits, ctx);\n",
    "logits_mask": "{f}(params, ctx)",
    "output_transform": "o = {f}(params, o, ctx);\n",
    "kv_range": "{f}(params, q_pos_min, q_pos_max, lo, hi);\n",
    "alibi_slope": "{f}(params, qo_head)",
}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = {"reserved_", "params", "ctx", "logits", "o", "x0", "x1", "i", "lo", "hi", "q_pos_min", "q_pos_max",
             "qo_head"}
_DISALLOWED = ("{{", "}}")  # template placeholders inside a hook body would be substituted by the renderer


def _as_tuple(body) -> Tuple[str, ...]:
    if body is None:
        return ()
    if isinstance(body, str):
        return (body,)
    return tuple(body)


@dataclass(frozen=True)
class Variant:
    """An attention variant: hook bodies (C++ strings), extra params, and whether softmax is used.

    name              letters, digits, '_' (part of the kernel module's name)
    params            {name: type} (see PARAM_TYPES), in the order they are laid out
    defaults          {name: value} for params a caller may omit
    use_softmax       False for sigmoid-style attention (no normalisation, no LSE)
    rotary_interleave pairing of dimensions for query/key transforms (False: (d, d + D/2))
    mask_is_kv_range  logits_mask is exactly the kv_range interval at the query's position (see above)
    prepare           optional Python callable (head_dim, device, kwargs) -> kwargs that turns
                      caller-facing arguments into kernel params (e.g. RoPE settings -> a table)
    hooks             each a body string or a tuple of bodies applied in order
    """

    name: str
    params: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, object] = field(default_factory=dict)
    use_softmax: bool = True
    rotary_interleave: bool = False
    mask_is_kv_range: bool = False
    query_transform: Tuple[str, ...] = ()
    key_transform: Tuple[str, ...] = ()
    logits_transform: Tuple[str, ...] = ()
    logits_mask: Tuple[str, ...] = ()
    output_transform: Tuple[str, ...] = ()
    kv_range: Tuple[str, ...] = ()
    alibi_slope: Tuple[str, ...] = ()
    prepare: Tuple[Callable, ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_]*", self.name):
            raise VariantError(f"variant name must be letters, digits and '_' (got {self.name!r})")
        params = dict(self.params)
        for pname, ptype in params.items():
            if not isinstance(pname, str) or not _IDENT.match(pname) or pname in _RESERVED:
                raise VariantError(f"variant {self.name}: parameter name {pname!r} must be a C identifier and "
                                   f"not one of {sorted(_RESERVED)}")
            if ptype not in PARAM_TYPES:
                raise VariantError(f"variant {self.name}: parameter {pname} has type {ptype!r}; accepted types: "
                                   f"{', '.join(PARAM_TYPES)}")
        for dname in self.defaults:
            if dname not in params:
                raise VariantError(f"variant {self.name}: default given for unknown parameter {dname!r}")
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "defaults", dict(self.defaults))
        for hook in HOOKS:
            bodies = _as_tuple(getattr(self, hook))
            for b in bodies:
                if not isinstance(b, str) or not b.strip():
                    raise VariantError(f"variant {self.name}: hook {hook} must be a non-empty C++ body string")
                if any(t in b for t in _DISALLOWED):
                    raise VariantError(f"variant {self.name}: hook {hook} contains '{{{{' or '}}}}', which the "
                                       "template renderer reserves; add a space between the braces")
            object.__setattr__(self, hook, bodies)
        object.__setattr__(self, "prepare", _as_tuple(self.prepare) if not callable(self.prepare)
                           else (self.prepare,))
        if self.alibi_slope and not self.use_softmax:
            raise VariantError(f"variant {self.name}: alibi_slope biases softmax logits; with use_softmax=False "
                               "write the bias into the logits_transform")
        if self.mask_is_kv_range and not (self.logits_mask and self.kv_range):
            raise VariantError(f"variant {self.name}: mask_is_kv_range needs both a logits_mask and a kv_range hook")

    # -------------------------------------------------------------------------------- rendering

    @property
    def has_rotary(self) -> bool:
        return bool(self.query_transform or self.key_transform)

    def render(self) -> Dict[str, str]:
        """Template parameters VARIANT_PARAMS, VARIANT_BODY, VARIANT_LAYOUT of the attention modules."""
        fields = "".join(f"  {PARAM_TYPES[t][0]} {n};\n" for n, t in self.params.items())
        lines = [
            f"  static constexpr bool kUseSoftmax = {'true' if self.use_softmax else 'false'};",
            f"  static constexpr bool kRotaryInterleave = {'true' if self.rotary_interleave else 'false'};",
            f"  static constexpr bool kMaskIsKvRange = {'true' if self.mask_is_kv_range else 'false'};",
        ]
        for hook, (ret, args, flag) in HOOKS.items():
            bodies = getattr(self, hook)
            lines.append(f"  static constexpr bool {flag} = {'true' if bodies else 'false'};")
            for k, body in enumerate(bodies):
                lines.append(f"  // {self.name}: {hook} #{k}\n"
                             f"  static __device__ __forceinline__ {ret} {hook}_{k}(const VariantParams& params, {args}) {{\n"
                             f"    {body.strip()}\n  }}")
            if bodies:
                calls = [_CALL[hook].format(f=f"{hook}_{k}") for k in range(len(bodies))]
                if hook in _JOIN:
                    chain = _CHAIN[hook].format(joined=_JOIN[hook].join(calls))
                else:
                    chain = _CHAIN[hook].format(calls="".join("    " + c for c in calls))
                lines.append(f"  static __device__ __forceinline__ {ret} {hook}(const VariantParams& params, {args}) {{\n"
                             f"    {chain.strip()}\n  }}")
            else:  # never called (the flag is false); present so the template always compiles
                default = {"void": "", "float": "return 0.f;", "bool": "return true;"}[ret]
                lines.append(f"  static __device__ __forceinline__ {ret} {hook}(const VariantParams& params, {args}) {{ {default} }}")
        layout = "".join(f"  out[i++] = (int64_t)offsetof(VariantParams, {n});\n" for n in self.params)
        return {"VARIANT_PARAMS": fields, "VARIANT_BODY": "\n".join(lines) + "\n", "VARIANT_LAYOUT": layout}

    def ctypes_fields(self) -> list:
        """Fields of the ctypes mirror of VariantParams (same order and C types as render())."""
        import ctypes
        return [("reserved_", ctypes.c_int32)] + [(n, getattr(ctypes, PARAM_TYPES[t][1])) for n, t in self.params.items()]

    # -------------------------------------------------------------------------------- values

    def resolve(self, kwargs: Mapping[str, object], *, head_dim: int, device) -> Dict[str, object]:
        """Caller arguments -> {param: value} for every param (prepare hooks, defaults, checks).

        Raises VariantError naming a missing or unknown argument."""
        kw = dict(kwargs)
        for fn in self.prepare:
            kw = fn(head_dim, device, kw)
        unknown = sorted(set(kw) - set(self.params))
        if unknown:
            raise VariantError(f"variant {self.name} has no parameter(s) {', '.join(unknown)}; its parameters: "
                               f"{', '.join(self.params) or 'none'}")
        values = {}
        for pname, ptype in self.params.items():
            if pname in kw:
                values[pname] = kw[pname]
            elif pname in self.defaults:
                values[pname] = self.defaults[pname]
            else:
                raise VariantError(f"variant {self.name} needs parameter {pname!r} ({ptype}); pass it to plan()")
        return values


def combine(*variants: Variant, name: Optional[str] = None) -> Variant:
    """One variant applying each of `variants` in order (transforms chained, masks ANDed)."""
    if not variants:
        raise VariantError("combine needs at least one variant")
    params: Dict[str, str] = {}
    defaults: Dict[str, object] = {}
    for v in variants:
        for pname, ptype in v.params.items():
            if pname in params:
                raise VariantError(f"combine: parameter {pname!r} appears in more than one variant")
            params[pname] = ptype
        defaults.update(v.defaults)
    interleave = {v.rotary_interleave for v in variants if v.has_rotary}
    if len(interleave) > 1:
        raise VariantError("combine: the variants disagree on rotary_interleave")
    kwargs = {hook: sum((getattr(v, hook) for v in variants), ()) for hook in HOOKS}
    return Variant(
        name or "_".join(v.name for v in variants if v.name != "default") or "default",
        params=params, defaults=defaults, use_softmax=all(v.use_softmax for v in variants),
        rotary_interleave=interleave.pop() if interleave else False,
        # the ANDed masks are the intersected ranges when every masking variant's mask is its range
        mask_is_kv_range=any(v.logits_mask for v in variants) and all(
            v.mask_is_kv_range for v in variants if v.logits_mask or v.kv_range),
        prepare=sum((v.prepare for v in variants), ()), **kwargs)


# ------------------------------------------------------------------------------------ RoPE tables

def _inv_freq(head_dim: int, theta: float, llama31) -> list:
    inv = [1.0 / (theta ** (i / head_dim)) for i in range(0, head_dim, 2)]
    if llama31 is None:
        return inv
    factor = float(llama31.factor)
    low, high = float(llama31.low_freq_factor), float(llama31.high_freq_factor)
    orig = float(llama31.original_max_position)
    if not high > low:
        raise VariantError(f"llama31 needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def rope_rev_freq(head_dim: int, *, theta: float = 10000.0, scale: float = 1.0, llama31=None, device=None):
    """float64 [head_dim // 2] revolutions per position, inv_freq / (2 pi scale), Llama-3.1 scaling
    applied when `llama31` (an object with factor, low_freq_factor, high_freq_factor,
    original_max_position, e.g. fi_backend.reference.Llama31Scaling) is given."""
    import torch
    if theta <= 0 or scale <= 0:
        raise VariantError(f"rope theta and scale must be > 0, got theta={theta}, scale={scale}")
    inv = _inv_freq(head_dim, float(theta), llama31)
    return torch.tensor([f / (2 * math.pi * scale) for f in inv], dtype=torch.float64, device=device)


_rope_tables: Dict[tuple, object] = {}


def _rope_prepare(head_dim, device, kw, interleave=False):
    """rope=RopeConfig(...) (or rope_theta / rope_scale / rope_llama31) -> rope_rev_freq table.

    Tables are memoised per (head_dim, settings, device): a re-plan with the same settings hands the
    kernel the same device pointer, which a captured CUDA graph keeps reading."""
    if "rope_rev_freq" in kw:
        return kw
    cfg = kw.pop("rope", None)
    if cfg is not None and bool(getattr(cfg, "interleave", False)) != interleave:
        raise VariantError(f"rope={cfg!r} asks for interleave={not interleave} pairing but this variant rotates "
                           f"{'(2i, 2i + 1)' if interleave else '(d, d + D/2)'} pairs; use "
                           f"{'ROPE_INTERLEAVE' if not interleave else 'ROPE'} instead")
    theta = float(kw.pop("rope_theta", getattr(cfg, "theta", 10000.0)))
    scale = float(kw.pop("rope_scale", getattr(cfg, "scale", 1.0)))
    llama31 = kw.pop("rope_llama31", getattr(cfg, "llama31", None))
    l31 = None if llama31 is None else (float(llama31.factor), float(llama31.low_freq_factor),
                                         float(llama31.high_freq_factor), float(llama31.original_max_position))
    key = (head_dim, theta, scale, l31, str(device))
    table = _rope_tables.get(key)
    if table is None:
        table = rope_rev_freq(head_dim, theta=theta, scale=scale, llama31=llama31, device=device)
        _rope_tables[key] = table
    kw["rope_rev_freq"] = table
    return kw


def pack_custom_mask(masks, device=None):
    """Per-request boolean masks [q_len_i, kv_len_i] (True = attend) -> (mask_packed uint8,
    mask_indptr int64 [B]) for CUSTOM_MASK: request i's bit (q, k) is mask_indptr[i] + q * kv_len_i + k,
    little-endian within bytes."""
    import numpy as np
    import torch
    flat, starts, off = [], [], 0
    for m in masks:
        m = torch.as_tensor(m)
        if m.dtype != torch.bool or m.dim() != 2:
            raise VariantError(f"custom masks must be bool [q_len, kv_len], got {m.dtype} {tuple(m.shape)}")
        flat.append(m.reshape(-1).cpu().numpy())
        starts.append(off)
        off += m.numel()
    bits = np.concatenate(flat) if flat else np.zeros(0, dtype=bool)
    packed = np.packbits(bits, bitorder="little")
    if packed.size == 0:
        packed = np.zeros(1, dtype=np.uint8)
    return (torch.from_numpy(packed).to(device), torch.tensor(starts, dtype=torch.int64, device=device))


# ------------------------------------------------------------------------------------ built-ins

DEFAULT = Variant("default")

SOFT_CAP = Variant(
    "soft_cap", params={"logits_soft_cap": "float"},
    logits_transform="return params.logits_soft_cap * fi::tanh_fast(logits * __frcp_rn(params.logits_soft_cap));")

SLIDING_WINDOW = Variant(
    "window", params={"window_left": "int"},
    logits_mask="return params.window_left < 0 || ctx.kv_pos >= ctx.q_pos - params.window_left;",
    kv_range="if (params.window_left >= 0) lo = max(lo, q_pos_min - params.window_left);", mask_is_kv_range=True)

ALIBI = Variant("alibi", params={"alibi_slopes": "float32[]"}, alibi_slope="return __ldg(params.alibi_slopes + qo_head);")

SIGMOID = Variant(
    "sigmoid", params={"sigmoid_bias": "float"}, defaults={"sigmoid_bias": 0.0}, use_softmax=False,
    logits_transform="return 1.f / (1.f + __expf(-(logits + params.sigmoid_bias)));")

CUSTOM_MASK = Variant(
    "custom_mask", params={"mask_packed": "uint8[]", "mask_indptr": "int64[]"},
    logits_mask=("const int64_t bit = __ldg(params.mask_indptr + ctx.request) + (int64_t)ctx.q_idx * ctx.kv_len"
                 " + ctx.kv_idx;\n    return fi::packed_mask_bit(params.mask_packed, bit);"))

_ROPE_BODY = "fi::rope_rotate(params.rope_rev_freq, ctx.pos, i, x0, x1);"
ROPE = Variant(
    "rope", params={"rope_rev_freq": "float64[]"}, prepare=_rope_prepare,
    query_transform=_ROPE_BODY, key_transform=_ROPE_BODY)
ROPE_INTERLEAVE = Variant(
    "rope_interleave", params={"rope_rev_freq": "float64[]"}, rotary_interleave=True,
    prepare=lambda head_dim, device, kw: _rope_prepare(head_dim, device, kw, interleave=True),
    query_transform=_ROPE_BODY, key_transform=_ROPE_BODY)

BUILTIN_VARIANTS: Dict[str, Variant] = {
    v.name: v for v in (DEFAULT, SOFT_CAP, SLIDING_WINDOW, ALIBI, SIGMOID, CUSTOM_MASK, ROPE, ROPE_INTERLEAVE)
}
# Combinations that make sense together (causal is a plan() flag and combines with all of them).
BUILTIN_VARIANTS.update({
    v.name: v for v in (
        combine(SOFT_CAP, SLIDING_WINDOW),
        combine(ALIBI, SLIDING_WINDOW),
        combine(ROPE, SLIDING_WINDOW),
        combine(ROPE, SOFT_CAP),
        combine(SOFT_CAP, SIGMOID),
    )
})
