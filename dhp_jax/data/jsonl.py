"""JSON and JSON-lines files, written whole and read with errors that name the file and the line.

- `JsonlAppender`: one record a line, each line written by a single `os.write` on a file opened
  with `O_APPEND` (so a line is never split into pieces another writer could land between, and a
  reader never meets half a record unless the process died inside that one call).
- `read_jsonl`: the records of a JSON-lines file; a line that is not JSON is an error naming the
  file and its line number (and, for the last line, that the file may be cut short).
- `read_json_file`: one JSON document; invalid JSON is an error naming the file and the line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonFileError(ValueError):
    """A JSON or JSON-lines file that cannot be parsed; the message names the file and the line
    (`line`, 1-based; `last`: it is the file's last line, so the file may be cut short)."""

    def __init__(self, message: str, line: int = 0, last: bool = False):
        super().__init__(message)
        self.line, self.last = line, last


def jsonl_lines(text: str, path: str | Path) -> list[tuple[int, Any]]:
    """(line number, record) of each non-blank line of JSON-lines `text` read from `path`;
    `JsonFileError` at the first line that is not JSON."""
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append((i + 1, json.loads(line)))
        except json.JSONDecodeError:
            raise JsonFileError(f"{path}: line {i + 1} is not valid JSON"
                                + (" (the last line: the file may be cut short, e.g. by a run killed while writing "
                                   "it, or by two runs writing at once)" if i == last else ""),
                                i + 1, i == last) from None
    return out


def read_jsonl(path: str | Path) -> list[Any]:
    """The records of a JSON-lines file, blank lines skipped; `JsonFileError` at the first bad line."""
    return [rec for _, rec in jsonl_lines(Path(path).read_text(), path)]


def read_json_file(path: str | Path, fix: str = "") -> Any:
    """One JSON document. Invalid JSON: `JsonFileError` "<path>: not valid JSON at line L (the file
    may be cut short)" and `fix`, the remedy the caller names."""
    path = Path(path)
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonFileError(f"{path}: not valid JSON at line {e.lineno} (the file may be cut short)"
                            + (f"; {fix}" if fix else "")) from None


class JsonlAppender:
    """Appends JSON records to `path`, one line each, each line in one `os.write` call
    (`append=False` starts the file empty)."""

    def __init__(self, path: str | Path, append: bool = True):
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, 0o644)

    def write(self, record: Any) -> None:
        self.write_line(json.dumps(record))

    def write_line(self, line: str) -> None:
        """One line (no newline in `line`), written whole: O_APPEND puts it at the end in one call."""
        if self._fd is None:
            raise ValueError(f"{self.path}: the writer is closed")
        data = (line + "\n").encode()
        done = os.write(self._fd, data)
        while done < len(data):   # a regular file takes it whole; a short write (disk full) finishes here
            done += os.write(self._fd, data[done:])

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
