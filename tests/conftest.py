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
def _free_gpu_memory(request):
    """After each GPU test: collect reference cycles, so a test's device tensors (wrappers, workspaces, KV caches)
    are freed before the next test allocates, not whenever the cyclic collector next runs a full pass; and with
    FI_TEST_MEMORY=path, append the test's id and the CUDA memory still allocated after it (GiB)."""
    yield
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        return
    import gc
    import os
    gc.collect()
    path = os.environ.get("FI_TEST_MEMORY")
    if path:
        with open(path, "a") as f:
            f.write(f"{torch.cuda.memory_allocated() / 2**30:8.2f} {request.node.nodeid}\n")
