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
# explicit options (the executors' tiers, the memory measurements) keep those.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CPU executors build each program once (with `CPU_FAST_COMPILE`): the second tier (XLA's default
# options, rebuilt in the background once a program has run a few times) would double the suite's
# compiles; tests/test_sharding.py and tests/test_train.py turn it on where they test it
os.environ.setdefault("DHP_COMPILE_TIERS", "0")
