"""The committed ShareGPT length trace: vLLM's rules hold, its metadata is there, the loader is deterministic.

CPU only and fast: reads perf/data/sharegpt_trace.json and exercises the sampling code on synthetic
conversations, so neither the dataset nor the tokenizer package is needed.
"""
import json
import random

import numpy as np
import pytest

from perf import sharegpt as sg

RNG_SEED = random.SystemRandom().randrange(2**32)


@pytest.fixture(scope="module")
def trace():
    return json.loads(sg.TRACE_PATH.read_text())


def test_file_is_small_enough_to_commit():
    assert sg.TRACE_PATH.stat().st_size < 300 * 1024


def test_metadata_present(trace):
    src, tok, rules = trace["source"], trace["tokenizer"], trace["rules"]
    assert "ShareGPT_V3_unfiltered_cleaned_split.json" in src["dataset"]
    assert len(src["sha256"]) == 64 and int(src["sha256"], 16) >= 0
    assert src["bytes"] > 0 and isinstance(src["truncated"], bool)
    assert 0 < src["conversations_examined"] <= src["conversations_with_2_turns"] <= src["conversations_parsed"]
    if src["truncated"]:
        assert src["note"]
    assert "Llama-3" in tok["name"] and tok["sha256"] == sg.LLAMA3_BPE_SHA256
    for key in ("why", "package", "file", "runner", "count"):
        assert tok[key]
    assert "is_valid_sequence" in rules["followed"] and "ShareGPTDataset" in rules["followed"]
    assert (rules["min_len"], rules["max_prompt_len"], rules["max_total_len"], rules["min_turns"]) == \
        (sg.MIN_LEN, sg.MAX_PROMPT_LEN, sg.MAX_TOTAL_LEN, sg.MIN_TURNS) == (4, 1024, 2048, 2)
    assert isinstance(trace["seed"], int)
    assert 1000 <= len(trace["pairs"]) <= rules["n"] <= 10000


def test_every_pair_obeys_the_rules(trace):
    rules = trace["rules"]
    for p, o in trace["pairs"]:
        assert type(p) is int and type(o) is int
        assert p >= rules["min_len"] and o >= rules["min_len"], (p, o)
        assert p <= rules["max_prompt_len"] and p + o <= rules["max_total_len"], (p, o)
    # Real conversations, not a degenerate fill: lengths spread over the allowed range.
    a = np.array(trace["pairs"])
    assert len(np.unique(a[:, 0])) > 100 and len(np.unique(a[:, 1])) > 100


def test_loader_default_is_file_order(trace):
    pairs = sg.load_trace()
    assert pairs == [tuple(x) for x in trace["pairs"]]
    assert pairs == sg.load_trace(seed=0)
    n = random.Random(RNG_SEED).randrange(len(pairs) + 1)
    assert sg.load_trace(n) == pairs[:n]


def test_loader_seeded_permutations_are_deterministic():
    r = random.Random(RNG_SEED)
    s1, s2 = r.randrange(1, 2**31), r.randrange(1, 2**31)
    base = sg.load_trace()
    a, b, c = sg.load_trace(seed=s1), sg.load_trace(seed=s1), sg.load_trace(seed=s2)
    assert a == b, f"seed {s1} gave two different orders"
    assert sorted(a) == sorted(base) == sorted(c)
    assert a != base and a != c, f"seeds {s1}, {s2}"
    n = r.randrange(1, len(base))
    assert sg.load_trace(n, seed=s1) == a[:n]


@pytest.mark.parametrize("n", [-1, 10**9, 2.5, "8"])
def test_loader_rejects_bad_n(n):
    with pytest.raises(ValueError, match="n must be"):
        sg.load_trace(n)


def test_loader_rejects_bad_seed():
    with pytest.raises(ValueError, match="seed must be"):
        sg.load_trace(5, seed=1.5)


