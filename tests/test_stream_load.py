"""`load_sharded`: a checkpoint streamed into the sharded fp32 master vector equals
`PlanExecutor.shard(hf.load_pretrained(path)[1])` bit for bit; `dhp bench load`'s synthetic
checkpoint has transformers' Qwen3-VL layout; the bench runs end to end at a tiny size."""

import json

import jax
import numpy as np
import pytest

from dhp_jax.model import MLLMConfig, hf
from dhp_jax.sharding import PlanExecutor, load_sharded
from dhp_jax.sharding import load_bench as lb
from dhp_jax.sharding.family_adapter import FamilyModel
from dhp_jax.data.model_configs import model_config, model_facts


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def test_synthetic_count_is_the_published_one():
    # the name/shape table at the published Qwen3-VL-2B config gives its exact parameter count
    assert lb.param_count(model_config(lb.BASE_MODEL)) == model_facts(lb.BASE_MODEL).params
    raw = lb.synthetic_config(10**9)
    assert 10**9 <= lb.param_count(raw) < 1.1e9
    assert raw["text_config"]["hidden_size"] == model_config(lb.BASE_MODEL)["text_config"]["hidden_size"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("synthetic"))
    info = lb.write_synthetic(path, lb.synthetic_config(200_000), shard_bytes=96 * 1024)
    assert info["files"] > 1
    config, params = hf.load_pretrained(path)
    return path, config, params


@pytest.mark.parametrize("chunk,block", [(977, 4096), (1 << 24, 300)])
def test_streamed_equals_whole_load(synthetic, chunk, block):
    """3 devices (a padded tail), chunks that cut leaves and kernel rows anywhere, mappings of a
    few elements (block 300 bytes) or whole tensors."""
    path, config, params = synthetic
    devices = jax.devices()[:3]
    ref = PlanExecutor(config, devices=devices).shard(params)
    ex = PlanExecutor(hf.load_config(path), devices=devices)
    got = load_sharded(path, ex, chunk_elements=chunk, block_bytes=block)
    assert ex.layout.padded > ex.layout.size
    assert got.sharding == ex.sharded and got.shape == ref.shape
    np.testing.assert_array_equal(bits(got), bits(ref))
    # the executor is bound to the checkpoint's tree: the whole-load tree matches it
    assert ex.layout.matches(params)


def test_fp32_checkpoint_streams(synthetic, tmp_path):
    """An fp32 checkpoint (our save_pretrained of the loaded tree, sharded) streams onto 8 devices
    as the tree itself shards."""
    _, config, params = synthetic
    hf.save_pretrained(config, params, str(tmp_path), max_shard_bytes=256 * 1024)
    assert (tmp_path / "model.safetensors.index.json").exists()
    ex = PlanExecutor(hf.load_config(str(tmp_path)))
    got = load_sharded(str(tmp_path), ex, chunk_elements=30_001)
    np.testing.assert_array_equal(bits(got), bits(PlanExecutor(config).shard(params)))


def test_synthetic_layout_is_transformers(tmp_path):
    """transformers' own Qwen3-VL of a synthetic config has the bench's weight names and shapes;
    untied (an lm_head), that checkpoint streams onto 8 devices exactly."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    raw = lb.synthetic_config(100_000)
    raw["tie_word_embeddings"] = False
    raw["text_config"] = dict(raw["text_config"], tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**raw))
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == lb.weight_shapes(raw)
    lb.write_synthetic(str(tmp_path), raw, shard_bytes=64 * 1024)
    config, params = hf.load_pretrained(str(tmp_path))
    assert not config.tied and "lm_head" in params
    ref = PlanExecutor(config).shard(params)
    got = load_sharded(str(tmp_path), PlanExecutor(hf.load_config(str(tmp_path))), chunk_elements=5000)
    np.testing.assert_array_equal(bits(got), bits(ref))


def test_wrong_executor_is_refused(synthetic):
    path, config, params = synthetic
    other = json.load(open(f"{path}/config.json"))
    other["text_config"]["num_hidden_layers"] += 1
    with pytest.raises(ValueError, match="config.json is not the config of this executor"):
        load_sharded(path, PlanExecutor(hf.parse_config(other)))
    with pytest.raises(ValueError, match="config.json is not the config of this executor"):
        load_sharded(path, PlanExecutor(MLLMConfig.preset("tiny")))        # not a family executor
    # the family executor's own checks (shared with PlanExecutor's)
    with pytest.raises(TypeError, match="float32 params"):
        PlanExecutor(config).bind(jax.tree.map(lambda x: x.astype(np.float16), params))
    with pytest.raises(TypeError, match="config must be a dhp_jax.model.hf.config.HFConfig, got dict"):
        FamilyModel({})


def test_bench_load_runs(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    lb.configure(parser)
    out, ckpt = tmp_path / "load.json", tmp_path / "ckpt"
    assert lb.run(parser.parse_args(["--params", "1e5", "--dir", str(ckpt), "--out", str(out), "--json",
                                     "--shard-mb", "0.1"])) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert not ckpt.exists()                           # removed without --keep
    c, m = result["checkpoint"], result["load"]
    assert c["params"] >= 100_000 and c["files"] > 1 and c["bf16_bytes"] == 2 * c["params"]
    assert m["devices"] == 8 and m["state_bytes"] == 4 * m["padded"] and m["peak_rss"] >= m["baseline_rss"]
    assert result["overhead_bytes"] == m["peak_rss"] - m["baseline_rss"] - m["state_bytes"]
