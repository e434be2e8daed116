"""The engines' integration tests' logprob comparison (integration_tests/vllm, integration_tests/sglang): a run
against its anchor, within a bound that is twice the distance between two other backends plus a floor."""

MAX_FLOOR, MEAN_FLOOR = 0.02, 0.002


def logprob_diffs(ref: dict, test: dict) -> list:
    """|difference| of every prompt logprob and of the first-token top-5 logprobs both runs report."""
    diffs = []
    shapes = [[len(lp) for lp in run["prompt_logprobs"]] for run in (ref, test)]
    if shapes[0] != shapes[1]:
        raise ValueError(f"the two runs had different workloads (prompt lengths {shapes[0]} and {shapes[1]}): a record "
                         "from an older workload (re-run that engine rather than reusing its record)")
    for a, b in zip(ref["prompt_logprobs"], test["prompt_logprobs"], strict=True):
        diffs += [abs(x - y) for x, y in zip(a, b, strict=True)]
    for a, b in zip(ref["prefix_hit_first_token"], test["prefix_hit_first_token"], strict=True):
        diffs += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    return diffs


def generation_diffs(ref: dict, test: dict, near_tie: bool = True) -> tuple:
    """Logprob differences of greedy generations up to their first differing token, which must be a near-tie
    (each token in the other's top 5) unless near_tie is False. Returns (diffs, tokens compared, tokens
    generated)."""
    diffs, compared, total = [], 0, 0
    for i, (a, b) in enumerate(zip(ref["generations"], test["generations"], strict=True)):
        total += len(a["tokens"])
        for step, (ta, tb, la, lb) in enumerate(zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"])):
            if ta != tb:
                assert not near_tie or (str(tb) in la and str(ta) in lb), (
                    f"generation {i} step {step}: tokens {ta} vs {tb} are not a near-tie (top-5 {la} vs {lb})")
                break
            diffs.append(abs(la[str(ta)] - lb[str(tb)]))
            compared += 1
    return diffs, compared, total


def embedding_diffs(ref: dict, test: dict) -> list:
    """|difference| of every embedding entry, over its vector's RMS in ref (records of the embed workloads)."""
    import math
    if len(ref["embeddings"]) != len(test["embeddings"]):
        raise ValueError(f"the two runs embedded {len(ref['embeddings'])} and {len(test['embeddings'])} prompts: a "
                         "record from an older workload (re-run that engine rather than reusing its record)")
    diffs = []
    for a, b in zip(ref["embeddings"], test["embeddings"], strict=True):
        rms = math.sqrt(sum(x * x for x in a) / len(a))
        diffs += [abs(x - y) / rms for x, y in zip(a, b, strict=True)]
    return diffs


def write_wordpiece_vocab(folder, vocab_size: int, max_len: int) -> None:
    """A BERT WordPiece tokenizer of vocab_size entries in a dummy-weight model folder: BERT's special tokens at
    their ids ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103), then words w0, w1, ... (the engines build a
    tokenizer for pooling models even when prompts are token ids; text "w5 w7" is [CLS] 109 111 [SEP])."""
    import json
    from pathlib import Path
    special = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = special + [f"w{i}" for i in range(vocab_size - len(special))]
    Path(folder, "vocab.txt").write_text("\n".join(words) + "\n")
    Path(folder, "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": max_len}))


def stats(diffs: list) -> dict:
    return {"max": max(diffs, default=0.0), "mean": sum(diffs) / max(len(diffs), 1), "n": len(diffs)}


def bound(noise: dict) -> dict:
    return {"max": 2 * noise["max"] + MAX_FLOOR, "mean": 2 * noise["mean"] + MEAN_FLOOR}


def check_shared_prefix(counts: dict, shared: dict, got: dict, gen: list, bound: dict, system_tokens: int,
                        off_counts: dict = None, on_off: dict = None) -> None:
    """Issue 28's engine checks (kind shared, both engines): grouped decode and extend steps planned, the system
    prompt's questions hit the prefix cache, groups on within the bound of the reference (got: logprobs, gen:
    generations); with groups off (off_counts) none planned, and on vs off (on_off) within the same bound."""
    assert counts["grouped_decode"] > 0 and counts["grouped_extend"] > 0, counts
    cached = shared["prefix_hit_cached_tokens"]
    assert min(cached[-shared["system_prompt_requests"]:]) >= system_tokens - 16, cached
    assert got["max"] <= bound["max"] and got["mean"] <= bound["mean"], (got, bound)
    assert max(gen, default=0.0) <= bound["max"], (gen, bound)
    if off_counts is not None:
        assert off_counts["grouped_decode"] == off_counts["grouped_extend"] == 0, off_counts
        assert on_off["max"] <= bound["max"] and on_off["mean"] <= bound["mean"], (on_off, bound)


