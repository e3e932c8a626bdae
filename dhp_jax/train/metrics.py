"""Run output: a progress bar, one JSONL line per step, optional TensorBoard, the end summary file.

Every number written says what it is: step times are wall-clock seconds measured on this
machine's devices; simulated figures carry the cost-model preset they come from.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping


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


class MetricsWriter:
    """Writes `<out_dir>/metrics.jsonl` (appends on resume), a progress bar, and TensorBoard scalars."""

    def __init__(self, out_dir: str | Path, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = False, append: bool = False):
        writer_cls = tensorboard_writer() if tensorboard else None  # fails before any file is touched
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if not append and self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a")
        self._tb = writer_cls(str(self.out_dir / "tensorboard")) if writer_cls else None
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             file=sys.stderr, dynamic_ncols=True, leave=True)
        self.records: list[dict] = []

    def log_step(self, record: Mapping[str, Any]) -> None:
        rec = _clean(dict(record))
        rec.setdefault("time", time.time())
        self.records.append(rec)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time"):
                    self._tb.add_scalar(f"train/{k}", v, rec["step"])
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{rec.get('loss', float('nan')):.3f}",
                                  step_s=f"{rec.get('step_time_s', 0):.2f}",
                                  wait_ms=f"{1e3 * rec.get('plan_wait_s', 0):.1f}", refresh=False)
            self._bar.update(1)

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


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
