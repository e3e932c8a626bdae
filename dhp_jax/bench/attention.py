"""`dhp bench attention`: what the tiled custom-VJP ring attention holds, skips and costs.

Three measures on the local (fake CPU) devices, tiny model:
- memory: temp bytes per device of the compiled group program (XLA `memory_analysis()`, params
  given as `jax.ShapeDtypeStruct`, nothing allocated) at the same local length S/d on d = 1 and
  d = 8, and at d = 4 for 4x more tokens;
- tiles: (query tile, key tile) pairs of one causal sample on a zigzag ring of degree 8: the
  pairs the skip rule allows, as a share of the dense pairs (`dhp_jax.geometry.tiling.count_ring_tiles`,
  NumPy), beside the pairs the ring kernel executed, forward and backward, counted as they ran
  (`dhp_jax.model.executed`: a callback inside the branch that computes a pair);
- step time: DHP steps of the demo's batches (`dhp_jax/train/configs/demo.yaml`: same data,
  planner and planning cost model), this ring vs the earlier ring (a `lax.scan` over dense blocks with autodiff,
  kept here as the baseline), interleaved in one run, medians.

`--device-check` is the GPU script: a reduced-depth internvl3-2b degree-1 group program at 8k and
32k tokens, tiled path vs the cuDNN fused kernel, step time and memory. Without a GPU it says so in
one line and exits 0.

jax and the modules that import it are imported inside the functions: `run` asks for 8 fake CPU
devices first, which works only before jax's first import.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from typing import Any

import numpy as np

from dhp_jax.devices import force_cpu_devices
from dhp_jax.geometry.layout import zigzag_permutation
from dhp_jax.geometry.tiling import DEFAULT_TILE, count_ring_tiles
from dhp_jax.train.train_config import DEMO_CONFIG, load_config
from dhp_jax.train.pipeline import DataPipeline
from dhp_jax.train.plans import PlanSource, make_cost



def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, default=2, help="demo batches timed (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per batch and ring (default 5)")
    parser.add_argument("--tile", type=int, default=None, help="ring tile (tokens; default the library's)")
    parser.add_argument("--skip-steps", action="store_true", help="memory and tiles only")
    parser.add_argument("--full-opt", action="store_true",
                        help="time steps with XLA's default backend optimisation (the CPU default is level 0)")
    parser.add_argument("--device-check", action="store_true",
                        help="GPU: internvl3-2b (2 layers) degree 1 at 8k/32k tokens, tiled vs fused")
    parser.add_argument("--json", action="store_true", help="print results as JSON")


# ---------------------------------------------------------------------- the baseline ring
def _scan_ring(q, k, v, q_ids, k_ids, *, axis_name: str, degree: int):
    """The earlier ring: dense [S_l, S_l] blocks in a `lax.scan`, gradients by autodiff."""
    import jax.numpy as jnp
    from jax import lax

    from dhp_jax.model.attention import AttnIds, attention_mask, repeat_kv

    def fold(acc, k, v, k_ids):
        m, l, o = acc
        mask = attention_mask(q_ids, k_ids)

        def compute(_):
            g = q.shape[1] // k.shape[1]
            s = jnp.einsum("qhd,khd->hqk", q, repeat_kv(k, g)) / jnp.sqrt(jnp.float32(q.shape[-1]))
            m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(jnp.where(mask[None], s, -1e30), axis=-1)))
            p = jnp.exp(jnp.where(mask[None], s - m_new[..., None], -jnp.inf))
            corr = jnp.exp(m - m_new)
            return m_new, l * corr + jnp.sum(p, -1), o * corr[..., None] + jnp.einsum("hqk,khd->hqd", p, repeat_kv(v, g))

        return lax.cond(jnp.any(mask), compute, lambda _: (m, l, o), None)

    s_l, h, d = q.shape
    acc = fold((jnp.full((h, s_l), -1e30), jnp.zeros((h, s_l)), jnp.zeros((h, s_l, d))), k, v, k_ids)
    if degree > 1:
        perm = [(i, (i + 1) % degree) for i in range(degree)]

        def step(carry, _):
            acc, kv = carry
            kv = lax.ppermute(kv, axis_name, perm)
            return (fold(acc, kv[0], kv[1], AttnIds(*kv[2])), kv), None

        (acc, _), _ = lax.scan(step, (acc, (k, v, tuple(k_ids))), None, length=degree - 1)
    _, l, o = acc
    return jnp.transpose(o / jnp.where(l > 0, l, 1.0)[..., None], (1, 0, 2))


def baseline_attention(axis_name: str, degree: int):
    return functools.partial(_scan_ring, axis_name=axis_name, degree=degree)


# ---------------------------------------------------------------------- measures
def _executor(config, tile=None, attention=None, compiler_options=None):
    from dhp_jax.sharding import PlanExecutor

    kw = {} if tile is None else {"attention_tile": tile}
    return PlanExecutor(config, attention=attention, compiler_options=compiler_options, **kw)


def temp_bytes(ex, params_struct, degree: int, tokens: int) -> int:
    import jax

    devs = tuple(jax.devices()[:degree])
    return int(ex.executable(params_struct, degree, tokens, devs).memory_analysis().temp_size_in_bytes)


def memory(tile=None) -> dict[str, Any]:
    import jax

    from dhp_jax.model import MLLMConfig, init_params

    config = MLLMConfig.preset("tiny")
    struct = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    ex = _executor(config, tile)
    cases = {"d1_S1024": (1, 1024), "d8_S8192": (8, 8192), "d4_S4096": (4, 4096), "d4_S16384": (4, 16384)}
    mib = {k: temp_bytes(ex, struct, d, s) / 2 ** 20 for k, (d, s) in cases.items()}
    return {"temp_mib_per_device": {k: round(v, 2) for k, v in mib.items()},
            "same_local_d8_over_d1": round(mib["d8_S8192"] / mib["d1_S1024"], 3),
            "d4_growth_for_4x_tokens": round(mib["d4_S16384"] / mib["d4_S4096"], 3)}


def executed_tiles(segment, position, span, degree: int, tile: int) -> dict[str, int]:
    """Tile pairs the ring kernel executed, summed over the devices, in one forward and backward
    pass over a stream in device order (small heads: the count depends on the ids only)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from dhp_jax.model.attention import AttnIds
    from dhp_jax.model.executed import counting
    from dhp_jax.sharding.mesh import CP_AXIS
    from dhp_jax.sharding.ring import ring_attention

    s = len(segment)
    ids = AttnIds(*(jnp.asarray(a, jnp.int32) for a in (segment, position, span)))
    q, k, v = (jax.random.normal(jax.random.key(i), (s, h, 8)) for i, h in enumerate((2, 1, 1)))
    mesh = Mesh(np.array(jax.devices()[:degree]), (CP_AXIS,))
    body = functools.partial(ring_attention, axis_name=CP_AXIS, degree=degree, tile=tile)
    ring = jax.shard_map(lambda q, k, v, i: body(q, k, v, i, i), mesh=mesh, in_specs=P(CP_AXIS),
                         out_specs=P(CP_AXIS), check_vma=False)
    with counting() as counts:          # traced inside: the branches that compute a pair tick
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v, ids)), argnums=(0, 1, 2)))
        jax.block_until_ready(grad(q, k, v))
    return {"forward": counts["tile_pairs_fwd"], "backward": counts["tile_pairs_bwd"]}


