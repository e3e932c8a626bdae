"""Records -> samples: counts from metadata equal the processed samples, the other sources give
the same samples as JSONL, every kind of bad data is named, and the loader is seeded and resumable."""

import json
import os
import time

import numpy as np
import pytest

from dhp_jax.data.example import write_example_data, write_image, write_processor_files, write_video
from dhp_jax.data.finetune import DataError, FinetuneData, write_issues
from dhp_jax.data.loader import Loader
from dhp_jax.data.sources import iter_hf_dataset, iter_jsonl, iter_webdataset

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "internvl"]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    root = tmp_path_factory.mktemp("example")
    manifest = write_example_data(str(root / "data"), num_samples=12)
    cks = {}
    for fam in FAMILIES:
        write_processor_files(str(root / fam), fam)
        cks[fam] = str(root / fam)
    return manifest, cks


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_counts_equal_processed(example, family):
    manifest, cks = example
    data = FinetuneData(cks[family])
    issues, notes = [], []
    planned = list(data.scan(iter_jsonl(manifest), issues=issues))
    assert not issues and len(planned) == 12
    kinds = set()
    for p in planned:
        out = data.materialize(p, notes)
        assert out["input_ids"].shape == (1, p.num_tokens) == out["labels"].shape, p.where
        kinds.update(m.kind for m in p.record.media)
        if family == "internvl":
            tiles = sum(g[0] for g in p.image_grids) + sum(v.grid[0] for v in p.video_plans)
            assert out.get("pixel_values", np.zeros((0,))).shape[0] == tiles
            ctx = data.chat.tok.token_to_id("<IMG_CONTEXT>")
            assert int((out["input_ids"] == ctx).sum()) == tiles * data.vision.image_seq_length
        else:
            if p.image_grids:
                assert out["pixel_values"].shape[0] == int(out["image_grid_thw"].prod(1).sum())
                assert int((out["mm_token_type_ids"] == 1).sum()) == int(out["image_grid_thw"].prod(1).sum()) // 4
            if p.video_plans:
                assert out["pixel_values_videos"].shape[0] == int(out["video_grid_thw"].prod(1).sum())
                assert int((out["mm_token_type_ids"] == 2).sum()) == int(out["video_grid_thw"].prod(1).sum()) // 4
        sample = p.to_sample()  # what the planner packs: same length, vision spans where the placeholders are
        assert sample.num_tokens == p.num_tokens
        assert sample.vision_tokens == int((out["mm_token_type_ids"] != 0).sum())
    assert kinds == {"image", "video"}
    assert {n.kind for n in notes} == {"converted_image"}  # the example's grey/RGBA images, converted


def test_webdataset_and_hf_sources_match_jsonl(example, tmp_path):
    manifest, cks = example
    data = FinetuneData(cks["qwen2_5_vl"])
    want = [p.encoded.input_ids.tolist() for p in data.scan(iter_jsonl(manifest))]
    root = os.path.dirname(manifest)
    recs = [json.loads(line) for line in open(manifest)]
    # webdataset: one json member per sample plus its media members, two shards
    import tarfile
    import io
    for s in range(2):
        with tarfile.open(tmp_path / f"shard-{s}.tar", "w") as tf:
            for k, rec in enumerate(recs[s * 6:(s + 1) * 6]):
                key = f"{s * 6 + k:06d}"
                files = {"json": json.dumps({kk: v for kk, v in rec.items() if kk not in ("image", "images", "video")}).encode()}
                for j, path in enumerate(rec.get("images", [rec.get("image")] if rec.get("image") else [])):
                    files[f"{j}.{path.rsplit('.', 1)[1]}"] = open(os.path.join(root, path), "rb").read()
                if rec.get("video"):
                    files["mp4"] = open(os.path.join(root, rec["video"]), "rb").read()
                for ext, b in files.items():
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(b)
                    tf.addfile(ti, io.BytesIO(b))
    got = [p.encoded.input_ids.tolist() for p in data.scan(iter_webdataset(str(tmp_path / "shard-*.tar")))]
    assert got == want
    # a datasets directory and parquet files with media as {'bytes', 'path'} cells and JSON turns
    datasets = pytest.importorskip("datasets")
    rows = {"id": [], "conversations": [], "messages": [], "images": [], "videos": []}
    for rec in recs:
        rows["id"].append(rec["id"])
        rows["conversations"].append(json.dumps(rec["conversations"]) if "conversations" in rec else None)
        rows["messages"].append(json.dumps(rec["messages"]) if "messages" in rec else None)
        imgs = rec.get("images", [rec["image"]] if "image" in rec else [])
        rows["images"].append([{"bytes": open(os.path.join(root, p), "rb").read(), "path": p} for p in imgs])
        rows["videos"].append([rec["video"]] if "video" in rec else [])
    ds = datasets.Dataset.from_dict(rows)
    ds.save_to_disk(str(tmp_path / "hf"))
    ds.to_parquet(str(tmp_path / "pq" / "train-0.parquet")) if os.makedirs(tmp_path / "pq") is None else None
    for src in (str(tmp_path / "hf"), str(tmp_path / "pq")):
        recs_hf = list(iter_hf_dataset(src))
        for r in recs_hf:  # null columns of the other turn format; video paths relative to the data
            for k in ("conversations", "messages"):
                if r.data.get(k) is None:
                    r.data.pop(k, None)
            for m in r.media:
                if m.kind == "video":
                    m.src = os.path.join(root, m.name)
        got = [p.encoded.input_ids.tolist() for p in data.scan(recs_hf)]
        assert got == want, src


