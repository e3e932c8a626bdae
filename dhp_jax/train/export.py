"""`dhp export RUN_DIR OUT_DIR [--step N]`: a fine-tuning run's checkpoint as a Hugging Face
checkpoint: the trained fp32 master params as safetensors with the source checkpoint's config.json
(`hf.save_pretrained`), and the source's processor, tokenizer and chat-template files copied
beside them, so that transformers' `from_pretrained` (and `dhp train model.pretrained=OUT_DIR`)
loads it.

jax, orbax and the model are imported inside `run`, so `dhp export --help` stays quick."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# files of a checkpoint directory that hold the weights or the model config: written anew, not copied
_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")


class ExportError(ValueError):
    """The run directory cannot be exported; the message says why."""


def _checkpoint_dir(run_dir: Path) -> Path:
    for d in (run_dir / "checkpoints", run_dir):
        if d.is_dir() and any(p.name.isdigit() for p in d.iterdir()):
            return d
    raise ExportError(f"{str(run_dir)!r} holds no checkpoint (neither it nor its checkpoints/ has a step directory)")


def export(run_dir: str, out_dir: str, step: int | None = None) -> tuple[int, str]:
    """Write the Hugging Face checkpoint of `run_dir`'s latest (or `step`) checkpoint into
    `out_dir`; returns (step, source checkpoint)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from dhp_jax.model import hf
    from dhp_jax.sharding.flat import FlatLayout
    from dhp_jax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(_checkpoint_dir(Path(run_dir)))
    try:
        step = ckpt.latest_step() if step is None else int(step)
        if step is None or step not in ckpt._manager.all_steps():
            raise ExportError(f"{str(ckpt.directory)!r}: no checkpoint of step {step} "
                              f"(steps there: {sorted(ckpt._manager.all_steps())})")
        meta = ckpt.read_meta(step)
        run = meta.get("run_config", {})
        source = ((run.get("model") or {}) if isinstance(run.get("model"), dict) else {}).get("pretrained")
        if not source:
            raise ExportError(f"checkpoint step {step} is of a run of the stand-in model (model.preset), not of a "
                              "Hugging Face checkpoint: there is nothing to export")
        if not os.path.isdir(source):
            raise ExportError(f"the run fine-tuned {source!r}, which is no longer there: its config.json and "
                              "processor files are needed")
        config, template = hf.load_pretrained(source)
        layout = FlatLayout.of(template, int(run.get("num_ranks", 1)))   # the run's master vector layout
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = {"params": jax.ShapeDtypeStruct((layout.padded,), np.float32, sharding=cpu)}
        try:
            restored = ckpt._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, restore_args={"params": ocp.ArrayRestoreArgs(sharding=cpu)}, partial_restore=True)))
        except Exception as e:
            raise ExportError(f"checkpoint step {step} in {str(ckpt.directory)!r}: its params are not those of "
                              f"{source!r} laid out over {run.get('num_ranks')} ranks "
                              f"({type(e).__name__}: {str(e)[:300]})") from None
        flat = np.asarray(restored["state"]["params"])
    finally:
        ckpt.close()
    params = jax.tree.map(np.asarray, layout.unravel(flat))
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and name not in _WEIGHT_FILES and not name.endswith(".safetensors"):
            shutil.copy2(path, os.path.join(out_dir, name))
    hf.save_pretrained(config, params, out_dir)
    return step, source


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a fine-tuning run's directory (metrics.out_dir)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the Hugging Face checkpoint")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")


def run(args: argparse.Namespace) -> int:
    from dhp_jax.train.checkpoint import CheckpointError

    try:
        step, source = export(args.run_dir, args.out_dir, args.step)
    except (ExportError, CheckpointError) as e:
        print(f"dhp export: {e}", file=sys.stderr)
        return 2
    print(f"dhp export: step {step} of {args.run_dir} (fine-tuned from {source}) -> {args.out_dir}")
    return 0
