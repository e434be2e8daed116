"""Shapes fit the shared memory of the GPUs their modules are built for (fi_backend.shapes.smem_per_cta).

The mma.sync kernels run on Ampere and Ada too, where a CTA may use 163 KiB (sm_80, sm_87) or 99 KiB (sm_86, sm_89),
not Hopper's 227. A shape over the limit fails at its first launch (cudaFuncSetAttribute), so the shapes are made to
fit when they are chosen, and a shape that cannot is refused when its spec is made: at an engine's start-up. No GPU:
the shapes are checked by the Python mirror of the kernels' layout, and a few modules are built for sm_86 and their
compiled layout read back."""
import os

import pytest

from fi_backend import kernels, models, shapes, variants as V
from fi_backend import wrappers as W

nvcc = pytest.mark.skipif(kernels.find_nvcc() is None, reason="needs nvcc")

LIMITS = {"80": 163 * 1024, "86": 99 * 1024, "89": 99 * 1024, "80+ptx": 99 * 1024, "90a": 227 * 1024,
          "80 90a": 163 * 1024, "86 90a": 99 * 1024}


@pytest.fixture
def arch(monkeypatch, request):
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", request.param)
    return request.param


@pytest.mark.parametrize("arch", sorted(LIMITS), indirect=True)
def test_limit_is_the_least_of_the_arch_list(arch):
    assert shapes.smem_per_cta() == LIMITS[arch]


def test_limit_without_device_or_arch_list_is_hoppers(monkeypatch):
    monkeypatch.delenv("FI_BACKEND_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(kernels, "resolve_arch_list", lambda archs=None: (_ for _ in ()).throw(RuntimeError("none")))
    assert shapes.smem_per_cta() == shapes.SMEM_PER_CTA


@pytest.mark.parametrize("arch", ["80", "86", "89", "80+ptx"], indirect=True)
def test_every_zoo_model_fits(arch):
    """Every zoo model's decode and prefill shapes (each variant it needs, bf16 and fp8 KV, every family member) fit
    the arch's shared memory, so its modules can be named (models.modules_of raises on a shape that does not)."""
    limit = shapes.smem_per_cta()
    checked = 0
    for model in models.ZOO:
        if not models.check(model)[0]:
            continue
        assert models.modules_of(model), model.name
        d, group = model.head_dim, model.num_qo_heads // model.num_kv_heads
        for variant in models.variants_of(model):
            for kv_bytes in (2, 1):
                for m in range(shapes.decode_family_size(d, kv_bytes, group, bool(variant.key_transform))):
                    shape = shapes._kernel_shape(d, kv_bytes, group, bool(variant.key_transform), member=m)
                    assert shapes._smem_bytes(d, kv_bytes, shape) <= limit, (model.name, "decode", m, shape)
                for shape in shapes._prefill_family(d, kv_bytes, variant=variant):
                    assert not shape["wgmma"]
                    assert shapes._prefill_smem_bytes(d, kv_bytes, shape) <= limit, (model.name, "prefill", shape)
                    checked += 1
    assert checked > 50


def test_hopper_shapes_unchanged(monkeypatch):
    """On sm_90a every table shape fits as it is: the fit changes nothing there."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    assert shapes._kernel_shape(128, 2, 16) == {"rows": 16, "hpc": 16, "warps": 4, "sub": 1, "stages": 3}
    assert shapes._kernel_shape(128, 2, 16, member=1) == {"rows": 16, "hpc": 16, "warps": 8, "sub": 1, "stages": 3}
    assert shapes._kernel_shape(256, 2, 2) == {"rows": 8, "hpc": 2, "warps": 2, "sub": 1, "stages": 2}
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90")   # the mma.sync family at Hopper's limit: the table's
    assert [(s["warps"], s["mfrags"], s["tile"], s["stages"]) for s in shapes._prefill_family(128, 2)] == \
        [(8, 2, 64, 2), (8, 1, 64, 3)]


@pytest.mark.parametrize("arch", ["86"], indirect=True)
def test_shapes_shrink_in_order(arch):
    """Fewer stages first, then (decode) fewer warps or (prefill) KV tiles of fewer tokens."""
    assert shapes._kernel_shape(128, 2, 16) == {"rows": 16, "hpc": 16, "warps": 4, "sub": 1, "stages": 2}
    assert shapes._kernel_shape(256, 2, 2) == {"rows": 8, "hpc": 2, "warps": 2, "sub": 1, "stages": 2}
    assert [(s["warps"], s["mfrags"], s["tile"], s["stages"], s["step"]) for s in shapes._prefill_family(128, 2)] == \
        [(8, 2, 32, 2, 32), (8, 1, 64, 2, 64)]


@pytest.mark.parametrize("arch,size", [("90a", 2), ("80", 2), ("86", 1), ("80+ptx", 1)], indirect=["arch"])
def test_decode_family_is_one_module_where_its_members_shrink_to_one_shape(arch, size):
    """8- and 16-row tiles at head size 128: member 1 (8 x 1 x 3) fits as 8 x 1 x 2 in 163 KiB, and shrinks to member
    0's 4 x 1 x 2 in 99 KiB, where a second module would be the same kernel."""
    for group in (4, 16):
        assert shapes.decode_family_size(128, 2, group) == size
        shaped = [shapes._kernel_shape(128, 2, group, member=m) for m in range(size)]
        assert len({tuple(sorted(s.items())) for s in shaped}) == size


@pytest.mark.parametrize("arch", ["86"], indirect=True)
def test_a_shape_that_cannot_fit_is_refused_by_name(arch):
    with pytest.raises(ValueError, match=r"needs \d+ bytes of shared memory; a CTA may use at most 101376 on sm_86"):
        W.decode_spec(V.DEFAULT, 128, "bf16", "bf16", 4, tuning={"warps": 8, "sub": 2, "stages": 3})


@nvcc
def test_compiled_layout_within_sm86(tmp_path, monkeypatch):
    """Modules built for sm_86 at the shrunk shapes compile, and their layout (prefill::Config / decode::Config's
    kSmemBytes, read from the built module) is the mirror's and within 99 KiB."""
    monkeypatch.setenv("FI_BACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "86")
    monkeypatch.setenv("FI_BACKEND_QUIET", "1")
    cases = [("decode", 256, 2, 0), ("decode", 128, 16, 0), ("prefill", 128, 4, 0), ("prefill", 128, 4, 1)]
    specs = [(W.decode_spec if k == "decode" else W.prefill_spec)(V.DEFAULT, d, "bf16", "bf16", g,
                                                                  **({"member": m} if m else {}))
             for k, d, g, m in cases]
    results = kernels.build_many(specs, archs="86", jobs=min(4, os.cpu_count() or 1))
    failed = [(s.tag, r) for s, r in zip(specs, results) if isinstance(r, Exception)]
    assert not failed, failed
    for k, d, g, m in cases:
        launcher = W._launcher(V.DEFAULT, d, "bf16", "bf16", g, kernel=k, member=m)
        if k == "decode":
            mirror = shapes._smem_bytes(d, 2, shapes._kernel_shape(d, 2, g, member=m))
        else:
            mirror = shapes._prefill_smem_bytes(d, 2, shapes._prefill_shape(d, 2, g, m, V.DEFAULT))
        assert launcher.smem_bytes == mirror <= 99 * 1024, (k, d, g, m, launcher.smem_bytes, mirror)
