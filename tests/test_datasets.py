"""The named mixes: the heterogeneity each was designed to have, vision families, determinism."""

import numpy as np
import pytest

from dhp_jax.data import DATASETS, make_dataset


def _durations(samples):
    return np.array([g.meta["duration_s"] for s in samples for g in s.segments if g.modality == "video"])


def _lengths(samples):
    return np.array([s.num_tokens for s in samples])


def test_names_and_ids():
    assert set(DATASETS) == {"openvid", "internvid", "msrvtt", "llava-mix", "text-longtail"}
    for name in DATASETS:
        ss = make_dataset(name, 32, seed=1)
        assert len(ss) == 32
        assert [s.sample_id for s in ss] == list(range(32))
        assert all(s.source == name and s.num_tokens > 0 for s in ss)
        assert all(g.pixels is None and g.token_ids is None for s in ss for g in s.segments)
    assert make_dataset("openvid", 0, seed=0) == []


def test_unknown_name_and_bad_count():
    with pytest.raises(ValueError, match="known: openvid"):
        make_dataset("kinetics", 4, 0)
    with pytest.raises(ValueError, match="num_samples"):
        make_dataset("openvid", -1, 0)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_deterministic_per_seed(name):
    a, b, c = (make_dataset(name, 64, seed=s) for s in (7, 7, 8))
    assert [[(g.modality, g.num_tokens, dict(g.meta)) for g in s.segments] for s in a] == \
           [[(g.modality, g.num_tokens, dict(g.meta)) for g in s.segments] for s in b]
    assert not np.array_equal(_lengths(a), _lengths(c))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_openvid_long_tail(seed):
    ss = make_dataset("openvid", 512, seed)
    d = _durations(ss)
    assert len(d) == 512
    assert np.median(d) < 8.0                       # most clips short
    assert np.sum(d > 64) == round(0.02 * 512)      # designed tail: exactly 2% past 64 s
    assert d.max() <= 240
    lengths = _lengths(ss)
    assert np.percentile(lengths, 99) > 10 * np.median(lengths)   # heterogeneous token lengths


def test_internvid_and_msrvtt_match_published_means():
    d = _durations(make_dataset("internvid", 4096, 3))
    assert 10.5 <= d.mean() <= 13.0                 # published mean ~11.7 s
    assert np.mean(d < 10) > 0.6                    # most clips under 10 s
    assert np.sum(d > 64) == round(0.015 * 4096)
    d = _durations(make_dataset("msrvtt", 4096, 3))
    assert 14.3 <= d.mean() <= 15.3                 # 41.2 h / 10k clips = 14.8 s
    assert d.min() >= 10.0 and d.max() <= 30.0      # MSR-VTT clips last 10-30 s: no invented tail
    assert np.mean(d == 10.0) < 0.01                # truncated, not clipped: no pile at the ends


def test_text_longtail_matches_wikipedia_figures():
    lengths = _lengths(make_dataset("text-longtail", 20000, 0))
    assert abs(np.median(lengths) / 347 - 1) < 0.06
    assert abs(lengths.mean() / 1014 - 1) < 0.08
    assert abs(np.percentile(lengths, 99) / 10921 - 1) < 0.15


def test_llava_mix_composition():
    ss = make_dataset("llava-mix", 1000, 5)
    n_img = np.array([sum(g.modality == "image" for g in s.segments) for s in ss])
    assert np.sum(n_img == 0) == 60 and np.sum(n_img == 1) == 820 and np.sum(n_img >= 2) == 120
    assert n_img.max() <= 6
    assert all(s.segments[-1].modality == "text" for s in ss)


def test_vision_family_changes_tokens_not_shapes():
    q = make_dataset("openvid", 64, 4, vision="qwen-vl")
    i = make_dataset("openvid", 64, 4, vision="internvl")
    assert np.array_equal(_durations(q), _durations(i))
    for s in i:
        v = s.segments[1]
        assert v.num_tokens == 256 * v.meta["frames"] and v.meta["family"] == "internvl"
    llava = make_dataset("llava-mix", 64, 4, vision="llava")
    assert all(g.num_tokens == 576 for s in llava for g in s.segments if g.modality == "image")
