"""orbax checkpoints of the whole train state plus the data-loader position, written atomically.

Each checkpoint holds two items: `state` (the `TrainState` pytree, restored straight into its
sharding; the trainer's state is sharded over the full mesh, so each process writes and reads only
the shards it holds) and `meta` (JSON: the next data position, the model config, the run config, and
the trainer's record of the programs its plans used, so a resumed run plans alike). orbax writes
into a temporary directory and renames it when complete, so a crash never leaves a half checkpoint
that `latest` would pick. Before any array is read, `meta` is checked against the model config of
the run: resuming a different model is a clear error, not a shape mismatch deep inside orbax.

`meta["layout"]` (`FlatLayout.record`, or `TensorLayout.record` with tensor parallelism) says how
the flat state vectors are laid out: the leaves in order, the P parameters and the padding to a
multiple of the device count that wrote it, with t > 1 also t and each device's share. A run on
another number of ranks at t = 1 pads differently; `restore` reads the same P parameters into the
new padded length (the tail past P is zero, so cutting or extending it changes no value) and the
new sharding. A run at another t (or another device count with t > 1 on either side) lays the
parameters out otherwise: `restore` reads the saved vectors sharded over this run's devices and
converts each of them (the master params and AdamW's moments mu and nu, which are per parameter)
through the whole params tree, the saved layout's `unravel` then this run's `ravel`, in one jitted
program per vector (`convert`). The copies a t > 1 state holds (replicated leaves, shared kv heads)
are checked equal first (`TensorLayout.copy_spread`): a checkpoint whose copies disagree is
refused naming the leaf. Step counters, the schedule's count and the data position are scalars
and carry over as they are. Leaves that differ, or a t > 1 checkpoint whose share layout is not
the one this dhp_jax derives for its t, are named and refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from dhp_jax.model.mllm_config import RUN_ONLY_MODEL_FIELDS


class CheckpointError(ValueError):
    """A checkpoint cannot be used for this run; the message says why."""


@dataclasses.dataclass
class Restored:
    state: Any
    step: int
    data_position: int
    meta: dict


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


class Checkpointer:
    """Save every `every` steps (and on demand), keep the last `keep`, restore the latest."""

    def __init__(self, directory: str | Path, every: int = 0, keep: int = 2):
        self.directory = Path(directory).resolve()
        self.every = int(every)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(self, step: int, state: Any, data_position: int, model_config: Mapping[str, Any],
             run_config: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> None:
        """`extra`: more JSON fields of `meta` (the trainer's program record)."""
        meta = {**_jsonable(dict(extra or {})), "step": int(step), "data_position": int(data_position),
                "model_config": _jsonable(dict(model_config)), "run_config": _jsonable(dict(run_config or {}))}
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def clear(self) -> list[int]:
        """Delete every checkpoint here (a fresh run replaces an old run's); returns their steps."""
        steps = list(self._manager.all_steps())
        for step in steps:
            self._manager.delete(step)
        return steps

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def read_meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {str(self.directory)!r}")
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} has no readable "
                                  f"metadata: {type(e).__name__}: {e}") from None
        return dict(out["meta"])

    def check_compatible(self, model_config: Mapping[str, Any], step: int | None = None) -> dict:
        """Raise `CheckpointError` naming the differing model fields; return the meta otherwise."""
        meta = self.read_meta(step)
        saved = meta.get("model_config", {})
        mine = _jsonable(dict(model_config))
        diff = sorted(k for k in set(saved) | set(mine)
                      if saved.get(k) != mine.get(k) and k not in RUN_ONLY_MODEL_FIELDS)
        if diff:
            details = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {mine.get(k)!r}" for k in diff[:8])
            raise CheckpointError(f"checkpoint in {str(self.directory)!r} (step {meta.get('step')}) is from a "
                                  f"different model config ({details})")
        return meta

    def restore(self, abstract_state: Any, model_config: Mapping[str, Any], step: int | None = None,
                layout: Any = None, layouts: Callable[[Mapping[str, Any]], Any] | None = None) -> Restored:
        """Restore into the shardings of `abstract_state` (a state or its `jax.ShapeDtypeStruct`s).

        `layout`: this run's layout (`FlatLayout` or `TensorLayout`, or its `record`); with one
        stored in the checkpoint too, flat vectors padded for another rank count are re-padded to
        this run's length, and vectors of another tensor-parallel layout are converted, which
        needs `layouts` (a layout record -> that layout of this model, `PlanExecutor.layout_for`)."""
        step = self.latest_step() if step is None else step
        meta = self.check_compatible(model_config, step)
        where = f"checkpoint in {str(self.directory)!r} (step {meta.get('step')})"
        mine = layout.record() if hasattr(layout, "record") else layout
        mode = check_layout(meta.get("layout"), mine, where)
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_state)
        if mode == CONVERT:
            if layouts is None:
                raise CheckpointError(f"{where} was written with tensor_parallel={_tp(meta['layout'])} on "
                                      f"{meta['layout']['num_shards']} devices, this run has tensor_parallel="
                                      f"{_tp(mine)} on {mine['num_shards']}: converting it needs the model's layouts")
            src, dst = layouts(meta["layout"]), layouts(mine)
            check_share_layout(src, meta["layout"], where)
            return self._restore_converted(step, meta, target, src, dst, where)
        try:   # strict=False: orbax cuts or zero-extends an array to the target's shape (the padding only)
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target, strict=mode != REPAD)))
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} does not match this "
                                  f"run's train state: {type(e).__name__}: {e}") from None
        return Restored(state=out["state"], step=int(meta["step"]), data_position=int(meta["data_position"]),
                        meta=meta)

    def _restore_converted(self, step: int, meta: dict, target: Any, src: Any, dst: Any, where: str) -> Restored:
        """`restore` of a state laid out as `src` into `target`, laid out as `dst`: every flat vector
        (a leaf of `dst.padded` elements: the params and the moments) read at its saved length,
        zero-extended to a multiple of this run's device count and sharded over them, then
        converted; the other leaves read as they are."""
        def saved_shape(x):
            if tuple(x.shape) != (dst.padded,):
                return x
            n = len(x.sharding.device_set)
            return jax.ShapeDtypeStruct((-(-src.padded // n) * n,), x.dtype, sharding=x.sharding)

        flat_paths = {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]
                      if tuple(x.shape) == (dst.padded,)}
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(saved_shape, target), strict=False)))
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} does not match this "
                                  f"run's train state: {type(e).__name__}: {e}") from None
        state = out["state"]
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        shardings = {jax.tree_util.keystr(p): x.sharding for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}
        check_copies(src, {_name(p): x for p, x in leaves if jax.tree_util.keystr(p) in flat_paths}, where)
        done, fns = {}, {}
        for p, x in leaves:
            k = jax.tree_util.keystr(p)
            if k in flat_paths:
                if shardings[k] not in fns:          # one program for params, mu and nu
                    fns[shardings[k]] = converter(src, dst, shardings[k])
                x = fns[shardings[k]](x)
            done[k] = x
        state = jax.tree_util.tree_unflatten(jax.tree.structure(state), [done[jax.tree_util.keystr(p)]
                                                                          for p, _ in leaves])
        return Restored(state=state, step=int(meta["step"]), data_position=int(meta["data_position"]), meta=meta)

    def all_steps(self) -> list[int]:
        return sorted(int(s) for s in self._manager.all_steps())

    def restore_params(self, step: int, padded: int) -> np.ndarray:
        """The flat fp32 master params (`state.params`, `padded` elements) of checkpoint `step`, on
        this host's CPU; nothing else of the state (no optimizer moments) is read."""
        if step not in self.all_steps():
            raise CheckpointError(f"{str(self.directory)!r}: no checkpoint of step {step} "
                                  f"(steps there: {self.all_steps()})")
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = {"params": jax.ShapeDtypeStruct((int(padded),), np.float32, sharding=cpu)}
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, restore_args={"params": ocp.ArrayRestoreArgs(sharding=cpu)}, partial_restore=True)))
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r}: no params vector of "
                                  f"{padded} elements ({type(e).__name__}: {str(e)[:300]})") from None
        return np.asarray(out["state"]["params"])

    def close(self) -> None:
        self._manager.close()


