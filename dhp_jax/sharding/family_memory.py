"""`dhp bench memory --families`: XLA's compiled bytes of a family's group program vs the memory model.

The group program of `FamilyModel` (`dhp_jax.sharding.family_adapter`) for (model, degree, tokens) is
lowered with abstract arguments (the params tree's shapes from the model's config.json:
`dhp_jax.model.hf.abstract`; nothing is allocated) and compiled for `degree` CPU devices with
XLA:CPU's memory-minimising scheduler; `memory_analysis()` gives arguments + outputs + temp -
aliases per device. Next to it, `group_program_bytes` of the model's `ModelShape`
(`planner.cost.memory`, the family terms, `family_bytes_per_token`) at the program's choices: the
bench's are no pad skipping, fp32, and each remat of `remats` (default "none": the family
program keeps every intermediate; "layer": each block keeps its input, `layers.remat_block`);
`compiled` and `modelled` take `linear_chunk` too.

The packed vision stream gives every LLM slot `unit` encoder rows (`dhp_jax.model.hf.packed`), so
the program's shapes, and its bytes, do not depend on the group's vision share: the encoder runs
(on dead rows for text slots) as for an all-vision stream.

Depth: compiling a full-depth model at long lengths is slow on a small host, so the bench
compiles the model at
`BASE` (LLM layers, encoder blocks), at one LLM layer more and at one encoder block more, and
extrapolates linearly to full depth (`extrapolate`); the model's bytes are computed at the same
depths, and each row records the model / compiled ratio both at the compiled base depth and at
full depth (the per-layer bytes, compiled and modelled, are compared in `layer_rows`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Mapping, Sequence

from dhp_jax.data.model_configs import hf_layout, model_config, read_config
from dhp_jax.planner import CostModel
from dhp_jax.planner.cost.memory import REMATS, cpu_grouped_gemm_padding, group_program_bytes
from dhp_jax.planner.cost.presets import ModelShape

BASE = (3, 3)    # compiled (LLM layers, encoder blocks): the 3 DeepStack blocks of Qwen3-VL fit


def load_model_config(name: str) -> tuple[str, dict]:
    """(name, config.json dict, nested layout) of a stored model (`dhp_jax/data/models`), a model
    directory (config.json inside, as a checkpoint's or a stored model's) or a model file (a path to
    a JSON record with a "config" object, or to a bare config.json)."""
    if os.path.isdir(name):
        return os.path.basename(os.path.normpath(name)), hf_layout(read_config(name))
    if os.path.isfile(name):
        with open(name) as f:
            record = json.load(f)
        raw = record.get("config", record)
        return str(record.get("name") or os.path.splitext(os.path.basename(name))[0]), hf_layout(raw)
    return name, hf_layout(model_config(name))


def model_shape(raw: Mapping[str, Any], params: int) -> Any:
    """The planner's `ModelShape` of config.json dict `raw`, with `params` parameters."""
    return dataclasses.replace(ModelShape.from_config(raw), param_count=int(params))


def compiled(raw: Mapping[str, Any], degree: int, tokens: int, devices: Sequence[Any],
             compute_dtype: str = "float32", remat: str = "none", linear_chunk: int = 0,
             tensor_parallel: int = 1, sequence_parallel: bool = False) -> tuple[int, int]:
    """(per-device bytes of the compiled group program, its parameter count) of the family model of
    config.json dict `raw` for a group of `degree` ranks of `tensor_parallel` devices each and
    `tokens` LLM tokens (rounded up to a multiple of 2 x degree), its blocks run with `remat` and
    `linear_chunk` (`HFConfig`; `sequence_parallel`: the LLM layers and encoder blocks sequence-parallel
    at t > 1)."""
    m, params = memory_analysis(raw, degree, tokens, devices, compute_dtype, remat, linear_chunk, tensor_parallel,
                                sequence_parallel)
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes), params


