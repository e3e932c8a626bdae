"""The pure-NumPy token layout: buckets, zigzag order, ids, targets, and bad input."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from dhp_jax.data import Sample, Segment, random_samples
from dhp_jax.geometry.layout import bucket_length, ladder, pack_group, zigzag_permutation
from dhp_jax.model import MLLMConfig, init_params, reference_loss
from dhp_jax.model.mllm import apply_model, token_loss_sum
from dhp_jax.model.reference import reference_stream

C = MLLMConfig.preset("tiny")


def test_layout_imports_no_jax():
    code = "import sys, dhp_jax.geometry.layout, dhp_jax.data.synthetic; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("degree", [1, 2, 3, 5, 7, 8])
def test_buckets_divisible_and_bounded(degree):
    seen = set()
    for n in range(0, 3000, 7):
        b = bucket_length(n, degree)
        assert b >= max(n, 1) and b % (2 * degree) == 0
        assert b < 2 * ladder(n) + 2 * degree
        seen.add(b)
    rungs = {ladder(n) for n in range(0, 3000, 7)}
    assert len(seen) == len(rungs)


@pytest.mark.parametrize("degree", [1, 3, 5, 8])
def test_zigzag_gives_device_i_chunks_i_and_mirror(degree):
    s = 4 * degree * 3
    perm = zigzag_permutation(s, degree)
    assert sorted(perm.tolist()) == list(range(s))
    c = s // (2 * degree)
    for i in range(degree):
        shard = perm[i * 2 * c:(i + 1) * 2 * c]
        assert shard.tolist() == list(range(i * c, (i + 1) * c)) + list(range((2 * degree - 1 - i) * c, (2 * degree - i) * c))
    with pytest.raises(ValueError, match="divisible"):
        zigzag_permutation(10, 3)


@pytest.mark.parametrize("degree", [1, 3, 5])
def test_pack_matches_independent_stream(degree):
    samples = random_samples(C, [23, 1, 40, 9, 31], seed=4)
    lay = pack_group(samples, degree, C)
    ref = reference_stream(C, samples)
    n = lay.num_tokens
    assert n == sum(s.num_tokens for s in samples) and lay.bucket == bucket_length(n, degree)
    assert lay.num_loss_tokens == int(ref["loss_weights"].sum())
    for name, arr in lay.arrays().items():
        assert arr.shape[0] == lay.bucket, name
        np.testing.assert_array_equal(lay.tokens(arr), ref[name], err_msg=name)
        pad = np.ones(lay.bucket, bool)
        pad[lay.real_index] = False
        assert not np.any(arr[pad]), f"{name} is not zero on padding"
    assert lay.sample_offsets == tuple(np.cumsum([0] + [s.num_tokens for s in samples[:-1]]))


@pytest.mark.parametrize("degree", [1, 2, 3, 8])
def test_padding_sits_at_the_end_of_every_shard_and_real_tokens_balance(degree):
    for lengths in ([23, 1, 40, 9, 31], [3], [5, 2]):
        samples = random_samples(C, lengths, seed=5)
        for bucket in (None, bucket_length(sum(lengths), degree) + 4 * degree):
            lay = pack_group(samples, degree, C, bucket=bucket)
            n, shard = lay.num_tokens, lay.bucket // degree
            real = lay.segment_ids.reshape(degree, shard) > 0
            counts = real.sum(axis=1)
            assert counts.tolist() == lay.real_per_shard.tolist() and counts.sum() == n
            assert counts.max() - counts.min() <= 1 and counts.tolist() == sorted(counts, reverse=True)
            for i in range(degree):                     # real prefix, padding tail
                assert real[i, :counts[i]].all() and not real[i, counts[i]:].any()
            # real tokens follow the stream (unpermuted) order, so the zigzag keeps its balance
            stream_pos = lay.permutation[lay.real_index]
            assert np.all(np.diff(stream_pos) > 0)


def test_video_frames_and_spans():
    pix = np.ones((7, C.patch_dim), np.float32)
    s = Sample((Segment("text", 2, token_ids=np.array([3, 4], np.int32)),
                Segment("video", 7, pixels=pix, tokens_per_frame=3),
                Segment("image", 2, pixels=pix[:2]),
                Segment("text", 3, token_ids=np.array([5, 6, 7], np.int32))))
    lay = pack_group([s], 1, C)
    f = lay.tokens(lay.frame_ids)
    assert f.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 4, 0, 0, 0]
    assert lay.tokens(lay.frame_positions).tolist() == [0, 0, 0, 1, 2, 0, 1, 2, 0, 0, 1, 0, 0, 0]
    assert lay.tokens(lay.span_ids).tolist() == [0, 0] + [1] * 7 + [2] * 2 + [0] * 3
    w = lay.tokens(lay.loss_weights)
    assert w.tolist() == [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]
    assert lay.tokens(lay.targets).tolist() == [4] + [0] * 10 + [6, 7, 0]


def test_dense_model_on_layout_equals_reference():
    params = init_params(C, jax.random.key(0))
    samples = random_samples(C, [29, 1, 44, 13], seed=9)
    want = float(reference_loss(C, params, samples))
    for degree in (2, 5):
        lay = pack_group(samples, degree, C)
        arr = lay.arrays()
        batch = {k: v for k, v in arr.items() if k not in ("targets", "loss_weights")}
        loss_sum = jax.jit(lambda p, b, t, w: token_loss_sum(apply_model(C, p, b), t, w))
        got = float(loss_sum(params, batch, arr["targets"], arr["loss_weights"])) / lay.num_loss_tokens
        assert abs(got - want) <= 1e-5 * abs(want), (degree, got, want)


def test_bad_input_is_named():
    ok = random_samples(C, [5], seed=0)[0]
    bad_tok = Sample((Segment("text", 2, token_ids=np.array([1, 999], np.int32)),), sample_id=42)
    with pytest.raises(ValueError, match="sample 42.*token id 999"):
        pack_group([ok, bad_tok], 2, C)
    with pytest.raises(ValueError, match="sample 'v'.*no pixels"):
        pack_group([Sample.from_lengths(text=2, vision=4, sample_id="v")], 1, C)
    wide = Sample((Segment("image", 2, pixels=np.zeros((2, C.patch_dim + 1), np.float32)),), sample_id="w")
    with pytest.raises(ValueError, match="sample 'w'.*pixels have shape"):
        pack_group([wide], 1, C)
    with pytest.raises(ValueError, match="bucket 4 cannot hold"):
        pack_group([ok], 1, C, bucket=4)
    with pytest.raises(ValueError, match="degree"):
        pack_group([ok], 0, C)
