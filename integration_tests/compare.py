"""The engines' integration tests' logprob comparison (integration_tests/vllm, integration_tests/sglang): a run
against its anchor, within a bound that is twice the distance between two other backends plus a floor."""

MAX_FLOOR, MEAN_FLOOR = 0.02, 0.002


def logprob_diffs(ref: dict, test: dict) -> list:
    """|difference| of every prompt logprob and of the first-token top-5 logprobs both runs report."""
    diffs = []
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


def stats(diffs: list) -> dict:
    return {"max": max(diffs, default=0.0), "mean": sum(diffs) / max(len(diffs), 1), "n": len(diffs)}


def bound(noise: dict) -> dict:
    return {"max": 2 * noise["max"] + MAX_FLOOR, "mean": 2 * noise["mean"] + MEAN_FLOOR}
