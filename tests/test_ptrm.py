"""Test-time scaling by noisy trajectories chosen by the Q-halt head (ptrm.py, issue 37)."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import data
import predict
import ptrm
import train
from config import parse_config
from eval_command import evaluate_command
from model import TRM, Carry, loss_and_metrics
from tests.test_model import random_batch, tiny_config
from tests.test_train import PROJECT_DIR, tiny_args


def eval_steps(m: TRM, batch: dict, trajectories=None):
    """Trainer.eval_step's math for halt_max_steps ACT steps on CPU eager: (metrics, predictions
    and q_halt of the last step)."""
    carry = m.initial_carry(batch)
    with torch.no_grad():
        for _ in range(m.config.halt_max_steps):
            carry, outputs = m(carry, batch, perturb=None if trajectories is None else trajectories.perturb)
            scored_carry, scored = (carry, outputs) if trajectories is None else trajectories.select(carry, outputs)
            _, metrics = loss_and_metrics(scored_carry, scored, halted_losses=True)
    return metrics, scored["logits"].argmax(-1), scored["q_halt_logits"]


def trained_looking_model(config, seed=0):
    torch.manual_seed(seed)
    m = TRM(config).eval()
    with torch.no_grad():
        m.q_head.weight.normal_(std=0.5)  # q_halt varies by row
    return m


def test_one_trajectory_without_noise_is_the_evaluation_bit_for_bit():
    config = tiny_config()
    m, batch = trained_looking_model(config), random_batch(config, 16, seed=1)
    reference = eval_steps(m, batch)
    assert ptrm.trajectories_of(1, 0.0, seed=3) is None  # eval and training do not route it through ptrm
    # Routed through ptrm anyway, nothing changes.
    metrics, preds, q = eval_steps(m, batch, ptrm.Trajectories(1, 0.0))
    assert torch.equal(preds, reference[1]) and torch.equal(q, reference[2])
    assert all(torch.equal(metrics[name], reference[0][name]) for name in metrics)
    # K identical trajectories (no noise) choose the first: the answers and counts of K=1.
    repeated = {k: v.repeat_interleave(4, 0) for k, v in batch.items()}
    metrics, preds, q = eval_steps(m, repeated, ptrm.Trajectories(4, 0.0))
    assert torch.equal(preds[::4], reference[1]) and torch.equal(q[::4], reference[2])
    for name in ("count", "exact_accuracy", "accuracy", "steps"):
        assert metrics[name] == reference[0][name], name


def test_selection_takes_the_highest_q_halt_and_the_lowest_index_on_ties():
    k = 4
    planted = torch.tensor([0.1, 2.0, -1.0, 1.9,    # puzzle 0: trajectory 1
                            -3.0, -3.0, -5.0, -4.0,  # puzzle 1: tie, the first (0)
                            1.0, 2.0, 3.0, 3.0])     # puzzle 2: tie at the top, trajectory 2
    chosen = ptrm.Trajectories(k, 0.5).best(planted)
    assert chosen.view(-1, k).int().argmax(1).tolist() == [1, 0, 2]
    assert chosen.sum() == 3
    # select() spreads the chosen row's logits over its puzzle's rows and counts each puzzle once.
    rows, seq, vocab = 12, 3, 5
    logits = torch.arange(rows, dtype=torch.float32).view(rows, 1, 1).expand(rows, seq, vocab).clone()
    labels = torch.full((rows, seq), 2, dtype=torch.int32)
    carry = Carry(z_H=torch.zeros(rows, 1, 1), z_L=torch.zeros(rows, 1, 1), steps=torch.full((rows,), 4),
                  halted=torch.ones(rows, dtype=torch.bool), current_data={"labels": labels},
                  rng_counter=torch.tensor(0))
    picked, outputs = ptrm.Trajectories(k, 0.5).select(carry, {"logits": logits, "q_halt_logits": planted})
    assert outputs["logits"][:, 0, 0].tolist() == [1] * 4 + [4] * 4 + [10] * 4
    assert outputs["q_halt_logits"].tolist() == [2.0] * 4 + [-3.0] * 4 + [3.0] * 4
    assert picked.halted.tolist() == [True, False, False, False] * 3
    _, metrics = loss_and_metrics(picked, outputs, halted_losses=True)
    assert metrics["count"] == 3 and metrics["exact_accuracy"] == 0  # the chosen rows predict 1, 4, 10
    # The oracle: a puzzle counts when any trajectory is right (rows 2 and 7 predict label 2).
    right = torch.where(torch.arange(rows).view(rows, 1, 1) % 5 == 2, 9.0, 0.0) * (torch.arange(vocab) == 2)
    assert ptrm.Trajectories(k, 0.5).solved_by_any(carry, {"logits": right}) == 2


def test_noise_is_a_function_of_seed_puzzle_trajectory_and_step():
    config = tiny_config()
    batch = {k: v.repeat_interleave(4, 0) for k, v in random_batch(config, 6, seed=2).items()}
    z = torch.zeros(24, config.total_len, config.hidden_size)
    steps = torch.zeros(24, dtype=torch.int32)
    t = ptrm.Trajectories(4, 1.0, seed=7)
    noise = t.perturb(z, batch, steps)
    assert abs(noise.std().item() - 1.0) < 0.02 and abs(noise.mean().item()) < 0.02
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[4])  # trajectories, puzzles
    assert not torch.equal(noise, t.perturb(z, batch, steps + 1))
    assert not torch.equal(noise, dataclasses.replace(t, seed=8).perturb(z, batch, steps))
    # The same puzzle elsewhere in the batch, or trajectory k at a larger K: the same noise.
    shifted = {k: v.roll(4, 0) for k, v in batch.items()}
    assert torch.equal(t.perturb(z, shifted, steps).roll(-4, 0), noise)
    wider = {k: v.view(6, 4, *v.shape[1:])[:, :2].reshape(12, *v.shape[1:]) for k, v in batch.items()}
    assert torch.equal(ptrm.Trajectories(2, 1.0, seed=7).perturb(z[:12], wider, steps[:12]),
                       noise.view(6, 4, *noise.shape[1:])[:, :2].reshape(12, *noise.shape[1:]))


def test_noise_and_selection_on_a_sharded_xla_mesh_equal_cpu_eager(spmd_mesh):
    import torch_xla.debug.metrics as met

    import sharding

    config = tiny_config()
    m = trained_looking_model(config)
    batch = {k: v.repeat_interleave(4, 0) for k, v in random_batch(config, 8, seed=3).items()}
    t = ptrm.Trajectories(4, 0.5, seed=1)
    cpu = eval_steps(m, batch, t)
    device = sharding.device()
    xla_model = TRM(config).eval()
    xla_model.load_state_dict(m.state_dict())
    xla_model = xla_model.to(device)
    xla_batch = {k: sharding.shard_batch_dim(v.to(device), spmd_mesh) for k, v in batch.items()}
    met.clear_all()
    xla = eval_steps(xla_model, xla_batch, t)
    import torch_xla
    torch_xla.sync()
    assert not [n for n in met.counter_names() if n.startswith("aten::")]
    assert met.metric_data("TransferFromDeviceTime") is None, "the steps read a device value"
    assert torch.equal(xla[1].cpu(), cpu[1])
    torch.testing.assert_close(xla[2].cpu(), cpu[2], rtol=1e-5, atol=1e-5)
    assert xla[0]["exact_accuracy"].cpu() == cpu[0]["exact_accuracy"]


def test_trajectory_flags_are_checked_and_a_k_that_splits_puzzles_is_refused():
    assert ptrm.parse_trajectories("1,4,16") == [1, 4, 16]
    assert ptrm.parse_noises("0,0.3") == [0.0, 0.3]
    with pytest.raises(SystemExit, match=r"eval.trajectories='1,0' must be .* \(set it with --eval.trajectories\)"):
        parse_config(["demo", "--eval.trajectories", "1,0"])
    with pytest.raises(SystemExit, match=r"eval.noise='-1' must be"):
        parse_config(["demo", "--eval.noise=-1"])
    with pytest.raises(ValueError, match=r"K=3 must divide the global batch of 128 rows .* pick K among"):
        ptrm.puzzles_per_batch(128, 3, 1)


ONE_DEVICE_EVAL = """
import json, sys
sys.path.insert(0, {project!r})
import sharding
from eval_command import evaluate_command
result = evaluate_command({args!r})
print("RESULT" + json.dumps({{"curve": result["trajectories"], "xla": sharding.xla_counters()}}))
"""


def test_eval_curve_compiles_one_program_per_k_gives_the_same_answers_on_1_and_8_devices_and_in_predict(demo_path,
                                                                                                       tmp_path):
    """`train.py eval --eval.trajectories 1,2,4`: K=1 without noise is the evaluation's own
    result; each K compiles one program and reads its metrics once; the curve, its JSON and PNG
    are saved; the same seed gives the same accuracies on 1 device as on the 8 of the mesh."""
    run_dir = tmp_path / "run"
    # float32: the partitioned program rounds differently from the one-device one (test_train).
    steps = ("--optim.max-steps", "30", "--eval.every-epochs", "1000", "--model.forward-dtype", "float32")
    train.main(parse_config(tiny_args(demo_path, tmp_path, *steps)))
    common = ["--init-from", str(run_dir), "--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache"),
              "--optim.global-batch-size", "32"]
    baseline = evaluate_command([*common, "--run.dir", str(tmp_path / "base")])
    args = [*common, "--run.dir", str(tmp_path / "curve"), "--eval.trajectories", "1,2,4", "--eval.noise", "0,0.5"]
    result = evaluate_command(args)
    curve = result["trajectories"]
    # Without noise only K=1 runs (its trajectories would all be the first, test above).
    assert [(r["trajectories"], r["noise"]) for r in curve] == [(1, 0), (1, 0.5), (2, 0.5), (4, 0.5)]
    assert curve[0]["exact_accuracy"] == baseline["exact_accuracy"] and curve[0]["accuracy"] == baseline["accuracy"]
    # K=1 without noise is the evaluation program compiled for `baseline`; every other K, one.
    assert [r["compiles"] for r in curve] == [0, 1, 1, 1]
    assert all(r["transfers"] == 1 for r in curve)  # the metric sums, read after the last batch
    assert curve[0]["examples"] == 40
    assert all(r["oracle_exact_accuracy"] >= r["exact_accuracy"] for r in curve)
    saved = tmp_path / "curve" / "eval" / "step_30"
    assert json.loads((saved / ptrm.CURVE_FILE).read_text()) == curve
    assert (saved / ptrm.CURVE_PLOT).read_bytes()[:4] == b"\x89PNG"
    # The study report's columns of a run evaluated so (its eval/step_N/trajectories.json).
    columns = ptrm.saved_curve_columns(str(tmp_path / "curve"))
    assert list(columns) == ["exact_K1_noise0_%", "exact_K1_noise0.5_%", "exact_K2_noise0.5_%", "exact_K4_noise0.5_%"]
    assert columns["exact_K4_noise0.5_%"] == f"{100 * curve[-1]['exact_accuracy']:.2f}"
    assert ptrm.saved_curve_columns(str(tmp_path / "base")) == {}

    # predict takes one K and noise and gives the evaluation's answers (the same noise per puzzle).
    test_set = data.open_dataset(demo_path, "test")
    digits = lambda tokens: "".join(str(int(t) - 1) for t in tokens)  # noqa: E731
    csv_file = tmp_path / "test.csv"
    csv_file.write_text("source,question,answer,rating\n" + "".join(
        f"demo,{digits(q)},{digits(a)},0\n" for q, a in zip(test_set.inputs, test_set.labels)))
    predicted = predict.predict_command(["demo", "--init-from", str(run_dir), "--puzzle-file", str(csv_file),
                                         "--eval.trajectories", "4", "--eval.noise", "0.5"])
    assert predicted["exact_accuracy"] == pytest.approx(curve[-1]["exact_accuracy"])
    with pytest.raises(SystemExit, match="predict takes one --eval.trajectories K"):
        predict.predict_command(["demo", "--init-from", str(run_dir), "--puzzle-file", str(csv_file),
                                 "--eval.trajectories", "1,4"])

    script = textwrap.dedent(ONE_DEVICE_EVAL.format(project=str(PROJECT_DIR),
                                                    args=args + ["--run.cpu-devices", "1"]))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads(proc.stdout.split("RESULT")[1])
    assert not one["xla"]["fallbacks"]
    for a, b in zip(curve, one["curve"]):
        assert a["exact_accuracy"] == b["exact_accuracy"], (a, b)
        assert a["accuracy"] == pytest.approx(b["accuracy"], rel=1e-5)
    assert np.isfinite([r["seconds_per_puzzle"] for r in curve]).all()


def test_training_evaluations_may_use_trajectories(demo_path, tmp_path):
    """--eval.trajectories / --eval.noise in training: its evaluations run the last K and noise,
    counting each test puzzle once."""
    trained = train.main(parse_config(tiny_args(demo_path, tmp_path, "--optim.max-steps", "4", "--eval.every-epochs",
                                                "1000", "--eval.trajectories", "1,2", "--eval.noise", "0.3")))
    assert trained["final"]["count"] == 40


def test_projection_of_an_evaluation_at_k_trajectories():
    """bench.py --trajectories K / projection: an evaluation batch holds global_batch // K puzzles."""
    from config import PRESETS
    from projection import PAPER_DATASETS, flop_record, project_paper_run, slice_spec

    preset = PRESETS["sudoku-mlp"][1]
    record = flop_record("sudoku-mlp", preset, slice_spec("v4-8"))
    one = project_paper_run(record, preset, PAPER_DATASETS["sudoku-mlp"], 0.4)
    at_16 = project_paper_run(record, dataclasses.replace(preset, eval=dataclasses.replace(
        preset.eval, trajectories="1,16")), PAPER_DATASETS["sudoku-mlp"], 0.4)
    test_examples = PAPER_DATASETS["sudoku-mlp"].test_examples
    assert at_16["eval_act_steps"] == 10 * -(-test_examples // 48) * 16  # 768 // 16 puzzles a batch
    assert at_16["eval_ms_per_puzzle"] == pytest.approx(16 * one["eval_ms_per_puzzle"])
    assert at_16["test_eval_hours"] == pytest.approx(
        -(-test_examples // 48) * 16 * at_16["eval_ms_per_act_step"] / 3.6e6)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="libtpu's compile-only client needs Python 3.11+")
def test_tpu_compile_compiles_the_evaluation_at_k_trajectories(tmp_path):
    """`tpu_compile.py demo --programs eval_step --eval.trajectories 8`: the evaluation program
    with its K rows per puzzle compiles for a v4-8 host and tells its device time per puzzle."""
    out = tmp_path / "k8.json"
    done = subprocess.run([sys.executable, "tpu_compile.py", "demo", "--slice", "v4-8", "--programs", "eval_step",
                           "--json", str(out), "--eval.trajectories", "8", "--eval.noise", "0.5"],
                          cwd=PROJECT_DIR, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TRM_TPU_COMPILE_CACHE=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["programs"]
    assert (result["trajectories"], result["noise"], result["puzzles_per_batch"]) == (8, 0.5, 128 // 8)
    import tpu_compile
    per_puzzle = tpu_compile.eval_ms_per_puzzle(result)
    assert per_puzzle == pytest.approx(result["estimate_ms"] * 4 / 16)  # demo: 4 ACT steps, 16 puzzles a batch
    assert f"per test puzzle: {per_puzzle:.4f} ms of device time" in done.stdout
    assert "K=8 trajectories each, noise 0.5" in done.stdout
    assert result["hbm_bytes"]["total"] < result["hbm_capacity_bytes"]


def test_the_study_report_adds_the_columns_of_runs_evaluated_at_several_k(tmp_path):
    import study_report

    runs = [{"kind": "run", "name": "a", "status": "done", "exact_K16_noise0.3_%": "57.00"},
            {"kind": "run", "name": "b", "status": "done"}]
    configs = [{"kind": "configuration", "name": "a", "status": "1 of 1 seeds done"}]
    text = study_report.write_outputs(str(tmp_path), runs, configs, [], "")
    assert "exact_K16_noise0.3_%" in text.splitlines()[0] and "57.00" in text
    header = (tmp_path / "results.csv").read_text().splitlines()[0]
    assert "exact_K16_noise0.3_%" in header and "exact_K16_noise0.3_% |" in (tmp_path / "results.md").read_text()
