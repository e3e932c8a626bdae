"""Load a compiled group program onto another device set of the same mesh shape, without compiling.

XLA binds an executable to its device assignment, so a group program that runs on two device sets
(a degree-1 group on rank 0 in one step and on rank 5 in the next) was compiled once per set. But
the code XLA generates for an SPMD program never names a device: partitions are logical (partition
ids, replica groups, collective-permute pairs) and the device assignment is a table the runtime
reads. The program lowered for two device sets of one mesh shape is the same StableHLO (the
executor lowers it from abstract arguments), so its compiled form, loaded with the other device
assignment, is what a compile for those devices would build: the same machine code, giving the
same values to the last bit (`tests/test_rebind.py` checks both). JAX does the same for GPU
processes that share one binary (its persistent cache key drops the device assignment there).

`rebind` serializes a compiled program (`jax.experimental.serialize_executable`), maps each device
of the source mesh to the device at the same mesh position in the target mesh, and loads it with
the target's device assignment: 0.6 to 1.1 s wall for the demo's programs on a loaded 2-core VM,
against 8 to 11 s of CPU for their compiles. It needs JAX internals (the unpickler of serialized
executables, the compile options JAX builds), so it is used where those are known to work (JAX
0.10 on CPU devices, one process) and a caller falls back to compiling when it raises
(`RebindError`). The device assignment must be the target mesh's, in mesh order, as here: a wrong
one is not an error but a crash or wrong values when the executable runs.
"""

from __future__ import annotations

import io
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh


class RebindError(RuntimeError):
    """The program could not be loaded onto the other devices (compile it there instead)."""


def supported(source: Mesh, target: Mesh) -> bool:
    """Whether `rebind` applies: one process owns every device of both meshes (a group spanning
    processes is compiled as before), the meshes have one shape and axis names, and one platform."""
    devices = list(source.devices.flat) + list(target.devices.flat)
    me = jax.process_index()
    return (source.devices.shape == target.devices.shape and source.axis_names == target.axis_names
            and all(d.process_index == me for d in devices)
            and len({d.platform for d in devices}) == 1 and jax.process_count() == 1)


def serialize(compiled: Any) -> tuple[bytes, Any, Any]:
    """(bytes, in_tree, out_tree) of a compiled program, as `rebind` takes them (serialize once,
    rebind many times)."""
    from jax.experimental import serialize_executable

    try:
        return serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError, TypeError) as e:
        raise RebindError(f"cannot serialize the compiled program: {e}") from None


def rebind(serialized: tuple[bytes, Any, Any], source: Mesh, target: Mesh,
           compiler_options: Mapping[str, Any] | None = None) -> Any:
    """The program `serialized` (compiled for `source`) loaded onto `target`'s devices, device
    `source.devices[i]` replaced by `target.devices[i]` at every mesh position i; a
    `jax.stages.Compiled` taking and returning arrays on `target`. `RebindError` if it cannot."""
    if not supported(source, target):
        raise RebindError(f"cannot move a program from mesh {source.devices.shape} {source.axis_names} to "
                          f"{target.devices.shape} {target.axis_names} across processes or platforms")
    try:
        from jax._src import compiler
        from jax.experimental import serialize_executable
    except ImportError as e:      # a JAX without these internals: compile instead
        raise RebindError(f"this JAX cannot load a program onto other devices: {e}") from None
    data, in_tree, out_tree = serialized
    old = [d.id for d in source.devices.flat]
    new = list(target.devices.flat)
    backend = new[0].client
    # the options JAX compiles an SPMD program with (one replica, a partition per device), for the
    # target's device assignment: what the loaded executable runs with
    options = compiler.get_compile_options(num_replicas=1, num_partitions=len(new),
                                           device_assignment=np.array(new, dtype=object).reshape(1, -1),
                                           env_options_overrides=dict(compiler_options or {}), backend=backend)
    by_old_id = dict(zip(old, new))

    class Remap(serialize_executable._JaxPjrtUnpickler):
        def persistent_load(self, pid):
            if pid[0] == "device":         # the shardings' meshes: each device at its mesh position
                return by_old_id[pid[1]]
            if pid[0] == "exec":
                return self.backend.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                           compile_options=options)
            return super().persistent_load(pid)

    try:
        unloaded, args_info_flat, no_kwargs = Remap(io.BytesIO(data), backend, new).load()
        return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree,
                                   no_kwargs=no_kwargs)
    except Exception as e:  # noqa: BLE001 - any failure of the internals: the caller compiles instead
        raise RebindError(f"cannot load the program onto devices {[d.id for d in new]}: "
                          f"{type(e).__name__}: {e}") from None
