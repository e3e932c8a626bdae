"""The grouped expert GEMM of the MoE block (`dhp_jax.model.hf.moe`): the "blocks" formulation
(`block_dot` over `block_layout`) against `jax.lax.ragged_dot` ("ragged"), values and gradients
at fp32 1e-5, on routings with empty experts, every row on one expert and rows of other devices'
experts; its layout; and the compiled program holding the routed rows, not XLA:CPU's dense copy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dhp_jax.model.hf import moe
from hf_cases import TOL, relative_error

S, K, E, D, I = 256, 2, 8, 16, 12      # blocks of 4 rows (8 with 4 experts here): padding in play


def _act(g, u):
    return jax.nn.silu(g) * u


def _routing(name: str, rng) -> tuple[np.ndarray, int, int]:
    """(expert ids [S, K], first expert held here, experts held here)."""
    if name == "random":
        return rng.integers(0, E, (S, K)), 0, E
    if name == "empty_experts":             # experts 1, 3, 4, 6, 7 get no row
        return rng.choice([0, 2, 5], (S, K)), 0, E
    if name == "one_expert":                # every first choice on expert 3, every second on 5
        return np.stack([np.full(S, 3), np.full(S, 5)], 1), 0, E
    if name == "other_devices":             # the device holds experts 4..7 of 8; about half the pairs are elsewhere
        return rng.integers(0, E, (S, K)), 4, E // 2
    if name == "none_here":                 # every pair on the other device's experts
        return rng.integers(0, E // 2, (S, K)), 4, E // 2
    raise KeyError(name)


ROUTINGS = ("random", "empty_experts", "one_expert", "other_devices", "none_here")


def _value_and_grads(kind: str, routing: str, monkeypatch):
    rng = np.random.default_rng(ROUTINGS.index(routing))
    ids, first, local = _routing(routing, rng)
    assert moe.block_rows(S * K, local) > 1
    experts = {"gate_up_proj": jnp.asarray(0.2 * rng.normal(size=(local, 2 * I, D)), jnp.float32),
               "down_proj": jnp.asarray(0.2 * rng.normal(size=(local, D, I)), jnp.float32)}
    z = jnp.asarray(rng.normal(size=(S, D)), jnp.float32)
    weights = jnp.asarray(rng.random((S, K)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(S, D)), jnp.float32)
    monkeypatch.setenv(moe.GROUPED_GEMM_ENV, kind)

    def loss(experts, z, weights):
        y = moe.grouped_experts(experts, z, jnp.asarray(ids, jnp.int32), weights, _act, first)
        return jnp.sum(jnp.tanh(y) * probe), y
    (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(experts, z, weights)
    return [y, value, *jax.tree.leaves(grads)]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_blocks_match_ragged_dot(routing, monkeypatch):
    """The "blocks" grouped GEMM equals `ragged_dot`'s: the block's output, a loss of it and the
    gradients of the experts' weights, the rows and the routing weights."""
    ref = _value_and_grads("ragged", routing, monkeypatch)
    got = _value_and_grads("blocks", routing, monkeypatch)
    if routing == "none_here":
        assert not np.any(np.asarray(ref[0])) and not np.any(np.asarray(got[0]))
    for name, a, b in zip(("output", "loss", "d down", "d gate_up", "d rows", "d weights"), got, ref):
        b = np.asarray(b, np.float64)
        if not np.any(b):
            assert not np.any(np.asarray(a)), (routing, name)
            continue
        err = relative_error(a, b)
        assert err <= TOL, f"{routing}, {name}: relative error {err:.2e} > {TOL}"


def test_block_layout_places_each_groups_rows_in_its_own_blocks():
    """Every sorted row of a group lies in exactly one slot, in order, of a block of that group; the
    rows past the groups in none; the slot count bounds the padding at rows / BLOCKS_PER_EXPERT."""
    rng = np.random.default_rng(0)
    for rows, groups in ((80, 8), (5000, 4), (3, 8), (700, 1)):
        layout = jax.jit(moe.block_layout, static_argnums=1)
        for trial in range(3):
            held = rows if trial == 0 else int(rng.integers(0, rows + 1))
            sizes = np.bincount(rng.integers(0, groups, held), minlength=groups) if trial != 2 else \
                np.eye(groups, dtype=int)[int(rng.integers(groups))] * held
            source, group = (np.asarray(a) for a in layout(jnp.asarray(sizes, jnp.int32), rows))
            b = moe.block_rows(rows, groups)
            assert source.shape == (moe.padded_rows(rows, groups),) and source.size == group.size * b
            assert source.size <= rows * (1 + 1 / moe.BLOCKS_PER_EXPERT), (rows, groups, source.size)
            starts = np.concatenate([[0], np.cumsum(sizes)])
            for g in range(groups):
                slots = np.flatnonzero((source >= starts[g]) & (source < starts[g + 1]))
                assert list(source[slots]) == list(range(starts[g], starts[g + 1])), (rows, groups, g)
                assert np.all(np.repeat(group, b)[slots] == g)
            assert np.sum(source >= 0) == held