def tiles(tokens: int = 16384, degree: int = 8, tile=None) -> dict[str, Any]:
    tile = DEFAULT_TILE if tile is None else tile
    perm = zigzag_permutation(tokens, degree)
    seg, pos, span = np.ones(tokens, np.int32), np.arange(tokens, dtype=np.int32)[perm], np.zeros(tokens, np.int32)
    computed, total = count_ring_tiles(seg, pos, span, degree, tile)
    executed = executed_tiles(seg, pos, span, degree, tile)
    return {"tokens": tokens, "degree": degree, "tile": tile, "computed_pairs": computed, "dense_pairs": total,
            "computed_over_dense": round(computed / total, 4), "executed_pairs_forward": executed["forward"],
            "executed_pairs_backward": executed["backward"]}


def step_times(batches: int, repeats: int, tile=None, full_opt: bool = False) -> dict[str, Any]:
    import jax

    from dhp_jax.model import MLLMConfig, init_params

    cfg = load_config(DEMO_CONFIG)
    config = MLLMConfig.preset(cfg.model.preset)
    n = min(cfg.num_ranks, len(jax.devices()))
    p = cfg.planner
    cost = make_cost(p.cost_profile, p.cost_model, p.hardware, p.ranks_per_node or n, num_ranks=n,
                     comm_overlap=p.comm_overlap)
    source = PlanSource(n, cost=cost, strategy=p.strategy, full_size=p.full_size)
    pipe = DataPipeline(cfg.data, config.vocab_size, config.patch_dim)
    work = [(b.samples, source(b.step, b)) for b in pipe.batches(range(batches))]
    opts = {} if full_opt else None
    tile = cfg.attention_tile if tile is None else tile      # what the demo runs, unless told
    rings = {"tiled": _executor(config, tile, compiler_options=opts),
             "scan_baseline": _executor(config, attention=baseline_attention, compiler_options=opts)}
    params = {k: ex.replicate(init_params(config, jax.random.key(0))) for k, ex in rings.items()}
    compile_s = {}
    for k, ex in rings.items():
        t0 = time.perf_counter()
        for samples, plan in work:
            jax.block_until_ready(ex.loss_and_grads(params[k], samples, plan))
        compile_s[k] = time.perf_counter() - t0
    # wall and CPU seconds (all threads of this process: the work of every fake device, which
    # other jobs' load disturbs less than wall time) per (ring, batch)
    wall: dict[str, list[list[float]]] = {k: [[] for _ in work] for k in rings}
    cpu: dict[str, list[list[float]]] = {k: [[] for _ in work] for k in rings}
    for r in range(repeats):
        for b, (samples, plan) in enumerate(work):
            # interleaved, in alternating order: both rings see the same machine load
            for k, ex in (list(rings.items()) if r % 2 == 0 else list(rings.items())[::-1]):
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(ex.loss_and_grads(params[k], samples, plan))
                wall[k][b].append(time.perf_counter() - t0)
                cpu[k][b].append(time.process_time() - c0)

    def summary(t: dict[str, list[list[float]]]) -> dict[str, Any]:
        # per batch, the median over repeats; a ring's step time is the sum over the batches
        per = {k: [statistics.median(v) for v in t[k]] for k in rings}
        step = {k: sum(v) / len(v) * 1e3 for k, v in per.items()}
        return {"mean_step_ms": {k: round(v, 2) for k, v in step.items()},
                "tiled_over_baseline": round(step["tiled"] / step["scan_baseline"], 3),
                "per_batch_ratio": [round(a / b, 3) for a, b in zip(per["tiled"], per["scan_baseline"])]}

    return {"batches": batches, "repeats": repeats, "tile": rings["tiled"].attention_tile,
            "compiler_options": rings["tiled"].compiler_options,
            "tokens_per_batch": [sum(s.num_tokens for s in w[0]) for w in work],
            "wall": summary(wall), "cpu": summary(cpu),
            "first_steps_with_compile_s": {k: round(v, 1) for k, v in compile_s.items()}}


