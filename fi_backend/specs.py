"""The kernel modules' specs: decode_spec / prefill_spec render csrc/attention/attention_module.cu for one
(variant, head size, dtypes, GQA group) at the shape fi_backend.shapes chooses, or at a benchmark's tuning;
attention_specs names every module a BatchAttention loads. Named sets for ahead-of-time builds:
fi_backend/module_sets.py."""
from __future__ import annotations

from typing import Optional

from . import kernels
from .shapes import (SMEM_PER_CTA, _bias_mma_possible, _fa3_blockers, _fa3_q_buffers, _blocks_by_smem, _check_head_dim, _kernel_shape, _kv_bytes,
                     _prefill_q_buffers, _prefill_q_copy_possible, _prefill_shape, _prefill_smem_bytes,
                     _producer_blockers, _smem_bytes, decode_family_size, prefill_family_size, prefill_uses_wgmma,
                     smem_per_cta)
from .variants import Variant


def _arch_text() -> str:
    """The arch list in effect, for messages."""
    try:
        return "sm_" + ", sm_".join(kernels.resolve_arch_list())
    except RuntimeError:
        return "Hopper (no device and no arch list)"


_C_TYPE = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp8_e4m3": "__nv_fp8_e4m3", "fp8_e5m2": "__nv_fp8_e5m2"}
DECODE_TUNING_KEYS = frozenset({"warps", "sub", "stages"})
PREFILL_TUNING_KEYS = frozenset({"warps", "mfrags", "tile", "stages", "step", "wgmma", "producer", "q_buffers",
                                 "min_blocks", "fa3"})


def decode_spec(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int, *,
                tuning: Optional[dict] = None, deterministic: bool = False, member: int = 0) -> kernels.ModuleSpec:
    """The JIT module of the decode kernel for one (variant, head_dim, dtypes, GQA group), family member `member`
    (1: the shape for steps with few (request, unit) pairs, where shapes.decode_family_size is 2).

    tuning (benchmarks): overrides of warps / sub / stages.
    deterministic: the module deterministic wrappers load (decode::Config's kDeterministic: the fold of a whole
    item's pieces and the fold merge, docs/deterministic.md); a module of its own (tag suffix _det), so the
    normal one carries none of that code."""
    _check_head_dim(head_dim, variant)
    kv_bytes = _kv_bytes(kv_dtype)
    shape = _kernel_shape(head_dim, kv_bytes, group, key_transform=bool(variant.key_transform), member=member)
    tuning = dict(tuning or {})
    unknown = set(tuning) - DECODE_TUNING_KEYS
    if unknown:
        raise ValueError(f"unknown decode tuning keys {sorted(unknown)}; accepted: {sorted(DECODE_TUNING_KEYS)}")
    shape.update(tuning)
    smem, limit = _smem_bytes(head_dim, kv_bytes, shape), smem_per_cta()
    if smem > limit:
        raise ValueError(f"decode kernel shape {shape} for head_dim {head_dim} ({kv_dtype} KV) needs {smem} bytes of "
                         f"shared memory; a CTA may use at most {limit} on {_arch_text()}")
    config = ", ".join([str(head_dim), str(shape["rows"]), str(shape["hpc"]), _C_TYPE[q_dtype], _C_TYPE[kv_dtype],
                        str(shape["warps"]), str(shape["stages"]), str(shape["sub"])]
                       + (["true"] if deterministic else []))
    tag = f"{variant.name}_{q_dtype}_{kv_dtype}_d{head_dim}_r{shape['rows']}_h{shape['hpc']}"
    if tuning:
        tag += "_w{warps}s{stages}k{sub}".format(**shape)
    elif member:
        tag += f"_m{member}"
    if deterministic:
        tag += "_det"
    return _attention_spec("decode", variant, config, _blocks_by_smem(head_dim, kv_bytes, shape), tag)


