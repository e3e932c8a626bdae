"""Fit the cost model's coefficients to measured group times (the profiler's output).

Each measurement is `{"lengths": [...], "etas": [...] or None, "degree": d, "seconds": t}` (optionally
`"inter_node": bool` and `"attention"`: "ring" by default, "ulysses" or "hybrid:<u>x<r>"). Given
whether a point's ring traffic is hidden behind its attention, the model is linear in its
coefficients:

    hidden:  t = (a1 A0 + a2 L1 + av V1) / d + b1 + c_a2a X + lat m'
    exposed: t = (a2 L1 + av V1) / d + b1 + c R + c_a2a X + lat m        (c, lat per link class)

with A0 = sum (1+eta) L^2, L1 = sum L, V1 = sum sqrt(eta) L, and R, X, m the ring tokens,
all-to-all tokens and messages of `pricing.traffic` for the point's attention kind (ring:
R = S (d-1)/d, X = 0, m = d-1; all-to-all traffic never hides; m' = m except on a pure ring, whose
hand-overs hide with its traffic). c_a2a is the intra-node all-to-all's seconds per token; it is
fitted when some points are Ulysses or hybrid groups. The structural terms of
`base` are respected, not fitted: compute is divided by p = min(d, base.compute_lanes) instead of d
(and b1 and the ring latency multiplied by d/p),
ring traffic simply adds when `base.comm_overlap` is False, and when `base.geometry.bucket_min` is set
the features are those of the padded stream of length P (S = P, L1 = the tokens the linear layers
compute, P or with `base.geometry.linear_chunk` the busiest rank's real chunks times d, and A0 = P^2 with
`base.padded_attention`; see `CostModel`). The fit alternates between
classifying the points with the current coefficients and a non-negative least-squares solve on
relative errors, from a few starting points, and keeps the best. Coefficients no measurement
informs (e.g. inter-node links when every group was inside a node) stay those of `base`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import least_squares, nnls

from dhp_jax.checks import positive_int
from dhp_jax.geometry.layout import linear_tokens
from dhp_jax.planner.cost.geometry import padded_length
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import comm_per_token, compute_divisor, traffic

_NAMES = ("a1", "a2", "a2_vision", "b1", "c_intra", "c_inter", "lat_intra", "lat_inter", "c_a2a")
_MAX_ROUNDS = 50


def _features(measurements: Sequence[Mapping[str, Any]], base: CostModel) -> tuple[np.ndarray, ...]:
    if not measurements:
        raise ValueError("fit_cost_model needs at least one measurement")
    rows = []
    for i, m in enumerate(measurements):
        for key in ("lengths", "degree", "seconds"):
            if key not in m:
                raise ValueError(f"measurement {i}: missing field {key!r}")
        L = np.asarray(m["lengths"], dtype=np.float64).reshape(-1)
        if L.size == 0 or np.any(L < 0):
            raise ValueError(f"measurement {i}: lengths must be a non-empty list of numbers >= 0")
        etas = m.get("etas")
        e = np.zeros_like(L) if etas is None else np.asarray(etas, dtype=np.float64).reshape(-1)
        if e.size != L.size or np.any(e < 0) or np.any(e > 1):
            raise ValueError(f"measurement {i}: etas must have one value in [0, 1] per length")
        d = m["degree"]
        positive_int(d, f"measurement {i}: degree")
        t = float(m["seconds"])
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"measurement {i}: seconds must be > 0, got {m['seconds']!r}")
        inter = m.get("inter_node")
        inter = bool(d > base.ranks_per_node) if inter is None else bool(inter)
        if base.geometry.bucket_min:
            P = float(padded_length(base, L.sum(), d))
            A0 = P * P if base.padded_attention else float(((1 + e) * L * L).sum())
            L1 = P
            W = d * linear_tokens(float(L.sum()), P, d, base.geometry.linear_chunk)   # what the linear layers compute
        else:
            A0, L1 = float(((1 + e) * L * L).sum()), float(L.sum())
            W = L1
        kind = m.get("attention", "ring")
        try:
            R, X, msgs, _ = (float(np.asarray(x)) for x in traffic(L1, d, kind))
        except ValueError as err:
            raise ValueError(f"measurement {i}: {err}") from None
        rows.append((A0, W, float((np.sqrt(e) * L).sum()), int(d), inter, t, R, X, msgs, kind == "ring"))
    A0, L1, V1, d, inter, t, R, X, msgs, ring = (np.array(c) for c in zip(*rows))
    d = d.astype(np.float64)
    return A0, L1, V1, d, inter.astype(bool), t, compute_divisor(base, d), _Traffic(R, X, msgs, ring.astype(bool))


class _Traffic:
    """Per point: ring tokens R, all-to-all tokens X, messages m, and whether it is a pure ring."""

    def __init__(self, R: np.ndarray, X: np.ndarray, msgs: np.ndarray, ring: np.ndarray):
        self.R, self.X, self.msgs, self.ring = R, X, msgs, ring


def _design(A0, L1, V1, d, inter, exposed, p, overlap, tr: _Traffic) -> np.ndarray:
    X = np.zeros((len(d), len(_NAMES)))
    X[:, 0] = np.where(exposed & overlap, 0.0, A0 / p)
    X[:, 1] = L1 / p
    X[:, 2] = V1 / p
    X[:, 3] = d / p  # every rank's fixed work, shared over the p lanes (1 when p = d)
    X[:, 4] = np.where(exposed & ~inter, tr.R, 0.0)
    X[:, 5] = np.where(exposed & inter, tr.R, 0.0)
    msgs = np.where(exposed | ~tr.ring, tr.msgs * d / p, 0.0)  # messages of d ranks on p lanes
    X[:, 6] = np.where(~inter, msgs, 0.0)
    X[:, 7] = np.where(inter, msgs, 0.0)
    X[:, 8] = tr.X
    return X


def _predict(p: np.ndarray, A0, L1, V1, d, inter, lanes, overlap, tr: _Traffic) -> tuple[np.ndarray, np.ndarray]:
    a1, a2, av, b1, ci, ce, li, le, ca = p
    c = np.where(inter, ce, ci)
    lat_s = np.where(inter, le, li) * tr.msgs * d / lanes
    ring = c * tr.R + np.where(tr.ring, lat_s, 0.0)            # may hide behind the attention
    other = ca * tr.X + np.where(tr.ring, 0.0, lat_s)          # never hides
    attn = a1 * A0 / lanes
    base = attn + (a2 * L1 + av * V1) / lanes + b1 * d / lanes + other
    if not overlap:  # traffic and compute add up; every point's traffic counts
        return base + ring, np.ones(len(d), bool)
    return base + np.maximum(ring - attn, 0.0), ring > attn


def _polish(p: np.ndarray, informed: np.ndarray, A0, L1, V1, d, inter, t, lanes, overlap, tr) -> np.ndarray:
    """Nonlinear least squares on relative errors from the alternating solution; keep the better."""
    scale = np.where(p > 0, p, 1.0)[informed]

    def resid(z: np.ndarray) -> np.ndarray:
        q = p.copy()
        q[informed] = z * scale
        return _predict(q, A0, L1, V1, d, inter, lanes, overlap, tr)[0] / t - 1.0

    z0 = p[informed] / scale
    try:
        res = least_squares(resid, z0, bounds=(0.0, np.inf), xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=2000)
    except ValueError:
        return p
    if np.max(np.abs(res.fun)) < np.max(np.abs(resid(z0))):
        q = p.copy()
        q[informed] = res.x * scale
        return q
    return p


def fit_cost_model(measurements: Sequence[Mapping[str, Any]], base: CostModel) -> tuple[CostModel, dict[str, Any]]:
    """Fitted model (other fields from `base`) and a report with per-point relative errors."""
    A0, L1, V1, d, inter, t, lanes, tr = _features(measurements, base)
    overlap = bool(base.comm_overlap)
    p0 = np.array([base.a1, base.a2, base.a2_vision, base.b1, base.kv_bytes_per_token / base.bw_intra,
                   base.kv_bytes_per_token / base.bw_inter, base.lat_intra, base.lat_inter,
                   float(comm_per_token(base, False, "ulysses"))])
    full = _design(A0, L1, V1, d, inter, np.ones(len(d), bool), lanes, overlap, tr) + _design(A0, L1, V1, d, inter, np.zeros(len(d), bool), lanes, overlap, tr)
    informed = np.any(full != 0, axis=0)
    starts = []
    for scale in (1.0, 10.0, 0.1, 100.0, 0.01):
        q = p0.copy()
        q[4:] *= scale
        starts.append(_predict(q, A0, L1, V1, d, inter, lanes, overlap, tr)[1])
    starts += [np.zeros(len(d), bool), d > 1, inter & (d > 1)]
    best = None
    for exposed in starts:
        seen = set()
        for _ in range(_MAX_ROUNDS):
            key = exposed.tobytes()
            if key in seen:
                break
            seen.add(key)
            X = _design(A0, L1, V1, d, inter, exposed, lanes, overlap, tr)[:, informed] / t[:, None]
            sol, _ = nnls(X, np.ones(len(t)), maxiter=50 * X.shape[1])
            p = p0.copy()
            p[informed] = sol
            pred, exposed = _predict(p, A0, L1, V1, d, inter, lanes, overlap, tr)
            err = float(np.max(np.abs(pred - t) / t))
            if best is None or err < best[0]:
                best = (err, p)
    p = _polish(best[1], informed, A0, L1, V1, d, inter, t, lanes, overlap, tr)
    # a link class whose traffic is never exposed is not identified by the data: keep base's
    # figures there when they explain the points as well
    unidentified = []
    for cls, cols in ((False, (4, 6)), (True, (5, 7))):
        exposed = _predict(p, A0, L1, V1, d, inter, lanes, overlap, tr)[1]
        if np.count_nonzero(exposed & (inter == cls)) < 2 and any(informed[c] for c in cols):
            q = p.copy()
            q[list(cols)] = p0[list(cols)]
            old = np.max(np.abs(_predict(p, A0, L1, V1, d, inter, lanes, overlap, tr)[0] / t - 1))
            new = np.max(np.abs(_predict(q, A0, L1, V1, d, inter, lanes, overlap, tr)[0] / t - 1))
            if new <= max(old, 1e-12) * (1 + 1e-9):
                p = q
                unidentified += [_NAMES[c] for c in cols]
    kv = base.kv_bytes_per_token if base.kv_bytes_per_token > 0 else 1.0
    tiny = 1e-300
    fitted = dataclasses.replace(
        base, a1=float(p[0]), a2=float(p[1]), a2_vision=float(p[2]), b1=float(p[3]),
        kv_bytes_per_token=float(kv), bw_intra=float(kv / max(p[4], tiny)) if p[4] > 0 else base.bw_intra * 1e6,
        bw_inter=float(kv / max(p[5], tiny)) if p[5] > 0 else base.bw_inter * 1e6,
        lat_intra=float(p[6]), lat_inter=float(p[7]),
        a2a_bw_intra=float(base.a2a_bytes_per_token / p[8]) if informed[8] and p[8] > 0 and base.a2a_bytes_per_token > 0
        else base.a2a_bw_intra)
    pred, exposed = _predict(p, A0, L1, V1, d, inter, lanes, overlap, tr)
    rel = (pred - t) / t
    report = {
        "points": [{"degree": int(di), "inter_node": bool(ii), "measured_s": float(ti), "predicted_s": float(pi),
                    "rel_err": float(ri), "comm_exposed": bool(ei)}
                   for di, ii, ti, pi, ri, ei in zip(d, inter, t, pred, rel, exposed)],
        "mean_abs_rel_err": float(np.mean(np.abs(rel))),
        "max_abs_rel_err": float(np.max(np.abs(rel))),
        "fitted": [n for n, f in zip(_NAMES, informed) if f and n not in unidentified],
        "kept_from_base": [n for n, f in zip(_NAMES, informed) if not f or n in unidentified],
        "coefficients": {n: float(v) for n, v in zip(_NAMES, p)},
    }
    return fitted, report
