"""Tensor parallelism in the torch backend: 8 gloo processes as 4 ranks of t = 2 run ring (3 + 1),
Ulysses and hybrid plans, in the psum form and sequence-parallel; loss and gradients equal one
process running every sample unsharded.

One world runs every check (process start-up dominates on shared CPUs): two stand-in models (kv
heads split over t; one kv head replicated on both processes of a rank), each on three plans, the
gathered weights (what `--save-weights` writes) and plans the world refuses; then three tiny
families, their LLM and their vision encoder blocks split, on the same three kinds of plan (each
model and plan once more with sequence parallelism, and the stand-in on 2 ranks of t = 4 whose
stream of 70 rows a shard is padded to 72, the rows of a process 18):
Qwen2.5-VL (q/k/v biases, one kv head, tied embedding; window attention, SwiGLU vision MLP with
biases, fused qkv, 2 vision heads: 1 a process), Qwen3-VL (fused qkv, GELU-tanh, a DeepStack
merger) and InternVL (CLS, layer scales, RMSNorm and QK-norm over all 4 vision heads). Their
checkpoints' constant initial weights (biases, norm scales, layer scales) are perturbed, so a bias
added twice or a scale dropped shows. No jax in the processes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dhp_jax.data.synthetic import random_samples
from dhp_jax.model.mllm_config import MLLMConfig
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan
from npu_backend.launch import run_world

TOL = 1e-5  # fp32, whole model, relative
T = 2
LENGTHS = [30, 12, 25, 9, 20, 14, 6, 17]
CONFIGS = {"kv split": MLLMConfig(), "kv replicated": MLLMConfig(num_kv_heads=1)}
T4_CONFIG = MLLMConfig(vision_heads=4)      # t = 4: 1 query head a process, the 2 kv heads replicated


def _plan(*groups: tuple[list[int], list[int], str]) -> Plan:
    return Plan(num_ranks=4, micro_batches=(MicroBatch(tuple(
        Group(tuple(r), len(r), tuple(s), attention=a) for r, s, a in groups)),))


PLANS = {
    "ring 3 + 1": _plan(([1, 2, 3], [0, 2, 4, 6], "ring"), ([0], [1, 3, 5, 7], "ring")),
    "ulysses 2 + ring 2": _plan(([2, 0], [0, 1, 2, 3], "ulysses"), ([3, 1], [4, 5, 6, 7], "ring")),
    "hybrid 2x2": _plan(([0, 1, 2, 3], list(range(8)), "hybrid:2x2")),
}


def _t4_plan(samples) -> Plan:
    """2 ranks (of t = 4) in one ring over every sample, the stream padded to 140 rows: 70 a shard,
    which t = 4 does not divide (sequence parallelism pads it to 72: 18 rows a process)."""
    tokens = sum(s.num_tokens for s in samples)
    assert tokens <= 140 and 140 // 2 % 4 == 2
    return Plan(num_ranks=2, micro_batches=(MicroBatch((Group((1, 0), 2, tuple(range(len(samples))), attention="ring",
                                                              tokens=tokens, padded_tokens=140),)),))


def _reference(config: MLLMConfig, samples) -> tuple[float, dict]:
    """One process, every sample in one unsharded stream, no tensor parallelism."""
    import torch

    from dhp_jax.geometry.layout import MODEL_INPUTS, pack_group
    from npu_backend.model import TorchMLLM, token_loss_sum

    model = TorchMLLM(config)
    layout = pack_group(samples, 1, config)
    batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in layout.arrays().items()}
    loss = token_loss_sum(model({k: batch[k] for k in MODEL_INPUTS}), batch["targets"], batch["loss_weights"])
    loss = loss / layout.num_loss_tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _stand_in(rank: int, configs, samples, plans, t4_plan) -> dict:
    from torch.distributed import distributed_c10d as c10d

    from npu_backend.executor import StepError, TorchPlanExecutor
    from npu_backend.model import TorchMLLM

    out: dict = {"process groups": [c10d.get_pg_count()]}
    for cname, config in configs.items():
        model = TorchMLLM(config)          # the same seeded weights on every process, whole
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
        ex = TorchPlanExecutor(model, tensor_parallel=T)
        gathered = ex.tp.gather(model)     # the weights --save-weights writes: the whole model again
        out[cname, "gathered"] = all(bool((gathered[n] == w).all()) for n, w in whole.items())
        out[cname, "held"] = sum(p.numel() for p in model.parameters()) / sum(w.numel() for w in whole.values())
        out["process groups"].append(c10d.get_pg_count())
        for pname, plan in plans.items():
            out[cname, pname] = _step(rank, ex, model, plan, samples)
        out["process groups"].append(c10d.get_pg_count())
        model = TorchMLLM(config)          # sequence parallelism
        ex = TorchPlanExecutor(model, tensor_parallel=T, sequence_parallel=True)
        for pname, plan in plans.items():
            out[cname, "sequence", pname] = _step(rank, ex, model, plan, samples)
        out[cname, "sequence collectives"] = _block_collectives(model, rank)
    try:
        ex.loss_and_grads(dataclasses.replace(plans["hybrid 2x2"], num_ranks=8), samples)
    except StepError as e:
        out["wrong ranks"] = str(e)
    try:     # 4 query heads, 2 a process: Ulysses over 4 ranks cannot split them
        ex.loss_and_grads(_plan(([0, 1, 2, 3], list(range(8)), "ulysses")), samples)
    except StepError as e:
        out["ulysses 4"] = str(e)
    model = TorchMLLM(T4_CONFIG)           # 2 ranks of 4, sequence-parallel over 18 rows (2 of them padding)
    ex = TorchPlanExecutor(model, tensor_parallel=4, sequence_parallel=True)
    out["t4 sequence"] = _step(rank, ex, model, t4_plan, samples)
    return out


def _block_collectives(model, rank: int) -> dict:
    """{"forward" | "backward": {collective: calls}} of one sequence-parallel decoder block of a
    sharded model on a stream of 23 rows (3 of them dead: the live-rows path), counted by wrapping
    the backend's all-gather and reduce-scatter and torch.distributed's all-reduce."""
    import torch
    import torch.distributed as dist

    import npu_backend.tensor_parallel as tensor
    from npu_backend.model import dense_attn

    counts: dict = {}
    kinds = {"_ALL_GATHER": "all_gather", "_REDUCE_SCATTER": "reduce_scatter"}
    originals = {name: getattr(tensor, name) for name in kinds} | {"all_reduce": dist.all_reduce}

    def counted(kind: str, f):
        def call(*args, **kwargs):
            counts[kind] = counts.get(kind, 0) + 1
            return f(*args, **kwargs)
        return call

    gen = torch.Generator().manual_seed(11 + rank // T)      # the same stream on a rank's processes
    s, c = 23, model.config
    x = torch.randn((s, c.d_model), generator=gen)
    ids = torch.stack([(torch.arange(s) < 20).long(), torch.arange(s), torch.zeros(s, dtype=torch.long)], dim=1)
    tp, blk = model.tp, model.layers[0]
    rows = tp.rows(x).detach().requires_grad_()
    out: dict = {}
    try:
        for name, kind in kinds.items():
            setattr(tensor, name, counted(kind, originals[name]))
        dist.all_reduce = counted("all_reduce", originals["all_reduce"])
        y = blk.sequence_forward(rows, ids, dense_attn)
        out["forward"], counts = dict(counts), {}
        (y * y).sum().backward()
        out["backward"] = dict(counts)
    finally:
        for name in kinds:
            setattr(tensor, name, originals[name])
        dist.all_reduce = originals["all_reduce"]
    model.zero_grad(set_to_none=True)
    return out


def _step(rank: int, ex, model, plan, samples) -> dict:
    """Loss and whole gradients of one step (the gradients from the first and the last process)."""
    loss, _, _ = ex.loss_and_grads(plan, samples)
    g = ex.tp.gather(model, grads=True)
    return {"loss": loss, "grads": {n: v.numpy() for n, v in g.items()} if rank in (0, 7) else None}


def _family(rank: int, cases: dict, plans) -> dict:
    from npu_backend.executor import TorchPlanExecutor
    from npu_backend.hf import load_family

    out = {}
    for family, (path, samples) in cases.items():
        model = load_family(path)
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
        ex = TorchPlanExecutor(model, tensor_parallel=T)
        gathered = ex.tp.gather(model)     # what --save-weights writes
        vision = [n for n in whole if ".visual.blocks." in n or ".vision_tower.encoder." in n]
        out[family] = {"gathered": all(bool((gathered[n] == w).all()) for n, w in whole.items()),
                       "vision held": sum(model.params[n].numel() for n in vision) / sum(whole[n].numel() for n in vision)}
        out[family].update({pname: _step(rank, ex, model, plan, samples) for pname, plan in plans.items()})
        model = load_family(path)          # sequence parallelism
        ex = TorchPlanExecutor(model, tensor_parallel=T, sequence_parallel=True)
        out[family].update({("sequence", pname): _step(rank, ex, model, plan, samples) for pname, plan in plans.items()})
    return out


def _worker(rank: int, world: int, stand_in: tuple, family: tuple) -> dict:
    return {"stand-in": _stand_in(rank, *stand_in), "family": _family(rank, *family)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(stand-in references, family references, every process's results) of one world of 8 processes."""
    samples = random_samples(CONFIGS["kv split"], LENGTHS, seed=3)
    refs = {c: _reference(cfg, samples) for c, cfg in CONFIGS.items()}
    refs["t4"] = _reference(T4_CONFIG, samples)
    cases = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(f"tp_{family}"))
        cases[family] = (path, _family_case(path, family))
    family_refs = {f: _family_reference(*case) for f, case in cases.items()}
    res = run_world(_worker, 8, ((CONFIGS, samples, PLANS, _t4_plan(samples)), (cases, FAMILY_PLANS)), timeout=300)
    return refs, family_refs, res


