"""`dhp export RUN_DIR OUT_DIR [--step N] [--overwrite]`: a fine-tuning run's checkpoint as a Hugging
Face checkpoint: the trained fp32 master params as safetensors with the source checkpoint's
config.json (`hf.save_pretrained`), and the source's processor, tokenizer and chat-template files
copied beside them, so that transformers' `from_pretrained` (and `dhp train model.pretrained=OUT_DIR`)
loads it. Only the run's params vector is read (the source's weights never are: its headers give
the layout), and OUT_DIR appears complete or not at all (written beside it, then renamed).

jax, orbax and the model are imported inside `run`, so `dhp export --help` stays quick."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
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


def export(run_dir: str, out_dir: str, step: int | None = None, overwrite: bool = False) -> tuple[int, str]:
    """Write the Hugging Face checkpoint of `run_dir`'s latest (or `step`) checkpoint into
    `out_dir`; returns (step, source checkpoint).

    The source checkpoint's weights are never read: its config.json and safetensors headers give
    the parameter tree (`stream.checkpoint_sources`), whose flat layout must be the one the run
    stored (`meta["layout"]`); only the run's params vector is read. The output is written into a
    temporary directory beside `out_dir` and renamed into place once complete, so a failure leaves
    `out_dir` as it was. An existing non-empty `out_dir` is an error unless `overwrite`."""
    import jax
    import numpy as np

    from dhp_jax.model import hf
    from dhp_jax.model.mllm_config import run_model_section
    from dhp_jax.model.hf.stream import abstract_params, checkpoint_sources
    from dhp_jax.sharding.flat import FlatLayout
    from dhp_jax.train.checkpoint import Checkpointer, check_layout

    out = Path(os.path.abspath(out_dir))
    _check_target(out, overwrite)
    ckpt = Checkpointer(_checkpoint_dir(Path(run_dir)))
    try:
        step = ckpt.latest_step() if step is None else int(step)
        if step is None or step not in ckpt.all_steps():
            raise ExportError(f"{str(ckpt.directory)!r}: no checkpoint of step {step} "
                              f"(steps there: {ckpt.all_steps()})")
        meta = ckpt.read_meta(step)
        run = meta.get("run_config", {})
        model = run_model_section(meta)
        source = model.get("pretrained")
        if not source:
            raise ExportError(f"checkpoint step {step} is of a run of model.preset={model.get('preset')!r} "
                              "(no model.pretrained): "
                              "only a run fine-tuning a Hugging Face checkpoint directory can be exported")
        if not os.path.isdir(source):
            raise ExportError(f"the run fine-tuned {source!r}, which is no longer there: its config.json and "
                              "processor files are needed")
        config, sources = checkpoint_sources(source)           # headers only: no weight is read
        saved = meta.get("layout")
        shards = int(saved["num_shards"]) if saved else int(run.get("num_ranks", 1))
        layout = FlatLayout.of(abstract_params(sources), shards)     # the run's master vector layout
        check_layout(saved, layout.record(), f"checkpoint step {step} in {str(ckpt.directory)!r} (vs {source!r})")
        flat = ckpt.restore_params(step, layout.padded)
    finally:
        ckpt.close()
    params = jax.tree.map(np.asarray, layout.unravel(flat))

    def write(tmp: str) -> None:
        for name in os.listdir(source):
            path = os.path.join(source, name)
            if os.path.isfile(path) and name not in _WEIGHT_FILES and not name.endswith(".safetensors"):
                shutil.copy2(path, os.path.join(tmp, name))
        hf.save_pretrained(config, params, tmp)

    write_atomically(out, write)
    return step, source


def _check_target(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{str(out)!r} exists and is not empty: give another directory, or --overwrite to "
                          "replace its content")


def write_atomically(out: Path, write) -> None:
    """`write(tmp)` fills a fresh directory beside `out`, which then takes the place of `out` (an
    existing `out` is moved aside first and deleted last). A failure inside `write` removes the
    temporary directory and leaves `out` untouched."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent)
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        if out.is_dir() and any(out.iterdir()):
            old = tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent)
            os.rename(out, os.path.join(old, "content"))
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)     # over an empty directory too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a fine-tuning run's directory (metrics.out_dir)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the Hugging Face checkpoint")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the content of a non-empty OUT_DIR (once the new checkpoint is complete)")


def run(args: argparse.Namespace) -> int:
    from dhp_jax.train.checkpoint import CheckpointError

    try:
        step, source = export(args.run_dir, args.out_dir, args.step, args.overwrite)
    except (ExportError, CheckpointError) as e:
        print(f"dhp export: {e}", file=sys.stderr)
        return 2
    print(f"dhp export: step {step} of {args.run_dir} (fine-tuned from {source}) -> {args.out_dir}")
    return 0
