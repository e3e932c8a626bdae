"""Token layout of one CP group: its samples packed into one padded, zigzag-permuted stream.

Pure NumPy (no jax): the JAX sharding compiler and the torch backend both consume it.

`pack_group(samples, degree, config)` concatenates the group's samples in the given order into one
sequence of `num_tokens` real tokens and lays it out in a stream of S = `bucket_length(num_tokens,
degree)` slots permuted with the zigzag order for `degree`. All per-token arrays below are in that
final (permuted) order, length S; shard i of a degree-d group is `array[i*S/d:(i+1)*S/d]`.

Where the padding goes (`real_slots`): every shard holds n // d or n // d + 1 real tokens (the
first n % d shards one more) as a prefix of the shard, its padding at the shard's end, so each
rank has the same real work and can skip its pad tail (the executors' linear layers do, chunk by
chunk). The real tokens fill, in order, the stream positions (unpermuted) left free by those
tails: zigzag order, so the causal attention work stays balanced. `GroupLayout.real_index` is
the slot of each real token in the permuted arrays; `tokens(x)` reads them back in order.

Per-token arrays (`GroupLayout.arrays()`):
- token_ids int32: text token ids (0 on vision and pad tokens);
- pixels float32[S, patch_dim]: one merged patch per vision token (0 on text and pad);
- vision_mask bool: token comes from an image/video segment;
- segment_ids int32: 1 + index of the sample inside the group; 0 = padding;
- positions int32: offset of the token inside its sample (text and vision alike);
- span_ids int32: decoder bidirectional span, 1.. unique per vision segment in the group, 0 = text;
- frame_ids int32: vision-encoder frame, 1.. unique per frame in the group, 0 = not vision.
  A segment's frames are consecutive runs of `tokens_per_frame` tokens (the last may be shorter);
  without `tokens_per_frame` the whole segment is one frame;
- frame_positions int32: offset inside the frame (0 outside vision);
- targets int32: next token id where loss_weights is 1, else 0;
- loss_weights float32: 1 on a text token whose next token (same sample) is text, else 0.

The mask rule that goes with these ids is in `dhp_jax.model.attention`; because it reads ids
and never stream order, the permutation and the padding (wherever it sits) change no result.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import numpy as np

from dhp_jax.data.sample import Sample

# The per-token inputs, one list for the flax model, the torch model and both executors.
MODEL_INPUTS = ("token_ids", "pixels", "vision_mask", "segment_ids", "positions", "span_ids",
                "frame_ids", "frame_positions")
ARRAY_NAMES = MODEL_INPUTS + ("targets", "loss_weights")   # what a layout holds
FLOAT_ARRAYS = ("pixels", "loss_weights")
INT_ARRAYS = tuple(k for k in ARRAY_NAMES if k not in FLOAT_ARRAYS and k != "vision_mask")

MIN_BUCKET = 16
GROWTH = 2.0
LINEAR_CHUNK = 256    # the executors' default pad-skipping chunk (tokens; `linear_tokens`)


def _check_ladder(min_bucket: int, growth: float) -> None:
    if min_bucket < 1 or growth <= 1.0:
        raise ValueError(f"bucket ladder needs min_bucket >= 1 and growth > 1, got {min_bucket}, {growth}")


def ladder(n: int, min_bucket: int = MIN_BUCKET, growth: float = GROWTH) -> int:
    """Smallest rung of the geometric ladder ceil(min_bucket * growth**k) that holds n tokens."""
    return int(ladders(n, min_bucket, growth))


@functools.lru_cache(maxsize=32)
def _rungs(min_bucket: int, growth: float) -> tuple[list[float], np.ndarray]:
    """Every rung ceil(min_bucket * growth**k) up to 2**48 tokens, walked once, as a list (scalar
    lookups by bisection) and an array (vectorised lookups)."""
    _check_ladder(min_bucket, growth)
    out, k, rung = [], 0, float(min_bucket)
    while rung < 2.0 ** 48:
        if not out or rung > out[-1]:
            out.append(rung)
        k += 1
        rung = float(math.ceil(min_bucket * growth ** k))
    out.append(rung)
    return out, np.asarray(out)


def rung_list(min_bucket: int = MIN_BUCKET, growth: float = GROWTH) -> list[float]:
    """The walked ladder (ascending rungs, as floats): `bisect_left` on it for max(ceil(tokens), 1)
    gives `ladders` of one count. Shared, do not modify."""
    return _rungs(int(min_bucket), float(growth))[0]


def ladders(tokens: Any, min_bucket: int = MIN_BUCKET, growth: float = GROWTH) -> np.ndarray:
    """`ladder` for an array of token counts (float64, same shape): the smallest rung that holds
    each count, looked up in the walked ladder (no float log, so rounding never moves a rung)."""
    lst, arr = _rungs(int(min_bucket), float(growth))
    if np.ndim(tokens) == 0:  # the planner's scalar path: plain floats
        return np.float64(lst[bisect.bisect_left(lst, max(math.ceil(float(tokens)), 1))])
    n = np.maximum(np.ceil(np.asarray(tokens, dtype=np.float64)), 1.0)
    return arr[np.searchsorted(arr, n, side="left")]


def bucket_lengths(tokens: Any, degree: Any, min_bucket: int = MIN_BUCKET, growth: float = GROWTH,
                   max_per_device: float | None = None, menu: Any = ()) -> np.ndarray:
    """The bucket rule, vectorised: the padded stream length for `tokens` on `degree` devices is
    the ladder rung, rounded up to a multiple of 2*degree (two zigzag chunks per device). The
    planner's cost model, the simulator and both executors all price and run this length.

    `max_per_device` (a memory limit in tokens per device) clamps the rung: padding never takes a
    group that fits unpadded over it (one extra, memory-sized bucket per degree at most); the
    result still holds the tokens, rounded up to 2*degree.

    `menu` (pairs `(degree, (bucket, ...))`, buckets ascending multiples of 2*degree, e.g. a fitted
    `planner.programs.menu.BucketMenu`) replaces the ladder for its degrees: the smallest menu bucket that
    holds the tokens (the ladder only where none does)."""
    if isinstance(tokens, (int, float)) and isinstance(degree, (int, float)):
        out = _bucket_scalar(tokens, degree, int(min_bucket), float(growth), max_per_device)
        for d, buckets in menu:
            if d == degree:
                k = bisect.bisect_left(buckets, tokens)
                return float(buckets[k]) if k < len(buckets) else out
        return out
    d = np.asarray(degree, dtype=np.float64)
    if np.any(d < 1):
        raise ValueError(f"degree must be >= 1, got {degree}")
    step = 2.0 * d
    rung = ladders(tokens, min_bucket, growth)
    if max_per_device is not None:
        rung = np.maximum(np.minimum(rung, np.floor(max_per_device * d / step) * step), np.asarray(tokens, float))
    out = np.ceil(rung / step) * step
    if menu:
        n, d = np.broadcast_arrays(np.asarray(tokens, dtype=np.float64), d)
        out = np.array(np.broadcast_to(out, n.shape), dtype=np.float64)
        for deg, buckets in menu:
            on = d == deg
            if on.any():
                table = np.asarray(buckets, dtype=np.float64)
                k = np.searchsorted(table, n[on], side="left")
                fit = k < table.size
                sub = out[on]
                sub[fit] = table[k[fit]]
                out[on] = sub
    return out


def _bucket_scalar(tokens: float, degree: float, min_bucket: int, growth: float,
                   max_per_device: float | None) -> float:
    """`bucket_lengths` of one group in plain floats (the planner evaluates thousands)."""
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    return _rung_scalar(_rungs(min_bucket, growth)[0], tokens, degree, max_per_device)


def _rung_scalar(lst: list[float], tokens: float, degree: float, max_per_device: float | None) -> float:
    rung = lst[bisect.bisect_left(lst, max(math.ceil(tokens), 1))]
    step = 2.0 * degree
    if max_per_device is not None:
        rung = max(min(rung, (max_per_device * degree // step) * step), tokens)
    return math.ceil(rung / step) * step


def scalar_bucketer(min_bucket: int = MIN_BUCKET, growth: float = GROWTH, max_per_device: float | None = None,
                    menu: Any = ()) -> Callable[[float, int], float]:
    """`bucket_lengths` of one group (plain float tokens, integer degree >= 1) as a function with
    the ladder and the menu looked up once: the degree search of the planner's allocation evaluates
    it tens of thousands of times per plan."""
    lst = _rungs(int(min_bucket), float(growth))[0]
    table: dict[int, list] = {}
    for d, b in menu:
        table.setdefault(int(d), list(b))  # the first entry of a degree wins, as in bucket_lengths

    def bucket(tokens: float, degree: int) -> float:
        buckets = table.get(degree)
        if buckets is not None:
            k = bisect.bisect_left(buckets, tokens)
            if k < len(buckets):
                return float(buckets[k])
        return _rung_scalar(lst, tokens, degree, max_per_device)

    return bucket


def bucket_length(n: int, degree: int, min_bucket: int = MIN_BUCKET, growth: float = GROWTH) -> int:
    """`bucket_lengths` of one group. One bucket per (rung, degree), so the number of distinct
    shapes is bounded by #rungs x #degrees."""
    if int(degree) < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    return int(bucket_lengths(n, int(degree), min_bucket, growth))


