"""Checkpoints in the layouts the families were published in, widths shrunk: config.json with the
structure of each Hub release (tests/published_configs/<repository name>.json: Qwen2.5-VL's flat
file with rope_scaling "mrope", Qwen3-VL's nested one, InternVL3 / InternVL3.5 "-hf" with their
tie flags and InternVL3-38B's / 78B's "dynamic" rope_scaling), the weights under the names of the
published checkpoints (Qwen2.5-VL: `model.layers.*`, `visual.*`; InternVL -hf:
`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`)
in shards with model.safetensors.index.json, written by the `safetensors` package. transformers
loads each directory (its logits are those of the model it was written from: the names and the
config are as transformers reads them), and so does `dhp_jax.model.hf.load_pretrained`: logits
within 1e-5 (fp32, relative) of transformers'.

Also: config.json read as transformers reads it (`dhp_jax.data.hf_config.FIELDS`: every field the
project reads has transformers' default), the tie flags by transformers' rule, rotary scaling
(linear computed, dynamic exact below max_position_embeddings, yarn refused), Hub ids resolved in
a local Hugging Face cache."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

import hf_cases as hc
from hf_cases import torch, transformers

from dhp_jax.data import hf_config, model_configs
from dhp_jax.model import hf

safetensors_numpy = pytest.importorskip("safetensors.numpy")

CONFIGS = Path(__file__).with_name("published_configs")
LAYOUTS = sorted(p.stem for p in CONFIGS.glob("*.json"))
IMG, VID, START, END = 251, 252, 249, 250        # the fixtures' placeholder ids

# transformers 5 names -> the names of the published checkpoints (inverse of transformers' renames)
PUBLISHED_NAMES = {
    "qwen2_5_vl": ((r"model.language_model.", "model."), (r"model.visual.", "visual.")),
    "internvl": (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                 ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")),
    "qwen3_vl": (),
}


def published_name(family: str, name: str) -> str:
    for new, old in PUBLISHED_NAMES[family]:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def write_published(directory: Path, raw: dict, state: dict, family: str, shards: int = 3) -> None:
    """config.json as published and the weights under their published names, in `shards` files
    with model.safetensors.index.json (the Hub's sharded layout)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    names = sorted(state)
    weight_map, total = {}, 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {published_name(family, n): np.ascontiguousarray(state[n]) for n in names[i::shards]}
        safetensors_numpy.save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
        total += sum(a.nbytes for a in part.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def inputs_for(family: str, g: np.random.Generator) -> dict:
    """A processor-shaped sample with text and one image (4 x 4 patches, 4 LLM tokens)."""
    if family == "internvl":
        ids = [5, 6, 7, START] + [IMG] * 4 + [END, 8, 9, 10]
        return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
                "pixel_values": g.standard_normal((1, 3, 56, 56)).astype(np.float32)}
    patch = 14 if family == "qwen2_5_vl" else 16
    ids = [5, 6, 7, START] + [IMG] * 4 + [END, 8, 9, 10]
    types = [0] * 4 + [1] * 4 + [0] * 4
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
            "mm_token_type_ids": np.array([types]),
            "pixel_values": g.standard_normal((16, 3 * 2 * patch * patch)).astype(np.float32),
            "image_grid_thw": np.array([[1, 4, 4]])}


def build_published(raw: dict, directory: Path, seed: int = 0):
    """A random transformers model of the published config `raw` (read by transformers from a
    directory, as from_pretrained does), written in the published layout; (model, family)."""
    src = directory / "config"
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(str(src))
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    hc.randomize(model, seed)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    write_published(directory / "ckpt", raw, state, raw["model_type"])
    return model, raw["model_type"]


def check_published(raw: dict, tmp_path: Path, label: str, seed: int = 0) -> float:
    model, family = build_published(raw, tmp_path, seed)
    ckpt = str(tmp_path / "ckpt")
    inputs = inputs_for(family, hc.rng(seed + 1))
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    ref = hc.reference_logits(reloaded, inputs)
    np.testing.assert_array_equal(ref, hc.reference_logits(model, inputs))   # transformers read every weight
    config, params = hf.load_pretrained(ckpt)
    assert config.tied == bool(reloaded.config.tie_word_embeddings), label
    assert ("lm_head" in params) == (not config.tied), label
    return hc.check_logits(reloaded, config, params, inputs, label)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layout_logits_match_transformers(layout, tmp_path):
    raw = json.loads((CONFIGS / f"{layout}.json").read_text())
    check_published(raw, tmp_path, layout)


