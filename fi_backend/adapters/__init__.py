"""Engine adapters: one module per engine (vllm.py, sglang.py), the only code that imports an engine.

Importing this package (or fi_backend.adapters.vllm) never imports the engine itself: the engine's
plugin hook loads the adapter, and the adapter imports the engine only when the engine asks for it.
"""


def rank_device(device, index=None):
    """The torch.device of this rank's GPU, with its index: an engine may name the device by its type alone
    (SGLang's model_runner.device is "cuda"; its gpu_id is the rank's index). `index` (the engine's) fills in a
    missing one, else the current device, which the engines set to the rank's GPU before building the model.
    Under tensor parallelism every workspace and buffer of a rank then lives on that rank's GPU, never on
    device 0 by default."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(index) if index is not None else torch.cuda.current_device())
    return device


def plan_decode_step(decode, graph_prefill, qo_cpu, kv_cpu, bsr, groups, kw: dict, counts: dict, plan_other: bool):
    """One decode step of an adapter with shared-prefix groups (docs/composable.md): (the wrapper that runs it, the
    other one planned idle, or None). Groups that pay for the prefill kernel (scheduler.decode_groups_pay) are
    planned on graph_prefill first, which runs the step where the planner keeps any; else the decode wrapper runs
    it, given the groups for its own verdict (a 16-row tile's requests read the prefix once). plan_other: a graph
    launches both wrappers, so the other one gets an idle plan (the same rows, no items). counts: the adapter's
    plan counters (decode, prefill, grouped_decode)."""
    from fi_backend.scheduler import decode_groups_pay
    active = decode
    if groups is not None and decode_groups_pay(groups, len(kv_cpu)):
        graph_prefill.plan(qo_cpu, kv_cpu, bsr, prefix_groups=groups, **kw)
        if graph_prefill.plan_info.shared_groups > 0:
            active = graph_prefill
    if active is decode:
        decode.plan(qo_cpu, kv_cpu, bsr, prefix_groups=groups, **kw)
        counts["decode"] += 1
        counts["grouped_decode"] += groups is not None and decode.plan_info.shared_groups > 0
    else:
        counts["prefill"] += 1
        counts["grouped_decode"] += 1
    if not plan_other:
        return active, None
    other = graph_prefill if active is decode else decode
    other.plan(qo_cpu, kv_cpu, bsr, idle=True, **kw)
    return active, other


class RaggedRows:
    """A step's new prompts over their own K / V rows (the adapters' fresh wrappers): the contiguous BSR whose request
    i reads rows qo_indptr[i] .. + kv_lens[i] (its keys are its queries), with kv_indices an identity made once and
    grown to the longest step seen (the tile family reads it; the CuTe member does not)."""

    def __init__(self):
        self._ident = None

    def bsr(self, qo_indptr, kv_lens, rows: int):
        import torch
        from fi_backend.formats import BSR
        if self._ident is None or self._ident.numel() < rows:
            self._ident = torch.arange(max(rows, 2 * (0 if self._ident is None else self._ident.numel())),
                                       dtype=torch.int32, device=qo_indptr.device)
        return BSR(qo_indptr=qo_indptr, kv_indices=self._ident, kv_block_start=qo_indptr[:-1], kv_lens=kv_lens,
                   block_width=1, num_kv_blocks=rows, contiguous=True)


def whole_prompts_refusal(kv_lens, q_lens, remedy: str):
    """Encoder-only layers keep no KV cache, so each request of a step must be a whole prompt (its keys are its
    queries): None where kv_lens (CPU) equals q_lens, else the error message naming up to 8 requests and `remedy`."""
    import torch
    kv_lens = kv_lens.to(q_lens.dtype)
    if torch.equal(kv_lens, q_lens):
        return None
    bad = torch.nonzero(kv_lens != q_lens).flatten().tolist()[:8]
    return (f"fi-backend runs encoder-only attention on each prompt whole in one step (no KV cache holds a prompt's "
            f"earlier tokens): requests {bad} have {kv_lens[bad].tolist()} tokens against {q_lens[bad].tolist()} "
            f"in this step ({remedy})")
