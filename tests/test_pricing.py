"""One pricing implementation: the allocation's scalar and tabulated group times are
`pricing.closed_form`, the formula `pricing.group_times` prices with, down to the last bit."""

from __future__ import annotations

import numpy as np
import pytest

from dhp_jax.planner import CostModel
from dhp_jax.planner.cost.pricing import (best_times, closed_form, group_times, hybrid_floor, padded_terms, traffic,
                                         ulysses_sizes)
from dhp_jax.planner.solvers.allocate import _ScalarTime

_BASE = CostModel.preset("internvl3-8b", "ascend-910b", ranks_per_node=8)
COSTS = {
    "padded": _BASE,
    "dense-padded": _BASE.replace(padded_attention=True, comm_overlap=False),
    "pad-computed": _BASE.replace(linear_chunk=0),
    "unpadded": _BASE.replace(bucket_min=0),
    "menu": _BASE.replace(bucket_menu=((4, (4096, 8192, 65536)), (8, (16384,)), (2, (8,)))),
    "lanes": _BASE.replace(compute_lanes=4),
    "one-rank-nodes": CostModel.preset("qwen3-vl-8b", "ascend-910b", ranks_per_node=1),
}


def _groups(cost: CostModel, rng: np.random.Generator, K: int) -> tuple[np.ndarray, ...]:
    S = rng.integers(1, 500_000, K).astype(float)
    A = cost.a1 * S * S * rng.random(K) * rng.choice([1.0, 1e-3], K)  # little attention too: traffic shows
    B = cost.a2 * S * (1 + rng.random(K))
    return A, B, S, rng.integers(1, 129, K)  # past the tables' first 64 degrees too


@pytest.mark.parametrize("name", list(COSTS))
def test_the_search_prices_groups_with_the_models_floats(name):
    # the allocation prices a group one float at a time (`__call__`, `group_times_of`) or from its
    # tables (`times`); each must be pricing's own float, not a close one: a last-bit difference
    # can flip a comparison of two packings and change a plan
    cost = COSTS[name]
    rng = np.random.default_rng(11)
    for attention in ("ring", "ulysses", "best"):
        t = _ScalarTime(cost, attention)
        A, B, S, d = _groups(cost, rng, 60)
        want = (best_times(cost, A, B, S, d) if attention == "best"
                else group_times(cost, A, B, S, d, attention=attention)).tolist()
        assert t.times(A, B, S, d).tolist() == want, (name, attention)
        assert [t(float(A[i]), float(B[i]), float(S[i]), int(d[i])) for i in range(len(d))] == want, (name, attention)
        ev = t.group_times_of(A.tolist(), B.tolist(), S.tolist())
        assert [ev(i, int(d[i])) for i in range(len(d))] == want, (name, attention)


def test_closed_form_gives_the_same_floats_on_scalars_and_arrays():
    # one formula for both callers: the scalar search's Python floats and group_times' arrays
    cost = _BASE
    rng = np.random.default_rng(12)
    A, B, S, d = _groups(cost, rng, 200)
    df = d.astype(float)
    u = np.asarray([rng.choice([x for x in (1, 2, 4, 8) if di % x == 0] or [1]) for di in d], dtype=float)
    u = np.where(rng.random(d.size) < 0.2, df, u)  # Ulysses over the whole group too
    c_ring, c_a2a, lat = 3e-9 * (1 + rng.random(d.size)), 2e-9 * (1 + rng.random(d.size)), 1e-5 * rng.random(d.size)
    for overlap in (True, False):
        for ring_only, ulysses_only, uu in ((True, False, np.ones_like(df)), (False, True, df), (False, False, u)):
            vec = closed_form(A, B, S, df, uu, df, cost.b1, c_ring, c_a2a, lat, ring_only, ulysses_only, overlap)
            one = [closed_form(float(A[i]), float(B[i]), float(S[i]), float(df[i]), float(uu[i]), float(df[i]),
                               cost.b1, float(c_ring[i]), float(c_a2a[i]), float(lat[i]), ring_only, ulysses_only,
                               overlap) for i in range(d.size)]
            assert np.asarray(vec).tolist() == one


def test_ulysses_and_ring_are_the_hybrid_formula_at_its_ends():
    # Ulysses is the hybrid family's formula at u = d (the same floats), and the traffic counts of
    # the ring and of Ulysses are the ones `traffic` documents
    cost = _BASE
    S = np.asarray([1000.0, 4096.0, 70_000.0, 123_457.0])
    A, B = cost.a1 * S * S, cost.a2 * S
    for d in (2, 4, 8):
        dd = np.full(S.size, d)
        assert np.array_equal(group_times(cost, A, B, S, dd, attention="ulysses"),
                              group_times(cost, A, B, S, dd, attention="hybrid", ulysses=d))
        ring_tok, a2a_tok, msgs, _ = traffic(S, d, "ring")
        assert ring_tok.tolist() == (S * (d - 1) / d).tolist() and a2a_tok == 0.0 and msgs == d - 1
        ring_tok, a2a_tok, msgs, _ = traffic(S, d, "ulysses")
        assert ring_tok == 0.0 and a2a_tok.tolist() == (S / d * (d - 1) / d).tolist() and msgs == d - 1