def _audio_only(path):
    import av
    with av.open(path, "w") as c:
        s = c.add_stream("aac", rate=16000)
        f = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        f.sample_rate = 16000
        for pkt in list(s.encode(f)) + list(s.encode()):
            c.mux(pkt)


def _bad_manifest(tmp_path):
    """One record per kind of bad data, after two good ones; returns (path, {kind: line})."""
    d = tmp_path / "bad"
    os.makedirs(d / "m")
    write_image(str(d / "m" / "ok.jpg"), 64, 48, 0)
    write_image(str(d / "m" / "grey.png"), 64, 48, 1, mode="L")
    (d / "m" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    write_video(str(d / "m" / "ok.mp4"), 64, 48, 16, 8, 0)
    _audio_only(str(d / "m" / "empty.mp4"))  # a video file with no video frames
    conv = [{"from": "human", "value": "<image>\nwhat"}, {"from": "gpt", "value": "a square"}]
    vconv = [{"from": "human", "value": "<video>\nwhat"}, {"from": "gpt", "value": "a square"}]
    lines = [
        ("good", {"id": "a", "image": "m/ok.jpg", "conversations": conv}),
        ("good", {"id": "b", "video": "m/ok.mp4", "conversations": vconv}),
        ("corrupt_image", {"id": "c", "image": "m/corrupt.jpg", "conversations": conv}),
        ("missing_media", {"id": "d", "video": "m/nowhere.mp4", "conversations": vconv}),
        ("unreadable_line", '{"id": "e", "image": '),
        ("no_assistant", {"id": "f", "image": "m/ok.jpg", "conversations": conv[:1]}),
        ("too_long", {"id": "g", "image": "m/ok.jpg",
                      "conversations": [conv[0], {"from": "gpt", "value": "square " * 400}]}),
        ("no_frames", {"id": "h", "video": "m/empty.mp4", "conversations": vconv}),
        ("good", {"id": "i", "image": "m/grey.png", "conversations": conv}),  # non-RGB: converted
        ("duplicate_id", {"id": "a", "image": "m/ok.jpg", "conversations": conv}),
        ("bad_conversation", {"id": "j", "image": "m/ok.jpg",
                              "conversations": [{"from": "human", "value": "<image><image>"}, conv[1]]}),
    ]
    with open(d / "train.jsonl", "w") as f:
        for _, rec in lines:
            f.write((rec if isinstance(rec, str) else json.dumps(rec)) + "\n")
    return str(d / "train.jsonl"), {k: i + 1 for i, (k, _) in enumerate(lines) if k != "good"}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_bad_data_each_kind_named(example, tmp_path, family):
    path, kinds = _bad_manifest(tmp_path)
    data = FinetuneData(example[1][family], max_tokens=300)
    issues = []
    planned = list(data.scan(iter_jsonl(path), issues=issues))
    assert [p.sample_id for p in planned] == ["a", "b", "i"]
    got = {e.kind: e.where for e in issues}
    assert set(got) == set(kinds), got
    for kind, line in kinds.items():
        assert got[kind].startswith(f"train.jsonl:{line}"), (kind, got[kind])
    msgs = {e.kind: str(e) for e in issues}
    assert "m/corrupt.jpg" in msgs["corrupt_image"] and "m/nowhere.mp4" in msgs["missing_media"]
    assert "m/empty.mp4" in msgs["no_frames"] and "train.jsonl:1" in msgs["duplicate_id"]
    notes = []
    data.materialize(planned[2], notes)
    assert [n.kind for n in notes] == ["converted_image"] and "m/grey.png" in str(notes[0])
    out = tmp_path / "issues.tsv"
    assert write_issues(str(out), issues) == len(kinds)
    assert out.read_text().count("\n") == len(kinds)
    with pytest.raises(DataError, match="train.jsonl:3.*corrupt_image.*m/corrupt.jpg"):
        list(data.scan(iter_jsonl(path), on_error="fail"))


def test_loader_seeded_bounded_resumable(example):
    manifest, cks = example
    data = FinetuneData(cks["qwen3_vl"])
    planned = list(data.scan(iter_jsonl(manifest)))

    def ids(loader, n):
        it = iter(loader)
        return [[s["sample_id"] for s in next(it)] for _ in range(n)]

    a = ids(Loader(data, planned, 5, seed=3, workers=2, prefetch=2), 7)  # 12 samples: 3 batches/epoch
    assert a == ids(Loader(data, planned, 5, seed=3, workers=1, prefetch=3), 7)
    assert sorted(sum(a[:3], [])) == sorted(p.sample_id for p in planned)  # an epoch covers every sample
    assert a[:3] != a[3:6]  # the next epoch is reshuffled
    assert a != ids(Loader(data, planned, 5, seed=4), 7)
    first = Loader(data, planned, 5, seed=3, prefetch=3)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()
    assert state == {"seed": 3, "epoch": 1, "position": 1}
    resumed = Loader(data, planned, 5, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert ids(resumed, 3) == a[4:7]


def test_loader_runs_at_most_prefetch_ahead(example):
    manifest, cks = example
    data = FinetuneData(cks["internvl"])
    planned = list(data.scan(iter_jsonl(manifest)))
    loader = Loader(data, planned, 2, seed=0, workers=2, prefetch=3)
    started = []
    real = loader._load
    loader._load = lambda idx: started.append(1) or real(idx)
    it = iter(loader)
    for k in range(1, 6):
        next(it)
        time.sleep(0.05)  # give the workers time to run ahead as far as they may
        # the batch handed out plus at most `prefetch - 1` waiting or in flight
        assert len(started) <= k + loader.prefetch - 1, (k, len(started))
    it.close()


def test_example_writes_what_transformers_reads(example):
    """The example's files: transformers loads the tokenizer with the family's token names, and the
    JSONL mixes single/multi-image, video, LLaVA and messages records, with non-RGB images."""
    transformers = pytest.importorskip("transformers")
    manifest, cks = example
    root = os.path.dirname(manifest)
    recs = [json.loads(line) for line in open(manifest)]
    assert {"image", "images", "video", "conversations", "messages"} <= set().union(*map(set, recs))
    from PIL import Image
    modes = {Image.open(os.path.join(root, r["image"])).mode for r in recs if "image" in r}
    assert {"RGB", "L"} <= modes or {"RGB", "RGBA"} <= modes
    for fam, d in cks.items():
        tok = transformers.AutoTokenizer.from_pretrained(d)
        assert tok.eos_token == "<|im_end|>"
        name = "context_image_token" if fam == "internvl" else "image_token"
        assert tok.convert_tokens_to_ids(getattr(tok, name)) == FinetuneData(d).chat.image_ids[0]
        proc = json.load(open(os.path.join(d, "processor_config.json")))
        assert {"image_processor", "video_processor", "processor_class"} <= set(proc)


def test_bench_data_runs():
    from dhp_jax.data.loader_bench import measure
    r = measure("internvl", samples=6, batch=2, workers=2, batches=2)
    assert r["samples"] == 4 and r["tokens"] > 0 and r["samples_per_s"] > 0 and r["planned_samples"] == 6


def test_webm_without_a_frame_count(tmp_path):
    """WebM stores no frame count: it comes from the duration, and the frames decode."""
    av = pytest.importorskip("av")
    from dhp_jax.data.media import load_video_frames, video_info
    path = str(tmp_path / "v.webm")
    try:
        with av.open(path, "w") as c:
            s = c.add_stream("libvpx", rate=10)
            s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
            for i in range(23):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 10, np.uint8), format="rgb24")
                for pkt in s.encode(frame):
                    c.mux(pkt)
            for pkt in s.encode():
                c.mux(pkt)
    except (av.FFmpegError, ValueError) as e:  # pragma: no cover - a PyAV build without libvpx
        pytest.skip(f"no VP8 encoder: {e}")
    with av.open(path) as c:
        assert c.streams.video[0].frames == 0
    assert video_info(path).total_frames == 23
    assert load_video_frames(path, [0, 22]).shape == (2, 48, 64, 3)
