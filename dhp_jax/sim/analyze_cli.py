"""`dhp analyze MANIFEST`: the token profile of a dataset and what DHP would gain on it (simulated)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dhp_jax.planner.cli_args import add_cost_args, add_video_args, video_sampling_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="MANIFEST",
                        help="JSONL manifest path, or a built-in mix name (openvid, internvid, msrvtt, ...)")
    add_cost_args(parser, model="qwen3-vl-8b", ranks=64, router_phase=True)
    parser.add_argument("--batch", type=int, default=512, help="global batch size in samples (default 512)")
    parser.add_argument("--batches", type=int, default=3, help="batches drawn for the simulation (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch draws")
    parser.add_argument("--vision", default=None,
                        help="vision-token rules: a family (qwen-vl, qwen3-vl, internvl, llava), a stored model or a "
                             "checkpoint directory (default: --model's processor files)")
    add_video_args(parser)
    parser.add_argument("--skip-bad", action="store_true", help="skip bad manifest lines and count them")
    parser.add_argument("--image-root", default=None, help="folder image paths are relative to (default: the manifest's)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json path or name (default: chars/token estimate)")
    parser.add_argument("--mix-samples", type=int, default=8192, help="samples drawn when MANIFEST is a built-in mix")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw the histogram and step times to this file")


def run(args: argparse.Namespace) -> int:
    from dhp_jax.sim.analyze import analyze
    try:
        report = analyze(args.manifest, args.model, args.ranks, args.batch, hardware=args.hardware,
                         vision=args.vision, num_batches=args.batches, seed=args.seed, skip_bad=args.skip_bad,
                         image_root=args.image_root, tokenizer=args.tokenizer, ranks_per_node=args.ranks_per_node,
                         mix_samples=args.mix_samples, cost=args.cost,
                         video_sampling=video_sampling_from_args(args))
    except (ValueError, OSError) as e:   # OSError: a manifest path that is not there, or a directory
        print(f"dhp analyze: error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        plot(report, args.plot)
        report["plot"] = args.plot
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def render(report: dict[str, Any]) -> str:
    d, sim = report["data"], report["simulation"]
    ln, sh, kinds = d["length"], d["token_share"], d["sample_kinds"]
    out = [f"data: {d['source']} ({d['kind']}), vision family {d['vision']}",
           f"  samples {d['samples']:,}  tokens {d['tokens']:,}  text-only {kinds['text_only']:,}  "
           f"with image {kinds['with_image']:,}  with video {kinds['with_video']:,}",
           f"  length mean {ln['mean']:,.0f}  median {ln['median']:,.0f}  p90 {ln['p90']:,.0f}  "
           f"p99 {ln['p99']:,.0f}  max {ln['max']:,}",
           f"  token share: text {sh['text']:.1%}  image {sh['image']:.1%}  video {sh['video']:.1%}"]
    if d["kind"] == "manifest":
        out.append(f"  lines {d['lines']:,}  skipped {d['skipped']:,}  missing image files {d['missing_images']:,}"
                   f"  image sizes read {d['images_read']:,}  text tokens by {d['text_counter']}")
        out += [f"    {e}" for e in d["errors"]]
        out += [f"    missing: {p}" for p in d["missing_paths"][:3]]
        if d["missing_images"] > 3:
            out.append(f"    ... {d['missing_images'] - 3:,} more missing image files (their sizes were given)")
    out.append("token-length histogram (tokens per bin by modality):")
    out.append(f"  {'length':>17}  {'samples':>8}  {'text':>6}  {'image':>6}  {'video':>6}")
    for r in report["histogram"]:
        tok = r["text_tokens"] + r["image_tokens"] + r["video_tokens"]
        shares = [r[k] / tok if tok else 0.0 for k in ("text_tokens", "image_tokens", "video_tokens")]
        out.append(f"  [{r['lo']:>7,}, {r['hi']:>7,})  {r['samples']:>8,}  " + "  ".join(f"{s:>6.1%}" for s in shares))
    out.append(f"step time, {sim['kind']}, {sim['ranks']} ranks ({sim['ranks_per_node']}/node), "
               f"batch {sim['batch']}, mean of {sim['num_batches']} batches (seed {sim['seed']}):")
    for s, r in sim["strategies"].items():
        if r["error"]:
            out.append(f"  {s:<22} cannot plan: {r['error']}")
        else:
            out.append(f"  {s:<22} {r['mean_step_time_s']:9.3f} s   solve {r['median_solve_ms']:7.1f} ms   "
                       f"{_choices(r['choices'])}")
    if "speedup_vs_best_baseline" in sim:
        out.append(f"  dhp speed-up over the best baseline ({sim['best_baseline']}): "
                   f"{sim['speedup_vs_best_baseline']:.3f}x (simulated)")
    return "\n".join(out)


def _choices(choices: list[dict[str, Any]]) -> str:
    if not choices:
        return ""
    keys = sorted({k for c in choices for k in c})
    return "  ".join(f"{k}: {','.join(str(c.get(k)) for c in choices)}" for k in keys)


def plot(report: dict[str, Any], path: str) -> None:
    """Two panels: stacked token histogram by modality; mean simulated step time per strategy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sim = report["histogram"], report["simulation"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['lo']:,}" for r in rows]
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, colour in (("text_tokens", "#4c72b0"), ("image_tokens", "#dd8452"), ("video_tokens", "#55a868")):
        vals = [r[key] for r in rows]
        ax1.bar(x, vals, bottom=bottom, color=colour, label=key.split("_")[0])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_xticks(list(x), labels, rotation=60, fontsize=7)
    ax1.set_xlabel("sample length bin (tokens, lower edge)")
    ax1.set_ylabel("tokens in bin")
    ax1.set_title(f"{report['data']['source']}: tokens by length and modality", fontsize=9)
    ax1.legend(fontsize=8)
    names = [s for s, r in sim["strategies"].items() if r["mean_step_time_s"] is not None]
    ax2.bar(names, [sim["strategies"][s]["mean_step_time_s"] for s in names],
            color=["#c44e52" if s == "dhp" else "#8c8c8c" for s in names])
    ax2.set_ylabel("step time (s, simulated)")
    ax2.set_title(f"{sim['model']} on {sim['hardware']}, {sim['ranks']} ranks, batch {sim['batch']}", fontsize=9)
    ax2.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