# ------------------------------------------------------------------------------------ issue 31's engine bar
# Batch invariance: the same target prompt served alone and inside busy batches must give bit-identical logprobs.
# The plan (targets, companion sets) and the comparison are shared; each engine's file serves the requests.

DET_TARGET_LENS = (7, 300, 1500)   # none is 1 more than a multiple of 16: a cached prefix leaves > 1 token to compute
DET_GEN = 64                       # greedy tokens per target, logprobs (top 5 and the chosen token) at each
DET_TOP = 5
# name -> (companions submitted first, companions submitted with the target, their prompt lengths, their generation
# lengths, how long the first companions run before the target arrives: engine steps (vLLM) or seconds (SGLang))
DET_BATCHES = {
    "decoding": (15, 0, (16, 600), (120, 320), (12, 1.0)),     # the target's prefill meets 15 decodes
    "prefilling": (8, 4, (200, 1400), (80, 240), (3, 0.05)),   # arrives mid-prefill, with 4 more prompts
    "queued": (28, 0, (8, 400), (16, 160), (6, 0.3)),          # more than the 16 slots: waits, then a changing batch
}


def det_plan(token_hi: int = 120000) -> dict:
    """The targets' prompts and, per (companion set, target), fresh companions (so that no companion hits the
    prefix cache of an earlier run): {"targets": [ids], "busy": [{"batch", "target", "early": [(ids, gen)],
    "late": [(ids, gen)], "wait"}]}. Token ids in [1000, token_hi)."""
    import random
    targets = [[random.Random(3100 + n).randrange(1000, token_hi) for _ in range(n)] for n in DET_TARGET_LENS]
    busy = []
    for b, (name, (early, late, lens, gens, wait)) in enumerate(DET_BATCHES.items()):
        for t in range(len(targets)):
            rng = random.Random(7000 + 100 * b + t)

            def one():
                n = rng.randrange(*lens)
                return [rng.randrange(1000, token_hi) for _ in range(n)], rng.randrange(*gens)

            busy.append({"batch": name, "target": t, "early": [one() for _ in range(early)],
                         "late": [one() for _ in range(late)], "wait": wait})
    return {"targets": targets, "busy": busy}


def det_workload(plan: dict, alone, busy) -> dict:
    """Run the plan on one engine. alone(prompt) -> (full, cached) serves the target by itself twice in a row:
    `full` with prompt logprobs (which never read the prefix cache) then `cached` without (which may: its prefix
    is cached by then where the cache is on); busy(prompt, entry) -> (full, cached, info) serves both inside the
    entry's companions. A target record: {"tokens", "logprobs": [{token: logprob}], "cached_tokens"} and, for
    full, "prompt_logprobs" (one per prompt token after the first)."""
    rec = {"target_lens": [len(p) for p in plan["targets"]], "gen": DET_GEN, "alone": [], "alone_repeat": [],
           "busy": []}
    for p in plan["targets"]:
        rec["alone"].append(dict(zip(("full", "cached"), alone(p))))
    for p in plan["targets"]:   # the same again: run-to-run determinism, apart from any batch
        rec["alone_repeat"].append(dict(zip(("full", "cached"), alone(p))))
    for entry in plan["busy"]:
        full, cached, info = busy(plan["targets"][entry["target"]], entry)
        rec["busy"].append({"batch": entry["batch"], "target": entry["target"], "full": full, "cached": cached,
                            "companions": len(entry["early"]) + len(entry["late"]), **info})
    return rec


