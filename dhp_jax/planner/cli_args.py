"""The command-line arguments every command shares, with one meaning each, and the one way to build
a cost model from a preset name or a profile path.

- `--model NAME|DIR`: the model the cost model prices (a `CostModel.preset` model, e.g. internvl3-8b, or a
  checkpoint directory: its config.json) and whose processor files count the vision tokens
  (`dhp_jax.data.vision.rules_for_model`).
- `--video-fps F`, `--video-frames N` (`dhp plan`, `dhp analyze`, `dhp simulate`): the video sampling the
  fine-tuning run passes to the processor (`FinetuneData(video_sampling=...)`); default "auto".
- `--hardware NAME`: the hardware preset (ascend-910b, a100, h100, cpu).
- `--cost SOURCE`: a fitted cost model (`dhp profile` output, a .json path) or a preset
  `MODEL/HARDWARE`; given, it replaces --model/--hardware. `--cost-profile PATH` is the same flag.
- `--ranks N`, `--ranks-per-node N`: model replicas, and how many share a node's fast links; a
  preset's fp32 state is sharded over the N ranks (`cost_from_args`), as the engine shards it.
- `--mllm NAME`: the `MLLMConfig` preset a command executes (tiny), where a command runs a model.
- `--tensor-parallel T` (`dhp plan`, `dhp simulate`): a rank is T devices of one node
  (`dhp_jax.planner.cost.tensor_parallel`); --ranks and --ranks-per-node then count devices and the planner's
  ranks are those counts / T (T must divide them). A preset only (a fitted profile is one rank's).
- `--sequence-parallel` (with `--tensor-parallel T` > 1): the block stacks sequence-parallel over a
  rank's T devices (Megatron SP; `CostModel.preset(..., sequence_parallel=True)` prices the rows
  they carry, 1/T a device).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dhp_jax.checks import positive_int
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.presets import HARDWARE, MODELS


def positive(text: str) -> int:
    """argparse type: a positive integer."""
    try:
        return positive_int(int(text), "value", argparse.ArgumentTypeError)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def add_cost_args(parser: argparse.ArgumentParser, *, model: str = "internvl3-8b", hardware: str = "ascend-910b",
                  cost: str | None = None, ranks: int | None = None, ranks_per_node: int | None = 8,
                  freeze_vision: bool = False, router_phase: bool = False) -> None:
    """--model, --hardware, --cost (alias --cost-profile); --ranks when `ranks` is given; --ranks-per-node
    unless `ranks_per_node` is None; --freeze-vision and --router-phase when asked (commands that price
    a run; a command that runs steps derives the router phase from its model instead)."""
    parser.add_argument("--model", default=model,
                        help=f"model preset (default {model}): {', '.join(MODELS)}; or a checkpoint directory "
                             f"(config.json and processor files)")
    parser.set_defaults(model_default=model)
    parser.add_argument("--hardware", default=hardware,
                        help=f"cost-model hardware preset (default {hardware}): {', '.join(HARDWARE)}")
    parser.add_argument("--cost", "--cost-profile", dest="cost", default=cost, metavar="SOURCE",
                        help="a fitted cost model (.json from `dhp profile`) or a preset MODEL/HARDWARE; "
                             "replaces --model/--hardware" + (f" (default {cost})" if cost else ""))
    if ranks is not None:
        parser.add_argument("--ranks", type=positive, default=ranks, help=f"model replicas (default {ranks})")
    if ranks_per_node is not None:
        parser.add_argument("--ranks-per-node", type=positive, default=ranks_per_node,
                            help=f"ranks sharing a node's fast links (default {ranks_per_node})")
    if freeze_vision:
        parser.add_argument("--freeze-vision", action="store_true", help="model a frozen vision encoder")
    if router_phase:
        parser.add_argument("--router-phase", action="store_true",
                            help="a mixture of experts trained with its load-balancing loss on the JAX engine "
                                 "(`dhp train model.router_aux_loss_coef` > 0): price each group's forward-only "
                                 "router program before its step (`CostModel.preset(..., router_phase=True)`); "
                                 "a preset's, not a profile's")


def add_tensor_parallel_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel", type=positive, default=1, metavar="T",
                        help="devices per rank, Megatron-style tensor parallelism inside a node (default 1): "
                             "--ranks and --ranks-per-node then count devices, the planner's ranks are those / T")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tensor-parallel T > 1: the block stacks sequence-parallel over a rank's T "
                             "devices (each carries 1/T of the rows between the split matrices; the engine's "
                             "PlanExecutor(sequence_parallel=True), train parallel.sequence)")


def tensor_parallel_ranks(devices: int, devices_per_node: int, t: int) -> tuple[int, int]:
    """(ranks, ranks per node) of `devices` devices, `devices_per_node` a node, in ranks of t devices;
    a ValueError when t does not divide the node's devices or the device count."""
    from dhp_jax.planner.cost.tensor_parallel import check_node

    check_node(devices_per_node, t)
    if devices % t:
        raise ValueError(f"tensor_parallel {t} does not divide the {devices} devices")
    return devices // t, devices_per_node // t


