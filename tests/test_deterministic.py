"""Deterministic plans (issue 31, docs/deterministic.md), on the CPU: a request's KV pieces and the order its
partial states are merged are the same whatever else is in the step (companions, batch size 1..256, CTA
count), for decode, prefill and mixed steps, and whether its prefix came from a cache; the normal plan is shown
to differ on some of the same steps, so these tests can fail. The kernels' side is tests/test_deterministic_gpu.py."""
import numpy as np
import pytest
import torch

from fi_backend import env
from fi_backend import scheduler as S
from fi_backend.workspace import Workspace

DECODE_ALIGN, PREFILL_ALIGN = 128, 64   # KV tiles (chunk alignment), as the kernels' shapes have them
CTA_GRIDS = [(128, 8), (132, 8), (16, 8), (1, 8), (132, 32), (66, 1)]   # (num_ctas, num_units)


def plan(qo, kv, *, tile_q, num_ctas, num_units, causal, align, pieces, min_kv_chunk):
    """A plan on a section sized as Workspace(deterministic_pieces=pieces) sizes it."""
    rows = int(qo[-1])
    views = S.PlanViews.allocate(num_ctas, S.max_items_for(rows, num_ctas, num_units, pieces), max(rows, 1),
                                 S.max_partial_rows_for(num_ctas, num_units, tile_q, rows, pieces))
    S.plan_into(views, np.asarray(qo, np.int32), np.asarray(kv, np.int32), tile_q=tile_q, num_ctas=num_ctas,
                num_units=num_units, causal=causal, kv_chunk_align=align, min_kv_chunk=min_kv_chunk,
                cost_q=float(align), deterministic_pieces=pieces)
    return S.decode_plan(views)


def request_signature(d, qo, request, how=None):
    """What decides a request's arithmetic, relative to its own rows: each of its rows' query tile (rows
    relative to the request) and KV pieces in the order the merge (split) or the kernel's fold (a whole item
    of a deterministic plan: pieces of partial_stride tokens from 0) takes them (by partial row, which must be
    exactly [merge_indptr[r], merge_indptr[r + 1])), the same for every unit. A row's pieces are its tile's.
    how: a set that gets "split" and / or "whole" for the tiles seen (deterministic plans)."""
    q0, q1 = int(qo[request]), int(qo[request + 1])
    it = d.items[d.items["request"] == request]
    per_unit = []
    for u in np.unique(d.items["unit"]):
        mine = it[it["unit"] == u]
        rows = []
        for tb in np.unique(mine["q_begin"]):
            tile = mine[mine["q_begin"] == tb]
            te = int(tile["q_end"][0])
            assert np.all(tile["q_end"] == te)
            order = np.argsort(tile["partial_base"])
            pieces = tuple((int(tile["kv_begin"][k]), int(tile["kv_end"][k])) for k in order)
            mi = d.merge_indptr
            if len(tile) == 1 and tile["partial_base"][0] < 0:
                assert np.all(mi[tb + 1:te + 1] == mi[tb:te])
                if how is not None:  # deterministic: the pieces the kernel folds
                    c, end = int(tile["partial_stride"][0]), int(tile["kv_end"][0])
                    assert int(tile["kv_begin"][0]) == 0 and c > 0 and c % DECODE_ALIGN % PREFILL_ALIGN == 0
                    pieces = tuple((b, min(end, b + c)) for b in range(0, max(end, 1), c))
                    how.add("whole")
            else:
                if how is not None:
                    how.add("split")  # row r's pieces write partial rows base + (r - tb) * stride: its merge range, in piece order
                for r in (tb, te - 1):
                    prow = tile["partial_base"][order] + (r - tb) * tile["partial_stride"][order]
                    assert np.array_equal(prow, np.arange(mi[r], mi[r + 1]))
            rows += [((int(tb) - q0, te - q0), pieces)] * (te - int(tb))
        assert len(rows) == q1 - q0
        per_unit.append(tuple(rows))
    assert all(p == per_unit[0] for p in per_unit), "every unit runs the same pieces"
    return per_unit[0]


def random_companions(rng, n, kind):
    """n other requests: (q_len, kv_len) pairs of decodes, prefills or both, KV 1..32k."""
    out = []
    for _ in range(n):
        k = kind if kind != "mixed" else rng.choice(["decode", "prefill"])
        kv = int(rng.integers(1, 32769)) if rng.random() < 0.3 else int(rng.integers(1, 4097))
        q = 1 if k == "decode" else int(rng.integers(1, min(kv, 512) + 1))
        out.append((q, kv))
    return out


