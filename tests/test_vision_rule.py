"""One rule for vision tokens: the planner's count (`dhp_jax.data.vision`, what `dhp plan`, `dhp analyze`,
`dhp simulate`, `make_dataset` and the experiments use) against transformers' own processors built
offline from the same processor files (`dhp_jax/data/models/<name>/`), for each family, on 20 image
sizes and 20 clips.

Images: transformers' Pillow image processors (Qwen2-VL's; GotOcr2's with the InternVL processor's
`crop_to_patches=True`), run on an image of each size (without their elementwise rescale and
normalize steps, which leave the shapes as they are). Videos: the video processors' own code:
Qwen3-VL's class as installed; the Qwen2-VL and InternVL video modules import torchvision (absent
here) for pixel work only, so `_video_module` runs their source with that one import stubbed, and the
count is their `sample_frames` (torch) + their `resize` size rule (its pixel call recorded, not run)
+ the processor's tokens per frame (Qwen: grid / merge^2; InternVL: `image_seq_length` per frame).
"""

import importlib.util
import json
import math
import sys
import types

import numpy as np
import pytest

from dhp_jax.data.vision import MODELS_DIR, DEFAULT_SOURCE_FPS, rules_for_model, vision_rules

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

REFERENCE = {"qwen2_5_vl": "qwen2.5-vl-32b", "qwen3_vl": "qwen3-vl-8b", "internvl": "internvl3-8b"}
IMAGES = [(1, 1), (28, 28), (56, 20), (97, 203), (224, 224), (300, 200), (333, 1000), (448, 448), (500, 375),
          (640, 480), (800, 1000), (896, 448), (1000, 300), (1024, 768), (1280, 720), (1300, 200), (1600, 1200),
          (1920, 1080), (2480, 3508), (4000, 3000)]
DURATIONS = [1.0, 1.5, 2.2, 3.0, 4.7, 5.5, 7.0, 8.3, 10.0, 12.5, 15.0, 20.0, 30.0, 45.0, 64.0, 90.0, 120.0,
             180.0, 240.0, 300.0]
SIZES = [(1280, 720), (1920, 1080), (640, 360), (512, 512), (320, 240), (3840, 2160), (720, 1280), (100, 60),
         (854, 480), (1024, 768)]
RATES = [24.0, 25.0, 30.0, 29.97, 60.0, 10.0, None]
CLIPS = [(d, *SIZES[i % len(SIZES)], RATES[i % len(RATES)]) for i, d in enumerate(DURATIONS)]


def _files(name):
    d = MODELS_DIR / name
    image = json.loads((d / "preprocessor_config.json").read_text())
    video_file = d / "video_preprocessor_config.json"
    video = json.loads(video_file.read_text()) if video_file.is_file() else dict(image)  # transformers' fallback
    return image, video


def _video_module(modname):
    """A transformers video-processor module whose `torchvision.transforms.v2.functional` import is
    stubbed: its classes, sampling and size rules are the installed source, run as is."""
    name = modname + "_without_torchvision"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(modname)
    src = open(spec.origin, encoding="utf-8").read()
    stub = "import torchvision.transforms.v2.functional as tvF"
    assert stub in src, modname
    mod = types.ModuleType(name)
    mod.__package__, mod.__file__ = modname.rsplit(".", 1)[0], spec.origin
    sys.modules[name] = mod
    exec(compile(src.replace(stub, "tvF = None"), spec.origin, "exec"), mod.__dict__)
    return mod


def _image_reference(family, cfg):
    from transformers import GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil
    cfg = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class",
                                                     "feature_extractor_type")}
    if family == "internvl":
        return GotOcr2ImageProcessorPil(**cfg)
    return Qwen2VLImageProcessorPil(**cfg)