def test_summary_matches_numpy():
    r = random.Random(RNG_SEED)
    pairs = sg.load_trace(r.randrange(1, 4000), seed=r.randrange(1, 1000))
    s = sg.summary(pairs)
    a = np.array(pairs, dtype=np.float64)
    assert s["count"] == len(pairs)
    for i, name in enumerate(("prompt", "output")):
        assert s[name]["mean"] == pytest.approx(a[:, i].mean(), abs=0.006)
        assert s[name]["median"] == np.median(a[:, i])
        assert s[name]["p90"] == np.percentile(a[:, i], 90, method="inverted_cdf")
        assert (s[name]["min"], s[name]["max"]) == (a[:, i].min(), a[:, i].max())
    # Distinct values: an off-by-one rank cannot hide behind ties.
    m = r.randrange(2, 300)
    distinct = list(zip(r.sample(range(10**6), m), r.sample(range(10**6), m)))
    d = np.array(distinct)
    for i, name in enumerate(("prompt", "output")):
        assert sg.summary(distinct)[name]["p90"] == np.percentile(d[:, i], 90, method="inverted_cdf")
    assert sg.summary()["count"] == len(sg.load_trace())
    assert "pairs" in sg.format_summary(s)
    with pytest.raises(ValueError, match="at least one"):
        sg.summary([])


# ---------------------------------------------------------------- the builder's pure parts, synthetic data

def _words(r, lo, hi):
    return " ".join("w%d" % r.randrange(100) for _ in range(r.randrange(lo, hi)))


def _conversations(r, count):
    out = []
    for i in range(count):
        turns = [{"from": "human" if k % 2 == 0 else "gpt", "value": _words(r, 0, 40)}
                 for k in range(r.choice([0, 1, 2, 2, 3, 4]))]
        conv = {"id": f"c{i}", "conversations": turns}
        if r.random() < 0.05:
            del conv["conversations"]
        out.append(conv)
    return out


def _count_words(texts):
    return [len(t.split()) + 1 for t in texts]  # +1 stands in for BOS, as in the real counter


def _vllm_loop(conversations, n, seed):
    """vLLM's ShareGPTDataset load_data + sample, one pair at a time, with the word counter."""
    data = [c for c in conversations if "conversations" in c and len(c["conversations"]) >= 2]
    state = random.getstate()
    random.seed(seed)
    random.shuffle(data)
    random.setstate(state)
    out = []
    for c in data:
        if len(out) >= n:
            break
        p, o = _count_words([c["conversations"][0]["value"], c["conversations"][1]["value"]])
        if p < 4 or o < 4 or p > 1024 or p + o > 2048:
            continue
        out.append((p, o))
    return out


def test_sample_pairs_matches_vllm_loop():
    r = random.Random(RNG_SEED)
    convs = _conversations(r, 600)
    seed, n = r.randrange(1000), r.randrange(1, 500)
    before = random.getstate()
    got, seen = sg.sample_pairs(convs, _count_words, n, seed, batch=r.randrange(1, 64))
    assert random.getstate() == before, "sample_pairs must not disturb the global random state"
    assert got == _vllm_loop(convs, n, seed), f"rng seed {RNG_SEED}"
    assert got == sg.sample_pairs(convs, _count_words, n, seed, batch=1)[0]
    assert all(sg.is_valid_pair(p, o) for p, o in got)
    assert len(got) <= n and seen >= len(got)


def test_parse_conversations_recovers_a_cut_file():
    r = random.Random(RNG_SEED)
    convs = _conversations(r, 50)
    text = json.dumps(convs, indent=2)
    assert sg.parse_conversations(text) == (convs, False)
    cut = r.randrange(len(text) // 4, len(text) - 2)
    got, truncated = sg.parse_conversations(text[:cut])
    assert truncated
    assert got == convs[:len(got)], f"cut at {cut}"
    # Every conversation that ends before the cut is recovered.
    assert len(json.dumps(convs[:len(got) + 1], indent=2)) - 2 > cut or len(got) == len(convs)
    with pytest.raises(ValueError, match="JSON array"):
        sg.parse_conversations('{"not": "a list"}')
