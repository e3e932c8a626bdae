"""A checkpoint's flat params vector as the whole params tree from its layout record alone (NumPy,
no jax, no model config): what the torch backend reads a `dhp train` checkpoint with.

The record is `FlatLayout.record` (t = 1: the leaves end to end, then the zero padding) or
`TensorLayout.record` (t > 1: the master vector holds t rows, each device's share, interleaved
over (rank, tp): device r t + i holds part r of row i; `local` lays out one row, `split` says how
each leaf's shares join). The rule is `dhp_jax.sharding.tensor_parallel.TensorLayout.unravel`'s: split
leaves concatenated along their axis (a fused one part by part), a shared kv head read from its
first holder, vocab ids from their owner's window, replicated leaves from tp index 0.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


class RecordError(ValueError):
    """A layout record that does not describe the vector it came with; the message says how."""


def _cut(flat: np.ndarray, leaves: Any) -> dict[str, np.ndarray]:
    out, at = {}, 0
    for path, shape, _dtype in leaves:
        n = int(np.prod(shape, dtype=np.int64))
        if at + n > flat.size:
            raise RecordError(f"leaf {path} {list(shape)} ends at {at + n}, past the {flat.size} values there")
        out[path] = flat[at:at + n].reshape(shape)
        at += n
    return out


def unravel_record(flat: np.ndarray, record: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """{leaf path "a/b/c": array} of the whole params tree held in `flat` (a master vector or an
    AdamW moment) laid out as `record` says; `RecordError` when they do not fit."""
    flat = np.asarray(flat).reshape(-1)
    if flat.size != int(record["padded"]):
        raise RecordError(f"the vector has {flat.size} values, the layout record says {record['padded']}")
    t = int(record.get("tensor_parallel", 1))
    if t == 1:
        out = _cut(flat, record["leaves"])
        if sum(x.size for x in out.values()) != int(record["size"]):
            raise RecordError(f"the record's leaves hold {sum(x.size for x in out.values())} values, not "
                              f"{record['size']}")
        return out
    if "split" not in record or "local" not in record:
        raise RecordError(f"a tensor_parallel={t} record without its split rule (written by an older dhp_jax); "
                          "resume the run with `dhp train --resume` for a step to write one that has it")
    local = record["local"]
    ranks, row = int(local["num_shards"]), int(local["padded"])
    if ranks * t * (row // ranks) != flat.size or row % ranks:
        raise RecordError(f"{flat.size} values are not t={t} rows of {row} over {ranks} ranks")
    rows = flat.reshape(ranks, t, row // ranks).transpose(1, 0, 2).reshape(t, row)
    shares = [_cut(rows[i], local["leaves"]) for i in range(t)]
    vocab = int(record["vocab"])
    vl = -(-vocab // t)
    out = {}
    for path, kind, axis, groups in record["split"]:
        if kind == "replicated":
            out[path] = shares[0][path]
        elif kind == "split":
            out[path] = np.concatenate([s[path] for s in shares], axis=axis)
        elif kind == "shared":
            out[path] = np.concatenate([shares[h * (t // groups)][path] for h in range(groups)], axis=axis)
        elif kind == "fused":
            sh = shares[0][path].shape
            parts = [s[path].reshape(sh[:axis] + (groups, sh[axis] // groups) + sh[axis + 1:]) for s in shares]
            out[path] = np.concatenate(parts, axis=axis + 1).reshape(sh[:axis] + (t * sh[axis],) + sh[axis + 1:])
        elif kind == "vocab":
            parts = []
            for i in range(t):
                own, start = i * vl, min(i * vl, vocab - vl)
                if own < vocab:
                    parts.append(np.take(shares[i][path], np.arange(own - start, own - start + min(vl, vocab - own)),
                                         axis=axis))
            out[path] = np.concatenate(parts, axis=axis)
        else:
            raise RecordError(f"leaf {path}: unknown split kind {kind!r}")
    whole = {p: tuple(s) for p, s, _ in record["leaves"]}
    wrong = [f"{p}: joined {list(out[p].shape)} vs recorded {list(whole[p])}" for p in out
             if p in whole and out[p].shape != whole[p]]
    missing = sorted(set(whole) ^ set(out))
    if wrong or missing:
        raise RecordError("the split rule does not rebuild the recorded leaves: "
                          + "; ".join(wrong[:4] + [f"{p} not in both" for p in missing[:4]]))
    return {p: out[p] for p, _, _ in record["leaves"]}
