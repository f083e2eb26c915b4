"""Standalone evaluation (`python train.py eval`) and the ARC evaluator inside training."""
import dataclasses
import json
import os
import shutil
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import data
import model
import train
from commands.eval_command import evaluate_command
from commands.restore import load_weights_for_eval
from data import EvalBatches, total_train_steps
from puzzles.build_arc import build_arc
from reference import weights as reference_weights
from tests.data_fixtures import ARC_EVALUATION_SOLUTIONS, arc_files
from training import checkpoint, evaluate
from training.config import PRESETS, ConfigError, parse_config
from training.schedule import evaluation_steps


def small(run_dir, cache_dir, *extra):
    return ["--data.cache-dir", str(cache_dir), "--run.dir", str(run_dir), "--model.hidden-size", "32",
            "--model.puzzle-emb-ndim", "32", "--optim.global-batch-size", "32", "--eval.every-epochs", "1000",
            "--run.log-every", "5", *extra]


def test_standalone_eval_matches_the_runs_final_evaluation(demo_path, tmp_path, capsys):
    run_dir = tmp_path / "run"
    trained = train.main(parse_config(["demo", "--data.path", demo_path,
                                    *small(run_dir, tmp_path / "cache", "--optim.max-steps", "40")]))
    capsys.readouterr()
    assert train.command_line(["eval", "--init-from", str(run_dir), "--data.path", demo_path,
                               "--data.cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert f"evaluating {run_dir} (step 40) on 40 examples" in out
    assert f"exact_accuracy {trained['final']['exact_accuracy']:.4f}" in out
    assert f"accuracy {trained['final']['accuracy']:.4f}" in out
    # into the run's test-time/ (K=1, no noise, the demo's 4 ACT steps), not over its eval/step_40/
    with open(run_dir / "test-time" / "K1-noise0-D4" / "metrics.json") as f:
        saved = json.load(f)
    assert saved["exact_accuracy"] == pytest.approx(trained["final"]["exact_accuracy"])
    assert saved["step"] == 40 and saved["mode_exact_accuracy"] == saved["pass_exact_accuracy"] == \
        saved["exact_accuracy"]
    with open(run_dir / "eval" / "step_40" / "metrics.json") as f:
        assert json.load(f) == trained["final"] | {"step": 40}

    # The exported file evaluates the same.
    exported = str(tmp_path / "model.safetensors")
    train.command_line(["export", str(run_dir), "--out", exported])
    result = evaluate_command(["--init-from", exported, "--data.path", demo_path,
                                     *small(tmp_path / "elsewhere", tmp_path / "cache")])
    assert result["accuracy"] == pytest.approx(trained["final"]["accuracy"])


def test_eval_of_a_run_trained_on_a_subset_reads_every_test_puzzle_unless_told(demo_path, tmp_path, capsys):
    """A run trained with --eval.max-examples 8 (its training-time evaluations' subset):
    `train.py eval --init-from RUN` reads all 40 of the demo's test puzzles, as the run's own final
    evaluation does, and says so on its lines and in metrics.json; --eval.max-examples on the eval
    command line is the subset it reads."""
    run_dir = tmp_path / "run"
    trained = train.main(parse_config(["demo", "--data.path", demo_path, "--eval.max-examples", "8",
                                       *small(run_dir, tmp_path / "cache", "--optim.max-steps", "2")]))
    assert trained["final"]["count"] == 40
    capsys.readouterr()
    cache = ["--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache")]
    assert train.command_line(["eval", "--init-from", str(run_dir), *cache]) == 0
    out = capsys.readouterr().out
    assert f"evaluating {run_dir} (step 2) on 40 examples" in out
    assert "K1-noise0-D4: 40 puzzles" in out and "on 40 puzzles" in out.splitlines()[-1]
    saved = json.loads((run_dir / "test-time" / "K1-noise0-D4" / "metrics.json").read_text())
    assert (saved["num_puzzles"], saved["count"], saved["max_examples"]) == (40, 40, None)
    assert saved["exact_accuracy"] == pytest.approx(trained["final"]["exact_accuracy"])
    # A subset given on the command line is read, and evaluated anew (not the 40's result).
    assert train.command_line(["eval", "--init-from", str(run_dir), *cache, "--eval.max-examples", "8"]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out and "K1-noise0-D4: 8 puzzles" in out
    saved = json.loads((run_dir / "test-time" / "K1-noise0-D4" / "metrics.json").read_text())
    assert (saved["num_puzzles"], saved["count"], saved["max_examples"]) == (8, 8, 8)


def two_exported_models(demo_path, tmp_path):
    """Two demo runs of seeds 0 and 1, each trained 2 steps and exported (`train.py export`) at that
    one step: their model.safetensors files."""
    exported = []
    for seed in (0, 1):
        run_dir = tmp_path / f"seed{seed}"
        train.main(parse_config(["demo", "--data.path", demo_path, "--run.seed", str(seed),
                                 *small(run_dir, tmp_path / "cache", "--optim.max-steps", "2")]))
        exported.append(str(tmp_path / f"seed{seed}.safetensors"))
        assert train.command_line(["export", str(run_dir), "--out", exported[-1]]) == 0
    return exported


def test_two_models_exported_at_one_step_each_report_their_own_numbers(demo_path, tmp_path, monkeypatch, capsys):
    """Two models exported at step 2, evaluated one after the other from one directory, without
    --run.dir and then into one --run.dir: each reports its own numbers (those it gives evaluated
    alone), never the other's metrics found "done" there; metrics.json names the weights read."""
    models = two_exported_models(demo_path, tmp_path)
    cache = ["--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache")]
    alone = [evaluate_command(["demo", "--init-from", m, *cache, "--run.dir", str(tmp_path / f"alone{i}")])
             for i, m in enumerate(models)]
    assert alone[0]["weights"] != alone[1]["weights"] and alone[0]["data"] == alone[1]["data"]
    assert alone[0]["accuracy"] != alone[1]["accuracy"]
    monkeypatch.chdir(tmp_path)
    for flags, order in (([], (0, 1)), (["--run.dir", str(tmp_path / "shared")], (0, 1, 0))):
        for i in order:
            capsys.readouterr()
            result = evaluate_command(["demo", "--init-from", models[i], *cache, *flags])
            assert "skipped" not in capsys.readouterr().out, (flags, i)
            assert (result["weights"], result["accuracy"], result["exact_accuracy"]) == \
                (alone[i]["weights"], alone[i]["accuracy"], alone[i]["exact_accuracy"]), (flags, i)
        if not flags:  # each beside its file, never the preset's runs/demo under the working directory
            assert not (tmp_path / "runs").exists()
            for m in models:
                assert json.loads(open(f"{m}.eval/test-time/K1-noise0-D4/metrics.json").read())["weights"] == \
                    alone[models.index(m)]["weights"]
    # The same weights again, into the directory that holds their result: done, skipped.
    assert evaluate_command(["demo", "--init-from", models[0], *cache, "--run.dir", str(tmp_path / "alone0")]) \
        == alone[0]
    assert "done with these weights" in capsys.readouterr().out


def files_of(directory) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_copied_run_is_evaluated_into_the_copy_and_the_original_is_unchanged(where, demo_path, tmp_path, capsys,
                                                                                 request):
    """A run copied to a second directory (local, or gs:// through the emulator) and evaluated
    without --run.dir: the results are in the copy (the directory given, not the run.dir of its
    saved config), the output says so, and the original is byte for byte unchanged. A checkpoint
    directory of the copy is evaluated into the copy too."""
    run_dir = tmp_path / "run"
    train.main(parse_config(["demo", "--data.path", demo_path, *small(run_dir, tmp_path / "cache",
                                                                      "--optim.max-steps", "2")]))
    original = files_of(run_dir)
    if where == "local":
        copy = str(tmp_path / "copy")
        shutil.copytree(run_dir, copy)
    else:
        copy = request.getfixturevalue("gcs_url") + "/runs/copy"
        from rundir import storage
        storage.upload_dir(str(run_dir), copy)
    capsys.readouterr()
    cache = ["--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache")]
    result = evaluate_command(["--init-from", copy, *cache])
    out = capsys.readouterr().out
    assert f"results into {copy}/test-time" in out and f"saved under {copy}/test-time" in out.splitlines()[-1]
    from testtime import curve
    assert curve.read_metrics(f"{copy}/test-time/K1-noise0-D4") == result
    assert files_of(run_dir) == original
    if where == "local":
        step_dir = next((tmp_path / "copy" / "checkpoints").iterdir())
        assert evaluate_command(["--init-from", str(step_dir), *cache]) == result  # done in the copy
        assert "skipped" in capsys.readouterr().out
        assert files_of(run_dir) == original


