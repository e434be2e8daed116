"""Every kernel module the model zoo needs builds with nvcc for sm_90a, and for Ampere / Ada as `8.0+PTX`, on a
machine without a GPU.

The union of models.modules_of over every zoo model that models.check accepts and over the TP-sliced
ranks of the large ones (models.tp_slices: a rank whose KV heads are replicated has its own group), decode
and prefill, bf16 and fp8 e4m3 KV, bf16 queries, deduplicated, is built in parallel (kernels.build_many, as `fi-backend
build --jobs` does) into $FI_BACKEND_CACHE_DIR if set (so CI can keep it between runs), else a temporary
cache. About 120 modules at 3-10 s of nvcc each: minutes on two cores, seconds when cached."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fi_backend import env, kernels, models

REPO = Path(__file__).resolve().parents[1]
needs_nvcc = pytest.mark.skipif(kernels.find_nvcc() is None, reason="needs nvcc")
ARCHS = ("90a",)


@pytest.fixture(scope="module")
def zoo_cache(tmp_path_factory):
    """The cache the zoo's modules go to: $FI_BACKEND_CACHE_DIR, else a fresh temporary one."""
    given = os.environ.get(env.CACHE_DIR)
    return Path(given) if given else tmp_path_factory.mktemp("fi_zoo_cache")


@pytest.fixture
def sm90a(monkeypatch, zoo_cache):
    monkeypatch.setenv(env.CACHE_DIR, str(zoo_cache))
    monkeypatch.setenv(env.CUDA_ARCH_LIST, " ".join(ARCHS))   # names the modules as for an H100 (prefill family)
    monkeypatch.delenv(env.JIT, raising=False)
    return zoo_cache


def zoo_modules():
    """({memo_key: (spec, [names of the models that need it])}, {model name: error naming its modules}) over
    every zoo model that check() accepts and every TP-sliced rank of the large ones."""
    needed, errors = {}, {}
    for model in list(models.ZOO) + models.tp_slices():
        if not models.check(model)[0]:
            continue
        try:
            specs = models.modules_of(model)
        except Exception as e:   # an accepted model whose modules cannot even be named: a bug, reported below
            errors[model.name] = f"{type(e).__name__}: {e}"
            continue
        for spec in specs:
            needed.setdefault(spec.memo_key, (spec, []))[1].append(model.name)
    return needed, errors


def _first_error_line(error: Exception) -> str:
    lines = [l.strip() for l in str(error).splitlines() if l.strip()] or [type(error).__name__]
    return next((l for l in lines if "error" in l.lower()), lines[0])[:300]


@needs_nvcc
def test_every_zoo_module_builds_for_sm90a(sm90a):
    _build_zoo(ARCHS, sm90a)


@needs_nvcc
def test_every_zoo_module_builds_for_ampere_and_ada(monkeypatch, zoo_cache):
    """The mma.sync modules as `8.0+PTX` builds them (sm_80 code and compute_80 PTX), at shapes that fit the least
    shared memory the PTX may meet (sm_86 / sm_89's 99 KiB: fi_backend.shapes.smem_per_cta)."""
    monkeypatch.setenv(env.CACHE_DIR, str(zoo_cache))
    monkeypatch.setenv(env.CUDA_ARCH_LIST, "80+ptx")
    monkeypatch.delenv(env.JIT, raising=False)
    _build_zoo(("80+ptx",), zoo_cache)


def _build_zoo(archs, cache):
    needed, spec_errors = zoo_modules()
    accepted = [m.name for m in list(models.ZOO) + models.tp_slices() if models.check(m)[0]]
    assert accepted and needed, "the zoo needs no modules"
    specs = [spec for spec, _ in needed.values()]
    jobs = os.cpu_count() or 1
    print(f"\nzoo ({' '.join(archs)}): {len(accepted)} models and TP ranks accepted, {len(specs)} modules, {jobs} jobs, "
          f"cache {cache}", flush=True)
    start = time.perf_counter()
    results = kernels.build_many(specs, archs=archs, jobs=jobs, quiet=True)
    elapsed = time.perf_counter() - start
    built = sum(1 for r in results if not isinstance(r, Exception) and r.built)
    failed = [(spec, needed[spec.memo_key][1], r) for spec, r in zip(specs, results) if isinstance(r, Exception)]
    print(f"zoo: {built} built, {len(specs) - built - len(failed)} cached, {len(failed)} failed in {elapsed:.0f} s",
          flush=True)
    report = [f"{name}: modules_of raised {error}" for name, error in spec_errors.items()]
    report += [f"{spec.family} {spec.readable_tag()} (needed by {', '.join(names)}): {_first_error_line(error)}"
               for spec, names, error in failed]
    assert not report, (f"{len(spec_errors)} accepted models without modules, {len(failed)} of {len(specs)} zoo "
                        "modules failed to build:\n" + "\n".join(report))


@needs_nvcc
def test_cli_builds_one_model_into_the_zoo_cache(sm90a):
    """`fi-backend build --model` builds exactly modules_of(model), one progress line each."""
    model = models.find("Llama-3.1-8B")
    specs = models.modules_of(model)
    proc = subprocess.run([sys.executable, "-m", "fi_backend.cli", "build", "--model", "llama-3.1-8b", "--arch", "90a",
                           "--jobs", str(os.cpu_count() or 1)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("[")]
    assert len(lines) == len(specs)
    assert sorted(l.split("]", 1)[1].split()[0].rsplit("_", 1)[0] for l in lines) == sorted(  # "[ 1/11] name ..."
        f"{s.family}_{s.readable_tag()}" for s in specs)


def test_zoo_modules_include_the_tp_ranks(monkeypatch):
    """The TP ranks whose KV heads are replicated need modules no whole model needs (StarCoder2-15B TP8: group 6)."""
    monkeypatch.setenv(env.CUDA_ARCH_LIST, " ".join(ARCHS))
    needed, errors = zoo_modules()
    assert not errors
    users = {name for _, names in needed.values() for name in names}
    assert {"Llama-3.1-70B TP8", "Qwen2.5-32B TP4", "StarCoder2-15B TP8"} <= users
    only_tp = [spec for spec, names in needed.values() if all(" TP" in n for n in names)]
    assert only_tp and all("_h6" in spec.readable_tag() for spec in only_tp), [s.readable_tag() for s in only_tp]