def _machine() -> dict[str, Any]:
    import jax

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "devices": len(jax.devices()),
            "device_kind": jax.devices()[0].device_kind,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def device_check(tile=None) -> dict[str, Any] | None:
    """Degree-1 internvl3-2b (2 decoder + 2 vision layers) at 8k and 32k tokens: tiled vs fused."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    from dhp_jax.data import random_samples
    from dhp_jax.geometry.layout import pack_group
    from dhp_jax.model import MLLMConfig, init_params
    from dhp_jax.sharding.executor import pack_inputs
    from dhp_jax.sharding.ring import ring_attention_fn

    config = MLLMConfig.preset("internvl3-2b", num_layers=2, vision_layers=2)
    params = init_params(config, jax.random.key(0))
    out: dict[str, Any] = {"model": "internvl3-2b, 2 decoder + 2 vision layers", "machine": _machine(), "runs": []}
    paths = {"tiled": None, "fused": lambda ax, d: ring_attention_fn(ax, d, fused=True)}
    for tokens in (8192, 32768):
        samples = random_samples(config, [tokens], seed=0, kinds=("image",))
        lay = pack_group(samples, 1, config, bucket=tokens)
        for name, attention in paths.items():
            row: dict[str, Any] = {"tokens": tokens, "path": name}
            try:
                ex = _executor(config, tile, attention)
                devs = (jax.devices()[0],)
                t0 = time.perf_counter()
                exe = ex.executable(params, 1, tokens, devs)
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                mem = exe.memory_analysis()
                row["temp_gib"] = round(mem.temp_size_in_bytes / 2 ** 30, 3)
                flat = ex.flat_params(params)
                view = ex._views(flat, [(devs, "ring")])[(devs, "ring")]
                ints, floats = (jax.device_put(a, devs[0]) for a in pack_inputs(lay))
                jax.block_until_ready(exe(view, ints, floats))
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(exe(view, ints, floats))
                    ts.append(time.perf_counter() - t0)
                row["median_step_ms"] = round(statistics.median(ts) * 1e3, 2)
            except Exception as e:          # a missing cuDNN kernel is a result, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            out["runs"].append(row)
    return out


def run(args: argparse.Namespace) -> int:
    if not args.device_check:
        force_cpu_devices(8)
    if args.device_check:
        res = device_check(args.tile)
        if res is None:
            print("dhp bench attention --device-check: no GPU here (CPU only); nothing to check")
            return 0
        print(json.dumps(res, indent=2) if args.json else
              "\n".join(f"{r['tokens']:>6} tokens {r['path']:>5}: " +
                        (r["error"] if "error" in r else f"{r['median_step_ms']} ms/step, temp {r['temp_gib']} GiB")
                        for r in res["runs"]))
        return 0
    res: dict[str, Any] = {"label": "measured on fake CPU devices sharing the host cores (tiny model)",
                           "machine": _machine(), "memory": memory(args.tile), "tiles": tiles(tile=args.tile)}
    if not args.skip_steps:
        res["step_time"] = step_times(args.batches, args.repeats, args.tile, args.full_opt)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    m, t = res["memory"], res["tiles"]
    print(f"Ring attention, {res['label']}")
    print("  temp memory per device (MiB): " + ", ".join(f"{k} {v}" for k, v in m["temp_mib_per_device"].items()))
    print(f"  same local length S/d=1024, d=8 over d=1: {m['same_local_d8_over_d1']}x; "
          f"d=4, 4x tokens: {m['d4_growth_for_4x_tokens']}x")
    print(f"  one causal sample of {t['tokens']} tokens, zigzag ring d={t['degree']}, tile {t['tile']}: "
          f"{t['computed_pairs']}/{t['dense_pairs']} tile pairs allowed by the skip rule ({t['computed_over_dense']} "
          f"of dense, NumPy); executed by the kernel: {t['executed_pairs_forward']} forward, "
          f"{t['executed_pairs_backward']} backward")
    if "step_time" in res:
        s = res["step_time"]
        for kind in ("wall", "cpu"):
            k = s[kind]
            print(f"  demo batches {s['tokens_per_batch']} tokens, {kind} time: {k['mean_step_ms']['tiled']} ms/step "
                  f"tiled (tile {s['tile']}) vs {k['mean_step_ms']['scan_baseline']} ms earlier scan ring (ratio "
                  f"{k['tiled_over_baseline']}; per batch {k['per_batch_ratio']})")
    return 0
