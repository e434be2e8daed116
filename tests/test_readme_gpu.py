"""README's Python API example run as written (its two code blocks, in order, in one namespace), then its
outputs checked against the float64 reference: the softmax prefill and the FlashSigmoid variant."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fi_backend import reference as ref

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
    q, k, v, qo = ns["q"], ns["k"], ns["v"], ns["qo_indptr"]
    softmax_out, lse = ns["out"], ns["lse"]
    exec(compile(second, "README.md (a variant of your own)", "exec"), ns)
    torch.cuda.synchronize()
    sigmoid_out = ns["out"]
    for r in range(len(qo) - 1):
        b, e = int(qo[r]), int(qo[r + 1])
        o_ref, lse_ref = ref.attention(q[b:e], k[b:e], v[b:e], causal=True)
        torch.testing.assert_close(softmax_out[b:e].double(), o_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[b:e].double(), lse_ref, atol=2e-2, rtol=2e-2)
        s_ref, _ = ref.attention(q[b:e], k[b:e], v[b:e], causal=True, use_sigmoid=True,
                                 sigmoid_bias=-2.0)
        scale = max(1.0, float(s_ref.abs().max()))  # sums of up to 1000 sigmoids: tolerance by magnitude
        torch.testing.assert_close(sigmoid_out[b:e].double(), s_ref, atol=2e-2 * scale, rtol=2e-2)
