"""`CompileCache`: the group programs' executables of a `PlanExecutor`, built once each.

XLA binds an executable to its device assignment, so the key is (degree, bucket, device tuple,
attention kind); a program is (degree, bucket, attention). On CPU devices (`reuse_compiled`) only a
program's first executable is compiled: its executables for other device sets are that compiled
program loaded with their device assignment (`dhp_jax.sharding.rebind`: the same machine code,
about a second instead of a compile; `rebound_keys` lists them), unless JAX's persistent compilation
cache supplied the compile. Heavy programs get a second build with XLA's default options after a
few steps (`tiers`), made on one background worker thread. The cache knows nothing of the model:
it is given the functions that lower a program and give a group's sub-mesh.
"""

from __future__ import annotations

import atexit
import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import jax

from dhp_jax.sharding import rebind

Key = tuple[int, int, tuple[jax.Device, ...], str]          # (degree, bucket, devices, attention)

# XLA:CPU compile options of the executor on CPU (fake) devices, which are for correctness runs:
# most of a CPU run is compiling group programs. LLVM optimisation (backend level 0) and the MLIR
# fusion emitters (off: XLA:CPU's older emitters compile faster, their programs run somewhat slower)
# cost compile time and buy little there. Memory measurements compile with XLA's default emitters
# (`memory_bench.CPU_MEMORY_OPTIONS`), the programs the memory model was validated on.
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
# The second tier on CPU devices: XLA's default options (LLVM optimisation, the fusion emitters). The
# first `TIER_UP_RUNS` steps that run a program use its `CPU_FAST_COMPILE` build; its second-tier
# build is queued on a background thread `TIER_LEAD` steps before that, and every later step runs it
# (waiting for it if it is not built yet). The switch is a function of the step count alone, so a
# run's numbers do not depend on how fast the builds are. XLA's defaults are written out, so that the
# second tier is XLA's default build whatever XLA_FLAGS the process was started with (the test suite
# starts its processes with `CPU_FAST_COMPILE`'s values as flags, for every compile it makes itself).
CPU_TUNED: dict[str, Any] = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
TIER_UP_RUNS = 4
TIER_LEAD = 3
# Only a program whose run is heavy enough for a faster build to pay back its compile within a few
# steps gets a second tier: at least this many flops a run over all its devices (XLA's cost
# analysis of the lowered program, the same on every run).
TIER_MIN_FLOPS = 1.5e9


class _CacheHits(threading.local):
    count = 0


_CACHE_HITS = _CacheHits()
_LISTENING = threading.Lock()
_listener_on = False


def _count_cache_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS.count += 1


def _flops(lowered: Any) -> float:
    """Flops of one device's run of a lowered program (XLA's cost analysis; 0 if there is none)."""
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no second tier
        return 0.0
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def compile_counting_cache_hits(lowered: Any, options: Mapping[str, Any]) -> tuple[Any, bool]:
    """(executable, built here): `built here` is False when JAX's persistent compilation cache
    supplied the executable instead of XLA building it in this process. Such an executable runs, but
    serialized again it lacks kernels (XLA:CPU: "Function ... not found" when the copy runs), so it
    is never the source `dhp_jax.sharding.rebind` loads onto other devices."""
    global _listener_on
    with _LISTENING:
        if not _listener_on:
            jax.monitoring.register_event_listener(_count_cache_hit)
            _listener_on = True
    before = _CACHE_HITS.count
    exe = lowered.compile(compiler_options=dict(options))
    return exe, _CACHE_HITS.count == before


@dataclasses.dataclass
class _FirstCompile:
    """A program's first compiled executable and its devices: what further device sets load
    (`dhp_jax.sharding.rebind`), serialized once, on the first such load."""
    devices: tuple
    executable: Any
    _serialized: Any = None

    def serialized(self) -> Any:
        if self._serialized is None:
            self._serialized = rebind.serialize(self.executable)
        return self._serialized


_WORKERS: dict[threading.Thread, "queue.Queue"] = {}    # second-tier workers and their queues


def _drain(jobs: "queue.Queue") -> list:
    """Take the jobs still queued (second-tier keys) off `jobs`."""
    out = []
    while True:
        try:
            out.append(jobs.get_nowait())
        except queue.Empty:
            return out


@atexit.register
def _join_workers() -> None:
    """At exit: drop the queued second-tier builds and wait for the one in progress."""
    for worker, jobs in list(_WORKERS.items()):
        _drain(jobs)
        jobs.put(None)
        worker.join()


