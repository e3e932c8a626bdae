"""Typed training configs: nested dataclasses loaded from YAML, with dotted `key=value` overrides.

A train YAML has top-level `kind: train`; every other key must name a field below, so a typo is
an error that names the key and lists the valid ones instead of being silently ignored.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from dhp_jax.typed_config import ConfigError, apply as _apply, parse_override, read_yaml
from dhp_jax.typed_config import valid_keys as _valid_keys

__all__ = ["ConfigError", "TrainConfig", "apply_overrides", "config_from_dict", "load_config", "parse_override",
           "valid_keys"]

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "demo.yaml"   # package data: installed with dhp_jax


@dataclasses.dataclass
class DevicesConfig:
    platform: str = "cpu"          # "cpu" forces `count` fake host devices before jax is imported
    count: int = 8                 # devices the run needs (cpu: how many fake devices to create)


@dataclasses.dataclass
class ModelConfig:
    SCALAR_KEY = "preset"          # `model=tiny` (a string) sets model.preset
    preset: str = "tiny"           # no checkpoint given: "tiny" (the stand-in model) or a tiny random model of a
                                   # family on synthetic samples in its input format (dhp_jax.train.demo_models):
                                   # "tiny-<family>" of any registered family ("tiny-qwen2_5_vl", ...)
    pretrained: str | None = None  # a Hugging Face checkpoint directory of a supported family: fine-tune it
                                   # (config.json + safetensors + its processor and tokenizer files)
    family_module: str | None = None  # a module (dotted name on sys.path) that registers a model family
                                   # outside the package (dhp_jax.models.register), imported before the model
    router_aux_loss_coef: float | None = None  # a mixture-of-experts model: the router's load-balancing loss over the
                                   # global batch added with this weight (overriding config.json's); null: as
                                   # transformers, off unless config.json sets output_router_logits


@dataclasses.dataclass
class ParallelConfig:
    tensor: int = 1                # devices per rank (Megatron-style tensor parallelism inside a node); num_ranks
                                   # counts ranks, so a run needs num_ranks x tensor devices
    sequence: bool = False         # with tensor > 1: the block stacks sequence-parallel over a rank's devices


@dataclasses.dataclass
class DataConfig:
    dataset: str = "openvid"       # a `make_dataset` name (or a manifest path)
    # fine-tuning data (with model.pretrained; exactly one): a LLaVA-style JSONL, webdataset tar
    # shards (a path or glob), a local `datasets` directory or parquet file(s)
    manifest: str | None = None
    webdataset: str | None = None
    hf_dataset: str | None = None
    on_error: str = "skip"         # bad records: skip (counted in the summary, listed in data_issues.tsv) | fail
    video_fps: float | None = None  # fine-tuning videos sampled at this rate (None with video_frames None: "auto",
    video_frames: int | None = None  # dhp_jax.data.vision); or this many frames each; as dhp plan's --video-fps
    workers: int = 2               # fine-tuning loader threads that decode ahead
    prefetch: int = 4              # batches decoded ahead at most
    batch_size: int = 16           # samples per global batch
    token_scale: float = 1.0 / 64  # real token counts are scaled by this to fit the tiny model
    max_tokens: int = 384          # longest sample after scaling (longer ones are truncated)
    min_text_tokens: int = 6       # every sample keeps at least this many caption tokens
    num_classes: int = 16          # distinct visual "concepts" whose captions the model must learn
    noise: float = 0.5             # pixel noise around each concept's prototype
    seed: int = 0


@dataclasses.dataclass
class OptimConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 4
    end_lr_ratio: float = 0.1      # cosine decays to learning_rate * end_lr_ratio
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0


@dataclasses.dataclass
class PlannerConfig:
    strategy: str = "dhp"          # any `plan_batch` strategy: dhp, static-ring:best, static-ring:4 ...
    plan_file: str | None = None   # replay plans (.json: one plan or {"plans": [...]}; .jsonl: one a step)
    cost_model: str | None = None  # CostModel preset used for planning when no profile is given (None:
                                   # internvl3-2b, or with model.pretrained the checkpoint's config.json)
    hardware: str = "cpu"
    cost_profile: str | None = None   # JSON written by `dhp profile`; overrides the preset
    ranks_per_node: int | None = None  # preset only: ranks sharing a node's fast links (None: all ranks)
    comm_overlap: bool | None = None  # preset only: ring traffic hides behind attention (None: the hardware's)
    full_size: bool = False        # plan the unscaled batch (the token counts a preset describes); the
                                   # executor runs the scaled samples in the same groups
    num_micro_batches: int | None = None  # fixes the count of the strategies that choose one (not the static ones)
    lookahead: int = 2             # batches planned ahead by the planner thread (queue bound); their
                                   # programs compile in the background as soon as they are planned
    compile_price_s: float = 3.0   # planner seconds charged for each group program no earlier step's plan
                                   # needed (a fixed figure, never a live measurement: plans must not
                                   # depend on timing); 0: programs are free


@dataclasses.dataclass
class CheckpointConfig:
    dir: str | None = None         # None: <metrics.out_dir>/checkpoints
    every: int = 0                 # save every K steps (0: only at the end)
    keep: int = 2


@dataclasses.dataclass
class MetricsConfig:
    out_dir: str = "runs/demo"
    progress: bool = True
    tensorboard: bool = False      # needs tensorboardX
    log_plans: bool = True         # write plans.jsonl (replayable with planner.plan_file)


@dataclasses.dataclass
class CompareConfig:
    enabled: bool = True           # the simulated comparison at scale (and its Gantt PNG) after the run
    measured: bool = False         # also time DHP and the static plans on these devices (opt-in: on fake CPU
                                   # devices that share the host's cores it is an overhead check, not a speed-up)
    static_strategy: str = "static-ring:best"  # the static baseline measured on these devices
    batches: int = 3               # batches timed with both plans after training
    repeats: int = 3               # timed repeats per batch and plan (median)
    sim_model: str = "internvl3-8b"  # preset for the simulated speed-up on the unscaled batches
    sim_hardware: str = "ascend-910b"
    sim_ranks: int | None = None   # None: the run's num_ranks
    sim_batch_size: int | None = None  # samples per simulated batch, drawn from the run's mix (None: the run's batches)
    sim_ranks_per_node: int = 8    # the simulated cluster's ranks per node


@dataclasses.dataclass
class TrainConfig:
    kind: str = "train"
    name: str = "demo"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    compute_dtype: str = "float32"  # the groups' compute dtype: float32 (exact) | bfloat16; master + Adam fp32
    remat: str = "none"            # recompute in backward: none | layer | selective (MLLMConfig.remat)
    num_ranks: int = 8
    min_bucket: int | None = None  # smallest padded group length (None: the executor's default)
    attention_tile: int | None = None  # ring attention tile, tokens (None: the executor's default, 512)
    compilation_cache: str | None = "auto"  # JAX persistent compilation cache: "auto" = <metrics.out_dir>/jax-cache,
                                   # a directory, or null (off)
    steps: int = 40
    seed: int = 0
    devices: DevicesConfig = dataclasses.field(default_factory=DevicesConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    compare: CompareConfig = dataclasses.field(default_factory=CompareConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "TrainConfig":
        if self.kind != "train":
            raise ConfigError(f"config kind is {self.kind!r}; `dhp train` runs configs with kind: train")
        positive = {"num_ranks": self.num_ranks, "devices.count": self.devices.count,
                    "data.batch_size": self.data.batch_size, "data.max_tokens": self.data.max_tokens,
                    "data.num_classes": self.data.num_classes, "planner.lookahead": self.planner.lookahead,
                    "checkpoint.keep": self.checkpoint.keep, "compare.sim_ranks_per_node": self.compare.sim_ranks_per_node}
        for key, v in {"planner.ranks_per_node": self.planner.ranks_per_node, "compare.sim_ranks": self.compare.sim_ranks,
                       "attention_tile": self.attention_tile,
                       "compare.sim_batch_size": self.compare.sim_batch_size}.items():
            if v is not None and v < 1:
                raise ConfigError(f"{key} must be >= 1 (or null), got {v}")
        for key, v in positive.items():
            if v < 1:
                raise ConfigError(f"{key} must be >= 1, got {v}")
        for key, v in {"steps": self.steps, "optim.warmup_steps": self.optim.warmup_steps,
                       "checkpoint.every": self.checkpoint.every,
                       "data.min_text_tokens": self.data.min_text_tokens}.items():
            if v < 0:
                raise ConfigError(f"{key} must be >= 0, got {v}")
        coef = self.model.router_aux_loss_coef
        if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf")):
            raise ConfigError(f"model.router_aux_loss_coef must be a number >= 0 (the load-balancing loss's weight; "
                              f"null: config.json's choice), got {coef!r}")
        if not self.planner.compile_price_s >= 0:
            raise ConfigError(f"planner.compile_price_s must be >= 0 (seconds), got {self.planner.compile_price_s}")
        if self.data.token_scale <= 0:
            raise ConfigError(f"data.token_scale must be > 0, got {self.data.token_scale}")
        if self.data.min_text_tokens + 1 > self.data.max_tokens:
            raise ConfigError(f"data.max_tokens={self.data.max_tokens} leaves no room for "
                              f"data.min_text_tokens={self.data.min_text_tokens} plus a vision token")
        if self.optim.learning_rate <= 0:
            raise ConfigError(f"optim.learning_rate must be > 0, got {self.optim.learning_rate}")
        if self.compare.enabled and self.compare.batches < 1:
            raise ConfigError(f"compare.batches must be >= 1 when the comparison runs, got {self.compare.batches} "
                              "(compare.enabled=false skips it)")
        if self.compare.repeats < 1:
            raise ConfigError(f"compare.repeats must be >= 1, got {self.compare.repeats}")
        sources = {k: v for k, v in (("data.manifest", self.data.manifest), ("data.webdataset", self.data.webdataset),
                                     ("data.hf_dataset", self.data.hf_dataset)) if v}
        if self.model.pretrained and len(sources) != 1:
            raise ConfigError(f"model.pretrained needs exactly one of data.manifest, data.webdataset, "
                              f"data.hf_dataset, got {sorted(sources) or 'none'}")
        if self.model.pretrained:
            from dhp_jax.data.hf_config import checkpoint_dir

            try:        # a Hub id in the local Hugging Face cache: its snapshot directory
                self.model.pretrained = checkpoint_dir(self.model.pretrained)
            except FileNotFoundError:
                pass    # reported (with the command that downloads it) where the checkpoint is loaded
        if sources and not self.model.pretrained:
            raise ConfigError(f"{next(iter(sources))} is fine-tuning data: it needs model.pretrained=CHECKPOINT_DIR "
                              f"(the stand-in model trains on data.dataset)")
        if self.data.video_fps is not None and not 0 < self.data.video_fps < float("inf"):
            raise ConfigError(f"data.video_fps must be > 0 frames per second (or null), got {self.data.video_fps}")
        if self.data.video_frames is not None and self.data.video_frames < 1:
            raise ConfigError(f"data.video_frames must be >= 1 (or null), got {self.data.video_frames}")
        if self.data.video_fps is not None and self.data.video_frames is not None:
            raise ConfigError("data.video_fps and data.video_frames: set one, not both")
        if self.data.on_error not in ("skip", "fail"):
            raise ConfigError(f"data.on_error must be skip or fail, got {self.data.on_error!r}")
        if self.data.workers < 1 or self.data.prefetch < 1:
            raise ConfigError(f"data.workers and data.prefetch must be >= 1, got {self.data.workers}, "
                              f"{self.data.prefetch}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.remat not in ("none", "layer", "selective"):
            raise ConfigError(f"remat must be none, layer or selective, got {self.remat!r}")
        if self.devices.platform not in ("cpu", "gpu", "tpu", "default"):
            raise ConfigError(f"devices.platform must be cpu, gpu, tpu or default, got {self.devices.platform!r}")
        if self.num_ranks > self.devices.count:
            raise ConfigError(f"num_ranks={self.num_ranks} needs {self.num_ranks} devices but "
                              f"devices.count={self.devices.count}")
        self._validate_tensor_parallel()
        return self

    def check_paths(self) -> "TrainConfig":
        """The input paths the config names, before anything else reads them: a path that does not
        exist, a directory where a file belongs (or the reverse), a checkpoint without config.json
        or whose config.json is not JSON. `ConfigError` naming the key, the path and the fix."""
        from dhp_jax.data.jsonl import JsonFileError, read_json_file

        def exists(key: str, value: str, what: str) -> Path:
            path = Path(value)
            if not path.exists():
                raise ConfigError(f"{key}={value!r}: {str(path.resolve())!r} does not exist; give {what}")
            return path

        def a_file(key: str, value: str, what: str) -> None:
            path = exists(key, value, what)
            if path.is_dir():
                inside = sorted(p.name for p in path.glob("*.jsonl"))[:3]
                raise ConfigError(f"{key}={value!r}: {str(path.resolve())!r} is a directory, expected a .jsonl file"
                                  + (f" (it holds {', '.join(inside)}: e.g. {key}={os.path.join(value, inside[0])})"
                                     if inside else f"; give {what}"))

        if self.model.pretrained:
            from dhp_jax.data.hf_config import checkpoint_dir

            key, value = "model.pretrained", self.model.pretrained
            what = "a checkpoint directory written by save_pretrained (the folder that holds config.json)"
            try:        # a path as it is; a Hub id: its snapshot in the local cache
                value = checkpoint_dir(value)
            except FileNotFoundError as e:
                raise ConfigError(f"{key}={value!r}: {e}") from None
            path = exists(key, value, what)
            if not path.is_dir():
                raise ConfigError(f"{key}={value!r}: {str(path.resolve())!r} is a file, expected {what}"
                                  + (f": {key}={path.parent}" if path.name == "config.json" else ""))
            config_json = path / "config.json"
            if not config_json.is_file():
                raise ConfigError(f"{key}={value!r}: {str(config_json.resolve())!r} does not exist: the directory is "
                                  f"not a checkpoint; give {what}")
            try:
                read_json_file(config_json, fix="copy or save the checkpoint again")
            except JsonFileError as e:
                raise ConfigError(f"{key}={value!r}: {e}") from None
        if self.data.manifest:
            a_file("data.manifest", self.data.manifest, "a LLaVA-style .jsonl manifest file")
        for key, value in (("data.webdataset", self.data.webdataset), ("data.hf_dataset", self.data.hf_dataset)):
            if value and not any(c in value for c in "*?[{"):      # a pattern is expanded where it is read
                exists(key, value, "the data's path or a glob pattern")
        if self.planner.plan_file:
            a_file("planner.plan_file", self.planner.plan_file, "a plan file (a run's plans.jsonl or a .json plan)")
        if not sources_given(self):     # the stand-in's data.dataset: a built-in mix or a manifest path
            from dhp_jax.data.datasets import check_dataset

            try:
                check_dataset(self.data.dataset)
            except OSError as e:
                raise ConfigError(f"data.dataset={self.data.dataset!r}: {e}") from None
        return self

    def _validate_tensor_parallel(self) -> None:
        """parallel.tensor = t: a positive integer, num_ranks x t devices, and every model the run
        names (the one it trains, the planner's cost model) splittable t ways."""
        from dhp_jax.planner.cost.tensor_parallel import unsplittable

        t = self.parallel.tensor
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ConfigError(f"parallel.tensor must be a positive integer, got {t!r}")
        if not isinstance(self.parallel.sequence, bool):
            raise ConfigError(f"parallel.sequence must be true or false, got {self.parallel.sequence!r}")
        if self.parallel.sequence and t == 1:
            raise ConfigError("parallel.sequence=true needs parallel.tensor > 1 (it splits a rank's rows over its "
                              "devices)")
        if t == 1:
            return
        if self.num_ranks * t > self.devices.count:
            raise ConfigError(f"num_ranks={self.num_ranks} ranks of parallel.tensor={t} devices need "
                              f"{self.num_ranks * t} devices but devices.count={self.devices.count}")
        for key, name, shape in self._model_shapes():
            why = unsplittable(shape, t)
            if why:
                raise ConfigError(f"parallel.tensor={t}: {key}={name!r}: {why}")

    def _model_shapes(self) -> list[tuple[str, str, Any]]:
        """(config key, name, shape) of each model the run names whose shape is known without loading
        weights: the stored presets, a checkpoint's config.json and the stand-in MLLMConfig presets."""
        from dhp_jax.planner.cost import presets

        out = []
        if self.model.pretrained:
            try:
                out.append(("model.pretrained", self.model.pretrained,
                            presets.ModelShape.from_config(self.model.pretrained)))
            except (OSError, ValueError, KeyError):
                pass   # an unreadable checkpoint is reported where it is loaded
        elif self.model.preset in presets.MODELS:
            out.append(("model.preset", self.model.preset, presets.MODELS[self.model.preset]))
        else:
            from dhp_jax.model.mllm_config import PRESETS, split_shape

            c = PRESETS.get(self.model.preset)
            if c is not None:
                out.append(("model.preset", self.model.preset, split_shape(c)))
        if self.planner.cost_model in presets.MODELS:
            out.append(("planner.cost_model", self.planner.cost_model, presets.MODELS[self.planner.cost_model]))
        return out


# ---------------------------------------------------------------------------------------- loading
def valid_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key a train config or an override may set."""
    return _valid_keys(TrainConfig if cls is None else cls, prefix)


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    for text in overrides:
        path, value = parse_override(text)
        nested: Any = value
        for part in reversed(path):
            nested = {part: nested}
        if path and dataclasses.is_dataclass(getattr(config, path[0], None)) and len(path) == 1 \
                and not getattr(getattr(config, path[0]), "SCALAR_KEY", None):
            raise ConfigError(f"override {text!r} sets the whole section {path[0]!r}; set one key, "
                              f"e.g. {valid_keys(type(getattr(config, path[0])), path[0] + '.')[0]}=...")
        _apply(config, nested)
    return config


def checkpoint_path(config: TrainConfig) -> Path:
    """Where a run's checkpoints go: `checkpoint.dir`, else <metrics.out_dir>/checkpoints."""
    return Path(config.checkpoint.dir) if config.checkpoint.dir else Path(config.metrics.out_dir) / "checkpoints"


def compilation_cache_path(setting: str | None, out_dir: str | os.PathLike) -> Path | None:
    """JAX's persistent compilation cache of a run: "auto" is <out_dir>/jax-cache, None is off."""
    if not setting:
        return None
    return Path(out_dir) / "jax-cache" if setting == "auto" else Path(setting)


def sources_given(config: TrainConfig) -> bool:
    """Whether the config names fine-tuning data (then data.dataset is not read)."""
    return bool(config.data.manifest or config.data.webdataset or config.data.hf_dataset)


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                check_paths: bool = False) -> TrainConfig:
    """Load a `kind: train` YAML (None: the embedded demo) and apply `key=value` overrides; with
    `check_paths`, the input paths it names are checked (`TrainConfig.check_paths`) before the
    rest of the config is validated."""
    path = Path(path) if path is not None else DEMO_CONFIG
    data = read_yaml(path)
    if data.get("kind") != "train":
        raise ConfigError(f"config {str(path)!r} has kind {data.get('kind')!r}; `dhp train` needs kind: train")
    config = TrainConfig()
    _apply(config, data)
    _resolve_inputs(config, path.parent)
    apply_overrides(config, overrides)
    if path == DEMO_CONFIG and config.model.pretrained:
        given = {tuple(parse_override(o)[0]) for o in overrides}
        if ("planner", "cost_model") not in given:
            # the demo prices its tiny model as a published one; a fine-tuned checkpoint is priced as itself
            config.planner.cost_model = None
        # a fine-tuning run is not the demo: named after its checkpoint directory, written under runs/<name>
        if ("name",) not in given:
            config.name = finetune_name(config.model.pretrained)
        if ("metrics", "out_dir") not in given:
            config.metrics.out_dir = f"runs/{config.name}"
    if check_paths:
        config.check_paths()
    return config.validate()


