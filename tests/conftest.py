"""Every test process sees 8 fake CPU devices: the flag must be set before jax is imported.

One OpenMP thread per process (torch, numpy's BLAS), inherited by every subprocess a test starts:
the suite runs several processes per core, where a second OpenMP thread per process only spins
waiting for a core (an in-process torch loop costs ~17x the CPU time with two threads instead of
one on a loaded 2-core machine). Set OMP_NUM_THREADS to override.
"""

import os

from dhp_jax.devices import cpu_devices_env

os.environ.update(cpu_devices_env(8))
# Every program a test compiles without options of its own (the references' `jax.jit`, `hf.logits`)
# builds as the CPU executors' first tier does (`compile_cache.CPU_FAST_COMPILE`: no LLVM
# optimisation, the older fusion emitters), which halves their compile time; programs compiled with
# explicit options (the executors' tiers, the memory measurements) keep those. Every program, with
# options or without, is generated as one LLVM module (XLA:CPU splits a module into parts to compile
# them on several threads; the suite runs a process or more per core, so the parts only add work).
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
              "--xla_cpu_parallel_codegen_split_count=1"):
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CPU executors build each program once (with `CPU_FAST_COMPILE`): the second tier (XLA's default
# options, rebuilt in the background once a program has run a few times) would double the suite's
# compiles; tests/test_sharding.py and tests/test_train.py turn it on where they test it
os.environ.setdefault("DHP_COMPILE_TIERS", "0")

# xdist hands whole files to its workers in the order of the collection (`--dist loadfile
# --no-loadscope-reorder` in pyproject.toml). The heaviest files go first, so that the last files
# to start are short ones and the workers finish together (longest-processing-time-first); xdist's
# own order (most tests first) left single-test subprocess files of ~45 CPU-s for the end, one
# worker idle while the other ran them. The list is the files that take about 10 CPU-s or more,
# heaviest first; a file not in it starts after them, in collection order. Only the suite's wall
# time depends on it.
HEAVY_FIRST = (
    "test_tp_family.py", "test_family_memory.py", "test_memory.py", "test_multiprocess_jax.py",
    "test_train.py", "test_npu_xla.py", "test_finetune_train.py", "test_npu_train.py",
    "test_train_runs.py", "test_sharding.py", "test_torchrun_multinode.py", "test_multiprocess_live.py",
    "test_experiments.py", "test_hf_moe.py", "test_hf_engine_qwen3_vl.py", "test_tp_engine.py",
    "test_padskip.py", "test_notebooks.py", "test_tp_train.py", "test_ulysses.py", "test_ring.py",
    "test_docs_commands.py", "test_published_layouts.py", "test_vision_rule.py", "test_planner_milp.py",
    "test_hf_engine_internvl.py", "test_family_registry.py", "test_attention_bench.py",
    "test_hf_qwen3_vl.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: files stay whole
