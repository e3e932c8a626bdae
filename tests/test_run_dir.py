"""One run at a time in a run directory (`dhp_jax.train.rundir`), and JSONL records written whole.

Real processes, kept cheap: the run holding the directory is a helper process that takes the lock
as `dhp train` does and appends records as a run does; the refused `dhp train` never imports jax.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dhp_jax.data.jsonl import JsonFileError, JsonlAppender, read_jsonl
from dhp_jax.train.rundir import RunDir, RunLockedError

# holds the lock of argv[1] (process argv[2]) and appends to argv[1]/metrics.jsonl: one record per
# "w" line read on stdin, until "q"
HOLDER = """
import sys
from dhp_jax.data.jsonl import JsonlAppender
from dhp_jax.train.rundir import RunDir
lock = RunDir(sys.argv[1], int(sys.argv[2])).acquire()
log = JsonlAppender(lock.path.parent / "metrics.jsonl")
print("held", flush=True)
step = 0
for line in sys.stdin:
    if line.strip() == "q":
        break
    step += 1
    log.write({"step": step, "loss": 1.0 / step, "pad": "x" * 20000})
    print("wrote", flush=True)
lock.release()
"""

# `dhp train ARGS` in a fresh interpreter: its exit status, whether jax was imported, its seconds
TRAIN = """
import json, sys, time
t0 = time.perf_counter()
from dhp_jax.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "jax": "jax" in sys.modules, "s": time.perf_counter() - t0}))
"""


def _env():
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _holder(run: Path, process: int = 0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(process)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def _tell(proc: subprocess.Popen, what: str) -> None:
    proc.stdin.write(what + "\n")
    proc.stdin.flush()
    if what == "w":
        assert proc.stdout.readline().strip() == "wrote"


def _train(*args: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", TRAIN, "train", *args], capture_output=True, text=True, timeout=120,
                       env=_env())
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_a_second_run_on_a_directory_is_refused_at_once(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        for _ in range(3):
            _tell(holder, "w")
        for extra in ([], ["--resume"], ["--dry-run"]):
            res, err = _train("model=tiny", "steps=2", "--out", str(run), *extra)
            lines = err.strip().splitlines()
            assert res["rc"] == 2 and len(lines) == 1, (extra, err)
            assert lines[0] == (f"dhp train: run directory {str(run.resolve())!r} is in use by another run (pid "
                                f"{holder.pid} on {os.uname().nodename}, lock run.lock); wait for it to end or give "
                                f"another --out"), lines
            assert not res["jax"] and res["s"] < 5.0, res     # refused before jax is imported
        _tell(holder, "w")
        _tell(holder, "q")
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
    # the holder's log is whole (the refused runs wrote nothing), and its lock file is gone
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_a_lock_left_by_a_killed_process_never_blocks(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    with pytest.raises(RunLockedError, match=f"pid {holder.pid} "):
        RunDir(run).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (run / "run.lock").exists()           # the file stays; the kernel dropped the lock
    lock = RunDir(run).acquire()
    try:
        assert (run / "run.lock").read_text().startswith(f"pid {os.getpid()} ")
    finally:
        lock.release()
    assert not (run / "run.lock").exists()


def test_the_processes_of_one_run_do_not_block_each_other(tmp_path):
    """Process 0 locks the run directory, process k its process-k/: a run's processes take their
    locks side by side; a second run's process 1 is refused by the first run's."""
    run = tmp_path / "run"
    first = [_holder(run, 0), _holder(run, 1)]
    try:
        assert (run / "run.lock").exists() and (run / "process-1" / "run.lock").exists()
        with pytest.raises(RunLockedError, match=f"pid {first[1].pid} "):
            RunDir(run, 1).acquire()
        for proc in first:
            _tell(proc, "q")
            assert proc.wait(timeout=30) == 0
    finally:
        for proc in first:
            proc.kill()
    RunDir(run, 1).acquire().release()


def test_a_refused_run_leaves_no_folder_it_created(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        lock = RunDir(tmp_path / "run")
        lock.track(tmp_path / "run" / "checkpoints", tmp_path / "other" / "jax-cache")
        with pytest.raises(RunLockedError):
            lock.acquire()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
        _tell(holder, "q")
        holder.wait(timeout=30)
    finally:
        holder.kill()


def test_two_runs_never_write_one_checkpoint_directory(tmp_path):
    """A `checkpoint.dir` outside the run directory is locked by the run too: another run naming
    it (whatever its --out, --resume and --dry-run included) is refused at once, before jax is
    imported, as is a checkpoint directory lying inside another live run's directory; a refused
    run leaves no folder or lock behind."""
    shared, run = tmp_path / "shared-ckpt", tmp_path / "run"
    holder = _holder(shared)              # a live run's lock on the checkpoint directory
    try:
        for extra in ([], ["--resume"], ["--dry-run"]):
            res, err = _train("model=tiny", "steps=2", f"checkpoint.dir={shared}", "--out", str(tmp_path / "other"),
                              *extra)
            lines = err.strip().splitlines()
            assert res["rc"] == 2 and len(lines) == 1, (extra, err)
            assert lines[0] == (f"dhp train: checkpoint directory {str(shared.resolve())!r} is in use by another run "
                                f"(pid {holder.pid} on {os.uname().nodename}, lock run.lock); wait for it to end or "
                                f"give another checkpoint.dir"), lines
            assert not res["jax"], res
        assert not (tmp_path / "other").exists()          # the refused run's folders are gone
        _tell(holder, "q")
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
    holder = _holder(run)                 # a live run; another run's checkpoints inside its directory
    try:
        for extra in ([], ["--dry-run"]):
            res, err = _train("model=tiny", "steps=2", f"checkpoint.dir={run / 'checkpoints'}", "--out",
                              str(tmp_path / "other"), *extra)
            assert res["rc"] == 2 and not res["jax"], (extra, err)
            assert err.strip().splitlines() == [
                f"dhp train: checkpoint directory {str((run / 'checkpoints').resolve())!r} lies in run directory "
                f"{str(run.resolve())!r}, which is in use by another run (pid {holder.pid} on {os.uname().nodename}); "
                f"wait for it to end or give another checkpoint.dir"], err
        assert not (run / "checkpoints").exists() and not (tmp_path / "other").exists()
        _tell(holder, "q")
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()


def test_a_run_holds_its_outside_checkpoint_directory_until_it_ends(tmp_path):
    """The API path (`Trainer.run` without the CLI) takes the same two locks through
    `checkpoint_lock`; process k > 0 and a checkpoint directory inside the run's own take none."""
    from dhp_jax.train.rundir import checkpoint_lock

    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    with RunDir(run) as lock:
        lock.attach(checkpoint_lock(run, ckpt))
        assert (ckpt / "run.lock").exists()
        with pytest.raises(RunLockedError, match="checkpoint directory .* is in use by another run"):
            checkpoint_lock(tmp_path / "run2", ckpt, dry_run=True)
        assert checkpoint_lock(run, ckpt, 1) is None and checkpoint_lock(run, run / "checkpoints") is None
    assert not ckpt.exists() and not run.exists()          # both released; the empty folders removed


