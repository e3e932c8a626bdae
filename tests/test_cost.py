"""Cost model: presets, the paper's formulas checked by hand, I/O, and the coefficient fit."""

import dataclasses
import json
import math

import numpy as np
import pytest

from dhp_jax.planner import CostModel
from dhp_jax.planner.cost.fit import fit_cost_model
from dhp_jax.planner.cost.presets import MODELS
from dhp_jax.planner.cost.tensor_parallel import valid_degrees
from dhp_jax.planner.cost.geometry import StreamGeometry, padded_length
from dhp_jax.planner.cost.memory import group_activation_bytes, max_tokens_per_rank, min_degree
from dhp_jax.planner.cost.pricing import allreduce_time, group_time, sent_tokens


def _fitting_preset(model, hardware):
    """The preset at the least tensor-parallel size (up to 8) at which the model fits: the 32B-class
    models hold their gathered weights twice per device, more than one accelerator's memory."""
    for t in valid_degrees(MODELS[model], 8):
        try:
            return CostModel.preset(model, hardware, tensor_parallel=t, ranks_per_node=8 // t)
        except ValueError as e:
            if "does not fit" not in str(e):
                raise
    return None


def test_every_preset_builds_and_is_physical():
    unfit = set()
    for m in CostModel.MODELS:
        for h in CostModel.HARDWARE:
            c = _fitting_preset(m, h)
            if c is None:
                unfit.add((m, h))
                continue
            assert c.memory_budget > 0 and c.a1 > 0 and c.a2 > 0 and c.b1 > 0
            # a longer sequence is slower; two ranks beat one for a long sequence (but on the host's
            # 2 cores shared by ranks of several devices: compute_lanes 1, only one rank computes at once)
            assert group_time(c, [8000], 1) < group_time(c, [16000], 1)
            if c.compute_lanes != 1:
                assert group_time(c, [60000], 2) < group_time(c, [60000], 1)
    # InternVL3-38B holds 2 x 38.4 B gathered weights per device at t = 1, and InternViT-6B's 25 heads
    # allow no t > 1: it fits no preset's device; Qwen3-VL-235B-A22B holds 2 x 29.6 B at t = 8
    assert unfit == {(m, h) for m in ("internvl3-38b", "qwen3-vl-235b-a22b") for h in CostModel.HARDWARE}


def test_model_that_cannot_fit_says_so():
    with pytest.raises(ValueError, match="does not fit on cpu with its state sharded over 1 ranks"):
        CostModel.preset("qwen3-vl-8b", "cpu", state_shards=1)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known models: internvl3-2b"):
        CostModel.preset("llama-70b", "a100")
    with pytest.raises(ValueError, match="known hardware: ascend-910b, a100, h100, cpu"):
        CostModel.preset("internvl3-8b", "tpu")
    with pytest.raises(ValueError, match="unknown CostModel field"):
        CostModel.preset("internvl3-8b", "a100", a9=1.0)


def test_attention_coefficient_from_flops():
    c = CostModel.preset("internvl3-8b", "ascend-910b")
    # 28 layers, 28 heads of 128: QK^T + PV = 4 h hd FLOPs per pair, L^2/2 causal pairs, 4 passes
    # (fwd, recomputed fwd, bwd = 2 fwd) at 313 TFLOPS x 35 %
    assert c.a1 == pytest.approx(4 * 2 * 28 * 128 * 28 / (313e12 * 0.35), rel=1e-12)
    assert c.num_heads == 28
    assert c.ranks_per_node == 8


def _by_hand(c, lengths, etas, d, inter):
    """The paper's form written out independently of pricing.group_times."""
    A = sum(c.a1 * (1 + e) * L * L for L, e in zip(lengths, etas))
    B = sum((c.a2 + c.a2_vision * math.sqrt(e)) * L for L, e in zip(lengths, etas))
    t_cp_attn = A / d
    t_cp = (A + B) / d + c.b1
    v = c.bw_inter if inter else c.bw_intra
    lat = c.lat_inter if inter else c.lat_intra
    t_cm = c.kv_bytes_per_token / v * sum(lengths) * (d - 1) / d + lat * (d - 1)
    return t_cp + t_cm - min(t_cp_attn, t_cm)


@pytest.mark.parametrize("lengths, etas, d", [
    ([1000], [0.0], 1), ([90000], [1.0], 3), ([500, 700, 300], [0.2, 0.0, 0.9], 5),
    ([120000, 4000], [0.81, 0.0], 8), ([2000] * 10, [0.5] * 10, 12), ([64], [0.0], 64)])
def test_time_matches_the_paper_form(lengths, etas, d):
    c = CostModel.preset("qwen3-vl-4b", "h100", bucket_min=0)  # the paper's form: no padding
    inter = d > c.ranks_per_node
    assert group_time(c, lengths, d, etas) == pytest.approx(_by_hand(c, lengths, etas, d, inter), rel=1e-12)
    # an explicit link class overrides the degree rule
    assert group_time(c, lengths, d, etas, inter_node=not inter) == pytest.approx(
        _by_hand(c, lengths, etas, d, not inter), rel=1e-12)


def test_ulysses_pays_all_to_all_without_overlap():
    c = CostModel.preset("qwen3-vl-8b", "a100", bucket_min=0)
    t_ring = group_time(c, [50000], 4)
    t_uly = group_time(c, [50000], 4, attention="ulysses")
    A = c.a1 * 50000 ** 2
    B = c.a2 * 50000
    # a rank holds 50000/4 tokens and sends 3/4 of their Q, K, V, O
    expect = (A + B) / 4 + c.b1 + c.a2a_bytes_per_token / c.a2a_bw_intra * 50000 / 4 * 3 / 4 + c.lat_intra * 3
    assert t_uly == pytest.approx(expect, rel=1e-12)
    assert t_ring != t_uly
    assert c.ulysses_ok(8) and not c.ulysses_ok(3)


def _all_to_all_sent(S: int, d: int, heads: int) -> int:
    """Count, element by element, the (token, head) pairs one rank sends in Ulysses' re-shards.

    Before: rank r holds tokens [r S/d, (r+1) S/d) with every head. Q, K and V go to the rank owning
    the head (heads are split in d contiguous slices); O comes back to the rank owning the token.
    """
    owner_tok = np.repeat(np.arange(d), S // d)       # token -> rank before the all-to-all
    owner_head = np.repeat(np.arange(d), heads // d)  # head -> rank after it
    sent = 0
    for r in range(d):
        mine = owner_tok == r
        # Q, K, V: (token of r, head owned elsewhere); O: (head of r, token owned elsewhere)
        sent += 3 * int(mine.sum()) * int((owner_head != r).sum())
        sent += int((owner_head == r).sum()) * int((~mine).sum())
    return sent // d  # every rank sends the same amount


@pytest.mark.parametrize("S,d", [(48, 2), (96, 4), (64, 8), (384, 16)])
def test_ulysses_traffic_is_the_per_rank_all_to_all_volume(S, d):
    heads = 16
    c = CostModel.preset("qwen3-vl-8b", "a100", bucket_min=0)  # the unpadded form
    per_token_head = c.a2a_bytes_per_token / (4 * heads)  # Q, K, V, O of one head of one token
    by_hand = _all_to_all_sent(S, d, heads) * per_token_head  # bytes one rank sends
    assert float(sent_tokens(S, d, "ulysses")) * c.a2a_bytes_per_token == pytest.approx(by_hand, rel=1e-12)
    # a ring sends the K/V of its S/d tokens at each of d-1 steps
    assert float(sent_tokens(S, d, "ring")) == pytest.approx((d - 1) * S / d, rel=1e-12)
    bw = c.bw_inter if d > c.ranks_per_node else c.a2a_bw_intra
    t = group_time(c, [S], d, attention="ulysses")
    expect = (c.a1 * S ** 2 + c.a2 * S) / d + c.b1 + by_hand / bw \
        + (c.lat_inter if d > c.ranks_per_node else c.lat_intra) * (d - 1)
    assert t == pytest.approx(expect, rel=1e-12)


def test_memory_and_min_degree():
    c = CostModel.preset("internvl3-8b", "ascend-910b")
    # the padded stream is what a rank holds: 4000 tokens at degree 4 run as the 4096 bucket
    assert group_activation_bytes(c, [1000, 3000], 4) == pytest.approx(4096 * c.mem_per_token / 4)
    assert group_activation_bytes(c.replace(bucket_min=0), [1000, 3000], 4) == pytest.approx(4000 * c.mem_per_token / 4)
    cap = max_tokens_per_rank(c)
    assert list(min_degree(c, [1, int(cap), int(cap) + 1, int(3 * cap)])) == [1, 1, 2, 3]


def test_allreduce_is_hierarchical():
    c = CostModel.preset("internvl3-8b", "ascend-910b")
    assert allreduce_time(c, 1) == 0.0
    g = c.grad_bytes
    assert allreduce_time(c, 8) == pytest.approx(2 * 7 / 8 * g / c.bw_intra)
    assert allreduce_time(c, 64) == pytest.approx(2 * 7 / 8 * g / c.bw_intra + 2 * 7 / 8 * (g / 8) / c.bw_inter)
    assert allreduce_time(c, 64) > allreduce_time(c, 8)


def test_freeze_vision_drops_the_encoder_backward():
    c = CostModel.preset("qwen3-vl-2b", "ascend-910b")
    f = CostModel.preset("qwen3-vl-2b", "ascend-910b", freeze_vision=True)
    assert f.a2_vision < c.a2_vision / 2
    assert group_time(f, [20000], 2, [1.0]) < group_time(c, [20000], 2, [1.0])
    assert group_time(f, [20000], 2, [0.0]) == group_time(c, [20000], 2, [0.0])  # text only: unchanged


def test_json_round_trip(tmp_path):
    c = CostModel.preset("qwen3-vl-8b", "h100", ranks_per_node=4, freeze_vision=True)
    path = tmp_path / "cost.json"
    c.save(path)
    assert CostModel.from_profile(path) == c
    assert CostModel.from_dict({"cost": c.to_dict()}) == c
    bad = c.to_dict()
    bad["schema"] = "dhp.cost/v0"
    with pytest.raises(ValueError, match="schema"):
        CostModel.from_dict(bad)
    del bad["schema"]
    bad["surprise"] = 1
    with pytest.raises(ValueError, match="unknown cost model field"):
        CostModel.from_dict(bad)
    path.write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        CostModel.from_profile(path)


def test_bad_inputs_are_named():
    c = CostModel.preset("internvl3-2b", "a100")
    with pytest.raises(ValueError, match="sequence 1: length must be"):
        group_time(c, [10, -5], 1)
    with pytest.raises(ValueError, match="degree must be a positive integer"):
        group_time(c, [10], 0)
    with pytest.raises(ValueError, match="sequence 0: eta must be in"):
        group_time(c, [10], 1, [1.5])
    with pytest.raises(ValueError, match="ranks_per_node"):
        c.replace(ranks_per_node=0)


def _synthetic(true, rng, n=48):
    ms = []
    for i in range(n):
        d = int(rng.choice([1, 2, 3, 4, 5, 7, 8, 12, 16]))
        k = int(rng.integers(1, 4))
        # short sequences at high degree expose the ring traffic; long ones hide it
        hi = 3000 if i % 2 else 80000
        L = rng.integers(128, hi, k).tolist()
        e = rng.uniform(0, 1, k).tolist()
        ms.append({"lengths": L, "etas": e, "degree": d, "seconds": group_time(true, L, d, e)})
    return ms


@pytest.mark.parametrize("model", ["qwen3-vl-2b", "internvl3-8b"])
def test_fit_recovers_known_coefficients(model):
    true = CostModel.preset(model, "ascend-910b", bucket_min=0)  # unpadded: the paper's form
    base = CostModel.preset(model, "a100", bucket_min=0)  # a wrong starting point: other peak rates and links
    fitted, report = fit_cost_model(_synthetic(true, np.random.default_rng(1)), base)
    assert report["max_abs_rel_err"] < 1e-9
    for name in ("a1", "a2", "a2_vision", "b1", "bw_intra", "bw_inter", "lat_intra", "lat_inter"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    json.dumps(report)


def test_fit_keeps_uninformed_coefficients_and_rejects_bad_points():
    true = CostModel.preset("qwen3-vl-2b", "ascend-910b", bucket_min=0)
    base = CostModel.preset("qwen3-vl-2b", "a100", bucket_min=0)
    ms = [m for m in _synthetic(true, np.random.default_rng(2), 60) if m["degree"] <= 8]
    fitted, report = fit_cost_model(ms, base)
    assert "c_inter" in report["kept_from_base"] and fitted.bw_inter == base.bw_inter
    assert fitted.a2 == pytest.approx(true.a2, rel=1e-6)
    with pytest.raises(ValueError, match="at least one measurement"):
        fit_cost_model([], base)
    with pytest.raises(ValueError, match="measurement 0: missing field 'seconds'"):
        fit_cost_model([{"lengths": [1], "degree": 1}], base)
    with pytest.raises(ValueError, match="measurement 0: degree"):
        fit_cost_model([{"lengths": [1], "degree": 0, "seconds": 1.0}], base)


# ------------------------------------------------------------------ machine/executor structure
def test_padded_length_is_the_layouts_bucket():
    """The vectorised ladder in the cost model equals dhp_jax.geometry.layout.bucket_length."""
    from dhp_jax.geometry.layout import bucket_length

    for min_bucket, growth in ((16, 2.0), (16, 1.5), (24, 1.25)):
        c = CostModel.preset("internvl3-2b", "cpu", bucket_min=min_bucket, bucket_growth=growth)
        n = np.arange(0, 1500)
        for d in (1, 2, 3, 5, 6, 8):
            want = [bucket_length(int(k), d, min_bucket, growth) for k in n]
            assert padded_length(c, n, d).tolist() == want, (min_bucket, growth, d)
    off = CostModel.preset("internvl3-2b", "cpu", bucket_min=0)
    assert padded_length(off, [100, 7], 3).tolist() == [100.0, 7.0]


def _by_hand_machine(c, lengths, etas, d, lanes, bucket, overlap):
    """Compute split over min(d, lanes) cores; with a bucket, dense attention on the padded stream;
    without overlap, ring traffic adds to compute."""
    S = sum(lengths)
    if bucket:
        P = bucket(S, d)
        A = c.a1 * P * P
        B = sum((c.a2 + c.a2_vision * math.sqrt(e)) * L for L, e in zip(lengths, etas)) + c.a2 * (P - S)
        S = P
    else:
        A = sum(c.a1 * (1 + e) * L * L for L, e in zip(lengths, etas))
        B = sum((c.a2 + c.a2_vision * math.sqrt(e)) * L for L, e in zip(lengths, etas))
    p = min(d, lanes)
    t_cm = c.kv_bytes_per_token / c.bw_intra * S * (d - 1) / d + c.lat_intra * (d - 1) * d / p
    return (A + B) / p + c.b1 * d / p + t_cm - (min(A / p, t_cm) if overlap else 0.0)


@pytest.mark.parametrize("lengths, etas, d", [
    ([100], [0.0], 1), ([100], [0.25], 2), ([300, 50], [0.5, 0.0], 3), ([700], [0.0], 8), ([40, 40, 41], [0.1] * 3, 6)])
def test_compute_lanes_and_padding_by_hand(lengths, etas, d):
    from dhp_jax.geometry.layout import bucket_length

    base = CostModel.preset("internvl3-2b", "cpu", bucket_min=0).replace(
        a1=2e-7, a2=5e-5, a2_vision=3e-5, b1=4e-3, kv_bytes_per_token=4096.0, bw_intra=2e8, lat_intra=3e-4)
    assert base.compute_lanes == 2 and not base.comm_overlap
    assert group_time(base, lengths, d, etas) == pytest.approx(
        _by_hand_machine(base, lengths, etas, d, 2, None, False), rel=1e-12)
    padded = base.replace(bucket_min=16, compute_lanes=3, comm_overlap=True)
    assert group_time(padded, lengths, d, etas) == pytest.approx(
        _by_hand_machine(padded, lengths, etas, d, 3, bucket_length, True), rel=1e-12)
    # lanes >= degree and no padding is the paper's model
    wide = base.replace(compute_lanes=None)
    assert group_time(wide, lengths, d, etas) == pytest.approx(group_time(base.replace(compute_lanes=64), lengths, d, etas), rel=1e-12)


def test_lanes_make_large_degrees_pay_on_shared_cores():
    c = CostModel.preset("internvl3-2b", "cpu", bucket_min=0).replace(kv_bytes_per_token=0.0, lat_intra=0.0)
    # with no traffic, degree 8 on 2 cores does the compute of degree 2 and 4x the fixed work;
    # with 8 lanes the compute is 4x cheaper and the fixed work that of one rank
    assert group_time(c, [4000], 8) - 4 * c.b1 == pytest.approx(group_time(c, [4000], 2) - c.b1, rel=1e-12)
    eight = c.replace(compute_lanes=8)
    assert group_time(eight, [4000], 8) - eight.b1 == pytest.approx((group_time(c, [4000], 2) - c.b1) / 4, rel=1e-12)
    for hw in ("ascend-910b", "a100", "h100"):
        assert CostModel.preset("internvl3-8b", hw).compute_lanes is None
        assert CostModel.preset("internvl3-8b", hw).comm_overlap


def test_structure_round_trips_and_bad_values_are_named(tmp_path):
    c = CostModel.preset("internvl3-2b", "cpu", bucket_min=16, bucket_growth=1.5)
    c.save(tmp_path / "c.json")
    back = CostModel.from_profile(tmp_path / "c.json")
    assert back == c and back.compute_lanes == 2 and isinstance(back.geometry.bucket_min, int)
    assert group_time(back, [123, 45], 3) == group_time(c, [123, 45], 3)
    with pytest.raises(ValueError, match="compute_lanes must be None or a positive integer, got 0"):
        c.replace(compute_lanes=0)
    with pytest.raises(ValueError, match="bucket_min must be an integer >= 0"):
        c.replace(bucket_min=-1)
    with pytest.raises(ValueError, match="bucket_growth must be > 1"):
        c.replace(bucket_growth=1.0)
    with pytest.raises(ValueError, match="linear_chunk must be an integer >= 0"):
        c.replace(linear_chunk=-4)


def test_geometry_is_one_field_and_flat_cost_files_still_load(tmp_path):
    """The executor's geometry is `CostModel.geometry` (a `StreamGeometry`): written under "geometry",
    read from there or flat (cost files written when it was five fields of the class); both at once
    is refused, and so is an unknown geometry key."""
    c = CostModel.preset("internvl3-8b", "ascend-910b").replace(
        bucket_menu=((1, (4096, 8192)), (2, (8192,))), menu_kinds=((1, 4096, "ring"), (2, 8192, "ulysses")))
    assert c.geometry == StreamGeometry(16, 2.0, 256, ((1, (4096, 8192)), (2, (8192,))),
                                        ((1, 4096, "ring"), (2, 8192, "ulysses")))
    new = json.loads(json.dumps(c.to_dict()))
    assert not set(StreamGeometry.FIELDS) & set(new) and new["geometry"]["bucket_min"] == 16
    flat = {k: v for k, v in new.items() if k != "geometry"} | new["geometry"]
    (tmp_path / "old.json").write_text(json.dumps(flat))
    assert CostModel.from_dict(new) == CostModel.from_profile(tmp_path / "old.json") == c
    assert CostModel.from_dict({k: v for k, v in flat.items() if k not in StreamGeometry.FIELDS}).geometry \
        == StreamGeometry()                                    # a file without geometry: no padding
    with pytest.raises(ValueError, match="both flat and under 'geometry'"):
        CostModel.from_dict({**new, "bucket_min": 16})
    with pytest.raises(ValueError, match="unknown stream geometry field"):
        CostModel.from_dict({**new, "geometry": {**new["geometry"], "bucket_max": 9}})
    with pytest.raises(ValueError, match="must be a StreamGeometry"):
        dataclasses.replace(c, geometry=new["geometry"])


def test_accelerator_presets_price_the_padding_by_hand():
    """Every preset prices the executor's bucket: pad tokens go around the ring and into memory,
    through the linear layers only in the busiest rank's last real chunk (`linear_chunk`; all of
    them with 0); on accelerators attention stays that of the real samples."""
    from dhp_jax.geometry.layout import bucket_length

    c = CostModel.preset("internvl3-8b", "ascend-910b")
    assert c.geometry.bucket_min > 0 and not c.padded_attention
    assert CostModel.preset("internvl3-8b", "cpu").padded_attention
    lengths, etas, d = [11000, 4000], [0.5, 0.0], 3
    P = bucket_length(sum(lengths), d, c.geometry.bucket_min, c.geometry.bucket_growth)
    assert sum(lengths) < P <= max_tokens_per_rank(c) * d  # a rung the memory clamp leaves alone
    A = sum(c.a1 * (1 + e) * L * L for L, e in zip(lengths, etas))
    t_cm = c.kv_bytes_per_token / c.bw_intra * P * (d - 1) / d + c.lat_intra * (d - 1)
    # the executor skips its pad chunks: the busiest rank computes ceil(S/d) real tokens rounded up
    # to chunks; P/d = 5462 slots cut into ceil(5462/256) = 22 chunks of 249 rows
    assert c.geometry.linear_chunk == 256 and P // d == 5462
    computed = {256: d * math.ceil(math.ceil(sum(lengths) / d) / 249) * 249, 0: P}
    assert computed[256] == 3 * 21 * 249 < P
    for chunk, W in computed.items():
        B = sum((c.a2 + c.a2_vision * math.sqrt(e)) * L for L, e in zip(lengths, etas)) + c.a2 * (W - sum(lengths))
        got = group_time(c.replace(linear_chunk=chunk), lengths, d, etas)
        assert got == pytest.approx((A + B) / d + c.b1 + t_cm - min(A / d, t_cm), rel=1e-12)
    assert group_activation_bytes(c, lengths, d) == pytest.approx(P * c.mem_per_token / d)
    # the rung is clamped to the memory budget: padding never makes a fitting group overflow
    near = int(max_tokens_per_rank(c) * 2) - 10
    assert group_activation_bytes(c, [near], 2) <= c.memory_budget * (1 + 1e-9) < group_activation_bytes(c.replace(bucket_min=0), [2 * near], 2)
