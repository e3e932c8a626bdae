"""Model families: one folder each (`dhp_jax/models/<family>/`), described by one `FamilySpec`
registered once. The data path, the cost model, the demo and the engines ask the spec of a name
(`spec(name)`, `spec_for_type(model_type)`) and never branch on the name itself.

A family folder's files are split by layer (`tests/test_layering.py` classifies them by name):

- `spec.py` and every other file without a prefix: pure Python and NumPy, at the bottom of the
  import arrows (the `data` layer): the config reader's rows and layout resolution, the processor,
  the chat tokens, the memory terms, the tiny configs. `spec.py` registers the `FamilySpec`.
- `hf_*.py`: the model layer without jax (config parsing into `HFConfig`, host-side tables, the
  tensor-parallel table of its encoder blocks), read by both engines;
- `jax_*.py`: the model layer with jax (the family's layers and forward);
- `torch_*.py`: the torch backend's side (imported only by `npu_backend`).

The spec names its engine modules as import strings (`jax_module`, `torch_module`, `hf_module`),
which each engine imports on first use (`engine_module`), so the spec itself never imports jax or
torch. A family outside the package registers the same way: a module that calls `register` (or
defines `SPEC`), imported by name with `load` (`dhp train model.family_module=...`).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any, Callable, Mapping

# The families of the package: the module that registers each (one line a family).
BUILTIN = (
    "dhp_jax.models.qwen2_5_vl.spec",
    "dhp_jax.models.qwen3_vl.spec",
    "dhp_jax.models.internvl.spec",
    "dhp_jax.models.qwen3_vl_moe.spec",
)


@dataclasses.dataclass(frozen=True)
class ConfigRules:
    """How the family's config.json is read (`dhp_jax.data.hf_config.resolve`).

    `fields`: {model_type: {field: transformers' default}} for every config class the family reads
    (its top level, its LLMs, its vision encoder); `text_types`: the text model types its LLM may be
    (the first is the one a text_config without model_type is); `vision_type`: its vision_config's;
    `vision_aliases`: older vision model types renamed on load; `tie_text`: the LM head is also tied
    when text_config says so; `nest(config)`: the nested layout of a config of this family (a flat
    one moved into text_config; the nested one as is); `layouts`: {other model_type: converter to
    this family's nested layout} (e.g. a vendor's own checkpoint layout); `text_section(config)`:
    the prefix the LLM's fields get in errors ("text_config.", "" for a flat file); `text_kinds`:
    {text model type: (q/k/v bias, QK-norm, rotary kind "plain" | "mrope_sections" |
    "mrope_interleaved")} of its LLMs (where the config class has an `attention_bias` field, that
    field decides the bias)."""

    fields: Mapping[str, Mapping[str, Any]]
    text_types: tuple[str, ...]
    vision_type: str
    vision_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tie_text: bool = False
    nest: Callable[[dict], dict] | None = None
    layouts: Mapping[str, Callable[[dict], dict]] = dataclasses.field(default_factory=dict)
    text_section: Callable[[Mapping[str, Any]], str] = lambda config: "text_config."
    text_kinds: Mapping[str, tuple[bool, bool, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ExampleFiles:
    """`processor_class`, chat `template`, image / video processor configs and processor extras of
    the tiny example; the tokenizer's `specials` and the `tokenizer` config entries naming them;
    `token_names`: the placeholders `tiny_config` takes ids of; `published_extra`: the processor
    extras the released models' files imply; `accepts_image_seq_length`: the processor takes a
    tokens-per-tile setting."""

    processor_class: str
    template: str
    image: dict[str, Any]
    video: dict[str, Any]
    extra: dict[str, Any]
    specials: list[str]
    tokenizer: dict[str, str]
    token_names: dict[str, str]
    published_extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    accepts_image_seq_length: bool = False    # `write_processor_files(image_seq_length=)` applies


@dataclasses.dataclass(frozen=True)
class MemoryTerms:
    """Per-row terms of a family's group program that differ by family (`planner.cost.memory`):
    `encoder_cotangents`: (MLP-wide, block-wide) cotangents an encoder block's backward pass holds;
    `cls_rows`: encoder rows a LLM token has beyond its patches (a tile's CLS token);
    `position_axes`: rotary position axes of the LLM stream; `llm_qk_norm`: the LLM normalises q
    and k; `encoder_saved(m, v, w, ff)`: elements an encoder block keeps per row without recompute;
    `tail(m, rows, v, wide, mid, levels)`: (elements, mask bytes) per LLM token outside the scans
    beyond the common ones; `psum_buffers`: [rows, hidden] all-reduce buffers an encoder block's
    backward pass holds at its peak on a rank of t > 1 devices in the psum form
    (`planner.cost.memory.family_collective_buffers`)."""

    encoder_cotangents: tuple[int, int]
    cls_rows: int
    position_axes: int
    llm_qk_norm: bool
    encoder_saved: Any
    tail: Any
    psum_buffers: int = 0


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """Everything that is one model family's, as hooks (see the module docstring).

    Data layer: `config` (`ConfigRules`); `facts(raw, d, where)` -> the vision part of the planner's
    `ModelFacts` of a resolved config; `processor` (an object with the family's image and video
    rules, `dhp_jax.data.processors.VisionProcessor` delegates to it); `processor_names`: prefixes
    of model types and processor classes that name the family (`processors.family_of`); `chat`
    (placeholder tokens and their expansion, `dhp_jax.data.chat.ChatTokenizer`); `example` (the
    tiny example's tokenizer and processor files, `dhp_jax.data.example`); `vision_rule`: the
    planner's vision-rule name of the family's published processor, and `published_model` the
    stored model (`dhp_jax/data/models/<name>/`) that stands for it; `name_prefixes`: how the
    names of its models begin ("internvl3-8b"), for a name that is no stored model;
    `router_aux_loss`: the family's transformers model adds its routers' load-balancing loss to
    the loss when config.json sets `output_router_logits` (a mixture of experts); `memory` (the
    family program's per-row terms, `dhp_jax.planner.cost.memory`); `tiny_config(token_ids,
    vocab_size, text)` -> a tiny config.json; `demo` (the `dhp train` demo's model and synthetic
    inputs).

    Engines (import strings, imported on first use): `hf_module` (model layer, NumPy only: parse,
    renames, host arrays, packed rows, weight shapes, the JAX tensor-parallel table),
    `jax_module` (the JAX forward), `torch_module` (the torch backend's encoder and split)."""

    name: str
    model_types: tuple[str, ...]
    config: ConfigRules
    facts: Callable[..., dict]
    processor: Any
    processor_names: tuple[str, ...]
    chat: Any
    example: Any
    vision_rule: str
    published_model: str
    memory: Any
    tiny_config: Callable[..., dict]
    demo: Any
    name_prefixes: tuple[str, ...] = ()
    router_aux_loss: bool = False
    hf_module: str = ""
    jax_module: str = ""
    torch_module: str = ""

    def engine_module(self, which: str) -> ModuleType:
        """The family's module of one engine side ("hf", "jax", "torch"), imported now."""
        path = getattr(self, f"{which}_module")
        if not path:
            raise ValueError(f"model family {self.name!r} has no {which} module")
        return importlib.import_module(path)


_REGISTRY: dict[str, FamilySpec] = {}
_LOADED = False


def register(family: FamilySpec) -> FamilySpec:
    """Register `family` (once per name; the same object again is a no-op)."""
    old = _REGISTRY.get(family.name)
    if old is not None and old is not family:
        raise ValueError(f"model family {family.name!r} is already registered")
    _REGISTRY[family.name] = family
    return family


def _builtins() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for module in BUILTIN:
            importlib.import_module(module)


def load(module: str) -> list[str]:
    """Import `module` (a dotted name on sys.path) that registers one or more families; a module that
    defines `SPEC` without registering it is registered here. Returns the names it added."""
    _builtins()
    before = set(_REGISTRY)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"family module {module!r} cannot be imported: {e}") from None
    if isinstance(getattr(mod, "SPEC", None), FamilySpec):
        register(mod.SPEC)
    added = sorted(set(_REGISTRY) - before)
    if not added and not isinstance(getattr(mod, "SPEC", None), FamilySpec):
        raise ValueError(f"family module {module!r} registers no model family (call dhp_jax.models.register "
                         f"or define SPEC)")
    return added


def names() -> tuple[str, ...]:
    """The registered families' names, in registration order."""
    _builtins()
    return tuple(_REGISTRY)


def specs() -> tuple[FamilySpec, ...]:
    _builtins()
    return tuple(_REGISTRY.values())


def spec(name: str) -> FamilySpec:
    """The spec of a family name; an unknown name is an error that lists the known ones."""
    _builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(_REGISTRY)}") from None


def spec_for_type(model_type: str) -> FamilySpec | None:
    """The family that reads a config.json of `model_type` (its own or another layout it converts)."""
    for s in specs():
        if model_type in s.model_types or model_type in s.config.layouts:
            return s
    return None


def fields() -> dict[str, dict[str, Any]]:
    """{model_type: {field: default}} of every registered family's config classes."""
    out: dict[str, dict[str, Any]] = {}
    for s in specs():
        for k, v in s.config.fields.items():
            out.setdefault(k, dict(v))
    return out


def text_kinds() -> dict[str, tuple[bool, bool, str]]:
    """{text model type: (q/k/v bias, QK-norm, rotary kind)} of every registered family's LLMs."""
    out: dict[str, tuple[bool, bool, str]] = {}
    for s in specs():
        for k, v in s.config.text_kinds.items():
            out.setdefault(k, tuple(v))
    return out
