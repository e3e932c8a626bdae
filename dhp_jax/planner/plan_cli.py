"""`dhp plan`: plan one batch with a strategy, print the groups and compare with static baselines."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dhp_jax.planner.cli_args import add_cost_args, add_tensor_parallel_arg, add_video_args, cost_from_args, \
    tensor_parallel_ranks, video_sampling_from_args
from dhp_jax.planner.cost.pricing import allreduce_time

DEFAULT_COMPARE = "static-ring:best,static-ulysses:best"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="openvid", help="dataset mix name or a .jsonl manifest (default openvid)")
    parser.add_argument("--batch", type=int, default=512, help="global batch size in samples (default 512)")
    add_cost_args(parser, ranks=64, freeze_vision=True, router_phase=True)
    add_tensor_parallel_arg(parser)
    add_video_args(parser)
    parser.add_argument("--strategy", default="dhp", help="dhp, static-ring:<d|best>, static-ulysses:<d|best>, flexsp, milp")
    parser.add_argument("--micro-batches", type=int, default=None, help="fix the micro-batch count (default: searched)")
    parser.add_argument("--compare", default=DEFAULT_COMPARE,
                        help=f"comma-separated strategies to compare with, '' for none (default {DEFAULT_COMPARE})")
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print the plan and comparison as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw ranks x time per micro-batch")


def not_optimal(solver: dict) -> str:
    """Why a time-limited solver's plan is only the best found (its solver metadata)."""
    limit = solver.get("time_limit_s")
    return (f"the {solver.get('strategy', 'MILP')} solver stopped at its {limit:g} s time limit; this is the best "
            f"plan it found" if limit else "the solver stopped before proving optimality")


def chosen_from(solver: dict) -> str | None:
    """Where a "dhp" plan came from when a static or FlexSP-style candidate beat its search (its
    solver metadata "chosen"; `dhp_jax.planner.solvers.static_candidates`, `flexsp_candidate`),
    else None."""
    chosen = solver.get("chosen")
    if not chosen or chosen == "dhp":
        return None
    kind, _, degree = chosen.partition(":")
    what = {"static-best": f"degree-{degree} static groups, each on its fastest attention kind",
            "flexsp-packing": "FlexSP's length-sorted micro-batches, each on groups of one power-of-two degree"
            }.get(kind, f"the {chosen} baseline's plan")
    return (f"chosen: {chosen} ({what}): faster than the DHP search's own plan "
            f"({solver['est_makespan_sum_s']:.3f} s against {solver['dhp_search_makespan_sum_s']:.3f} s of "
            f"micro-batch makespans)")


def _span(ranks: tuple[int, ...]) -> str:
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))


