"""A pytest plugin that runs the GPU tests on a machine without a GPU to learn which attention modules they
would load (tests/test_kernels_build.py: test_tests_set_covers_the_gpu_tests). Every BatchAttention the
tests construct, through attention_cases.make_wrapper or directly, records the specs of its tile family
and is a stand-in that does nothing; run_case, check and the reference are no-ops and tensors live on the
CPU. A test that fails after its wrappers are made is fine: only the recorded specs count. They are
written as JSON lines {"tag": ..., "key": repr(memo_key), "builtin": whether the variant is a built-in one}
to $FI_SPEC_RECORD.

    FI_SPEC_RECORD=/tmp/specs.jsonl FI_BACKEND_CUDA_ARCH_LIST=90a python3 -m pytest -p spec_recorder -m gpu tests/...
"""
from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

_RECORD = os.environ.get("FI_SPEC_RECORD")


def _record_wrapper(head_dim, num_qo_heads, num_kv_heads, q_dtype, kv_dtype, variant, kernel, tuning,
                    deterministic) -> None:
    from fi_backend import variants as V
    from fi_backend import wrappers as W
    from fi_backend.attention import _deterministic
    kv_dtype = q_dtype if kv_dtype is None else kv_dtype
    specs = W.attention_specs(variant, head_dim, W.Q_DTYPES[q_dtype], W.KV_DTYPES[kv_dtype],
                              num_qo_heads // num_kv_heads, tuning, kernel, _deterministic(deterministic))
    builtin = V.BUILTIN_VARIANTS.get(variant.name) is variant  # a test's own variant is JIT-built where it runs
    with open(_RECORD, "a") as f:
        for spec in specs:
            f.write(json.dumps({"tag": f"{spec.family}_{spec.tag}", "key": repr(spec.memo_key), "builtin": builtin})
                    + "\n")


class _BatchAttention(mock.MagicMock):
    """Records the family a real BatchAttention would load; anything else is a mock."""

    def __init__(self, workspace=None, num_qo_heads=1, num_kv_heads=1, head_dim=128, *, q_dtype=torch.bfloat16,
                 kv_dtype=None, page_size=16, kv_layout="NHD", variant=None, kernel="decode", tuning=None,
                 deterministic=None, **_):
        super().__init__()
        from fi_backend import variants as V
        _record_wrapper(head_dim, num_qo_heads, num_kv_heads, q_dtype, kv_dtype, variant or V.DEFAULT, kernel, tuning,
                        deterministic)

    def _get_child_mock(self, **kw):
        return mock.MagicMock(**kw)

    @staticmethod
    def recommended_num_ctas(device, num_qo_heads, num_kv_heads, head_dim, *, q_dtype=torch.bfloat16, kv_dtype=None,
                             variant=None, kernel="decode", tuning=None, deterministic=None):
        return 132

    @staticmethod
    def query_tile_rows(num_qo_heads, num_kv_heads, head_dim, *, q_dtype=torch.bfloat16, kv_dtype=None,
                        variant=None, kernel="decode", tuning=None, deterministic=None):
        return 128

    @staticmethod
    def workspace_for(*args, **kwargs):
        return mock.MagicMock()


def _lazy():
    return _BatchAttention, mock.MagicMock


def _noop(*args, **kwargs):
    return None


def _reference(q, *args, **kwargs):
    return torch.zeros_like(q), None


_PATCHES = {"_lazy": _lazy, "run_case": _noop, "run_variant_case": _noop, "check": _noop, "reference": _reference,
            "DEV": "cpu"}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    import attention_cases
    for name, value in _PATCHES.items():
        setattr(attention_cases, name, value)
    for item in items:
        item.own_markers[:] = [m for m in item.own_markers if m.name != "skip"]  # conftest's "needs a CUDA GPU"
        for name, value in _PATCHES.items():
            if hasattr(item.module, name):
                setattr(item.module, name, value)
