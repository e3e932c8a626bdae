"""`dhp example` -> `dhp train model.pretrained=... data.manifest=...` -> `dhp export`, on a tiny random
Qwen2.5-VL checkpoint and generated images and videos, 8 fake devices: the step-0 loss is
transformers' loss on the same batch (same chat template, assistant-only labels), the loss falls
on a fixed set, a resumed run takes the same batches and losses, bad records are skipped and
listed, the exported checkpoint gives transformers the project's logits, and the planner makes
plans of irregular degrees from the real token counts."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dhp_jax.model import hf  # noqa: E402

TOL = 1e-5
SAMPLES = 12


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example dir, with two bad records appended to its manifest (a missing image, a line that is not JSON)."""
    from dhp_jax.train.example import write_example

    root = tmp_path_factory.mktemp("ft_example")
    ckpt, manifest = write_example(str(root), "qwen2_5_vl", num_samples=SAMPLES)
    with open(manifest, "a") as f:
        f.write(json.dumps({"id": "bad-missing", "image": "media/nowhere.jpg",
                            "conversations": [{"from": "human", "value": "<image>\nwhat"},
                                              {"from": "gpt", "value": "nothing"}]}) + "\n")
        f.write("{not json\n")
    return ckpt, manifest


def _config(ckpt, manifest, out, **extra):
    from dhp_jax.train.config import load_config

    # all 12 good records in every batch (one batch an epoch): the loss is measured on a fixed set;
    # one ring group of 8 ranks and one bucket: one group program to compile
    overrides = [f"model.pretrained={ckpt}", f"data.manifest={manifest}", f"data.batch_size={SAMPLES}", "steps=3",
                 "planner.strategy=static-ring:8", "min_bucket=2048", "compare.enabled=false",
                 "metrics.progress=false", "compilation_cache=null", "checkpoint.every=1", "checkpoint.keep=5",
                 "optim.warmup_steps=0", "optim.learning_rate=0.01", f"metrics.out_dir={out}"]
    return load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()])


@pytest.fixture(scope="module")
def run(example, tmp_path_factory):
    from dhp_jax.train.trainer import Trainer

    ckpt, manifest = example
    out = tmp_path_factory.mktemp("ft_run")
    trainer = Trainer(_config(ckpt, manifest, out))
    result = trainer.run()
    return trainer, result, out


def _torch(x):
    return {k: torch.as_tensor(v.astype(np.int64) if v.dtype.kind in "iu" else v) for k, v in x.items()}


def test_step0_loss_is_transformers_loss(example, run):
    """The first step's loss (initial params) equals transformers' loss of the checkpoint on the same
    batch: each sample through the processor-shaped inputs with its assistant-only labels, the
    token-weighted mean over the batch."""
    from dhp_jax.train.finetune import FinetunePipeline

    trainer, result, _ = run
    ckpt, _ = example
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt).eval()
    pipe = FinetunePipeline(trainer.config.data, ckpt, trainer.hf_config, trainer.config.data.seed)
    try:
        items = pipe.loader._load(pipe.loader.batch_indices(0, 0))
    finally:
        pipe.close()
    total, count = 0.0, 0
    with torch.no_grad():
        for it in items:
            x = dict(it["inputs"])
            labels = x.pop("labels")
            n = int((labels[0, 1:] != -100).sum())
            assert n and (labels[0] != -100).sum() < labels.shape[1]  # assistant tokens only
            total += float(model(**_torch(x), labels=torch.as_tensor(labels.astype(np.int64))).loss) * n
            count += n
    ref = total / count
    err = abs(result.losses[0] - ref) / abs(ref)
    print(f"step-0 loss {result.losses[0]:.7f} vs transformers {ref:.7f}: relative error {err:.1e}")
    assert err <= TOL, err