def add_video_args(parser: argparse.ArgumentParser) -> None:
    """--video-fps / --video-frames: the video sampling a run passes to the model's processor."""
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--video-fps", type=float, default=None, metavar="F",
                   help="sample videos at F frames/s, as the fine-tuning run's processor call does (default: the "
                        "checkpoint's own sampling; where its files take every frame, 2 frames/s for Qwen2.5-VL and "
                        "1 for InternVL, as FinetuneData's default)")
    g.add_argument("--video-frames", type=positive, default=None, metavar="N",
                   help="sample N frames of each video (default: as --video-fps)")


def video_sampling_from_args(args: argparse.Namespace) -> dict[str, Any] | str:
    """The `video_sampling` of --video-fps / --video-frames ("auto" when neither is given)."""
    fps, frames = getattr(args, "video_fps", None), getattr(args, "video_frames", None)
    if fps is not None:
        if not fps > 0 or fps != fps or fps == float("inf"):
            raise ValueError(f"--video-fps must be a positive number of frames per second, got {fps}")
        return {"fps": fps}
    return {"num_frames": frames} if frames is not None else "auto"


def add_mllm_arg(parser: argparse.ArgumentParser, default: str = "tiny") -> None:
    parser.add_argument("--mllm", default=None, help=f"MLLMConfig preset to run (default {default})")
    parser.set_defaults(mllm_default=default)


def mllm_preset(args: argparse.Namespace, prog: str) -> str:
    """The --mllm preset. The old spelling `--model tiny` (a name that is no cost preset) still
    selects it, with a note on stderr; --model then falls back to its default."""
    if args.mllm:
        return args.mllm
    model = getattr(args, "model", None)
    if model and str(model).lower() not in MODELS and not (Path(str(model)) / "config.json").is_file():
        print(f"{prog}: --model {model} read as --mllm {model} (--model names the cost-model preset)",
              file=sys.stderr)
        args.model = getattr(args, "model_default", None)
        return model
    return args.mllm_default


# Fitted cost profiles shipped in the wheel (package data beside the trainer that fits them with
# `dhp profile`): `--cost tiny-cpu8` / `planner.cost_profile=tiny-cpu8` name them from anywhere.
PACKAGED_PROFILES = Path(__file__).resolve().parents[1] / "train" / "profiles"


def packaged_profiles() -> list[str]:
    """The names of the packaged cost profiles (file names without .json; reports left out)."""
    return sorted(p.name[:-5] for p in PACKAGED_PROFILES.glob("*.json") if not p.name.endswith(".report.json"))


def profile_path(source: str) -> str:
    """A profile path as given, or the packaged profile a bare name (`tiny-cpu8`) stands for."""
    if os.path.isfile(source) or os.sep in source or "/" in source:
        return source
    name = source[:-5] if source.endswith(".json") else source
    return str(PACKAGED_PROFILES / f"{name}.json") if name in packaged_profiles() else source


def is_profile(source: str) -> bool:
    return source.endswith(".json") or os.path.isfile(source) or profile_path(source) != source


def is_checkpoint_dir(model: str) -> bool:
    """A --model that names a checkpoint directory (one with a config.json) rather than a preset."""
    return os.path.isdir(str(model)) and os.path.isfile(os.path.join(str(model), "config.json"))