def finetune_name(checkpoint: str) -> str:
    """The default run name of a fine-tuning run: `finetune-<checkpoint directory name>`."""
    return "finetune-" + (os.path.basename(os.path.normpath(checkpoint)) or "checkpoint")


# Input files named inside a YAML are relative to that YAML (overrides stay relative to the cwd).
_INPUT_PATHS = (("planner", "plan_file"), ("planner", "cost_profile"), ("model", "pretrained"), ("data", "manifest"),
                ("data", "webdataset"), ("data", "hf_dataset"))


def _resolve_inputs(config: TrainConfig, base: Path) -> None:
    from dhp_jax.data.hf_config import HUB_ID
    from dhp_jax.planner.cli_args import profile_path

    for section, key in _INPUT_PATHS:
        obj = getattr(config, section)
        value = getattr(obj, key)
        if key == "cost_profile" and value and not (base / value).exists() and profile_path(value) != value:
            continue  # a packaged profile named by name (tiny-cpu8)
        if key == "pretrained" and value and not (base / value).exists() and HUB_ID.match(value):
            continue  # a Hugging Face Hub id (resolved in the local cache by validate)
        if value and not os.path.isabs(value):
            setattr(obj, key, str((base / value).resolve()))


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    config = TrainConfig()
    _apply(config, data)
    return config.validate()
