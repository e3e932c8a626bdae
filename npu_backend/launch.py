"""Start a world of real torch.distributed processes on this machine (tests, benchmarks).

Each process is one rank: it joins a TCP rendezvous on a free local port, runs `fn(rank, world,
*args)` and sends back its result (or its traceback). The parent never waits forever: past the
timeout every child is killed and the error says which ranks did not finish.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Sequence


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, world: int, port: int, backend: str, threads: int,
           fn: Callable[..., Any], args: Sequence[Any], results: Any) -> None:
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "xlahost":    # npu_backend.xla's process group (host copies over gloo)
            from npu_backend.xla import register_backend

            register_backend()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))


# Modules the fork server imports once; every rank then starts as a fork of it with torch loaded,
# instead of paying seconds of `import torch` per rank (spawn). The server itself runs no threads
# and never imports jax, so forking it is safe.
_PRELOAD = ["torch", "torch.distributed", "numpy", "npu_backend.model", "npu_backend.ring",
            "npu_backend.executor"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_world(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), *, timeout: float = 120.0,
              backend: str = "gloo", threads: int = 1) -> list[Any]:
    """Run `fn(rank, world, *args)` in `world` spawned processes; return the results by rank.

    `backend`: a torch.distributed backend, or "xlahost" (`npu_backend.xla.XlaHostGroup`).

    Ranks are forked from a fork server that has torch preloaded. `fn` must be importable by
    name (a module-level function). Raises `RuntimeError` with every
    failing rank's traceback, or naming the ranks still running when `timeout` seconds pass.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, backend, threads, fn, tuple(args), results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(got))
                raise RuntimeError(f"ranks {missing} did not finish within {timeout:.0f} s"
                                   + _errors_text(got))
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"ranks {dead} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})" + _errors_text(got))
                continue
            got[rank] = (ok, out)
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    failed = {r: out for r, (ok, out) in got.items() if not ok}
    if failed:
        raise RuntimeError(_errors_text(got))
    return [got[r][1] for r in range(world)]


def _errors_text(got: dict[int, tuple[bool, Any]]) -> str:
    return "".join(f"\n--- rank {r} failed:\n{out}" for r, (ok, out) in sorted(got.items()) if not ok)