def _every_kind_least(cost: CostModel, A, B, S, d) -> list[float]:
    """Each group's least time over every kind the per-group choice may give it, kind by kind
    (no floor, no pruning): the ring, each hybrid u (u dividing the ranks of a node when the group
    spans nodes) and Ulysses over all ranks of a group that spans nodes."""
    rpn, out = cost.ranks_per_node, []
    for a, b, s, di in zip(A, B, S, d.tolist()):
        inter = di > rpn
        ts = [float(group_times(cost, a, b, s, di, inter, "ring"))]
        ts += [float(group_times(cost, a, b, s, di, inter, "hybrid", u)) for u in ulysses_sizes(cost, di)
               if not inter or rpn % u == 0]
        if inter and cost.num_heads % di == 0:
            ts.append(float(group_times(cost, a, b, s, di, True, "ulysses")))
        out.append(min(ts))
    return out


@pytest.mark.parametrize("name", ["padded", "dense-padded", "unpadded", "lanes", "one-rank-nodes"])
def test_best_times_is_the_least_over_every_kind(name):
    # best_times (and the search's "best" times) price only the groups above `hybrid_floor` on the
    # kinds other than the ring; that must give every group its least time over all kinds (kinds
    # chosen per group: `StreamGeometry.kind_rule` "group")
    cost = COSTS[name].replace(kind_rule="group")
    rng = np.random.default_rng(13)
    A, B, S, d = _groups(cost, rng, 300)
    want = _every_kind_least(cost, A, B, S, d)
    assert best_times(cost, A, B, S, d).tolist() == want
    assert _ScalarTime(cost, "best").times(A, B, S, d).tolist() == want
    ring = group_times(cost, A, B, S, d)
    assert np.sum(np.asarray(want) < ring) >= 5  # other kinds win on some of these groups


def test_the_program_rule_is_priced_from_the_tables():
    """Under the presets' one attention kind per ladder program (`kind_rule` "program") the search's
    "best" prices are its tables' (`_ScalarTime.tabled`, the floats checked above): each group on
    its program's kind (`program_kind`), which is not each group's least over the kinds."""
    from dhp_jax.planner.cost.geometry import padded_length
    from dhp_jax.planner.cost.pricing import program_kind, program_rule

    rng = np.random.default_rng(16)
    above = 0
    for name in ("padded", "dense-padded", "pad-computed", "one-rank-nodes"):
        cost = COSTS[name]
        assert program_rule(cost), name
        t = _ScalarTime(cost, "best")
        assert t.tabled, name
        A, B, S, d = _groups(cost, rng, 300)
        got = t.times(A, B, S, d)
        P = padded_length(cost, S, d)
        kinds = [program_kind(cost, int(x), int(p)) if x > 1 else "ring" for x, p in zip(d.tolist(), P.tolist())]
        assert {k for k in kinds} - {"ring"}, name                             # not the ring everywhere
        ring = group_times(cost, A, B, S, d)
        on_ring = np.asarray([k == "ring" for k in kinds])
        assert got[on_ring].tolist() == ring[on_ring].tolist(), name
        least = np.asarray(_every_kind_least(cost, A, B, S, d))
        assert np.all(got >= least), name
        above += int(np.sum(got > least))
    assert above  # a program's kind, not each group's least


def test_no_kind_prices_a_group_under_the_hybrid_floor():
    cost = _BASE
    rng = np.random.default_rng(14)
    A, B, S, d = _groups(cost, rng, 400)
    df = d.astype(float)
    Ap, Bp, P = padded_terms(cost, A, B, S, df)
    floor = (Ap + Bp) / df + cost.b1 + hybrid_floor(cost) * P / df
    for u in (2, 4, 8):
        m = (d % u == 0) & ((d <= cost.ranks_per_node) | (cost.ranks_per_node % u == 0))
        assert np.all(group_times(cost, A[m], B[m], S[m], d[m], attention="hybrid", ulysses=u) > floor[m])
    m = d > 1
    assert np.all(group_times(cost, A[m], B[m], S[m], d[m], True, "ulysses") > floor[m])


