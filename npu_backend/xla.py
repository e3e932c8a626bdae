"""torch_xla devices for the torch executor: XLA computes, gloo carries the traffic on host copies.

A DHP plan runs groups of different sizes and shapes at the same time, and every group's ranks
exchange different tensors. torch_xla's own collectives cannot express that: an all-reduce on a
`dist.new_group` of 3 of 4 ranks of its "xla" process group fails XLA's HLO verifier (a replica
group must hold every replica), and `xm.all_reduce(..., groups=[[0, 1, 2], [3]])` issued with
different shapes per group stalls (each process compiles its own program, and their rendezvous op
ids differ). So each rank here is an independent XLA client with one device, and every message
the executor sends (the ring's and Ulysses' point-to-point blocks, the step's status all-reduce,
the gradient all-reduce) goes through `XlaHostGroup`: a torch.distributed process group, written
in Python, whose collectives copy the XLA tensors to the host, run gloo on the copies and copy the
results back into the XLA tensors. The executor, ring and Ulysses code stays as it is: they call
`dist.batch_isend_irecv` / `dist.all_reduce` on the world group, and `init_process_group(BACKEND)`
makes that group an `XlaHostGroup`.

The copy to the host is also where torch_xla cuts its lazy graph: sending a tensor executes the
program that computes it. torch_xla compiles one program per graph and input shapes and caches
it; the executor pads a group's packed stream to the planned bucket
(`dhp_jax.geometry.layout.planned_bucket`), so plans whose groups fall in the same buckets reuse
the programs of earlier steps. `compile_stats()` reads torch_xla's CompileTime metric.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

BACKEND = "xlahost"     # the torch.distributed backend name registered by `register_backend`

_REGISTERED = False


class XlaError(RuntimeError):
    """torch_xla is missing or cannot give a device."""


def available() -> tuple[bool, str]:
    """(True, version) when torch_xla imports here; else (False, one line saying why)."""
    if importlib.util.find_spec("torch_xla") is None:
        return False, (f"torch_xla is not installed in this environment (torch {torch.__version__}); "
                       f"build the xla environment: python -m npu_backend.xla_env")
    try:
        import torch_xla
    except Exception as e:   # an ABI mismatch with torch shows here (undefined symbol ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return False, f"torch_xla does not import with torch {torch.__version__}: {type(e).__name__}: {first}"
    return True, getattr(torch_xla, "__version__", "?")


def device(mode: str | None = None) -> torch.device:
    """This process's XLA device (one per process: the rank's), in execution `mode` (default
    $DHP_XLA_MODE, else "eager"): "eager" compiles and runs each op on its own (one program per op
    and shape), "lazy" traces ops into graphs cut at each host copy (one program per graph)."""
    import torch_xla
    from torch_xla.experimental import eager_mode

    mode = (mode or os.environ.get("DHP_XLA_MODE") or "eager").lower()
    if mode not in ("eager", "lazy"):
        raise XlaError(f"DHP_XLA_MODE={mode!r} is not one of eager, lazy")
    eager_mode(mode == "eager")
    return torch_xla.device()


def sync() -> None:
    """Cut the lazy graph here and run it (the end of a step: the optimizer's update)."""
    import torch_xla

    torch_xla.sync()


def compile_stats() -> dict[str, float]:
    """What torch_xla compiled and ran in this process so far: programs compiled (`compiles`, the
    UncachedCompile counter), compilations served from its cache (`cached`), seconds compiling
    (CompileTime, or EagerOpCompileTime in eager mode) and programs executed."""
    import torch_xla.debug.metrics as met

    def counter(name: str) -> int:
        return int(met.counter_value(name) or 0)

    def seconds(name: str) -> float:
        data = met.metric_data(name)
        return 0.0 if data is None else float(data[1]) / 1e9

    return {"compiles": counter("UncachedCompile"), "cached": counter("CachedCompile"),
            "compile_s": seconds("CompileTime") + seconds("EagerOpCompileTime"),
            "executions": counter("ExecuteComputation")}


# ---------------------------------------------------------------------------- the process group
class _Done(dist.Work):
    """A finished request: the host copies already landed."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class _HostWork(dist.Work):
    """A gloo request on host copies; `wait()` waits for it, then runs `then` (copy back to XLA)."""

    def __init__(self, work: Any, then: Callable[[], None] | None = None, keep: Sequence[torch.Tensor] = ()):
        super().__init__()
        self._work, self._then, self._keep = work, then, list(keep)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._then is not None:
                self._then()
            self._keep = []
        return True

    def is_completed(self) -> bool:
        return self._work is None

    def is_success(self) -> bool:
        return True


def _host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.device.type == "cpu" else t.detach().cpu() for t in tensors]


def _copy_back(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for d, s in zip(dst, src):
            if d is not s:
                d.copy_(s)
    return run


class XlaHostGroup(dist.ProcessGroup):
    """A process group whose collectives run on gloo over host copies of XLA (or CPU) tensors.

    Implements what the torch executor's stand-in and family paths use on one process per rank:
    point-to-point `send` / `recv`, `allreduce`, `broadcast` and `barrier`. Anything else raises
    `NotImplementedError` naming the operation (tensor parallelism's all-gathers and
    reduce-scatters are not supported on XLA devices)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.messages = 0     # tensors sent or reduced, for tests and logs

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        host = _host(tensors)
        if opts is None:
            opts = dist.AllreduceOptions()
        elif not isinstance(opts, dist.AllreduceOptions):     # a ReduceOp
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = op
        self.gloo.allreduce(host, opts).wait()
        _copy_back(tensors, host)()
        self.messages += len(tensors)
        return _Done()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        host = _host(tensors)
        self.gloo.broadcast(host, opts if opts is not None else dist.BroadcastOptions()).wait()
        _copy_back(tensors, host)()
        return _Done()

    def barrier(self, opts: Any = None) -> dist.Work:
        self.gloo.barrier(opts if opts is not None else dist.BarrierOptions()).wait()
        return _Done()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        host = _host(tensors)     # runs the XLA program that computes them
        self.messages += len(tensors)
        return _HostWork(self.gloo.send(host, dst, tag), keep=host)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        host = [t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype) for t in tensors]
        return _HostWork(self.gloo.recv(host, src, tag), then=_copy_back(tensors, host))

    def _unsupported(self, what: str) -> None:
        raise NotImplementedError(f"{what} is not supported by the {BACKEND!r} process group (XLA devices run "
                                  f"point-to-point sends, all-reduce and broadcast only)")

    def allgather(self, *a: Any, **k: Any) -> dist.Work:
        self._unsupported("all_gather")

    def _allgather_base(self, *a: Any, **k: Any) -> dist.Work:
        self._unsupported("all_gather_into_tensor")

    def reduce_scatter(self, *a: Any, **k: Any) -> dist.Work:
        self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, *a: Any, **k: Any) -> dist.Work:
        self._unsupported("reduce_scatter_tensor")

    def alltoall_base(self, *a: Any, **k: Any) -> dist.Work:
        self._unsupported("all_to_all_single")

    def recv_anysource(self, *a: Any, **k: Any) -> dist.Work:
        self._unsupported("recv from any source")


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> XlaHostGroup:
    return XlaHostGroup(store, rank, size, timeout)


def register_backend() -> str:
    """Register `BACKEND` with torch.distributed (once per process); returns its name."""
    global _REGISTERED
    if not _REGISTERED:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "xla"])
        _REGISTERED = True
    return BACKEND
