"""`dhp bench memory --step`: a whole training step's peak bytes per device, compiled vs modelled.

A step runs, on every device, the all-gather of the params, then per micro-batch the device's
group program and the reduction of its gradient row into the sharded fp32 accumulator, then the
optimizer update (`dhp_jax.sharding.PlanExecutor.loss_and_grad_shards`, `train.state.make_update`).
Each of these programs is lowered with abstract arguments (`jax.ShapeDtypeStruct`; nothing is
allocated), compiled, and its `memory_analysis()` read; the per-device bytes are then laid end to
end in the order the device runs them, with what it holds across them (the state shards, the
gathered params while a later micro-batch needs them), exactly as `planner.cost.memory.step_phases`
does with the model's figures. The peak over that sequence, besides the state, is the row's
`compiled_step_bytes`; `memory.device_step_bytes` of the same plan is `model_step_bytes`.

The plans: `micro_batches` micro-batches, in each of which the device runs a group of `degree`
ranks holding `tokens` tokens. The state is sharded over `state_shards` ranks, so the bench runs on
that many fake CPU devices (the group program uses `degree` of them). The group program's bytes
come from `dhp_jax.sharding.memory_bench.program_bytes` (full depth, or extrapolated from 2- and
3-layer compiles with `--extrapolate`); the other programs do not depend on the depth and are
compiled at the model's full parameter count.

jax (and what imports it) is imported inside the functions: `run` asks for the fake CPU devices
first, which XLA reads when jax is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any, Sequence

import numpy as np

from dhp_jax.model import MLLMConfig
from dhp_jax.planner import CostModel
from dhp_jax.planner.cost.memory import device_step_bytes, rank_state_bytes
from dhp_jax.devices import force_cpu_devices
from dhp_jax.sharding import memory_bench
from dhp_jax.sharding.memory_bench import CPU_ACTIVATION_BYTES, CPU_MEMORY_OPTIONS, SMOKE_MODELS, model_shape, program_bytes
from dhp_jax.train.train_config import OptimConfig

MICRO_BATCHES = (2, 3)
STEP_ROWS = (("internvl3-8b", 8, 65536), ("internvl3-2b", 8, 65536), ("internvl3-2b", 2, 32768))


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Per-device bytes of one compiled program (XLA `memory_analysis()`)."""

    arguments: int
    outputs: int
    temp: int
    aliased: int

    @classmethod
    def of(cls, lowered: Any, options: dict) -> "Compiled":
        m = lowered.compile(compiler_options=options).memory_analysis()
        return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                   int(m.alias_size_in_bytes))

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temp - self.aliased


def step_programs(config: Any, compute_dtype: str, devices: Sequence[Any], options: dict) -> dict[str, Compiled]:
    """The compiled bytes of the step's programs other than the group program, on `devices` (the
    state's shards): gather, accumulate (one micro-batch's reduction), finish, update."""
    import jax

    from dhp_jax.model import init_params
    from dhp_jax.sharding import PlanExecutor
    from dhp_jax.sharding.executor import row_dtype
    from dhp_jax.train.state import make_init, make_optimizer, make_update

    ex = PlanExecutor(config, devices, compute_dtype=compute_dtype)
    n, padded = len(devices), ex.layout.padded
    shard = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=ex.sharded)  # noqa: E731
    master, stats = shard((padded,), np.float32), shard((n, 2), np.float32)
    rows = shard((n, padded), row_dtype(ex.compute_dtype))
    optimizer = make_optimizer(OptimConfig(), 1000)
    init = make_init(lambda k: ex.layout.ravel(init_params(config, k)), optimizer, ex.state_sharding)
    abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
    update = make_update(optimizer, ex.state_sharding, abstract)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ex.state_sharding(x)), abstract)
    return {"gather": Compiled.of(ex.state.program("gather").lower(master), options),
            "accumulate": Compiled.of(ex.state.program("accumulate").lower(master, stats, rows, stats), options),
            "finish": Compiled.of(ex.state.program("finish").lower(master, stats), options),
            "update": Compiled.of(update.lower(state, master), options)}


def compiled_phases(group: int, programs: dict[str, Compiled], micro_batches: int) -> list[tuple[str, int]]:
    """(phase, bytes besides the state) of a device's step from the compiled programs, in the order
    the device runs them (`planner.cost.memory.step_phases` with measured bytes). The state is what the
    update takes (master params, moments, gradient accumulator): arguments the other programs find
    already there are not counted again."""
    g, a, f, u = (programs[k] for k in ("gather", "accumulate", "finish", "update"))
    acc = a.aliased                                  # the accumulator shards (and stats) updated in place
    out = [("gather", g.outputs + g.temp)]           # its argument, the master shard, is state
    for m in range(micro_batches):
        out.append((f"micro-batch {m} group program", group))       # its params argument is the gather's output
        held = g.outputs if m + 1 < micro_batches else 0            # params, while a later micro-batch needs them
        out.append((f"micro-batch {m} reduction", held + a.total - acc))
    out.append(("finish", f.outputs + f.temp))                       # the mean gradient next to the accumulator
    out.append(("update", u.total - u.arguments))                    # in place: its arguments are the state
    return out


