"""JSONL manifests: token counts per record kind, image sizes from files, bad lines, draws by seed."""

import json
import re
import math

import numpy as np
import pytest
from PIL import Image

from dhp_jax.data import make_dataset, read_manifest
from dhp_jax.data.manifest import ManifestError, ManifestStats, estimate_text_tokens, iter_manifest
from dhp_jax.data.vision import image_tokens, video_tokens

TURN = 4  # chat-template tokens per turn (manifest.TURN_OVERHEAD_TOKENS)


def _conv(q, a):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return path


@pytest.fixture
def manifest(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (100, 60)).save(tmp_path / "img" / "small.png")
    Image.new("RGB", (1000, 500)).save(tmp_path / "img" / "wide.jpg")
    recs = [
        {"id": "a", "image": "img/small.png", "conversations": _conv("<image>\nWhat is it?", "A box.")},
        {"id": "b", "image": "img/absent.jpg", "width": 448, "height": 448,
         "conversations": _conv("<image>\nDescribe.", "Nothing much here.")},
        {"id": "c", "image": ["img/wide.jpg", "img/small.png"], "image_sizes": [[1000, 500], [100, 60]],
         "conversations": _conv("<image><image> compare", "Same.")},
        {"id": "d", "video": "v.mp4", "duration": 10, "fps": 30, "resolution": "1280x720",
         "conversations": _conv("<video>\nSummarise.", "A man walks.")},
        "",
        {"id": "e", "video": {"path": "w.mp4", "num_frames": 300, "fps": 25, "width": 640, "height": 360},
         "messages": [{"role": "user", "content": "What happens?"}]},
        {"id": "f", "text": "x" * 4001},
        {"id": "g", "image": [{"path": "img/wide.jpg"}], "conversations": _conv("<image>", "ok")},
    ]
    return _write(tmp_path / "m.jsonl", recs)


def _t(s):
    return estimate_text_tokens(s) + TURN


def test_token_counts_per_record(manifest):
    ss = read_manifest(manifest)
    assert [s.sample_id for s in ss] == [1, 2, 3, 4, 6, 7, 8]        # line numbers; line 5 is blank
    a, b, c, d, e, f, g = ss
    assert a.vision_tokens == image_tokens(100, 60) and a.segments[0].meta["width"] == 100
    assert a.text_tokens == _t("\nWhat is it?") + _t("A box.")
    assert b.vision_tokens == 256
    assert c.vision_tokens == image_tokens(1000, 500) + image_tokens(100, 60)
    assert len(c.vision_spans) == 2 and len(c.segments) == 3      # one bidirectional span per image
    assert d.vision_tokens == video_tokens(10, 1280, 720, source_fps=30).num_tokens == 7200
    assert e.vision_tokens == video_tokens(12, 640, 360, source_fps=25).num_tokens
    assert e.segments[0].meta["duration_s"] == 12.0
    assert f.num_tokens == math.ceil(4001 / 4) and f.vision_tokens == 0
    assert g.vision_tokens == image_tokens(1000, 500)
    st = ss.stats
    assert (st.lines, st.samples, st.skipped, st.missing_images, st.images_read) == (7, 7, 0, 1, 2)
    assert "absent.jpg" in st.missing_paths[0] and st.missing_paths[0].startswith("line 2")


def test_families_and_tokenizer(manifest):
    ss = read_manifest(manifest, vision="internvl")
    assert ss[1].vision_tokens == 256 and ss[2].vision_tokens == 256 * (2 + 1) + 256 * (6 + 1)  # 2x1 and 3x2 grids
    assert ss[3].vision_tokens == 10 * 256
    assert read_manifest(manifest, vision="llava")[0].vision_tokens == 576
    words = read_manifest(manifest, tokenizer=lambda s: len(s.split()))
    assert words[0].text_tokens == (3 + TURN) + (2 + TURN)


def test_text_estimate():
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("abcd" * 10) == 10
    assert estimate_text_tokens("数据并行") == math.ceil(4 / 1.5)


@pytest.mark.parametrize("line,field,msg", [
    ("{not json", None, "invalid JSON"),
    ("[1, 2]", None, "expected a JSON object"),
    ({"image": "x.jpg", "width": -3, "height": 10, "conversations": []}, "width", "positive integer"),
    ({"image": "x.jpg", "width": 30}, "height", "without its pair"),
    ({"image": "nofile.jpg"}, "image", "not found and no width/height"),
    ({"video": "v.mp4", "resolution": "1280x720"}, "duration", "missing"),
    ({"video": "v.mp4", "duration": 3, "resolution": "big"}, "resolution", "WxH"),
    ({"video": "v.mp4", "duration": 3}, "resolution", "missing"),
    ({"conversations": [{"from": "human"}]}, "conversations[0].value", "not a string"),
    ({"image": ["a.jpg", "b.jpg"], "image_sizes": [[1, 2]]}, "image_sizes", "2 [width, height]"),
])
def test_bad_lines_name_line_and_field(tmp_path, line, field, msg):
    path = _write(tmp_path / "bad.jsonl", [{"text": "fine"}, "", line])
    with pytest.raises(ManifestError, match=re.escape(msg)) as err:
        read_manifest(path)
    assert err.value.line == 3 and err.value.field == field
    assert "line 3" in str(err.value) and str(path) in str(err.value)
    if field:
        assert repr(field) in str(err.value)
    ss = read_manifest(path, skip_bad=True)
    assert len(ss) == 1 and ss.stats.skipped == 1 and ss.stats.errors[0].startswith("line 3")


