"""`dhp example` -> `dhp train model.pretrained=... data.manifest=...` -> `dhp export`, on a tiny random
Qwen2.5-VL checkpoint and generated images and videos, 8 fake devices: the step-0 loss is
transformers' loss on the same batch (same chat template, assistant-only labels), the loss falls
on a fixed set, bad records are skipped and listed, a run resumed on another rank count (8 -> 6 -> 8)
takes the same batches with the same losses, the exported
checkpoint gives transformers the project's logits, the README's run plans what its prices choose
from the real token counts (mixed, irregular degrees where programs are free), and the torch backend continues the run (one process; and
`--tensor-parallel 2 --sequence-parallel` vs its plans replayed at 1, saved checkpoints compared)."""

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_cases as hc  # noqa: E402

from dhp_jax.model import hf  # noqa: E402

TOL = 1e-5
SAMPLES = 12
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example dir, with two bad records appended to its manifest (a missing image, a line that is not JSON)."""
    from dhp_jax.train.example import write_example

    root = tmp_path_factory.mktemp("ft_example")
    ckpt, manifest = write_example(str(root), "qwen2_5_vl", num_samples=SAMPLES, long_videos=0)
    with open(manifest, "a") as f:
        f.write(json.dumps({"id": "bad-missing", "image": "media/nowhere.jpg",
                            "conversations": [{"from": "human", "value": "<image>\nwhat"},
                                              {"from": "gpt", "value": "nothing"}]}) + "\n")
        f.write("{not json\n")
    return ckpt, manifest


def _config(ckpt, manifest, out, **extra):
    from dhp_jax.train.train_config import load_config

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
    said = io.StringIO()
    with contextlib.redirect_stderr(said):     # what the run tells the user as it goes
        result = trainer.run()
    trainer.said = said.getvalue()
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
    # said when met (here, planning the records from their headers, before the first step), once
    said = [line for line in trainer.said.splitlines() if "skipped so far" in line]
    assert said == [f"dhp train: 2 record(s) skipped so far: 1 missing_media, 1 unreadable_line; see "
                    f"{out / 'data_issues.tsv'}"], trainer.said


def test_resume_on_6_ranks_and_back_takes_the_next_batches_with_the_same_losses(example, run, tmp_path, capsys):
    """Stop the 8-rank run after step 1, resume it on 6 ranks for step 2, then on 8 again for step 3:
    the same batches (the records' ids, the checkpoints' loader states) and, within fp32 1e-5, the
    losses of the uninterrupted 8-rank run (another rank count changes the plans, so only the order
    of the sums). 6, not 4: the tiny checkpoint's 223456 parameters need no padding on 4 or 8 ranks,
    on 6 they do (223458), so the state is re-padded on the way there and back."""
    import jax

    from dhp_jax.train.checkpoint import Checkpointer
    from dhp_jax.train.metrics import read_jsonl
    from dhp_jax.train.trainer import Trainer

    trainer, full, _ = run
    ckpt, manifest = example
    eight = _config(ckpt, manifest, tmp_path)
    legs = [Trainer(eight, executor=trainer.executor).run(stop_after=1)]
    capsys.readouterr()
    six = Trainer(_config(ckpt, manifest, tmp_path, num_ranks=6, **{"planner.strategy": "static-ring:6"}))
    legs.append(six.run(resume=True, stop_after=1))
    assert (six.executor.layout.padded, trainer.executor.layout.padded) == (223458, 223456)
    assert "written on 8 ranks, this run has 6: the state is re-laid onto 6 ranks" in capsys.readouterr().err
    flat = [x for x in jax.tree.leaves(legs[1].state) if x.shape == (six.executor.layout.padded,)]
    assert len(flat) == 3 and all(x.sharding == six.executor.sharded for x in flat)
    legs.append(Trainer(eight, executor=trainer.executor).run(resume=True))

    saved = Checkpointer(tmp_path / "checkpoints")
    assert [saved.read_meta(s)["loader"] for s in (1, 2)] == [{"seed": 0, "epoch": e, "position": 0} for e in (1, 2)]
    assert saved.read_meta(2)["layout"]["num_shards"] == 6
    saved.close()
    assert [[r["step"] for r in leg.records] for leg in legs] == [[1], [2], [3]]
    assert [leg.records[0]["degrees"] for leg in legs] == [[[8]], [[6]], [[8]]]
    assert [p["plan"]["num_ranks"] for p in read_jsonl(tmp_path / "plans.jsonl")] == [8, 6, 8]
    records = [r for leg in legs for r in leg.records]
    assert [r["sample_ids"] for r in records] == [r["sample_ids"] for r in full.records]
    assert len({tuple(r["sample_ids"]) for r in full.records}) == 3   # each epoch reshuffled
    resumed = [x for leg in legs for x in leg.losses]
    np.testing.assert_allclose(resumed, full.losses, rtol=TOL, atol=0)
    with capsys.disabled():
        print("fine-tune resume 8 -> 6 -> 8 ranks vs uninterrupted 8: losses", resumed, "vs", full.losses,
              "max rel diff", float(np.max(np.abs(np.subtract(resumed, full.losses)) / np.abs(full.losses))))


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
    ours = hc.logits(trainer.hf_config, trained, x)
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


def _readme_command(prefix: str) -> list[str]:
    """The arguments after `dhp <command>` of the README's line that starts with `prefix` (its
    comment and --out dropped)."""
    import shlex

    line = next(x for x in (REPO / "README.md").read_text().splitlines() if x.startswith(prefix))
    args = shlex.split(line.split("#")[0])[2:]
    return [a for k, a in enumerate(args) if a != "--out" and (k == 0 or args[k - 1] != "--out")]


def test_readme_run_plans_what_its_prices_choose_from_real_counts(tmp_path):
    """The README's fine-tuning run planned as the run plans it (`plan_run`: its config, cost model,
    head rule, compile prices and bucket ladder, step after step; the batches from the records'
    headers, no pixel decoded) on `dhp example`'s default data, and the README's "groups run" line
    is these plans' count.

    What the planner chooses and why: each plan is its cheapest candidate by the planner's price
    (micro-batch makespans plus `planner.compile_price_s` for each program no earlier plan needed).
    Over these 6 steps that is a plan of one degree (a static plan or a FlexSP-style packing: two
    groups of 4) whose programs the first step pays once, against the search's own plan whose 3
    new programs (9 s) each step outweigh its faster steps. With programs free
    (`compile_price_s=0`) the same batches, long videos beside short samples, are strictly faster
    on mixed degrees, and the planner mixes them: >= 3 degrees, one not a power of two."""
    from collections import Counter

    from dhp_jax.train.train_config import load_config
    from dhp_jax.train.example import write_example
    from dhp_jax.train.finetune import plan_run

    assert _readme_command("dhp example ex") == ["ex", "--family", "qwen2_5_vl"]
    write_example(str(tmp_path / "ex"), "qwen2_5_vl")
    overrides = [a.replace("=ex/", f"={tmp_path}/ex/") for a in _readme_command("dhp train model.pretrained=")]
    cfg = load_config(None, overrides)
    assert cfg.model.pretrained == f"{tmp_path}/ex/checkpoint" and cfg.planner.strategy == "dhp"
    price = cfg.planner.compile_price_s
    plans = plan_run(cfg)
    free = plan_run(load_config(None, overrides + ["planner.compile_price_s=0"]))
    paid = []
    for step, (plan, alt) in enumerate(zip(plans, free)):
        solver = plan.solver
        spans = sum(mb.est_makespan_s for mb in plan.micro_batches)
        assert solver["chosen"] != "dhp" and len({d for mb in plan.degrees for d in mb}) == 1, (step, solver)
        # its price: its makespans plus its new programs; below the search's plan
        paid.append(round((solver["est_makespan_sum_s"] - spans) / price))
        assert solver["est_makespan_sum_s"] == pytest.approx(spans + paid[-1] * price, rel=1e-9)
        assert solver["est_makespan_sum_s"] < solver["dhp_search_makespan_sum_s"], (step, solver)
        # with programs free the search's mixed plan wins, and it is strictly faster a step
        free_degrees = {d for mb in alt.degrees for d in mb}
        assert alt.solver["chosen"] == "dhp", (step, alt.solver)
        assert len(free_degrees) >= 3 and any(d & (d - 1) for d in free_degrees), alt.degrees
        assert alt.est_step_time_s < plan.est_step_time_s, step
    assert paid[0] >= 1 and sum(paid) <= 2, paid     # its programs: paid for at the first step
    groups = Counter(d for plan in plans for mb in plan.degrees for d in mb)
    line = "groups run: " + ", ".join(f"{n} of degree {d}" for d, n in sorted(groups.items()))
    print(f"README run ({cfg.steps} steps), planned from headers: {line}")
    assert line in (REPO / "README.md").read_text(), line


def test_model_section_and_data_settings_are_checked():
    """`model=tiny` still sets the stand-in's preset; fine-tuning data needs a checkpoint and one
    source; a bad data.on_error is named; the demo's planning preset and run name are not a
    fine-tuning run's."""
    from dhp_jax.train.train_config import ConfigError, load_config

    assert load_config(None, ["model=tiny"]).model.preset == "tiny"
    assert load_config(None, ["model.pretrained=ck", "data.manifest=m.jsonl"]).planner.cost_model is None
    assert load_config(None, ["model.pretrained=ck", "data.manifest=m.jsonl",
                              "planner.cost_model=qwen3-vl-4b"]).planner.cost_model == "qwen3-vl-4b"
    # a fine-tuning run is named after its checkpoint directory and writes under runs/<name>
    cfg = load_config(None, ["model.pretrained=models/Qwen2.5-VL-3B/", "data.manifest=m.jsonl"])
    assert (cfg.name, cfg.metrics.out_dir) == ("finetune-Qwen2.5-VL-3B", "runs/finetune-Qwen2.5-VL-3B")
    cfg = load_config(None, ["model.pretrained=ck", "data.manifest=m.jsonl", "name=mine", "metrics.out_dir=o"])
    assert (cfg.name, cfg.metrics.out_dir) == ("mine", "o")
    assert (load_config(None, []).name, load_config(None, []).metrics.out_dir) == ("demo", "runs/demo")
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


