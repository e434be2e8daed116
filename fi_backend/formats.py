"""KV-cache formats as block-sparse row (BSR) matrices (DESIGN.md, idea 1 and 2).

Rows of the matrix are query rows (tokens of this step's query tensor), grouped into row blocks: a row
block is a set of query rows that read the same KV (one request; or, in a shared-prefix matrix, every
request of a group, Br > 1). Columns are KV blocks of width Bc (the page size; Bc = 1 for token tables).

Row block i:
  query rows   qo_rows[qo_indptr[i] : qo_indptr[i + 1]]   (qo_rows None: rows qo_indptr[i] .. qo_indptr[i+1])
  KV blocks    kv_indices[kv_block_start[i] + j] for j < ceil(kv_lens[i] / Bc)
  KV length    kv_lens[i] tokens; the last block holds kv_lens[i] - (nblocks - 1) * Bc of them
  positions    KV token t of the row block has logical position kv_pos_start[i] + t (None: 0 + t)

kv_block_start instead of a CSR indptr makes the engines' tables zero-copy: a vLLM block table is
kv_indices = block_table.view(-1), kv_block_start = arange(R) * max_blocks, and an SGLang token table is
kv_indices = req_to_token.view(-1), kv_block_start = req_pool_indices * max_context_len. A compact CSR
(indptr) is the special case kv_block_start = indptr[:-1].

Builders (each returns a BSR; `check=True` validates it, which may synchronise the device):
  from_block_table   vLLM block tables (zero-copy)
  from_token_table   SGLang req_to_token tables (zero-copy for page_size 1; a page table copy otherwise)
  from_ragged        ragged KV tensors [total, H, D] (Bc = 1)
  from_dense_mask    block-sparse masks (to_dense_mask is its exact inverse at block granularity)
Composable formats (idea 2): split_shared_prefix turns one per-request BSR into a shared-prefix BSR
(Br > 1) plus a suffix BSR (Br = 1); their attention states merge into the original's. The kernels take
the same composition as prefix groups beside the per-request BSR (BatchAttention.plan's prefix_groups,
docs/composable.md): int32 [G, 3] rows (first request, end request, prefix tokens) over consecutive
requests; prefix_groups_from_table finds them in a host copy of a block table, check_prefix_groups
checks them against a BSR.

Everything is vectorised with torch on the tensors' own device: no Python loop over requests.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

__all__ = [
    "BSR",
    "Ragged",
    "from_block_table",
    "from_token_table",
    "from_ragged",
    "from_dense_mask",
    "to_dense_mask",
    "query_positions",
    "shared_prefix_groups",
    "split_shared_prefix",
    "check_prefix_groups",
    "prefix_groups_from_table",
    "prefix_groups_from_links",
]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_I32, _I64 = torch.int32, torch.int64
_INT32_MAX = 2**31 - 1


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_tensor(
    name: str, t, dtypes: Sequence[torch.dtype], dim: int = 1, shape: Optional[tuple] = None, why: str = ""
) -> torch.Tensor:
    """Raise TypeError/ValueError naming `name` unless t is a tensor of one of `dtypes` with `dim`/`shape`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype {_dtype_names(dtypes)}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {list(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}{' (' + why + ')' if why else ''}, got {list(t.shape)}")
    return t


def _check_int(name: str, x, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(x).__name__} {x!r}")
    if x < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {x}")
    return x


def _as_int32(name: str, t, shape: tuple, device: torch.device, why: str = "") -> torch.Tensor:
    """An integer index tensor as int32 (no copy when it already is), on `device`, of `shape`."""
    _check_tensor(name, t, _INT_DTYPES, dim=len(shape), shape=shape, why=why)
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the table's device), got {t.device}")
    return t if t.dtype == _I32 else t.to(_I32)


def _first_true(mask: torch.Tensor) -> Optional[int]:
    """Index of the first True in a 1-D bool tensor, or None (one sync)."""
    idx = torch.nonzero(mask).flatten()
    return int(idx[0]) if idx.numel() else None


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand counts [n] into (segment id [N], index within segment [N]), int64, N = counts.sum()."""
    counts = counts.to(_I64)
    total = int(counts.sum()) if counts.numel() else 0
    seg = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    j = torch.arange(total, device=counts.device) - first[seg]
    return seg, j


def _indptr(counts: torch.Tensor, dtype: torch.dtype = _I32) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=dtype, device=counts.device)
    torch.cumsum(counts, 0, dtype=dtype, out=out[1:])
    return out


def _flat_rows(table: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """A 1-D view over a 2-D table's storage and the distance between its rows (zero-copy).

    Row r of `table` is flat[r * row_stride : r * row_stride + table.shape[1]]. A table sliced out of a
    wider persistent buffer (row stride > width) is viewed over the buffer's storage, not copied.
    """
    n, m = table.shape
    if m > 1 and table.stride(1) != 1:
        raise ValueError(
            f"{name} must have contiguous rows (stride(1) == 1) to be viewed without a copy, got strides "
            f"{tuple(table.stride())}; pass {name}.contiguous()"
        )
    if table.is_contiguous() or n <= 1:
        return table.reshape(-1), m
    row_stride = table.stride(0)
    span = (n - 1) * row_stride + m
    return table.as_strided((span,), (1,), table.storage_offset()), row_stride


def _row_starts(n: int, row_stride: int, device: torch.device) -> torch.Tensor:
    dtype = _I32 if n * max(row_stride, 1) <= _INT32_MAX else _I64
    return torch.arange(n, dtype=dtype, device=device) * row_stride


# ------------------------------------------------------------------------------------------------ BSR


@dataclass
class BSR:
    qo_indptr: torch.Tensor                 # int32 [R + 1], row-space ranges of each row block
    kv_indices: torch.Tensor                # int32 [*], KV block ids (pages; slots when Bc = 1)
    kv_block_start: torch.Tensor            # int32/int64 [R], offset of row block i's first entry in kv_indices
    kv_lens: torch.Tensor                   # int32 [R], KV tokens of row block i
    block_width: int                        # Bc: tokens per KV block (page size)
    num_kv_blocks: Optional[int] = None     # blocks in the cache, for range checks (None: unchecked)
    qo_rows: Optional[torch.Tensor] = None  # int32 [qo_indptr[-1]], query row of each row-space slot
    kv_pos_start: Optional[torch.Tensor] = None  # int32 [R], logical position of each row block's first KV token
    # True: block j is row j of ragged K / V tensors (kv_indices the identity, Bc = 1; from_ragged's), so a reader may
    # load row block i's KV as rows kv_block_start[i] .. + kv_lens[i] without reading kv_indices
    contiguous: bool = False

    @property
    def num_row_blocks(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.qo_indptr.device

    @property
    def kv_num_blocks(self) -> torch.Tensor:
        """int32 [R]: KV blocks each row block reads, ceil(kv_lens / Bc) (no sync)."""
        return (self.kv_lens + (self.block_width - 1)) // self.block_width

    @property
    def last_block_len(self) -> torch.Tensor:
        """int32 [R]: tokens in each row block's last KV block, kv_lens - (nblocks - 1) * Bc; 0 when empty."""
        return self.kv_lens - (self.kv_num_blocks - 1).clamp_min(0) * self.block_width

    @property
    def qo_lens(self) -> torch.Tensor:
        """int32 [R]: query rows of each row block (the block height; no sync)."""
        return self.qo_indptr[1:] - self.qo_indptr[:-1]

    @property
    def num_q_rows(self) -> int:
        """Query rows the query tensor needs at least (syncs): qo_indptr[-1], or max(qo_rows) + 1 with qo_rows."""
        if self.qo_rows is None:
            return int(self.qo_indptr[-1])
        return int(self.qo_rows.max()) + 1 if self.qo_rows.numel() else 0

    def to(self, device, non_blocking: bool = False) -> "BSR":
        """The same matrix with every tensor on `device` (no copy for tensors already there)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return dataclasses.replace(
            self,
            qo_indptr=move(self.qo_indptr),
            kv_indices=move(self.kv_indices),
            kv_block_start=move(self.kv_block_start),
            kv_lens=move(self.kv_lens),
            qo_rows=move(self.qo_rows),
            kv_pos_start=move(self.kv_pos_start),
        )

    def validate(self, num_q_rows: Optional[int] = None, prefix_groups=None) -> "BSR":
        """Check dtypes, shapes and ranges; raise TypeError/ValueError naming the field. Returns self.

        Only the KV entries a row block uses (j < ceil(kv_lens / Bc)) are range-checked, so padding in
        an engine's table may hold anything. num_q_rows, when given, bounds qo_rows. prefix_groups, when
        given, are checked against this BSR (check_prefix_groups). Syncs the device: not for the hot path.
        """
        _check_tensor("BSR.qo_indptr", self.qo_indptr, (_I32,))
        if self.qo_indptr.numel() < 1:
            raise ValueError("BSR.qo_indptr must have R + 1 >= 1 entries, got 0")
        R = self.num_row_blocks
        dev = self.qo_indptr.device
        _check_tensor("BSR.kv_indices", self.kv_indices, (_I32,))
        _check_tensor("BSR.kv_block_start", self.kv_block_start, (_I32, _I64), shape=(R,), why="R = len(qo_indptr) - 1")
        _check_tensor("BSR.kv_lens", self.kv_lens, (_I32,), shape=(R,), why="R = len(qo_indptr) - 1")
        _check_int("BSR.block_width", self.block_width, 1)
        if self.num_kv_blocks is not None:
            _check_int("BSR.num_kv_blocks", self.num_kv_blocks, 0)
        if self.kv_pos_start is not None:
            _check_tensor("BSR.kv_pos_start", self.kv_pos_start, (_I32,), shape=(R,), why="R = len(qo_indptr) - 1")
        for name in ("kv_indices", "kv_block_start", "kv_lens", "qo_rows", "kv_pos_start"):
            t = getattr(self, name)
            if t is not None and t.device != dev:
                raise ValueError(f"BSR.{name} is on {t.device} but BSR.qo_indptr is on {dev}; all must share a device")

        if int(self.qo_indptr[0]) != 0:
            raise ValueError(f"BSR.qo_indptr must start at 0, got {int(self.qo_indptr[0])}")
        bad = _first_true(self.qo_indptr[1:] < self.qo_indptr[:-1])
        if bad is not None:
            raise ValueError(
                f"BSR.qo_indptr must be non-decreasing, got qo_indptr[{bad}]={int(self.qo_indptr[bad])} > "
                f"qo_indptr[{bad + 1}]={int(self.qo_indptr[bad + 1])}"
            )
        S = int(self.qo_indptr[-1])
        if self.qo_rows is not None:
            _check_tensor("BSR.qo_rows", self.qo_rows, (_I32,), shape=(S,), why="qo_indptr[-1] row-space slots")
            hi = _INT32_MAX if num_q_rows is None else num_q_rows
            bad = _first_true((self.qo_rows < 0) | (self.qo_rows >= hi))
            if bad is not None:
                accepted = ">= 0" if num_q_rows is None else f"in [0, num_q_rows={num_q_rows})"
                raise ValueError(f"BSR.qo_rows must be {accepted}, got qo_rows[{bad}]={int(self.qo_rows[bad])}")
        elif num_q_rows is not None and S > num_q_rows:
            raise ValueError(f"BSR.qo_indptr[-1]={S} exceeds num_q_rows={num_q_rows}")
        bad = _first_true(self.kv_lens < 0)
        if bad is not None:
            raise ValueError(f"BSR.kv_lens must be >= 0, got kv_lens[{bad}]={int(self.kv_lens[bad])}")
        if self.kv_pos_start is not None:
            bad = _first_true(self.kv_pos_start < 0)
            if bad is not None:
                got = int(self.kv_pos_start[bad])
                raise ValueError(f"BSR.kv_pos_start must be >= 0, got kv_pos_start[{bad}]={got}")

        nblk = self.kv_num_blocks.to(_I64)
        start = self.kv_block_start.to(_I64)
        n_idx = self.kv_indices.numel()
        bad = _first_true((nblk > 0) & ((start < 0) | (start + nblk > n_idx)))
        if bad is not None:
            s, e = int(start[bad]), int(start[bad] + nblk[bad])
            raise ValueError(
                f"BSR.kv_block_start[{bad}]={s}: row block {bad} uses kv_indices[{s}:{e}] "
                f"(kv_lens={int(self.kv_lens[bad])}, block_width={self.block_width}), "
                f"outside kv_indices' {n_idx} entries"
            )
        if self.num_kv_blocks is not None:
            row, j = _segments(nblk)
            ids = self.kv_indices[start[row] + j]
            bad = _first_true((ids < 0) | (ids >= self.num_kv_blocks))
            if bad is not None:
                raise ValueError(
                    f"BSR.kv_indices: row block {int(row[bad])} names KV block {int(ids[bad])} (its block "
                    f"{int(j[bad])}), outside [0, num_kv_blocks={self.num_kv_blocks})"
                )
        if self.contiguous:
            if self.block_width != 1:
                raise ValueError(f"BSR.contiguous needs block_width 1 (rows of ragged K / V), got {self.block_width}")
            row, j = _segments(nblk)
            e = start[row] + j
            bad = _first_true(self.kv_indices[e] != e)
            if bad is not None:
                raise ValueError(
                    f"BSR.contiguous: kv_indices[{int(e[bad])}]={int(self.kv_indices[e[bad]])} (row block "
                    f"{int(row[bad])}) must be {int(e[bad])}: a contiguous BSR's kv_indices are the identity "
                    f"(formats.from_ragged)"
                )
        if prefix_groups is not None:
            check_prefix_groups(self, prefix_groups)
        return self


# --------------------------------------------------------------------------------------------- Ragged


@dataclass
class Ragged:
    """A ragged tensor's segments: segment i is rows indptr[i] : indptr[i + 1] of a [total, ...] tensor."""

    indptr: torch.Tensor  # int32/int64 [B + 1], starting at 0, non-decreasing

    @classmethod
    def from_lens(cls, lens: torch.Tensor) -> "Ragged":
        """Segments of the given lengths (integer [B], >= 0), packed back to back; indptr is int32."""
        _check_tensor("lens", lens, _INT_DTYPES)
        return cls(_indptr(lens, _I32))

    @property
    def lens(self) -> torch.Tensor:
        return self.indptr[1:] - self.indptr[:-1]

    @property
    def batch_size(self) -> int:
        return self.indptr.numel() - 1

    @property
    def total(self) -> int:
        """Rows covered, indptr[-1] (syncs)."""
        return int(self.indptr[-1])

    def validate(self, name: str = "indptr") -> "Ragged":
        _check_tensor(name, self.indptr, (_I32, _I64))
        if self.indptr.numel() < 1 or int(self.indptr[0]) != 0:
            raise ValueError(f"{name} must have B + 1 >= 1 entries starting at 0, got {self.indptr.tolist()[:8]}")
        bad = _first_true(self.indptr[1:] < self.indptr[:-1])
        if bad is not None:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{bad}] > {name}[{bad + 1}]")
        return self

    def to(self, device, non_blocking: bool = False) -> "Ragged":
        return Ragged(self.indptr.to(device, non_blocking=non_blocking))


