"""Qwen2.5-VL in PlanExecutor on 8 fake CPU devices: one DHP step (ring groups of degrees 3 and 5;
Ulysses over 4 and a hybrid 2 x 2) of image, video and text samples gives transformers' loss and
autograd gradients at fp32, relative error <= 1e-5 (`hf_engine_cases`)."""

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import transformers

import hf_engine_cases as ec
from test_hf_qwen2_5_vl import video_inputs

IMAGE, VIDEO, START, END = 120, 121, 122, 123


def qwen2_5_vl_config():
    # 4 query heads, 2 KV heads (Ulysses 4 repeats KV heads); 2 vision heads (padded under Ulysses 4)
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=16, out_hidden_size=64,
                           fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def qwen2_5_vl_batch(g):
    return [ec.qwen_image(g, 8, 8, 3, 4), hc.qwen_text_inputs(), video_inputs(g), ec.qwen_image(g, 4, 8, 5, 2),
            ec.qwen_image(g, 8, 4, 1, 6)]


# degrees 3 and 5 on 8 devices (4 query heads: ring only); a group's samples are not in batch order
IRREGULAR = ec.plan([((0, 1, 2), (0, 3), "ring"), ((3, 4, 5, 6, 7), (2, 1, 4), "ring")])
# Ulysses over 4 (2 KV heads repeated, 2 vision heads padded to 4) and Ulysses 2 x ring 2
ALL_TO_ALL = ec.plan([((0, 1, 2, 3), (0, 3), "ulysses"), ((7, 5, 6, 4), (2, 1, 4), "hybrid:2x2")])
PLANS = {"ring-3+5": IRREGULAR, "ulysses-4+hybrid-2x2": ALL_TO_ALL}


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    return ec.build_case(tmp_path_factory, "engine_qwen2_5_vl", transformers.Qwen2_5_VLForConditionalGeneration,
                         qwen2_5_vl_config(), qwen2_5_vl_batch, (IMAGE, VIDEO))


@pytest.mark.parametrize("name", list(PLANS))
def test_qwen2_5_vl_step_matches_transformers(qwen2_5_vl, name):
    ec.check_step(qwen2_5_vl, PLANS[name], f"qwen2_5_vl {name}")


def test_bad_samples_fail_before_device_work(qwen2_5_vl):
    """A sample without its rotary positions, with labels of the wrong length or with pixels that
    do not make its grid is rejected by `prepare`, naming the group, the sample and the segment."""
    import dataclasses

    from dhp_jax.data.sample import Sample
    cfg, params, samples, _, ex = qwen2_5_vl
    image = samples[0]

    def with_segment(i, **changes):
        segs = list(image.segments)
        segs[i] = dataclasses.replace(segs[i], **changes)
        return Sample(tuple(segs), sample_id="bad")

    no_positions = with_segment(0, meta={k: v for k, v in image.segments[0].meta.items() if k != "positions"})
    short_labels = with_segment(0, meta={**image.segments[0].meta, "labels": image.segments[0].meta["labels"][:-1]})
    bad_grid = with_segment(1, meta={**image.segments[1].meta, "grid_thw": (1, 4, 8)})
    for bad, words in [(no_positions, "sample 'bad' segment 0: no meta['positions']"),
                       (short_labels, "sample 'bad' segment 0: labels have shape"),
                       (bad_grid, "sample 'bad' segment 1: image pixels")]:
        with pytest.raises(ValueError, match="micro-batch 0 group 0") as err:
            ex.prepare([bad] + samples[1:], IRREGULAR)
        assert words in str(err.value), str(err.value)