def test_an_evaluations_identity_is_the_contents_it_read_not_their_names(demo_path, tmp_path):
    """The weights' fingerprint is their tensors' bytes (with or without the `model/` prefix); the
    test split's is its contents: a copy at another path is the same data, one label changed is not."""
    from testtime import identity

    test_set = data.open_dataset(demo_path, "test")
    fingerprint = identity.data_fingerprint(test_set, data.identifiers_fingerprint(demo_path))
    copy = tmp_path / "copy"
    shutil.copytree(demo_path, copy)
    assert identity.data_fingerprint(data.open_dataset(str(copy), "test"),
                                     data.identifiers_fingerprint(str(copy))) == fingerprint
    labels_file = next((copy / "test").glob("*__labels.npy"))
    labels = np.load(labels_file)
    labels[0, 0] = labels[0, 1] if labels[0, 0] != labels[0, 1] else labels[0, 0] + 1
    np.save(labels_file, labels)
    assert identity.data_fingerprint(data.open_dataset(str(copy), "test"),
                                     data.identifiers_fingerprint(str(copy))) != fingerprint
    weights = model.TRM(model.TRMConfig(seq_len=16, vocab_size=6, hidden_size=32, puzzle_emb_ndim=32,
                                        num_heads=2)).state_dict()
    ours = identity.weights_fingerprint(weights)
    assert identity.weights_fingerprint({f"model/{k}": v for k, v in weights.items()}) == ours
    changed = dict(weights)
    name = next(iter(changed))
    changed[name] = changed[name].clone()
    changed[name].view(-1)[0] += 1
    assert identity.weights_fingerprint(changed) != ours


