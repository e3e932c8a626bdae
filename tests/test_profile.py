"""The profiler's fitting path: synthetic timings from a known cost model come back as its coefficients."""

import json

import numpy as np
import pytest

from dhp_jax.planner import CostModel
from dhp_jax.planner.cost.pricing import comm_per_token, group_time
from dhp_jax.train.profile import default_points, fit_profile, measure_points, split_points, write_profile


def _truth() -> CostModel:
    base = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8)
    # coefficients of the size a tiny model has on CPU: attention and linear work comparable at
    # a few hundred tokens, a visible fixed cost, ring traffic that is exposed for short groups
    return base.replace(a1=2e-7, a2=6e-5, a2_vision=3e-5, b1=4e-3, kv_bytes_per_token=4096.0,
                        bw_intra=2e8, lat_intra=3e-4)


def test_fit_recovers_known_coefficients(tmp_path):
    truth = _truth()
    points = default_points(degrees=[1, 2, 3, 4, 6, 8], lengths=[64, 128, 256, 512, 1024], packs=(1, 2))
    measurements = measure_points(points, lambda lengths, etas, d, k: group_time(truth, lengths, d, etas=etas, attention=k))
    base = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8)  # starts far from the truth
    cost, report = fit_profile(measurements, base, holdout_every=4)
    for name in ("a1", "a2", "a2_vision", "b1", "lat_intra"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    assert cost.kv_bytes_per_token / cost.bw_intra == pytest.approx(truth.kv_bytes_per_token / truth.bw_intra,
                                                                    rel=1e-4)
    assert report["held_out_mean_rel_error"] < 1e-6 and report["num_held_out"] == len(points) // 4
    path, report_path = write_profile(tmp_path / "p.json", cost, report, measurements, {"machine": "synthetic"})
    loaded = CostModel.from_profile(path)
    for lengths, d in (([300], 3), ([100, 50], 5), ([700], 8)):
        assert group_time(loaded, lengths, d) == pytest.approx(group_time(truth, lengths, d), rel=1e-4)
    saved = json.loads(report_path.read_text())
    assert saved["machine"] == "synthetic" and len(saved["measurements"]) == len(points)


def test_held_out_error_is_measured_on_points_outside_the_fit():
    truth = _truth()
    points = default_points(degrees=[1, 2, 4], lengths=[128, 256, 512], packs=(1,))
    train, held = split_points(points, holdout_every=3)
    assert set(train).isdisjoint(held) and sorted(train + held) == list(range(len(points)))
    rng = np.random.default_rng(0)
    noisy = measure_points(points, lambda l, e, d, k: group_time(truth, l, d, etas=e, attention=k) * (1 + 0.03 * rng.standard_normal()))
    _, report = fit_profile(noisy, truth, holdout_every=3)
    assert 0 < report["held_out_mean_rel_error"] < 0.15
    assert all(abs(p["rel_error"] - abs(p["estimate_s"] - p["seconds"]) / p["seconds"]) < 1e-12
               for p in report["held_out"])


def test_bad_timing_is_named():
    points = default_points(degrees=[2], lengths=[64], packs=(1,))
    with pytest.raises(ValueError, match=r"profile point 0 \(degree 2, ring, lengths \[64\]\) measured 0.0 s"):
        measure_points(points, lambda l, e, d, k: 0.0)


def test_passes_keep_each_points_minimum():
    points = default_points(degrees=[1, 2], lengths=[64], packs=(1,))
    calls = iter([5.0, 7.0, 3.0, 9.0])  # pass 1: 5, 7; pass 2: 3, 9
    out = measure_points(points, lambda l, e, d, k: next(calls), passes=2)
    assert [m["seconds"] for m in out] == [3.0, 7.0]


def test_fit_recovers_coefficients_with_lanes_and_padding():
    """Truth on 2 shared cores with the executor's padded streams; the fit respects that structure."""
    truth = _truth().replace(compute_lanes=2, bucket_min=16, bucket_growth=2.0)
    points = default_points(degrees=[1, 2, 3, 4, 6, 8], lengths=[32, 64, 96, 128, 256, 384, 512], packs=(1, 2))
    measurements = measure_points(points, lambda lengths, etas, d, k: group_time(truth, lengths, d, etas=etas, attention=k))
    base = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8, bucket_min=16, bucket_growth=2.0)
    cost, report = fit_profile(measurements, base, holdout_every=4)
    for name in ("a1", "a2", "a2_vision", "b1", "lat_intra"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    assert cost.compute_lanes == 2 and cost.geometry.bucket_min == 16 and not cost.comm_overlap
    assert report["held_out_mean_rel_error"] < 1e-6
    # the same timings fitted without the structure cannot explain them
    _, plain = fit_profile(measurements, base.replace(compute_lanes=None, bucket_min=0, comm_overlap=True),
                           holdout_every=4)
    assert plain["held_out_mean_rel_error"] > 0.02


def test_fit_recovers_overlapped_ring_with_lanes():
    """With overlap on, the fit still separates hidden from exposed traffic under a lane limit."""
    truth = _truth().replace(compute_lanes=3, comm_overlap=True)
    points = default_points(degrees=[1, 2, 3, 4, 6, 8], lengths=[64, 128, 256, 512, 1024], packs=(1, 2))
    measurements = measure_points(points, lambda lengths, etas, d, k: group_time(truth, lengths, d, etas=etas, attention=k))
    base = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8, compute_lanes=3, comm_overlap=True)
    cost, report = fit_profile(measurements, base, holdout_every=4)
    for name in ("a1", "a2", "a2_vision", "b1", "lat_intra"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    assert report["held_out_mean_rel_error"] < 1e-6


def test_cli_refits_a_saved_report(tmp_path):
    """`dhp profile --from-report` refits saved timings with the current model, timing nothing."""
    import argparse

    from dhp_jax.train import profile_cli

    truth = _truth().replace(bucket_min=16, bucket_growth=2.0)
    points = default_points(degrees=[1, 2, 4, 8], lengths=[32, 64, 128, 256, 512], packs=(1, 2))
    measurements = measure_points(points, lambda lengths, etas, d, k: group_time(truth, lengths, d, etas=etas, attention=k))
    src = tmp_path / "old.report.json"
    src.write_text(json.dumps({"machine": "synthetic", "num_devices": 8, "compute_lanes": 2, "bucket_min": 16,
                               "bucket_growth": 2.0, "measurements": measurements}))
    parser = argparse.ArgumentParser()
    profile_cli.configure(parser)
    args = parser.parse_args(["--from-report", str(src), "--out", str(tmp_path / "new.json"), "--cpu-devices", "0"])
    assert profile_cli.run(args) == 0
    saved = json.loads((tmp_path / "new.report.json").read_text())
    assert saved["refit_from"] == str(src) and saved["held_out_mean_rel_error"] < 1e-6
    assert CostModel.from_profile(tmp_path / "new.json").a1 == pytest.approx(truth.a1, rel=1e-4)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    args = parser.parse_args(["--from-report", str(bad), "--out", str(tmp_path / "x.json"), "--cpu-devices", "0"])
    assert profile_cli.run(args) == 2


def test_fit_covers_ulysses_and_hybrid_points():
    """Points of every attention kind: the all-to-all's seconds per token are fitted with the rest,
    and each kind's held-out estimate is exact."""
    truth = _truth().replace(num_heads=4, a2a_bytes_per_token=16384.0, a2a_bw_intra=1e8)
    points = default_points(degrees=[1, 2, 3, 4, 6, 8], lengths=[64, 128, 256, 512, 1024], packs=(1, 2),
                            kinds=("ring", "ulysses", "hybrid"), num_heads=4)
    kinds = {p.attention for p in points}
    assert kinds == {"ring", "ulysses", "hybrid:2x2", "hybrid:2x3", "hybrid:2x4", "hybrid:4x2"}, kinds
    measurements = measure_points(points, lambda lengths, etas, d, k: group_time(truth, lengths, d, etas=etas, attention=k))
    base = CostModel.preset("internvl3-2b", "cpu", ranks_per_node=8, num_heads=4)
    cost, report = fit_profile(measurements, base, holdout_every=4)
    assert "c_a2a" in report["fit"]["fitted"]
    assert comm_per_token(cost, False, "ulysses") == pytest.approx(comm_per_token(truth, False, "ulysses"), rel=1e-4)
    for name in ("a1", "a2", "b1", "lat_intra"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    assert report["held_out_mean_rel_error"] < 1e-6
    assert {m["attention"] for m in report["held_out"]} > {"ring"}
    with pytest.raises(ValueError, match="kinds"):
        default_points(degrees=[2], lengths=[64], kinds=("ulysses",), num_heads=4)