def test_grouped_gemm_kind_rule_and_override(monkeypatch):
    """"ragged" unless a `grouped_gemm` block (the memory measurements) says "blocks"; the
    environment variable overrides both, and a bad value is refused by name."""
    monkeypatch.delenv(moe.GROUPED_GEMM_ENV, raising=False)
    assert moe.grouped_gemm_kind() == "ragged"
    with moe.grouped_gemm("blocks"):
        assert moe.grouped_gemm_kind() == "blocks"
        with moe.grouped_gemm("ragged"):
            assert moe.grouped_gemm_kind() == "ragged"
        assert moe.grouped_gemm_kind() == "blocks"
    assert moe.grouped_gemm_kind() == "ragged"
    for kind in moe.GROUPED_GEMMS:
        monkeypatch.setenv(moe.GROUPED_GEMM_ENV, kind)
        assert moe.grouped_gemm_kind() == kind
        with moe.grouped_gemm("blocks" if kind == "ragged" else "ragged"):
            assert moe.grouped_gemm_kind() == kind
    monkeypatch.setenv(moe.GROUPED_GEMM_ENV, "dense")
    with pytest.raises(ValueError, match="DHP_GROUPED_GEMM='dense' is not one of"):
        moe.grouped_gemm_kind()
    with pytest.raises(ValueError, match="grouped GEMM 'dense' is not one of"):
        with moe.grouped_gemm("dense"):
            pass


def test_blocks_program_holds_the_routed_rows_only(monkeypatch):
    """XLA:CPU's program of a sparse block's forward and backward pass: with "ragged" it holds
    dense copies over the experts (temp bytes growing with E x rows); with "blocks" its temp bytes
    stay within a small multiple of the padded routed rows' bytes (rows x (2 d + 3 I) each)."""
    s, k, e, d, inter = 256, 2, 32, 32, 16
    rng = np.random.default_rng(1)
    experts = {"gate_up_proj": jnp.zeros((e, 2 * inter, d)), "down_proj": jnp.zeros((e, d, inter))}
    z, weights = jnp.zeros((s, d)), jnp.zeros((s, k))
    ids = jnp.asarray(rng.integers(0, e, (s, k)), jnp.int32)

    def temp(kind: str) -> int:
        monkeypatch.setenv(moe.GROUPED_GEMM_ENV, kind)
        f = jax.grad(lambda ex, z, w: jnp.sum(moe.grouped_experts(ex, z, ids, w, _act)), argnums=(0, 1, 2))
        return jax.jit(f).lower(experts, z, weights).compile().memory_analysis().temp_size_in_bytes

    rows = moe.padded_rows(s * k, e) * (2 * d + 3 * inter) * 4
    blocks, ragged = temp("blocks"), temp("ragged")
    print(f"temp bytes: blocks {blocks}, ragged {ragged}, padded routed rows {rows}")
    assert blocks <= 3 * rows < ragged / 4, (blocks, ragged, rows)


def test_padding_slots_never_reach_the_output(monkeypatch):
    """A padding slot reads some token's row through its block's expert; its output is dropped, so
    an expert that no pair reaches, with weights that overflow, leaves every output and gradient
    finite and equal to `ragged_dot`'s (the blocks past the last expert's are that expert's)."""
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(0, E - 1, (S, K)), jnp.int32)            # expert E - 1 gets no pair
    gate_up = 0.2 * rng.normal(size=(E, 2 * I, D))
    gate_up[E - 1] = 1e30
    experts = {"gate_up_proj": jnp.asarray(gate_up, jnp.float32),
               "down_proj": jnp.asarray(0.2 * rng.normal(size=(E, D, I)), jnp.float32)}
    z = jnp.asarray(0.1 + np.abs(rng.normal(size=(S, D))), jnp.float32)     # any row overflows through E - 1
    weights = jnp.asarray(rng.random((S, K)), jnp.float32)
    sizes = np.bincount(np.asarray(ids).reshape(-1), minlength=E)
    b = moe.block_rows(S * K, E)
    assert moe.padded_rows(S * K, E) > b * int(np.sum(-(-sizes // b)))          # blocks past the last expert's

    def run(kind):
        monkeypatch.setenv(moe.GROUPED_GEMM_ENV, kind)
        f = lambda ex, z: jnp.sum(jnp.tanh(moe.grouped_experts(ex, z, ids, weights, _act)))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(experts, z)
    ref, got = run("ragged"), run("blocks")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert np.all(np.isfinite(np.asarray(a)))
        b = np.asarray(b, np.float64)
        assert (relative_error(a, b) if np.any(b) else float(np.max(np.abs(a)))) <= TOL
