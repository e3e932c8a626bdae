"""`toy_vl`: a model family registered from outside the package, as a new family registers.

Its config.json has its own `model_type` ("toy_vl") and vision model type ("toy_vl_vision"); its
hooks are Qwen2.5-VL's (the same math, processor and memory terms), so the toy checks that the
data path, the cost model, the demo and both engines reach a family only through its `FamilySpec`,
never by a built-in name. A run imports it with `model.family_module=toy_family.spec` (this folder's
parent, `tests/`, on PYTHONPATH).
"""

from __future__ import annotations

import dataclasses

from dhp_jax import models
from dhp_jax.models.qwen2_5_vl import spec as base

NAME, VISION = "toy_vl", "toy_vl_vision"
FIELDS = {base.TEXT: base.FIELDS[base.TEXT], VISION: base.FIELDS[base.VISION], NAME: base.FIELDS[base.NAME]}


def tiny_config(token_ids, vocab_size, text):
    raw = base.tiny_config(token_ids, vocab_size, text)
    raw.update(model_type=NAME, architectures=["ToyVLForConditionalGeneration"])
    raw["vision_config"]["model_type"] = VISION
    return raw


SPEC = models.register(dataclasses.replace(
    base.SPEC, name=NAME, model_types=(NAME,), processor_names=(NAME,), name_prefixes=("toy",), vision_rule="toy-vl",
    config=models.ConfigRules(FIELDS, (base.TEXT,), VISION, {NAME: VISION}, tie_text=True, nest=base.nest),
    tiny_config=tiny_config, hf_module="toy_family.hf_config"))