def test_eval_refuses_a_dataset_the_checkpoint_does_not_fit(demo_path, tmp_path):
    run_dir = tmp_path / "run"
    train.main(parse_config(["demo", "--data.path", demo_path,
                          *small(run_dir, tmp_path / "cache", "--optim.max-steps", "1")]))
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
        evaluate_command(["--init-from", str(run_dir), "--data.path", str(other)])
    # A model exported for 9x9 Sudoku (seq_len 81) on the 4x4 demo data.
    config = model.TRMConfig(seq_len=81, vocab_size=11, hidden_size=32, puzzle_emb_ndim=32, num_heads=2)
    sudoku_file = str(tmp_path / "sudoku.safetensors")
    save_file(model.TRM(config).state_dict(), sudoku_file,
              metadata={"trm_config": json.dumps(dataclasses.asdict(config))})
    with pytest.raises(SystemExit, match="model.seq_len=81 but the dataset at .* has seq_len=16"):
        evaluate_command(["--init-from", sudoku_file, "--data.path", demo_path])


def test_arc_scores_and_submission_during_training_and_standalone(tmp_path, capsys):
    arc_path = str(tmp_path / "arc")
    build_arc(arc_path, arc_files(str(tmp_path)), subsets=("training", "evaluation"),
                         test_sets=("evaluation",), num_aug=3, seed=0)
    tiny_arc = ["--model.hidden-size", "32", "--model.num-heads", "2", "--model.puzzle-emb-ndim", "32",
                "--model.H-cycles", "1", "--model.L-cycles", "1", "--model.L-layers", "1",
                "--model.halt-max-steps", "2", "--model.forward-dtype", "float32"]
    run_dir = tmp_path / "run"
    trained = train.main(parse_config(["arc1", "--data.path", arc_path, "--optim.global-batch-size", "16",
                                    *small(run_dir, tmp_path / "cache", "--optim.max-steps", "2"),
                                    *tiny_arc]))
    final = trained["final"]
    assert set(final) >= {"pass@1", "pass@2", "pass@5", "pass@10"}
    assert 0 <= final["pass@1"] <= final["pass@2"] <= final["pass@5"] <= final["pass@10"] <= 1
    out = capsys.readouterr().out
    assert "pass@2" in out and "ARC submission:" in out
    with open(run_dir / "eval" / "step_2" / "submission.json") as f:
        submission = json.load(f)
    assert list(submission) == ["task_e"] and len(submission["task_e"]) == 2
    assert set(submission["task_e"][0]) == {"attempt_1", "attempt_2"}

    result = evaluate_command(["--init-from", str(run_dir), "--data.path", arc_path,
                                     "--data.cache-dir", str(tmp_path / "cache")])
    assert result["pass@2"] == final["pass@2"] and result["exact_accuracy"] == final["exact_accuracy"]
    assert os.path.exists(run_dir / "test-time" / "K1-noise0-D2" / "metrics.json")
    assert os.path.exists(run_dir / "test-time" / "K1-noise0-D2" / "submission.json")
    # The arc presets also vote over the run's evaluations; here there was one.
    assert set(final) >= {f"{name}@{k}" for name in ("pass", "aggregated_pass")
                          for k in (1, 2, 5, 10, 100, 1000)}
    assert final["aggregated_evaluations"] == 1
    assert all(final[f"aggregated_pass@{k}"] == final[f"pass@{k}"] for k in (1, 2, 5, 10, 100, 1000))
    assert "aggregated_pass@2" in out and "(aggregated over 1 evaluation)" in out


