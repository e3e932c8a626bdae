"""Qwen2.5-VL in PlanExecutor on 8 fake CPU devices: one two-micro-batch DHP step (ring groups of
degrees 3 and 5, then Ulysses over 4) of image, video and text samples gives transformers' loss and
autograd gradients at fp32, relative error <= 1e-5 (`hf_engine_cases`)."""

import pytest

import hf_cases as hc
from hf_cases import transformers

import hf_engine_cases as ec
from test_hf_qwen2_5_vl import video_inputs

IMAGE, VIDEO = hc.QWEN_IMAGE, hc.QWEN_VIDEO


def qwen2_5_vl_batch(g):
    return [ec.qwen_image(g, 8, 8, 3, 4), hc.qwen_text_inputs(), video_inputs(g), ec.qwen_image(g, 4, 8, 5, 2),
            ec.qwen_image(g, 8, 4, 1, 6)]


# degrees 3 and 5 on 8 devices (4 query heads: ring only); a group's samples are not in batch order
IRREGULAR = ec.plan([((0, 1, 2), (0, 3), "ring"), ((3, 4, 5, 6, 7), (2, 1, 4), "ring")])
# then Ulysses over 4, out of order (2 KV heads repeated, 2 vision heads padded to 4): three
# executables (the other families run a hybrid instead)
MIXED = ec.plan([((0, 1, 2), (0,), "ring"), ((3, 4, 5, 6, 7), (2, 1), "ring")], [((3, 1, 0, 2), (4, 3), "ulysses")])


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    # 4 query heads, 2 KV heads (Ulysses 4 repeats KV heads); 2 vision heads (padded under Ulysses 4)
    return ec.build_case(tmp_path_factory, "engine_qwen2_5_vl", transformers.Qwen2_5_VLForConditionalGeneration,
                         hc.qwen2_5_vl_config(depth=2), qwen2_5_vl_batch, (IMAGE, VIDEO))


def test_qwen2_5_vl_step_matches_transformers(qwen2_5_vl):
    ec.check_step(qwen2_5_vl, MIXED, "qwen2_5_vl ring-3+5 / ulysses-4")


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
