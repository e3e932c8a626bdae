"""`dhp simulate`: step times of strategies on a described cluster (simulated from a cost preset).

Example: `dhp simulate --nodes 512 --ranks-per-node 8 --batch 32768 --steps 3`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dhp_jax.planner.cli_args import add_cost_args, add_tensor_parallel_arg, add_video_args, cost_from_args, \
    is_profile, tensor_parallel_ranks, video_sampling_from_args

DEFAULT_STRATEGIES = "dhp,static-ring:best,static-ulysses:best"


def configure(parser: argparse.ArgumentParser) -> None:
    add_cost_args(parser, freeze_vision=True, router_phase=True)
    add_tensor_parallel_arg(parser)
    add_video_args(parser)
    parser.add_argument("--dataset", default="openvid", help="dataset name or manifest path")
    parser.add_argument("--nodes", type=int, default=8, help="nodes in the cluster")
    parser.add_argument("--intra-gbps", type=float, default=None, help="override intra-node GB/s per rank")
    parser.add_argument("--inter-gbps", type=float, default=None, help="override inter-node GB/s per rank")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default 8 per rank)")
    parser.add_argument("--steps", type=int, default=3, help="global batches simulated")
    parser.add_argument("--seed", type=int, default=0, help="data seed (every strategy sees the same batches)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _hashable(sampling):
    return tuple(sorted(sampling.items())) if isinstance(sampling, dict) else sampling


def run(args: argparse.Namespace) -> int:
    from dhp_jax.sim.cluster import Cluster
    from dhp_jax.sim.simulate import make_batches, simulate

    from dhp_jax.data.datasets import check_dataset

    try:
        check_dataset(args.dataset)        # a wrong manifest path is said first
        _, node_ranks = tensor_parallel_ranks(args.ranks_per_node, args.ranks_per_node, args.tensor_parallel)
        cluster = Cluster(nodes=args.nodes, ranks_per_node=node_ranks, model=args.model,
                          hardware=args.hardware, freeze_vision=args.freeze_vision,
                          intra_node_gbps=args.intra_gbps, inter_node_gbps=args.inter_gbps,
                          tensor_parallel=args.tensor_parallel, sequence_parallel=args.sequence_parallel,
                          state_shards=args.nodes * args.ranks_per_node,   # the state over every device
                          video_sampling=_hashable(video_sampling_from_args(args)))
        shards = {} if args.cost and is_profile(args.cost) else {"state_shards": cluster.devices}
        cost = cost_from_args(args, **shards) if args.cost else cluster.cost_model()
    except (ValueError, OSError) as e:
        print(f"dhp simulate: {e}", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"dhp simulate: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    batch = args.batch or 8 * cluster.num_ranks
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    t0 = time.perf_counter()
    try:
        batches = make_batches(args.dataset, batch, args.steps, args.seed, cluster.vision)
    except (ValueError, OSError) as e:   # an unknown mix, a manifest path that is not there, a bad line
        print(f"dhp simulate: {e}", file=sys.stderr)
        return 2
    runs = []
    for s in strategies:
        try:
            r = simulate(cluster, batches, s, cost=cost)
        except ValueError as e:  # unknown strategy or infeasible batch: name it and go on
            print(f"dhp simulate: strategy {s!r}: {e}", file=sys.stderr)
            return 2
        r.dataset = args.dataset
        runs.append(r)
    source = (f"profile {args.cost}" if is_profile(args.cost) else f"{args.cost} preset") if args.cost \
        else f"{args.hardware} preset"
    out = {"label": f"simulated ({source})", "cluster": cluster.describe(),
           "dataset": args.dataset, "batch": batch, "seed": args.seed,
           "runs": [r.summary() for r in runs], "wall_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{cluster.describe()}; {args.dataset}, global batch {batch}, {args.steps} steps; "
          f"step times simulated from the {args.hardware} preset, planning measured here")
    print(f"{'strategy':<24}{'step s':>10}{'tok/s/rank':>12}{'util':>7}{'mbs':>6}{'plan ms':>10}{'vs dhp':>8}")
    ref = next((r.mean_step_s for r in runs if r.strategy == "dhp"), None)
    for r in runs:
        rel = f"{r.mean_step_s / ref:7.2f}x" if ref else ""
        su = r.summary()
        print(f"{r.strategy:<24}{r.mean_step_s:10.3f}{r.tokens_per_s_per_rank:12.0f}{su['utilisation']:7.2f}"
              f"{su['micro_batches_mean']:6.1f}{su['plan_wall_ms_median']:10.1f}{rel:>8}")
    return 0