@pytest.mark.parametrize("layout", ["Qwen2.5-VL-3B-Instruct", "Qwen3-VL-8B-Instruct", "InternVL3-38B-hf"])
def test_torch_backend_reads_the_published_layout(layout, tmp_path):
    """npu_backend.hf.load_family reads the same directory through the same config reader."""
    from npu_backend.hf import load_family

    model, family = build_published(fixture(layout), tmp_path)
    inputs = inputs_for(family, hc.rng(7))
    ours = load_family(str(tmp_path / "ckpt"))
    sample = hf.sample_from_inputs(ours.config, inputs)
    err = hc.relative_error(ours.logits(sample).numpy(), hc.reference_logits(model, inputs))
    print(f"torch backend {layout}: max relative logits error {err:.2e}")
    assert err <= hc.TOL, f"torch backend {layout}: relative error {err:.2e}"


def test_the_fixtures_cover_the_published_families():
    assert len(LAYOUTS) == 20
    flat = [n for n in LAYOUTS if n.startswith("Qwen2.5-VL")]
    assert len(flat) == 4
    for name in flat:
        raw = json.loads((CONFIGS / f"{name}.json").read_text())
        assert "text_config" not in raw and raw["rope_scaling"]["type"] == "mrope"
    assert sum(n.startswith("Qwen3-VL") for n in LAYOUTS) == 4
    assert sum(n.startswith("InternVL3-") for n in LAYOUTS) == 6
    assert sum(n.startswith("InternVL3_5-") for n in LAYOUTS) == 6


# ------------------------------------------------------------------------------ tie flags
def fixture(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


@pytest.mark.parametrize("name,top,text", [
    ("Qwen3-VL-8B-Instruct", False, True),       # transformers: untied (Qwen3VLConfig reads the top level)
    ("InternVL3-8B-hf", False, True),            # untied (top level)
    ("InternVL3-8B-hf", None, False),            # tied (InternVLConfig's default, the top level absent)
    ("qwen2_5_vl nested", False, True),          # tied (Qwen2_5_VLConfig also follows text_config)
])
def test_tie_flags_follow_transformers(name, top, text, tmp_path):
    if name == "qwen2_5_vl nested":
        raw = hf_config.nested(fixture("Qwen2.5-VL-7B-Instruct"))
    else:
        raw = fixture(name)
    raw.pop("tie_word_embeddings", None)
    if top is not None:
        raw["tie_word_embeddings"] = top
    raw["text_config"]["tie_word_embeddings"] = text
    check_published(raw, tmp_path, f"{name} top={top} text={text}", seed=3)


# ------------------------------------------------------------------------- rotary scaling
def test_linear_rope_scaling_is_computed(tmp_path):
    raw = fixture("InternVL3-2B-hf")
    raw["text_config"]["rope_scaling"] = {"type": "linear", "factor": 4.0}
    check_published(raw, tmp_path, "internvl linear rope", seed=5)


def test_dynamic_rope_refuses_positions_past_max_position_embeddings(tmp_path):
    """Below max_position_embeddings transformers' dynamic rotary is the default one (the 38B
    fixture matches above); at it transformers rescales, and the project refuses, naming the field."""
    raw = fixture("InternVL3-38B-hf")
    raw["text_config"]["max_position_embeddings"] = 8
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    config = hf.load_config(str(path))
    assert config.text.exact_positions == 8
    with pytest.raises(ValueError, match="past text_config.max_position_embeddings 8, where the 'dynamic' "):
        hf.prepare(config, inputs_for("internvl", hc.rng(0)))


def test_yarn_is_refused_naming_the_field():
    raw = fixture("Qwen2.5-VL-7B-Instruct")
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                           "mrope_section": [2, 3, 3]}
    with pytest.raises(ValueError, match=r"config.json: rope_scaling: rope_type 'yarn' is not supported"):
        hf.parse_config(raw)


