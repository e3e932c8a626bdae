"""`dhp bench memory`: XLA's compiled bytes of the group program next to the planner's memory model.

For each model preset, degree and tokens per group, the group program is lowered with abstract
arguments (`jax.ShapeDtypeStruct`; nothing is allocated) and compiled for `degree` local devices;
`memory_analysis()` gives arguments + outputs + temp - aliases per device. Next to it,
`memory.group_program_bytes` (static + activation bytes) of the same preset and engine choices.
The block stacks are scans (`dhp_jax.model.mllm.block_stack`), so a full-depth compile costs about
what a shallow one does (internvl3-2b: about 20 s on CPU) and the bench compiles the real depth.
`--extrapolate` compiles (2 decoder, 2 vision) layers, (3, 2) and (2, 3) instead and extrapolates
linearly (rows say `"extrapolated": true`). On CPU devices the bench compiles
with XLA:CPU's memory-minimising scheduler and default fusion emitters (`CPU_MEMORY_OPTIONS`). `"fits"` answers the sizing
question: internvl3-8b, degree 8, 64k tokens on ascend-910b with the state sharded over 64 ranks:
compiled bytes + the state shard against the device's usable bytes; with `--tensor-parallel T`,
qwen2.5-vl-32b (the stand-in at its shape) at 64k tokens on 64 devices as ranks of T devices, at
the degree DHP's plan gives it (`planned_degree`; the compile needs degree x T devices). A whole step (every program
it runs, in dispatch order) is `dhp bench memory --step` (`dhp_jax.bench.step_memory`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Sequence

from dhp_jax.devices import force_cpu_devices
from dhp_jax.planner import CostModel
from dhp_jax.planner.cost.memory import REMATS, group_program_bytes, rank_state_bytes
from dhp_jax.planner.cost.presets import ModelShape

DEGREES = (1, 2, 4, 8)
TOKENS = (8192, 32768, 65536)
FITS = {"model": "internvl3-8b", "hardware": "ascend-910b", "degree": 8, "tokens": 65536, "state_shards": 64}
# with --tensor-parallel T: a 32B-class model at 64k tokens on 64 devices as ranks of T, at the
# degree DHP's plan gives it (`planned_degree`); the state over the 64 devices
FITS_TP = {"model": "qwen2.5-vl-32b", "hardware": "ascend-910b", "tokens": 65536, "state_shards": 64}


def planned_degree(f: dict, t: int, remat: str, compute_dtype: str, devices: int, sequence_parallel: bool = False
                   ) -> int:
    """The degree of the group DHP's plan gives one sample of `f["tokens"]` (90 % vision tokens,
    as experiment 13's long sample) on `devices` devices as ranks of t, 8 devices a node, priced
    with the memory model on `f["hardware"]` (the accelerator's bf16 activations): the planner's
    choice. SystemExit when no plan fits."""
    import numpy as np

    from dhp_jax.model import MLLMConfig
    from dhp_jax.planner.compare import compare_strategies
    from dhp_jax.planner.contract.plan import PlanningError

    try:
        cost = CostModel.preset(model_shape(MLLMConfig.preset(f["model"])), f["hardware"],
                                state_shards=f["state_shards"], remat=remat, compute_dtype=compute_dtype,
                                tensor_parallel=t, ranks_per_node=8 // t, sequence_parallel=sequence_parallel)
        comp = compare_strategies([(np.array([f["tokens"]]), np.array([0.81]))], devices // t, cost, ["dhp"],
                                  errors="raise", ranks_per_node=8 // t)
    except (PlanningError, ValueError) as e:
        raise SystemExit(f"{f['model']} at {f['tokens']} tokens on {devices} devices as ranks of {t}: {e}") from None
    plan = comp.runs["dhp"].plans[0]
    return next(g.degree for mb in plan.micro_batches for g in mb.groups if g.samples)

# XLA:CPU's default scheduler orders the program for concurrency, not memory: it holds up to twice
# the bytes its memory-minimising scheduler does (internvl3-2b, 1 layer, 4k tokens: 6.67 vs 5.59 GB).
# Accelerator compilers schedule under a memory limit, so the bench measures the CPU program
# under the memory-minimising scheduler.
# XLA:CPU's memory-minimising scheduler, and its default (MLIR) fusion emitters: the executor's
# CPU runs compile with the older ones (`executor.CPU_FAST_COMPILE`, faster to compile), whose
# programs lay out some buffers differently (a step's gather program: 12.6 MB with the older
# emitters against the 22.5 MB modelled); the memory model is validated on these.
CPU_MEMORY_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED", "xla_cpu_use_fusion_emitters": True}
# XLA:CPU has no bf16 arithmetic: a bf16 program compiled for CPU devices computes in fp32, so the
# bench's CostModel holds the block working set and the other activations in 4 bytes
# (`CostModel.activation_bytes`) when the devices are CPUs. The block scans' loop state (saved
# residuals, stacked gradients, params rows) is stored bit-cast to uint16 and stays 2 bytes, and
# what the program casts to fp32 itself (a family block's ring attention residuals and rotary
# tables, `memory._family_block_wide`) is 4 bytes on every platform.
CPU_ACTIVATION_BYTES = 4
BASE_DEPTH = 2      # extrapolation base: (2, 2) layers, steps to (3, 2) and (2, 3)


def model_shape(config: Any) -> Any:
    """The planner's `presets.ModelShape` of an `MLLMConfig` (for `CostModel.preset` of any model)."""
    c = config
    return ModelShape(c.num_layers, c.num_heads, c.num_kv_heads, c.d_model, c.d_ff, c.head_dim, c.vocab_size,
                      c.vision_layers, c.vision_dim, c.vision_ff, vision_heads=c.vision_heads,
                      vision_head_dim=c.vision_head_dim, patch_dim=c.patch_dim)


def compiled_bytes(config: Any, degree: int, tokens: int, compute_dtype: str, devices: Sequence[Any],
                   tensor_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """Per-device bytes of the compiled group program (arguments + outputs + temp - aliases); with
    `tensor_parallel` t, a group of `degree` ranks of t devices each."""
    from dhp_jax.sharding.executor import PlanExecutor

    ex = PlanExecutor(config, devices, compute_dtype=compute_dtype, tensor_parallel=tensor_parallel,
                      sequence_parallel=sequence_parallel)
    stream = -(-tokens // (2 * degree)) * 2 * degree        # the tokens, divisible by 2 x degree
    options = dict(ex.compiler_options)
    if all(d.platform == "cpu" for d in devices[:degree]):
        options.update(CPU_MEMORY_OPTIONS)
    group = tuple(devices[:degree * tensor_parallel])
    m = ex.lower(degree, stream, group).compile(compiler_options=options).memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def program_bytes(full: Any, degree: int, tokens: int, *, compute_dtype: str, devices: Sequence[Any],
                  full_depth: bool = False, tensor_parallel: int = 1, sequence_parallel: bool = False
                  ) -> tuple[int, bool]:
    """(compiled bytes of model config `full`, whether they were extrapolated from shallow
    compiles: with B = `BASE_DEPTH`, b(L, V) = b(B, B) + (L - B) [b(B+1, B) - b(B, B)]
    + (V - B) [b(B, B+1) - b(B, B)]. The base is 2 layers, not 1: the peak of a 1-layer program
    is the loss (vocabulary-sized buffers), from 2 layers on it is a block's backward, and only
    from there do the bytes grow linearly with depth)."""
    b = BASE_DEPTH
    if full_depth or full.num_layers <= b or full.vision_layers <= b:
        return compiled_bytes(full, degree, tokens, compute_dtype, devices, tensor_parallel, sequence_parallel), False

    def at(layers: int, vision: int) -> int:
        cfg = dataclasses.replace(full, num_layers=layers, vision_layers=vision)
        return compiled_bytes(cfg, degree, tokens, compute_dtype, devices, tensor_parallel, sequence_parallel)

    base, deeper, wider = at(b, b), at(b + 1, b), at(b, b + 1)
    est = base + (full.num_layers - b) * (deeper - base) + (full.vision_layers - b) * (wider - base)
    return int(est), True


def measure(models: Sequence[str], degrees: Sequence[int], tokens: Sequence[int], *, hardware: str = "ascend-910b",
            remat: str = "layer", compute_dtype: str = "bfloat16", state_shards: int = 64,
            full_depth: bool = True, fits: bool = True, tensor_parallel: int = 1,
            sequence_parallel: bool = False) -> dict:
    import jax

    from dhp_jax.model import MLLMConfig

    devices = jax.devices()
    t = tensor_parallel
    if max(degrees) * t > len(devices):
        raise SystemExit(f"degree {max(degrees)}{f' x tensor_parallel {t}' if t > 1 else ''} needs "
                         f"{max(degrees) * t} devices, found {len(devices)}")
    rows = []
    cpu = devices[0].platform == "cpu"
    ab = CPU_ACTIVATION_BYTES if cpu else None
    for model in models:
        # the engine runs the stand-in at the preset's shape: price that, not the real family
        cost = CostModel.preset(model_shape(MLLMConfig.preset(model)), hardware, state_shards=state_shards,
                                remat=remat, compute_dtype=compute_dtype, activation_bytes=ab, require_fit=False,
                                **({"tensor_parallel": t, "sequence_parallel": sequence_parallel} if t > 1 else {}))
        for d in degrees:
            for s in tokens:
                t0 = time.perf_counter()
                got, extra = program_bytes(MLLMConfig.preset(model, remat=remat), d, s, compute_dtype=compute_dtype,
                                           devices=devices, full_depth=full_depth, tensor_parallel=t,
                                           sequence_parallel=sequence_parallel)
                want = group_program_bytes(cost, [s], d)
                rows.append({"model": model, "degree": d, "tokens": s, "compiled_bytes": got,
                             "model_bytes": int(want), "rel_error": round(want / got - 1.0, 4),
                             "extrapolated": extra, "compile_s": round(time.perf_counter() - t0, 1)})
    out: dict[str, Any] = {
        "label": f"XLA memory_analysis of the group program compiled for {devices[0].platform} devices "
                 f"(abstract arguments{f', ranks of {t} devices' if t > 1 else ''}) vs memory.group_program_bytes "
                 f"({hardware} preset{f', tensor_parallel {t}' if t > 1 else ''})",
        "hardware": hardware, "remat": remat, "compute_dtype": compute_dtype, "tensor_parallel": t,
        "sequence_parallel": bool(sequence_parallel), "rows": rows}
    if fits:
        f = FITS if t == 1 else {**FITS_TP, "tensor_parallel": t}
        if t > 1:       # the degree the planner's memory model gives a 64k sample on ranks of t devices
            f["degree"] = planned_degree(f, t, remat, compute_dtype, f["state_shards"], sequence_parallel)
        row = next((r for r in rows if r["model"] == f["model"] and r["degree"] == f["degree"]
                    and r["tokens"] == f["tokens"]), None)
        got = row["compiled_bytes"] if row else program_bytes(
            MLLMConfig.preset(f["model"], remat=remat), f["degree"], f["tokens"], compute_dtype=compute_dtype,
            devices=devices, full_depth=full_depth, tensor_parallel=t, sequence_parallel=sequence_parallel)[0]
        shape = model_shape(MLLMConfig.preset(f["model"]))
        extra = {"tensor_parallel": t, "sequence_parallel": sequence_parallel} if t > 1 else {}
        cost = CostModel.preset(shape, f["hardware"], state_shards=f["state_shards"], remat=remat,
                                compute_dtype=compute_dtype, activation_bytes=ab, require_fit=False, **extra)
        total = got + rank_state_bytes(cost)
        # the same program priced at the preset's own widths (bf16 activations, as an accelerator
        # compiler keeps them), next to what the CPU compile holds
        native = CostModel.preset(shape, f["hardware"], state_shards=f["state_shards"], remat=remat,
                                  compute_dtype=compute_dtype, require_fit=False, **extra)
        native_total = group_program_bytes(native, [f["tokens"]], f["degree"]) + rank_state_bytes(native)
        out["fits"] = {**f, "compiled_bytes": int(got), "state_bytes": int(rank_state_bytes(cost)),
                       "total_bytes": int(total), "usable_bytes": int(cost.usable_bytes),
                       "fits": bool(total <= cost.usable_bytes),
                       "model_total_bytes_native": int(native_total),
                       "fits_native_model": bool(native_total <= native.usable_bytes)}
    return out


# the stand-in's own test shape (`MLLMConfig.preset("tiny")`): accepted by `--model` and the step
# bench's `--rows` so that a smoke run of a bench compiles in seconds; never in the default list
SMOKE_MODELS = ("tiny",)


def dense_models() -> list[str]:
    """The model presets the stand-in engine builds (`MLLMConfig.preset`): every stored model but
    the mixtures of experts, whose own program `--families` compiles."""
    from dhp_jax.model.mllm_config import MOE_PRESETS

    return [m for m in CostModel.MODELS if m not in MOE_PRESETS]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", choices=(*CostModel.MODELS, *SMOKE_MODELS),
                        help="model preset (repeatable; default: every dense one, "
                             f"{', '.join(dense_models())}; a mixture of experts runs with --families; "
                             "\"tiny\": the stand-in's test shape, a quick check of the bench itself)")
    parser.add_argument("--degrees", default=",".join(map(str, DEGREES)), help="comma-separated degrees")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated tokens per group")
    parser.add_argument("--hardware", default="ascend-910b", choices=CostModel.HARDWARE)
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="ranks of T devices (the model split Megatron-style, PlanExecutor("
                             "tensor_parallel=T); with --families the family's own program), priced with "
                             "CostModel.preset(..., tensor_parallel=T); a group of degree d uses d x T devices "
                             "(not with --step)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tensor-parallel T > 1: the block stacks (a family's LLM layers and encoder blocks) sequence-"
                             "parallel (PlanExecutor(sequence_parallel=True)), priced with CostModel.preset(..., "
                             "sequence_parallel=True)")
    parser.add_argument("--remat", default=None,
                        help="recompute policy: none, layer or selective (default: layer); with --families a "
                             "comma-separated list of them (default: none)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                        help="compute dtype (default: bfloat16; with --families float32)")
    parser.add_argument("--state-shards", type=int, default=64, help="ranks the fp32 state is sharded over")
    parser.add_argument("--extrapolate", action="store_true",
                        help="compile 2 and 3 layers and extrapolate linearly instead of compiling every layer")
    parser.add_argument("--no-fits", action="store_true", help="skip the sizing check (internvl3-8b; qwen2.5-vl-32b with --tensor-parallel)")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices if jax is not yet imported")
    parser.add_argument("--json", action="store_true", help="print only JSON")
    parser.add_argument("--families", default="",
                        help="comma-separated family models (stored names, or model files such as "
                             "experiments/configs/models/qwen2.5-vl-7b): compile the Hugging Face family's own "
                             "group program (dhp_jax.sharding.family_memory) instead of the stand-in's")
    parser.add_argument("--layer-checks", default="",
                        help="--families: semicolon-separated DEGREE,TOKENS points where one more LLM layer and one "
                             "more encoder block are compiled too (the per-layer bytes)")
    parser.add_argument("--device-check", action="store_true",
                        help="on a GPU: the bf16 family rows (--families, default " + ",".join(DEVICE_CHECK_FAMILIES) +
                             ") at degree 1, remat none and layer, compiled for this machine's first GPU and "
                             "compared with the model's accelerator figure (model / compiled); without a GPU "
                             "it prints one line and checks nothing")
    parser.add_argument("--rows-file", default=None,
                        help="--families: append each row to this JSON-lines file as soon as it is measured")


DEVICE_CHECK_FAMILIES = ("qwen3-vl-2b", "internvl3-2b", "experiments/configs/models/qwen2.5-vl-7b")
DEVICE_CHECK_TOKENS = "4096"


def gpu_present() -> bool:
    """Whether jax sees a GPU (imports jax with the machine's own devices)."""
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def run(args: argparse.Namespace) -> int:
    if getattr(args, "device_check", False):    # the machine's own devices: no fake CPU devices forced
        if not gpu_present():
            print("dhp bench memory --device-check: no GPU here (CPU only); nothing to check")
            return 0
        args.families = args.families or ",".join(DEVICE_CHECK_FAMILIES)
        args.dtype, args.remat = args.dtype or "bfloat16", args.remat or "none,layer"
        args.degrees = "1"
        args.tokens = args.tokens if args.tokens != ",".join(map(str, TOKENS)) else DEVICE_CHECK_TOKENS
        if args.tensor_parallel != 1:
            raise SystemExit("--device-check: one device, no --tensor-parallel")
        return run_families(args, lambda text: [int(x) for x in str(text).split(",") if x.strip()])
    force_cpu_devices(args.devices)
    ints = lambda text: [int(x) for x in str(text).split(",") if x.strip()]  # noqa: E731
    if args.tensor_parallel != 1 and getattr(args, "step", False):
        raise SystemExit(f"--tensor-parallel {args.tensor_parallel}: not with --step")
    if args.sequence_parallel and args.tensor_parallel == 1:
        raise SystemExit("--sequence-parallel needs --tensor-parallel T > 1")
    if args.families:
        return run_families(args, ints)
    remat = args.remat or "layer"
    if remat not in REMATS:
        raise SystemExit(f"--remat: {remat!r} is not one of {REMATS}")
    moe = sorted(set(args.model or ()) - set(dense_models()) - set(SMOKE_MODELS))
    if moe:
        raise SystemExit(f"--model {moe[0]}: a mixture of experts, which the stand-in engine cannot build; "
                         f"compile its family program with --families {moe[0]}")
    res = measure(args.model or dense_models(), ints(args.degrees), ints(args.tokens),
                  hardware=args.hardware, remat=remat, compute_dtype=args.dtype or "bfloat16",
                  state_shards=args.state_shards, full_depth=not args.extrapolate, fits=not args.no_fits,
                  tensor_parallel=args.tensor_parallel, sequence_parallel=args.sequence_parallel)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(res["label"])
    if any(r["extrapolated"] for r in res["rows"]):
        print(f"compiled at {BASE_DEPTH} and {BASE_DEPTH + 1} layers (decoder and vision) and extrapolated linearly "
              "to full depth")
    print(f"{'model':16s} {'degree':>6s} {'tokens':>7s} {'compiled GB':>12s} {'model GB':>9s} {'error':>7s}")
    for r in res["rows"]:
        print(f"{r['model']:16s} {r['degree']:6d} {r['tokens']:7d} {r['compiled_bytes'] / 1e9:12.2f} "
              f"{r['model_bytes'] / 1e9:9.2f} {r['rel_error']:+7.1%}")
    if "fits" in res:
        f = res["fits"]
        per_rank = f" (ranks of {f['tensor_parallel']} devices)" if f.get("tensor_parallel", 1) > 1 else ""
        print(f"{f['model']} degree {f['degree']}{per_rank}, {f['tokens']} tokens on {f['hardware']}, state over "
              f"{f['state_shards']} ranks: {f['compiled_bytes'] / 1e9:.2f} GB compiled + {f['state_bytes'] / 1e9:.2f} "
              f"GB state = {f['total_bytes'] / 1e9:.2f} GB of {f['usable_bytes'] / 1e9:.2f} GB usable: "
              f"{'fits' if f['fits'] else 'does NOT fit'}; CostModel at the preset's widths (bf16 "
              f"activations): {f['model_total_bytes_native'] / 1e9:.2f} GB "
              f"({'fits' if f['fits_native_model'] else 'does NOT fit'})")
    return 0


def run_families(args: argparse.Namespace, ints: Any) -> int:
    """`dhp bench memory --families`: the family group programs (`family_memory.measure_families`)."""

    from dhp_jax.sharding import family_memory

    checks = [tuple(ints(x)) for x in str(args.layer_checks).split(";") if x.strip()]
    if any(len(c) != 2 for c in checks):
        raise SystemExit(f"--layer-checks: {args.layer_checks!r} is not DEGREE,TOKENS[;DEGREE,TOKENS...]")
    remats = [r.strip() for r in str(args.remat or "none").split(",") if r.strip()]
    if not remats or any(r not in REMATS for r in remats):
        raise SystemExit(f"--remat: {args.remat!r} is not a comma-separated list of {REMATS}")
    res = family_memory.measure_families([m.strip() for m in args.families.split(",") if m.strip()],
                                         ints(args.degrees), ints(args.tokens), layer_checks=checks,
                                         hardware=args.hardware, log=lambda t: print(t, file=sys.stderr, flush=True),
                                         rows_file=args.rows_file, remats=remats,
                                         compute_dtype=args.dtype or "float32", tensor_parallel=args.tensor_parallel,
                                         sequence_parallel=args.sequence_parallel)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(res["label"])
    print(f"model figure compared: {res['figure']}")
    print(f"{'model':16s} {'remat':>6s} {'degree':>6s} {'tokens':>7s} {'compiled GB':>12s} {'model GB':>9s} "
          f"{'model/compiled':>15s}")
    for r in res["rows"]:
        print(f"{r['model']:16s} {r['remat']:>6s} {r['degree']:6d} {r['tokens']:7d} {r['compiled_bytes'] / 1e9:12.2f} "
              f"{r['model_bytes'] / 1e9:9.2f} {r['ratio']:15.3f}")
    for r in res["layer_rows"]:
        print(f"{r['model']:16s} {r['remat']:>6s} {r['degree']:6d} {r['tokens']:7d} one more {r['added']}: compiled "
              f"{r['compiled_bytes'] / 1e6:.0f} MB, model {r['model_bytes'] / 1e6:.0f} MB, ratio {r['ratio']:.3f}")
    return 0