def memory_analysis(raw: Mapping[str, Any], degree: int, tokens: int, devices: Sequence[Any],
                    compute_dtype: str = "float32", remat: str = "none", linear_chunk: int = 0,
                    tensor_parallel: int = 1, sequence_parallel: bool = False) -> tuple[Any, int]:
    """(XLA's `memory_analysis()` of the compiled group program, its parameter count) (`compiled`;
    with `tensor_parallel` t > 1 the program of one device of a rank of t, on degree x t devices)."""
    from dhp_jax.model.hf import moe
    from dhp_jax.model.hf.abstract import abstract_params
    from dhp_jax.model.hf.api import parse_config
    from dhp_jax.sharding.executor import PlanExecutor
    from dhp_jax.sharding.memory_bench import CPU_MEMORY_OPTIONS

    config = dataclasses.replace(parse_config(raw), remat=remat)
    group = tuple(devices[:degree * tensor_parallel])
    if len(group) < degree * tensor_parallel:
        raise ValueError(f"degree {degree} x tensor_parallel {tensor_parallel} needs {degree * tensor_parallel} "
                         f"devices, found {len(devices)}")
    ex = PlanExecutor(config, group, compute_dtype=compute_dtype, linear_chunk=linear_chunk,
                      tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel)
    ex.bind(abstract_params(config))
    stream = -(-tokens // (2 * degree)) * 2 * degree
    options = dict(ex.compiler_options)
    if all(d.platform == "cpu" for d in group):
        options.update(CPU_MEMORY_OPTIONS)
        # the grouped GEMM as an accelerator's holds it: the routed rows (`moe.grouped_gemm`)
        with moe.grouped_gemm("blocks"):
            lowered = ex.lower(degree, stream, group)
    else:
        lowered = ex.lower(degree, stream, group)
    program = lowered.compile(compiler_options=options)
    return program.memory_analysis(), ex.layout.size


def modelled(raw: Mapping[str, Any], params: int, degree: int, tokens: int, *, hardware: str = "ascend-910b",
             compute_dtype: str = "float32", state_shards: int = 64, remat: str = "none",
             linear_chunk: int = 0, tensor_parallel: int = 1, sequence_parallel: bool = False,
             activation_bytes: int | None = None, cpu_terms: bool = False) -> float:
    """`group_program_bytes` (the planner's memory model) of the family model of `raw` (with `params` parameters) for one
    group of `degree` ranks of `tensor_parallel` devices and `tokens` tokens, its blocks run with `remat` and
    `linear_chunk`: the preset's static bytes, and per token `family_bytes_per_token` of the family
    program at those choices (the preset's own `mem_per_token` for a family's shape; with t > 1, one
    device's, `planner.cost.tensor.local_shape`, and `sequence_parallel` as
    `CostModel.preset(..., sequence_parallel=...)`), activations in `activation_bytes` per element
    (default: the compute dtype's; a bf16 program compiled for CPU devices holds them in 4).
    `cpu_terms`: price the program as XLA:CPU compiles it, the accelerator's figure plus the named
    CPU terms (`memory.cpu_grouped_gemm_padding` per token, in the activation bytes); without,
    the accelerator's figure."""
    extra = {"sequence_parallel": sequence_parallel, "ranks_per_node": 8 // tensor_parallel} if tensor_parallel > 1 else {}
    cost = CostModel.preset(model_shape(raw, params), hardware, remat=remat, compute_dtype=compute_dtype,
                            state_shards=state_shards, require_fit=False, linear_chunk=linear_chunk,
                            tensor_parallel=tensor_parallel, activation_bytes=activation_bytes, **extra)
    if cpu_terms:
        shape = model_shape(raw, params)
        add = cpu_grouped_gemm_padding(shape, remat) * float(activation_bytes or cost.activation_bytes)
        cost = cost.replace(mem_per_token=cost.mem_per_token + add)
    return float(group_program_bytes(cost, [int(tokens)], int(degree)))


def measure_families(models: Sequence[str], degrees: Sequence[int], tokens: Sequence[int], *,
                     layer_checks: Sequence[tuple[int, int]] = (), depth: tuple[int, int] = BASE,
                     hardware: str = "ascend-910b", compute_dtype: str = "float32", log=None,
                     rows_file: str | None = None, remats: Sequence[str] = ("none",), tensor_parallel: int = 1,
                     sequence_parallel: bool = False) -> dict:
    """Rows (model, remat, degree, tokens), for each remat of `remats`: compiled and modelled bytes of the group program at `depth`
    (LLM layers, encoder blocks), their ratio; `layer_rows` (model, degree, tokens) at each of
    `layer_checks`: the bytes one more LLM layer / one more encoder block adds, compiled and
    modelled. The ratio of a full-depth program, (base + n dL + m dV) compiled vs modelled, lies
    between the base ratio and the per-layer ratios (a mediant), so the full-depth agreement is
    bounded by the rows and the layer rows (`full_depth_bound`).

    `tensor_parallel` t > 1: each group is `degree` ranks of t devices (`PlanExecutor(...,
    tensor_parallel=t)`, the program of one device), priced with `CostModel.preset(...,
    tensor_parallel=t)`. A bf16 program compiled for CPU devices computes in fp32: the model then
    holds its activations in `CPU_ACTIVATION_BYTES` (`dhp_jax.sharding.memory_bench`)."""
    import jax

    from dhp_jax.model.hf.config import with_depth
    from dhp_jax.sharding.memory_bench import CPU_ACTIVATION_BYTES

    devices = jax.devices()
    t = int(tensor_parallel)
    if not remats or any(r not in REMATS for r in remats):
        raise ValueError(f"remats must be some of {REMATS}, got {list(remats)}")
    if max(degrees, default=1) * t > len(devices):
        raise SystemExit(f"degree {max(degrees)}{f' x tensor_parallel {t}' if t > 1 else ''} needs "
                         f"{max(degrees) * t} devices, found {len(devices)}")
    ab = CPU_ACTIVATION_BYTES if devices[0].platform == "cpu" and compute_dtype != "float32" else None
    say = log or (lambda text: None)
    cpu = devices[0].platform == "cpu"           # price the CPU program as it is (`modelled`'s cpu_terms)
    device: dict = {}                            # the accelerator's figure of each point (no CPU terms, compute dtype)

    def cfg_key(cfg: Mapping[str, Any]) -> str:
        return json.dumps(cfg, sort_keys=True, default=str)

    def keep(row: dict) -> dict:
        if rows_file:                                  # one JSON line per row as it is measured
            import json
            with open(rows_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row
    rows, layer_rows = [], []
    for spec in models:
        name, raw = load_model_config(spec)
        full = (int(raw["text_config"]["num_hidden_layers"]),
                int(raw["vision_config"].get("depth", raw["vision_config"].get("num_hidden_layers", 0))))
        base = with_depth(raw, *depth)

        def point(cfg: Mapping[str, Any], d: int, s: int, remat: str) -> tuple[int, float, float, int]:
            t0 = time.perf_counter()
            got, params = compiled(cfg, d, s, devices, compute_dtype, remat, tensor_parallel=t,
                                   sequence_parallel=sequence_parallel)
            kw = dict(hardware=hardware, compute_dtype=compute_dtype, remat=remat, tensor_parallel=t,
                      sequence_parallel=sequence_parallel, activation_bytes=ab)
            want = modelled(cfg, params, d, s, cpu_terms=cpu, **kw)
            device[cfg_key(cfg), remat, d, s] = modelled(cfg, params, d, s, hardware=hardware,
                                                         compute_dtype=compute_dtype, remat=remat,
                                                         tensor_parallel=t, sequence_parallel=sequence_parallel)
            return got, want, time.perf_counter() - t0, params

        done: dict[tuple[str, int, int], tuple[int, float, float, int]] = {}   # base program by (remat, degree, tokens)
        for remat, (d, s) in ((r, c) for r in remats for c in layer_checks):
            done[remat, d, s] = got0, want0, _, params0 = point(base, d, s, remat)
            for what, cfg in (("llm_layer", with_depth(raw, depth[0] + 1, depth[1])),
                              ("encoder_block", with_depth(raw, depth[0], depth[1] + 1))):
                got, want, took, params = point(cfg, d, s, remat)
                dg, dw = got - got0, want - want0
                layer_rows.append(keep({"model": name, "remat": remat, "tensor_parallel": t, "degree": d,
                                        "tokens": s, "added": what,
                                   "compiled_bytes": int(dg), "model_bytes": int(dw), "ratio": round(dw / dg, 4),
                                   "compile_s": round(took, 1), "base_compiled_bytes": got0, "base_params": params0,
                                   "params": params}))
                say(f"{name} remat {remat} degree {d} {s} tokens, one more {what}: compiled {dg / 1e6:.0f} MB, "
                    f"model {dw / 1e6:.0f} MB, ratio {dw / dg:.3f}")
        for remat, s, d in ((r, s, d) for r in remats for s in tokens for d in degrees):
            got, want, took, params = done.get((remat, d, s)) or point(base, d, s, remat)
            rows.append(keep({"model": name, "family": raw["model_type"], "remat": remat, "tensor_parallel": t,
                              **({"sequence_parallel": bool(sequence_parallel)} if t > 1 else {}),
                              "degree": d, "tokens": s,
                              "layers": list(depth), "full_layers": list(full), "compiled_bytes": got,
                              "model_bytes": int(want), "ratio": round(want / got, 4), "compile_s": round(took, 1),
                              "device_model_bytes": int(device[cfg_key(base), remat, d, s]),
                              "cpu_terms": cpu, "params": params}))
            say(f"{name} remat {remat} degree {d} {s} tokens at {depth}: compiled {got / 1e9:.2f} GB, model "
                f"{want / 1e9:.2f} GB, ratio {want / got:.3f} ({took:.0f} s)")
    ratios = [r["ratio"] for r in rows] + [r["ratio"] for r in layer_rows]
    return {"label": f"XLA memory_analysis of the family group program at {depth[0]} LLM layers and {depth[1]} "
                     f"encoder blocks (abstract params from config.json, {compute_dtype}, compiled for "
                     f"{devices[0].platform} devices{f', ranks of {t} devices' if t > 1 else ''}) vs "
                     f"`group_program_bytes` (remat {', '.join(remats)}{f', tensor_parallel {t}' if t > 1 else ''})",
            "figure": ("the CPU program's (activations in 4 bytes where bf16, and the named CPU terms)" if cpu
                       else "the accelerator's (no CPU term)"),
            "depth": list(depth), "compute_dtype": compute_dtype, "tensor_parallel": t, "remats": list(remats),
            "sequence_parallel": bool(sequence_parallel), "rows": rows,
            "layer_rows": layer_rows,
            "full_depth_bound": [min(ratios), max(ratios)] if ratios else None}