def prefill_spec(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int, *,
                 tuning: Optional[dict] = None, member: int = 0) -> kernels.ModuleSpec:
    """The JIT module of the prefill kernel for one (variant, head_dim, dtypes, GQA group), tile family
    member `member` (0: the largest query tile; see fi_backend.shapes).
    tuning (benchmarks and the tests of forced shapes): overrides of warps / mfrags / tile / stages / step
    (default: min(step, tile)) / wgmma (1: Hopper warpgroup MMAs, sm_90a only) / producer (1: warp-specialised,
    a producer warpgroup loads the tiles for `warps` compute warps; wgmma, the query copy, 16-bit KV, no
    KeyTransform), q_buffers (1, or the stages: the loader's query copy; with a producer, 2 or more; default
    _prefill_q_buffers's choice), min_blocks (CTAs per SM the register budget is cut for; default 1: the
    kernel's own need) and fa3 (1: FlashAttention-3's consumer loop, prefill::Config::kOverlap; with producer=1,
    one fragment, a step per tile, three stages or more; row sums by FADD; 2: the same with its two consumer
    warpgroups' ping-pong, kPingPong; shapes.PREFILL_FA3_TUNINGS). The softmax's row sums go by MMA wherever there are warpgroup MMAs
    (prefill::Config::kRowSumMma) and a variant's ALiBi wherever _bias_mma_possible (kBiasMma)."""
    _check_head_dim(head_dim, variant)
    kv_bytes = _kv_bytes(kv_dtype)
    size = prefill_family_size(head_dim, kv_dtype, tuning)
    if not 0 <= member < size:
        raise ValueError(f"member must be in [0, {size}) (got {member})")
    shape = _prefill_shape(head_dim, kv_bytes, group, member, variant)
    default_shape = dict(shape) if member == 0 else _prefill_shape(head_dim, kv_bytes, group, 0, variant)
    tuning = dict(tuning or {})
    unknown = set(tuning) - PREFILL_TUNING_KEYS
    if unknown:
        raise ValueError(f"unknown prefill tuning keys {sorted(unknown)}; accepted: {sorted(PREFILL_TUNING_KEYS)}")
    min_blocks = int(tuning.pop("min_blocks", 1))
    q_buffers = tuning.pop("q_buffers", None)
    fa3 = int(tuning.pop("fa3", 0))
    if fa3 not in (0, 1, 2):
        raise ValueError(f"tuning fa3 must be 0, 1 (FlashAttention-3's consumer loop) or 2 (with ping-pong); got {fa3}")
    shape.update(tuning)
    if shape["wgmma"] and not prefill_uses_wgmma():
        raise ValueError("tuning wgmma=1 needs modules built for sm_90a only: set FI_BACKEND_CUDA_ARCH_LIST=90a, or "
                         "leave it unset with an H100 / H200 as the current device")
    if "step" not in tuning:
        shape["step"] = min(shape["step"], shape["tile"])
    shape["producer"] = int(shape.get("producer", 0))
    fa3_q = None
    if fa3:
        why = _fa3_blockers(variant, head_dim, kv_bytes, shape, fa3)
        if why:
            raise ValueError(f"tuning fa3={fa3} (FlashAttention-3's consumer loop) needs {', '.join(why)}; shape {shape}")
        fa3_q = _fa3_q_buffers(head_dim, kv_bytes, {**shape, "rowsum": 0, "bias": 0})   # the loop's row sums: FADD
        if q_buffers is None:
            q_buffers = fa3_q
    why = (_producer_blockers(variant, head_dim, kv_bytes, shape, q_buffers if fa3 else None)
           if shape["producer"] else [])
    if why:
        raise ValueError(f"tuning producer=1 (warp-specialised prefill) needs {', '.join(why)}; shape {shape}")
    shape["rowsum"] = int(shape["wgmma"] and not fa3)  # by MMA wherever there are warpgroup MMAs (fa3: FADD)
    shape["bias"] = int(_bias_mma_possible(variant, shape, shape["hpc"]) and not fa3)
    smem, limit = _prefill_smem_bytes(head_dim, kv_bytes, shape), smem_per_cta()
    if smem > limit:
        raise ValueError(f"prefill kernel shape {shape} for head_dim {head_dim} ({kv_dtype} KV) needs {smem} bytes of "
                         f"shared memory; a CTA may use at most {limit} on {_arch_text()}")
    chosen = fa3_q if fa3 else _prefill_q_buffers(variant, head_dim, kv_bytes, shape)
    if fa3 and q_buffers not in (1, chosen):
        raise ValueError(f"tuning fa3={fa3} takes q_buffers 1 or {chosen}; got {q_buffers}")
    if shape["producer"] and not fa3 and q_buffers is not None and not (isinstance(q_buffers, int) and q_buffers >= 2):
        raise ValueError(f"a warp-specialised prefill kernel (producer=1) needs q_buffers >= 2 (the producer copies "
                         f"the next sub-item's query tile while this one runs); got {q_buffers}")
    if q_buffers is None:
        q_buffers = chosen
    elif shape["producer"]:
        smem = _prefill_smem_bytes(head_dim, kv_bytes, shape, q_buffers)
        if smem > SMEM_PER_CTA:
            raise ValueError(f"tuning q_buffers {q_buffers} with shape {shape} needs {smem} bytes of shared memory; "
                             f"a CTA may use at most {SMEM_PER_CTA}")
    elif q_buffers != 1 and (q_buffers != shape["stages"] or
                             not _prefill_q_copy_possible(variant, head_dim, kv_bytes, shape)):
        raise ValueError(f"tuning q_buffers must be 1 or the stages ({shape['stages']}), and more than 1 only with "
                         f"wgmma, no QueryTransform and within {SMEM_PER_CTA} bytes of shared memory; got {q_buffers}")
    config = ", ".join([str(head_dim), str(shape["hpc"]), _C_TYPE[q_dtype], _C_TYPE[kv_dtype], str(shape["warps"]),
                        str(shape["mfrags"]), str(shape["tile"]), str(shape["stages"]), str(shape["step"]),
                        "true" if shape["wgmma"] else "false", str(q_buffers),
                        "true" if shape["producer"] else "false",
                        "true" if shape["rowsum"] else "false", "true" if shape["bias"] else "false"]
                       + (["true"] if fa3 else []) + (["true"] if fa3 == 2 else []))
    tag = f"{variant.name}_{q_dtype}_{kv_dtype}_d{head_dim}_h{shape['hpc']}"
    if shape != default_shape:  # a tuning equal to the largest member is that member's module
        tag += ("_w{warps}m{mfrags}t{tile}s{stages}k{step}".format(**shape) + ("_wg" if shape["wgmma"] else "")
                + ("_p" if shape["producer"] else "") + ("_rs" if shape["rowsum"] else "")
                + ("_ab" if shape["bias"] else "") + ("_fa3" if fa3 else "") + ("pp" if fa3 == 2 else ""))
    if q_buffers != chosen:
        tag += f"_q{q_buffers}"
    if min_blocks != 1:
        tag += f"_b{min_blocks}"
    return _attention_spec("prefill", variant, config, min_blocks, tag)


