"""Reference semantics: the ground truth every kernel is tested against.

Everything here is float64 math on the inputs' device (CPU tensors compute on the CPU, CUDA tensors on
the GPU). Clarity beats speed: the code is vectorised over heads and query rows with torch and loops only
over requests / row blocks.

What is defined here, in the FlashInfer paper's words:
  * the variants (RoPE as a KeyTransform/QueryTransform; soft-cap, ALiBi and sigmoid as LogitsTransforms;
    causal, sliding window and custom masks as the LogitsMask), applied in the order `attention` documents;
  * the attention state (O, LSE) of one request, LSE in natural log;
  * the merge of attention states, O = (e^a O_a + e^b O_b) / (e^a + e^b), LSE = log(e^a + e^b);
  * batches over ragged tensors (`batch_attention`) and over the BSR KV format (`attention_bsr`);
  * the KV write path: appending tokens to a paged KV cache by slot (`append_paged_kv_cache`), with the
    fp8 conversion stored = saturate(x / scale).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .formats import BSR

__all__ = [
    "Llama31Scaling",
    "RopeConfig",
    "rope_frequencies",
    "apply_rope",
    "alibi_slopes",
    "attention",
    "batch_attention",
    "attention_bsr",
    "merge_state",
    "merge_states",
    "append_paged_kv_cache",
]

_f64 = torch.float64


# --------------------------------------------------------------------------------------------- RoPE


@dataclass(frozen=True)
class Llama31Scaling:
    """Llama-3.1 frequency scaling (HF transformers' `rope_type="llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding applied to q and k before the dot product.

    theta: base of the inverse frequencies theta^(-2i/D).
    scale: linear position interpolation, positions / scale.
    llama31: Llama-3.1 frequency scaling, or None.
    interleave: False rotates (x[i], x[i + D/2]) (HF Llama / GPT-NeoX "rotate_half");
                True rotates (x[2i], x[2i + 1]) (GPT-J).
    """

    theta: float = 10000.0
    scale: float = 1.0
    llama31: Optional[Llama31Scaling] = None
    interleave: bool = False


def rope_frequencies(head_dim: int, rope: RopeConfig, device=None) -> torch.Tensor:
    """Inverse frequencies float64 [head_dim // 2], after Llama-3.1 scaling when rope.llama31 is set."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope needs a positive even head_dim, got head_dim={head_dim}")
    if rope.theta <= 0 or rope.scale <= 0:
        raise ValueError(f"rope theta and scale must be > 0, got theta={rope.theta}, scale={rope.scale}")
    i = torch.arange(0, head_dim, 2, dtype=_f64, device=device)
    inv_freq = 1.0 / (rope.theta ** (i / head_dim))
    s = rope.llama31
    if s is None:
        return inv_freq
    if not s.high_freq_factor > s.low_freq_factor:
        raise ValueError(
            f"llama31 needs high_freq_factor > low_freq_factor, got {s.high_freq_factor} <= {s.low_freq_factor}"
        )
    # Wavelengths longer than original_max_position / low_freq_factor are divided by `factor`, shorter
    # than original_max_position / high_freq_factor are kept, and the band between is interpolated.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    medium = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, medium, out)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Rotate x [L, H, D] by positions pos [L]; returns float64 [L, H, D] on x's device."""
    if x.dim() != 3:
        raise ValueError(f"apply_rope expects x of shape [L, H, D], got {tuple(x.shape)}")
    L, _, D = x.shape
    pos = torch.as_tensor(pos, device=x.device)
    if pos.shape != (L,):
        raise ValueError(f"apply_rope expects pos of shape [{L}], got {tuple(pos.shape)}")
    x = x.to(_f64)
    inv_freq = rope_frequencies(D, rope, device=x.device)
    angle = (pos.to(_f64) / rope.scale)[:, None] * inv_freq[None, :]  # [L, D/2]
    cos = torch.cos(angle)[:, None, :]
    sin = torch.sin(angle)[:, None, :]
    if rope.interleave:
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).reshape(x.shape)
    x0, x1 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)


