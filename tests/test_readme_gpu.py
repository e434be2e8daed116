"""README's Python API example run as written (its two code blocks, in order, in one namespace), then its
outputs checked against the float64 reference: the softmax prefill and the FlashSigmoid variant."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from attention_cases import TOL, check, reference

pytestmark = pytest.mark.gpu

README = Path(__file__).resolve().parents[1] / "README.md"


def _api_blocks() -> list[str]:
    """The indented code blocks of README's "## Python API" section, dedented."""
    text = README.read_text()
    start = text.index("## Python API")
    section = text[start:text.index("\n## ", start + 1)]
    blocks = re.findall(r"((?:^    .*\n|^\n)+)", section, flags=re.M)
    code = [re.sub(r"^    ", "", b, flags=re.M).strip("\n") for b in blocks if b.strip()]
    assert len(code) == 2, f"expected the API example and the variant example, found {len(code)} blocks"
    return code


def test_readme_python_api_runs_and_agrees_with_the_reference():
    first, second = _api_blocks()
    ns: dict = {}
    exec(compile(first, "README.md (Python API)", "exec"), ns)
    torch.cuda.synchronize()
    q, k, v = ns["q"], ns["k"], ns["v"]
    softmax_out, lse = ns["out"], ns["lse"]
    exec(compile(second, "README.md (a variant of your own)", "exec"), ns)
    torch.cuda.synchronize()
    sigmoid_out = ns["out"]
    kv = (k.unsqueeze(1), v.unsqueeze(1))   # the example's ragged K/V as pages of one token
    o_ref, lse_ref = reference(q, *kv, ns["bsr"], causal=True)
    check(softmax_out, lse, o_ref, lse_ref, TOL[torch.bfloat16], "README's prefill")
    s_ref, _ = reference(q, *kv, ns["bsr"], causal=True, use_sigmoid=True, sigmoid_bias=-2.0)
    check(sigmoid_out, None, s_ref, None, TOL[torch.bfloat16], "README's FlashSigmoid variant")
