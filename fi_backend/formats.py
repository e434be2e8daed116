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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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

    @property
    def num_row_blocks(self) -> int:
        return self.qo_indptr.numel() - 1
