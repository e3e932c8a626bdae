"""`dhp train` as a user runs it (subprocesses): the demo shows DHP's irregular groups and the
simulated 64-rank comparison, and no run is ever lost (used directory, finished run, SIGKILL).

Kept short: 2 steps of the demo on a data seed whose first batches need groups of three degrees,
one not a power of two (few group programs), the simulated comparison only; the kill test runs a one-program static plan.
"""

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dhp_jax.train.train_config import load_config
from dhp_jax.train.metrics import read_jsonl

# the demo, shortened: data.seed=3's two batches are planned on three degrees (6 and 1, then 8), one
# of them not a power of two, on four group programs in all (the test asserts the degrees, so a
# planner change that loses this shows here); no warm-up, so the one update between the two logged
# losses is taken at the full learning rate
DEMO_SHORT = ["steps=2", "data.seed=3", "data.max_tokens=96", "min_bucket=128", "optim.warmup_steps=0",
              "optim.learning_rate=0.01", "checkpoint.every=0", "compare.batches=1", "compare.measured=false",
              "metrics.progress=false"]


def _dhp(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dhp_jax", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


def _snapshot(run: Path) -> dict:
    """Every file of a run directory and its digest: what 'nothing changed' compares."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def test_demo_shows_dhp_and_never_loses_the_run(tmp_path):
    out = tmp_path / "demo"
    r = _dhp("train", *DEMO_SHORT, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["model_config"]["name"] == "tiny-qwen2_5_vl"      # the default: a real family's architecture
    degrees = {int(d) for d in s["groups_by_degree"]}
    assert len(degrees) >= 3 and any(d & (d - 1) for d in degrees), s["groups_by_degree"]
    assert s["loss_last"] < s["loss_first"]
    sim = s["compare"]["simulated"]
    assert sim["ranks"] == 64 and sim["batch_size"] == 512 and sim["speedup_vs_best_static"] > 0
    assert "64 ranks" in r.stdout and "qwen3-vl-2b on ascend-910b" in r.stdout and "(simulated)" in r.stdout
    assert "not powers of two" in r.stdout and "correctness and overhead run" in r.stdout
    assert {"steps", "compiles", "comparison"} <= set(s["time_s"])
    assert (out / "plan_simulated_step.png").stat().st_size > 0
    assert [x["step"] for x in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    before = _snapshot(out)

    # a fresh run into the used directory is refused, in one line naming both ways on
    again = _dhp("train", *DEMO_SHORT, "--out", str(out))
    assert again.returncode == 2 and again.stdout == ""
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume" in lines[0] and "--overwrite" in lines[0], again.stderr
    assert _snapshot(out) == before

    # --resume on the finished run says so and changes nothing
    done = _dhp("train", *DEMO_SHORT, "--out", str(out), "--resume")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "already finished (step 2 of 2" in done.stderr
    assert _snapshot(out) == before


def test_every_step_of_the_shipped_demo_plans():
    """The demo as shipped (`dhp train`, 20 steps): every batch plans with its planner settings (no
    execution: the executed demo above runs 2 steps), priced as the run prices them, each step on
    its cheapest candidate, on groups of several degrees, some not powers of two: the groups the
    README's summary shows. A cost model or planner change that makes a demo batch unplannable
    fails here, not at a user's step 3."""
    from collections import Counter

    from dhp_jax.geometry.layout import GROWTH, LINEAR_CHUNK, MIN_BUCKET
    from dhp_jax.train.plans import attach_programs
    from dhp_jax.train.trainer import prepare_run

    cfg = load_config()
    setup = prepare_run(cfg)
    # priced as the run prices them: a plan that needs a program no earlier step's plan needed pays
    # the config's compile price (`Trainer` attaches the same)
    attach_programs(setup.plan_source, cfg.planner.compile_price_s, (cfg.min_bucket or MIN_BUCKET, GROWTH, LINEAR_CHUNK),
                    None)
    degrees = set()
    groups, choices = Counter(), Counter()
    for step in range(cfg.steps):
        plan = setup.plan_source(step, setup.pipeline.batch(step))
        plan.validate(num_heads=setup.model_config.num_heads)    # attention kinds the executed model runs
        assert len(plan.micro_batches) == cfg.planner.num_micro_batches
        # each step runs its cheapest candidate (the search's own plan, a static plan or a
        # FlexSP-style packing), priced with the programs it adds to the earlier steps'
        chosen = plan.solver.get("chosen", "dhp")
        choices[chosen] += 1
        if chosen != "dhp":
            assert plan.solver["est_makespan_sum_s"] < plan.solver["dhp_search_makespan_sum_s"], (step, plan.solver)
        degrees |= {g.degree for mb in plan.micro_batches for g in mb.groups}
        groups.update(g.degree for mb in plan.micro_batches for g in mb.groups)
    assert len(degrees) >= 4 and sum(d & (d - 1) > 0 for d in degrees) >= 2, degrees
    assert choices["dhp"] >= cfg.steps // 2, choices      # on these long-tailed batches mixing mostly wins
    # the README's demo summary shows these plans' groups
    line = "groups run: " + ", ".join(f"{n} of degree {d}" for d, n in sorted(groups.items()))
    assert line + " (" in (Path(__file__).resolve().parents[1] / "README.md").read_text(), line


# the kill test: a static degree-8 plan (one program), 5 steps, a checkpoint every 2
KILL = ["model=tiny", "steps=5", "checkpoint.every=2", "planner.strategy=static-ring:8", "data.batch_size=8",
        "data.max_tokens=48", "min_bucket=512", "compare.enabled=false", "metrics.progress=false"]


def test_killed_run_resumes_each_step_logged_once_same_losses(tmp_path):
    from dhp_jax.train.trainer import Trainer

    out = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "dhp_jax", "train", *KILL, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # mid-step: step 3 is logged, the last checkpoint is step 2
    proc.wait()
    logged = [x["step"] for x in read_jsonl(metrics)]
    assert max(logged) in (3, 4), logged  # records past the last checkpoint, run unfinished

    resumed = _dhp("train", *KILL, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    m = re.search(r"resumed from step (\d+) \(checkpoint ", resumed.stderr)
    assert m and int(m.group(1)) in (2, 4) and int(m.group(1)) <= max(logged), resumed.stderr
    recs = read_jsonl(metrics)
    assert [x["step"] for x in recs] == list(range(1, 6))
    assert [x["step"] for x in read_jsonl(out / "plans.jsonl")] == list(range(1, 6))   # numbered as metrics.jsonl

    # the reference loads the killed run's program from its compilation cache (when it is the first
    # cache this process sets: a worker that ran a trainer before keeps that one, and compiles)
    full = Trainer(load_config(None, KILL + [f"metrics.out_dir={tmp_path / 'full'}", "checkpoint.every=0",
                                             f"compilation_cache={out / 'jax-cache'}"])).run()
    np.testing.assert_array_equal([x["loss"] for x in recs], full.losses)


def test_truncate_jsonl_keeps_earlier_records_and_drops_a_torn_line(tmp_path):
    from dhp_jax.train.metrics import truncate_jsonl

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, 6)) + '{"step": 6, "lo')
    kept = truncate_jsonl(path, lambda r: r["step"] <= 3)
    assert [r["step"] for r in kept] == [1, 2, 3] == [r["step"] for r in read_jsonl(path)]
    assert truncate_jsonl(tmp_path / "none.jsonl", lambda r: True) == []