def test_torch_backend_tensor_parallel_2_matches_one_process_per_rank(run, tmp_path, capsys):
    """The same continuation on 2 ranks of 2 processes each (`--tensor-parallel 2 --sequence-parallel`: the
    family's LLM and vision encoder split over each rank's processes, their blocks on half the rows
    each; the psum form's steps are checked in test_npu_tensor_parallel) and, replaying its plans, on
    2 processes of one:
    the same losses, and `--save-weights` (gathered over each rank) the same Hugging Face checkpoint,
    within fp32 1e-5."""
    from test_npu_train import _torchrun

    from npu_backend.finetune import FamilyRun
    from npu_backend.hf import load_family
    from npu_backend.weights import load_jax_checkpoint

    _, result, out = run
    common = ["--init-from", str(out / "checkpoints" / "2"), "--steps", "2", "--optimizer", "sgd", "--lr", "0.1"]
    log = str(tmp_path / "plans.jsonl")
    runs, said = {}, {}
    for t, nproc, extra in ((2, 4, ["--strategy", "static-ring:2", "--dump-plans", log, "--sequence-parallel"]),
                            (1, 2, ["--plan-file", log])):
        done = _torchrun(nproc, [*common, *extra, "--tensor-parallel", str(t), "--save-weights", str(tmp_path / f"w{t}"),
                                 "--json", str(tmp_path / f"t{t}.json")], tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[t], said[t] = json.loads((tmp_path / f"t{t}.json").read_text()), done.stdout
    assert "npu_backend: 2 ranks of 2 processes (tensor parallel, sequence parallel)" in said[2]
    assert runs[2]["tensor_parallel"] == 2 and runs[2]["sequence_parallel"] and not runs[1]["sequence_parallel"]
    assert [s["degrees"] for s in runs[2]["steps"]] == [[[2]], [[2]]]
    losses = {t: np.array([s["loss"] for s in r["steps"]]) for t, r in runs.items()}
    loss_err = float(np.max(np.abs(losses[2] - losses[1]) / np.abs(losses[1])))
    assert loss_err <= TOL, losses
    assert abs(losses[2][0] - result.losses[2]) <= TOL * abs(result.losses[2])     # the JAX run's step 3
    w0 = FamilyRun.of(load_jax_checkpoint(str(out / "checkpoints" / "2"))).model.params
    w0 = {n: p.detach() for n, p in w0.items()}
    w1, w2 = ({n: p.detach() for n, p in load_family(str(tmp_path / f"w{t}")).params.items()} for t in (1, 2))
    assert set(w1) == set(w2) == set(w0)
    rel = {n: float((w2[n] - w1[n]).abs().max() / w1[n].abs().max()) for n in w1}
    upd = {n: float((w2[n] - w1[n]).abs().max() / max(float((w1[n] - w0[n]).abs().max()), 1e-30)) for n in w1}
    moved = [n for n in w1 if float((w1[n] - w0[n]).abs().max()) > 1e-3 * float(w0[n].abs().max())]
    worst = max(rel, key=rel.get)
    with capsys.disabled():
        print(f"torch tensor parallel 2 (sequence-parallel) vs 1: losses {loss_err:.1e}, weights {rel[worst]:.1e} ({worst}); "
              f"updates of {len(moved)}/{len(w1)} tensors that moved: {max(upd[n] for n in moved):.1e}")
    assert rel[worst] <= TOL, (worst, rel[worst])
    # the updates themselves (w - w0: cancellation in fp32 costs |w| / |update| ulps) of the tensors that moved
    assert len(moved) > len(w1) // 2 and max(upd[n] for n in moved) <= 10 * TOL, {n: upd[n] for n in moved}
