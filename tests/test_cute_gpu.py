"""The CuTe probe (csrc/attention/cute/qk_tile.cu: S = Q K^T of 64 x 128 tiles by one warpgroup's GMMA, CUTLASS /
CuTe SM90 atoms) against float64, the first piece of issue 30's CuTe member (docs/prefill.md). Needs an sm_90a GPU and
the nvidia-cutlass wheel's headers (fi_backend.kernels.cutlass); the CPU tests of the header lookup are in
test_kernels_build.py."""
import ctypes

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("D", [64, 128])
def test_qk_tile(D):
    pytest.importorskip("cutlass_library")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a only")
    from fi_backend import kernels
    from fi_backend.kernels import cutlass
    module = kernels.load(cutlass.qk_tile_spec(D))
    run = module.function("fi_cute_qk_tile", [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p])
    tiles = 7
    q = torch.randn(tiles, 64, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tiles, 128, D, device="cuda", dtype=torch.bfloat16)
    s = torch.full((tiles, 64, 128), float("nan"), device="cuda", dtype=torch.float32)
    rc = run(q.data_ptr(), k.data_ptr(), s.data_ptr(), tiles, torch.cuda.current_stream().cuda_stream)
    assert rc == 0, f"launch failed: {rc}"
    torch.cuda.synchronize()
    ref = q.double() @ k.double().transpose(1, 2)
    err = ((s.double() - ref).abs() / (ref.abs() + 1)).max().item()
    assert err < 1e-5, f"max relative error {err} (D={D})"