def test_loss_falls_and_bad_records_are_listed(run):
    trainer, result, out = run
    assert len(result.losses) == 3 and result.losses[-1] < result.losses[0] - 0.05, result.losses
    data = result.summary["data"]
    assert data["samples"] == SAMPLES and data["skipped"] == 2, data
    assert data["skipped_by_kind"] == {"missing_media": 1, "unreadable_line": 1}, data
    lines = (out / "data_issues.tsv").read_text().splitlines()
    assert len(lines) == 2 and any("nowhere.jpg" in line for line in lines) \
        and any(line.startswith("unreadable_line\ttrain.jsonl:14") for line in lines), lines
    assert data["data_wait_median_s"] >= 0 and "data_wait_s" in result.records[0]


def test_resume_takes_the_next_batch(example, run, tmp_path):
    """Stop after step 2, resume: the same batches (the records' ids) and losses as the uninterrupted run
    (the resumed run reads its first batch, then restarts the loader at the checkpoint's position)."""
    from dhp_jax.train.checkpoint import Checkpointer
    from dhp_jax.train.trainer import Trainer

    trainer, full, _ = run
    ckpt, manifest = example
    cfg = _config(ckpt, manifest, tmp_path)
    first = Trainer(cfg, executor=trainer.executor).run(stop_after=2)
    saved = Checkpointer(tmp_path / "checkpoints")
    assert saved.read_meta(2)["loader"] == {"seed": 0, "epoch": 2, "position": 0}
    saved.close()
    rest = Trainer(cfg, executor=trainer.executor).run(resume=True)
    assert [r["step"] for r in rest.records] == [3]
    assert [r["sample_ids"] for r in first.records + rest.records] == [r["sample_ids"] for r in full.records]
    assert len({tuple(r["sample_ids"]) for r in full.records}) == 3   # each epoch reshuffled
    np.testing.assert_allclose(first.losses + rest.losses, full.losses, rtol=1e-6)


def test_export_gives_transformers_the_project_logits(example, run, tmp_path):
    """`dhp export` of the run -> transformers loads it with no missing weight, and its logits are
    the project's logits of the trained params."""
    from dhp_jax.data.finetune import FinetuneData
    from dhp_jax.data.sources import iter_jsonl
    from dhp_jax.train.export import export

    trainer, result, out = run
    ckpt, manifest = example
    step, source = export(str(out), str(tmp_path / "hf"))
    assert step == 3 and source == ckpt
    assert {"tokenizer.json", "chat_template.jinja", "processor_config.json"} <= set(os.listdir(tmp_path / "hf"))
    model, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "hf"),
                                                                                  output_loading_info=True)
    assert not any(info.values()), info
    import jax

    trained = trainer.executor.layout.unravel(jax.device_get(result.state.params))
    trained = jax.tree.map(jax.numpy.asarray, trained)
    data = FinetuneData(str(tmp_path / "hf"))
    planned = list(data.scan(iter_jsonl(manifest)))
    x = data.materialize(planned[2])     # a video sample (the example's every third record)
    assert "pixel_values_videos" in x
    x.pop("labels")
    ours = np.asarray(hf.logits(trainer.hf_config, trained, x))
    with torch.no_grad():
        ref = model.eval()(**_torch(x)).logits[0].numpy()
    worst = float(np.abs(ours - ref).max() / np.abs(ref).max())
    print(f"exported: transformers logits vs the project's, max relative error {worst:.1e}")
    assert worst <= TOL, worst


def test_torch_backend_continues_the_run(run, tmp_path, monkeypatch, capsys):
    """`python -m npu_backend.train --init-from` the run's step-2 checkpoint (one gloo process): the
    family model with the checkpoint's params, trained on the run's data from its next batch; the
    first torch loss is the loss of the JAX run's step 3 (same params, same batch)."""
    from npu_backend import train as torch_train

    _, result, out = run
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DHP_TORCH_DEVICE", "cpu")
    args = ["--init-from", str(out / "checkpoints" / "2"), "--steps", "1", "--optimizer", "sgd", "--lr", "0.01",
            "--strategy", "static-ring:1", "--json", str(tmp_path / "torch.json")]
    assert torch_train.main(args) == 0
    rec = json.loads((tmp_path / "torch.json").read_text())
    assert (rec["init_from"]["step"], rec["init_from"]["family"]) == (2, "qwen2_5_vl")
    assert rec["steps"][0]["sample_ids"] == result.records[2]["sample_ids"]   # the run's batch 2, in its order
    first, ref = rec["steps"][0]["loss"], result.losses[2]
    err = abs(first - ref) / abs(ref)
    with capsys.disabled():
        print(f"torch from the step-2 checkpoint: first loss {first:.7f} vs JAX step 3 {ref:.7f}, relative {err:.1e}")
    assert err <= TOL, (first, ref)
    assert "qwen2_5_vl params from dhp train checkpoint" in capsys.readouterr().out
    assert torch_train.main(args[:2] + ["--mllm", "tiny"]) == 2       # the model comes from the run
    assert "its model comes from there, not --mllm" in capsys.readouterr().err