def test_streaming_and_limit(tmp_path):
    path = _write(tmp_path / "m.jsonl", [{"text": "a" * (4 * (i + 1))} for i in range(50)] + ["{broken"])
    stats = ManifestStats()
    it = iter_manifest(path, stats=stats)
    first = next(it)
    assert first.num_tokens == 1 and stats.lines == 1      # nothing read beyond the first line
    assert [s.num_tokens for s in read_manifest(path, limit=5)] == [1, 2, 3, 4, 5]


def test_make_dataset_draws_from_manifest(tmp_path):
    recs = [{"image": f"i{i}.jpg", "width": 28 * (i + 4), "height": 28, "text": "t"} for i in range(40)]
    path = str(_write(tmp_path / "m.jsonl", recs))
    a = make_dataset(path, 16, seed=3)
    b = make_dataset(path, 16, seed=3)
    c = make_dataset(path, 16, seed=4)
    la, lb, lc = ([s.num_tokens for s in x] for x in (a, b, c))
    assert la == lb and la != lc
    assert [s.sample_id for s in a] == list(range(16)) and a[0].source == path
    assert len(set(la)) == 16                                   # without replacement: distinct lines
    full = sorted(s.num_tokens for s in read_manifest(path))
    assert sorted(s.num_tokens for s in make_dataset(path, 40, seed=0)) == full
    many = make_dataset(path, 100, seed=0)                      # more than the manifest: with replacement
    assert len(many) == 100 and set(s.num_tokens for s in many) <= set(full)
    assert make_dataset(path, 8, 0, vision="llava")[0].vision_tokens == 576
    with pytest.raises(FileNotFoundError):
        make_dataset(str(tmp_path / "none.jsonl"), 4, 0)


def test_draw_reports_bad_line_number(tmp_path):
    path = str(_write(tmp_path / "m.jsonl", [{"text": "ok"}, "", {"image": "z.jpg", "width": 0, "height": 4}]))
    with pytest.raises(ManifestError, match="line 3: field 'width'"):
        make_dataset(path, 2, 0)
    assert np.all([s.num_tokens > 0 for s in read_manifest(path, skip_bad=True)])


def test_images_and_videos_spellings(tmp_path):
    path = _write(tmp_path / "m.jsonl", [
        {"images": ["a.jpg", "b.jpg"], "image_sizes": [[448, 448], [224, 224]]},
        {"videos": [{"path": "v.mp4", "duration": 10, "fps": 30, "resolution": [1280, 720]}]},
        {"images": "c.jpg"},
    ])
    a, b = read_manifest(path, skip_bad=True)
    assert a.vision_tokens == 256 + 64 and b.vision_tokens == 7200
    with pytest.raises(ManifestError, match="line 3: field 'images'"):
        read_manifest(path)


def test_stdlib_json_path_agrees(tmp_path):
    """Without orjson the reader uses the standard library's scanner directly: same samples, same errors."""
    import subprocess
    import sys
    good = [{"image": "a.jpg", "width": 640, "height": 480, "conversations": _conv("<image>\nQ é", "A")},
            {"video": "v.mp4", "duration": 3.5, "fps": 24, "resolution": "640x360", "text": "x"}, {"text": "y" * 99}]
    path = _write(tmp_path / "m.jsonl", good + ['  {"text": "z"}  ', '{"text": "a"} trailing', "[1"])
    code = f"""
import sys; sys.modules['orjson'] = None
from dhp_jax.data.manifest import read_manifest, _JSON_ERRORS
ss = read_manifest({str(path)!r}, skip_bad=True)
print([s.num_tokens for s in ss], ss.stats.skipped, ss.stats.errors)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    ss = read_manifest(path, skip_bad=True)
    lengths, skipped = [s.num_tokens for s in ss], ss.stats.skipped
    assert out.startswith(f"{lengths} {skipped} ") and skipped == 2
    assert "line 5: invalid JSON" in out and "line 6: invalid JSON" in out


def test_draw_sees_a_changed_manifest(tmp_path):
    path = tmp_path / "m.jsonl"
    _write(path, [{"text": "a" * 4 * (i + 1)} for i in range(10)])
    assert sorted(s.num_tokens for s in make_dataset(str(path), 10, 0)) == list(range(1, 11))
    _write(path, [{"text": "a" * 4 * (i + 1)} for i in range(20)])      # same path, new content
    assert sorted(s.num_tokens for s in make_dataset(str(path), 20, 0)) == list(range(1, 21))
