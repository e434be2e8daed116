"""Every module entry (FI_EXPORT in csrc/) against the ctypes arguments Python calls it with: the same count and, one
by one, the same kind (pointer, integer of a width, float). ctypes passes whatever it is told, so a parameter added in
C and not in Python shifts every later argument and fails only at run time on a GPU (the paged CuTe test passed 19
int64 for 22 after V got its own strides)."""
import ctypes
import re
from pathlib import Path

import pytest

from fi_backend import attention, ops
from fi_backend.kernels import cutlass

CSRC = Path(__file__).resolve().parents[1] / "csrc"

# entry -> the ctypes argument list its Python caller uses
CHECKED = {
    "fi_cute_attn_ws": cutlass.ATTN_WS_ARGS,
    "fi_cute_attn_bsr": cutlass.ATTN_BSR_ARGS,
    "fi_cute_stage_pages": cutlass.STAGE_PAGES_ARGS,
    "fi_attention_run": attention._RUN_ARGS,
    "fi_attention_layout": attention._LAYOUT_ARGS,
    "fi_attention_occupancy": attention._OCCUPANCY_ARGS,
    "fi_attention_kv_maps": attention._KV_MAPS_ARGS,
    "fi_merge_state": ops._MERGE_STATE_ARGS,
    "fi_merge_states": ops._MERGE_STATES_ARGS,
    "fi_append_paged_kv_cache": ops._APPEND_ARGS,
    "fi_append_errors": ops._ERRORS_ARGS,
}
# entries called from elsewhere, each with why it is not checked here
UNCHECKED = {
    "fi_error_string": "the loader's own, restype char*",
    "fi_timeline_read": "perf/tools/timeline.py, a profiling build's entry",
    "fi_timeline_clear": "perf/tools/timeline.py, a profiling build's entry",
    "fi_timeline_shape": "perf/tools/timeline.py, a profiling build's entry",
}

_C_SCALARS = {"int64_t": ("int", 8), "uint64_t": ("int", 8), "int32_t": ("int", 4), "uint32_t": ("int", 4),
              "int": ("int", 4), "unsigned": ("int", 4), "float": ("float", 4), "double": ("float", 8)}


def declarations() -> dict:
    """entry -> its C parameter list's text, for every FI_EXPORT function in csrc/."""
    out = {}
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cu", ".cuh", ".h"):
            continue
        text = path.read_text()
        for m in re.finditer(r"FI_EXPORT\s+[\w\s\*]+?\b(fi_\w+)\s*\(", text):
            depth, i = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            out[m.group(1)] = (path.relative_to(CSRC.parent), text[m.end():i - 1])
    return out


def c_kind(param: str):
    param = re.sub(r"//.*", "", param).strip()
    if "*" in param:
        return "pointer"
    words = [w for w in re.findall(r"\w+", param) if w not in ("const", "volatile")]
    return _C_SCALARS.get(" ".join(words[:-1])) or pytest.fail(f"unknown C parameter type: {param!r}")


def ctypes_kind(t):
    if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, ctypes._Pointer):
        return "pointer"
    if t in (ctypes.c_float, ctypes.c_double):
        return ("float", ctypes.sizeof(t))
    return ("int", ctypes.sizeof(t))


def test_every_entry_is_checked_or_named():
    found = set(declarations())
    assert found, "no FI_EXPORT found under csrc/: the parser is broken"
    assert found - set(CHECKED) - set(UNCHECKED) == set(), "entries with no argument check: add them to CHECKED"
    assert set(CHECKED) | set(UNCHECKED) <= found, "entries named here that csrc/ no longer exports"


@pytest.mark.parametrize("entry", sorted(CHECKED))
def test_ctypes_arguments_match_the_declaration(entry):
    path, params = declarations()[entry]
    c = [c_kind(p) for p in params.split(",") if p.strip() and p.strip() != "void"]
    py = [ctypes_kind(t) for t in CHECKED[entry]]
    assert len(py) == len(c), f"{entry} ({path}) takes {len(c)} arguments, Python passes {len(py)}"
    for i, (a, b) in enumerate(zip(c, py)):
        assert a == b, f"{entry} ({path}) argument {i}: C {a}, ctypes {b} ({params.split(',')[i].strip()!r})"