# ------------------------------------------------------------------------------------------- builders


def from_block_table(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    num_kv_blocks: Optional[int] = None,
    check: bool = True,
) -> BSR:
    """vLLM's paged layout as BSR, zero-copy: one row block per request, Bc = block_size.

    block_table int32 [num_reqs, max_blocks] (page ids; entries past a request's length are ignored);
    seq_lens [num_reqs] KV tokens per request (cached + this step's); query_start_loc [num_reqs + 1]
    (becomes qo_indptr). kv_indices is a view of block_table's storage, so later writes to the table are
    seen: kv_block_start = arange(num_reqs) * block_table.stride(0) (a table sliced from a wider buffer
    is viewed over that buffer). seq_lens / query_start_loc are used as they are when int32, converted
    otherwise. check: raise if a request's seq_len exceeds max_blocks * block_size, then validate().
    """
    _check_tensor("block_table", block_table, (_I32,), dim=2)
    _check_int("block_size", block_size, 1)
    n, max_blocks = block_table.shape
    dev = block_table.device
    seq_lens = _as_int32("seq_lens", seq_lens, (n,), dev, why="num_reqs = block_table.shape[0]")
    qo_indptr = _as_int32("query_start_loc", query_start_loc, (n + 1,), dev, why="num_reqs + 1")
    kv_indices, row_stride = _flat_rows(block_table, "block_table")
    bsr = BSR(
        qo_indptr=qo_indptr,
        kv_indices=kv_indices,
        kv_block_start=_row_starts(n, row_stride, dev),
        kv_lens=seq_lens,
        block_width=block_size,
        num_kv_blocks=num_kv_blocks,
    )
    if check:
        cap = max_blocks * block_size
        bad = _first_true(seq_lens > cap)
        if bad is not None:
            raise ValueError(
                f"seq_lens[{bad}]={int(seq_lens[bad])} does not fit block_table: max_blocks={max_blocks} * "
                f"block_size={block_size} = {cap} tokens"
            )
        bsr.validate()
    return bsr


