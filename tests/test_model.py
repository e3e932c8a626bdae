"""The flax model against an independent NumPy forward pass, presets, and `random_samples`."""

import dataclasses

import jax
import numpy as np
import pytest
from scipy.special import erf

from dhp_jax.data import Sample, Segment, random_samples
from dhp_jax.model import MLLMConfig, init_params, reference_loss

NAMES = ["internvl3-2b", "internvl2.5-4b", "internvl3-8b", "qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b"]


@pytest.fixture(scope="module")
def tiny():
    c = MLLMConfig.preset("tiny")
    return c, init_params(c, jax.random.key(0))


# ----------------------------------------------------------------- an independent NumPy model
def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope(x, pos, base):
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _block(p, x, h, kvh, hd, allowed, pos, c):
    """One pre-norm block; allowed[q, k] is the boolean mask, pos the rotary positions."""
    y = _rms(x, p["attn_norm"]["scale"], c.rms_eps)
    q = (y @ p["attn"]["q"]["kernel"]).reshape(len(x), h, hd)
    k = (y @ p["attn"]["k"]["kernel"]).reshape(len(x), kvh, hd)
    v = (y @ p["attn"]["v"]["kernel"]).reshape(len(x), kvh, hd)
    q, k = _rope(q, pos, c.rope_base), _rope(k, pos, c.rope_base)
    out = np.zeros_like(q)
    for head in range(h):
        kv = head // (h // kvh)
        s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
        s = np.where(allowed, s, -np.inf)
        m = np.max(s, -1, keepdims=True)
        e = np.where(allowed, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
        den = e.sum(-1, keepdims=True)
        out[:, head] = (e / np.where(den > 0, den, 1)) @ v[:, kv]
    x = x + out.reshape(len(x), h * hd) @ p["attn"]["o"]["kernel"]
    y = _rms(x, p["mlp_norm"]["scale"], c.rms_eps)
    g, u = y @ p["mlp"]["gate"]["kernel"], y @ p["mlp"]["up"]["kernel"]
    return x + (g / (1 + np.exp(-g)) * u) @ p["mlp"]["down"]["kernel"]


def numpy_sample_loss(c, p, sample):
    """(sum of CE over text->text pairs, their count) for ONE sample, computed densely in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    n = sample.num_tokens
    x = np.zeros((n, c.d_model))
    ids = np.zeros(n, int)
    is_vis = np.zeros(n, bool)
    span = np.zeros(n, int)
    off = 0
    for si, sg in enumerate(sample.segments):
        k = sg.num_tokens
        if sg.is_vision:
            tpf = sg.tokens_per_frame or k
            for f0 in range(0, k, tpf):
                pix = np.asarray(sg.pixels[f0:f0 + tpf], np.float64)
                v = pix @ p["patch_embed"]["kernel"] + p["patch_embed"]["bias"]
                allowed = np.ones((len(v), len(v)), bool)
                for i in range(c.vision_layers):
                    v = _block(p[f"vision_layers_{i}"], v, c.vision_heads, c.vision_heads,
                               c.vision_head_dim, allowed, np.arange(len(v), dtype=float), c)
                v = _rms(v, p["vision_norm"]["scale"], c.rms_eps)
                v = v @ p["proj_fc1"]["kernel"] + p["proj_fc1"]["bias"]
                v = 0.5 * v * (1 + erf(v / np.sqrt(2)))
                x[off + f0: off + f0 + len(v)] = v @ p["proj_fc2"]["kernel"] + p["proj_fc2"]["bias"]
            is_vis[off:off + k] = True
            span[off:off + k] = si + 1
        else:
            ids[off:off + k] = sg.token_ids
            x[off:off + k] = p["embed"]["embedding"][sg.token_ids]
        off += k
    pos = np.arange(n)
    allowed = (pos[None] <= pos[:, None]) | ((span[:, None] == span[None]) & (span[:, None] > 0))
    for i in range(c.num_layers):
        x = _block(p[f"layers_{i}"], x, c.num_heads, c.num_kv_heads, c.head_dim, allowed, pos.astype(float), c)
    logits = _rms(x, p["final_norm"]["scale"], c.rms_eps) @ p["lm_head"]["kernel"]
    total, count = 0.0, 0
    for t in range(n - 1):
        if not is_vis[t] and not is_vis[t + 1]:
            z = logits[t]
            total += np.log(np.exp(z - z.max()).sum()) + z.max() - z[ids[t + 1]]
            count += 1
    return total, count


def test_reference_loss_matches_numpy_model(tiny):
    c, p = tiny
    samples = random_samples(c, [37, 1, 18, 52, 25, 9], seed=3)
    kinds = {sg.modality for s in samples for sg in s.segments}
    assert kinds == {"text", "image", "video"}, kinds
    parts = [numpy_sample_loss(c, p, s) for s in samples]
    want = sum(t for t, _ in parts) / sum(n for _, n in parts)
    got = float(reference_loss(c, p, samples))
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_loss_is_order_free(tiny):
    # (token weighting itself is checked above: the NumPy loss is sum over samples / count)
    c, p = tiny
    samples = random_samples(c, [30, 12, 44], seed=5)
    whole = float(reference_loss(c, p, samples))
    rev = float(reference_loss(c, p, samples[::-1]))
    assert abs(whole - rev) <= 1e-5 * abs(whole)


def test_reference_loss_grads_are_finite_and_nonzero(tiny):
    c, p = tiny
    samples = random_samples(c, [20, 33], seed=7)
    g = jax.grad(lambda q: reference_loss(c, q, samples))(p)
    leaves = jax.tree.leaves_with_path(g)
    for path, leaf in leaves:
        a = np.asarray(leaf)
        assert np.all(np.isfinite(a)), path
        assert np.any(a != 0), f"gradient of {jax.tree_util.keystr(path)} is identically zero"


def test_vocab_and_payload_errors_name_the_sample(tiny):
    c, p = tiny
    bad = Sample((Segment("text", 3, token_ids=np.array([1, 2, c.vocab_size], np.int32)),), sample_id="s7")
    with pytest.raises(ValueError, match="sample 's7'.*vocabulary"):
        reference_loss(c, p, [bad])
    with pytest.raises(ValueError, match="sample 'x'.*pixels"):
        reference_loss(c, p, [Sample.from_lengths(text=4, vision=3, sample_id="x")])


def test_presets_and_config_checks(tiny):
    tiny, p = tiny
    assert sum(x.size for x in jax.tree.leaves(p)) == tiny.num_params()
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(p))
    for name in NAMES:
        c = MLLMConfig.preset(name)
        assert c.name == name and c.num_heads % c.num_kv_heads == 0
        assert 1e9 < c.num_params() < 1.2e10, (name, c.num_params())
    assert MLLMConfig.preset("qwen3-vl-8b").vision_dim == 1152
    assert (MLLMConfig.preset("internvl3-2b").num_layers, MLLMConfig.preset("internvl3-2b").num_kv_heads) == (28, 2)
    with pytest.raises(ValueError, match="unknown model preset"):
        MLLMConfig.preset("gpt-9")
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(tiny, num_heads=4, num_kv_heads=3)


def test_random_samples_lengths_payloads_and_determinism(tiny):
    c, _ = tiny
    lengths = [1, 2, 3, 4, 5, 17, 64, 100, 0]
    a = random_samples(c, lengths, seed=11)
    b = random_samples(c, lengths, seed=11)
    assert [s.num_tokens for s in a] == lengths
    for s, t in zip(a, b):
        assert s.sample_id == t.sample_id
        for x, y in zip(s.segments, t.segments):
            assert x.modality == y.modality
            if x.is_vision:
                assert x.pixels.shape == (x.num_tokens, c.patch_dim) and np.array_equal(x.pixels, y.pixels)
            else:
                assert x.token_ids.max(initial=0) < c.vocab_size and np.array_equal(x.token_ids, y.token_ids)
    many = random_samples(c, [50] * 40, seed=2)
    assert {sg.modality for s in many for sg in s.segments} == {"text", "image", "video"}
