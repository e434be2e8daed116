"""JIT/AOT machinery on the CPU: rendering, identity, arch parsing, real nvcc builds for sm_90a,
cross-process build locking, the CLI. Compiles share one session cache; the few tests that must
compile fresh modules make them unique with a random -D flag."""
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import fi_backend
from fi_backend import kernels
from fi_backend.kernels import builder
from fi_backend.kernels import (BuildError, KernelError, ModuleSpec, RenderError, merge_spec, module_identity,
                                parse_arch_list, render, render_text)

REPO = Path(__file__).resolve().parents[1]
needs_nvcc = pytest.mark.skipif(kernels.find_nvcc() is None, reason="needs nvcc")


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ)
    env.update(FI_BACKEND_CACHE_DIR=str(cache), FI_BACKEND_CUDA_ARCH_LIST="90a", PYTHONPATH=str(REPO))
    env.pop("FI_BACKEND_QUIET", None)
    env.pop("FI_BACKEND_JIT", None)
    env.update(extra)
    return env


def _cli(cache: Path, *args, timeout=300, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fi_backend.cli", *args], cwd=REPO, env=_env(cache, **extra),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def use_cache(monkeypatch):
    """Point this process's builds at a cache dir (sm_90a, progress lines on)."""
    def use(cache: Path):
        monkeypatch.setenv("FI_BACKEND_CACHE_DIR", str(cache))
        monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
        monkeypatch.delenv("FI_BACKEND_QUIET", raising=False)
        monkeypatch.delenv("FI_BACKEND_JIT", raising=False)
        return cache
    return use


@pytest.fixture(scope="session")
def merge_cache(tmp_path_factory):
    """The "merge" set built once through the CLI (`fi-backend build merge --arch 90a`)."""
    if kernels.find_nvcc() is None:
        pytest.skip("needs nvcc")
    cache = tmp_path_factory.mktemp("fi_cache")
    proc = _cli(cache, "build", "merge", "--arch", "90a", "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    return cache, proc


def _fresh_spec(tag="t") -> ModuleSpec:
    """A real module (the fp32 merge) with a unique identity, so it must be compiled."""
    return ModuleSpec(family="merge_state", template="state_merge.cu", params={"DTYPE": "float"},
                      nvcc_flags=(f"-DFI_TEST_TOKEN={uuid.uuid4().hex}",), tag=tag)


def _spec_code(spec: ModuleSpec) -> str:
    return (f"ModuleSpec(family={spec.family!r}, template={spec.template!r}, params={dict(spec.params)!r}, "
            f"nvcc_flags={spec.nvcc_flags!r}, tag={spec.tag!r})")


# ----------------------------------------------------------------------------- module sets

_GPU_TESTS = ("tests/test_decode_gpu.py", "tests/test_prefill_gpu.py", "tests/test_composable_gpu.py",
              "tests/test_deterministic_gpu.py")


def test_tests_set_covers_the_gpu_tests(tmp_path, monkeypatch):
    """The "tests" set's attention modules (what .ci/prebuild.py builds for the GPU machine) are exactly those the
    decode, prefill and deterministic GPU tests load with a built-in variant: the GPU tests run here with stand-in wrappers that
    record their specs (tests/spec_recorder.py)."""
    record = tmp_path / "specs.jsonl"
    env = {**os.environ, "FI_SPEC_RECORD": str(record), "FI_BACKEND_CUDA_ARCH_LIST": "90a",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "spec_recorder",
                           "-m", "gpu", "-o", "addopts=", *_GPU_TESTS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert record.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    tags = {r["tag"] for r in rows}
    assert len(tags) > 100 and any(t.startswith("decode_") for t in tags) and any(t.startswith("prefill_") for t in tags)
    from fi_backend.kernels.sets import specs_of
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")  # the GPU machine's: the Hopper prefill family
    prebuilt = {repr(s.memo_key): s for s in specs_of(["tests"]) if s.family in ("decode", "prefill")}
    missing = sorted({r["tag"] for r in rows if r["builtin"] and r["key"] not in prebuilt})
    assert not missing, f"{len(missing)} modules the GPU tests load are not in the tests set: {missing[:20]}"
    loaded = {r["key"] for r in rows}
    unused = sorted(f"{s.family}_{s.tag}" for key, s in prebuilt.items() if key not in loaded)
    assert not unused, f"{len(unused)} modules of the tests set that no GPU test loads: {unused[:20]}"


def test_module_sets_registered():
    """The sets .ci/prebuild.py builds by default are registered, each with modules."""
    from fi_backend.kernels.sets import module_sets
    sets = module_sets()
    for name in ("tests", "zoo", "bench", "decode", "prefill", "merge", "append"):
        assert name in sets and sets[name].specs(), name
    with pytest.raises(KeyError, match="unknown module set 'nope'; known sets: .*tests"):
        kernels.specs_of(["nope"])


def test_prebuild_takes_the_package_sets():
    """.ci/prebuild.py --list names one module directory per spec of the sets asked for (default: tests, bench,
    zoo), and refuses an unknown set by name."""
    from fi_backend.kernels.sets import specs_of
    env = {**os.environ, "FI_BACKEND_CUDA_ARCH_LIST": "90a", "PYTHONPATH": str(REPO)}
    def listed(*names):
        proc = subprocess.run([sys.executable, ".ci/prebuild.py", "--list", *names], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        return proc, proc.stdout.split()
    proc, default = listed()
    assert proc.returncode == 0, proc.stderr
    _, tests = listed("tests")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
        assert len(default) == len(set(default)) == len(specs_of(["tests", "bench", "zoo"]))
        assert len(tests) == len(specs_of(["tests"])) and set(tests) <= set(default)
    proc, _ = listed("nope")
    assert proc.returncode != 0 and "unknown module set 'nope'" in proc.stderr


# ----------------------------------------------------------------------------- rendering

def test_render_substitutes_every_placeholder():
    a, b = f"v{uuid.uuid4().hex[:6]}", str(int.from_bytes(os.urandom(2), "little"))
    out = render_text("x={{A}}; y={{ B }}; z={{A}};", {"A": a, "B": b})
    assert out == f"x={a}; y={b}; z={a};"


def test_render_missing_parameter_is_named():
    with pytest.raises(RenderError, match=r"HEAD_DIM"):
        render_text("{{DTYPE}} {{HEAD_DIM}}", {"DTYPE": "float"})


def test_render_unused_parameter_is_named():
    with pytest.raises(RenderError, match=r"SOFTCAP.*not used"):
        render_text("{{DTYPE}}", {"DTYPE": "float", "SOFTCAP": "30.0"})


def test_spec_rejects_bad_fields():
    with pytest.raises(RenderError, match="HEAD_DIM"):
        ModuleSpec("f", "t.cu", params={"HEAD_DIM": 128})
    with pytest.raises(ValueError, match="family"):
        ModuleSpec("bad name", "t.cu")
    with pytest.raises(ValueError, match="template"):
        ModuleSpec("f", "/abs/t.cu")


@pytest.mark.parametrize("dtype,ctype", [("bf16", "__nv_bfloat16"), ("fp16", "__half"), ("fp32", "float")])
def test_merge_template_renders(dtype, ctype):
    src = render(merge_spec(dtype))
    assert f"using DType = {ctype};" in src and "{{" not in src
    assert merge_spec(dtype).readable_tag() == dtype
    with pytest.raises(ValueError, match="bf16, fp16, fp32"):
        merge_spec("fp64")


def test_render_reports_missing_template(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.cu"):
        render(ModuleSpec("f", "nope.cu"), tmp_path)


# ----------------------------------------------------------------------------- identity

@pytest.fixture
def toy_csrc(tmp_path):
    csrc = tmp_path / "csrc"
    (csrc / "sub").mkdir(parents=True)
    (csrc / "toy.cu").write_text('#include "common.h"\n// {{DTYPE}} {{N}}\n')
    (csrc / "common.h").write_text('#pragma once\n#include "sub/other.cuh"\n')
    (csrc / "sub" / "other.cuh").write_text("#pragma once\n")
    (csrc / "sub" / "host_only.h").write_text("#pragma once\n")   # included by no kernel
    return csrc


def test_identity_changes_with_each_input_and_only_then(toy_csrc, monkeypatch):
    spec = ModuleSpec("toy", "toy.cu", params={"DTYPE": "float", "N": "4"})
    archs, nvcc = ("90a",), "nvcc release 13.0"

    def key(s=spec, a=archs, n=nvcc):
        return module_identity(s, a, n, csrc=toy_csrc).key

    base = key()
    assert key() == base
    # Not part of the identity: machine-specific include paths, the readable tag.
    assert key(ModuleSpec("toy", "toy.cu", params=spec.params, include_dirs=("/opt/x",))) == base
    changed = {
        "params": key(ModuleSpec("toy", "toy.cu", params={"DTYPE": "float", "N": "8"})),
        "flags": key(ModuleSpec("toy", "toy.cu", params=spec.params, nvcc_flags=("-DX",))),
        "key_extra": key(ModuleSpec("toy", "toy.cu", params=spec.params, key_extra="cutlass 4.2")),
        "archs": key(a=("90a", "100a")),
        "nvcc": key(n="nvcc release 13.1"),
    }
    (toy_csrc / "toy.cu").write_text('#include "common.h"\n// {{DTYPE}}  {{N}}\n')
    changed["source"] = key()
    (toy_csrc / "toy.cu").write_text('#include "common.h"\n// {{DTYPE}} {{N}}\n')
    assert key() == base
    (toy_csrc / "sub" / "other.cuh").write_text("#pragma once\n// edited\n")
    changed["header (included transitively)"] = key()
    (toy_csrc / "sub" / "other.cuh").write_text("#pragma once\n")
    # A header no kernel includes is not part of any module's identity.
    (toy_csrc / "sub" / "host_only.h").write_text("#pragma once\n// edited\n")
    assert key() == base
    monkeypatch.setattr(builder, "__version__", "999.0")
    changed["fi_backend version"] = key()
    monkeypatch.undo()
    assert key() == base
    monkeypatch.setenv("FI_BACKEND_NVCC_FLAGS", "-DFI_TIMELINE=1")   # experiments' flags: cached apart, compiled with
    changed["FI_BACKEND_NVCC_FLAGS"] = key()
    assert module_identity(spec, archs, nvcc, csrc=toy_csrc).flags[-1] == "-DFI_TIMELINE=1"
    monkeypatch.delenv("FI_BACKEND_NVCC_FLAGS")
    assert key() == base
    for what, k in changed.items():
        assert k != base, f"identity did not change with {what}"
    assert len(set(changed.values())) == len(changed)


def test_loaded_modules_are_memoised_per_nvcc_flags(monkeypatch):
    """A process loads a spec once per FI_BACKEND_NVCC_FLAGS (part of the module's identity), so an A/B can hold the
    same spec built two ways (perf composable --build)."""
    from fi_backend.kernels import loader
    spec = ModuleSpec("toy", "toy.cu", params={"N": "1"})
    monkeypatch.delenv("FI_BACKEND_NVCC_FLAGS", raising=False)
    plain = loader.memo_key(spec)
    monkeypatch.setenv("FI_BACKEND_NVCC_FLAGS", "-DFI_MY_SWITCH=0")
    flagged = loader.memo_key(spec)
    assert flagged != plain and flagged[0] == plain[0]
    monkeypatch.setenv("FI_BACKEND_NVCC_FLAGS", "")
    assert loader.memo_key(spec) == plain


def test_module_name_is_family_tag_hash(toy_csrc):
    ident = module_identity(ModuleSpec("toy", "toy.cu", params={"DTYPE": "__nv_bfloat16", "N": "128"}),
                            ("90a",), "v", csrc=toy_csrc)
    assert re.fullmatch(r"toy_bf16_128_[0-9a-f]{16}", ident.name), ident.name
    assert ident.name.endswith(ident.key[:16])
    named = module_identity(ModuleSpec("toy", "toy.cu", params={"DTYPE": "x" * 40, "N": "1"}, tag="custom"),
                            ("90a",), "v", csrc=toy_csrc)
    assert re.fullmatch(r"toy_custom_[0-9a-f]{16}", named.name)
    # nvcc version enters the key but not the source key (prebuilt lookup without nvcc).
    other = module_identity(ModuleSpec("toy", "toy.cu", params={"DTYPE": "__nv_bfloat16", "N": "128"}),
                            ("90a",), "w", csrc=toy_csrc)
    assert other.key != ident.key and other.source_key == ident.source_key


# ----------------------------------------------------------------------------- architectures

@pytest.mark.parametrize("text,expected", [
    ("90a", ("90a",)), ("9.0a", ("90a",)), ("sm_90a", ("90a",)), ("compute_90a", ("90a",)),
    ("SM_90A", ("90a",)), ("8.0", ("80",)), ("100a 9.0a", ("90a", "100a")),
    ("9.0a;10.0a", ("90a", "100a")), ("90a, sm_90a,9.0a", ("90a",)), (" 8.6 ; 80 ,", ("80", "86")),
    ("8.0+PTX", ("80+ptx",)), ("90a 8.0+ptx", ("80+ptx", "90a")),
])
def test_parse_arch_list(text, expected):
    assert parse_arch_list(text) == expected


def test_ptx_arch_adds_the_ptx():
    """8.0+PTX: sm_80 code plus compute_80 PTX, which a newer GPU (the H100 here) JIT-compiles."""
    assert builder.gencode_flags(parse_arch_list("8.0+PTX 90a")) == (
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80",
        "-gencode=arch=compute_90a,code=sm_90a")


@pytest.mark.parametrize("text", ["", "  ;", "hopper", "9", "sm_9x", "90b", "8.0+sass"])
def test_parse_arch_list_rejects(text):
    with pytest.raises(ValueError, match="FI_BACKEND_CUDA_ARCH_LIST"):
        parse_arch_list(text)


def test_arch_of_capability_and_resolution(monkeypatch):
    assert builder.arch_of_capability(9, 0) == "90a"
    assert builder.arch_of_capability(10, 0) == "100a"
    assert builder.arch_of_capability(8, 9) == "89"
    assert builder.arch_of_capability(12, 0) == "120"
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "sm_100a 9.0a")
    assert kernels.resolve_arch_list() == ("90a", "100a")
    assert kernels.resolve_arch_list("8.0") == ("80",)  # explicit beats the environment
    monkeypatch.delenv("FI_BACKEND_CUDA_ARCH_LIST")
    import torch
    if torch.cuda.is_available():
        assert kernels.resolve_arch_list() == (builder.arch_of_capability(*torch.cuda.get_device_capability()),)
    else:
        with pytest.raises(RuntimeError, match="FI_BACKEND_CUDA_ARCH_LIST"):
            kernels.resolve_arch_list()


def test_cache_dir_layout(monkeypatch, tmp_path):
    monkeypatch.delenv("FI_BACKEND_CACHE_DIR", raising=False)
    assert kernels.cache_dir(("90a", "100a")) == \
        Path.home() / ".cache" / "fi_backend" / fi_backend.__version__ / "90a_100a"
    monkeypatch.setenv("FI_BACKEND_CACHE_DIR", str(tmp_path / "c"))
    assert kernels.cache_dir(("90a",)) == tmp_path / "c"


# ----------------------------------------------------------------------------- real builds

@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_merge_modules_built_and_loadable(merge_cache, use_cache, dtype):
    cache, _ = merge_cache
    use_cache(cache)
    result = kernels.build(merge_spec(dtype))
    assert not result.built and result.path.is_file()  # the CLI built it; this finds it
    meta = json.loads((result.path.parent / "meta.json").read_text())
    assert meta["archs"] == ["90a"] and meta["params"] == {"DTYPE": kernels.DTYPE_C[dtype]}
    assert "-gencode=arch=compute_90a,code=sm_90a" in meta["flags"]
    assert meta["nvcc_version"] == kernels.nvcc_version(kernels.find_nvcc())

    module = kernels.load(merge_spec(dtype))  # a static-cudart .so loads without a GPU
    assert kernels.load(merge_spec(dtype)) is module
    assert module.error_string(0) == "no error"
    assert module.error_string(1) == "invalid argument"
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn = module.function("fi_merge_state", [P] * 6 + [I] * 9 + [P])
    assert module.function("fi_merge_state", [P] * 6 + [I] * 9 + [P]) is fn
    module.function("fi_merge_states", [P] * 4 + [I] * 8 + [P])
    with pytest.raises(AttributeError, match="fi_nope"):
        module.function("fi_nope", [])
    # Argument checks run before any CUDA call: empty input is a no-op, a bad head_dim is refused.
    assert fn(0, 0, 0, 0, 0, 0, 0, 4, 128, 0, 0, 0, 0, 0, 0, None) == 0
    rc = fn(0, 0, 0, 0, 0, 0, 1, 4, 12, 0, 0, 0, 0, 0, 0, None)
    with pytest.raises(KernelError, match="fi_merge_state.*invalid argument"):
        module.check(rc, "fi_merge_state")

    nm = shutil.which("nm")
    if nm:
        out = subprocess.run([nm, "-D", "--defined-only", str(result.path)], capture_output=True, text=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
        assert exported == {"fi_error_string", "fi_merge_state", "fi_merge_states"}


def test_cli_build_and_info(merge_cache):
    cache, first = merge_cache
    assert re.search(r"\[3/3\]", first.stderr) and "3 built, 0 cached, 0 failed" in first.stderr
    again = _cli(cache, "build", "merge", "--arch", "9.0a")
    assert again.returncode == 0 and "0 built, 3 cached" in again.stderr, again.stderr
    info = _cli(cache, "info")
    assert info.returncode == 0, info.stderr
    assert fi_backend.__version__ in info.stdout and "sm_90a" in info.stdout and str(cache) in info.stdout
    assert kernels.find_nvcc() in info.stdout and "release 13" in info.stdout
    for dtype in ("bf16", "fp16", "fp32"):
        assert re.search(rf"merge_state_{dtype}_[0-9a-f]{{16}} +\d", info.stdout), info.stdout
    listing = _cli(cache, "build", "--list")
    assert "merge (3 modules):" in listing.stdout and "merge_state fp16" in listing.stdout
    bad = _cli(cache, "build", "no_such_set")
    assert bad.returncode == 2 and "no_such_set" in bad.stderr and "merge" in bad.stderr


def test_prebuilt_modules_load_without_jit(merge_cache, use_cache, monkeypatch):
    cache, _ = merge_cache
    use_cache(cache)
    expected = kernels.build(merge_spec("bf16")).path
    # FI_BACKEND_JIT=0 (or no nvcc): found by source identity, whatever nvcc built it.
    monkeypatch.setenv("FI_BACKEND_JIT", "0")
    assert kernels.build(merge_spec("bf16")).path == expected
    with pytest.raises(BuildError, match="fi-backend build"):
        kernels.build(_fresh_spec())


@needs_nvcc
def test_failed_build_reports_command_and_output(tmp_path, use_cache):
    cache = use_cache(tmp_path / "cache")
    spec = ModuleSpec("merge_state", "state_merge.cu", params={"DTYPE": "float"},
                      nvcc_flags=("--no-such-nvcc-option",), tag="broken")
    with pytest.raises(BuildError) as info:
        kernels.build(spec, quiet=True)
    message = str(info.value)
    assert "--no-such-nvcc-option" in message and "command" in message
    assert re.search(r"(?i)unknown option", message), message
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]
    assert not [p for p in cache.glob("merge_state_broken_*") if p.is_dir() and not p.name.endswith(".failed")]
    kept = list(cache.glob("merge_state_broken_*.failed"))
    assert len(kept) == 1 and (kept[0] / "build.log").is_file()


@needs_nvcc
def test_concurrent_builds_build_once(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    spec = _fresh_spec("conc")
    script = textwrap.dedent(f"""
        import os, time
        from fi_backend.kernels import ModuleSpec, load
        while not os.path.exists({str(go)!r}):
            time.sleep(0.005)
        m = load({_spec_code(spec)})
        print(m.path, m.error_string(0))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=_env(cache), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    time.sleep(0.3)  # let all three reach the start line
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    paths = {o.split()[0] for o, _ in outs}
    assert len(paths) == 1 and all(o.strip().endswith("no error") for o, _ in outs)
    assert sum(e.count("fi-backend: building merge_state_conc_") for _, e in outs) == 1
    assert len([d for d in cache.iterdir() if d.is_dir()]) == 1  # one module, no temporaries left


@needs_nvcc
def test_killed_lock_holder_does_not_block_next_build(tmp_path):
    cache = tmp_path / "cache"
    spec = _fresh_spec("kill")
    # A "builder" that dies holding the lock, leaving a temporary dir and a half-published module.
    holder = textwrap.dedent(f"""
        import time
        from fi_backend.kernels import ModuleSpec, builder
        archs = ("90a",)
        ident = builder.module_identity({_spec_code(spec)}, archs, builder.nvcc_version(builder.find_nvcc()))
        root = builder.cache_dir(archs)
        root.mkdir(parents=True, exist_ok=True)
        with builder.module_lock(root, ident.name):
            (root / f".tmp-{{ident.name}}-1-dead").mkdir()
            (root / f".tmp-{{ident.name}}-1-dead" / "junk.o").write_text("x")
            (root / ident.name).mkdir()
            (root / ident.name / "partial").write_text("x")
            print(ident.name, flush=True)
            time.sleep(600)
    """)
    h = subprocess.Popen([sys.executable, "-c", holder], cwd=REPO, env=_env(cache), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        name = h.stdout.readline().strip()
        assert name.startswith("merge_state_kill_"), h.stderr.read() if h.poll() is not None else name
        b = subprocess.Popen([sys.executable, "-c", f"from fi_backend.kernels import ModuleSpec, load\n"
                              f"print(load({_spec_code(spec)}).path)"],
                             cwd=REPO, env=_env(cache), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(1.0)
        assert b.poll() is None, "the build did not wait for the lock"
    finally:
        h.send_signal(signal.SIGKILL)
        h.wait()
    out, err = b.communicate(timeout=300)
    assert b.returncode == 0, err
    assert Path(out.strip()) == cache / name / f"{name}.so"
    files = {p.name for p in (cache / name).iterdir()}
    assert {"build.ninja", f"{name}.cu", f"{name}.so", "meta.json"} <= files and "partial" not in files
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def test_cutlass_headers_lookup(tmp_path, monkeypatch):
    """The CuTe kernels' headers: a bad FI_BACKEND_CUTLASS_DIR is named; a good one (or the wheel) gives include/ and
    the version enters the spec's identity, not the path; head sizes other than 64 / 96 / 128 / 256 are refused by name."""
    from fi_backend.kernels import cutlass
    monkeypatch.setenv(cutlass.ENV, str(tmp_path))
    with pytest.raises(cutlass.CutlassNotFound, match=cutlass.ENV):
        cutlass.include_dir()
    (tmp_path / "include" / "cute").mkdir(parents=True)
    (tmp_path / "include" / "cute" / "tensor.hpp").write_text("")
    (tmp_path / "include" / "cutlass").mkdir()
    (tmp_path / "include" / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    assert cutlass.include_dir() == str(tmp_path / "include")
    assert cutlass.version() == "4.2.0"
    spec = cutlass.attn_ws_spec(128, True)
    assert spec.include_dirs == (str(tmp_path / "include"),) and "cutlass 4.2.0" in spec.key_extra
    with pytest.raises(ValueError, match="head_dim must be 64, 96, 128 or 256"):
        cutlass.attn_ws_spec(80, True)
    # three consumer warpgroups at head sizes 64 and 96 (96-token KV tiles: TMA pages of 16 or 32, any gathered);
    # gathering needs pages, and pages below 16 need gathering
    assert cutlass.attn_ws_spec(96, True, warpgroups=3, page_size=32).params["WARPGROUPS"] == "3"
    assert cutlass.attn_ws_spec(96, True, warpgroups=3, page_size=64, gather=True).params["GATHER"] == "1"
    for kw, match in (({"warpgroups": 3, "page_size": 64}, "pages of 16 or 32"), ({"warpgroups": 4}, "warpgroups"),
                      ({"gather": True}, "gather needs pages"), ({"page_size": 8}, "any with gather")):
        with pytest.raises(ValueError, match=match):
            cutlass.attn_ws_spec(96, True, **kw)
    with pytest.raises(ValueError, match="3 at head sizes 64 and 96"):
        cutlass.attn_ws_spec(128, True, warpgroups=3)