def from_token_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: Optional[torch.Tensor] = None,
    page_size: int = 1,
    num_kv_slots: Optional[int] = None,
    check: bool = True,
) -> BSR:
    """SGLang's token table as BSR: one row block per request.

    req_to_token int32 [pool_rows, max_len] maps (pool row, token) to a KV slot; request b uses row
    req_pool_indices[b] for seq_lens[b] tokens. qo_indptr [B + 1]: this step's query rows per request
    (None: decode, one row per request). num_kv_slots: slots in the KV pool, for range checks.

    page_size 1: Bc = 1, zero-copy; kv_indices is a view of req_to_token's storage and
    kv_block_start = req_pool_indices * req_to_token.stride(0) (int64), kv_indices are slots.
    page_size P > 1 (SGLang's paged mode: a page's P slots are contiguous and page id = slot // P):
    Bc = P and kv_indices is a page table req_to_token[req_pool_indices, ::P] // P, a COPY of
    B * ceil(max_len / P) entries (rebuild it when the table changes); kv_indices are page ids into a
    cache viewed as [num_kv_slots / P, P, ...]. With check, every used slot must be page-aligned
    (req_to_token[r, t] == page(t) * P + t % P), else ValueError.
    seq_lens / qo_indptr are converted to int32 (no copy when they already are).
    """
    _check_tensor("req_to_token", req_to_token, (_I32,), dim=2)
    _check_int("page_size", page_size, 1)
    pool_rows, max_len = req_to_token.shape
    dev = req_to_token.device
    _check_tensor("req_pool_indices", req_pool_indices, _INT_DTYPES)
    if req_pool_indices.device != dev:
        raise ValueError(f"req_pool_indices must be on {dev} (req_to_token's device), got {req_pool_indices.device}")
    B = req_pool_indices.numel()
    seq_lens = _as_int32("seq_lens", seq_lens, (B,), dev, why="B = len(req_pool_indices)")
    if qo_indptr is None:
        qo_indptr = torch.arange(B + 1, dtype=_I32, device=dev)
    else:
        qo_indptr = _as_int32("qo_indptr", qo_indptr, (B + 1,), dev, why="B + 1")
    if num_kv_slots is not None:
        _check_int("num_kv_slots", num_kv_slots, 0)
        if num_kv_slots % page_size:
            raise ValueError(f"num_kv_slots={num_kv_slots} must be a multiple of page_size={page_size}")
    pool_idx = req_pool_indices.to(_I64)
    if check:
        bad = _first_true((pool_idx < 0) | (pool_idx >= pool_rows))
        if bad is not None:
            raise ValueError(f"req_pool_indices[{bad}]={int(pool_idx[bad])} is outside [0, pool_rows={pool_rows})")
        bad = _first_true(seq_lens > max_len)
        if bad is not None:
            raise ValueError(
                f"seq_lens[{bad}]={int(seq_lens[bad])} does not fit req_to_token: max_len={max_len} tokens"
            )

    if page_size == 1:
        kv_indices, row_stride = _flat_rows(req_to_token, "req_to_token")
        bsr = BSR(
            qo_indptr=qo_indptr,
            kv_indices=kv_indices,
            kv_block_start=pool_idx * row_stride,
            kv_lens=seq_lens,
            block_width=1,
            num_kv_blocks=num_kv_slots,
        )
    else:
        P = page_size
        page_table = req_to_token[:, ::P].index_select(0, pool_idx) // P  # [B, ceil(max_len / P)], a copy
        ncols = page_table.shape[1]
        if check and B:
            slots = req_to_token.index_select(0, pool_idx).to(_I64)  # [B, max_len]
            t = torch.arange(max_len, device=dev)
            expected = page_table.to(_I64).repeat_interleave(P, dim=1)[:, :max_len] * P + t % P
            wrong = (t[None, :] < seq_lens[:, None]) & (slots != expected)
            flat = _first_true(wrong.flatten())
            if flat is not None:
                b, tok = divmod(flat, max_len)
                raise ValueError(
                    f"req_to_token[{int(pool_idx[b])}, {tok}]={int(slots[b, tok])} (request {b}) is not slot "
                    f"{tok % P} of page {int(page_table[b, tok // P])}: with page_size={P} a page's slots must be "
                    f"contiguous and page-aligned (slot = page * {P} + token % {P})"
                )
        bsr = BSR(
            qo_indptr=qo_indptr,
            kv_indices=page_table.reshape(-1),
            kv_block_start=_row_starts(B, ncols, dev),
            kv_lens=seq_lens,
            block_width=P,
            num_kv_blocks=None if num_kv_slots is None else num_kv_slots // P,
        )
    if check:
        bsr.validate()
    return bsr


