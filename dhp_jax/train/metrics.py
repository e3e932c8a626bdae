"""Run output: progress, one JSONL line per step, optional TensorBoard, the end summary file.

Every number written says what it is: step times are wall-clock seconds measured on this
machine's devices; simulated figures carry the cost-model preset they come from. Progress fits
where stderr goes: on a terminal a tqdm bar; on a file or a pipe a plain line every few steps
(`plain_every`) and one when a step starts compiling, never a carriage return.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from dhp_jax.data.jsonl import JsonlAppender
from dhp_jax.data.jsonl import read_jsonl  # noqa: F401 (a run's JSONL files; errors name file and line)


class MetricsError(RuntimeError):
    pass


def _clean(x: Any) -> Any:
    """JSON-safe: numpy/jax scalars -> python, NaN/inf -> None."""
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def tensorboard_writer() -> Any:
    """tensorboardX's SummaryWriter class, or a clear error when it is not installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise MetricsError("metrics.tensorboard=true needs tensorboardX "
                           "(pip install 'dhp-jax[tensorboard]'), which is not installed") from None
    return SummaryWriter


_SPINNER = "|/-\\"


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_description_str(self, desc: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def on_terminal(stream: Any = None) -> bool:
    """Whether `stream` (default stderr) is a terminal, where a redrawn bar belongs."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class _PlainPhase(_NoBar):
    """A phase on a file or a pipe: one line when it starts, one when it ends."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.t0 = total, desc, 0, time.perf_counter()
        print(f"{desc} ...", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        if self.desc is not None:
            print(f"{self.desc}: {self.n}/{self.total} done in {time.perf_counter() - self.t0:.1f} s",
                  file=sys.stderr, flush=True)
            self.desc = None

    def __exit__(self, *exc: Any) -> None:
        self.close()


def phase_bar(total: int, desc: str, enabled: bool = True) -> Any:
    """Progress on stderr for a phase that takes more than a moment: a bar on a terminal, a line at
    its start and end on a file or a pipe, nothing when disabled."""
    if not enabled:
        return _NoBar()
    if not on_terminal():
        return _PlainPhase(total, desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")


def plain_every(total_steps: int) -> int:
    """How often a plain progress line is printed: about ten lines a run (every step of a short one)."""
    return max(1, -(-int(total_steps) // 10))


class MetricsWriter:
    """Writes `<out_dir>/metrics.jsonl` (appends on resume; each record one whole line), progress
    (a bar on a terminal, plain lines otherwise: `terminal`, default: whether stderr is one) and
    TensorBoard scalars."""

    def __init__(self, out_dir: str | Path, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = False, append: bool = False, terminal: bool | None = None):
        writer_cls = tensorboard_writer() if tensorboard else None  # fails before any file is touched
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._file = JsonlAppender(self.path, append=append)
        self._tb = writer_cls(str(self.out_dir / "tensorboard")) if writer_cls else None
        self._bar = None
        self.total_steps, self._done = int(total_steps), int(start_step)
        # plain progress lines (a file or a pipe): every `_every` steps, and the step a compile starts
        self._plain = progress and not (on_terminal() if terminal is None else terminal)
        self._every, self._said_compile = plain_every(total_steps), -1
        if progress and not self._plain:
            from tqdm import tqdm

            # no tqdm rate: wall time per bar tick would count compiles; the postfix shows the step time
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                             dynamic_ncols=True, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        self.records: list[dict] = []

    def compiling(self, count: int, done: int = 0, elapsed_s: float | None = None) -> None:
        """Say on the bar that the next step first compiles `count` group programs, `done` of them
        built so far (called every fraction of a second while the step waits, so the bar never sits
        frozen through a compile)."""
        if self._bar is not None:
            spin = "" if elapsed_s is None else f" {_SPINNER[int(elapsed_s * 4) % 4]} {elapsed_s:.0f} s"
            self._bar.set_description_str(f"train (compiling group programs: {min(done, count)}/{count} built{spin})")
        elif self._plain and self._said_compile != self._done + 1:
            self._said_compile = self._done + 1    # one line a step, not one a poll
            print(f"train: step {self._done + 1}/{self.total_steps}: compiling {count} group program(s)",
                  file=sys.stderr, flush=True)

    def log_step(self, record: Mapping[str, Any]) -> None:
        rec = _clean(dict(record))
        rec.setdefault("time", time.time())
        self.records.append(rec)
        self._file.write(rec)
        self._done = int(rec.get("step", self._done + 1))
        if self._tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time"):
                    self._tb.add_scalar(f"train/{k}", v, rec["step"])
        if self._bar is not None:
            self._bar.set_description_str("train", refresh=False)
            post = {"loss": f"{rec.get('loss', float('nan')):.3f}", "step": f"{1e3 * rec.get('step_time_s', 0):.0f} ms",
                    "plan wait": f"{1e3 * rec.get('plan_wait_s', 0):.1f} ms"}
            if rec.get("compile_s", 0) > 0.5:
                post["compile"] = f"{rec['compile_s']:.1f} s"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        elif self._plain and (self._done % self._every == 0 or self._done in (1, self.total_steps)):
            extra = f", compile {rec['compile_s']:.1f} s" if rec.get("compile_s", 0) > 0.5 else ""
            print(f"train: step {self._done}/{self.total_steps} loss {rec.get('loss', float('nan')):.4f} "
                  f"(step {1e3 * rec.get('step_time_s', 0):.0f} ms{extra})", file=sys.stderr, flush=True)

    def write_json(self, name: str, data: Mapping[str, Any]) -> Path:
        path = self.out_dir / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(_clean(dict(data)), indent=2) + "\n")
        tmp.replace(path)  # readers never see a half-written summary
        return path

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._file.close()


def truncate_jsonl(path: str | Path, keep: Callable[[dict], bool]) -> list[dict]:
    """Keep only the records `keep` accepts (a resumed run drops what it will redo); returns them.

    Rewritten atomically; a torn last line (a run killed mid-write) is dropped. No file: [].
    """
    path = Path(path)
    if not path.exists():
        return []
    kept, lines = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and keep(rec):
            kept.append(rec)
            lines.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    tmp.replace(path)
    return kept