@pytest.mark.parametrize("family", list(REFERENCE))
def test_image_tokens_equal_the_image_processor(family):
    name = REFERENCE[family]
    rules, (cfg, _) = vision_rules(name), _files(name)
    ref = _image_reference(family, cfg)
    rng = np.random.default_rng(0)
    # rescale and normalize are elementwise (the grid and the tile count do not depend on them);
    # they are the bulk of the processor's time on the large images, so the reference skips them
    plain = dict(do_rescale=False, do_normalize=False)
    equal = 0
    for w, h in IMAGES:
        if max(w, h) / min(w, h) > 200:
            continue
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        if family == "internvl":
            out = ref(im, return_tensors="np", crop_to_patches=True, **plain)   # InternVLProcessor's images_kwargs
            want = int(out["num_patches"][0]) * 256                    # InternVLProcessor(image_seq_length=256)
        else:
            out = ref(im, return_tensors="np", **plain)
            want = int(np.prod(out["image_grid_thw"][0])) // ref.merge_size ** 2
        assert rules.image_tokens(w, h) == want, (name, w, h)
        equal += 1
    assert equal == len(IMAGES)


def _stream(d, w, h, fps):
    fps = fps or DEFAULT_SOURCE_FPS
    return max(1, round(d * fps)), fps


def _qwen2_video_tokens(cfg, total, fps, w, h, sampling, monkeypatch):
    mod = _video_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    ref = mod.Qwen2VLVideoProcessor(**{k: v for k, v in cfg.items() if k not in ("image_processor_type",
                                                                                 "processor_class")})
    meta = VideoMetadata(total_num_frames=total, fps=fps)
    # the processor samples only when asked to (do_sample_frames, or fps / num_frames in the call)
    idx = ref.sample_frames(meta, fps=sampling["fps"]) if "fps" in sampling else torch.arange(total)
    n = len(idx)
    seen = {}
    monkeypatch.setattr(mod.BaseVideoProcessor, "resize",
                        lambda self, image, size, resample, **kw: seen.setdefault("size", size))
    frames = types.SimpleNamespace(shape=(1, n, 3, h, w))   # resize reads the shape only
    ref.resize(frames, size=ref.size, resample=ref.resample, factor=ref.patch_size * ref.merge_size,
               temporal_factor=ref.temporal_patch_size, cap_pixels_per_frame=sampling.get("cap_pixels_per_frame"))
    rh, rw = seen["size"].height, seen["size"].width
    gt = -(-n // ref.temporal_patch_size)
    return np.asarray(idx), gt * (rh // ref.patch_size) * (rw // ref.patch_size) // ref.merge_size ** 2


def _qwen3_video_tokens(cfg, total, fps, w, h):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    ref = Qwen3VLVideoProcessor(**{k: v for k, v in cfg.items() if k not in ("video_processor_type",
                                                                             "processor_class")})
    idx = np.asarray(ref.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)))
    return idx, ref.get_num_of_video_patches(len(idx), h, w, {}) // ref.merge_size ** 2


def _internvl_video_tokens(cfg, total, fps, sampling):
    mod = _video_module("transformers.models.internvl.video_processing_internvl")
    ref = mod.InternVLVideoProcessor(**{k: v for k, v in cfg.items() if k not in ("video_processor_type",
                                                                                 "processor_class")})
    idx = np.asarray(ref.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=sampling["fps"]))
    return idx, len(idx) * 256   # InternVLProcessor: image_seq_length context tokens per frame


@pytest.mark.parametrize("family", list(REFERENCE))
def test_video_tokens_equal_the_video_processor(family, monkeypatch):
    name = REFERENCE[family]
    rules, (_, cfg) = vision_rules(name), _files(name)
    sampling = rules.processor.video_sampling   # "auto": what the run passes (Qwen3-VL: its files' own)
    assert sampling == {"qwen2_5_vl": {"fps": 2.0, "cap_pixels_per_frame": True}, "qwen3_vl": {},
                        "internvl": {"fps": 1.0}}[family]
    for d, w, h, fps in CLIPS:
        total, rate = _stream(d, w, h, fps)
        if family == "qwen2_5_vl":
            idx, want = _qwen2_video_tokens(cfg, total, rate, w, h, sampling, monkeypatch)
        elif family == "qwen3_vl":
            idx, want = _qwen3_video_tokens(cfg, total, rate, w, h)
        else:
            idx, want = _internvl_video_tokens(cfg, total, rate, sampling)
        v = rules.video(d, w, h, fps)
        assert (v.num_tokens, v.frames) == (want, len(idx)), (name, d, w, h, fps)
        assert np.array_equal(rules.processor.frame_indices(rules.stream(d, w, h, fps)), idx)