def test_planner_makes_irregular_degrees_from_real_counts(example):
    """With the demo's planning model (qwen3-vl-4b on 910B, one rank per node), one batch of the
    example's real token counts gets groups of >= 3 distinct degrees, one not a power of two."""
    from dhp_jax.planner import plan_batch
    from dhp_jax.train.finetune import FinetunePipeline
    from dhp_jax.train.plans import make_cost

    ckpt, manifest = example
    cfg = _config(ckpt, manifest, "unused", **{"planner.cost_model": "qwen3-vl-4b"})
    p = cfg.planner
    config, _ = hf.load_pretrained(ckpt)
    pipe = FinetunePipeline(cfg.data, ckpt, config, 0)
    try:
        samples = [q.to_sample() for q in pipe.planned]   # from headers: no pixel decoded
    finally:
        pipe.close()
    cost = make_cost(None, p.cost_model, p.hardware, ranks_per_node=p.ranks_per_node, num_ranks=8,
                     comm_overlap=p.comm_overlap)
    degrees = {d for mb in plan_batch(samples, 8, cost, strategy="dhp", num_micro_batches=1).degrees for d in mb}
    assert len(degrees) >= 3 and any(d & (d - 1) for d in degrees), degrees


def test_model_section_and_data_settings_are_checked():
    """`model=tiny` still sets the stand-in's preset; fine-tuning data needs a checkpoint and one
    source; a bad data.on_error is named; the demo's planning preset is not the checkpoint's."""
    from dhp_jax.train.config import ConfigError, load_config

    assert load_config(None, ["model=tiny"]).model.preset == "tiny"
    assert load_config(None, ["model.pretrained=ck", "data.manifest=m.jsonl"]).planner.cost_model is None
    assert load_config(None, ["model.pretrained=ck", "data.manifest=m.jsonl",
                              "planner.cost_model=qwen3-vl-4b"]).planner.cost_model == "qwen3-vl-4b"
    for overrides, words in [(["data.manifest=m.jsonl"], "needs model.pretrained"),
                             (["model.pretrained=ck"], "exactly one of data.manifest"),
                             (["model.pretrained=ck", "data.manifest=a.jsonl", "data.webdataset=b.tar"], "exactly one"),
                             (["model.pretrained=ck", "data.manifest=a.jsonl", "data.on_error=maybe"], "skip or fail")]:
        with pytest.raises(ConfigError, match=words):
            load_config(None, overrides)


@pytest.mark.parametrize("family,cls", [("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
                                        ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
                                        ("internvl", "InternVLForConditionalGeneration")])
def test_random_checkpoint_is_whole_for_transformers(family, cls, tmp_path):
    """`dhp example`'s checkpoint of each family (hf.init, written by hf.save_pretrained): transformers
    loads it with no missing, unexpected or mismatched weight, and reads back the same values."""
    from dhp_jax.data.example import write_processor_files
    from dhp_jax.model.hf.init import random_params, tiny_config
    from dhp_jax.train.example import token_ids

    write_processor_files(str(tmp_path), family)
    config = hf.parse_config(tiny_config(family, token_ids(str(tmp_path), family), 512))
    params = random_params(config, seed=1)
    hf.save_pretrained(config, params, str(tmp_path))
    model, info = getattr(transformers, cls).from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info.values()), info
    ours = hf.to_state_dict(config, params)
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