class CompileCache:
    """Executables by key, built once (thread-safe: a background thread may build the next plan's
    programs while a step runs), loaded onto further device sets where that works, and tiered.

    `lower(degree, bucket, devices, attention)` gives the lowered program, `mesh_of(devices,
    attention)` a group's sub-mesh (what a rebind maps between), `check(degree, bucket, devices)`
    raises for a key the model cannot run. `tiers`: a program is first built with `options`; one
    whose run costs at least `tier_min_flops` runs that build for its first `tier_up_runs` steps and
    then its rebuild with `tuned_options`, made on a background thread from `TIER_LEAD` steps ahead
    (a step waits for it if it is not ready: the switch depends on the step count only)."""

    def __init__(self, lower: Callable[..., Any], mesh_of: Callable[..., Any], check: Callable[..., None],
                 options: Mapping[str, Any], reuse_compiled: bool, tiers: bool, tier_up_runs: int) -> None:
        self._lower, self._mesh_of, self._check = lower, mesh_of, check
        self.compiler_options = dict(options)
        self.tuned_options = dict(CPU_TUNED)
        self.reuse_compiled, self.tiers, self.tier_up_runs = reuse_compiled, tiers, tier_up_runs
        self.tier_min_flops = TIER_MIN_FLOPS
        self._executables: dict[Key, Any] = {}
        self._building: dict[Any, threading.Lock] = {}   # one build per program; other programs build concurrently
        self._building_lock = threading.Lock()
        self._compiled: dict[tuple[int, int, str], _FirstCompile] = {}   # program -> what other device sets load
        self.rebound_keys: list[Key] = []                # executables loaded, not compiled
        self.compile_seconds: list[float] = []           # wall time of every executable built
        # the second tier: launches per program, the programs being rebuilt, and the rebuilt
        # executables, which a launch takes from the dispatching thread once they are there
        self._runs: dict[tuple[int, int, str], int] = {}
        self._tuned_source: dict[tuple[int, int, str], _FirstCompile] = {}
        self._tuned: dict[Key, Any] = {}
        self.tune_seconds: list[float] = []              # wall time of every second-tier build
        self._flops: dict[tuple[int, int, str], float] = {}   # flops of a run of each program (all devices)
        self._tuner: Any = None                          # the background worker's queue (one thread)
        self._tuning: dict[Any, threading.Event] = {}    # keys queued or built: set once done

    # ------------------------------------------------------------------ counters
    @property
    def num_compiles(self) -> int:
        return len(self._executables)

    @property
    def num_programs(self) -> int:
        return len({(d, b, a) for d, b, _, a in self._executables})

    @property
    def executable_keys(self) -> list[tuple[int, int, tuple[int, ...], str]]:
        return [(d, b, tuple(x.id for x in devs), a) for d, b, devs, a in self._executables]

    @property
    def tuned_keys(self) -> list[tuple[int, int, tuple[int, ...], str]]:
        """(degree, bucket, device ids, attention) of every executable of the second tier built."""
        return [(d, b, tuple(x.id for x in devs), a) for d, b, devs, a in list(self._tuned)]

    # ------------------------------------------------------------------ the first tier
    def executable(self, key: Key) -> Any:
        """The executable of `key`, built on first use."""
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        degree, bucket, _, attention = key
        with self._building_lock:
            # one build of a program at a time: its executable for a second device set waits for
            # the first and is loaded from it; other programs build concurrently
            lock = self._building.setdefault((degree, bucket, attention), threading.Lock())
        with lock:
            return self._build(key)

    def _build(self, key: Key) -> Any:
        degree, bucket, devices, attention = key
        exe = self._executables.get(key)
        if exe is None:
            self._check(degree, bucket, devices)
            t0 = time.perf_counter()
            exe = self._rebound(key)
            if exe is None:
                lowered = self._lower(degree, bucket, devices, attention)
                if self.tiers and (degree, bucket, attention) not in self._flops:
                    self._flops[(degree, bucket, attention)] = _flops(lowered) * len(devices)
                exe, built = compile_counting_cache_hits(lowered, self.compiler_options)
                if built:   # a persistent-cache hit is never loaded onto other devices
                    self._compiled.setdefault((degree, bucket, attention), _FirstCompile(devices, exe))
            else:
                self.rebound_keys.append(key)
            self._executables[key] = exe
            self.compile_seconds.append(time.perf_counter() - t0)
        return exe

    def _rebound(self, key: Key, source: _FirstCompile | None = None, options: Mapping[str, Any] | None = None) -> Any:
        """The executable of `key` loaded from the program's compiled one on other devices (`source`,
        default: its first compile, built with `options`, default `compiler_options`); None when
        there is none, rebinding is off, or it cannot be loaded (then it is compiled)."""
        degree, bucket, devices, attention = key
        if source is None:
            source = self._compiled.get((degree, bucket, attention))
        if source is None or not self.reuse_compiled:
            return None
        mesh, target = self._mesh_of(source.devices, attention), self._mesh_of(devices, attention)
        if not rebind.supported(mesh, target):
            return None
        try:
            return rebind.rebind(source.serialized(), mesh, target,
                                 self.compiler_options if options is None else options)
        except rebind.RebindError:
            return None

    # ------------------------------------------------------------------ the second tier
    def count_step(self, keys: Sequence[Key]) -> None:
        """Count a step for each program it runs (once, whatever its groups) and queue second-tier
        builds: a program's first `tier_up_runs` steps run its first build, later ones its second,
        queued `TIER_LEAD` steps ahead (called by the dispatching thread, before the step's launches)."""
        if not self.tiers:
            return
        for program in {(d, b, a) for d, b, _, a in keys}:
            self._runs[program] = self._runs.get(program, 0) + 1
        for d, b, devs, a in keys:
            if self._flops.get((d, b, a), 0.0) >= self.tier_min_flops and \
                    self._runs[(d, b, a)] >= self.tier_up_runs - TIER_LEAD:
                self._tune_later((d, b, devs, a))

    def launching(self, key: Key) -> Any:
        """The executable a launch of `key` uses (called by the dispatching thread only): with tiers,
        once its program has run more than `tier_up_runs` steps (`count_step`, counted over the
        run: `launch_counts`), its second-tier build, waited for if it is not built yet."""
        degree, bucket, _, attention = key
        program = (degree, bucket, attention)
        if self.tiers and self._flops.get(program, 0.0) >= self.tier_min_flops and \
                self._runs.get(program, 0) > self.tier_up_runs:
            self._tune_later(key)
            self._tuning[key].wait()
            # a failed second-tier build leaves the first (the same numbers to fp32 1e-5)
            tuned = self._tuned.get(key)
            if tuned is not None:
                return tuned
        return self.executable(key)

    def _tune_later(self, key: Key) -> None:
        """Queue the second-tier build of `key` on the worker thread (once per key)."""
        if key in self._tuning:
            return
        self._tuning[key] = threading.Event()
        if self._tuner is None:
            self._tuner = queue.Queue()
            worker = threading.Thread(target=self._tune_loop, args=(self._tuner,), name="dhp-tier", daemon=True)
            worker.start()
            _WORKERS[worker] = self._tuner
        self._tuner.put(key)

    def _tune_loop(self, jobs: "queue.Queue") -> None:
        # a daemon thread that the interpreter's exit stops and joins (`_join_workers`): XLA ends the
        # process if a thread is torn down inside a compile
        while True:
            key = jobs.get()
            if key is None:
                _WORKERS.pop(threading.current_thread(), None)
                return
            try:
                self._tune(key)
            finally:
                self._tuning[key].set()

    def _tune(self, key: Key) -> None:
        """Build `key` with `tuned_options` (on the worker, in queue order): loaded from the
        program's second-tier build on other devices where there is one, else compiled (then the
        source of its other device sets, unless the persistent cache supplied it)."""
        degree, bucket, devices, attention = key
        program = (degree, bucket, attention)
        t0 = time.perf_counter()
        try:
            source = self._tuned_source.get(program)
            exe = self._rebound(key, source, self.tuned_options) if source is not None else None
            if exe is None:
                exe, built = compile_counting_cache_hits(self._lower(degree, bucket, devices, attention),
                                                         self.tuned_options)
                if built:
                    self._tuned_source.setdefault(program, _FirstCompile(devices, exe))
        except Exception:   # noqa: BLE001 - the first tier keeps running this program
            return
        self._tuned[key] = exe
        self.tune_seconds.append(time.perf_counter() - t0)

    def launch_counts(self) -> dict[str, int]:
        """Steps per program ("degree,bucket,attention": count): what decides its tier, stored in a
        checkpoint so that a resumed run switches where the uninterrupted one does."""
        return {f"{d},{b},{a}": n for (d, b, a), n in sorted(self._runs.items())}

    def set_launch_counts(self, counts: Mapping[str, int]) -> None:
        """Continue from `launch_counts()` of a checkpoint (empty: a fresh run)."""
        runs = {}
        for k, n in counts.items():
            d, b, a = str(k).split(",")
            runs[(int(d), int(b), a)] = int(n)
        self._runs = runs

    def stop_tuning(self) -> None:
        """Drop the queued second-tier builds (a build in progress ends on its own thread, which a
        finished run does not wait for); later launches queue builds again."""
        if self._tuner is not None:
            for key in _drain(self._tuner):
                if key is not None:
                    self._tuning.pop(key).set()
            self._tuner.put(None)
            self._tuner = None
