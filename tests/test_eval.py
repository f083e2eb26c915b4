"""Standalone evaluation (`python train.py eval`) and the ARC evaluator inside training."""
import dataclasses
import json
import os
import shutil
import types

import pytest
import torch
from safetensors.torch import save_file

import data
import model
import train
from tests.data_fixtures import arc_files


def small(run_dir, cache_dir, *extra):
    return ["--data.cache-dir", str(cache_dir), "--run.dir", str(run_dir), "--model.hidden-size", "32",
            "--model.puzzle-emb-ndim", "32", "--optim.global-batch-size", "32", "--eval.every-epochs", "1000",
            "--run.log-every", "5", *extra]


def test_standalone_eval_matches_the_runs_final_evaluation(demo_path, tmp_path, capsys):
    run_dir = tmp_path / "run"
    trained = train.main(train.cli(["demo", "--data.path", demo_path,
                                    *small(run_dir, tmp_path / "cache", "--optim.max-steps", "40")]))
    capsys.readouterr()
    assert train.command_line(["eval", "--init-from", str(run_dir), "--data.path", demo_path,
                               "--data.cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert f"evaluating {run_dir} (step 40) on 40 examples" in out
    assert f"exact_accuracy {trained['final']['exact_accuracy']:.4f}" in out
    assert f"accuracy {trained['final']['accuracy']:.4f}" in out
    with open(run_dir / "eval" / "step_40" / "metrics.json") as f:
        saved = json.load(f)
    assert saved["exact_accuracy"] == pytest.approx(trained["final"]["exact_accuracy"])

    # The exported file evaluates the same.
    exported = str(tmp_path / "model.safetensors")
    train.command_line(["export", str(run_dir), "--out", exported])
    result = train.evaluate_command(["--init-from", exported, "--data.path", demo_path,
                                     *small(tmp_path / "elsewhere", tmp_path / "cache")])
    assert result["accuracy"] == pytest.approx(trained["final"]["accuracy"])


def test_eval_refuses_a_dataset_the_checkpoint_does_not_fit(demo_path, tmp_path):
    run_dir = tmp_path / "run"
    train.main(train.cli(["demo", "--data.path", demo_path, *small(run_dir, tmp_path / "cache", "--optim.max-steps", "1")]))
    # Same arrays, but the metadata claims more puzzle identifiers.
    other = tmp_path / "other"
    shutil.copytree(demo_path, other)
    for split in ("train", "test"):
        meta_path = other / split / "dataset.json"
        meta = json.loads(meta_path.read_text())
        meta["num_puzzle_identifiers"] = 7
        meta_path.write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="puzzle embedding has 1 identifiers but the dataset at .* has "
                                         "num_puzzle_identifiers=7"):
        train.evaluate_command(["--init-from", str(run_dir), "--data.path", str(other)])
    # A model exported for 9x9 Sudoku (seq_len 81) on the 4x4 demo data.
    config = model.TRMConfig(seq_len=81, vocab_size=11, hidden_size=32, puzzle_emb_ndim=32, num_heads=2)
    sudoku_file = str(tmp_path / "sudoku.safetensors")
    save_file(model.TRM(config).state_dict(), sudoku_file,
              metadata={"trm_config": json.dumps(dataclasses.asdict(config))})
    with pytest.raises(SystemExit, match="model.seq_len=81 but the dataset at .* has seq_len=16"):
        train.evaluate_command(["--init-from", sudoku_file, "--data.path", demo_path])


def test_arc_scores_and_submission_during_training_and_standalone(tmp_path, capsys):
    arc_path = str(tmp_path / "arc")
    data.build_arc(arc_path, arc_files(str(tmp_path)), subsets=("training", "evaluation"),
                   test_sets=("evaluation",), num_aug=3, seed=0)
    tiny_arc = ["--model.hidden-size", "32", "--model.num-heads", "2", "--model.puzzle-emb-ndim", "32",
                "--model.H-cycles", "1", "--model.L-cycles", "1", "--model.L-layers", "1",
                "--model.halt-max-steps", "2", "--model.forward-dtype", "float32"]
    run_dir = tmp_path / "run"
    trained = train.main(train.cli(["arc1", "--data.path", arc_path, "--optim.global-batch-size", "16",
                                    *small(run_dir, tmp_path / "cache", "--optim.max-steps", "2"), *tiny_arc]))
    final = trained["final"]
    assert set(final) >= {"pass@1", "pass@2", "pass@5", "pass@10"}
    assert 0 <= final["pass@1"] <= final["pass@2"] <= final["pass@5"] <= final["pass@10"] <= 1
    out = capsys.readouterr().out
    assert "pass@2" in out and "ARC submission:" in out
    with open(run_dir / "eval" / "step_2" / "submission.json") as f:
        submission = json.load(f)
    assert list(submission) == ["task_e"] and len(submission["task_e"]) == 2
    assert set(submission["task_e"][0]) == {"attempt_1", "attempt_2"}

    result = train.evaluate_command(["--init-from", str(run_dir), "--data.path", arc_path,
                                     "--data.cache-dir", str(tmp_path / "cache")])
    assert result["pass@2"] == final["pass@2"] and result["exact_accuracy"] == final["exact_accuracy"]
    assert os.path.exists(run_dir / "eval" / "step_2" / "metrics.json")


def test_eval_losses_are_the_last_act_step_of_real_rows_per_counted_example(demo_path, tmp_path):
    """lm_loss and q_halt_loss of an evaluation, by hand: the reference's evaluate keeps each
    batch's metrics of its last ACT step and divides every sum by count; padding rows (no
    labels) must not count. One batch of 64 rows: the demo's 40 test examples and 24 pads."""
    run_dir = tmp_path / "run"
    trained = train.main(train.cli(["demo", "--data.path", demo_path,
                                    *small(run_dir, tmp_path / "cache", "--optim.max-steps", "3"),
                                    "--optim.global-batch-size", "64"]))
    final = trained["final"]
    config, weights, _ = train.load_weights_for_eval(str(run_dir), train.PRESETS["demo"][1])
    trm = model.TRM(config.model).eval()
    trm.load_state_dict({k.removeprefix("model/"): v for k, v in weights.items()})  # the EMA weights
    test_set = data.open_dataset(demo_path, "test")
    batches = data.EvalBatches(test_set, 64)
    assert len(batches) == 1 and batches.num_examples == 40
    batch = {k: torch.from_numpy(v) for k, v in batches.batch(0).items()}
    real = torch.from_numpy(batches.valid(0))
    lm_by_step, q_by_step = [], []
    with torch.no_grad():
        carry = trm.initial_carry(batch)
        for _ in range(config.model.halt_max_steps):
            carry, outputs = trm(carry, batch)
            labels = carry.current_data["labels"]
            divisor = (labels != model.IGNORE_LABEL_ID).sum(-1).clamp_min(1)
            lm_by_step.append(model.stablemax_cross_entropy(outputs["logits"], labels).sum(-1) / divisor)
            correct = ((outputs["logits"].argmax(-1) == labels) | (labels == model.IGNORE_LABEL_ID)).all(-1)
            q_by_step.append(torch.nn.functional.binary_cross_entropy_with_logits(
                outputs["q_halt_logits"], correct.float(), reduction="none"))
    count = int(real.sum())
    assert final["count"] == count == 40
    expected_lm = lm_by_step[-1][real].sum().item() / count
    expected_q = q_by_step[-1][real].sum().item() / count
    assert final["lm_loss"] == pytest.approx(expected_lm, rel=1e-4)
    assert final["q_halt_loss"] == pytest.approx(expected_q, rel=1e-4)
    # What it would be if padding rows counted (the reference's q_halt_loss) or every ACT step:
    assert final["q_halt_loss"] != pytest.approx(q_by_step[-1].sum().item() / count, rel=1e-3)
    assert final["lm_loss"] != pytest.approx(sum(x[real].sum().item() for x in lm_by_step) / count, rel=1e-3)


def test_evaluation_schedule_counts_epochs_and_ends_with_the_final_evaluation():
    # Sudoku-Extreme 1k (1000 groups of one-example puzzles), batch 768, 50k epochs, every 5k:
    # the reference evaluates 10 times; rounding eval_every to 6510 steps once put the 10th at
    # step 65,100 and then the final one at 65,104.
    sudoku = types.SimpleNamespace(total_groups=1000, mean_puzzle_examples=1.0)
    full = data.total_train_steps(sudoku, 50000, 768)
    assert full == 65104
    steps = train.evaluation_steps(full, 50000, 5000, full)
    assert steps == [6510, 13021, 19531, 26042, 32552, 39062, 45573, 52083, 58594, 65104]
    # ARC: every 10k of 100k epochs, 10 evaluations whatever the step count.
    assert len(train.evaluation_steps(123457, 100000, 10000, 123457)) == 10
    # Cut short by optim.max_steps: the scheduled ones before the end, then the final one.
    assert train.evaluation_steps(full, 50000, 5000, 20000) == [6510, 13021, 19531, 20000]
    assert train.evaluation_steps(full, 50000, 5000, 19531) == [6510, 13021, 19531]
    assert train.evaluation_steps(full, 50000, 5000, 100) == [100]
    # Epochs not a multiple of every_epochs: the last scheduled one stays, the final one follows.
    assert train.evaluation_steps(210, 210, 50, 210) == [50, 100, 150, 200, 210]
    # Fewer steps than evaluations: at most one per step.
    assert train.evaluation_steps(3, 200, 50, 3) == [1, 2, 3]
    assert train.evaluation_steps(full, 50000, 50000, full) == [full]
    with pytest.raises(train.ConfigError, match="eval.every_epochs=0 must be at least 1"):
        train.evaluation_steps(full, 50000, 0, full)