def _attention_spec(kernel: str, variant: Variant, config: str, min_blocks: int, tag: str) -> kernels.ModuleSpec:
    params = {"KERNEL": kernel, "CONFIG": config, "MIN_BLOCKS": str(min_blocks)}
    params.update(variant.render())
    return kernels.ModuleSpec(family=kernel, template="attention/attention_module.cu", params=params, tag=tag)


_SPECS = {"decode": decode_spec, "prefill": prefill_spec}
KERNELS = tuple(_SPECS)


def attention_specs(variant: Variant, head_dim: int, q_dtype: str, kv_dtype: str, group: int,
                    tuning: Optional[dict] = None, kernel: str = "decode", deterministic: bool = False) -> list:
    """The modules a BatchAttention of `kernel` loads: the tile family (prefill: largest query tile first; decode:
    shapes.decode_family_size members, one with a tuning or in deterministic mode, whose wrappers load the decode
    module of that mode; prefill's modules serve both)."""
    if kernel not in _SPECS:
        raise ValueError(f"kernel must be one of {KERNELS} (got {kernel!r})")
    if kernel == "decode":
        size = 1 if tuning or deterministic else decode_family_size(
            head_dim, _kv_bytes(kv_dtype), group, bool(variant.key_transform))
        return [decode_spec(variant, head_dim, q_dtype, kv_dtype, group, tuning=tuning, deterministic=deterministic,
                            **({"member": m} if m else {})) for m in range(size)]
    return [prefill_spec(variant, head_dim, q_dtype, kv_dtype, group, tuning=tuning, **({"member": m} if m else {}))
            for m in range(prefill_family_size(head_dim, kv_dtype, tuning))]
