# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · One DHP plan on sub-meshes of 8 fake CPU devices
#
# The sharding compiler runs every CP group of a `Plan` as its own XLA program on its own device
# sub-mesh, with ring attention inside the group, and sums the gradients of all groups in one
# reduction over the full mesh. This notebook runs one planner-made plan on 8 fake CPU devices and
#
# 1. builds the sub-meshes of the plan and shows how each group's tokens are laid out on them,
# 2. checks that the loss and every gradient equal the single-device reference (fp32, 1e-5),
# 3. inspects the compile cache (programs vs executables, reuse on the next batch),
# 4. reads the compiled HLO of each group program and finds the ring's collective-permutes.
#
# The model is the "tiny" config and the samples are short, so that this runs in about a minute
# on a laptop CPU. Times printed here are **measured on this CPU**, not a prediction for
# accelerators.

# %%
# Fake devices must be requested before jax is imported (restart the kernel if it already was).
from dhp_jax.devices import force_cpu_devices

force_cpu_devices(8)

import re
import time

import jax
import matplotlib.pyplot as plt
import numpy as np

from dhp_jax.data import make_dataset, random_samples, sample_lengths
from dhp_jax.geometry.layout import pack_group
from dhp_jax.model import MLLMConfig, init_params, reference_loss
from dhp_jax.planner import CostModel, plan_batch
from dhp_jax.sharding import PlanExecutor

assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.devices()} (restart the kernel)"
print(jax.__version__, jax.devices())

# %% [markdown]
# ## A plan from the planner
# We plan 8 samples of the long-tailed text mix for 8 ranks of a Qwen3-VL-8B-sized model (the cost
# model only sees lengths), taking the first seed whose plan has two or three groups of distinct
# sizes, one of them an odd ring (few groups keep the compiles few on a CPU): degrees need not be
# powers of two, nor divide the rank count. To run that plan here we then make *tiny* samples, 1/40
# of each length, with real payloads (token ids, image and video patches) for the tiny model; the
# plan refers to samples by index, so it applies unchanged.

# %%
MIX, BATCH, SHRINK = "text-longtail", 8, 40

cost = CostModel.preset("qwen3-vl-8b", "ascend-910b")
for seed in range(20):
    real_lengths = sample_lengths(make_dataset(MIX, BATCH, seed))
    plan = plan_batch(real_lengths, 8, cost, "dhp")
    degrees = sorted((g.degree for g in plan.groups), reverse=True)
    if 2 <= len(plan.groups) <= 3 and len(set(degrees)) == len(degrees) and any(d > 1 and d % 2 for d in degrees):
        break
else:
    raise RuntimeError(f"no seed in 0..19 gave 2-3 groups of distinct degrees, one odd; last: {plan.degrees}")
print(f"seed {seed}: {len(plan.micro_batches)} micro-batch(es), degrees {plan.degrees}")
for m, mb in enumerate(plan.micro_batches):
    for g in mb.groups:
        print(f"micro-batch {m}: ranks {list(g.ranks)} (degree {g.degree}) <- samples {list(g.samples)} "
              f"of {[int(real_lengths[s]) for s in g.samples]} tokens")

config = MLLMConfig.preset("tiny")
tiny_lengths = np.maximum(2, np.ceil(real_lengths / SHRINK)).astype(int)
samples = random_samples(config, tiny_lengths, seed=0)
print("\ntiny lengths:", tiny_lengths.tolist())
print("modalities:  ", [[sg.modality for sg in s.segments] for s in samples])

# %% [markdown]
# ## Sub-meshes and the token layout
# The executor owns one `RankLayout` (rank -> device) and builds each group's 1-D `cp` mesh once.
# Inside a group, the samples are packed into one stream, padded to a length bucket divisible by
# 2 x degree, and cut in zigzag halves: device i holds chunks i and 2d-1-i, which balances causal
# attention work over the ring.

# %%
params = init_params(config, jax.random.key(0))
executor = PlanExecutor(config)
print("full mesh:", executor.mesh)
# plan_keys: (degree, bucket, device ids, attention kind) of each group, in plan order, without compiling
for g, (degree, bucket, ids, kind) in zip(plan.groups, executor.plan_keys(samples, plan)):
    mesh = executor.ranks.submesh(executor.ranks.group_devices(g.ranks))
    assert tuple(d.id for d in mesh.devices.flat) == ids
    print(f"ranks {list(g.ranks)}: bucket {bucket} tokens -> {bucket // degree} per device on "
          f"mesh {dict(mesh.shape)} over devices {list(ids)}")
print("sub-meshes built:", executor.ranks.num_submeshes)

# %%
fig, axes = plt.subplots(len(plan.groups), 1, figsize=(10, 1.0 + 0.5 * max(degrees)), squeeze=False)
for ax, g in zip(axes[:, 0], plan.groups):
    lay = pack_group([samples[s] for s in g.samples], g.degree, config)
    shards = lay.segment_ids.reshape(g.degree, -1)         # segment_ids[degree, S/degree]
    ax.imshow(np.where(shards > 0, shards, np.nan), aspect="auto", cmap="tab10", vmin=1, vmax=10,
              interpolation="nearest")
    ax.set_yticks(range(g.degree), [f"dev {r}" for r in g.ranks], fontsize=7)
    ax.set_title(f"group on ranks {list(g.ranks)}: samples {list(g.samples)}, {lay.num_tokens} tokens "
                 f"padded to {lay.bucket} (white = padding)", fontsize=8)