def exact_compare(ref: dict, run: dict) -> dict:
    """Bit for bit (==, no tolerance): prompt logprobs position by position, then each generated step's logprobs
    (every token either side reports; a token reported by one side only is a difference) until the first step
    whose chosen tokens differ (that step counts as differing; later steps have other contexts)."""
    out = {"prompt_positions": 0, "prompt_differing": 0, "gen_positions": 0, "gen_differing": 0, "max_abs": 0.0,
           "tokens_diverge_at": None, "first_differing": None}
    a, b = ref.get("prompt_logprobs"), run.get("prompt_logprobs")
    if a is not None and b is not None:
        assert len(a) == len(b), (len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            out["prompt_positions"] += 1
            if x != y:
                out["prompt_differing"] += 1
                out["max_abs"] = max(out["max_abs"], abs(x - y))
                out["first_differing"] = out["first_differing"] or f"prompt position {i + 1}"
    for step, (ta, tb, la, lb) in enumerate(zip(ref["tokens"], run["tokens"], ref["logprobs"], run["logprobs"])):
        out["gen_positions"] += 1
        common = la.keys() & lb.keys()
        if la != lb or ta != tb:
            out["gen_differing"] += 1
            out["max_abs"] = max([out["max_abs"]] + [abs(la[k] - lb[k]) for k in common])
            out["first_differing"] = out["first_differing"] or f"generated step {step}"
        if ta != tb:
            out["tokens_diverge_at"] = step
            break
    if len(ref["tokens"]) != len(run["tokens"]) and out["tokens_diverge_at"] is None:
        out["tokens_diverge_at"] = min(len(ref["tokens"]), len(run["tokens"]))
    out["differing"] = out["prompt_differing"] + out["gen_differing"]
    out["positions"] = out["prompt_positions"] + out["gen_positions"]
    return out


def _total(parts: list) -> dict:
    keys = ("positions", "differing", "prompt_positions", "prompt_differing", "gen_positions", "gen_differing")
    total = {k: sum(p[k] for p in parts) for k in keys}
    total["max_abs"] = max([p["max_abs"] for p in parts], default=0.0)
    total["runs_differing"] = sum(p["differing"] > 0 for p in parts)
    total["runs"] = len(parts)
    return total


def det_report(rec: dict) -> dict:
    """One engine's det_workload record: alone vs each busy batch (the bar), per companion set and in total; alone
    vs alone again; and the cached-prefix target vs the whole prompt's (their generations, alone)."""
    per_batch, parts = {}, []
    for run in rec["busy"]:
        alone = rec["alone"][run["target"]]
        for flavor in ("full", "cached"):
            c = exact_compare(alone[flavor], run[flavor])
            c.update(batch=run["batch"], target_len=rec["target_lens"][run["target"]], flavor=flavor,
                     cached_tokens_alone=alone[flavor]["cached_tokens"], cached_tokens_busy=run[flavor]["cached_tokens"])
            parts.append(c)
            per_batch.setdefault(run["batch"], []).append(c)
    repeat = [exact_compare(a[f], r[f]) for a, r in zip(rec["alone"], rec["alone_repeat"]) for f in ("full", "cached")]
    whole = [exact_compare({"tokens": a["full"]["tokens"], "logprobs": a["full"]["logprobs"]}, a["cached"])
             for a in rec["alone"]]
    return {"alone_vs_busy": _total(parts), "per_batch": {k: _total(v) for k, v in per_batch.items()},
            "runs": parts, "alone_vs_alone_again": _total(repeat),
            "cached_vs_whole": {**_total(whole), "cached_tokens": [a["cached"]["cached_tokens"] for a in rec["alone"]],
                                "per_target": whole}}


def require_engine_and_gpu(engine: str) -> None:
    """Skip the calling test where the engine package or a CUDA GPU is missing."""
    import pytest
    pytest.importorskip(engine)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def cute_member_expected() -> bool:
    """Whether fi-backend's prefill wrappers load the CuTe member here (an sm_90 GPU with the nvidia-cutlass headers,
    FI_BACKEND_PREFILL_CUTE not 0), so its plan counts must show it."""
    import importlib.util
    import os
    import torch
    return (importlib.util.find_spec("cutlass_library") is not None and os.environ.get("FI_BACKEND_PREFILL_CUTE") != "0"
            and torch.cuda.get_device_capability() == (9, 0))


def fresh_expected() -> bool:
    """Whether steps of new prompts run on their own K / V (the adapters' fresh wrapper, FI_BACKEND_PREFILL_FRESH)."""
    import os
    return cute_member_expected() and os.environ.get("FI_BACKEND_PREFILL_FRESH") != "0"


def engine_records(results, prefix: str, reuse: bool, run):
    """The tests' engine getter: label -> record, run once per session by run(label), or read back from
    results/<prefix><label>.json where reuse is set and the file is there."""
    import json
    done = {}

    def get(label: str) -> dict:
        if label not in done:
            path = results / f"{prefix}{label}.json"
            done[label] = json.loads(path.read_text()) if reuse and path.is_file() else run(label)
        return done[label]

    return get


def optional(get, label: str) -> dict:
    """A reference engine's record, or what stopped it (a reference does not decide a test)."""
    import subprocess
    try:
        return get(label)
    except (AssertionError, subprocess.TimeoutExpired, OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"[-3000:]}
