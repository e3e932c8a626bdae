"""The demo's family models (`model=tiny-qwen2_5_vl`, the default, `tiny-qwen3_vl`, `tiny-internvl`):
synthetic samples in each family's input format with the stand-in's lengths and learnable signal.

The data tests run no model. A short `dhp train` of the default (the family model) whose loss falls
is `test_train_runs.test_demo_shows_dhp_and_never_loses_the_run`."""

import numpy as np
import pytest

from dhp_jax.model import hf
from dhp_jax.models import spec
from dhp_jax.train.train_config import load_config
from dhp_jax.train.demo_models import DEMO_MODELS, FIRST_TEXT, TOKENS, FamilyDemoPipeline, demo_config
from dhp_jax.train.pipeline import DataPipeline

SMALL = ["data.batch_size=8", "data.max_tokens=96"]


def _pipeline(family, *extra):
    cfg = load_config(None, [f"model=tiny-{family}", *SMALL, *extra])
    return FamilyDemoPipeline(cfg.data, hf.parse_config(demo_config(family))), cfg


@pytest.mark.parametrize("family", sorted(set(DEMO_MODELS.values())))
def test_samples_are_the_familys_inputs_at_the_demos_lengths(family):
    pipe, cfg = _pipeline(family)
    stand_in = DataPipeline(cfg.data, 256, 12)
    batch = pipe.batch(3)
    again = pipe.batch(3)
    # the same source batch as the stand-in's (so the plans, made at full size, are the stand-in demo's)
    assert [s.num_tokens for s in batch.source_samples] == [s.num_tokens for s in stand_in.batch(3).source_samples]
    for s, s2, src, c in zip(batch.samples, again.samples, batch.source_samples, batch.concepts):
        shape = stand_in.scale_segments(src)
        # the family's token rules: every vision span wrapped in start/end tokens; Qwen3-VL (and its
        # MoE) a run per video frame; InternVL whole tiles of 4 tokens a frame
        frames = [n // f for m, n, f in shape if m != "text"]
        per = [f for m, n, f in shape if m != "text"]
        text = sum(n for m, n, f in shape if m == "text")
        if family == "qwen2_5_vl":
            expect = text + sum(n + 2 for m, n, f in shape if m != "text")
        elif getattr(spec(family).demo, "per_frame_runs", False):      # Qwen3-VL and Qwen3-VL-MoE
            expect = text + sum(k * (p + 2) for k, p in zip(frames, per))
        else:
            expect = text + sum(k * (-(-p // 4) * 4 + 2) for k, p in zip(frames, per))
        assert s.num_tokens == expect, (family, shape, [(g.modality, g.num_tokens) for g in s.segments])
        # the round trip through the processor format gives the same sample (positions included)
        back = hf.sample_from_inputs(pipe.hf, hf.inputs_from_sample(pipe.hf, s), None, sample_id=s.sample_id)
        assert [(g.modality, g.num_tokens, g.tokens_per_frame) for g in back.segments] == \
            [(g.modality, g.num_tokens, g.tokens_per_frame) for g in s.segments]
        for g, b in zip(s.segments, back.segments):
            np.testing.assert_array_equal(g.meta["positions"], b.meta["positions"])
        # labels: exactly the caption (cue + the concept's tokens), the sample's last tokens
        labels = np.concatenate([g.meta["labels"] for g in s.segments])
        n_cap = shape[-1][1]
        assert (labels[:-n_cap] == -100).all() and labels[-n_cap:].tolist() == s.segments[-1].token_ids[-n_cap:].tolist()
        assert labels[-n_cap + 2:].tolist() == pipe.captions[c, :n_cap - 2].tolist()
        ids = np.concatenate([g.token_ids for g in s.segments if g.modality == "text"])
        assert ids.min() >= min(TOKENS.values()) and set(ids.tolist()) - {TOKENS["vision_start"],
                                                                         TOKENS["vision_end"]} <= set(range(FIRST_TEXT, 256))
        # pixels (as the processor format holds them): the concept's prototype plus noise, drawn
        # the same for the same (seed, step)
        inputs, inputs2 = hf.inputs_from_sample(pipe.hf, s), hf.inputs_from_sample(pipe.hf, s2)
        key = "pixel_values" if family == "internvl" else "pixel_values_videos"
        np.testing.assert_array_equal(inputs[key], inputs2[key])
        rows = inputs[key].reshape(-1, pipe.patch_dim)
        assert rows.shape[0] == (sum(frames[i] * -(-per[i] // 4) for i in range(len(per))) if family == "internvl"
                                 else 4 * sum(n for m, n, f in shape if m != "text"))
        assert abs(float((rows - pipe.prototypes[c]).std()) - cfg.data.noise) < 0.05


def test_the_demo_batch_keeps_the_mixed_lengths_and_the_same_concepts_share_a_caption():
    pipe, _ = _pipeline("qwen2_5_vl", "data.batch_size=32", "data.max_tokens=384")
    batch = pipe.batch(0)
    assert batch.lengths.max() > 4 * np.median(batch.lengths)       # the long tail is still there
    caps = {}
    for s, c in zip(batch.samples, batch.concepts):
        lab = s.segments[-1].meta["labels"]
        ids = lab[lab != -100][2:].tolist()          # the concept's tokens, after the cue
        prev = caps.setdefault(int(c), ids)
        n = min(len(ids), len(prev))
        assert ids[:n] == prev[:n]
    assert len(caps) > 1 and len({tuple(v[:3]) for v in caps.values()}) == len(caps)


def test_an_unknown_model_is_one_line_naming_the_family_models(tmp_path, capsys):
    from dhp_jax.cli import main

    assert main(["train", "model=tiny-qwen4", "--dry-run", "--out", str(tmp_path / "x")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tiny-qwen4" in last and "'tiny'" in last and "tiny-qwen2_5_vl" in last and "Traceback" not in last
