"""`dhp example OUT_DIR --family FAMILY` (a registered family, `dhp_jax.models`): everything a fine-tuning run needs,
written offline: `OUT_DIR/checkpoint` (a tiny random model of the family, saved by
`hf.save_pretrained`, with the tokenizer, chat template and processor files transformers saves
next to a checkpoint) and `OUT_DIR/data/train.jsonl` (generated images, short PyAV videos and
conversations, `dhp_jax.data.example`)."""

from __future__ import annotations

import argparse
import os
import sys


def token_ids(checkpoint: str, family: str) -> dict[str, int]:
    """The tokenizer's ids of the vision placeholders a family's config.json names (its example's
    `token_names`)."""
    from tokenizers import Tokenizer

    from dhp_jax import models

    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    names = dict(models.spec(family).example.token_names)
    names.update(bos="<|endoftext|>", eos="<|im_end|>")
    return {k: int(tok.token_to_id(v)) for k, v in names.items()}


def write_example(out_dir: str, family: str, num_samples: int = 24, seed: int = 0,
                  vocab_size: int = 512, long_videos: int = 3) -> tuple[str, str]:
    """(checkpoint dir, manifest path) under `out_dir` (see the module docstring)."""
    from dhp_jax import models
    from dhp_jax.data.example import write_example_data, write_processor_files
    from dhp_jax.model import hf
    from dhp_jax.model.hf.init import random_params, tiny_config

    models.spec(family)         # an unknown name is an error naming the known ones
    ckpt = os.path.join(out_dir, "checkpoint")
    write_processor_files(ckpt, family, vocab_size=vocab_size)
    config = hf.parse_config(tiny_config(family, token_ids(ckpt, family), vocab_size))
    hf.save_pretrained(config, random_params(config, seed), ckpt)
    manifest = write_example_data(os.path.join(out_dir, "data"), num_samples=num_samples, seed=seed,
                                  long_videos=long_videos)
    return ckpt, manifest


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write checkpoint/ and data/")
    from dhp_jax import models

    names = models.names()
    parser.add_argument("--family", default=names[0], choices=names,
                        help=f"model family of the tiny checkpoint, a registered one (default: {names[0]})")
    parser.add_argument("--samples", type=int, default=24, help="records in data/train.jsonl (default: 24)")
    parser.add_argument("--long-videos", type=int, default=3, metavar="N",
                        help="how many of the records are long videos (12-30 s, about 0.8k-2k tokens) beside the "
                             "short captions, images and clips (default: 3)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        print(f"dhp example: --samples must be >= 1, got {args.samples}", file=sys.stderr)
        return 2
    if not 0 <= args.long_videos <= args.samples:
        print(f"dhp example: --long-videos must be between 0 and --samples ({args.samples}), got {args.long_videos}",
              file=sys.stderr)
        return 2
    if os.path.exists(os.path.join(args.out_dir, "checkpoint", "config.json")):
        print(f"dhp example: {os.path.join(args.out_dir, 'checkpoint')!r} already holds a checkpoint; "
              "choose another OUT_DIR", file=sys.stderr)
        return 2
    ckpt, manifest = write_example(args.out_dir, args.family, args.samples, args.seed, long_videos=args.long_videos)
    print(f"dhp example: {args.family} checkpoint in {ckpt}\n"
          f"dhp example: {args.samples} records ({args.long_videos} of them long videos) in {manifest}\n"
          f"next: dhp train model.pretrained={ckpt} data.manifest={manifest} planner.cost_model=qwen3-vl-4b\n"
          "(planner.cost_model: priced as Qwen3-VL-4B on 8 Ascend 910B nodes, the long videos get context "
          "parallelism; the tiny checkpoint priced as itself fits one rank: every group of degree 1)")
    return 0
