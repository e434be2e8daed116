"""Module specs and template rendering: what a JIT module is, before anything is compiled."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Tuple

import fi_backend

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*$")
# Short names for common parameter values, for readable module directory names.
_READABLE = {"__nv_bfloat16": "bf16", "__half": "fp16", "half": "fp16", "float": "fp32", "double": "fp64",
             "__nv_fp8_e4m3": "e4m3", "__nv_fp8_e5m2": "e5m2", "true": "1", "false": "0"}


class RenderError(ValueError):
    """A template and its parameters do not match (missing or unused parameter, bad value)."""


@dataclass(frozen=True)
class ModuleSpec:
    """One JIT module: a template under csrc/ rendered with `params`, compiled into one .so.

    family        short name of the kernel family, e.g. "merge_state" (letters, digits, '_')
    template      template path relative to csrc/, e.g. "state_merge.cu"
    params        {{NAME}} -> replacement text (C types, head_dim, variant functor code...); every
                  placeholder needs a value and every value needs a placeholder
    nvcc_flags    extra nvcc flags, after the standard ones (part of the module's identity)
    include_dirs  extra -I directories (e.g. CUTLASS). Their paths differ between machines, so they
                  are NOT part of the identity: name their version in `key_extra`
    key_extra     any other text the build depends on, hashed into the identity
    tag           readable part of the module's directory name (default: derived from short params)
    """

    family: str
    template: str
    params: Mapping[str, str] = field(default_factory=dict)
    nvcc_flags: Tuple[str, ...] = ()
    include_dirs: Tuple[str, ...] = ()
    key_extra: str = ""
    tag: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.family, str) or not _NAME.match(self.family):
            raise ValueError(f"ModuleSpec.family must be letters, digits and '_' (got {self.family!r})")
        if not isinstance(self.template, str) or not self.template or Path(self.template).is_absolute():
            raise ValueError(f"ModuleSpec.template must be a path relative to csrc/ (got {self.template!r})")
        params = dict(self.params)
        for name, value in params.items():
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise RenderError(f"parameter names must be C identifiers (got {name!r})")
            if not isinstance(value, str):
                raise RenderError(f"parameter {name} must be a str (got {type(value).__name__}: {value!r})")
        if self.tag is not None and not _NAME.match(self.tag):
            raise ValueError(f"ModuleSpec.tag must be letters, digits and '_' (got {self.tag!r})")
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "nvcc_flags", tuple(self.nvcc_flags))
        object.__setattr__(self, "include_dirs", tuple(str(d) for d in self.include_dirs))

    @property
    def memo_key(self) -> tuple:
        """A hashable key of everything the spec says (for in-process memoisation)."""
        return (self.family, self.template, tuple(sorted(self.params.items())), self.nvcc_flags,
                self.include_dirs, self.key_extra, self.tag)

    def readable_tag(self) -> str:
        """The readable middle part of the module directory name."""
        if self.tag is not None:
            return self.tag
        parts = []
        for name in sorted(self.params):
            value = self.params[name].strip()
            value = _READABLE.get(value, value)
            value = re.sub(r"[^A-Za-z0-9]+", "", value)
            if value and len(value) <= 12:
                parts.append(value)
        return "_".join(parts)[:48].strip("_")


def csrc_dir() -> Path:
    """The csrc/ directory: <repo>/csrc in a source checkout, else fi_backend/_csrc (installed copy)."""
    package = Path(fi_backend.__file__).resolve().parent
    checkout = package.parent / "csrc"
    if checkout.is_dir() and (package.parent / "pyproject.toml").is_file():
        return checkout
    installed = package / "_csrc"
    if installed.is_dir():
        return installed
    raise FileNotFoundError(f"fi-backend's CUDA sources are missing: neither {checkout} (source checkout) "
                            f"nor {installed} (installed package) exists")


def render_text(text: str, params: Mapping[str, str], *, what: str = "template") -> str:
    """Substitute {{NAME}} placeholders; a placeholder without a value or a value without a
    placeholder is an error naming it."""
    used = set(_PLACEHOLDER.findall(text))
    missing = sorted(used - set(params))
    unused = sorted(set(params) - used)
    if missing:
        raise RenderError(f"{what} needs parameter(s) {', '.join(missing)} that were not given "
                          f"(given: {', '.join(sorted(params)) or 'none'})")
    if unused:
        raise RenderError(f"parameter(s) {', '.join(unused)} are not used by {what} "
                          f"(its placeholders: {', '.join(sorted(used)) or 'none'})")
    return _PLACEHOLDER.sub(lambda m: params[m.group(1)], text)


def render(spec: ModuleSpec, csrc: Optional[Path] = None) -> str:
    """The rendered source of `spec` (its template under csrc/ with params substituted)."""
    root = Path(csrc) if csrc is not None else csrc_dir()
    path = root / spec.template
    if not path.is_file():
        raise FileNotFoundError(f"template {spec.template!r} of module family {spec.family!r} not found "
                                f"under {root}")
    return render_text(path.read_text(), spec.params, what=f"template {spec.template}")
