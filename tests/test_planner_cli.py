"""`dhp plan` and `dhp bench planner` end to end (small sizes)."""

import json

from dhp_jax.cli import main


def test_dhp_plan_json_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    # 32 ranks: internvl3-8b's fp32 state sharded over 8 would not leave room on a 910B, over 16 too
    # little for Ulysses' heads-limited degrees to hold the longest sample
    assert main(["plan", "--batch", "64", "--ranks", "32", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["model"] == "internvl3-8b" and out["config"]["numbers"].startswith("simulated")
    assert out["plan"]["schema"] == "dhp.plan/v2"
    assert set(out["comparison"]) == {"static-ring:best", "static-ulysses:best"}
    for r in out["comparison"].values():
        # never slower than a static baseline: DHP takes the static plans as candidates
        assert out["step_time_s"] <= r["step_time_s"] * (1 + 1e-9)
    # on this batch the search's own mixed plan is the fastest, and nothing says otherwise
    solver = out["plan"]["solver"]
    assert solver.get("chosen", "dhp") == "dhp", solver
    assert all(r["speedup"] > 1.0 for r in out["comparison"].values()), out["comparison"]
    assert len({g["degree"] for mb in out["plan"]["micro_batches"] for g in mb["groups"]}) >= 2
    assert png.stat().st_size > 1000
    # on a smaller batch the search prices every group at its fastest kind while it allocates, so it
    # finds a hybrid group of 24 beside two rings of 4, faster than the static degree-32 groups on
    # their fastest kind (which a search pricing the ring alone lost to)
    assert main(["plan", "--batch", "32", "--ranks", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    groups = sorted((g["degree"], g["attention"]) for mb in out["plan"]["micro_batches"] for g in mb["groups"])
    assert out["plan"]["solver"].get("chosen", "dhp") == "dhp" and groups == [(4, "ring"), (4, "ring"), (24, "hybrid:4x6")]
    assert main(["plan", "--batch", "32", "--ranks", "32", "--strategy", "static-ring:32", "--json"]) == 0
    static = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] < static["step_time_s"]
    # on 32 ranks with 16 samples FlexSP's length-sorted micro-batches on power-of-two groups beat
    # the search's own plan, and the plan says so
    assert main(["plan", "--batch", "16", "--ranks", "32", "--json"]) == 0
    solver = json.loads(capsys.readouterr().out)["plan"]["solver"]
    assert solver["chosen"] == "flexsp-packing"
    assert solver["est_makespan_sum_s"] < solver["dhp_search_makespan_sum_s"]
    assert main(["plan", "--batch", "16", "--ranks", "32", "--compare", ""]) == 0
    assert "chosen: flexsp-packing (FlexSP's length-sorted micro-batches" in capsys.readouterr().out


def test_dhp_plan_table_and_errors(capsys):
    assert main(["plan", "--batch", "32", "--ranks", "16", "--strategy", "static-ring:8", "--compare", "dhp"]) == 0
    text = capsys.readouterr().out
    assert "micro-batch 0" in text and "step time" in text and "comparison" in text
    assert main(["plan", "--model", "nope"]) == 2
    assert "known models" in capsys.readouterr().err
    assert main(["plan", "--batch", "16", "--ranks", "16", "--strategy", "bogus"]) == 2
    assert "unknown strategy 'bogus'" in capsys.readouterr().err


def test_bench_planner_json(capsys):
    assert main(["bench", "planner", "--sizes", "8:32,16:64", "--repeats", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["ranks"], r["batch"]) for r in out["results"]] == [(8, 32), (16, 64)]
    assert all(r["solve_ms_median"] > 0 and r["total_cpu_ms_p99"] > 0 for r in out["results"])
    assert "global batch" in out["target"]  # the targets are per batch; per micro-batch is reported beside
    for r in out["results"]:
        assert r["micro_batches_median"] >= 1
        assert 0 < r["solve_ms_per_micro_batch_median"] <= r["solve_ms_p99"]


def _dhp_cmd(*args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", "dhp_jax", *args]


def test_flexsp_json_is_only_json_on_stdout():
    """Real file descriptors (a shell pipe), so native solver output could not hide in a capture."""
    import os
    import shlex
    import subprocess
    import sys

    cmd = " ".join(map(shlex.quote, _dhp_cmd("plan", "--strategy", "flexsp", "--batch", "64", "--ranks", "16",
                                             "--compare", "", "--json")))
    check = f"{shlex.quote(sys.executable)} -c 'import json,sys; json.load(sys.stdin)'"
    r = subprocess.run(f"set -o pipefail; {cmd} | {check}", shell=True, executable="/bin/bash",
                       capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-2000:]


def test_closed_pipe_ends_quietly():
    import os
    import subprocess

    p = subprocess.Popen(_dhp_cmd("plan", "--batch", "64", "--ranks", "16", "--json"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=os.environ.copy())
    p.stdout.close()  # the reader is gone before the first byte (`| head` that already exited)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_time_limited_solver_says_it_is_not_proven_optimal():
    from dhp_jax.planner.plan_cli import not_optimal

    assert "stopped at its 10 s time limit" in not_optimal({"strategy": "flexsp", "time_limit_s": 10.0})
    assert "before proving optimality" in not_optimal({"strategy": "milp"})


def test_analyze_errors_go_to_stderr(tmp_path, capsys):
    assert main(["analyze", str(tmp_path / "missing.jsonl")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "not found" in captured.err


def test_json_mode_sends_native_writes_to_stderr():
    """What a native solver writes to file descriptor 1 during a --json command lands on stderr."""
    import os
    import subprocess
    import sys

    code = ("import os\nfrom dhp_jax.cli import _json_stdout\nwith _json_stdout(True):\n"
            "    os.write(1, b'solver banner\\n')\n    print('{}')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=os.environ.copy())
    assert r.returncode == 0 and r.stdout == "{}\n" and "solver banner" in r.stderr, (r.stdout, r.stderr)


def test_ranks_set_the_state_sharding_that_memory_is_priced_with(capsys):
    """The fp32 state is sharded over the --ranks of the command (as the engine shards it), not over
    a fixed 64: Qwen3-VL-8B's state does not fit 2 Ascend 910B ranks and fits 64, in `dhp plan`,
    `dhp simulate` and `dhp analyze` alike (16 ranks leave it no room either)."""
    for argv in (["plan", "--ranks", "2", "--batch", "16"],
                 ["simulate", "--nodes", "1", "--ranks-per-node", "2", "--batch", "16", "--steps", "1"],
                 ["analyze", "msrvtt", "--mix-samples", "64", "--ranks", "2", "--batch", "16", "--batches", "1"]):
        assert main([*argv, "--model", "qwen3-vl-8b"]) == 2, argv
        assert "does not fit on ascend-910b with its state sharded over 2 ranks" in capsys.readouterr().err, argv
    assert main(["plan", "--ranks", "16", "--batch", "16", "--model", "qwen3-vl-8b", "--compare", ""]) == 2
    assert "sharded over 16 ranks (static bytes 57.6 GiB of 57.6 GiB usable" in capsys.readouterr().err
    assert main(["plan", "--ranks", "64", "--batch", "16", "--model", "qwen3-vl-8b", "--compare", ""]) == 0
    assert main(["simulate", "--nodes", "8", "--batch", "16", "--steps", "1", "--model", "qwen3-vl-8b"]) == 0
    assert main(["plan", "--ranks", "1", "--model", "internvl3-38b", "--hardware", "cpu"]) == 2
    assert "sharded over 1 ranks" in capsys.readouterr().err
