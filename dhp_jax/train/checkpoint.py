"""orbax checkpoints of the whole train state plus the data-loader position, written atomically.

Each checkpoint holds two items: `state` (the `TrainState` pytree, restored straight into its
sharding; the trainer's state is sharded over the full mesh, so each process writes and reads only
the shards it holds) and `meta` (JSON: the next data position, the model config, the run config, and
the trainer's record of the programs its plans used, so a resumed run plans alike). orbax writes
into a temporary directory and renames it when complete, so a crash never leaves a half checkpoint
that `latest` would pick. Before any array is read, `meta` is checked against the model config of
the run: resuming a different model is a clear error, not a shape mismatch deep inside orbax.

`meta["layout"]` (`FlatLayout.record`) says how the flat state vectors are laid out: the leaves in
order, the P parameters and the padding to a multiple of the rank count that wrote it. A run on
another number of ranks pads differently; `restore` reads the same P parameters into the new
padded length (the tail past P is zero, so cutting or extending it changes no value) and the new
sharding. Leaves that differ are named.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from dhp_jax.model.config import RUN_ONLY_MODEL_FIELDS


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
                layout: Mapping[str, Any] | None = None) -> Restored:
        """Restore into the shardings of `abstract_state` (a state or its `jax.ShapeDtypeStruct`s).

        `layout`: this run's `FlatLayout.record`; with one stored in the checkpoint too, flat
        vectors padded for another rank count are re-padded to this run's length."""
        step = self.latest_step() if step is None else step
        meta = self.check_compatible(model_config, step)
        repad = check_layout(meta.get("layout"), layout, f"checkpoint in {str(self.directory)!r} "
                                                          f"(step {meta.get('step')})")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_state)
        try:   # strict=False: orbax cuts or zero-extends an array to the target's shape (the padding only)
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target, strict=not repad)))
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {str(self.directory)!r} does not match this "
                                  f"run's train state: {type(e).__name__}: {e}") from None
        return Restored(state=out["state"], step=int(meta["step"]), data_position=int(meta["data_position"]),
                        meta=meta)

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


def check_layout(saved: Mapping[str, Any] | None, mine: Mapping[str, Any] | None, where: str) -> bool:
    """Whether the flat vectors need re-padding (same parameters, another rank count's padding);
    `CheckpointError` naming the first differing leaves when the parameters differ. Nothing to
    check (False) when either side has no layout record (a checkpoint of an older dhp_jax)."""
    if not saved or not mine:
        return False
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
    tp = (int(saved.get("tensor_parallel", 1)), int(mine.get("tensor_parallel", 1)))
    if max(tp) > 1 and (tp[0] != tp[1] or int(saved["padded"]) != int(mine["padded"])):
        # a tensor-parallel state holds each device's share (dhp_jax.sharding.tensor.TensorLayout):
        # another t or rank count is another interleaving, not another padding
        raise CheckpointError(f"{where} was written with tensor_parallel={tp[0]} on {saved['num_shards']} "
                              f"devices; this run has tensor_parallel={tp[1]} on {mine['num_shards']}: a "
                              "tensor-parallel state restores only with the same t and device count")
    return int(saved["padded"]) != int(mine["padded"])
