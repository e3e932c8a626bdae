"""Every test process sees 8 fake CPU devices: the flag must be set before jax is imported.

One OpenMP thread per process (torch, numpy's BLAS), inherited by every subprocess a test starts:
the suite runs several processes per core, where a second OpenMP thread per process only spins
waiting for a core (an in-process torch loop costs ~17x the CPU time with two threads instead of
one on a loaded 2-core machine). Set OMP_NUM_THREADS to override.
"""

import os

from dhp_jax.devices import cpu_devices_env

os.environ.update(cpu_devices_env(8))
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The files that take longest start first (xdist hands out whole files, `--dist loadfile`, in
# collection order): a long file picked up last would run alone at the end while the other workers
# idle. Tests keep their order inside a file; the rest follow in the usual order.
SLOW_FIRST = ("test_multiprocess_jax.py", "test_memory.py", "test_tp_family.py", "test_multiprocess_live.py",
              "test_train.py", "test_sharding.py", "test_train_runs.py", "test_experiments.py", "test_padskip.py",
              "test_finetune_train.py", "test_torchrun_multinode.py", "test_tp_engine.py", "test_npu_train.py",
              "test_ulysses.py", "test_hf_engine_qwen3_vl.py", "test_family_memory.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
