"""One run at a time in a run directory: an exclusive OS file lock, and no empty folders left behind.

`RunDir(path).acquire()` takes `fcntl.flock(LOCK_EX | LOCK_NB)` on `<path>/run.lock` and writes the
holder's pid and host into it. It is held for the run's life; the kernel drops it when the process
ends, however it ends, so a lock left by a dead process never blocks (the file stays, the lock does
not). A second run on the same directory (`--resume` included) is refused at once with
`RunLockedError` naming the directory and the holder's pid, before jax is imported.

A multi-process run locks per process what that process writes: process 0 the run directory,
process k > 0 its own `process-k/` (`lock_path`), so the processes of one run never block each
other and two runs on one directory still refuse each other.

A `checkpoint.dir` outside the run directory is a second directory the run writes: process 0
locks it too (`checkpoint_lock`, the same `run.lock` file inside it; every process of a run writes
its shards there under process 0's lock), and a checkpoint directory inside another live run's
directory is refused, so two runs never write one checkpoint directory, whatever their `--out`.

`release()` unlocks, removes the lock file, and removes the folders the run created that are still
empty (`track`: a run stopped before its first step leaves no empty `checkpoints/`, `jax-cache/`
or run directory it made); it releases the locks `attach`ed to it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path
from typing import Any

LOCK_NAME = "run.lock"
_HELD: dict[Path, "RunDir"] = {}    # the locks this process holds, by lock file


def held_here(out_dir: str | Path, process_index: int = 0) -> bool:
    """Whether this process already holds the lock of `out_dir` (the CLI takes it before the
    trainer, which then does not take it again)."""
    return lock_path(out_dir, process_index).resolve() in _HELD


class RunLockedError(RuntimeError):
    """Another live process holds the run directory's lock."""


def lock_path(out_dir: str | Path, process_index: int = 0) -> Path:
    """The lock file of process `process_index` of a run writing `out_dir` (process 0 writes the
    directory itself, process k > 0 its `process-k/`, as the trainer's `metrics_dir`)."""
    base = Path(out_dir) if not process_index else Path(out_dir) / f"process-{process_index}"
    return base / LOCK_NAME


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "another process (pid not yet written)"


class RunDir:
    """The lock on one run directory and the folders this run created in it."""

    def __init__(self, out_dir: str | Path, process_index: int = 0, *, role: str = "run directory",
                 remedy: str = "give another --out"):
        self.out_dir = Path(out_dir)
        self.path = lock_path(out_dir, process_index)
        self.role, self.remedy = role, remedy      # how a refusal names the directory and what to do
        self._fd: int | None = None
        self._created: list[Path] = []      # folders made by this run, outermost first
        self._attached: list[RunDir] = []   # locks released with this one

    def attach(self, other: "RunDir | None") -> None:
        """Release `other` (a lock this run holds too) whenever this lock is released."""
        if other is not None:
            self._attached.append(other)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def track(self, *folders: str | Path) -> None:
        """Note the folders among `folders` that do not exist yet: this run creates them, and
        `release` removes those left empty."""
        for f in map(Path, folders):
            for p in reversed([f, *f.parents]):
                if not p.exists() and p not in self._created:
                    self._created.append(p)

    def check_free(self) -> None:
        """`RunLockedError` when another process holds the lock; creates nothing (a dry run)."""
        if not self.path.exists():
            return
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockedError(self._refusal()) from None
        finally:
            os.close(fd)

    def acquire(self) -> "RunDir":
        """Take the lock (creating the directory and the lock file); `RunLockedError` at once when
        another live process holds it."""
        import fcntl

        self.track(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                self.release()     # the folders made above, if empty
                raise RunLockedError(self._refusal()) from None
            # the holder before us may have removed the file between our open and our lock: then we
            # hold a lock on a file no one else can see; take the file that is there instead
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        _HELD[self.path.resolve()] = self
        return self

    def _refusal(self) -> str:
        return (f"{self.role} {str(self.out_dir.resolve())!r} is in use by another run ({_holder(self.path)}, "
                f"lock {self.path.name}); wait for it to end or {self.remedy}")

    def release(self) -> None:
        """Unlock, remove the lock file, and remove the folders this run created that are empty; then
        the same for the attached locks."""
        if self._fd is not None:
            _HELD.pop(self.path.resolve(), None)
            with contextlib.suppress(OSError):
                os.unlink(self.path)        # while still locked: a waiting process re-checks the file
            os.close(self._fd)
            self._fd = None
        for folder in reversed(self._created):   # innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()                   # only an empty one
        self._created = [p for p in self._created if p.exists()]
        while self._attached:
            self._attached.pop().release()

    def __enter__(self) -> "RunDir":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def checkpoint_lock(out_dir: str | Path, checkpoint_dir: str | Path, process_index: int = 0, *,
                    dry_run: bool = False) -> RunDir | None:
    """Process 0's lock on a checkpoint directory outside the run directory, taken now (None: the
    directory is inside the run directory, which the run's own lock covers, or this is process
    k > 0). `RunLockedError` when another live run holds it, or holds a run directory it lies in.
    `dry_run`: only check, create and hold nothing."""
    out, ckpt = Path(out_dir).resolve(), Path(checkpoint_dir).resolve()
    if process_index or ckpt == out or out in ckpt.parents:
        return None
    lock = RunDir(ckpt, role="checkpoint directory", remedy="give another checkpoint.dir")
    for run in ckpt.parents:       # another run's directory it lies in (this run's own are skipped)
        if (run / LOCK_NAME).exists() and (run / LOCK_NAME).resolve() not in _HELD:
            try:
                RunDir(run).check_free()
            except RunLockedError:
                raise RunLockedError(f"checkpoint directory {str(ckpt)!r} lies in run directory {str(run)!r}, "
                                     f"which is in use by another run ({_holder(run / LOCK_NAME)}); wait for "
                                     f"it to end or give another checkpoint.dir") from None
    if dry_run:
        lock.check_free()
        return None
    lock.track(ckpt)
    return lock.acquire()
