"""Attention-state merge for the benchmarks (perf.kernels): the same merge as PyTorch ops (the portable
anchor). fi_backend.ops.merge_state / merge_states are ours, flashinfer.merge_state / merge_states the other
anchor (its log-sum-exp is base 2: the same tensors time the same work, so only the timing compares).
"""
from __future__ import annotations

import torch


def torch_merge_state(v_a, s_a, v_b, s_b):
    """The anchor: the same math in PyTorch ops (fp32), without -inf handling."""
    m = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)
    d = w_a + w_b
    v = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / d[..., None]
    return v.to(v_a.dtype), m + torch.log(d)


def torch_merge_states(v, s):
    m = s.amax(dim=1, keepdim=True)
    w = torch.exp(s - m)
    d = w.sum(dim=1)
    out = (v.float() * w[..., None]).sum(dim=1) / d[..., None]
    return out.to(v.dtype), m.squeeze(1) + torch.log(d)
