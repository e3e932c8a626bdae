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
        assert r["speedup"] >= 1.0 - 1e-9  # dhp is never slower than the best static degree here
    assert png.stat().st_size > 1000


def test_dhp_plan_table_and_errors(capsys):
    assert main(["plan", "--batch", "32", "--ranks", "8", "--strategy", "static-ring:2", "--compare", "dhp"]) == 0
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