# -------------------------------------------------------------------------------------------- ALiBi


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """Standard ALiBi slopes float64 [num_heads] (Press et al.).

    For n a power of two the slopes are 2^(-8/n), 2^(-16/n), ...; otherwise the 2^floor(log2 n) series
    followed by every other slope of the 2 * 2^floor(log2 n) series.
    """
    if num_heads <= 0:
        raise ValueError(f"alibi_slopes needs num_heads > 0, got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 1 << (num_heads.bit_length() - 1)
    slopes = geometric(closest)
    if closest != num_heads:
        slopes += geometric(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=_f64, device=device)


# ---------------------------------------------------------------------------------------- attention


def _as_positions(pos, n: int, name: str, device) -> torch.Tensor:
    pos = torch.as_tensor(pos, device=device)
    if pos.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}], got {tuple(pos.shape)}")
    if pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {pos.dtype}")
    return pos.to(torch.int64)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos=None,
    kv_pos=None,
    sm_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    use_sigmoid: bool = False,
    sigmoid_bias: float = 0.0,
    rope: Optional[RopeConfig] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention of one request; returns the attention state (o float64 [Lq, Hq, Dv], lse float64 [Lq, Hq]).

    q [Lq, Hq, D]; k [Lkv, Hkv, D]; v [Lkv, Hkv, Dv] in any float dtype (float8_e4m3fn included: k and v
    are dequantised as k.double() * k_scale, v.double() * v_scale; the scales are per-tensor, default 1).
    Query head h reads KV head h // (Hq // Hkv) (GQA/MQA).

    Positions: kv_pos defaults to arange(Lkv); q_pos to Lkv - Lq + arange(Lq), i.e. bottom-right aligned
    (the query is the suffix of the KV, as in decode, append and chunked prefill).

    Applied in this order:
      1. rope: q rotated by q_pos, k by kv_pos (QueryTransform / KeyTransform);
      2. s = (q . k) * sm_scale, sm_scale default 1/sqrt(D);
      3. logits_soft_cap > 0: s = cap * tanh(s / cap);
      4. alibi_slopes [Hq]: s += slope[h] * (kv_pos - q_pos);
      5. LogitsMask: causal keeps kv_pos <= q_pos; window_left >= 0 keeps kv_pos >= q_pos - window_left;
         mask (bool [Lq, Lkv], True = attend) is ANDed in;
      6. softmax over allowed keys, lse = logsumexp of allowed s (natural log). A row with no allowed key
         gets o = 0 and lse = -inf, never NaN.
    use_sigmoid replaces step 6 with p = sigmoid(s + sigmoid_bias) on allowed keys (0 elsewhere),
    o = sum_j p_j v_j; the LSE is undefined for sigmoid attention, so (o, None) is returned.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"attention expects q [Lq, Hq, D], k and v [Lkv, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    Lq, Hq, D = q.shape
    Lkv, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"q and k head_dim differ: q {D}, k {Dk}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k and v must agree on [Lkv, Hkv]: k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"num_qo_heads ({Hq}) must be a multiple of num_kv_heads ({Hkv})")
    device = q.device
    kv_pos = torch.arange(Lkv, device=device) if kv_pos is None else _as_positions(kv_pos, Lkv, "kv_pos", device)
    if q_pos is None:
        q_pos = Lkv - Lq + torch.arange(Lq, device=device)
    else:
        q_pos = _as_positions(q_pos, Lq, "q_pos", device)

    qf = q.to(_f64)
    kf = k.to(device=device, dtype=_f64) * (1.0 if k_scale is None else float(k_scale))
    vf = v.to(device=device, dtype=_f64) * (1.0 if v_scale is None else float(v_scale))
    if rope is not None:
        qf = apply_rope(qf, q_pos, rope)
        kf = apply_rope(kf, kv_pos, rope)
    group = Hq // Hkv
    Dv = vf.shape[-1]

    def per_query_head(p):  # p [Hq, Lq, Lkv] . v: query head h reads KV head h // group, v never repeated
        return torch.einsum("ngqk,knd->qngd", p.reshape(Hkv, group, Lq, Lkv), vf).reshape(Lq, Hq, Dv)

    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    # [Hq, Lq, Lkv]: query head h = n * group + g reads KV head n (GQA / MQA), k never repeated per query head
    s = torch.einsum("qngd,knd->ngqk", qf.reshape(Lq, Hkv, group, D), kf).reshape(Hq, Lq, Lkv) * scale
    if logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    rel = (kv_pos[None, :] - q_pos[:, None]).to(_f64)  # [Lq, Lkv]
    if alibi_slopes is not None:
        slopes = torch.as_tensor(alibi_slopes, device=device).to(_f64)
        if slopes.shape != (Hq,):
            raise ValueError(f"alibi_slopes must have shape [num_qo_heads={Hq}], got {tuple(slopes.shape)}")
        s = s + slopes[:, None, None] * rel[None]

    allowed = torch.ones(Lq, Lkv, dtype=torch.bool, device=device)
    if causal:
        allowed &= kv_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        allowed &= kv_pos[None, :] >= q_pos[:, None] - window_left
    if mask is not None:
        mask = torch.as_tensor(mask, device=device)
        if mask.dtype != torch.bool or mask.shape != (Lq, Lkv):
            raise ValueError(f"mask must be bool [Lq={Lq}, Lkv={Lkv}], got {mask.dtype} {tuple(mask.shape)}")
        allowed &= mask
    allowed = allowed[None].expand(Hq, Lq, Lkv)

    if use_sigmoid:
        p = torch.where(allowed, torch.sigmoid(s + sigmoid_bias), torch.zeros((), dtype=_f64, device=device))
        return per_query_head(p), None

    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1) if Lkv else torch.full((Hq, Lq), -math.inf, dtype=_f64, device=device)
    # Empty rows have lse = -inf; shift by 0 there so exp never sees -inf - (-inf).
    shift = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.where(allowed, torch.exp(s - shift[..., None]), torch.zeros((), dtype=_f64, device=device))
    return per_query_head(p), lse.transpose(0, 1).contiguous()