def zigzag_permutation(length: int, degree: int) -> np.ndarray:
    """perm int64[length]: permuted[i] = original[perm[i]]; device i holds chunks i and 2d-1-i."""
    if length % (2 * degree):
        raise ValueError(f"stream length {length} is not divisible by 2*degree = {2 * degree}")
    c = length // (2 * degree)
    order = [j for i in range(degree) for j in (i, 2 * degree - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in order]).astype(np.int64)


def real_counts(n: int, length: int, degree: int) -> np.ndarray:
    """Real tokens on each of the `degree` shards of a stream of `length` slots holding `n` tokens:
    n // d each, one more on the first n % d shards (int64[degree])."""
    if n < 0 or length < n or length % (2 * degree):
        raise ValueError(f"a stream of {length} slots cannot hold {n} tokens in 2*{degree} chunks")
    return n // degree + (np.arange(degree) < n % degree).astype(np.int64)


def chunk_size(shard: int, chunk: int) -> int:
    """Rows per chunk when a shard of `shard` slots is cut into ceil(shard / chunk) equal chunks
    (the last padded by fewer rows than there are chunks); the whole shard when `chunk` is 0."""
    if chunk <= 0 or shard <= chunk:
        return max(int(shard), 1)
    return -(-int(shard) // -(-int(shard) // chunk))


def linear_tokens(tokens: Any, padded: Any, degree: Any, chunk: int) -> Any:
    """Tokens the linear layers of a group's busiest shard compute, for `tokens` real tokens in a
    stream of `padded` slots on `degree` shards: the shard's S/d slots when `chunk` is 0, else its
    ceil(tokens/d) real tokens (`real_counts`) rounded up to whole chunks of
    `chunk_size(S/d, chunk)` rows (the executors skip the chunks of a shard's padding tail).
    Plain numbers in, a float out (the planner's scalar path); arrays broadcast."""
    if isinstance(tokens, (int, float)) and isinstance(padded, (int, float)) and isinstance(degree, (int, float)):
        shard = padded / degree
        if chunk <= 0:
            return float(shard)
        c = chunk_size(shard, chunk)
        return float(math.ceil(math.ceil(tokens / degree) / c) * c)
    n, p, d = (np.asarray(x, dtype=np.float64) for x in (tokens, padded, degree))
    shard = p / d
    if chunk <= 0:
        return shard
    c = np.where(shard <= chunk, np.maximum(shard, 1.0), np.ceil(shard / np.ceil(shard / chunk)))
    return np.ceil(np.ceil(n / d) / c) * c


def real_slots(n: int, length: int, degree: int) -> np.ndarray:
    """int64[n]: the slot, in the permuted (device-order) stream, of real token k of the group.

    Shard i holds `real_counts` r_i real tokens as its prefix and r_i..S/d-1 as padding; real
    tokens take the free stream positions in increasing (unpermuted) order, so token k precedes
    token k+1 in the zigzag stream."""
    perm = zigzag_permutation(length, degree)
    shard = length // degree
    real = (np.arange(length) % shard) < np.repeat(real_counts(n, length, degree), shard)  # permuted order
    free = np.empty(length, bool)
    free[perm] = real                                    # the same mask in stream (unpermuted) order
    inverse = np.empty(length, np.int64)
    inverse[perm] = np.arange(length)
    return inverse[np.flatnonzero(free)]


@dataclasses.dataclass(frozen=True, eq=False)
class GroupLayout:
    """One group's packed stream (arrays already zigzag-permuted and padded to `bucket`; real
    token k sits at slot `real_index[k]`, see `real_slots`)."""

    degree: int
    bucket: int
    num_tokens: int
    num_loss_tokens: int
    permutation: np.ndarray
    sample_offsets: tuple[int, ...]       # offset of each sample among the real tokens (`tokens`)
    real_index: np.ndarray
    token_ids: np.ndarray
    pixels: np.ndarray
    vision_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    span_ids: np.ndarray
    frame_ids: np.ndarray
    frame_positions: np.ndarray
    targets: np.ndarray
    loss_weights: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """Model inputs plus targets/loss_weights, by name (see the module docstring)."""
        return {k: getattr(self, k) for k in ARRAY_NAMES}

    def unpermute(self, x: np.ndarray) -> np.ndarray:
        """Back to the stream (unpermuted) order along axis 0, padding slots included."""
        out = np.empty_like(x)
        out[self.permutation] = x
        return out

    def tokens(self, x: np.ndarray) -> np.ndarray:
        """The real tokens' rows of a per-slot array (axis 0, permuted order), in sample order."""
        return np.asarray(x)[self.real_index]

    @property
    def real_per_shard(self) -> np.ndarray:
        """Real tokens on each shard (int64[degree]); shard i's padding is its last S/d - r_i slots."""
        return real_counts(self.num_tokens, self.bucket, self.degree)


def _where(sample: Sample, index: int) -> str:
    sid = sample.sample_id if sample.sample_id is not None else index
    return f"sample {sid!r}"


def planned_bucket(group: Any, samples: Sequence[Sample]) -> int | None:
    """The stream length a plan chose for a group (its `padded_tokens`), when the plan describes
    these very samples (its `tokens` is their total; a plan of unscaled batches does not); None:
    the executor's own ladder. Both executors pack with it, so they run what the planner priced."""
    padded, tokens = int(getattr(group, "padded_tokens", 0) or 0), int(getattr(group, "tokens", 0) or 0)
    return padded if padded and tokens == sum(s.num_tokens for s in samples) else None


def pack_group(samples: Sequence[Sample], degree: int, config: Any, *, bucket: int | None = None,
               min_bucket: int = MIN_BUCKET, growth: float = GROWTH) -> GroupLayout:
    """Pack `samples` (with payloads) for a group of `degree` devices.

    `config` is anything with `patch_dim` and `vocab_size` (e.g. `MLLMConfig`). `bucket` forces the
    padded length (must hold the tokens and divide by 2*degree). Raises ValueError naming the
    sample on a missing payload, a token id outside the vocabulary or a wrong pixel width.
    """
    degree = int(degree)
    if degree < 1:
        raise ValueError(f"degree must be >= 1, got {degree}")
    if not samples:
        raise ValueError("pack_group needs at least one sample")
    patch_dim, vocab = int(config.patch_dim), int(config.vocab_size)
    n = sum(s.num_tokens for s in samples)
    if bucket is None:
        bucket = bucket_length(n, degree, min_bucket, growth)
    if bucket < n or bucket % (2 * degree):
        raise ValueError(f"bucket {bucket} cannot hold {n} tokens split in 2*{degree} chunks")

    ids = np.zeros(n, np.int32)
    pix = np.zeros((n, patch_dim), np.float32)
    vis = np.zeros(n, bool)
    seg, pos, span, frame, fpos, tgt = (np.zeros(n, np.int32) for _ in range(6))
    w = np.zeros(n, np.float32)
    offsets, off, n_span, n_frame = [], 0, 0, 0
    for si, s in enumerate(samples):
        offsets.append(off)
        if not isinstance(s, Sample):
            raise TypeError(f"group sample {si} is a {type(s).__name__}, not a Sample")
        start = off
        for seg_i, sg in enumerate(s.segments):
            k = sg.num_tokens
            sl = slice(off, off + k)
            if sg.is_vision:
                if sg.pixels is None:
                    raise ValueError(f"{_where(s, si)} segment {seg_i} ({sg.modality}) has no pixels")
                p = np.asarray(sg.pixels)
                if p.ndim != 2 or p.shape[1] != patch_dim:
                    raise ValueError(f"{_where(s, si)} segment {seg_i}: pixels have shape {p.shape}, "
                                     f"expected ({k}, {patch_dim})")
                pix[sl] = p
                vis[sl] = True
                if k:
                    n_span += 1
                    span[sl] = n_span
                tpf = int(sg.tokens_per_frame or k or 1)
                if tpf < 1:
                    raise ValueError(f"{_where(s, si)} segment {seg_i}: tokens_per_frame must be >= 1")
                local = np.arange(k)
                frame[sl] = n_frame + 1 + local // tpf
                fpos[sl] = local % tpf
                n_frame += -(-k // tpf)
            else:
                if sg.token_ids is None:
                    raise ValueError(f"{_where(s, si)} segment {seg_i} (text) has no token_ids")
                t = np.asarray(sg.token_ids)
                if k and (t.min() < 0 or t.max() >= vocab):
                    bad = int(t.max()) if t.max() >= vocab else int(t.min())
                    raise ValueError(f"{_where(s, si)} segment {seg_i}: token id {bad} is outside "
                                     f"the vocabulary [0, {vocab})")
                ids[sl] = t
            off += k
        seg[start:off] = si + 1
        pos[start:off] = np.arange(off - start)
        # Next-token targets: text followed by text of the same sample.
        txt = ~vis[start:off]
        nxt = np.zeros(off - start, bool)
        nxt[:-1] = txt[:-1] & txt[1:]
        w[start:off] = nxt
        if off - start > 1:
            tgt[start:off - 1] = np.where(nxt[:-1], ids[start + 1:off], 0)
    arr = {"token_ids": ids, "pixels": pix, "vision_mask": vis, "segment_ids": seg,
           "positions": pos, "span_ids": span, "frame_ids": frame, "frame_positions": fpos,
           "targets": tgt, "loss_weights": w}
    slots = real_slots(n, bucket, degree)
    out = {}
    for k, v in arr.items():                          # zeros on padding, each real token at its slot
        out[k] = np.zeros((bucket,) + v.shape[1:], v.dtype)
        out[k][slots] = v
    return GroupLayout(degree=degree, bucket=bucket, num_tokens=n, num_loss_tokens=int(w.sum()),
                       permutation=zigzag_permutation(bucket, degree), sample_offsets=tuple(offsets),
                       real_index=slots, **out)