TARGETS = {  # kind -> (target (q_len, kv_len), tile_q, causal, align, pieces, min_kv_chunk): the wrapper's settings
    "decode": ((1, 20000), 1, False, DECODE_ALIGN, S.DETERMINISTIC_PIECES, S.DETERMINISTIC_MIN_CHUNK),
    "decode_spec": ((3, 9000), 4, True, DECODE_ALIGN, S.DETERMINISTIC_PIECES, S.DETERMINISTIC_MIN_CHUNK),
    "prefill": ((700, 6000), 128, True, PREFILL_ALIGN, 1, S.DETERMINISTIC_MIN_CHUNK),
    "prefill_split": ((200, 12000), 128, True, PREFILL_ALIGN, 16, 512),
    "mixed_decode": ((1, 30000), 128, True, PREFILL_ALIGN, 1, S.DETERMINISTIC_MIN_CHUNK),
}


def batches(kind, seed, n=40):
    """n steps holding the target at a random place among random companions, batch sizes 1..256 (log-uniform),
    on a random grid; the first is the target alone."""
    rng = np.random.default_rng(seed)
    target = TARGETS[kind][0]
    companions = {"decode": "decode", "decode_spec": "decode", "prefill": "prefill", "prefill_split": "mixed",
                  "mixed_decode": "mixed"}[kind]
    for i in range(n):
        size = 1 if i == 0 else int(np.exp(rng.uniform(0, np.log(256))))
        reqs = random_companions(rng, size - 1, companions)
        at = int(rng.integers(0, size))
        reqs.insert(at, target)
        q = [r[0] for r in reqs]
        qo = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        kv = np.array([r[1] for r in reqs], dtype=np.int32)
        grid = CTA_GRIDS[0] if i == 0 else CTA_GRIDS[int(rng.integers(0, len(CTA_GRIDS)))]
        yield qo, kv, at, grid


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_request_plan_is_batch_invariant(kind):
    _, tile_q, causal, align, pieces, min_chunk = TARGETS[kind]
    kw = dict(tile_q=tile_q, causal=causal, align=align, min_kv_chunk=min_chunk)
    want = normal_first = None
    normal_differs = 0
    how = set()
    for qo, kv, at, (num_ctas, units) in batches(kind, seed=31):
        det = request_signature(plan(qo, kv, num_ctas=num_ctas, num_units=units, pieces=pieces, **kw), qo, at, how)
        normal = request_signature(plan(qo, kv, num_ctas=num_ctas, num_units=units, pieces=0, **kw), qo, at)
        if want is None:
            want, normal_first = det, normal
        assert det == want, f"the deterministic plan moved the request's pieces in a batch of {len(kv)} on {num_ctas} CTAs"
        normal_differs += normal != normal_first
    assert normal_differs > 0, "the normal plan never moved this request's pieces: the test could not fail"
    if pieces > 1:
        assert any(len(p) > 1 for _, p in want), "the target has pieces (their fold order is under test)"
        assert how == {"split", "whole"}, "the target ran split (merge) in some batches and whole (fold) in others"


def effective_pieces(signature, kv_len, q_len, causal=True):
    """Each row's pieces clipped to the KV it sees (causal: [0, its position]); pieces past it are masked for
    the row (an empty state, given no weight by the merge), so only these reach its arithmetic."""
    out = []
    for j, (_, pieces) in enumerate(signature):
        end = kv_len - q_len + j + 1 if causal else kv_len
        out.append(tuple((b, min(e, end)) for b, e in pieces if b < end))
    return out