def test_every_frame_when_the_run_passes_no_sampling(monkeypatch):
    """"files": the published Qwen2.5-VL file as is (its video processor configured from
    preprocessor_config.json, no sampling): every frame, 3136..12845056 px a frame."""
    rules, (_, cfg) = vision_rules("qwen2.5-vl-32b", "files"), _files("qwen2.5-vl-32b")
    for d, w, h, fps in CLIPS[:8]:
        total, rate = _stream(d, w, h, fps)
        idx, want = _qwen2_video_tokens(cfg, total, rate, w, h, {}, monkeypatch)
        assert len(idx) == total and rules.video(d, w, h, fps).num_tokens == want
    # a common clip: 10 s of 1280x720 at 30 fps
    assert rules.video(10, 1280, 720, 30).num_tokens == 179400
    assert vision_rules("qwen2.5-vl-32b").video(10, 1280, 720, 30).num_tokens == 11960


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS_DIR.iterdir() if p.is_dir()))
def test_every_stored_model_counts_as_its_processor(name):
    """Each stored model's files: image counts against the family's image processor's own count."""
    rules = rules_for_model(name)
    family = rules.processor.family
    cfg, _ = _files(name)
    ref = _image_reference(family, cfg)
    for w, h in IMAGES[1:]:
        if family == "internvl":
            want = ref.get_number_of_image_patches(h, w, {"crop_to_patches": True}) * 256
        else:
            want = ref.get_number_of_image_patches(h, w, {}) // ref.merge_size ** 2
        assert rules.image_tokens(w, h) == want, (name, w, h)