def from_ragged(
    kv_indptr: Union[torch.Tensor, Ragged],
    qo_indptr: Union[torch.Tensor, Ragged, None] = None,
    *,
    num_kv_tokens: Optional[int] = None,
    check: bool = True,
) -> BSR:
    """A ragged KV tensor [total, H, D] as BSR with Bc = 1: request i reads rows kv_indptr[i] : kv_indptr[i+1].

    Read the KV as a cache [total, 1, H, D] (k.unsqueeze(1)). kv_indices = arange(total) (int32),
    kv_block_start = kv_indptr[:-1] (a view when kv_indptr is int32/int64), kv_lens = diff(kv_indptr),
    contiguous=True (a ragged BatchAttention's CuTe member reads the rows directly).
    qo_indptr None: decode (one query row per request). num_kv_tokens: rows of the KV tensor (default
    kv_indptr[-1], which syncs the device).
    """
    kv_indptr = kv_indptr.indptr if isinstance(kv_indptr, Ragged) else kv_indptr
    _check_tensor("kv_indptr", kv_indptr, _INT_DTYPES)
    if kv_indptr.numel() < 1:
        raise ValueError("kv_indptr must have B + 1 >= 1 entries, got 0")
    if kv_indptr.dtype not in (_I32, _I64):
        kv_indptr = kv_indptr.to(_I64)
    dev = kv_indptr.device
    B = kv_indptr.numel() - 1
    if qo_indptr is None:
        qo_indptr = torch.arange(B + 1, dtype=_I32, device=dev)
    else:
        qo_indptr = qo_indptr.indptr if isinstance(qo_indptr, Ragged) else qo_indptr
        qo_indptr = _as_int32("qo_indptr", qo_indptr, (B + 1,), dev, why="len(kv_indptr)")
    total = int(kv_indptr[-1]) if num_kv_tokens is None else _check_int("num_kv_tokens", num_kv_tokens, 0)
    if check:
        Ragged(kv_indptr).validate("kv_indptr")
    bsr = BSR(
        qo_indptr=qo_indptr,
        kv_indices=torch.arange(total, dtype=_I32, device=dev),
        kv_block_start=kv_indptr[:-1],
        kv_lens=(kv_indptr[1:] - kv_indptr[:-1]).to(_I32),
        block_width=1,
        num_kv_blocks=total,
        contiguous=True,
    )
    if check:
        bsr.validate()
    return bsr