SAME, REPAD, CONVERT = "same", "repad", "convert"


def _name(path: Any) -> str:
    """A state leaf's path as "params", "opt_state/1/0/mu"."""
    return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def _tp(record: Mapping[str, Any]) -> int:
    return int(record.get("tensor_parallel", 1))


def check_layout(saved: Mapping[str, Any] | None, mine: Mapping[str, Any] | None, where: str) -> str:
    """How the saved flat vectors reach this run's layout: SAME, REPAD (t = 1 on both sides, the
    same parameters padded for another rank count) or CONVERT (another tensor-parallel layout:
    through the whole params tree, `convert`); `CheckpointError` naming the first differing leaves
    when the parameters differ. Nothing to check (SAME) when either side has no layout record (a
    checkpoint of an older dhp_jax)."""
    if not saved or not mine:
        return SAME
    a = [tuple(map(str, x)) for x in saved["leaves"]]
    b = [tuple(map(str, x)) for x in mine["leaves"]]
    if a != b:
        sa, sb = {x[0]: x[1:] for x in a}, {x[0]: x[1:] for x in b}
        diff = ([f"{p}: checkpoint {sa[p][0]} {sa[p][1]} vs run {sb[p][0]} {sb[p][1]}"
                 for p in sa if p in sb and sa[p] != sb[p]]
                + [f"{p} only in the checkpoint" for p in sa if p not in sb]
                + [f"{p} only in the run" for p in sb if p not in sa])
        if not diff:
            diff = ["the same leaves in another order"]
        raise CheckpointError(f"{where} holds other parameters than this run's model ({saved['size']} vs "
                              f"{mine['size']} values; " + "; ".join(diff[:6])
                              + (f"; ... ({len(diff)} leaves differ)" if len(diff) > 6 else "") + ")")
    if max(_tp(saved), _tp(mine)) > 1:
        # a tensor-parallel state holds each device's share (dhp_jax.sharding.tensor_parallel.TensorLayout):
        # another t or device count is another interleaving, not another padding
        same = _tp(saved) == _tp(mine) and int(saved["num_shards"]) == int(mine["num_shards"])
        return SAME if same else CONVERT
    return REPAD if int(saved["padded"]) != int(mine["padded"]) else SAME