TINY_ARC = ["--model.hidden-size", "32", "--model.num-heads", "2", "--model.puzzle-emb-ndim", "32",
            "--model.H-cycles", "1", "--model.L-cycles", "1", "--model.L-layers", "1",
            "--model.halt-max-steps", "2", "--model.forward-dtype", "float32"]
PASS_KS = (1, 2, 5, 10, 100, 1000)


def test_arc_votes_aggregate_over_a_runs_evaluations_across_a_preemption(tmp_path, monkeypatch):
    """ARC scores voted over every evaluation so far (the reference's aggregated_voting):
    the saved votes of each evaluation merge into the aggregated score, a run preempted at an
    evaluation step and resumed scores the same as one that ran straight through, and
    `train.py eval --eval.arc-aggregate` votes over the saved evaluations of earlier steps."""
    import sharding
    from puzzles.arc import ArcEvaluator, decode_summary, encode_summary

    arc_path = str(tmp_path / "arc")
    build_arc(arc_path, arc_files(str(tmp_path)), subsets=("training", "evaluation"),
                         test_sets=("evaluation",), num_aug=3, seed=0)
    # 3 groups of 2 examples, batch 16: 24 epochs are 9 steps, evaluations at 3, 6 and 9.
    def args(run_dir):
        return ["arc1", "--data.path", arc_path, "--data.cache-dir", str(tmp_path / "cache"),
                "--run.dir", str(run_dir), "--optim.global-batch-size", "16", "--optim.epochs", "24",
                "--eval.every-epochs", "8", "--run.log-every", "3", *TINY_ARC]

    straight_dir = tmp_path / "straight"
    straight = train.main(parse_config(args(straight_dir)))
    assert [e["step"] for e in straight["evals"]] == [3, 6, 9]
    assert [e["aggregated_evaluations"] for e in straight["evals"]] == [1, 2, 3]
    first = straight["evals"][0]
    assert all(first[f"aggregated_pass@{k}"] == first[f"pass@{k}"] for k in PASS_KS)
    # The aggregated score is the vote over the three saved evaluations.
    evaluator = ArcEvaluator.from_dataset(arc_path)
    saved = {step: (straight_dir / "eval" / f"step_{step}" / "arc_votes.json.gz").read_bytes()
             for step in (3, 6, 9)}
    votes = [decode_summary(payload) for payload in saved.values()]
    assert [v["voted_rows"] for v in votes] == [8, 8, 8]  # the test split's 8 rows each time
    by_hand = evaluator.result(ArcEvaluator.merge(votes), PASS_KS)
    assert {k: straight["final"][f"aggregated_{k}"] for k in by_hand} == by_hand
    assert {k: straight["evals"][1][f"aggregated_{k}"] for k in by_hand} == \
        evaluator.result(ArcEvaluator.merge(votes[:2]), PASS_KS)

    # SIGTERM noticed at step 6, an evaluation step: the run saves and stops before evaluating.
    resumed_dir = tmp_path / "resumed"
    with monkeypatch.context() as patch:
        checks = []
        # The 7th agreement: after steps 1-6 and the one batch of the evaluation at step 3.
        patch.setattr(sharding, "any_host", lambda flag: checks.append(flag) or len(checks) == 7)
        stopped = train.main(parse_config(args(resumed_dir)))
    assert stopped["preempted"] and [e["step"] for e in stopped["evals"]] == [3]
    assert not (resumed_dir / "eval" / "step_6").exists()
    resumed = train.main(parse_config(args(resumed_dir)))
    assert resumed["start_step"] == 6 and [e["step"] for e in resumed["evals"]] == [6, 9]
    for ours, theirs in zip(resumed["evals"], straight["evals"][1:]):
        assert {k: v for k, v in ours.items() if "pass@" in k or k == "aggregated_evaluations"} == \
            {k: v for k, v in theirs.items() if "pass@" in k or k == "aggregated_evaluations"}
    for step in (3, 6, 9):
        assert (resumed_dir / "eval" / f"step_{step}" / "arc_votes.json.gz").read_bytes() == saved[step], step

    # Standalone: the final checkpoint again (its own votes, saved in its test-time setting) plus
    # the run's saved votes of steps 3 and 6.
    eval_args = ["--init-from", str(straight_dir), "--data.path", arc_path,
                 "--data.cache-dir", str(tmp_path / "cache")]
    alone = evaluate_command(eval_args + ["--eval.no-arc-aggregate"])
    assert "aggregated_pass@2" not in alone and alone["pass@2"] == straight["final"]["pass@2"]
    again = evaluate_command(eval_args + ["--eval.arc-aggregate"])
    assert {k: again[k] for k in again if k.startswith("aggregated")} == \
        {k: straight["final"][k] for k in straight["final"] if k.startswith("aggregated")}
    # Votes saved at an earlier step count: solutions voted 5 times per test input (more than
    # the model's votes of three evaluations) win every aggregated pass@k, not this snapshot's.
    perfect = ArcEvaluator.from_dataset(arc_path, accumulate=True)
    test_batches = EvalBatches(data.open_dataset(arc_path, "test"), 16)
    for _ in range(5):
        batch = test_batches.batch(0)
        perfect.update(batch, np.where(batch["labels"] < 0, 0, batch["labels"]), np.zeros(16),
                       test_batches.valid(0))
    (straight_dir / "eval" / "step_1").mkdir()
    (straight_dir / "eval" / "step_1" / "arc_votes.json.gz").write_bytes(encode_summary(perfect.summary()))
    # The setting is done (same step, data and aggregation): evaluated again once its metrics go.
    assert evaluate_command(eval_args) == again
    os.remove(straight_dir / "test-time" / "K1-noise0-D2" / "metrics.json")
    voted = evaluate_command(eval_args)  # the run's config: the arc preset aggregates
    assert voted["aggregated_evaluations"] == 4
    assert all(voted[f"aggregated_pass@{k}"] == 1.0 for k in PASS_KS)
    assert voted["pass@1"] == straight["final"]["pass@1"] < 1.0
    with open(straight_dir / "test-time" / "K1-noise0-D2" / "submission.json") as f:
        assert [t["attempt_1"] for t in json.load(f)["task_e"]] == ARC_EVALUATION_SOLUTIONS["task_e"]