def from_dense_mask(mask: torch.Tensor, block_height: int, block_width: int, check: bool = True) -> BSR:
    """A block-sparse mask bool [num_q_rows, num_kv] (True = attend) as BSR.

    Row block i is query rows i*Br .. min((i+1)*Br, num_q_rows) (Br = block_height). Its KV blocks are
    the column blocks c (tokens c*Bc .. (c+1)*Bc, Bc = block_width) holding any True entry of the row
    block, in increasing order; kv_indices are those block numbers into the KV viewed as
    [ceil(num_kv / Bc), Bc, ...] (pad num_kv to a multiple of Bc). BSR is block granular: a kept block
    is attended in full by every row of its row block, including entries that are False in `mask`;
    to_dense_mask(result, ...) gives exactly what is attended, a superset of `mask` that equals it when
    the mask is constant on each (Br x Bc) tile. KV positions (kv_pos_start None) count the gathered
    tokens, not columns of `mask`: use position-free variants, or pass the mask itself to a reference.
    """
    _check_tensor("mask", mask, (torch.bool,), dim=2)
    _check_int("block_height", block_height, 1)
    _check_int("block_width", block_width, 1)
    Lq, Lkv = mask.shape
    dev = mask.device
    Br, Bc = block_height, block_width
    n_rb, n_cb = -(-Lq // Br), -(-Lkv // Bc)
    padded = torch.zeros(n_rb * Br, n_cb * Bc, dtype=torch.bool, device=dev)
    padded[:Lq, :Lkv] = mask
    kept = padded.view(n_rb, Br, n_cb, Bc).any(dim=3).any(dim=1)  # [n_rb, n_cb]
    counts = kept.sum(dim=1, dtype=_I32)
    kv_indptr = _indptr(counts)
    kv_indices = torch.nonzero(kept)[:, 1].to(_I32)  # row-major, so each row block's columns ascend
    # A kept final column block is the row block's last block and holds only Lkv - (n_cb - 1) * Bc tokens.
    tail = n_cb * Bc - Lkv
    kv_lens = counts * Bc - (kept[:, -1].to(_I32) * tail if n_cb else 0)
    qo_indptr = (torch.arange(n_rb + 1, dtype=_I32, device=dev) * Br).clamp_max(Lq)
    bsr = BSR(
        qo_indptr=qo_indptr,
        kv_indices=kv_indices,
        kv_block_start=kv_indptr[:-1],
        kv_lens=kv_lens.to(_I32),
        block_width=Bc,
        num_kv_blocks=n_cb,
    )
    if check:
        bsr.validate()
    return bsr


# ------------------------------------------------------------------------------------------- queries


def _row_space(bsr: BSR) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row block [S], index within the row block [S], query row [S]) of every row-space slot, int64."""
    rb, j = _segments(bsr.qo_lens)
    rows = torch.arange(rb.numel(), device=rb.device) if bsr.qo_rows is None else bsr.qo_rows.to(_I64)
    return rb, j, rows


def to_dense_mask(bsr: BSR, num_kv_slots: int, num_q_rows: Optional[int] = None) -> torch.Tensor:
    """What a BSR attends, as bool [num_q_rows, num_kv_slots]; exact for any BSR.

    mask[r, slot] is True when a row block covering query row r reads KV slot slot = block * Bc + offset
    (the KV cache flattened from [num_blocks, Bc, ...] to slots). num_q_rows defaults to bsr.num_q_rows.
    """
    _check_int("num_kv_slots", num_kv_slots, 0)
    dev = bsr.device
    Bc = bsr.block_width
    R = bsr.num_row_blocks
    num_q_rows = bsr.num_q_rows if num_q_rows is None else _check_int("num_q_rows", num_q_rows, 0)
    row, j = _segments(bsr.kv_num_blocks)
    blocks = bsr.kv_indices[bsr.kv_block_start.to(_I64)[row] + j].to(_I64)
    tok = j[:, None] * Bc + torch.arange(Bc, device=dev)  # [N, Bc] token index within the row block
    used = tok < bsr.kv_lens.to(_I64)[row][:, None]
    slots = (blocks[:, None] * Bc + torch.arange(Bc, device=dev))[used]
    row_of_slot = row[:, None].expand(-1, Bc)[used]
    bad = _first_true((slots < 0) | (slots >= num_kv_slots))
    if bad is not None:
        raise ValueError(
            f"row block {int(row_of_slot[bad])} reads KV slot {int(slots[bad])}, "
            f"outside [0, num_kv_slots={num_kv_slots})"
        )
    per_block = torch.zeros(R, num_kv_slots, dtype=torch.bool, device=dev)
    per_block[row_of_slot, slots] = True
    rb, _, rows = _row_space(bsr)
    if rows.numel():
        bad = _first_true((rows < 0) | (rows >= num_q_rows))
        if bad is not None:
            raise ValueError(f"query row {int(rows[bad])} is outside [0, num_q_rows={num_q_rows})")
    # A query row covered by several row blocks (merged matrices) attends the union of their KV.
    hits = torch.zeros(num_q_rows, num_kv_slots, dtype=_I32, device=dev)
    hits.index_add_(0, rows, per_block[rb].to(_I32))
    return hits > 0


def query_positions(bsr: BSR, num_q_rows: Optional[int] = None) -> torch.Tensor:
    """int32 [num_q_rows]: bottom-right aligned position of each query row of a per-request BSR.

    Row j of row block i (height h) is at kv_pos_start[i] + kv_lens[i] - h + j: the query is the last
    h tokens of the request's KV (decode, append, chunked prefill). Indexed by query row (through
    qo_rows); rows no row block covers get -1. Meant for BSRs where each query row is in one row block.
    """
    num_q_rows = bsr.num_q_rows if num_q_rows is None else _check_int("num_q_rows", num_q_rows, 0)
    rb, j, rows = _row_space(bsr)
    pos0 = bsr.kv_lens.to(_I64) - bsr.qo_lens.to(_I64)
    if bsr.kv_pos_start is not None:
        pos0 = pos0 + bsr.kv_pos_start.to(_I64)
    out = torch.full((num_q_rows,), -1, dtype=_I32, device=bsr.device)
    out[rows] = (pos0[rb] + j).to(_I32)
    return out


# ------------------------------------------------------------------------------- composable formats

_NO_LIMIT = torch.iinfo(torch.int64).max


def _with_sentinel(gid: torch.Tensor, G: int) -> torch.Tensor:
    """Group ids with -1 (no group) replaced by G, to index a per-group table padded with one entry."""
    return torch.where(gid >= 0, gid, G)


def _plan_groups(
    bsr: BSR,
    groups: Optional[tuple[torch.Tensor, torch.Tensor]],
    min_group_size: int,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group id per row block [R] (-1: none), prefix blocks per group [G], leader row block per group [G]).

    A group's prefix is capped at the whole blocks every member cached before this step's queries,
    floor((kv_len - q_len) / Bc), so every query row sees all of it under causal masking; groups with
    fewer than min_group_size members, or an empty prefix after capping, get 0 prefix blocks.
    """
    dev = bsr.device
    Bc = bsr.block_width
    R = bsr.num_row_blocks
    heights = bsr.qo_lens.to(_I64)
    start = bsr.kv_block_start.to(_I64)
    pos0 = torch.zeros(R, dtype=_I64, device=dev) if bsr.kv_pos_start is None else bsr.kv_pos_start.to(_I64)
    cap = ((bsr.kv_lens.to(_I64) - heights) // Bc).clamp_min(0)

    if groups is None:
        # Requests whose first KV block is the same physical block (and whose KV starts at the same
        # position) share it; sharing needs at least one cached block and one query row.
        eligible = (cap > 0) & (heights > 0)
        keys = torch.stack((bsr.kv_indices[start[eligible]].to(_I64), pos0[eligible]), dim=1)
        uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
        G = uniq.shape[0]
        gid = torch.full((R,), -1, dtype=_I64, device=dev)
        gid[eligible] = inverse
        requested = torch.full((G,), _NO_LIMIT, dtype=_I64, device=dev)
    else:
        if not (isinstance(groups, (tuple, list)) and len(groups) == 2):
            raise TypeError("groups must be None or a pair (group_ids int [R], prefix_lens int [G])")
        group_ids, prefix_lens = groups
        _check_tensor(
            "groups[0] (group_ids)", group_ids, _INT_DTYPES, shape=(R,), why="one group id per row block, -1 = none"
        )
        _check_tensor("groups[1] (prefix_lens)", prefix_lens, _INT_DTYPES)
        for name, t in (("groups[0] (group_ids)", group_ids), ("groups[1] (prefix_lens)", prefix_lens)):
            if t.device != dev:
                raise ValueError(f"{name} must be on {dev} (the BSR's device), got {t.device}")
        G = prefix_lens.numel()
        gid = group_ids.to(_I64)
        requested = prefix_lens.to(_I64) // Bc  # whole blocks only
        if check:
            bad = _first_true((gid < -1) | (gid >= G))
            if bad is not None:
                raise ValueError(
                    f"groups[0] (group_ids)[{bad}]={int(gid[bad])} is outside [-1, {G}) (G = len(prefix_lens))"
                )
            bad = _first_true(requested < 0)
            if bad is not None:
                raise ValueError(f"groups[1] (prefix_lens)[{bad}]={int(prefix_lens[bad])} must be >= 0")

    member = torch.nonzero(gid >= 0).flatten()
    mg = gid[member]
    size = torch.bincount(mg, minlength=G)
    leader = torch.full((G,), R, dtype=_I64, device=dev).scatter_reduce_(0, mg, member, "amin")
    gcap = torch.full((G,), _NO_LIMIT, dtype=_I64, device=dev).scatter_reduce_(0, mg, cap[member], "amin")
    target = torch.minimum(requested, gcap)
    target = torch.where(size >= min_group_size, target, torch.zeros_like(target))
    if check and bsr.kv_pos_start is not None and groups is not None:
        differs = pos0[member] != pos0[leader[mg]]
        bad = _first_true(differs & (target[mg] > 0))
        if bad is not None:
            raise ValueError(
                f"groups: row blocks {int(member[bad])} and {int(leader[mg[bad]])} of group {int(mg[bad])} "
                f"have different kv_pos_start; a shared prefix needs one position range"
            )

    if groups is not None and not check:
        return gid, target, leader
    # Longest run of leading block ids each member shares with its group's leader, up to the target;
    # equality with the leader is transitive, so the group's common run is the members' minimum.
    n_cmp = target[mg]
    m, j = _segments(n_cmp)
    mine = bsr.kv_indices[start[member][m] + j]
    theirs = bsr.kv_indices[start[leader[mg]][m] + j]
    miss = mine != theirs
    run = n_cmp.clone().scatter_reduce_(0, m[miss], j[miss], "amin")
    prefix_blocks = torch.full((G,), _NO_LIMIT, dtype=_I64, device=dev).scatter_reduce_(0, mg, run, "amin")
    prefix_blocks = torch.where(size > 0, prefix_blocks, torch.zeros_like(prefix_blocks))
    if groups is not None:
        bad = _first_true(run < n_cmp)
        if bad is not None:
            g = int(mg[bad])
            raise ValueError(
                f"groups: group {g} claims a prefix of {int(target[g])} KV blocks ({int(target[g]) * Bc} tokens), "
                f"but row block {int(member[bad])} differs from row block {int(leader[g])} at its block {int(run[bad])}"
            )
    return gid, prefix_blocks, leader


def shared_prefix_groups(bsr: BSR, min_group_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Detect shared prefixes: (group_ids int32 [R], prefix_lens int32 [G] in tokens), -1 = no group.

    Requests (row blocks) whose first KV block ids agree form a group; its prefix is the longest run of
    identical leading block ids across all members, in whole blocks, capped at what every member cached
    before this step's queries. Groups with an empty prefix or fewer than min_group_size members are
    dropped. The result can be passed to split_shared_prefix as `groups`.
    """
    _check_int("min_group_size", min_group_size, 1)
    gid, prefix_blocks, _ = _plan_groups(bsr, None, min_group_size, check=False)
    kept = prefix_blocks > 0
    # Renumber kept groups 0..K-1; dropped groups and rows in none map to -1 (through a sentinel slot).
    renumber = torch.cat((torch.where(kept, torch.cumsum(kept, 0) - 1, -1), gid.new_full((1,), -1)))
    out = renumber[_with_sentinel(gid, prefix_blocks.numel())]
    return out.to(_I32), (prefix_blocks[kept] * bsr.block_width).to(_I32)


def split_shared_prefix(
    bsr: BSR,
    groups: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    min_group_size: int = 2,
    check: bool = True,
) -> tuple[BSR, BSR]:
    """Split a per-request BSR into (prefix, suffix) BSRs whose attention states merge into the original's.

    groups: (group_ids int [R], prefix_lens int [G]): group id per row block (-1: no group) and the
    tokens its members share at the front of their KV (rounded down to whole blocks); or None to detect
    groups from identical leading KV block ids (see shared_prefix_groups). A prefix never exceeds the
    whole blocks every member cached before this step's queries, floor((kv_len - q_len) / Bc) blocks,
    so every query row sees all of it under causal masking; a group whose prefix is empty after that
    cap, or with fewer than min_group_size members, is dropped and its members keep their full KV.

    prefix: one row block per kept group, in group order, covering all its members' query rows
      (qo_rows lists them; Br > 1); KV = the prefix blocks of the group's first member (kv_block_start
      of that member), kv_pos_start = that member's (0 when the input has none).
    suffix: one row block per input row block, same query rows; kv_block_start advanced past the
      prefix blocks, kv_lens reduced by the prefix tokens, kv_pos_start raised by them.
    Both share the input's kv_indices (no KV moves, no table copy). Query rows in no group are not in
    `prefix`; its attention state there is (0, -inf), the identity of the merge.
    With explicit groups and check, every member must really hold the group leader's prefix block ids,
    else ValueError; check also validates `bsr`. Assumes one row block per request (the input's qo_rows
    cover each query row once).
    """
    _check_int("min_group_size", min_group_size, 1)
    if check:
        bsr.validate()
    dev = bsr.device
    Bc = bsr.block_width
    R = bsr.num_row_blocks
    gid, prefix_blocks, leader = _plan_groups(bsr, groups, min_group_size, check)

    G = prefix_blocks.numel()
    g_idx = _with_sentinel(gid, G)
    pb = torch.cat((prefix_blocks, prefix_blocks.new_zeros(1)))[g_idx]  # [R] prefix blocks, 0 in no group
    pos0 = torch.zeros(R, dtype=_I64, device=dev) if bsr.kv_pos_start is None else bsr.kv_pos_start.to(_I64)
    suffix = BSR(
        qo_indptr=bsr.qo_indptr,
        kv_indices=bsr.kv_indices,
        kv_block_start=(bsr.kv_block_start.to(_I64) + pb).to(bsr.kv_block_start.dtype),
        kv_lens=(bsr.kv_lens.to(_I64) - pb * Bc).to(_I32),
        block_width=Bc,
        num_kv_blocks=bsr.num_kv_blocks,
        qo_rows=bsr.qo_rows,
        kv_pos_start=(pos0 + pb * Bc).to(_I32),
    )

    kept = torch.nonzero(prefix_blocks > 0).flatten()  # kept groups, in group order
    K = kept.numel()
    new_id = torch.full((G + 1,), -1, dtype=_I64, device=dev)  # kept group -> prefix row block; else -1
    new_id[kept] = torch.arange(K, device=dev)
    rb, _, rows = _row_space(bsr)
    slot_group = new_id[g_idx[rb]]
    sel = slot_group >= 0
    slot_group, slot_rows = slot_group[sel], rows[sel]
    order = torch.argsort(slot_group, stable=True)  # group by group, members in row order
    prefix = BSR(
        qo_indptr=_indptr(torch.bincount(slot_group, minlength=K)),
        kv_indices=bsr.kv_indices,
        kv_block_start=bsr.kv_block_start[leader[kept]],
        kv_lens=(prefix_blocks[kept] * Bc).to(_I32),
        block_width=Bc,
        num_kv_blocks=bsr.num_kv_blocks,
        qo_rows=slot_rows[order].to(_I32),
        kv_pos_start=pos0[leader[kept]].to(_I32),
    )
    if check:
        prefix.validate()
        suffix.validate()
    return prefix, suffix


# ------------------------------------------------------------------------------ prefix groups (kernels)


def _groups_np(groups):
    """Prefix groups as an int64 numpy [G, 3] array (from a tensor, array or nested list)."""
    import numpy as np

    if isinstance(groups, torch.Tensor):
        groups = groups.detach().cpu().numpy()
    arr = np.asarray(groups, dtype=np.int64)
    if arr.size == 0:
        return arr.reshape(0, 3)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"prefix groups must be [G, 3] (first request, end request, prefix tokens), got shape "
                         f"{list(arr.shape)}")
    return arr


def check_prefix_groups(bsr: BSR, groups, qo_indptr=None, kv_lens=None) -> None:
    """Check prefix groups (int [G, 3]: first request, end request, prefix tokens) against a per-request BSR;
    raise ValueError naming the group and the request. A group is requests [first, end), consecutive, in no
    other group; every member holds the first member's KV block ids over the prefix's blocks and its
    kv_pos_start, and has at least the prefix cached before its query (prefix <= kv_len - q_len).
    qo_indptr / kv_lens: the host copies plan() got (default: the BSR's own). Syncs: not for the hot path."""
    import numpy as np

    g = _groups_np(groups)
    R = bsr.num_row_blocks
    qo = (bsr.qo_indptr if qo_indptr is None else torch.as_tensor(qo_indptr)).cpu().to(_I64).numpy()
    kv = (bsr.kv_lens if kv_lens is None else torch.as_tensor(kv_lens)).cpu().to(_I64).numpy()
    if len(g) == 0:
        return
    if bsr.qo_rows is not None:
        raise ValueError("prefix groups need a per-request BSR (qo_rows None): a group's rows are its requests' "
                         "consecutive query rows")
    Bc = bsr.block_width
    starts = bsr.kv_block_start.cpu().to(_I64).numpy()
    idx = bsr.kv_indices.cpu()
    pos = None if bsr.kv_pos_start is None else bsr.kv_pos_start.cpu().numpy()
    prev_end, prev_g = 0, -1
    for gi, (first, end, plen) in enumerate(g.tolist()):
        if not 0 <= first < end <= R:
            raise ValueError(f"prefix group {gi}: requests [{first}, {end}) must be non-empty and within the BSR's "
                             f"{R} row blocks")
        if first < prev_end:
            raise ValueError(f"prefix group {gi}: request {first} is also in group {prev_g} (requests [.., "
                             f"{prev_end})); groups must be disjoint and in order")
        if plen < 0:
            raise ValueError(f"prefix group {gi}: prefix length {plen} must be >= 0")
        nblk = -(-plen // Bc)
        lead = idx[int(starts[first]):int(starts[first]) + nblk]
        for r in range(first, end):  # host check, per member: fine off the hot path
            q_len = int(qo[r + 1] - qo[r])
            if plen > kv[r] - q_len:
                raise ValueError(f"prefix group {gi}: its prefix of {plen} tokens is longer than request {r}'s KV "
                                 f"before its query (kv_len {int(kv[r])}, q_len {q_len}); a prefix never reaches "
                                 f"into a member's query")
            if pos is not None and pos[r] != pos[first]:
                raise ValueError(f"prefix group {gi}: request {r} has kv_pos_start {int(pos[r])}, request {first} "
                                 f"{int(pos[first])}; a shared prefix needs one position range")
            if r == first:
                continue
            mine = idx[int(starts[r]):int(starts[r]) + nblk]
            if mine.numel() != nblk or lead.numel() != nblk:
                raise ValueError(f"prefix group {gi}: request {r}'s prefix blocks run past kv_indices")
            diff = torch.nonzero(mine != lead).flatten()
            if diff.numel():
                j = int(diff[0])
                raise ValueError(f"prefix group {gi}: request {r} reads KV block {int(mine[j])} at its block {j}, "
                                 f"request {first} block {int(lead[j])}; a group's members must share the "
                                 f"prefix's blocks")
        prev_end, prev_g = end, gi


def prefix_groups_from_table(table, cached_tokens, block_size: int, min_requests: int = 2,
                             min_prefix_tokens: int = 1, rows=None):
    """Prefix groups (int32 numpy [G, 3]: first request, end request, prefix tokens) of a host block table.

    table: int [R, W] (numpy or CPU tensor), request r's KV block ids in row r; or, with rows (int [R]), a
    larger table whose row rows[r] is request r's (vLLM's by request index: no copy of the step's rows).
    cached_tokens: int [R], the KV tokens each request holds before this step's query (kv_len - q_len).
    Consecutive requests whose leading block ids agree form a group (runs of neighbours sharing >= 1 block);
    its prefix is the run's shortest common leading run of ids, in whole blocks, capped at every member's
    cached blocks. Groups with fewer than min_requests members or a prefix under min_prefix_tokens are
    dropped. Vectorised: only neighbours whose first ids agree are compared further, over their cached blocks."""
    import numpy as np

    t = table.numpy() if isinstance(table, torch.Tensor) else np.asarray(table)
    c = cached_tokens.numpy() if isinstance(cached_tokens, torch.Tensor) else np.asarray(cached_tokens)
    r = np.arange(t.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    R = r.shape[0]
    if c.shape[0] != R:
        raise ValueError(f"cached_tokens has {c.shape[0]} entries for {R} requests")
    empty = np.zeros((0, 3), dtype=np.int32)
    if R < 2 or t.shape[1] == 0:
        return empty
    cap = np.minimum(c // block_size, t.shape[1]).astype(np.int64)  # whole cached blocks per request
    pair_cap = np.minimum(cap[1:], cap[:-1])
    cand = np.nonzero((t[r[1:], 0] == t[r[:-1], 0]) & (pair_cap > 0))[0]
    if cand.size == 0:
        return empty
    width = int(pair_cap[cand].max())
    eq = t[r[cand + 1], :width] == t[r[cand], :width]
    common = np.zeros(R - 1, dtype=np.int64)
    run = np.cumprod(eq, axis=1).sum(axis=1)
    common[cand] = np.minimum(run, pair_cap[cand])
    return prefix_groups_from_links(common, block_size, min_requests, min_prefix_tokens)


def prefix_groups_from_links(common_blocks, block_size: int, min_requests: int = 2, min_prefix_tokens: int = 1):
    """Prefix groups (int32 numpy [G, 3]: first request, end request, prefix tokens) from what each pair of
    neighbours shares: common_blocks int [R - 1], entry i the whole blocks requests i and i + 1 both hold at
    the front of their KV (already capped at both ones' cached blocks). A run of neighbours sharing >= 1 block
    is a group; its prefix is the run's smallest share. Groups with fewer than min_requests members or a
    prefix under min_prefix_tokens are dropped. The engines' ways of finding shares end here (block tables:
    prefix_groups_from_table; SGLang's radix tree: adapters.sglang.radix_shared_tokens)."""
    import numpy as np

    common = np.asarray(common_blocks, dtype=np.int64)
    link = common > 0
    if not link.any():
        return np.zeros((0, 3), dtype=np.int32)
    # runs of linked neighbours: a group is [first, end) with every neighbour pair inside linked
    edges = np.diff(np.concatenate(([0], link.astype(np.int8), [0])))
    firsts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]  # pair ranges [firsts, ends)
    # a run's shortest link: reduceat spans [firsts[i], firsts[i + 1]), its unlinked tail made too long to count
    prefix = np.minimum.reduceat(np.where(link, common, np.iinfo(np.int64).max), firsts)
    out = np.stack((firsts, ends + 1, prefix * block_size), axis=1)
    keep = (out[:, 1] - out[:, 0] >= min_requests) & (out[:, 2] >= min_prefix_tokens)
    return np.ascontiguousarray(out[keep], dtype=np.int32)
