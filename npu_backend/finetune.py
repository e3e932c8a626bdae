"""The torch backend continues a JAX fine-tuning run (`dhp train model.pretrained=DIR data.manifest=FILE`)
from one of its checkpoints, without jax: the same family model, the same data, the next batch.

`FamilyRun.load(path)` reads the checkpoint's fp32 master params (`weights.load_jax_checkpoint`:
the flat vector cut by the checkpoint's layout record), names them as transformers does
(`dhp_jax.model.hf.checkpoint.weights_from_tree`, the family's conv shapes), checks every name
and shape against the source checkpoint's safetensors headers (its config.json gives the
`HFConfig`), and builds the `TorchFamilyModel`. `FamilyRun.batches()` yields the run's batches
from the checkpoint's loader state on: the run's data (`data.manifest` / `webdataset` /
`hf_dataset`) planned and decoded by the project's NumPy data path (`dhp_jax.data.finetune`,
`dhp_jax.data.loader`: same records, same seeded order, same processor output) and turned into
family `Sample`s (`dhp_jax.model.hf.sample.samples_from_items`). So the first torch step's loss is
the loss the JAX run's next step would have had. The optimizer starts afresh (the Adam moments are
not read).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from dhp_jax.data.sample import Sample
from dhp_jax.model.mllm_config import run_model_section
from dhp_jax.model.hf import safetensors_io
from dhp_jax.model.hf.checkpoint import rename, weights_from_tree
from dhp_jax.model.hf.config import HFConfig, read_config_json
from dhp_jax.model.hf.families import family, parse_config
from npu_backend.hf import LM_HEAD, TorchFamilyModel
from npu_backend.weights import JaxCheckpoint, WeightsError, load_jax_checkpoint


def load_run_family(meta: dict, where: str) -> None:
    """Register the family module a run named (`model.family_module`: a family registered outside
    the package), as `dhp train` did, so its checkpoint's family is known here; `WeightsError`
    naming the module when it cannot be imported (it must be on this process's sys.path too)."""
    module = run_model_section(meta).get("family_module")
    if module:
        from dhp_jax import models

        try:
            models.load(module)
        except ValueError as e:
            raise WeightsError(f"{where}: the run's model.family_module: {e}") from None


def pretrained_source(meta: dict) -> str | None:
    """The checkpoint directory a run fine-tuned (`model.pretrained`), None for a stand-in run."""
    return run_model_section(meta).get("pretrained")


def family_weights(ck: JaxCheckpoint, config: HFConfig, source: str) -> dict[str, np.ndarray]:
    """{transformers name: float32 array} of the checkpoint's params; `WeightsError` listing every
    name missing, extra or misshapen against `source`'s safetensors headers."""
    weights = weights_from_tree(ck.params, family(config.family).conv_shapes(config))
    want = {}
    for file in safetensors_io.checkpoint_files(source):
        for name, _, shape, _ in safetensors_io.tensor_infos(file):
            name = rename(name, family(config.family).renames)
            if not (config.tied and name == LM_HEAD):
                want[name] = tuple(shape)
    problems = ([f"missing {k}" for k in sorted(set(want) - set(weights))]
                + [f"unexpected {k}" for k in sorted(set(weights) - set(want))]
                + [f"{k}: {tuple(weights[k].shape)} vs {want[k]}" for k in sorted(set(want) & set(weights))
                   if tuple(weights[k].shape) != want[k]])
    if problems:
        raise WeightsError(f"{str(ck.path)!r} does not hold the params of {source!r}: " + "; ".join(problems[:8])
                           + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else ""))
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}


@dataclasses.dataclass
class FamilyRun:
    """A JAX fine-tuning run's checkpoint as the torch backend starts from it."""

    checkpoint: JaxCheckpoint
    source: str               # the Hugging Face checkpoint the run fine-tuned (config, processor files)
    config: HFConfig
    model: TorchFamilyModel

    @classmethod
    def load(cls, path: str | Path, step: int | None = None) -> "FamilyRun":
        """The checkpoint of a run directory, its checkpoints/ or a step directory (latest step unless
        `step`); `WeightsError` when it is not of a fine-tuning run or its params do not fit."""
        return cls.of(load_jax_checkpoint(path, step))

    @classmethod
    def of(cls, ck: JaxCheckpoint) -> "FamilyRun":
        """The run of an already read checkpoint (see `load`)."""
        source = pretrained_source(ck.meta)
        if not source:
            raise WeightsError(f"{str(ck.path)!r} is of a run of the stand-in model (no model.pretrained): "
                               "start from it with --mllm")
        if not os.path.isdir(source):
            raise WeightsError(f"{str(ck.path)!r}: the run fine-tuned {source!r}, which is not there (its "
                               "config.json and processor files are needed)")
        load_run_family(ck.meta, repr(str(ck.path)))
        config = parse_config(read_config_json(source))
        weights = family_weights(ck, config, source)
        return cls(ck, source, config, TorchFamilyModel(config, {k: torch.from_numpy(v) for k, v in weights.items()}))

    @property
    def data_config(self) -> dict:
        return dict((self.checkpoint.meta.get("run_config") or {}).get("data") or {})

    def batches(self) -> Iterator[tuple[list[str], list[Sample]]]:
        """The run's batches from the checkpoint's next one on: (the records' ids, as the JAX run's
        `sample_ids` name them; their family Samples), forever, epoch after epoch, each epoch
        reshuffled by the run's seed, as the JAX run would have taken them."""
        from dhp_jax.data.finetune import FinetuneData
        from dhp_jax.data.loader import Loader
        from dhp_jax.data.sources import iter_source, source_spec
        from dhp_jax.model.hf.sample import samples_from_items

        state = self.checkpoint.meta.get("loader")
        if not state:
            raise WeightsError(f"{str(self.checkpoint.path)!r} holds no loader state (not a fine-tuning run's "
                               "checkpoint of this dhp_jax)")
        d = self.data_config
        spec, kind = source_spec(d)
        on_error = d.get("on_error", "skip")
        data = FinetuneData(self.source, family=self.config.family)
        planned = list(data.scan(iter_source(spec, kind), on_error=on_error))
        if not planned:
            raise WeightsError(f"{spec}: no usable record")
        loader = Loader(data, planned, int(d["batch_size"]), seed=int(state["seed"]), workers=int(d.get("workers", 2)),
                        prefetch=int(d.get("prefetch", 4)), on_error=on_error)
        if int(state["epoch"]) * loader.batches_per_epoch() + int(state["position"]) != self.checkpoint.data_position:
            raise WeightsError(f"{spec}: the checkpoint's loader state {state} is not step "
                               f"{self.checkpoint.data_position}'s with this data ({len(planned)} usable records, "
                               f"batches of {d['batch_size']}): the data changed since the run")
        loader.load_state_dict(state)
        it = iter(loader)
        try:
            for items in it:
                yield [it["sample_id"] for it in items], samples_from_items(self.config, items)
        finally:
            it.close()


def describe(run: FamilyRun) -> dict[str, Any]:
    """What the torch run started from (for its JSON record)."""
    return {"path": str(run.checkpoint.path), "step": run.checkpoint.step, "pretrained": run.source,
            "family": run.config.family, "data": run.data_config}