@pytest.mark.parametrize("pieces,min_chunk", [(1, S.DETERMINISTIC_MIN_CHUNK), (16, 256)])
@pytest.mark.parametrize("tile_q", [4, 128])
def test_cached_prefix_and_chunked_prefill_keep_the_cuts(pieces, min_chunk, tile_q):
    """The same request (KV 5000) computed whole, with a cached prefix (only its last rows as queries) and in
    chunks of a chunked prefill: the rows they share see the same pieces (split points at multiples of a
    chunk of the request's KV length, from position 0, whatever the query tiles)."""
    K = 5000
    kw = dict(tile_q=tile_q, causal=True, align=PREFILL_ALIGN, min_kv_chunk=min_chunk, num_ctas=132, num_units=8,
              pieces=pieces)
    whole = effective_pieces(request_signature(plan([0, K], [K], **kw), [0, K], 0, set()), K, K)
    for q_len in (1, 37, 1000, 4999):  # a cached prefix of K - q_len tokens
        part = effective_pieces(request_signature(plan([0, q_len], [K], **kw), [0, q_len], 0, set()), K, q_len)
        assert part == whole[K - q_len:]
    if pieces == 1:  # chunked prefill: each chunk's rows see [0, position] in one piece, whatever the chunk's KV
        for start, end in ((0, 512), (512, 2048), (2048, K)):
            part = effective_pieces(request_signature(plan([0, end - start], [end], **kw), [0, end - start], 0,
                                                      set()), end, end - start)
            assert part == whole[start:end] == [((0, p + 1),) for p in range(start, end)]


def test_split_points_follow_the_request_length_only():
    """The piece length is a power of two times the alignment from kv_len / pieces, at least the floor (one
    decode KV tile): a decode request of 20000 tokens is cut at multiples of 2048 (20000 / 16 = 1250 -> 128 *
    16), one of 40000 at 4096, 2048 at 128, 2049 at 256, one of 128 or less not at all. Alone on the grid each
    piece is an item of its own (split, merged); among 255 equal companions it runs whole (folded)."""
    kw = dict(tile_q=1, causal=False, align=DECODE_ALIGN, min_kv_chunk=S.DETERMINISTIC_MIN_CHUNK, num_ctas=128,
              num_units=8, pieces=S.DETERMINISTIC_PIECES)
    for K, chunk in ((20000, 2048), (40000, 4096), (2048, 128), (2049, 256), (1000, 128), (100, None)):
        for B in (1, 256):
            how = set()
            qo, kv = np.arange(B + 1), np.full(B, K)
            (_, pieces), = request_signature(plan(qo, kv, **kw), qo, 0, how)
            if chunk is None:
                assert pieces == ((0, K),) and how == {"whole"}
            else:
                assert pieces == tuple((b, min(K, b + chunk)) for b in range(0, K, chunk))
                assert how == ({"split"} if B == 1 else {"whole"})


def test_workspace_holds_every_row_split():
    """Workspace(deterministic_pieces) sizes items and partial rows for a step whose every row is split into
    the most pieces (max_tokens decode rows of 32k KV on a grid they do not fill). On a normal workspace the
    same step plans too, splitting only what fits (whole requests fold their pieces: the same bits). A full
    batch of long requests runs whole, with no partial state."""
    kw = dict(max_requests=8, max_tokens=8, num_ctas=128, max_tile_q=4, num_qo_heads=32, num_kv_heads=8,
              head_dim=128, pin_memory=False)
    plan_kw = dict(tile_q=1, num_units=8, kv_chunk_align=DECODE_ALIGN, cost_q=128.0,
                   min_kv_chunk=S.DETERMINISTIC_MIN_CHUNK, deterministic_pieces=S.DETERMINISTIC_PIECES)
    qo = np.arange(9, dtype=np.int32)
    kv = np.full(8, 32768, dtype=np.int32)
    info = Workspace("cpu", deterministic_pieces=S.DETERMINISTIC_PIECES, **kw).plan(qo, kv, **plan_kw)
    assert info.kind == "deterministic" and info.num_partial_rows == 8 * S.DETERMINISTIC_PIECES
    small = Workspace("cpu", **kw).plan(qo, kv, **plan_kw)
    assert small.kind == "deterministic" and small.num_partial_rows < info.num_partial_rows
    big = Workspace("cpu", deterministic_pieces=S.DETERMINISTIC_PIECES, **{**kw, "max_requests": 256, "max_tokens": 256})
    full = big.plan(np.arange(257, dtype=np.int32), np.full(256, 32768, dtype=np.int32), **plan_kw)
    assert full.num_partial_rows == 0 and full.num_split_pairs == 0
    with pytest.raises(ValueError, match="deterministic_pieces must be an int >= 0"):
        Workspace("cpu", deterministic_pieces=-1, **kw)