def measure_step(models_rows: Sequence[tuple[str, int, int]], micro_batches: Sequence[int] = MICRO_BATCHES, *,
                 hardware: str = "ascend-910b", remat: str = "layer", compute_dtype: str = "bfloat16",
                 full_depth: bool = True) -> dict:
    """`dhp bench memory --step`: a row per (model, degree, tokens) and micro-batch count."""
    import jax

    devices = jax.devices()
    shards = len(devices)
    cpu = devices[0].platform == "cpu"
    options = {"xla_backend_optimization_level": 0, **CPU_MEMORY_OPTIONS} if cpu else {}
    rows, cache = [], {}
    for model, degree, tokens in models_rows:
        t0 = time.perf_counter()
        config = MLLMConfig.preset(model, remat=remat)
        if model not in cache:
            cache[model] = step_programs(config, compute_dtype, devices, options)
        group, extrapolated = program_bytes(config, degree, tokens, compute_dtype=compute_dtype, devices=devices,
                                            full_depth=full_depth)
        # the engine runs the stand-in at the preset's shape: price that, not the real family
        cost = CostModel.preset(model_shape(config), hardware, state_shards=shards, remat=remat,
                                compute_dtype=compute_dtype, activation_bytes=CPU_ACTIVATION_BYTES if cpu else None,
                                require_fit=False)
        for mbs in micro_batches:
            phases = compiled_phases(group, cache[model], mbs)
            got = max(b for _, b in phases)
            want = device_step_bytes(cost, [([tokens], degree)] * mbs)
            state = cache[model]["update"].arguments
            rows.append({"model": model, "degree": degree, "tokens": tokens, "micro_batches": mbs,
                         "compiled_step_bytes": int(got), "model_step_bytes": int(want),
                         "state_bytes": int(state), "usable_bytes": int(cost.usable_bytes),
                         "fits": bool(got + state <= cost.usable_bytes),
                         "rel_error": round(want / got - 1.0, 4), "extrapolated": extrapolated,
                         "peak_phase": max(phases, key=lambda p: p[1])[0],
                         "compiled_phases": {k: int(b) for k, b in phases},
                         "model_state_bytes": int(rank_state_bytes(cost)),
                         "compile_s": round(time.perf_counter() - t0, 1)})
    return {"label": f"whole-step peak per device: XLA memory_analysis of every program of the step compiled for "
                     f"{devices[0].platform} devices (abstract arguments), laid out in dispatch order, vs "
                     f"memory.device_step_bytes ({hardware} preset); state sharded over {shards} devices",
            "hardware": hardware, "remat": remat, "compute_dtype": compute_dtype, "state_shards": shards,
            "rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    """`dhp bench memory`'s options (`dhp_jax.sharding.memory_bench`) and `--step`."""
    memory_bench.configure(parser)
    parser.add_argument("--step", action="store_true",
                        help="the whole step's peak per device (every program it runs, in dispatch order) for plans "
                             "with --micro-batches micro-batches, on --state-shards fake CPU devices")
    parser.add_argument("--micro-batches", default=",".join(map(str, MICRO_BATCHES)),
                        help="comma-separated micro-batch counts (--step)")
    parser.add_argument("--rows", default=";".join(f"{m},{d},{t}" for m, d, t in STEP_ROWS),
                        help="--step: semicolon-separated MODEL,DEGREE,TOKENS (default: %(default)s)")


def _step_rows(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in (x for x in text.split(";") if x.strip()):
        parts = [p.strip() for p in item.split(",")]
        models = (*CostModel.MODELS, *SMOKE_MODELS)
        if len(parts) != 3 or parts[0] not in models or not (parts[1].isdigit() and parts[2].isdigit()):
            raise SystemExit(f"--rows: {item!r} is not MODEL,DEGREE,TOKENS with MODEL one of {models}")
        out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def run(args: argparse.Namespace) -> int:
    if not args.step or args.tensor_parallel != 1:    # memory_bench refuses --step with --tensor-parallel
        return memory_bench.run(args)
    rows = _step_rows(args.rows)
    force_cpu_devices(args.state_shards)
    import jax

    if max(d for _, d, _ in rows) > len(jax.devices()):
        raise SystemExit(f"degree {max(d for _, d, _ in rows)} needs that many devices, found {len(jax.devices())}")
    res = measure_step(rows, [int(x) for x in str(args.micro_batches).split(",") if x.strip()],
                       hardware=args.hardware, remat=args.remat or "layer", compute_dtype=args.dtype or "bfloat16",
                       full_depth=not args.extrapolate)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(res["label"])
    print(f"{'model':14s} {'degree':>6s} {'tokens':>7s} {'mbs':>4s} {'compiled GB':>12s} {'model GB':>9s} "
          f"{'error':>7s} {'+ state GB':>11s} {'usable GB':>10s}  peak")
    for r in res["rows"]:
        print(f"{r['model']:14s} {r['degree']:6d} {r['tokens']:7d} {r['micro_batches']:4d} "
              f"{r['compiled_step_bytes'] / 1e9:12.2f} {r['model_step_bytes'] / 1e9:9.2f} {r['rel_error']:+7.1%} "
              f"{(r['compiled_step_bytes'] + r['state_bytes']) / 1e9:11.2f} {r['usable_bytes'] / 1e9:10.2f}  "
              f"{r['peak_phase']}{' (extrapolated)' if r['extrapolated'] else ''}")
    return 0