APPENDER = """
import os, sys, time
from dhp_jax.data.jsonl import JsonlAppender
with JsonlAppender(sys.argv[1]) as log:
    print("ready", flush=True)
    while not os.path.exists(sys.argv[1] + ".go"):    # both start writing at the same moment
        time.sleep(0.001)
    for i in range(int(sys.argv[3])):
        log.write({"writer": sys.argv[2], "i": i, "pad": sys.argv[2] * 20000})
"""


def test_records_written_at_once_by_two_processes_stay_whole(tmp_path):
    """Two writers append 20 KB records to one file at the same time: every line is one whole record
    (each is one write call on an O_APPEND file), none lost."""
    path = tmp_path / "m.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path), w, "1500"], stdout=subprocess.PIPE, text=True,
                              env=_env()) for w in "ab"]
    assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
    Path(f"{path}.go").touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    recs = read_jsonl(path)
    assert sorted((r["writer"], r["i"]) for r in recs) == sorted((w, i) for w in "ab" for i in range(1500))
    assert all(r["pad"] == r["writer"] * 20000 for r in recs)


def test_a_torn_last_line_is_named_with_its_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with JsonlAppender(path, append=False) as log:
        for step in range(1, 21):
            log.write({"step": step})
    path.write_text(path.read_text() + "}\n")
    with pytest.raises(JsonFileError, match=r"metrics.jsonl: line 21 is not valid JSON \(the last line: the file "
                                            r"may be cut short"):
        read_jsonl(path)