class _Stderr:
    """A child's stderr read as it comes (progress bars end lines with \\r, not \\n)."""

    def __init__(self, proc):
        import threading

        self.text = ""
        self._proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while True:
            chunk = os.read(self._proc.stderr.fileno(), 65536)
            if not chunk:
                return
            self.text += chunk.decode(errors="replace")

    def wait_for(self, cond, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._proc.poll() is None and not cond():
            time.sleep(0.02)
        assert cond(), f"never seen; stderr:\n{self.text[-3000:]}"

    def last_line(self):
        self._thread.join(timeout=10)
        return self.text.replace("\r", "\n").strip().splitlines()[-1]


def _interrupt(proc) -> float:
    """SIGINT, as Ctrl-C sends it; the seconds until the process has ended."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    return time.monotonic() - t0


# Ctrl-C: the kill test's one-program run, longer, with its progress bar, no compilation cache (so
# the first step compiles)
CTRL_C = ["steps=500", "checkpoint.every=0", "compilation_cache=null"] + \
    [a for a in KILL if a.split("=")[0] not in ("steps", "checkpoint.every", "metrics.progress")]


def test_ctrl_c_during_the_first_compile_stops_at_once_and_leaves_no_empty_files(tmp_path):
    out = tmp_path / "cc"
    proc = subprocess.Popen([sys.executable, "-m", "dhp_jax", "train", *CTRL_C, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    err = _Stderr(proc)
    err.wait_for(lambda: "train: step 1/500: compiling 1 group program(s)" in err.text)
    took = _interrupt(proc)
    # the compile (seconds) runs on a helper thread: the main thread leaves its wait at once
    assert proc.returncode == 130 and took < 4.0, (took, err.text[-2000:])
    line = err.last_line()
    assert line.startswith("dhp train: interrupted before a step finished, nothing new saved; run again with: "
                           "dhp train steps=500"), line
    assert "Traceback" not in err.text and "KeyboardInterrupt" not in err.text
    assert not (out / "metrics.jsonl").exists() and not (out / "plans.jsonl").exists()
    assert not (out / "summary.json").exists()
    assert not out.exists()     # nor the empty folders it made: checkpoints/, the run directory


def test_ctrl_c_while_jax_is_imported_leaves_nothing(tmp_path):
    """Ctrl-C as soon as the run says it is starting (jax being imported): one line, exit 130, and
    no folder of the run left behind (it had made the run directory to hold its lock)."""
    out = tmp_path / "early"
    proc = subprocess.Popen([sys.executable, "-m", "dhp_jax", "train", *CTRL_C, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    err = _Stderr(proc)
    err.wait_for(lambda: "importing jax" in err.text)
    _interrupt(proc)
    assert proc.returncode == 130 and "Traceback" not in err.text, err.text[-2000:]
    assert err.last_line().startswith("dhp train: interrupted before a step finished, nothing new saved")
    assert not out.exists()


def test_ctrl_c_after_steps_checkpoints_the_last_one_and_prints_the_resume_command(tmp_path):
    from dhp_jax import cli
    from dhp_jax.train.checkpoint import Checkpointer

    out = tmp_path / "cc"
    proc = subprocess.Popen([sys.executable, "-m", "dhp_jax", "train", *CTRL_C, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    err = _Stderr(proc)
    metrics = out / "metrics.jsonl"
    err.wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2)
    # a second run on the directory while this one trains: refused at once, naming the holder
    t0 = time.monotonic()
    second = _dhp("train", *CTRL_C, "--out", str(out), "--resume")
    assert second.returncode == 2 and time.monotonic() - t0 < 5.0, second.stderr
    assert second.stderr.strip().splitlines() == [
        f"dhp train: run directory {str(out.resolve())!r} is in use by another run (pid {proc.pid} on "
        f"{os.uname().nodename}, lock run.lock); wait for it to end or give another --out"]
    took = _interrupt(proc)
    assert proc.returncode == 130 and took < 8.0, (took, err.text[-2000:])
    line = err.last_line()
    m = re.fullmatch(r"dhp train: interrupted after step (\d+) of 500, checkpoint (\S+); resume with: (.*)", line)
    assert m, line
    step = int(m.group(1))
    assert "Traceback" not in err.text
    assert [x["step"] for x in read_jsonl(metrics)] == list(range(1, step + 1))   # every finished step, once, whole
    assert [x["step"] for x in read_jsonl(out / "plans.jsonl")] == list(range(1, step + 1))
    # stderr is a pipe: plain progress lines, no bar redrawn with carriage returns
    assert "\r" not in err.text and "train: step 1/500 loss " in err.text, err.text[-2000:]
    ckpt = Checkpointer(out / "checkpoints")
    assert ckpt.latest_step() == step and m.group(2) == str(ckpt.directory / str(step))
    ckpt.close()
    argv = shlex.split(m.group(3))
    assert argv[:2] == ["dhp", "train"] and argv[-1] == "--resume" and f"--out={out}" in argv
    assert cli._parser("train").parse_args(argv[1:]).resume