def test_grouped_query_heads_must_divide():
    raw = fixture("InternVL3-2B-hf")
    raw["text_config"]["num_key_value_heads"] = 3
    with pytest.raises(ValueError, match=r"config.json: text_config.num_attention_heads 4 is not a multiple of "
                                         r"num_key_value_heads 3"):
        hf.parse_config(raw)


# ----------------------------------------------------------------- defaults of transformers
TEXT_REQUIRED = {"qwen2_5_vl_text": {"num_attention_heads": 8}, "qwen3_vl_text": {}, "qwen2": {}, "qwen3": {},
                 "llama": {"num_attention_heads": 8}, "qwen3_vl_moe_text": {}, "qwen3_moe": {}}


def transformers_value(config, key: str):
    if key == "head_dim":          # what the attention modules use
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if key in ("rope_theta", "mrope_section"):
        return config.rope_parameters.get(key)
    value = getattr(config, key)
    return list(value) if isinstance(value, tuple) else value


def text_rope_default(model_type: str, key: str):
    """The M-RoPE split a rotary module uses when rope_parameters has none."""
    module = {"qwen2_5_vl_text": transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding,
              "qwen3_vl_text": transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding,
              "qwen3_vl_moe_text":
                  transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextRotaryEmbedding}[model_type]
    config = transformers.AutoConfig.for_model(model_type, **TEXT_REQUIRED[model_type])
    return list(module(config).mrope_section)


@pytest.mark.parametrize("family", hf_config.FAMILIES)
def test_every_field_read_has_transformers_default(family):
    """Each config class built with only what it requires: every field of FIELDS that the project
    reads (top level, text_config of each LLM type, vision_config) equals transformers' value."""
    text_types = hf_config.TEXT_TYPES[family]
    checked = 0
    for text_type in text_types:
        minimal = {"model_type": family, "text_config": {"model_type": text_type, **TEXT_REQUIRED[text_type]}}
        ours = hf_config.resolve(minimal)
        theirs = transformers.AutoConfig.for_model(**minimal)
        sections = [("", ours, theirs), ("text_config", ours["text_config"], theirs.text_config),
                    ("vision_config", ours["vision_config"], theirs.vision_config)]
        for where, mine, cfg in sections:
            model_type = mine["model_type"]
            for key in hf_config.FIELDS[model_type]:
                if key == "mrope_section":
                    want = text_rope_default(model_type, key)
                    got = mine["rope_parameters"][key]
                elif key == "rope_theta" and where == "vision_config":
                    want, got = cfg.rope_parameters["rope_theta"], mine[key]
                else:
                    want = transformers_value(cfg, key)
                    got = mine["rope_parameters"][key] if key == "rope_theta" else mine[key]
                assert got == want, f"{family} {where or 'top level'} ({model_type}).{key}: ours {got!r}, " \
                                    f"transformers {want!r}"
                checked += 1
    assert checked >= 20


@pytest.mark.parametrize("text_type", ["qwen2", "qwen3", "llama"])
def test_null_key_value_heads_read_as_transformers(text_type):
    minimal = {"model_type": "internvl", "text_config": {"model_type": text_type, "num_key_value_heads": None,
                                                         "num_attention_heads": 4, "hidden_size": 64}}
    ours = hf_config.resolve(minimal)["text_config"]["num_key_value_heads"]
    assert ours == transformers.AutoConfig.for_model(**minimal).text_config.num_key_value_heads == 4


def test_flat_qwen2_5_vl_reads_as_transformers():
    raw = fixture("Qwen2.5-VL-3B-Instruct")
    r = hf_config.resolve(raw)
    theirs = transformers.AutoConfig.for_model(**raw)
    assert r["text_config"]["hidden_size"] == theirs.text_config.hidden_size == 64
    assert r["text_config"]["rope_parameters"]["mrope_section"] == theirs.text_config.rope_parameters["mrope_section"]
    assert r["text_config"]["rope_parameters"]["rope_type"] == theirs.text_config.rope_parameters["rope_type"] \
        == "default"
    assert r["tie_word_embeddings"] is bool(theirs.tie_word_embeddings) is True
    f = model_configs.facts_from_config(raw)
    assert (f.hidden, f.heads, f.kv_heads, f.tied) == (64, 4, 1, True)


