"""Toolchain, cache and build: nvcc, architectures, module identity, ninja, locking, publishing.

Cache layout (root = $FI_BACKEND_CACHE_DIR, else ~/.cache/fi_backend/<version>/<archs joined by '_'>):

    <root>/<module>/<module>.so     the built module          (<module> = <family>_<tag>_<hash16>)
    <root>/<module>/<module>.cu     its rendered source
    <root>/<module>/build.ninja     the exact nvcc command (rerun: ninja -C <root>/<module>)
    <root>/<module>/meta.json       spec, archs, flags, nvcc version, identity keys, build time
    <root>/<module>.lock            flock'ed while a process builds <module>
    <root>/.tmp-<module>-<pid>-<r>  a build in progress (or a leftover from a killed one)
    <root>/<module>.failed/         sources and log of the last failed build

A module directory appears only complete: it is built in a temporary directory and published with an
atomic rename, under an flock that the kernel drops when its holder dies.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple, Union

from .. import env
from .._version import __version__
from .spec import ModuleSpec, csrc_dir, render

# Standard flags, in the identity. -fvisibility=hidden and --exclude-libs keep everything but the
# FI_EXPORT launchers (and the static cudart) private to the .so.
BASE_FLAGS: Tuple[str, ...] = (
    "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", "-DNDEBUG",
    "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
    "-shared", "--cudart", "static", "-Xlinker", "--exclude-libs,ALL",
)
ArchList = Tuple[str, ...]


class BuildError(RuntimeError):
    """nvcc failed, or no module can be had (no nvcc and nothing prebuilt)."""


# ----------------------------------------------------------------------------- architectures

_ARCH = re.compile(r"^(\d+)(?:\.(\d))?([af]?)(\+ptx)?$")


def parse_arch_list(text: Union[str, Iterable[str]], *, source: str = env.CUDA_ARCH_LIST) -> ArchList:
    """Architectures from "9.0a", "90a", "sm_90a" or "compute_90a" entries separated by spaces,
    ';' or ','; "8.0+PTX" adds the PTX (newer GPUs JIT-compile it: how sm_80 kernels are proven on an
    H100). Returns canonical names ("90a", "100a", "80", "80+ptx"), sorted, without duplicates."""
    tokens = re.split(r"[\s;,]+", text) if isinstance(text, str) else list(text)
    archs = set()
    for token in tokens:
        raw = token.strip()
        if not raw:
            continue
        t = raw.lower()
        for prefix in ("sm_", "compute_"):
            if t.startswith(prefix):
                t = t[len(prefix):]
        m = _ARCH.match(t)
        if not m:
            raise ValueError(f"{source}: cannot read architecture {raw!r}; accepted forms: "
                             "'9.0a', '90a', 'sm_90a', '8.0', '80', '8.0+PTX' (separated by spaces, ';' or ',')")
        major, minor, suffix, ptx = m.groups()
        number = int(major + minor) if minor is not None else int(major)
        if number < 50:
            raise ValueError(f"{source}: architecture {raw!r} reads as sm_{number}; give major and minor "
                             "(e.g. '9.0a' or '90a')")
        archs.add(f"{number}{suffix}" + ("+ptx" if ptx else ""))
    if not archs:
        raise ValueError(f"{source}: no architecture given (example: '90a' for H100)")
    return tuple(sorted(archs, key=lambda a: (int(re.match(r"\d+", a).group()), a)))


def arch_of_capability(major: int, minor: int) -> str:
    """Build target for a device: the arch-specific 'a' variant where kernels need it (9.0, 10.0)."""
    number = f"{major}{minor}"
    return number + "a" if (major, minor) in ((9, 0), (10, 0)) else number


def resolve_arch_list(archs: Union[None, str, Iterable[str]] = None) -> ArchList:
    """The architectures in effect: `archs` if given, else $FI_BACKEND_CUDA_ARCH_LIST, else the
    current CUDA device."""
    if archs is not None:
        return parse_arch_list(archs, source="arch list")
    text = env.get(env.CUDA_ARCH_LIST)
    if text is not None:
        return parse_arch_list(text)
    try:
        import torch
        if torch.cuda.is_available():
            return (arch_of_capability(*torch.cuda.get_device_capability()),)
    except Exception:  # a broken CUDA setup reads as "no device"; the error below says what to do
        pass
    raise RuntimeError(f"no CUDA device found to build kernels for; set {env.CUDA_ARCH_LIST} "
                       f"(e.g. {env.CUDA_ARCH_LIST}=90a for H100/H200, 100a for B200)")


def gencode_flags(archs: ArchList) -> Tuple[str, ...]:
    flags = []
    for a in archs:
        base = a[:-len("+ptx")] if a.endswith("+ptx") else a
        flags.append(f"-gencode=arch=compute_{base},code=sm_{base}")
        if a.endswith("+ptx"):
            flags.append(f"-gencode=arch=compute_{base},code=compute_{base}")
    return tuple(flags)


# ----------------------------------------------------------------------------- toolchain

def find_nvcc() -> Optional[str]:
    """nvcc: $FI_BACKEND_NVCC, $CUDA_HOME/bin/nvcc, nvcc on PATH, /usr/local/cuda/bin/nvcc; or None."""
    explicit = env.get(env.NVCC)
    if explicit is not None:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise BuildError(f"{env.NVCC}={explicit} is not an executable file")
        return explicit
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    """`nvcc --version` output, whitespace-normalised (part of every module's identity)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from e
    return " ".join(out.split())


def find_ninja() -> Optional[str]:
    """ninja on PATH, else the one of the `ninja` Python package; None: run nvcc directly."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships a binary
        path = os.path.join(ninja.BIN_DIR, "ninja")
        return path if os.path.isfile(path) else None
    except ImportError:
        return None


# ----------------------------------------------------------------------------- identity and cache

def cache_dir(archs: ArchList) -> Path:
    """Cache root for modules built for `archs` (see the module docstring for the layout)."""
    override = env.get(env.CACHE_DIR)
    if override is not None:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "fi_backend" / __version__ / "_".join(archs)


_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def headers_digest(source: str, source_dir: Path, csrc: Path) -> str:
    """sha256 over the csrc/ headers the rendered source includes, followed transitively through
    quoted #include lines (relative path and content). Only what a module can see enters its key, so
    editing host-only code (csrc/scheduler/) rebuilds no kernel. Quoted includes are resolved as nvcc
    does with -I csrc: next to the including file first, then under csrc/; angle includes are system
    headers, covered by the nvcc version in the key."""
    h = hashlib.sha256()
    root = csrc.resolve()
    seen = set()
    pending = [(source, source_dir)]
    while pending:
        text, here = pending.pop()
        for name in _INCLUDE.findall(text):
            for base in (here, root):
                path = (base / name).resolve()
                if path.is_file():
                    break
            else:
                continue  # not ours (e.g. a CUDA header written with quotes): the nvcc version covers it
            if path in seen or root not in path.parents:
                continue
            seen.add(path)
            pending.append((path.read_text(), path.parent))
    for path in sorted(seen):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def module_flags(spec: ModuleSpec, archs: ArchList) -> Tuple[str, ...]:
    """The nvcc flags of a module that enter its identity (include paths excluded: machine-specific), with
    $FI_BACKEND_NVCC_FLAGS last (experiments, e.g. perf/tools/timeline.py's -DFI_TIMELINE)."""
    extra = tuple((env.get(env.NVCC_FLAGS) or "").split())
    return BASE_FLAGS + gencode_flags(archs) + spec.nvcc_flags + extra


@dataclass(frozen=True)
class ModuleIdentity:
    name: str            # <family>_<tag>_<hash16>: the directory and .so name
    key: str             # full sha256, everything included
    source_key: str      # the same without the nvcc version: finds prebuilt modules without nvcc
    source: str          # rendered source
    flags: Tuple[str, ...]
    archs: ArchList
    nvcc_version: Optional[str]


def module_identity(spec: ModuleSpec, archs: ArchList, nvcc_version_text: Optional[str], *,
                    csrc: Optional[Path] = None) -> ModuleIdentity:
    """The module's cache key: rendered source + csrc headers + flags + archs + nvcc version +
    fi_backend version (+ spec.key_extra); headers: the ones the source includes. nvcc_version_text None: only source_key is meaningful."""
    root = Path(csrc) if csrc is not None else csrc_dir()
    source = render(spec, root)
    flags = module_flags(spec, archs)
    material = {
        "source": source, "headers": headers_digest(source, (root / spec.template).parent, root), "flags": list(flags), "archs": list(archs),
        "fi_backend": __version__, "key_extra": spec.key_extra,
    }
    source_key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    key = hashlib.sha256(f"{source_key}\0{nvcc_version_text}".encode()).hexdigest()
    tag = spec.readable_tag()
    name = f"{spec.family}_{tag}_{key[:16]}" if tag else f"{spec.family}_{key[:16]}"
    return ModuleIdentity(name, key, source_key, source, flags, archs, nvcc_version_text)


def _library(module_dir: Path) -> Path:
    return module_dir / f"{module_dir.name}.so"


def _is_complete(module_dir: Path) -> bool:
    return _library(module_dir).is_file() and (module_dir / "meta.json").is_file()


def read_meta(module_dir: Path) -> Optional[dict]:
    try:
        return json.loads((module_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def list_cached(root: Path) -> list:
    """(module_dir, meta, size in bytes) of every complete module under a cache root."""
    out = []
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if d.is_dir() and not d.name.startswith(".") and _is_complete(d):
            out.append((d, read_meta(d), _library(d).stat().st_size))
    return out


def _find_prebuilt(root: Path, spec: ModuleSpec, source_key: str) -> Optional[Path]:
    """A complete module of this spec built by any nvcc (newest first)."""
    matches = []
    for d in root.glob(f"{spec.family}_*"):
        meta = read_meta(d) if _is_complete(d) else None
        if meta and meta.get("source_key") == source_key:
            matches.append(d)
    return max(matches, key=lambda d: d.stat().st_mtime) if matches else None


# ----------------------------------------------------------------------------- building

@contextmanager
def module_lock(root: Path, name: str):
    """Exclusive flock on <root>/<name>.lock. The kernel drops it when the holder dies, so a killed
    build never blocks the next one; the lock file itself is left in place (removing it would race)."""
    fd = os.open(root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$")


def _nvcc_command(nvcc: str, ident: ModuleIdentity, spec: ModuleSpec, csrc: Path) -> list:
    includes = [f"-I{csrc}"] + [f"-I{d}" for d in spec.include_dirs]
    return [nvcc, *ident.flags, *includes, f"{ident.name}.cu", "-o", f"{ident.name}.so"]


def _write_ninja(build_dir: Path, command: list, ident: ModuleIdentity) -> None:
    nvcc, *flags = command[:-3]
    text = (
        "# Generated by fi_backend.kernels; rerun with: ninja -C <this directory>\n"
        "ninja_required_version = 1.3\n"
        f"nvcc = {_ninja_escape(shlex.quote(nvcc))}\n"
        f"flags = {_ninja_escape(' '.join(shlex.quote(f) for f in flags))}\n\n"
        "rule nvcc_shared\n"
        "  command = $nvcc $flags $in -o $out\n"
        "  description = nvcc $out\n\n"
        f"build {ident.name}.so: nvcc_shared {ident.name}.cu\n"
    )
    (build_dir / "build.ninja").write_text(text)


def _run_build(build_dir: Path, command: list, ident: ModuleIdentity) -> None:
    ninja = find_ninja()
    run_cmd = [ninja, "-C", str(build_dir), "-j", "1"] if ninja else command
    proc = subprocess.run(run_cmd, cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (build_dir / "build.log").write_text(proc.stdout)
    if proc.returncode != 0 or not (build_dir / f"{ident.name}.so").is_file():
        raise BuildError(proc.stdout)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class BuildResult:
    name: str
    path: Path          # the .so
    built: bool         # True: this call compiled it; False: found in the cache
    seconds: float      # compile time (0 when found)


def build(spec: ModuleSpec, *, archs: Union[None, str, Iterable[str]] = None,
          quiet: Optional[bool] = None) -> BuildResult:
    """Build `spec` for `archs` (default: resolve_arch_list()) unless it is cached; return its .so.

    Safe across processes and threads: one builds, the others wait on the flock and find it built.
    Without nvcc (or with FI_BACKEND_JIT=0) only modules already in the cache are found."""
    archs = resolve_arch_list(archs)
    quiet = env.flag(env.QUIET, False) if quiet is None else quiet
    root = cache_dir(archs)
    csrc = csrc_dir()
    nvcc = find_nvcc() if env.flag(env.JIT, True) else None

    if nvcc is None:
        ident = module_identity(spec, archs, None, csrc=csrc)
        found = _find_prebuilt(root, spec, ident.source_key)
        if found is None:
            why = f"{env.JIT}=0" if not env.flag(env.JIT, True) else \
                f"no nvcc found (set {env.NVCC} or CUDA_HOME)"
            raise BuildError(f"cannot build module {spec.family} ({spec.readable_tag() or 'no tag'}): {why}, "
                             f"and no prebuilt copy for sm_{'/sm_'.join(archs)} is in {root}. Build it "
                             f"on a machine with nvcc (`fi-backend build --arch {' '.join(archs)}`) and "
                             f"copy that cache here, pointing {env.CACHE_DIR} at it.")
        return BuildResult(found.name, _library(found), False, 0.0)

    ident = module_identity(spec, archs, nvcc_version(nvcc), csrc=csrc)
    final = root / ident.name
    if _is_complete(final):
        return BuildResult(ident.name, _library(final), False, 0.0)

    root.mkdir(parents=True, exist_ok=True)
    with module_lock(root, ident.name):
        if _is_complete(final):  # another process built it while we waited
            return BuildResult(ident.name, _library(final), False, 0.0)
        # Only a lock holder creates temporaries of this module, so any that exist are leftovers.
        for stale in root.glob(f".tmp-{ident.name}-*"):
            _rmtree(stale)
        if final.exists():  # incomplete (tampered with): move aside, then rebuild
            trash = root / f".tmp-{ident.name}-trash-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            _rmtree(trash)

        tmp = root / f".tmp-{ident.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            (tmp / f"{ident.name}.cu").write_text(ident.source)
            command = _nvcc_command(nvcc, ident, spec, csrc)
            _write_ninja(tmp, command, ident)
            if not quiet:
                print(f"fi-backend: building {ident.name} (sm_{', sm_'.join(archs)}) ...",
                      end="", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                _run_build(tmp, command, ident)
            except BuildError as e:
                if not quiet:
                    print(" failed", file=sys.stderr, flush=True)
                kept = root / f"{ident.name}.failed"
                _rmtree(kept)
                os.replace(tmp, kept)
                tail = "\n".join(str(e).rstrip().splitlines()[-40:])
                raise BuildError(
                    f"building module {ident.name} failed.\ncommand (in {kept}):\n  "
                    f"{' '.join(shlex.quote(c) for c in command)}\noutput (last 40 lines):\n{tail}"
                ) from None
            seconds = time.perf_counter() - start
            if not quiet:
                print(f" {seconds:.1f} s", file=sys.stderr, flush=True)
            meta = {
                "name": ident.name, "family": spec.family, "template": spec.template,
                "params": spec.params, "tag": spec.readable_tag(), "archs": list(archs),
                "flags": list(ident.flags), "nvcc": nvcc, "nvcc_version": ident.nvcc_version,
                "fi_backend": __version__, "key": ident.key, "source_key": ident.source_key,
                "build_seconds": round(seconds, 3), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            os.replace(tmp, final)  # atomic publish: readers see nothing or everything
        finally:
            if tmp.exists():
                _rmtree(tmp)
    return BuildResult(ident.name, _library(final), True, seconds)


def build_many(specs: Sequence[ModuleSpec], *, archs=None, jobs: Optional[int] = None,
               quiet: Optional[bool] = True, on_done=None) -> list:
    """Build several modules in parallel (one nvcc per module, `jobs` at a time). on_done(spec,
    result_or_exception) is called as each finishes; returns results/exceptions in `specs` order."""
    from concurrent.futures import ThreadPoolExecutor

    archs = resolve_arch_list(archs)
    jobs = max(1, jobs or os.cpu_count() or 1)

    def one(spec):
        try:
            r = build(spec, archs=archs, quiet=quiet)
        except Exception as e:  # reported per module; the others still build
            r = e
        if on_done is not None:
            on_done(spec, r)
        return r

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, specs))


PREPARE_JOBS = 8  # nvcc processes at once at an engine's start, whatever the machine's cores


def prepare(specs: Iterable[ModuleSpec], *, jobs: Optional[int] = None) -> list:
    """Build (or find cached) the modules an engine's wrappers are about to load, in parallel (at most
    PREPARE_JOBS nvcc at once), so its start waits for the slowest module, not their sum. One stderr line per
    module built (FI_BACKEND_QUIET=1: none). Failures are returned, not raised: the wrapper that loads a module
    raises with the build's output, or leaves an optional one out (the CuTe member)."""
    import threading
    specs = list({s.memo_key: s for s in specs}.values())
    quiet, lock = env.flag(env.QUIET, False), threading.Lock()

    def on_done(spec, result):
        if not quiet and not isinstance(result, Exception) and result.built:
            with lock:
                print(f"fi-backend: built {result.name} in {result.seconds:.1f} s", file=sys.stderr, flush=True)
    if not quiet and specs:
        print(f"fi-backend: {len(specs)} kernel modules (built in parallel where not cached)", file=sys.stderr,
              flush=True)
    return build_many(specs, jobs=jobs or min(PREPARE_JOBS, os.cpu_count() or 1), quiet=True, on_done=on_done)