def test_closed_form_prices_the_traffic_counts():
    # closed_form writes traffic's counts out (the scalar search's speed); with one second per token
    # or message of one sort and none of the others it must give back exactly those counts
    S = np.asarray([1000.0, 4096.0, 70_000.0, 123_457.0])
    zero = np.zeros_like(S)
    for d in (2, 4, 8, 16):
        df = np.full(S.size, float(d))
        for attention, u in (("ring", 1.0), ("ulysses", df), ("hybrid", 2.0), ("hybrid", 4.0)):
            if attention == "hybrid" and d % u:
                continue
            ring_tok, a2a_tok, msgs, _ = traffic(S, df, attention, None if attention != "hybrid" else int(u))
            only = (attention == "ring", attention == "ulysses")
            priced = [closed_form(zero, zero, S, df, u, df, 0.0, c_ring, c_a2a, lat, *only, False)
                      for c_ring, c_a2a, lat in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))]
            want = [np.broadcast_to(x, S.shape) for x in (ring_tok, a2a_tok, msgs)]
            assert [np.asarray(x).tolist() for x in priced] == [w.tolist() for w in want], (attention, d, u)


@pytest.mark.parametrize("name", ["padded", "dense-padded", "unpadded", "menu", "one-rank-nodes"])
def test_least_time_over_degrees_is_the_least_of_the_times(name):
    # the search's bound on a sequence alone (`dhp.alone_times`) takes each row's least time over
    # the degrees it fits; pricing other kinds only below the row's least ring time changes no float
    cost = COSTS[name]
    rng = np.random.default_rng(15)
    A, B, S, _ = _groups(cost, rng, 24)
    ds = np.arange(1, 129)
    ok = ds[None, :] >= rng.integers(1, 40, 24)[:, None]
    ok[0] = False  # a row with no degree at all: inf
    for attention in ("ring", "best"):
        t = _ScalarTime(cost, attention)
        want = np.where(ok, t.times(A[:, None], B[:, None], S[:, None], ds[None, :]), np.inf).min(axis=1)
        got, ring = t.least(A[:, None], B[:, None], S[:, None], ds[None, :], ok)
        assert got.tolist() == want.tolist(), attention
        if ring is not None:  # the ring's least on the way: what a ring search's least gives
            assert ring.tolist() == _ScalarTime(cost, "ring").least(A[:, None], B[:, None], S[:, None], ds[None, :],
                                                                    ok)[0].tolist()
        else:
            assert attention == "ring" or not t.tabled


@pytest.mark.parametrize("name", ["padded", "dense-padded", "unpadded", "one-rank-nodes"])
def test_kind_times_is_group_times_on_each_groups_kind(name):
    """`kind_times` (the terms padded once, then `_times_on`, as `best_kind_times` prices) gives,
    bit for bit, `group_times` of each group on its own named kind: the ring, Ulysses (d = 1 too)
    and every hybrid the heads allow, inside a node or over nodes."""
    from dhp_jax.planner.contract.kinds import attention_kinds
    from dhp_jax.planner.cost.pricing import kind_times

    cost = COSTS[name]
    rng = np.random.default_rng(7)
    A, B, S, d = _groups(cost, rng, 300)
    inter = np.where(rng.random(d.size) < 0.3, True, d > cost.ranks_per_node)
    kinds = []
    for x in d.tolist():
        ks = list(attention_kinds(int(x), cost.num_heads, cost.ranks_per_node))
        if cost.ulysses_ok(int(x)):
            ks.append("ulysses")
        kinds.append(ks[int(rng.integers(len(ks)))])
    # several kinds: hybrids among them wherever a node holds more than one rank
    assert {"ring", "ulysses"} <= set(kinds) and (cost.ranks_per_node == 1 or len(set(kinds)) > 3)
    got = kind_times(cost, A, B, S, d, inter, kinds)
    want = np.array([float(group_times(cost, a, b, s, x, i, k)) for a, b, s, x, i, k in zip(A, B, S, d, inter, kinds)])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="3 kinds for 300 groups"):
        kind_times(cost, A, B, S, d, inter, kinds[:3])


def _program_size(cost: CostModel, d: int, p: float) -> int:
    """Reference: the Ulysses size of a program's kind as `pricing.program_kind` defines it, one kind at
    a time: a group of d ranks filled to p padded tokens (d sequences of p / d tokens), priced on the
    ring, then each hybrid u (ascending), then Ulysses over all its nodes; a kind wins only where
    strictly faster."""
    from dhp_jax.geometry.layout import linear_tokens
    from dhp_jax.planner.cost.pricing import _padded_times

    if d <= 1:
        return 1
    rpn, df, P = cost.ranks_per_node, np.array([float(d)]), np.array([float(p)])
    inter = np.array([d > rpn])
    A = cost.a1 * P * P / df
    B = cost.a2 * df * linear_tokens(P, P, df, cost.geometry.linear_chunk)
    best, size = float(_padded_times(cost, A, B, P, df, inter, "ring")[0]), 1
    for u in range(2, min(d, rpn) + 1):
        if cost.num_heads % u or d % u or (d > rpn and rpn % u):
            continue
        t = float(_padded_times(cost, A, B, P, df, inter, "hybrid", u)[0])
        if t < best:
            best, size = t, u
    if d > rpn and cost.num_heads % d == 0 and float(_padded_times(cost, A, B, P, df, True, "ulysses")[0]) < best:
        size = d
    return size