def test_eval_losses_are_the_last_act_step_of_real_rows_per_counted_example(demo_path, tmp_path):
    """lm_loss and q_halt_loss of an evaluation, by hand: the reference's evaluate keeps each
    batch's metrics of its last ACT step and divides every sum by count; padding rows (no
    labels) must not count. One batch of 64 rows: the demo's 40 test examples and 24 pads."""
    run_dir = tmp_path / "run"
    # float32: the hand computation runs eagerly on the CPU, whose bf16 rounding is not XLA's.
    trained = train.main(parse_config(["demo", "--data.path", demo_path,
                                    *small(run_dir, tmp_path / "cache", "--optim.max-steps", "3"),
                                    "--optim.global-batch-size", "64", "--model.forward-dtype", "float32"]))
    final = trained["final"]
    config, weights, _, _ = load_weights_for_eval(str(run_dir), PRESETS["demo"][1], [])
    trm = model.TRM(config.model).eval()
    trm.load_state_dict({k.removeprefix("model/"): v for k, v in weights.items()})  # the EMA weights
    test_set = data.open_dataset(demo_path, "test")
    batches = EvalBatches(test_set, 64)
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
    full = total_train_steps(sudoku, 50000, 768)
    assert full == 65104
    steps = evaluation_steps(full, 50000, 5000, full)
    assert steps == [6510, 13021, 19531, 26042, 32552, 39062, 45573, 52083, 58594, 65104]
    # ARC: every 10k of 100k epochs, 10 evaluations whatever the step count.
    assert len(evaluation_steps(123457, 100000, 10000, 123457)) == 10
    # Cut short by optim.max_steps: the scheduled ones before the end, then the final one.
    assert evaluation_steps(full, 50000, 5000, 20000) == [6510, 13021, 19531, 20000]
    assert evaluation_steps(full, 50000, 5000, 19531) == [6510, 13021, 19531]
    assert evaluation_steps(full, 50000, 5000, 100) == [100]
    # Epochs not a multiple of every_epochs: the last scheduled one stays, the final one follows.
    assert evaluation_steps(210, 210, 50, 210) == [50, 100, 150, 200, 210]
    # Fewer steps than evaluations: at most one per step.
    assert evaluation_steps(3, 200, 50, 3) == [1, 2, 3]
    assert evaluation_steps(full, 50000, 50000, full) == [full]
    with pytest.raises(ConfigError, match="eval.every_epochs=0 must be at least 1"):
        evaluation_steps(full, 50000, 0, full)


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_saved_arc_votes_are_found_by_step_locally_and_on_gcs(where, tmp_path, request):
    from puzzles.arc import ArcEvaluator

    root = str(tmp_path / "eval") if where == "local" else request.getfixturevalue("gcs_url") + "/eval"
    votes = {step: {"votes": {("T", bytes([1, 1, step])): {b"\x01\x01\x07": [step, step * 2 ** 70 + 1]}},
                    "voted_rows": step, "unmatched_rows": 0} for step in (3, 12, 7, 40)}
    for step, summary in votes.items():
        assert evaluate.save_arc_votes(root, step, summary).endswith(f"/step_{step}/arc_votes.json.gz")
    evaluate.save_arc_votes(root, 12, votes[12])  # rewriting a step keeps one copy
    found = evaluate.saved_arc_votes(root, before_step=40)
    assert [step for step, _ in found] == [3, 7, 12]
    assert [summary for _, summary in found] == [votes[3], votes[7], votes[12]]
    assert ArcEvaluator.merge(s for _, s in found)["voted_rows"] == 22
    assert evaluate.saved_arc_votes(root, before_step=3) == []
    assert evaluate.saved_arc_votes(root + "/nothing-here", before_step=100) == []