def _check(label: str, got: dict, ref_loss: float, ref_grads: dict) -> float:
    """Assert loss and gradients within TOL of the reference; return the worst gradient error."""
    assert abs(got["loss"] - ref_loss) <= TOL * abs(ref_loss), (label, got["loss"], ref_loss)
    if got["grads"] is None:
        return 0.0
    assert set(got["grads"]) == set(ref_grads)
    rel = {n: float(np.abs(got["grads"][n] - v).max() / max(np.abs(v).max(), 1e-30)) for n, v in ref_grads.items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= TOL, f"{label}: gradient {worst} off by {rel[worst]:.2e}"
    return rel[worst]


def test_world8_tensor_parallel_2_matches_one_process(world):
    refs, _, res = world
    for cname in CONFIGS:
        ref_loss, ref_grads = refs[cname]
        for r, o in enumerate(res):
            assert o["stand-in"][cname, "gathered"], (cname, r)
            assert o["stand-in"][cname, "held"] < 0.75, (cname, o["stand-in"][cname, "held"])   # a part only
        for form in ((), ("sequence",)):
            for pname in PLANS:
                key = (cname, *form, pname)
                worst = max(_check(f"{key}, process {r}", o["stand-in"][key], ref_loss, ref_grads) for r, o in enumerate(res))
                print(f"stand-in {key}: loss {abs(res[0]['stand-in'][key]['loss'] - ref_loss) / ref_loss:.1e}, "
                      f"worst gradient {worst:.1e}")
    worst = max(_check(f"t = 4 sequence-parallel, process {r}", o["stand-in"]["t4 sequence"], *refs["t4"])
                for r, o in enumerate(res))
    print(f"stand-in t = 4 sequence-parallel (padded rows): loss "
          f"{abs(res[0]['stand-in']['t4 sequence']['loss'] - refs['t4'][0]) / refs['t4'][0]:.1e}, worst gradient {worst:.1e}")
    # each executor creates its 4 + 2 groups (one per rank, one per tp index) once; plans create none
    for o in res:
        pgs = o["stand-in"]["process groups"]          # the world's, then after each psum-form executor and its steps
        assert [c - pgs[0] for c in pgs[1:]] == [6, 6, 18, 18], pgs
    e = res[0]["stand-in"]["wrong ranks"]
    assert "num_ranks=8" in e and "8 processes = 4 ranks of tensor_parallel 2" in e
    assert "the 2 query heads do not split over 4 Ulysses ranks" in res[0]["stand-in"]["ulysses 4"]


def test_sequence_parallel_block_runs_the_collectives_the_cost_model_prices(world):
    """One sequence-parallel block's all-gathers and reduce-scatters, forward and backward, are those
    the cost model prices (`block_collectives`; no recompute in the torch backend: remat "none"),
    and no all-reduce: the backward pass reuses the gathered inputs (as the JAX program does)."""
    from dhp_jax.planner.cost.memory import REMAT_PASSES
    from dhp_jax.planner.cost.tensor_parallel import block_collectives

    passes = REMAT_PASSES["none"][1]
    forward = block_collectives(passes, forward_only=True)
    step = block_collectives(passes)
    priced = {"forward": forward, "backward": {k: step[k] - forward[k] for k in step}}
    priced = {p: {k: int(n) for k, n in v.items() if n} for p, v in priced.items()}
    _, _, res = world
    for cname in CONFIGS:
        for r, o in enumerate(res):
            assert o["stand-in"][cname, "sequence collectives"] == priced, (cname, r, priced)
    print(f"collectives per sequence-parallel block: {res[0]['stand-in']['kv split', 'sequence collectives']}")


def test_head_counts_tensor_parallel_cannot_split_are_refused():
    from npu_backend.tensor_parallel import check_model

    with pytest.raises(ValueError, match=r"model 'tiny': tensor_parallel 3 cannot split MLLMConfig.num_heads = 4"):
        check_model(MLLMConfig(), 3)
    with pytest.raises(ValueError, match=r"tensor_parallel 4 cannot split MLLMConfig.num_kv_heads = 3"):
        check_model(MLLMConfig(num_heads=12, num_kv_heads=3, d_ff=64, vision_heads=4), 4)
    check_model(MLLMConfig(num_kv_heads=1, vision_heads=4), 4)     # one kv head, on 4 processes: allowed


def test_sequence_parallel_rows_are_the_jax_engines_and_need_tensor_parallel():
    """The rows a process holds are the JAX engine's (one chunk: the torch blocks run the stream in
    one pass), and sequence parallelism without tensor parallelism is refused before any collective."""
    from dhp_jax.model.mllm import sequence_chunks
    from npu_backend.tensor_parallel import TensorParallel, sequence_rows

    for t in (2, 3, 4, 8):
        for s in range(1, 70):
            assert sequence_rows(s, t) == (sequence_chunks(s, 0, t)[1], sequence_chunks(s, 0, t)[1] // t), (s, t)
    assert sequence_rows(70, 4) == (72, 18)
    with pytest.raises(ValueError, match=r"sequence_parallel needs tensor_parallel > 1"):
        TensorParallel.create(2, 1, sequence=True)
    with pytest.raises(ValueError, match=r"sequence_parallel must be True or False, got 'yes'"):
        TensorParallel.create(2, 2, sequence="yes")


def test_family_vision_heads_and_width_tensor_parallel_cannot_split_are_refused():
    from dhp_jax.model import hf
    from dhp_jax.model.hf.init import tiny_config
    from npu_backend.tensor_parallel import check_model

    raw = tiny_config("qwen3_vl", FAMILY_TOKENS, 96)
    raw["vision_config"].update(num_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match=r"model 'qwen3_vl': tensor_parallel 2 cannot split vision_config heads "
                                         r"\(num_heads / num_attention_heads\) = 3"):
        check_model(hf.parse_config(raw), 2)
    raw = tiny_config("internvl", FAMILY_TOKENS, 96)
    raw["vision_config"].update(num_attention_heads=4, intermediate_size=66)
    with pytest.raises(ValueError, match=r"model 'internvl': tensor_parallel 4 cannot split "
                                         r"vision_config.intermediate_size = 66"):
        check_model(hf.parse_config(raw), 4)
    check_model(hf.parse_config(raw), 2)


# ---------------------------------------------------------------------------------------- a family
FAMILY_TOKENS = {"image": 1, "video": 2, "vision_start": 3, "vision_end": 4}


def _qwen_sample(config, g, sample_id: int, before: int, grid: tuple[int, int] | None, after: int):
    """text, an image of grid (h, w) patches (h w / 4 tokens), text, as the Qwen processors emit it;
    the text labelled, the vision tokens not."""
    from dhp_jax.model import hf

    t = FAMILY_TOKENS
    ids, types = list(g.integers(5, config.vocab_size, before)), [0] * before
    inputs = {}
    if grid is not None:
        h, w = grid
        n = h * w // 4
        ids += [t["vision_start"]] + [t["image"]] * n + [t["vision_end"]]
        types += [0] + [1] * n + [0]
        v = config.vision
        inputs = {"pixel_values": g.standard_normal((h * w, 3 * v.temporal_patch_size * v.patch_size ** 2)).astype(np.float32),
                  "image_grid_thw": np.array([[1, h, w]])}
    ids += list(g.integers(5, config.vocab_size, after))
    types += [0] * after
    inputs.update(input_ids=np.array([ids]), attention_mask=np.ones((1, len(ids)), np.int64),
                  mm_token_type_ids=np.array([types]))
    labels = np.where(np.array(types) > 0, -100, np.array(ids))
    labels[[0, 2 if len(ids) > 2 else 0]] = -100
    return hf.sample_from_inputs(config, inputs, labels[None], sample_id=sample_id)


FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")


def _internvl_sample(config, g, sample_id: int, before: int, tiles: int, after: int):
    """text, an image of `tiles` 16 x 16 tiles (4 tokens each), text; the text labelled."""
    from dhp_jax.model import hf

    ids = list(g.integers(5, config.vocab_size, before)) + [FAMILY_TOKENS["image"]] * (4 * tiles)
    ids += list(g.integers(5, config.vocab_size, after))
    inputs = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
    if tiles:
        inputs["pixel_values"] = g.standard_normal((tiles, 3, 16, 16)).astype(np.float32)
    labels = np.where(np.array(ids) == FAMILY_TOKENS["image"], -100, np.array(ids))
    labels[0] = -100
    return hf.sample_from_inputs(config, inputs, labels[None], sample_id=sample_id)


def _family_case(directory: str, family: str):
    """A tiny checkpoint of `family` written without transformers (its constant initial weights
    perturbed), and a batch of 4 samples."""
    import torch

    from dhp_jax.model import hf
    from dhp_jax.model.hf.init import random_params, tiny_config
    from npu_backend.hf import load_family, save_family

    raw = tiny_config(family, FAMILY_TOKENS, 96)
    if family == "qwen2_5_vl":
        raw["text_config"].update(num_key_value_heads=1, tie_word_embeddings=True)
        raw["tie_word_embeddings"] = True
    if family == "internvl":   # 16 x 16 tiles of 4 x 4 patches; InternViT-6B's RMSNorm and QK-norm
        raw["vision_config"].update(image_size=[16, 16], patch_size=[4, 4], num_attention_heads=4,
                                    use_qk_norm=True, norm_type="rms_norm")
        raw["image_seq_length"] = 4
    config = hf.parse_config(raw)
    hf.save_pretrained(config, random_params(config, 5), directory)
    model = load_family(directory)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if float(p.std()) == 0 or p.numel() == 1:     # biases, norm and layer scales: no longer constant
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            elif ".visual." in name or ".vision_tower." in name:
                p.mul_(10.0)      # vision weights N(0, 0.2): attention far from uniform, q/k gradients not tiny
    save_family(model, directory)
    g = np.random.default_rng(4)
    if family == "internvl":
        specs = [(6, 2, 5), (0, 1, 8), (12, 0, 0), (7, 3, 4)]
        return [_internvl_sample(config, g, i, *spec) for i, spec in enumerate(specs)]
    specs = [(6, (4, 4), 5), (0, (2, 4), 8), (12, None, 0), (7, (2, 2), 4)]
    return [_qwen_sample(config, g, i, *spec) for i, spec in enumerate(specs)]


FAMILY_PLANS = {
    "ring 3 + 1": _plan(([2, 0, 1], [0, 2], "ring"), ([3], [1, 3], "ring")),
    "ulysses 2 + ring 2": _plan(([1, 3], [0, 1], "ulysses"), ([0, 2], [2, 3], "ring")),
    "hybrid 2x2": _plan(([3, 1, 0, 2], [0, 1, 2, 3], "hybrid:2x2")),
}


def _family_reference(path: str, samples) -> tuple[float, dict]:
    """One process, the whole batch in one unsharded stream."""
    from dhp_jax.model.hf.packed import pack_family_group
    from npu_backend.hf import load_family, stream_tensors

    model = load_family(path)
    if model.config.family == "qwen2_5_vl":
        assert model.config.tied and model.config.text.shape.num_kv_heads == 1
        assert "model.language_model.layers.0.self_attn.k_proj.bias" in model.params
    if model.config.family == "internvl":
        assert model.config.vision.qk_norm and model.config.vision.num_heads == 4
    layout = pack_family_group(samples, 1, model.config)
    loss = model.loss_sum(*stream_tensors(layout)) / layout.num_loss_tokens
    loss.backward()
    return float(loss.detach()), model.grads()


def test_families_tensor_parallel_2_matches_one_process(world):
    """LLM and vision encoder split: loss and gradients of every family equal one process's."""
    _, family_refs, res = world
    for family, (ref_loss, ref_grads) in family_refs.items():
        for r, o in enumerate(res):
            assert o["family"][family]["gathered"], (family, r)
            assert o["family"][family]["vision held"] < 0.6, (family, o["family"][family]["vision held"])
        for key in [*FAMILY_PLANS, *(("sequence", p) for p in FAMILY_PLANS)]:
            worst = max(_check(f"{family}, {key}, process {r}", o["family"][family][key], ref_loss, ref_grads)
                        for r, o in enumerate(res))
            print(f"{family}, {key}: loss {abs(res[0]['family'][family][key]['loss'] - ref_loss) / ref_loss:.1e}, "
                  f"worst gradient {worst:.1e}")
