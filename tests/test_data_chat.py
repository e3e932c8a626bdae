"""Chat template, tokenization, placeholder expansion and labels against transformers: its
tokenizer's `apply_chat_template` and its processors' own placeholder-expansion methods, on a tiny
tokenizer trained offline and saved as transformers saves it."""

import numpy as np
import pytest

from dhp_jax.data.chat import IGNORE, ChatTokenizer, to_messages
from dhp_jax.data.example import write_processor_files
from dhp_jax.data.media import VideoInfo
from dhp_jax.data.processors import VisionProcessor

transformers = pytest.importorskip("transformers")

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "internvl"]
RECORDS = [
    {"conversations": [{"from": "human", "value": "<image>\nwhat is in the picture"},
                       {"from": "gpt", "value": "a red square"},
                       {"from": "human", "value": "and the <video> there?"},
                       {"from": "gpt", "value": "two shapes move left"}]},
    {"messages": [{"role": "system", "content": "describe"},
                  {"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "the color"}]},
                  {"role": "assistant", "content": "blue circle"}]},
]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_processor_files(str(d), request.param)
    return request.param, str(d)


def _reference_processor(family, hf_tok, vp):
    """A transformers processor object with just what its placeholder expansion reads (the full
    processor cannot be built here: its video processor needs torchvision)."""
    from types import SimpleNamespace
    from transformers import InternVLProcessor, Qwen2_5_VLProcessor, Qwen3VLProcessor
    cls = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor, "internvl": InternVLProcessor}[family]
    p = object.__new__(cls)
    if family == "internvl":
        p.image_seq_length = vp.image_seq_length
        p.start_image_token, p.end_image_token = hf_tok.start_image_token, hf_tok.end_image_token
        p.image_token, p.video_token = hf_tok.context_image_token, hf_tok.video_token
    else:
        p.image_token, p.video_token = hf_tok.image_token, hf_tok.video_token
        p.vision_start_token, p.vision_end_token = hf_tok.vision_start_token, hf_tok.vision_end_token
        p.image_processor = SimpleNamespace(merge_size=2)
        p.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    return p


def _reference_ids(family, hf_tok, vp, text, image_sizes, videos):
    from transformers.video_utils import VideoMetadata
    proc = _reference_processor(family, hf_tok, vp)
    grids = np.asarray([vp.image_grid(w, h) for w, h in image_sizes]).reshape(-1, 3)
    if family == "internvl":
        imgs = [proc.replace_image_token({"num_patches": grids[:, 0]}, i) for i in range(len(grids))]
        vids = [proc.replace_video_token({"pixel_values_videos": [np.zeros((len(vp.frame_indices(v)), 1))]}, 0)
                for v in videos]
    else:
        imgs = [proc.replace_image_token({"image_grid_thw": grids}, i) for i in range(len(grids))]
        vids = []
        for v in videos:
            plan = vp.video_plan(v)
            meta = VideoMetadata(total_num_frames=v.total_frames, fps=v.fps, frames_indices=plan.indices)
            vids.append(proc.replace_video_token({"video_grid_thw": np.asarray([plan.grid]),
                                                 "video_metadata": [meta]}, 0))
    expanded, _ = proc.get_text_with_replacements([text], imgs, vids)
    return hf_tok(expanded[0], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("rec", RECORDS)
def test_ids_equal_transformers(family_dir, rec):
    family, d = family_dir
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    vp = VisionProcessor.from_pretrained(d)
    ct = ChatTokenizer.from_pretrained(d, family)
    sizes, videos = [(640, 480)], [VideoInfo(37, 8.0, 96, 64)]
    msgs = to_messages(rec, 1, 1)
    text = ct.render(msgs)
    assert text == hf_tok.apply_chat_template(msgs, tokenize=False)
    vexp = [ct.video_expansion(vp.video_plan(v), vp.image_seq_length) for v in videos]
    enc = ct.encode_conversation(msgs, [ct.image_expansion(vp.image_tokens(*s)) for s in sizes], vexp)
    want = _reference_ids(family, hf_tok, vp, text, sizes, videos)
    assert enc.input_ids.tolist() == want
    # labels: exactly each assistant turn's text followed by its end-of-turn token
    answers = [m["content"][0]["text"] for m in msgs if m["role"] == "assistant"]
    learned = enc.labels[enc.labels != IGNORE].tolist()
    assert learned == sum((hf_tok(a + "<|im_end|>", add_special_tokens=False)["input_ids"] for a in answers), [])
    assert hf_tok.decode(learned) == "".join(a + "<|im_end|>" for a in answers)
    assert (enc.mm_token_type_ids[enc.labels != IGNORE] == 0).all()
    n_img = int((enc.mm_token_type_ids == 1).sum())
    assert n_img == vp.image_tokens(*sizes[0]) + (2 if family == "internvl" else 0) + \
        ((vp.image_seq_length + 2) * len(vp.frame_indices(videos[0])) if family == "internvl" else 0)


def test_to_messages_rules():
    m = to_messages({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, 2, 0)
    assert m[0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    with pytest.raises(ValueError, match="markers"):
        to_messages({"conversations": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]}, 1, 0)
    with pytest.raises(ValueError, match="unknown role"):
        to_messages({"messages": [{"role": "robot", "content": "x"}]}, 0, 0)


def test_end_of_turn_when_eos_is_not_the_turn_end(tmp_path):
    """A base checkpoint whose eos is <|endoftext|>: the turn still ends at <|im_end|>, and the
    newline the template writes after it is not learned."""
    import json
    write_processor_files(str(tmp_path), "qwen2_5_vl")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|endoftext|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ct = ChatTokenizer.from_pretrained(str(tmp_path), "qwen2_5_vl")
    msgs = to_messages({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, 0, 0)
    enc = ct.encode_conversation(msgs, [], [])
    learned = [int(i) for i in enc.labels if i != IGNORE]
    assert ct.tok.decode(learned, skip_special_tokens=False) == "yo<|im_end|>"