def check_share_layout(src: Any, saved: Mapping[str, Any], where: str) -> None:
    """`CheckpointError` unless `src` (the layout this dhp_jax derives for the checkpoint's t and
    device count) lays the vectors out as the checkpoint's record says: the same master length
    and, with t > 1, the same share of every device (another dhp_jax may split otherwise)."""
    mine = src.record()
    keys = ("padded", "num_shards", "tensor_parallel", "local")
    diff = [k for k in keys if _normal(saved.get(k)) != _normal(mine.get(k))]
    if diff:
        what = ", ".join(f"{k}: checkpoint {_brief(saved.get(k))} vs derived {_brief(mine.get(k))}" for k in diff)
        raise CheckpointError(f"{where} holds a tensor_parallel={_tp(saved)} state whose layout this dhp_jax does "
                              f"not derive for t={_tp(saved)} on {saved['num_shards']} devices ({what}): it cannot "
                              "be converted; resume it at its own t and device count")


def _normal(x: Any) -> Any:
    return json.loads(json.dumps(x)) if x is not None else None


def _brief(x: Any) -> str:
    if isinstance(x, dict):
        return f"{x.get('size')} values padded to {x.get('padded')} over {x.get('num_shards')}"
    return repr(x)


# relative difference between copies of a parameter (or of its moments) a conversion accepts:
# they get the same summed gradient, so they are bitwise equal unless the state is corrupt
COPY_RTOL = 1e-6


def check_copies(src: Any, vectors: Mapping[str, jax.Array], where: str) -> None:
    """`CheckpointError` naming the vector and leaf where the copies a t > 1 state holds (a
    replicated leaf on every device of a rank, a shared kv head on its holders) differ by more
    than `COPY_RTOL` of the leaf's magnitude: converting keeps one copy, which would silently drop
    the others. Nothing to check at t = 1."""
    if not hasattr(src, "copy_spread"):
        return
    bad, fns = [], {}
    for name, x in vectors.items():
        if x.sharding not in fns:     # replicated out: every process reads the figures
            rep = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
            fns[x.sharding] = jax.jit(lambda v: src.copy_spread(v[:src.padded]), out_shardings=(rep, rep))
        spread, scale = (np.asarray(v) for v in fns[x.sharding](x))
        for j in np.flatnonzero(spread > COPY_RTOL * np.maximum(scale, np.finfo(np.float32).tiny)):
            bad.append(f"{name} {src.paths[j]}: copies differ by {spread[j]:.3g} (largest value {scale[j]:.3g})")
    if bad:
        raise CheckpointError(f"{where}: the copies of replicated parameters disagree, so it cannot be converted "
                              f"to another layout ({'; '.join(bad[:6])}" + (f"; ... {len(bad)} in all" if len(bad) > 6
                                                                           else "") + ")")


def converter(src: Any, dst: Any, sharding: Any) -> Callable[[jax.Array], jax.Array]:
    """x -> the flat vector x laid out as `src` (its first `src.padded` elements) as `dst` lays it
    out, placed with `sharding`: `dst.ravel(src.unravel(x))`, one jitted program (each device
    computes its part; the tails past P are zero)."""
    return jax.jit(lambda v: dst.ravel(src.unravel(v[:src.padded]), v.dtype), out_shardings=sharding)


def convert(x: jax.Array, src: Any, dst: Any, sharding: Any) -> jax.Array:
    """`converter(src, dst, sharding)(x)`."""
    return converter(src, dst, sharding)(x)
