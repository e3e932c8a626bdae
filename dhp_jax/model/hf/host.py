"""The host-side arrays of one processor output (NumPy only: the torch backend and the data path
build `Sample`s with them without jax): token ids, rotary positions, and per modality the
encoder's patches and per-patch ids. Each family's are its `hf_config.prepare`
(`dhp_jax.models.<family>`); `prepare(config, inputs)` asks the family's."""

from __future__ import annotations

from typing import Any, Mapping

from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.families import hf_module


def prepare(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The host-side arrays of one sample of `cfg`'s family."""
    return hf_module(cfg.family).prepare(cfg, inputs)