# -------------------------------------------------------------------- Hub ids, offline
def fake_cache(root: Path, repo_id: str, revision: str = "0123abcd", config: dict | None = None) -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (snap / "config.json").write_text(json.dumps(config or fixture("Qwen2.5-VL-7B-Instruct")))
    return snap


def test_hub_id_resolves_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snap = fake_cache(tmp_path / "home" / "hub", "Qwen/Qwen2.5-VL-7B-Instruct")
    stale = snap.parent / "00older"                 # an older revision beside it: refs/main decides
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert hf_config.checkpoint_dir("Qwen/Qwen2.5-VL-7B-Instruct") == str(snap)
    assert hf.load_config("Qwen/Qwen2.5-VL-7B-Instruct").family == "qwen2_5_vl"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))      # HF_HUB_CACHE wins over HF_HOME
    other = fake_cache(tmp_path / "elsewhere", "Qwen/Qwen2.5-VL-7B-Instruct", revision="fedc")
    assert hf_config.checkpoint_dir("Qwen/Qwen2.5-VL-7B-Instruct") == str(other)
    with pytest.raises(FileNotFoundError, match=r"'Qwen/Qwen2.5-VL-3B-Instruct' is neither a directory nor a model "
                                                r"in the local Hugging Face cache .*`hf download Qwen/Qwen2.5-VL-3B-"
                                                r"Instruct` \(or `huggingface-cli download"):
        hf.load_pretrained("Qwen/Qwen2.5-VL-3B-Instruct")


def test_hub_id_loads_weights_and_trains_config(tmp_path, monkeypatch):
    """load_pretrained and the train config's model.pretrained take a cached Hub id."""
    from dhp_jax.train.train_config import TrainConfig

    raw = fixture("Qwen3-VL-2B-Instruct")
    model, _ = build_published(raw, tmp_path / "build")
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snap = fake_cache(cache, "Qwen/Qwen3-VL-2B-Instruct", config=raw)
    for f in (tmp_path / "build" / "ckpt").iterdir():
        if f.name != "config.json":
            os.symlink(f, snap / f.name)        # the cache's snapshot files are links into blobs/
    monkeypatch.chdir(tmp_path)
    config, params = hf.load_pretrained("Qwen/Qwen3-VL-2B-Instruct")
    hc.check_logits(model, config, params, inputs_for("qwen3_vl", hc.rng(2)), "qwen3_vl from the hub cache")
    cfg = TrainConfig()
    cfg.model.pretrained = "Qwen/Qwen3-VL-2B-Instruct"
    cfg.data.manifest = "records.jsonl"
    assert cfg.validate().model.pretrained == str(snap)
    # dhp train checks its paths first: a cached id passes, one not in the cache names the download
    from dhp_jax.train.train_config import ConfigError

    (tmp_path / "records.jsonl").write_text("")
    cfg = TrainConfig()
    cfg.model.pretrained, cfg.data.manifest = "Qwen/Qwen3-VL-2B-Instruct", "records.jsonl"
    cfg.check_paths()
    cfg.model.pretrained = "Qwen/Qwen3-VL-8B-Instruct"
    with pytest.raises(ConfigError, match=r"model.pretrained='Qwen/Qwen3-VL-8B-Instruct': .*hf download "
                                          r"Qwen/Qwen3-VL-8B-Instruct"):
        cfg.check_paths()


# ------------------------------------------------------------ the planner reads the same files
@pytest.mark.parametrize("name,kw", [("qwen3-vl-4b", {}), ("qwen2.5-vl-32b", {"tensor_parallel": 4}),
                                     ("internvl3-2b", {})])
def test_a_checkpoint_directory_is_priced_as_its_preset(name, kw, tmp_path):
    """The stored presets are checkpoint-like directories (config.json as released); a checkpoint
    directory holding the same config.json is priced exactly as the preset."""
    import dataclasses
    import shutil

    from dhp_jax.planner import CostModel

    src = model_configs.model_dir(name)
    assert hf_config.read_config(src) == model_configs.model_config(name)
    shutil.copy(src / "config.json", tmp_path / "config.json")
    ours, preset = CostModel.preset(str(tmp_path), "h100", **kw), CostModel.preset(name, "h100", **kw)
    assert dataclasses.replace(ours, model=name) == preset
