"""`dhp export` on its own (the end-to-end path, run -> export -> transformers' logits, is in
tests/test_finetune_train.py): a checkpoint of a run's layout (3 ranks: a padded tail) holding
known params is exported from a source checkpoint whose tensor data is cut off after the
safetensors headers, so the export cannot have read a source weight; the output holds exactly the
run's params. OUT_DIR is written beside and renamed: a failure mid-write leaves it as it was, and
a non-empty OUT_DIR needs --overwrite."""

import os

import numpy as np
import pytest


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, source checkpoint with its weights cut off, the params tree the run holds)."""
    import jax.numpy as jnp

    from dhp_jax.model.hf import safetensors_io
    from dhp_jax.model.hf.stream import abstract_params, checkpoint_sources
    from dhp_jax.sharding.flat import FlatLayout
    from dhp_jax.train.checkpoint import Checkpointer
    from dhp_jax.train.example import write_example

    root = tmp_path_factory.mktemp("export")
    src, _ = write_example(str(root / "example"), "qwen3_vl", num_samples=1, long_videos=0)
    _, sources = checkpoint_sources(src)
    layout = FlatLayout.of(abstract_params(sources), 3)
    assert layout.padded > layout.size                     # the run's vector has a padded tail
    flat = np.random.default_rng(0).normal(size=layout.padded).astype(np.float32)
    flat[layout.size:] = 0
    ckpt = Checkpointer(root / "run" / "checkpoints")
    ckpt.save(4, {"params": jnp.asarray(flat), "step": jnp.asarray(4)}, data_position=4, model_config={},
              run_config={"model": {"pretrained": src}, "num_ranks": 3}, extra={"layout": layout.record()})
    ckpt.close()
    for f in safetensors_io.checkpoint_files(src):        # headers intact, tensor data gone
        end = max(offset for *_, offset in safetensors_io.tensor_infos(f))
        with open(f, "r+b") as fh:
            fh.truncate(end)
    return root / "run", src, layout.unravel(flat)


def test_export_reads_the_run_params_only(run, tmp_path):
    import jax

    from dhp_jax.model import hf
    from dhp_jax.train.export import export

    run_dir, src, params = run
    with pytest.raises(Exception):
        hf.load_pretrained(src)                             # the source's weights are unreadable
    assert export(str(run_dir), str(tmp_path / "hf")) == (4, src)
    assert {"tokenizer.json", "chat_template.jinja", "config.json"} <= set(os.listdir(tmp_path / "hf"))
    _, out = hf.load_pretrained(str(tmp_path / "hf"))
    got, want = jax.tree_util.tree_flatten_with_path(out)[0], jax.tree_util.tree_flatten_with_path(params)[0]
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_export_is_atomic_and_never_mixes(run, tmp_path, monkeypatch):
    from dhp_jax.model import hf
    from dhp_jax.train.export import ExportError, export

    run_dir, _, _ = run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "old.txt").write_text("previous export")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export(str(run_dir), str(out))

    def fail_midway(config, params, out_dir, **kw):
        with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_pretrained", fail_midway)
    for target in (out, tmp_path / "fresh"):
        with pytest.raises(OSError, match="disk full"):
            export(str(run_dir), str(target), overwrite=True)
    assert os.listdir(out) == ["old.txt"] and (out / "old.txt").read_text() == "previous export"
    assert sorted(os.listdir(tmp_path)) == ["hf"]          # no fresh/, no temporary directory left
    monkeypatch.undo()
    export(str(run_dir), str(out), overwrite=True)
    assert "old.txt" not in os.listdir(out) and "model.safetensors" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["hf"]
