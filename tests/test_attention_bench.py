"""`dhp bench attention`: the tile figures (allowed and executed), the memory probe on a small case, the CPU answer of
--device-check (the GPU run itself is a prepared script, never run by the tests)."""

import subprocess
import sys

import jax

from dhp_jax.model import MLLMConfig, init_params
from dhp_jax.bench import attention as attention_bench


def test_tiles_of_a_causal_sample_on_a_zigzag_ring():
    """The NumPy count of allowed pairs is the causal triangle, and the kernel executed exactly those,
    forward and backward (counted as they ran)."""
    t = attention_bench.tiles(tokens=4096, degree=8, tile=128)
    n = 8 * 4                                     # 4 tiles of 128 per device
    assert t["dense_pairs"] == n * n and t["computed_pairs"] == n * (n + 1) // 2
    assert t["executed_pairs_forward"] == t["executed_pairs_backward"] == t["computed_pairs"]


def test_temp_memory_is_read_from_the_compiled_program_without_params():
    config = MLLMConfig.preset("tiny")
    struct = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    ex = attention_bench._executor(config, tile=32)
    small, big = (attention_bench.temp_bytes(ex, struct, 2, s) for s in (128, 512))
    assert 0 < small < big < 8 * small            # linear-ish in local tokens, never quadratic


def test_device_check_on_cpu_prints_one_line():
    out = subprocess.run([sys.executable, "-m", "dhp_jax", "bench", "attention", "--device-check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(out.stdout.strip().splitlines()) == 1 and "no GPU" in out.stdout
