"""Tensor parallelism inside a rank in the JAX executor (`PlanExecutor(..., tensor_parallel=2)`):
8 fake CPU devices as 4 ranks of 2, one DHP step whose micro-batches run irregular ring groups
(3 + 1 ranks), a Ulysses group and a hybrid group, exact (fp32, 1e-5) against one device running
every sample unsharded (`reference_loss`); the model splits its kv heads in the vision encoder
(2 over 2) and replicates them in the decoder (1 kv head on 2 devices), its vocabulary (255)
splits 128 + 127 (the second device holds ids 127..254 and owns 128..254), and its blocks run in chunks with pad skipping (the tp sums inside the skip
conditions). Then the refusals: a head count no layout allows, t that does not divide the
devices, a plan in devices instead of ranks (the families: tests/test_tp_family.py)."""

import functools

import jax
import numpy as np
import pytest

from dhp_jax.data import random_samples
from dhp_jax.model import MLLMConfig, init_params, reference_loss
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan, PlanValidationError
from dhp_jax.sharding import PlanExecutor
from dhp_jax.sharding.mesh import CP_AXIS, SP_AXIS, TP_AXIS, RankLayout

C = MLLMConfig(name="tiny-tp", num_kv_heads=1, vocab_size=255)
LENGTHS = [37, 1, 22, 50, 9, 31, 17, 26]

PLAN = Plan(4, (MicroBatch((Group((0, 1, 2), 3, (0, 1, 2, 4)), Group((3,), 1, (3, 6)))),
                MicroBatch((Group((1, 0), 2, (5,), attention="ulysses"),)),
                MicroBatch((Group((3, 2, 1, 0), 4, (7,), attention="hybrid:2x2"),))))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@functools.cache
def _reference():
    params = init_params(C, jax.random.key(0))
    samples = random_samples(C, LENGTHS, seed=21)
    return params, samples, jax.jit(jax.value_and_grad(lambda p: reference_loss(C, p, samples)))(params)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_step_matches_one_device(sequence_parallel):
    """Sequence-parallel: the block stacks carry half of a rank's rows per device (chunks of 8 rows,
    4 a device), gathered before the split GEMMs and reduce-scattered after them."""
    assert len(jax.devices()) == 8
    params, samples, (ref_loss, ref_grads) = _reference()
    ex = PlanExecutor(C, tensor_parallel=2, linear_chunk=8, sequence_parallel=sequence_parallel)
    assert ex.ranks.num_ranks == 4 and ex.ranks.rank_devices(1) == tuple(jax.devices()[2:4])
    loss, grads = ex.loss_and_grads(ex.replicate(params), samples, PLAN)
    assert _rel(loss, ref_loss) <= 1e-5, (float(loss), float(ref_loss))
    ref = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree.flatten_with_path(ref_grads)[0])
    for path, g in jax.tree.flatten_with_path(grads)[0]:
        name = jax.tree_util.keystr(path)
        assert _rel(g, ref[name]) <= 1e-5, (name, _rel(g, ref[name]))
    # each group ran on its ranks' devices with a last tp axis: ring (cp, tp), Ulysses/hybrid (cp, sp, tp)
    keys = {(k[2], k[3]) for k in ex.executable_keys}
    assert keys == {((0, 1, 2, 3, 4, 5), "ring"), ((6, 7), "ring"), ((2, 3, 0, 1), "ulysses"),
                    ((6, 7, 4, 5, 2, 3, 0, 1), "hybrid:2x2")}
    mesh, _ = ex._mesh(tuple(jax.devices()[i] for i in (6, 7, 4, 5, 2, 3, 0, 1)), "hybrid:2x2")
    assert dict(mesh.shape) == {CP_AXIS: 2, SP_AXIS: 2, TP_AXIS: 2}
    assert [d.id for d in mesh.devices[1, 0]] == [2, 3]


def test_refusals_name_the_model_and_t():
    # 3 kv heads neither split over 2 devices nor divide 2
    with pytest.raises(ValueError, match=r"model 'odd-kv'.*num_kv_heads = 3.*tensor_parallel values"):
        PlanExecutor(MLLMConfig(name="odd-kv", num_heads=6, num_kv_heads=3), tensor_parallel=2)
    with pytest.raises(ValueError, match=r"model 'tiny'.*tensor_parallel 4 cannot split MLLMConfig.vision_heads = 2"):
        PlanExecutor(MLLMConfig(), tensor_parallel=4)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel > 1"):
        PlanExecutor(MLLMConfig(), sequence_parallel=True)
    with pytest.raises(ValueError, match="8 devices do not split into ranks of 3"):
        RankLayout(jax.devices(), 3)
    ex = PlanExecutor(MLLMConfig(), tensor_parallel=2)
    samples = random_samples(ex.config, [8, 8], seed=0)
    eight = Plan(8, (MicroBatch((Group(tuple(range(8)), 8, (0, 1)),)),))
    with pytest.raises(PlanValidationError, match=r"beyond the 4 ranks \(8 devices\)"):
        ex.prepare(samples, eight)


def test_sequence_parallel_config_for_the_families():
    """A family model takes sequence parallelism too (its exactness: tests/test_tp_family.py); it
    still needs tensor parallelism."""
    from dhp_jax.model import hf
    from dhp_jax.train.train_config import ConfigError, load_config
    from dhp_jax.train.demo_models import DEMO_MODELS, demo_config

    name = sorted(DEMO_MODELS)[0]
    config = hf.parse_config(demo_config(DEMO_MODELS[name]))
    assert PlanExecutor(config, tensor_parallel=2, sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel > 1"):
        PlanExecutor(config, sequence_parallel=True)
    with pytest.raises(ConfigError, match="parallel.sequence=true needs parallel.tensor > 1"):
        load_config(overrides=["parallel.sequence=true"])
    cfg = load_config(overrides=["parallel.sequence=true", "parallel.tensor=2", "num_ranks=4", f"model.preset={name}"])
    assert cfg.parallel.sequence and cfg.parallel.tensor == 2
