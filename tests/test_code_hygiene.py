"""Code says what and why; history lives in docs/ and git. No source file under fi_backend/ or csrc/ cites a
commit hash or a timing table, and csrc/ keeps no A/B switch (a macro a build may override with -D)."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("fi_backend", "csrc") for p in (REPO / d).rglob("*")
                 if p.suffix in (".py", ".cu", ".cuh", ".h", ".cc") and "__pycache__" not in p.parts)

# 7 to 40 hex digits with a letter and a digit, not part of a word or a number (0x..., 1.4426950408889634f)
_HASH = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w.])")
# a measured time or throughput: "374.6 us", "5650 us", "1.2 ms", "TF/s"
_TIMING = re.compile(r"\b\d+(\.\d+)? (us|ms)\b|TF/s")
# the A/B switches retired from csrc/, and any macro csrc/ lets a build override (#ifndef FI_X / #define FI_X)
_RETIRED = ("FI_PREFILL_KV_VOTE", "FI_PREFILL_VOTE_EVERY_TILE", "FI_DECODE_L2_PREFETCH", "FI_DECODE_INDEX_AHEAD")
_OVERRIDABLE = re.compile(r"#\s*ifndef\s+(FI_\w+)\s*\n\s*#\s*define\s+\1\b")


def _offences(pattern, text):
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in pattern.finditer(text)]


def test_sources_found():
    names = {p.name for p in SOURCES}
    assert {"attention.py", "shapes.py", "specs.py", "prefill.cuh", "decode.cuh", "shared.cuh"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_commit_hash_or_timing_table(path):
    text = path.read_text()
    found = _offences(_HASH, text) + _offences(_TIMING, text)
    assert not found, f"{path.relative_to(REPO)}: history belongs in docs/*.md and git, not code: {found[:5]}"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.suffix != ".py"], ids=lambda p: str(p.relative_to(REPO)))
def test_no_ab_macro(path):
    text = path.read_text()
    found = [m for m in _RETIRED if m in text] + [m.group(1) for m in _OVERRIDABLE.finditer(text)]
    assert not found, f"{path.relative_to(REPO)}: A/B switches {found}: hard-wire the default and drop the switch"


def test_the_checks_bite():
    """The patterns catch what they are for and pass what they must."""
    assert _offences(_HASH, "# measured at 4d16d09 (perf/results/x.md)") and _offences(_HASH, "at b105cd5:")
    assert not _offences(_HASH, "kLn2 = 0.6931471805599453f; x = 0xffffffffu; deadline 1234567 tokens")
    assert _offences(_TIMING, "# 132 CTAs 374.6 / 1425 / 5650 us") and _offences(_TIMING, "0.9 TF/s")
    assert not _offences(_TIMING, "# microseconds (us) of the run")
    assert _OVERRIDABLE.search("#ifndef FI_DECODE_X\n#define FI_DECODE_X 4\n#endif")