def preset_model(model: str) -> Any:
    """What `CostModel.preset` takes for a --model: the preset name, or a checkpoint directory's shape
    (`ModelShape.from_config`, its config.json)."""
    if is_checkpoint_dir(model):
        from dhp_jax.planner.cost.presets import ModelShape

        return ModelShape.from_config(str(model))
    return model


def cost_model(source: str, hardware: str | None = None, *, ranks_per_node: int | None = None,
               freeze_vision: bool = False, profile: bool | None = None, **overrides: Any) -> CostModel:
    """A cost model from a profile path (`CostModel.from_profile`; `ranks_per_node` and `overrides`
    replace its own fields when given) or a preset `MODEL` / `MODEL/HARDWARE` (`hardware` when the
    source names none). `profile` forces the reading (None: a .json or existing file is a profile).
    Raises ValueError naming an unreadable profile."""
    if is_profile(source) if profile is None else profile:
        try:
            cost = CostModel.from_profile(profile_path(source))
        except OSError as e:
            raise ValueError(f"cannot read cost profile {source!r}: {e.strerror or e} (packaged profiles, "
                             f"named without a path: {', '.join(packaged_profiles()) or 'none'})") from None
        changes = {**overrides, **({} if ranks_per_node is None else {"ranks_per_node": ranks_per_node})}
        return cost.replace(**changes) if changes else cost
    if is_checkpoint_dir(source):
        return CostModel.preset(preset_model(source), hardware or "ascend-910b", freeze_vision=freeze_vision,
                                **({} if ranks_per_node is None else {"ranks_per_node": ranks_per_node}), **overrides)
    model, _, hw = source.partition("/")
    return CostModel.preset(model, hw or hardware or "ascend-910b", freeze_vision=freeze_vision,
                            **({} if ranks_per_node is None else {"ranks_per_node": ranks_per_node}), **overrides)


def _check_router_phase(source: str) -> None:
    """--router-phase prices a preset's router program: a ValueError for a profile (it prices what it
    measured) or a model without routers, naming which."""
    if is_profile(source):
        raise ValueError(f"--router-phase needs a preset: the profile {source!r} prices the programs it measured")
    shape = preset_model(source)
    name = str(source).partition("/")[0].lower()
    if isinstance(shape, str):
        shape = MODELS.get(name)
    if shape is not None and not shape.experts:
        raise ValueError(f"--router-phase: {source!r} has no mixture-of-experts layer (no router program to price)")


def cost_from_args(args: argparse.Namespace, **overrides: Any) -> CostModel:
    """The cost model that `add_cost_args` describes: --cost when given, else --model on --hardware;
    with --tensor-parallel T > 1 the preset of a rank of T devices (--ranks-per-node counts devices),
    with --sequence-parallel its block stacks sequence-parallel. A preset's fp32 state is sharded
    over the --ranks devices of the command (`CostModel.state_shards`; what the engine does),
    unless `overrides` name `state_shards` or `zero_shards`; a fitted profile keeps its own."""
    rpn, t = getattr(args, "ranks_per_node", None), getattr(args, "tensor_parallel", 1)
    ranks = getattr(args, "ranks", None)
    if getattr(args, "router_phase", False):
        overrides = {**overrides, "router_phase": True}
        _check_router_phase(args.cost or args.model)
    if ranks is not None and not is_profile(args.cost or args.model) \
            and not {"state_shards", "zero_shards"} & set(overrides):
        overrides = {**overrides, "state_shards": int(ranks)}
    if getattr(args, "sequence_parallel", False):
        if t == 1:
            raise ValueError("--sequence-parallel needs --tensor-parallel T > 1 (it splits a rank's rows over its "
                             "T devices)")
        overrides = {**overrides, "sequence_parallel": True}
    if t > 1:
        source = args.cost or args.model
        if is_profile(source):
            raise ValueError(f"--tensor-parallel {t} needs a preset: the profile {source!r} prices the ranks it "
                             f"was measured on")
        rpn = tensor_parallel_ranks(rpn or t, rpn or t, t)[1]
        overrides = {**overrides, "tensor_parallel": t}
    return cost_model(args.cost or args.model, args.hardware, ranks_per_node=rpn,
                      freeze_vision=getattr(args, "freeze_vision", False), **overrides)