def test_arc_aggregate_without_arc_scoring_is_refused(demo_path, tmp_path):
    with pytest.raises(SystemExit, match="eval.arc_aggregate votes over ARC evaluations but eval.arc is off"):
        train.main(parse_config(["demo", "--data.path", demo_path, "--eval.arc-aggregate",
                              *small(tmp_path / "run", tmp_path / "cache", "--optim.max-steps", "1")]))


def reference_weights_with_other_sizes(config_base, num_ids, seed=0):
    """A model whose sizes no preset has (hidden 48, 3 layers, expansion 2, a table of `num_ids`
    random rows) and its weights written as the reference saves them (torch.compile prefix)."""
    import torch

    config = dataclasses.replace(config_base, seq_len=8, vocab_size=256, num_puzzle_identifiers=num_ids,
                                 hidden_size=48, expansion=2.0, L_layers=3, puzzle_emb_ndim=48)
    torch.manual_seed(seed)
    trm = model.TRM(config)
    with torch.no_grad():
        trm.puzzle_embedding.weight.normal_()
    return config, trm, {"_orig_mod." + k: v for k, v in reference_weights.reference_state_dict(trm).items()}


def test_eval_of_a_reference_checkpoint_with_other_sizes_equals_the_same_weights_loaded_directly(tmp_path):
    import torch

    from tests.data_fixtures import write_synthetic

    dataset = str(tmp_path / "synthetic")
    write_synthetic(dataset, num_groups=4, puzzles_per_group=3, seq_len=8)  # 13 identifiers
    config, trm, reference = reference_weights_with_other_sizes(PRESETS["sudoku-att"][1].model, 13)
    reference_file = str(tmp_path / "reference_step_500.pt")
    torch.save(reference, reference_file)
    ours_file = str(tmp_path / "ours.safetensors")
    save_file(trm.state_dict(), ours_file, metadata={"trm_config": json.dumps(dataclasses.asdict(config))})

    def evaluate_with(*init_from, out):
        # Fewer cycles and ACT steps than the preset keep it quick: flags apply to both the same.
        return evaluate_command(["sudoku-att", *init_from, "--data.path", dataset, "--data.cache-dir",
                                       str(tmp_path / "cache"), "--optim.global-batch-size", "16",
                                       "--eval.max-examples", "16", "--model.H-cycles", "2",
                                       "--model.L-cycles", "2", "--model.halt-max-steps", "3",
                                       "--run.dir", str(tmp_path / out)])

    direct = evaluate_with("--init-from", ours_file, out="direct")
    from_reference = evaluate_with(f"--init-from={reference_file}", out="reference")
    spaced = evaluate_with("--init-from", reference_file, out="spaced")
    assert direct["count"] > 0
    # the same scores; the sources and timings differ
    scores = lambda r: {k: v for k, v in r.items() if k not in (  # noqa: E731
        "source", "seconds_per_puzzle", "cpu_seconds_per_puzzle", "compile_seconds", "compiles", "transfers")}
    assert scores(from_reference) == scores(direct) and scores(spaced) == scores(direct)

    # Evaluation never resizes a table: on a dataset with other identifiers it is an error.
    other = str(tmp_path / "other")
    write_synthetic(other, num_groups=5, puzzles_per_group=3, seq_len=8)  # 16 identifiers
    with pytest.raises(SystemExit, match="puzzle embedding has 13 identifiers but the dataset at .* has "
                                         "num_puzzle_identifiers=16"):
        evaluate_command(["sudoku-att", "--init-from", reference_file, "--data.path", other])