axes[-1, 0].set_xlabel("token slot on the device (zigzag order; colour = sample)")
fig.tight_layout()

# %% [markdown]
# ## Run the plan; compare with the single-device reference
# `reference_loss` builds its own unpadded, unpermuted stream from the samples and runs the model
# with dense attention on one device: an independent check of packing, zigzag, ring attention and
# the token-weighted gradient reduction.

# %%
t0 = time.perf_counter()
loss, grads = executor.loss_and_grads(params, samples, plan)
jax.block_until_ready(grads)
first_step_s = time.perf_counter() - t0

ref_loss, ref_grads = jax.value_and_grad(lambda p: reference_loss(config, p, samples))(params)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (the scale of the whole tensor, so tiny entries do not dominate)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


rows = [("loss", rel_err(loss, ref_loss))]
ref_by_path = {jax.tree_util.keystr(k): v for k, v in jax.tree.flatten_with_path(ref_grads)[0]}
for path, g in jax.tree.flatten_with_path(grads)[0]:
    name = jax.tree_util.keystr(path)
    assert g.shape == ref_by_path[name].shape, name
    rows.append((name, rel_err(g, ref_by_path[name])))
assert len(rows) == 1 + len(ref_by_path)

print(f"loss: DHP {float(loss):.7f}  reference {float(ref_loss):.7f}")
worst = max(rows, key=lambda r: r[1])
print(f"{len(rows) - 1} gradient tensors; worst relative error {worst[1]:.1e} ({worst[0]})")
for name, err in rows[:6]:
    print(f"  {name:<48} {err:.1e}")
assert all(err <= 1e-5 for _, err in rows), [r for r in rows if r[1] > 1e-5]
print("gradients are replicated on the full mesh:",
      all(g.sharding == executor.replicated for g in jax.tree.leaves(grads)))

# %% [markdown]
# ## The compile cache
# XLA binds an executable to its devices, so the cache key is (degree, bucket, devices, attention).
# `num_programs` counts distinct (degree, bucket, attention) programs, `num_compiles` the executables built.
# Running the same plan again, or a new batch whose groups land in the same buckets, compiles
# nothing new.

# %%
print("executables:", executor.executable_keys)
print(f"num_programs={executor.num_programs}  num_compiles={executor.num_compiles}")
compiles = executor.num_compiles

t0 = time.perf_counter()
jax.block_until_ready(executor.loss_and_grads(params, samples, plan))
again_s = time.perf_counter() - t0

# A different batch: new token ids and pixels, same lengths, so the same buckets.
other = random_samples(config, tiny_lengths, seed=1)
t0 = time.perf_counter()
other_loss, other_grads = executor.loss_and_grads(params, other, plan)
jax.block_until_ready(other_grads)
other_s = time.perf_counter() - t0
assert executor.num_compiles == compiles, "a cached plan compiled again"
# same stream length as the first batch, so the reference reuses its compiled program too
other_ref = jax.value_and_grad(lambda p: reference_loss(config, p, other))(params)
assert rel_err(other_loss, other_ref[0]) <= 1e-5
assert all(rel_err(a, b) <= 1e-5 for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(other_ref[1])))

print(f"step 1 (compiles {compiles} executables): {first_step_s:6.2f} s   (measured, this CPU)")
print(f"step 2 (same batch, cache hit):     {again_s:6.3f} s")
print(f"step 3 (new batch, cache hit):      {other_s:6.3f} s")

# %% [markdown]
# ## Collective-permutes in the compiled HLO
# `PlanExecutor.executable(params, degree, bucket, devices, attention)` returns the cached compiled program,
# whose `as_text()` is the optimised HLO. Ring attention passes K/V (and their ids) to the next
# device with `ppermute`, which XLA compiles to `collective-permute`; its backward pass sends the
# gradients the other way round. A degree-d group should show exactly the ring pairs
# {i -> i+1 mod d} and their reverse, and no all-reduce: gradients leave the group unreduced and
# meet in the reduce-scatter over the full mesh that sums them into the sharded train state.

# %%
PAIRS = re.compile(r"collective-permute(?:-start)?\(.*?source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
devices_by_id = {d.id: d for d in jax.devices()}

for degree, bucket, ids, kind in executor.executable_keys:
    exe = executor.executable(params, degree, bucket, tuple(devices_by_id[i] for i in ids), kind)
    hlo = exe.as_text()
    pair_sets = {tuple(sorted(tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m)))
                 for m in PAIRS.findall(hlo)}
    n_permutes = len(PAIRS.findall(hlo))
    n_allreduce = len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo))
    forward = tuple(sorted((i, (i + 1) % degree) for i in range(degree)))
    backward = tuple(sorted(((i + 1) % degree, i) for i in range(degree)))
    print(f"degree {degree} on devices {list(ids)}: {n_permutes} collective-permutes, "
          f"pair sets {sorted(pair_sets)}, all-reduces {n_allreduce}")
    if degree == 1:
        assert n_permutes == 0, "a one-device group needs no communication"
    else:
        assert n_permutes > 0 and pair_sets <= {forward, backward} and forward in pair_sets, pair_sets
    assert n_allreduce == 0, "a group program must not reduce over its devices"

# %% [markdown]
# One of those instructions as XLA prints it (the pairs are positions on the group's own sub-mesh,
# not global device ids):

# %%
degree, bucket, ids, kind = max(executor.executable_keys)
hlo = executor.executable(params, degree, bucket, tuple(devices_by_id[i] for i in ids), kind).as_text()
print(next(line.strip() for line in hlo.splitlines() if "collective-permute" in line)[:300])
