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