def _reject(variant: dict, names: tuple[str, ...], fn: str, why: str) -> None:
    for name in names:
        if name in variant:
            raise ValueError(f"{fn} does not accept `{name}`: {why}")


def batch_attention(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    q_pos=None,
    kv_pos=None,
    **variant,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention over a batch of requests in ragged tensors.

    q [Nq, Hq, D]; k, v [Nkv, Hkv, D]. Request i is query rows qo_indptr[i]:qo_indptr[i+1] against KV
    rows kv_indptr[i]:kv_indptr[i+1]. q_pos [Nq] / kv_pos [Nkv], when given, hold every row's position;
    by default positions are per request (kv 0.., query bottom-right aligned). Other keyword arguments
    are `attention`'s variant arguments; a custom `mask` is per request and not accepted here.
    Returns o float64 [Nq, Hq, Dv] and lse float64 [Nq, Hq] (None for sigmoid); rows outside every
    request get o = 0, lse = -inf.
    """
    _reject(variant, ("mask",), "batch_attention", "a custom mask is per request; call attention() per request")
    qo = [int(x) for x in torch.as_tensor(qo_indptr).tolist()]
    kv = [int(x) for x in torch.as_tensor(kv_indptr).tolist()]
    if len(qo) != len(kv) or len(qo) < 1:
        raise ValueError(f"qo_indptr and kv_indptr must both have batch_size + 1 entries, got {len(qo)} and {len(kv)}")
    for name, ptr, n in (("qo_indptr", qo, q.shape[0]), ("kv_indptr", kv, k.shape[0])):
        if any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[0] < 0 or ptr[-1] > n:
            raise ValueError(f"{name} must be non-decreasing within [0, {n}], got {ptr}")
    if q_pos is not None:
        q_pos = _as_positions(q_pos, q.shape[0], "q_pos", q.device)
    if kv_pos is not None:
        kv_pos = _as_positions(kv_pos, k.shape[0], "kv_pos", q.device)
    Nq, Hq, _ = q.shape
    o = torch.zeros(Nq, Hq, v.shape[-1], dtype=_f64, device=q.device)
    lse = torch.full((Nq, Hq), -math.inf, dtype=_f64, device=q.device)
    for i in range(len(qo) - 1):
        q0, q1, k0, k1 = qo[i], qo[i + 1], kv[i], kv[i + 1]
        o_i, lse_i = attention(
            q[q0:q1], k[k0:k1], v[k0:k1],
            q_pos=None if q_pos is None else q_pos[q0:q1],
            kv_pos=None if kv_pos is None else kv_pos[k0:k1],
            **variant,
        )
        o[q0:q1] = o_i
        if lse_i is not None:
            lse[q0:q1] = lse_i
    return o, (None if variant.get("use_sigmoid", False) else lse)


def attention_bsr(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bsr: BSR,
    *,
    q_pos=None,
    **variant,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention reading the KV through a BSR matrix (fi_backend.formats).

    q [num_q_rows, Hq, D]; k_cache, v_cache paged NHD [num_blocks, Bc, Hkv, D] (Bc = bsr.block_width;
    token tables have Bc = 1). Each row block gathers its KV blocks, and its KV token t has logical
    position kv_pos_start[i] + t. q_pos [num_q_rows], indexed by query row, gives the query positions;
    None aligns each row block's queries bottom-right (kv_pos_start + kv_len - height + j).
    Returns o float64 [num_q_rows, Hq, Dv] and lse float64 [num_q_rows, Hq] (None for sigmoid); rows no
    row block covers get o = 0, lse = -inf. A query row covered by two row blocks is an error: compute
    each BSR matrix separately and merge the attention states (merge_state).
    """
    _reject(variant, ("mask",), "attention_bsr", "a custom mask is per request; call attention() per request")
    _reject(variant, ("kv_pos",), "attention_bsr", "KV positions come from bsr.kv_pos_start")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must be paged NHD [num_blocks, Bc, Hkv, D] with matching leading dims, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_blocks, bc = k_cache.shape[0], k_cache.shape[1]
    if bc != bsr.block_width:
        raise ValueError(f"k_cache block size {bc} != bsr.block_width {bsr.block_width}")
    if bsr.num_kv_blocks is not None and bsr.num_kv_blocks > num_blocks:
        raise ValueError(f"bsr.num_kv_blocks={bsr.num_kv_blocks} exceeds the cache's {num_blocks} blocks")
    Nq, Hq, _ = q.shape
    device = q.device
    if q_pos is not None:
        q_pos = _as_positions(q_pos, Nq, "q_pos", device)

    R = bsr.num_row_blocks
    qo_indptr = bsr.qo_indptr.tolist()
    kv_lens = bsr.kv_lens.tolist()
    kv_block_start = bsr.kv_block_start.tolist()
    kv_pos_start = [0] * R if bsr.kv_pos_start is None else bsr.kv_pos_start.tolist()
    if len(kv_lens) != R or len(kv_block_start) != R or len(kv_pos_start) != R:
        raise ValueError(f"bsr.kv_lens, kv_block_start and kv_pos_start must have num_row_blocks={R} entries")
    if bsr.qo_rows is not None and bsr.qo_rows.numel() != qo_indptr[-1]:
        raise ValueError(f"bsr.qo_rows must have qo_indptr[-1]={qo_indptr[-1]} entries, got {bsr.qo_rows.numel()}")
    kv_indices = bsr.kv_indices.to(device=k_cache.device, dtype=torch.int64)
    qo_rows = None if bsr.qo_rows is None else bsr.qo_rows.to(device=device, dtype=torch.int64)

    o = torch.zeros(Nq, Hq, v_cache.shape[-1], dtype=_f64, device=device)
    lse = torch.full((Nq, Hq), -math.inf, dtype=_f64, device=device)
    covered = torch.zeros(Nq, dtype=torch.bool, device=device)
    for i in range(R):
        r0, r1 = qo_indptr[i], qo_indptr[i + 1]
        height, kv_len = r1 - r0, kv_lens[i]
        if height <= 0:
            continue
        rows = torch.arange(r0, r1, device=device) if qo_rows is None else qo_rows[r0:r1]
        if int(rows.min()) < 0 or int(rows.max()) >= Nq:
            raise ValueError(f"row block {i} names query rows outside [0, {Nq})")
        if covered[rows].any() or rows.unique().numel() != height:
            raise ValueError(
                f"row block {i} covers a query row that another row block already covers; attention_bsr "
                f"computes one attention state per row: run each BSR matrix separately and merge_state them"
            )
        covered[rows] = True
        nblk = -(-kv_len // bc)
        b0 = kv_block_start[i]
        if b0 < 0 or b0 + nblk > kv_indices.numel():
            raise ValueError(f"row block {i}: kv_indices[{b0}:{b0 + nblk}] is out of range ({kv_indices.numel()})")
        blocks = kv_indices[b0 : b0 + nblk]
        if nblk and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
            raise ValueError(f"row block {i} names KV blocks outside [0, {num_blocks})")
        k_i = k_cache[blocks].reshape(nblk * bc, *k_cache.shape[2:])[:kv_len].to(device)
        v_i = v_cache[blocks].reshape(nblk * bc, *v_cache.shape[2:])[:kv_len].to(device)
        p0 = kv_pos_start[i]
        kv_pos = p0 + torch.arange(kv_len, device=device)
        qp = p0 + kv_len - height + torch.arange(height, device=device) if q_pos is None else q_pos[rows]
        o_i, lse_i = attention(q[rows], k_i, v_i, q_pos=qp, kv_pos=kv_pos, **variant)
        o[rows] = o_i
        if lse_i is not None:
            lse[rows] = lse_i
    return o, (None if variant.get("use_sigmoid", False) else lse)


# ---------------------------------------------------------------------------------------------- merge


def merge_state(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states: O = (e^a O_a + e^b O_b) / (e^a + e^b), LSE = log(e^a + e^b).

    o_* [..., D], lse_* [...] (natural log). A side with lse = -inf contributes nothing (its o is never
    read, so poisoned values are fine) and the other side is returned exactly; both -inf gives o = 0,
    lse = -inf. Returns float64 on o_a's device.
    """
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_state expects o [..., D] and lse [...] of matching shapes, got o_a {tuple(o_a.shape)}, "
            f"lse_a {tuple(lse_a.shape)}, o_b {tuple(o_b.shape)}, lse_b {tuple(lse_b.shape)}"
        )
    dev = o_a.device
    o = torch.stack((o_a.to(_f64), o_b.to(device=dev, dtype=_f64)), dim=0)[None]  # [1, 2, ..., D]
    lse = torch.stack((lse_a.to(device=dev, dtype=_f64), lse_b.to(device=dev, dtype=_f64)), dim=0)[None]
    o, lse = merge_states(o, lse)
    return o[0], lse[0]


def merge_states(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S attention states per row: o [N, S, ..., D], lse [N, S, ...] -> o [N, ..., D], lse [N, ...].

    Same rule as merge_state, over dim 1; states with lse = -inf are skipped (their o is never read).
    S = 0 or all states -inf gives o = 0, lse = -inf. Returns float64 on o's device.
    """
    if o.dim() < 3 or o.shape[:-1] != lse.shape:
        raise ValueError(
            f"merge_states expects o [N, S, ..., D] and lse [N, S, ...], got {tuple(o.shape)} and {tuple(lse.shape)}"
        )
    o = o.to(_f64)
    lse = lse.to(device=o.device, dtype=_f64)
    if o.shape[1] == 0:
        shape = (o.shape[0],) + tuple(o.shape[2:])
        empty_lse = torch.full(shape[:-1], -math.inf, dtype=_f64, device=o.device)
        return torch.zeros(shape, dtype=_f64, device=o.device), empty_lse
    m = lse.amax(dim=1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf: any finite shift; weights are 0
    w = torch.exp(lse - m)  # [N, S, ...], in [0, 1]; the largest state has weight exactly 1
    live = (w > 0)[..., None]
    num = torch.where(live, o * w[..., None], torch.zeros((), dtype=_f64, device=o.device)).sum(dim=1)
    den = w.sum(dim=1)
    out_lse = m.squeeze(1) + torch.log(den)  # log(0) = -inf when every state is -inf
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return num / safe[..., None], out_lse


# -------------------------------------------------------------------------------------- KV append

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _cache_pages(t: torch.Tensor, kv_layout: str, packed_half: Optional[int] = None) -> torch.Tensor:
    """A view [num_blocks, page, heads, D] of one side of a cache (NHD order), writable in place."""
    if packed_half is not None:
        D = t.shape[-1] // 2
        t = t[..., :D] if packed_half == 0 else t[..., D:]
    if t.dim() == 3:
        return t[:, None]
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    return t if kv_layout == "NHD" else t.transpose(1, 2)


def _stored(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """x as the cache stores it: a copy, or saturate(x / scale) rounded to nearest-even fp8."""
    if dtype == x.dtype:
        return x
    if dtype not in _FP8_MAX:
        raise ValueError(f"a {x.dtype} key is stored as {x.dtype}, torch.float8_e4m3fn or torch.float8_e5m2, "
                         f"not {dtype}")
    # The kernel holds the scale in fp32. float64 x / scale then rounds to the same fp32 value as an
    # fp32 division (53 >= 2 * 24 + 2), and torch converts to fp8 through fp32: the kernel's fp32
    # divide + cvt.rn.satfinite, bit for bit.
    scale = torch.as_tensor(1.0 if scale is None else scale).to(device=x.device, dtype=torch.float32)
    scale = scale.reshape(()).to(_f64)
    y = (x.to(_f64) / scale).to(torch.float32)
    m = _FP8_MAX[dtype]
    return y.clamp(-m, m).to(dtype)  # clamp keeps NaN; +-inf saturate like satfinite


def append_paged_kv_cache(key, value, kv_cache, slot_mapping, *, kv_layout="NHD", k_scale=None, v_scale=None):
    """The cache after appending tokens: a clone of kv_cache (same structure) with token t < n of key /
    value [num_tokens, heads, D] written at slot s = slot_mapping[t] (n = len(slot_mapping)): block
    s // page, offset s % page. Slots < 0 (padding) and >= num_blocks * page are skipped.

    kv_cache: one packed [num_blocks, page, heads, 2 D] ("NHD") / [num_blocks, heads, page, 2 D] ("HND")
    tensor (K then V in the last dim), or a (k, v) pair of 4-D NHD / HND or 3-D [num_slots, heads, D]
    tensors. A cache of key's dtype stores a copy; an fp8 cache (float8_e4m3fn / float8_e5m2) stores
    saturate(x / scale) rounded to nearest even (k_scale for K, v_scale for V: None = 1.0, a float or
    a 1-element tensor). Slots should be distinct: which of two tokens lands in one slot is unspecified.
    """
    slots = torch.as_tensor(slot_mapping).to(torch.int64)
    n = slots.numel()
    if key.shape != value.shape or key.dim() != 3 or n > key.shape[0]:
        raise ValueError(f"key and value must be [num_tokens, heads, D] of one shape with num_tokens >= "
                         f"len(slot_mapping) = {n} (got {tuple(key.shape)} and {tuple(value.shape)})")
    if isinstance(kv_cache, torch.Tensor):
        out = kv_cache.clone()
        sides = (_cache_pages(out, kv_layout, 0), _cache_pages(out, kv_layout, 1))
    else:
        out = tuple(t.clone() for t in kv_cache)
        sides = tuple(_cache_pages(t, kv_layout) for t in out)
    num_blocks, page = sides[0].shape[:2]
    slots = slots.to(sides[0].device)
    keep = (slots >= 0) & (slots < num_blocks * page)
    s = slots[keep]
    rows = torch.nonzero(keep).flatten()
    for side, x, scale in ((sides[0], key, k_scale), (sides[1], value, v_scale)):
        if side.shape[2:] != x.shape[1:]:
            raise ValueError(f"the cache holds [heads, D] = {list(side.shape[2:])} per token but key/value "
                             f"rows are {list(x.shape[1:])}")
        vals = _stored(x[:n].to(side.device)[rows], side.dtype, scale)
        side[s // page, s % page] = vals
    return out
