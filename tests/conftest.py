import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _report_gpu_memory(request):
    """FI_TEST_MEMORY=path: append each GPU test's id and the CUDA memory still allocated after it (GiB), to find
    a test that keeps device memory alive (the sanitizer run's growth: .ci/gpu sanitize)."""
    yield
    import os
    path = os.environ.get("FI_TEST_MEMORY")
    if path and "gpu" in request.keywords and torch.cuda.is_available():
        with open(path, "a") as f:
            f.write(f"{torch.cuda.memory_allocated() / 2**30:8.2f} {request.node.nodeid}\n")


@pytest.fixture(autouse=True)
def _tile_family_unless_cute(request, monkeypatch):
    """GPU tests run the prefill tile family they were written for: where the nvidia-cutlass wheel is installed,
    prefill wrappers of pages of 16..256 tokens would load the CuTe member (fi_backend/cute_member.py) instead and
    build its modules lazily, about 40 s each. Files that test the member set CUTE_MEMBER = True; FI_TEST_CUTE=1
    leaves the member on in every GPU test."""
    import os
    if ("gpu" in request.keywords and not getattr(request.module, "CUTE_MEMBER", False)
            and os.environ.get("FI_TEST_CUTE") != "1"):
        monkeypatch.setenv("FI_BACKEND_PREFILL_CUTE", "0")


@pytest.fixture
def recorded_prepare(monkeypatch):
    """BatchAttention.prepare (an engine's start builds every module its wrappers load, in parallel) recorded as
    (args, keywords) calls instead of building: for adapter tests whose wrappers are stand-ins."""
    from fi_backend.wrappers import BatchAttention
    calls = []
    monkeypatch.setattr(BatchAttention, "prepare", staticmethod(lambda *a, **kw: calls.append((a, kw)) or []))
    return calls