def test_weights_trained_on_other_identifiers_are_refused_by_eval_and_fine_tuned_by_training(demo_path, tmp_path,
                                                                                            capsys):
    # Same shapes, other identifier names: the demo's table rows would belong to other puzzles.
    run_dir = tmp_path / "run"
    train.main(parse_config(["demo", "--data.path", demo_path,
                          *small(run_dir, tmp_path / "cache", "--optim.max-steps", "1")]))
    renamed = tmp_path / "renamed"
    shutil.copytree(demo_path, renamed)
    (renamed / "identifiers.json").write_text(json.dumps(["<another blank>"]))
    exported = str(tmp_path / "model.safetensors")
    train.command_line(["export", str(run_dir), "--out", exported])
    for source in (str(run_dir), exported):
        with pytest.raises(SystemExit, match="trained on a dataset with other puzzle identifiers"):
            evaluate_command(["--init-from", source, "--data.path", str(renamed),
                                    "--data.cache-dir", str(tmp_path / "cache2")])
    # Training from them fine-tunes: dense weights kept, every table row restarted from the mean row
    # (the reference's rule), here on the renamed identifiers and on a dataset with 5 of them.
    more = tmp_path / "more"
    shutil.copytree(demo_path, more)
    for split in ("train", "test"):
        meta = json.loads((more / split / "dataset.json").read_text())
        (more / split / "dataset.json").write_text(json.dumps(dict(meta, num_puzzle_identifiers=5)))
    (more / "identifiers.json").write_text(json.dumps(["<blank>"] + [f"new puzzle {i}" for i in range(4)]))
    weights = load_file(exported)
    for dataset, source, rows in ((renamed, exported, 1), (more, str(run_dir), 5)):
        capsys.readouterr()
        tuned_dir = tmp_path / f"tuned-{dataset.name}"
        train.main(parse_config(["demo", "--data.path", str(dataset),
                              *small(tuned_dir, tmp_path / f"cache-{dataset.name}", "--optim.max-steps", "0",
                                     "--run.init-from", source)]))
        said = capsys.readouterr().out
        assert f"fine-tuning: the puzzle embedding of {source} was trained on " in said
        assert ("1 identifiers, this dataset 5" in said) == (rows == 5)
        start, _ = checkpoint.read_ema_weights(checkpoint.list_checkpoints(str(tuned_dir))[0][1])
        assert [k for k in weights if k != "puzzle_embedding.weight" and not torch.equal(start[k], weights[k])] == []
        table = weights["puzzle_embedding.weight"]
        assert torch.equal(start["puzzle_embedding.weight"], table.mean(0, keepdim=True).expand(rows, -1))
    # Resuming the run on the renamed dataset is a configuration change.
    with pytest.raises(SystemExit, match="puzzle identifiers: fingerprint"):
        train.main(parse_config(["demo", "--data.path", str(renamed),
                              *small(run_dir, tmp_path / "cache2", "--optim.max-steps", "2")]))