def test_env_switch_is_named(monkeypatch):
    """FI_BACKEND_DETERMINISTIC is the switch BatchAttention reads when deterministic= is not given;
    env.batch_invariant (the vLLM adapter, `fi-backend build --model`) also takes VLLM_BATCH_INVARIANT as vLLM
    reads it."""
    assert env.DETERMINISTIC == "FI_BACKEND_DETERMINISTIC"
    monkeypatch.setenv(env.DETERMINISTIC, "1")
    assert env.flag(env.DETERMINISTIC, False) and env.batch_invariant()
    monkeypatch.setenv(env.DETERMINISTIC, "0")
    assert not env.flag(env.DETERMINISTIC, False) and not env.batch_invariant()
    for value, on in (("1", True), ("2", True), ("0", False), ("yes", False)):
        monkeypatch.setenv(env.VLLM_BATCH_INVARIANT, value)
        assert env.batch_invariant() is on, value


def test_deterministic_decode_is_a_module_of_its_own(monkeypatch):
    """The fold is compiled into decode modules of their own (decode::Config's kDeterministic): another CONFIG,
    tag and identity than the normal module, which keeps its CONFIG as it was; prefill's modules serve both
    modes; the module sets and modules_of name the deterministic ones."""
    monkeypatch.setenv("FI_BACKEND_CUDA_ARCH_LIST", "90a")
    from fi_backend import kernels, models
    from fi_backend import variants as V
    from fi_backend.kernels.sets import specs_of
    from fi_backend.specs import attention_specs, decode_spec
    normal = decode_spec(V.DEFAULT, 128, "bf16", "bf16", 4)
    det = decode_spec(V.DEFAULT, 128, "bf16", "bf16", 4, deterministic=True)
    assert normal.params["CONFIG"] == "128, 8, 4, __nv_bfloat16, __nv_bfloat16, 4, 2, 1"
    assert det.params["CONFIG"] == normal.params["CONFIG"] + ", true"
    assert det.tag == normal.tag + "_det"
    ident = [kernels.module_identity(s, ("90a",), "nvcc") for s in (normal, det)]
    assert ident[0].key != ident[1].key and ident[0].name != ident[1].name
    assert attention_specs(V.DEFAULT, 128, "bf16", "bf16", 4, None, "decode", True) == [det]
    assert attention_specs(V.DEFAULT, 128, "bf16", "bf16", 4, None, "decode") == [
        normal, decode_spec(V.DEFAULT, 128, "bf16", "bf16", 4, member=1)]   # the family of two: one mode each
    assert (attention_specs(V.DEFAULT, 128, "bf16", "bf16", 4, None, "prefill", True)
            == attention_specs(V.DEFAULT, 128, "bf16", "bf16", 4, None, "prefill"))
    tests = {s.memo_key for s in specs_of(["tests"])}
    for variant in (V.DEFAULT, V.SLIDING_WINDOW, V.SIGMOID):   # tests/test_deterministic_gpu.py's
        assert decode_spec(variant, 128, "bf16", "bf16", 4, deterministic=True).memo_key in tests
    assert det.memo_key in {s.memo_key for s in specs_of(["bench"])}   # tools/det_cost.py's
    llama = models.find("Llama-3.1-8B")
    plain, both = models.modules_of(llama), models.modules_of(llama, deterministic=True)
    added = [s for s in both if s.memo_key not in {p.memo_key for p in plain}]
    assert {p.memo_key for p in plain} < {s.memo_key for s in both}
    assert sorted(s.tag for s in added) == sorted(decode_spec(V.DEFAULT, 128, "bf16", kv, 4, deterministic=True).tag
                                                  for kv in ("bf16", "fp8_e4m3"))


def test_wrapper_refuses_a_workspace_without_room():
    """BatchAttention(deterministic=True) with the decode kernel on a workspace made without
    deterministic_pieces: an error naming the argument (the wrapper loads its kernel first: GPU only)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the wrapper loads its kernel first)")
    from fi_backend.wrappers import BatchAttention
    ws = Workspace("cuda", max_requests=8, max_tokens=8, num_ctas=128, max_tile_q=16, num_qo_heads=32,
                   num_kv_heads=8, head_dim=128)
    with pytest.raises(ValueError, match="deterministic_pieces >= 16"):
        BatchAttention(ws, 32, 8, 128, deterministic=True)