def run(args: argparse.Namespace) -> int:
    # lazy: `dhp --help` imports only the argument parsers
    from dhp_jax.data import make_dataset, sample_etas, sample_lengths
    from dhp_jax.data.datasets import check_dataset
    from dhp_jax.data.vision import rules_for_model
    from dhp_jax.planner.compare import compare_strategies
    from dhp_jax.planner.contract.plan import PlanningError

    others = [s for s in dict.fromkeys(s.strip() for s in args.compare.split(",")) if s and s != args.strategy]
    try:
        check_dataset(args.dataset)        # a wrong manifest path is said first
        cost = cost_from_args(args)
        devices, t = args.ranks, args.tensor_parallel
        args.ranks, _ = tensor_parallel_ranks(devices, args.ranks_per_node, t)
        # the batch's vision tokens: the planned model's processors (its processor files, the run's sampling)
        vision = rules_for_model(args.model, video_sampling_from_args(args))
        samples = make_dataset(args.dataset, args.batch, args.seed, vision=vision)
        lengths, etas = sample_lengths(samples), sample_etas(samples)
        # --micro-batches only when given: a strategy that takes no count (the static ones) refuses it
        fixed = {} if args.micro_batches is None else {"num_micro_batches": args.micro_batches}
        ours = compare_strategies([(lengths, etas)], args.ranks, cost, [args.strategy], errors="raise", **fixed)
    except (PlanningError, ValueError, OSError) as e:   # OSError: a manifest path that is not there
        print(f"dhp plan: {e}", file=sys.stderr)
        return 2
    plan, ours_s = ours.runs[args.strategy].plans[0], ours.mean(args.strategy)
    comp = compare_strategies([(lengths, etas)], args.ranks, cost, others)
    comparison: dict[str, Any] = {}
    for strat, r in comp.runs.items():
        if not r.ok:
            comparison[strat] = {"error": r.error}
            continue
        other = r.plans[0]
        comparison[strat] = {"step_time_s": r.step_time_s[0], "speedup": r.step_time_s[0] / ours_s,
                             "degree": other.solver.get("degree"), "optimal": other.solver.get("optimal"),
                             "num_micro_batches": len(other.micro_batches),
                             "solve_ms": other.solver["solve_ms"]}
    config = {"dataset": args.dataset, "batch": args.batch, "ranks": args.ranks, "ranks_per_node": args.ranks_per_node // t,
              "model": cost.model, "hardware": cost.hardware, "freeze_vision": cost.freeze_vision,
              "strategy": args.strategy, "seed": args.seed, "cost_source": args.cost or "preset",
              "vision": vision.name, "video_sampling": getattr(getattr(vision, "processor", None), "video_sampling", None),
              "numbers": "simulated with the cost model",
              **({"tensor_parallel": t, "devices": devices} if t > 1 else {}),
              **({"sequence_parallel": True} if args.sequence_parallel else {})}
    if args.plot:
        from dhp_jax.planner.plot import plot_plan  # lazy: matplotlib only with --plot

        plot_plan(plan, args.plot, title=f"{args.strategy}: {args.dataset}, {args.batch} samples, {args.ranks} ranks",
                  allreduce_s=allreduce_time(cost, plan.num_ranks))
    if args.json:
        print(json.dumps({"config": config, "step_time_s": ours_s, "plan": plan.to_dict(), "comparison": comparison},
                         indent=2))
        return 0
    tokens = int(lengths.sum())
    print(f"{args.strategy} plan: {args.dataset} batch {args.batch} ({tokens:,} tokens, longest {int(lengths.max()):,}), "
          f"{args.ranks} ranks ({args.ranks_per_node // t}/node)"
          + (f" of {t} devices (tensor parallel{', sequence-parallel' if args.sequence_parallel else ''}; "
             f"{devices} devices)" if t > 1 else "")
          + f", {cost.model} on {cost.hardware}")
    print(f"solve {plan.solver['solve_ms']:.1f} ms; {len(plan.micro_batches)} micro-batch(es); "
          f"numbers are simulated with the cost model")
    if plan.solver.get("optimal") is False:
        print(f"not proven optimal: {not_optimal(plan.solver)}")
    chosen = chosen_from(plan.solver)
    if chosen:
        print(chosen)
    for m, mb in enumerate(plan.micro_batches):
        print(f"\nmicro-batch {m}: {len(mb.groups)} groups, degrees {sorted((g.degree for g in mb.groups), reverse=True)}, "
              f"makespan {mb.est_makespan_s:.3f} s")
        print(f"  {'ranks':>12} {'deg':>4} {'attention':>11} {'samples':>7} {'tokens':>9} {'longest':>8} {'time s':>8} "
              f"{'mem GiB':>8}")
        for g in sorted(mb.groups, key=lambda g: (-g.degree, g.ranks)):
            ls = lengths[list(g.samples)]
            print(f"  {_span(g.ranks):>12} {g.degree:>4} {g.attention:>11} {len(g.samples):>7} {int(ls.sum()):>9,} "
                  f"{int(ls.max()):>8,} "
                  f"{g.est_time_s:>8.3f} {g.est_memory_bytes / 2**30:>8.2f}")
    print(f"\nstep time {ours_s:.3f} s (micro-batches {sum(mb.est_makespan_s for mb in plan.micro_batches):.3f} s "
          f"+ gradient all-reduce {allreduce_time(cost, args.ranks):.3f} s)")
    if comparison:
        print("\ncomparison (simulated step time):")
        print(f"  {args.strategy:<22} {ours_s:>9.3f} s")
        for strat, r in comparison.items():
            if "error" in r:
                print(f"  {strat:<22} infeasible: {r['error']}")
            else:
                print(f"  {strat:<22} {r['step_time_s']:>9.3f} s  degree {r['degree']}, {r['num_micro_batches']} "
                      f"micro-batch(es); {args.strategy} is {r['speedup']:.3f}x faster"
                      + (f" ({strat} not proven optimal)" if r.get("optimal") is False else ""))
    if args.plot:
        print(f"\nplot written to {args.plot}")
    return 0
