"""`dhp plan` and `dhp bench planner` end to end (small sizes)."""

import json

from dhp_jax.cli import main


def test_dhp_plan_json_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "--batch", "64", "--ranks", "8", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["model"] == "internvl3-8b" and out["config"]["numbers"].startswith("simulated")
    assert out["plan"]["schema"] == "dhp.plan/v2"
    assert set(out["comparison"]) == {"static-ring:best", "static-ulysses:best"}
    for r in out["comparison"].values():
        # never slower than a static baseline: DHP takes the static plans as candidates
        assert out["step_time_s"] <= r["step_time_s"] * (1 + 1e-9)
    # here the static degree-8 groups (each on its fastest attention kind) beat DHP's own search,
    # and the plan says so
    solver = out["plan"]["solver"]
    assert solver["chosen"] == "static-best:8"
    assert solver["est_makespan_sum_s"] < solver["dhp_search_makespan_sum_s"]
    assert png.stat().st_size > 1000
    assert main(["plan", "--batch", "64", "--ranks", "8", "--compare", ""]) == 0
    assert "chosen: static-best:8 (degree-8 static groups" in capsys.readouterr().out


def test_dhp_plan_table_and_errors(capsys):
    assert main(["plan", "--batch", "32", "--ranks", "8", "--strategy", "static-ring:4", "--compare", "dhp"]) == 0
    text = capsys.readouterr().out
    assert "micro-batch 0" in text and "step time" in text and "comparison" in text
    assert main(["plan", "--model", "nope"]) == 2
    assert "known models" in capsys.readouterr().err
    assert main(["plan", "--batch", "16", "--ranks", "4", "--strategy", "bogus"]) == 2
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

    cmd = " ".join(map(shlex.quote, _dhp_cmd("plan", "--strategy", "flexsp", "--batch", "64", "--ranks", "8",
                                             "--compare", "", "--json")))
    check = f"{shlex.quote(sys.executable)} -c 'import json,sys; json.load(sys.stdin)'"
    r = subprocess.run(f"set -o pipefail; {cmd} | {check}", shell=True, executable="/bin/bash",
                       capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-2000:]


def test_closed_pipe_ends_quietly():
    import os
    import subprocess

    p = subprocess.Popen(_dhp_cmd("plan", "--batch", "64", "--ranks", "8", "--json"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=os.environ.copy())
    p.stdout.close()  # the reader is gone before the first byte (`| head` that already exited)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_time_limited_solver_says_it_is_not_proven_optimal():
    from dhp_jax.planner.cli import not_optimal

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
