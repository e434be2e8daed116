"""Where ptxas put the CuTe CTA's P.V wait, on the CPU (a build for sm_90a, read with cuobjdump): after every
exponential of the step's softmax, so the exponentials overlap the P.V in flight (FlashAttention-3's overlap).
ptxas hoisted it before them until the kernel pinned it (`ss.pin` in attn_ws.cu; docs/prefill.md, "Where the
cycles go against vLLM's FA3"). Also: no new local memory, and no wgmma serialised (one wait a wgmma)."""

import pytest

from fi_backend import kernels

pytest.importorskip("cutlass_library", reason="needs CUTLASS's headers (the hopper extra)")
waits_tool = pytest.importorskip("perf.tools.wgmma_waits")


def _have_cuobjdump() -> bool:
    try:
        waits_tool.cuobjdump()
        return True
    except SystemExit:
        return False


pytestmark = [pytest.mark.skipif(kernels.find_nvcc() is None, reason="needs nvcc"),
              pytest.mark.skipif(not _have_cuobjdump(), reason="needs cuobjdump (the test extra's wheel)")]

# (head size, causal, page size, consumer warpgroups, local loads / stores at most): the shapes whose loops differ
# most, each as the member builds it (cute_member.specs: its ping-pong and lazy rescale as they are set). Head size
# 64's three consumer warpgroups hold fewer registers a thread: ptxas keeps 27 scalars in local memory there (as
# before the pin); more would be new spilling.
MEMBERS = [(128, False, 0, 2, 0), (128, True, 16, 2, 0), (64, True, 0, 3, 27), (256, True, 16, 2, 56)]


def _member_spec(head_dim, causal, page_size, warpgroups):
    import torch

    from fi_backend import cute_member
    specs = [s for s in cute_member.specs(head_dim, torch.bfloat16, page_size)
             if s.params["CAUSAL"] == str(int(causal)) and s.params["WARPGROUPS"] == str(warpgroups)
             and s.params["PAGE"] == str(page_size)]  # a paged member's list holds its staging's ragged modules too
    assert len(specs) == 1, specs
    return specs[0]


@pytest.mark.parametrize("head_dim,causal,page_size,warpgroups,local_max", MEMBERS,
                         ids=[f"d{d}_{'causal' if c else 'full'}_page{p}_wg{w}" for d, c, p, w, _ in MEMBERS])
def test_pv_wait_after_the_exponentials(head_dim, causal, page_size, warpgroups, local_max, tmp_path, monkeypatch):
    monkeypatch.setenv("FI_BACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    from fi_backend.kernels import builder
    r = waits_tool.report(str(builder.build(_member_spec(head_dim, causal, page_size, warpgroups)).path))
    assert r["spills"] <= local_max, f"{r['spills']} local loads / stores, at most {local_max} expected"
    assert r["mmas"] >= 8 and r["deps"] <= 6, f"wgmma serialised: {r['deps']} waits for {r['mmas']} HGMMA"
    assert r["waits"], "no wait on S with a P.V in flight: the overlap loop is gone"
    for _, _, before, after in r["waits"]:
        # a step's softmax: one exponential a logit (64 at 128 keys over a warpgroup's 64 rows) plus the rescales
        assert before["MUFU"] >= 32, f"P.V wait before the exponentials: before {dict(before)}, after {dict(after)}"
        assert after["MUFU"] == 0, f"exponentials after the P.V wait: {dict(after)}"