def test_captured_evaluation_equals_the_retraced_one_with_arc_votes(tmp_path):
    """The evaluation ACT step traced once and replayed (run.capture_step) gives the metrics,
    pass@k and saved ARC votes of re-tracing it every ACT step, on the same weights."""
    arc_path = str(tmp_path / "arc")
    build_arc(arc_path, arc_files(str(tmp_path)), subsets=("training", "evaluation"),
                         test_sets=("evaluation",), num_aug=3, seed=0)
    run_dir = tmp_path / "run"
    train.main(parse_config(["arc1", "--data.path", arc_path, "--optim.global-batch-size", "16",
                          "--optim.lr-warmup-steps", "1",
                          *small(run_dir, tmp_path / "cache", "--optim.max-steps", "2"), *TINY_ARC]))

    def evaluate_into(out, *extra):
        result = evaluate_command(["--init-from", str(run_dir), "--data.path", arc_path,
                                         "--data.cache-dir", str(tmp_path / "cache"), "--run.dir", str(out),
                                         "--eval.no-arc-aggregate", *extra])
        return result, (out / "test-time" / "K1-noise0-D2" / "arc_votes.json.gz").read_bytes()

    replayed, replayed_votes = evaluate_into(tmp_path / "replayed")
    retraced, retraced_votes = evaluate_into(tmp_path / "retraced", "--run.no-capture-step")
    timing = ("seconds_per_puzzle", "cpu_seconds_per_puzzle", "compile_seconds", "compiles")
    assert replayed["count"] == 8
    assert {k: v for k, v in replayed.items() if k not in timing} == {k: v for k, v in retraced.items()
                                                                       if k not in timing}
    assert replayed_votes == retraced_votes