def test_program_sizes_are_the_program_kinds_sizes():
    """`program_sizes` (the search's vectorised lookup of each program's kind, which `program_kind`
    names too) gives the kind `program_kind`'s definition picks, priced one kind at a time (the ring,
    hybrids, Ulysses over all of a group's nodes; degree 1 included)."""
    from dhp_jax.planner.contract.plan import attention_split
    from dhp_jax.planner.cost.pricing import program_kind, program_sizes

    rng = np.random.default_rng(3)
    over = []
    for cost in (_BASE, COSTS["one-rank-nodes"]):
        D = rng.integers(1, 200, 300)
        P = np.floor(rng.random(300) * 400_000) + 1
        got = program_sizes(cost, D, P).tolist()
        assert got == [_program_size(cost, d, p) for d, p in zip(D.tolist(), P.tolist())]
        assert got == [1 if d <= 1 else attention_split(program_kind(cost, d, p), d)[0]
                       for d, p in zip(D.tolist(), P.astype(int).tolist())]
        assert {1, 2}.issubset(got) or cost.ranks_per_node == 1  # the ring and hybrids
        over += [u == d > cost.ranks_per_node for u, d in zip(got, D.tolist())]
    assert any(over)  # Ulysses over all of a group's nodes


def test_a_menu_groups_off_its_kinds_run_their_programs_kind():
    """With a menu of programs (`bucket_menu`, the search then prices the ring) under `kind_rule`
    "program", a group whose program the menu lists no kind for still runs its program's kind
    (`program_kind`), not its own fastest; a group of a listed program runs the listed kind."""
    from dhp_jax.planner.cost.geometry import padded_length
    from dhp_jax.planner.cost.pricing import best_kind_times, program_kind, program_rule, sample_terms

    cost = COSTS["menu"].replace(menu_kinds=((2, 8, "ulysses"),))
    assert not program_rule(cost)  # the search's own prices: the ring
    lengths = np.array([3, 5, 9000, 9000, 9000, 9000, 3000])
    terms = sample_terms(cost, lengths, np.zeros(lengths.size))
    groups = [((0, 1), [0, 1]), ((2, 3, 4, 5), [2, 3, 4, 5]), ((4, 5, 6, 7), [6])]
    kinds, _ = best_kind_times(cost, groups, terms)
    own = best_kind_times(cost.replace(kind_rule="group", menu_kinds=((2, 8, "ulysses"),)), groups, terms)[0]
    want = ["ulysses"] + [program_kind(cost, len(r), int(padded_length(cost, float(lengths[s].sum()), len(r))))
                          for r, s in groups[1:]]
    assert kinds == want
    assert kinds[2] != own[2]  # the short group's own fastest kind is another one


def test_program_kinds_table_holds_kinds_only():
    """`program_kind` prices a degree's whole block of ladders at once and keeps which degrees it
    priced beside its table (`_KindTable.priced`), whose entries are all (degree, padded) -> kind."""
    from dhp_jax.planner.cost.pricing import _kinds_table, program_kind

    cost = _BASE.replace(b1=_BASE.b1 * (1 + 1e-9))  # a model of its own: a fresh table
    kind = program_kind(cost, 70, 65536)
    table = _kinds_table(cost)
    assert table.priced == set(range(65, 129)) and table[(70, 65536)] == kind
    assert all(isinstance(k, tuple) and len(k) == 2 and k[0] > 1 and isinstance(v, str) for k, v in table.items())
    table.clear()
    assert not table.priced and program_kind(cost, 70, 65536) == kind


def test_sorted_unique_is_numpys_unique():
    """`pricing.sorted_unique` (the planner's distinct values, without NumPy's masked-array check)
    gives `np.unique`'s values and dtype: the search's float program keys, integers, signed zeros,
    empty and one-element arrays."""
    from dhp_jax.planner.cost.pricing import sorted_unique

    rng = np.random.default_rng(5)
    keys = rng.integers(1, 9, 200).astype(np.float64) * 2.0 ** 40 + rng.integers(1, 6, 200) * 4096.0
    cases = [keys, rng.integers(-3, 4, (5, 7)), np.array([0.0, -0.0, 1.0, 0.0]), np.zeros(0), np.array([7])]
    for x in cases:
        got, want = sorted_unique(x), np.unique(x)
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
