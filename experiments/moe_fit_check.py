"""The long-sample check of experiments/REPORT.md section 14: qwen3-vl-30b-a3b, one sample of 64k
tokens on 64 devices of the ascend-910b preset. The planner's (t, degree)
(`dhp_jax.planner.cost.tensor_parallel.choose`) is compiled as the engine runs it (the family's
group program, bf16, remat "layer", the preset's linear chunk, sequence-parallel at t > 1) for one
device, abstractly (params as `jax.ShapeDtypeStruct`) on 64 fake CPU devices, and XLA's
`memory_analysis()` is set next to the memory model: the accelerator's figure (no CPU term, bf16
activations), which is what `choose` prices, and the CPU program's figure (activations in 4 bytes
and `memory.cpu_grouped_gemm_padding`), each with the device's state shard, against the 910B's usable
bytes.

    python -m experiments.moe_fit_check        # writes experiments/results/moe_fit_check.json
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

MODEL, HARDWARE, TOKENS, DEVICES = "qwen3-vl-30b-a3b", "ascend-910b", 65536, 64
OUT = Path(__file__).parent / "results" / "moe_fit_check.json"


def main() -> int:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
    import jax

    from dhp_jax.planner import CostModel
    from dhp_jax.planner.cost.memory import group_program_bytes, rank_state_bytes
    from dhp_jax.planner.cost.tensor_parallel import choose
    from dhp_jax.sharding.family_memory import load_model_config, memory_analysis, model_shape, modelled

    pick = choose(MODEL, HARDWARE, TOKENS, DEVICES)
    t, degree = pick["t"], pick["degree"]
    preset = dict(remat="layer", tensor_parallel=t, sequence_parallel=t > 1, ranks_per_node=8 // t,
                  state_shards=DEVICES)
    chunk = CostModel.preset(MODEL, HARDWARE, **preset).geometry.linear_chunk
    _, raw = load_model_config(MODEL)
    t0 = time.perf_counter()
    m, params = memory_analysis(raw, degree, TOKENS, jax.devices(), "bfloat16", "layer", chunk, t, t > 1)
    took = time.perf_counter() - t0
    got = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    kw = dict(hardware=HARDWARE, compute_dtype="bfloat16", remat="layer", linear_chunk=chunk, tensor_parallel=t,
              sequence_parallel=t > 1, state_shards=DEVICES)
    device = modelled(raw, params, degree, TOKENS, **kw)
    cpu = modelled(raw, params, degree, TOKENS, activation_bytes=4, cpu_terms=True, **kw)
    cost = CostModel.preset(model_shape(raw, params), HARDWARE, compute_dtype="bfloat16", require_fit=False,
                            linear_chunk=chunk, **preset)
    state = rank_state_bytes(cost)
    usable = cost.usable_bytes
    assert abs(group_program_bytes(cost, [TOKENS], degree) - device) < 1.0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"model": MODEL, "hardware": HARDWARE, "tokens": TOKENS, "devices": DEVICES,
           "choose": {k: pick[k] for k in ("t", "degree", "step_s", "device_bytes", "usable_bytes", "fits")},
           "linear_chunk": chunk, "compile_s": round(took, 1),
           "compiled": {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
                        "temp": m.temp_size_in_bytes, "aliases": m.alias_size_in_bytes, "total": int(got)},
           "state_bytes": int(state), "usable_bytes": int(usable),
           "model_device_bytes": int(device), "model_cpu_bytes": int(cpu),
           "model_cpu_over_compiled": round(cpu / got, 4),
           "device_fits_by_model": bool(device + state <= usable),
           "cpu_program_fits": bool(got + state <= usable),
           "commit": commit, "host": platform.processor() or platform.machine(), "jax": jax.__version__}
    OUT.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