def test_checkpoint_directory_and_errors(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        vision_rules(str(d))
    (d / "preprocessor_config.json").write_text((MODELS_DIR / "qwen3-vl-8b" / "preprocessor_config.json").read_text())
    (d / "video_preprocessor_config.json").write_text(
        (MODELS_DIR / "qwen3-vl-8b" / "video_preprocessor_config.json").read_text())
    r = vision_rules(str(d))
    assert r.image_tokens(640, 480) == vision_rules("qwen3-vl-8b").image_tokens(640, 480) == 300
    assert vision_rules(str(d), {"num_frames": 8}).video(10, 640, 480, 30).frames == 8
    with pytest.raises(ValueError, match="fps or num_frames, not both"):
        vision_rules(str(d), {"num_frames": 8, "fps": 2})
    with pytest.raises(ValueError, match="unknown key"):
        vision_rules(str(d), {"frames": 8})
    with pytest.raises(ValueError, match="source_fps"):
        r.video(1, 10, 10, source_fps=-3)
    assert math.isclose(DEFAULT_SOURCE_FPS, 30.0)


def test_commands_take_a_checkpoint_directory(tmp_path, capsys):
    """`--model DIR`: the directory's config.json prices the model, its processor files count the
    tokens; the same files as a preset's give the same data profile and the same plan."""
    from dhp_jax.cli import main
    from dhp_jax.data.model_configs import model_config
    d = tmp_path / "ck"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(model_config("qwen3-vl-8b")))
    for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (d / f).write_text((MODELS_DIR / "qwen3-vl-8b" / f).read_text())
    out = {}
    for model in (str(d), "qwen3-vl-8b"):
        assert main(["analyze", "openvid", "--model", model, "--mix-samples", "64", "--ranks", "8", "--batch", "16",
                     "--batches", "1", "--hardware", "a100", "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert main(["plan", "--model", model, "--ranks", "8", "--batch", "16", "--hardware", "a100",
                     "--compare", "", "--json"]) == 0
        out[model] = (rep["data"], json.loads(capsys.readouterr().out))
    (a, pa), (b, pb) = out[str(d)], out["qwen3-vl-8b"]
    assert a["vision"] == str(d) and b["vision"] == "qwen3-vl-8b"
    assert {k: v for k, v in a.items() if k != "vision"} == {k: v for k, v in b.items() if k != "vision"}
    untimed = [{k: ({kk: vv for kk, vv in v.items() if not kk.startswith("solve_")} if k == "solver" else v)
                for k, v in p["plan"].items()} for p in (pa, pb)]
    assert untimed[0] == untimed[1] and pa["step_time_s"] == pytest.approx(pb["step_time_s"], rel=1e-12)
    from dhp_jax.sim.cluster import Cluster
    c = Cluster(nodes=1, model=str(d))   # the simulator and the experiments: the same directory
    assert c.vision.name == str(d) and c.cost_model().param_count == Cluster(nodes=1, model="qwen3-vl-8b").cost_model().param_count
    assert main(["simulate", "--model", str(d), "--nodes", "1", "--batch", "8", "--steps", "1", "--hardware", "a100",
                 "--strategies", "dhp", "--video-fps", "1", "--json"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", "qwen3-vl-8b", "--video-fps", "0", "--compare", ""]) == 2
    assert "--video-fps must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("family", list(REFERENCE))
def test_the_run_and_the_planner_count_the_same_video_tokens(family, tmp_path):
    """A fine-tuning run's count of a real video (`FinetuneData`, from the file's header) equals the
    planner's count of that clip by duration, size and rate (`vision_rules(checkpoint)`), for the
    published processor files and each video sampling the run can pass (`data.video_fps` /
    `data.video_frames`, `dhp plan --video-fps` / `--video-frames`)."""
    import os

    from dhp_jax.data.example import write_example_data, write_processor_files
    from dhp_jax.data.finetune import FinetuneData
    from dhp_jax.data.media import video_info
    from dhp_jax.data.sources import iter_jsonl
    from dhp_jax.train.train_config import ConfigError, load_config
    from dhp_jax.train.finetune import video_sampling

    manifest = write_example_data(str(tmp_path / "data"), num_samples=9)
    ck = str(tmp_path / "ck")
    write_processor_files(ck, family, published=True)
    base = ["model.pretrained=ck", "data.manifest=m.jsonl"]
    runs = {"auto": [], "data.video_frames=6": [], "data.video_fps=3": [], "files": []}
    checked = 0
    for override in runs:
        cfg = load_config(None, base + ([override] if "=" in override else []))
        sampling = "files" if override == "files" else video_sampling(cfg.data)   # "files": every frame
        data, rules = FinetuneData(ck, video_sampling=sampling), vision_rules(ck, sampling)
        for rec in iter_jsonl(manifest):
            if "video" not in rec.data:
                continue
            planned = data.plan(rec)
            info = video_info(os.path.join(os.path.dirname(manifest), rec.data["video"]))
            v = rules.video(info.total_frames / info.fps, info.width, info.height, info.fps)
            assert (v.num_tokens, v.frames) == (planned.video_plans[0].tokens, len(planned.video_plans[0].indices))
            runs[override].append(v.frames)
            checked += 1
    assert checked >= 6 and set(runs["data.video_frames=6"]) == {6} and runs["auto"] != runs["data.video_fps=3"]
    assert video_sampling(load_config(None, base + ["data.video_fps=3"]).data) == {"fps": 3.0}
    for bad, words in [("data.video_fps=0", "data.video_fps must be > 0"), ("data.video_frames=0", "data.video_frames"),
                       ("data.video_frames=2 data.video_fps=1", "set one, not both")]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, base + bad.split())


def test_family_names_count_as_their_processors(monkeypatch):
    """A family name without a checkpoint: "qwen-vl" is Qwen2.5-VL's image file with the Qwen2-VL
    video processor's own defaults (its class, configured with nothing), "auto" sampling; "qwen3-vl"
    and "internvl" are their reference presets."""
    rules = vision_rules("qwen-vl")
    cfg, _ = _files("qwen2.5-vl-32b")
    ref = _image_reference("qwen2_5_vl", cfg)
    for w, h in IMAGES[1:]:
        assert rules.image_tokens(w, h) == ref.get_number_of_image_patches(h, w, {}) // 4
    for d, w, h, fps in CLIPS:
        total, rate = _stream(d, w, h, fps)
        idx, want = _qwen2_video_tokens({}, total, rate, w, h, rules.processor.video_sampling, monkeypatch)
        assert (rules.video(d, w, h, fps).num_tokens, rules.video(d, w, h, fps).frames) == (want, len(idx))
    for family, name in (("qwen3-vl", "qwen3-vl-8b"), ("internvl", "internvl3-8b")):
        a, b = vision_rules(family), vision_rules(name)
        assert [a.video(*c).num_tokens for c in CLIPS] == [b.video(*c).num_tokens for c in CLIPS]
        assert [a.image_tokens(*s) for s in IMAGES] == [b.image_tokens(*s) for s in IMAGES]
