"""Standalone evaluation (`python train.py eval`) and the ARC evaluator inside training."""
import dataclasses
import json
import os
import shutil

import pytest
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
    return config, trm, {"_orig_mod." + k: v for k, v in model.reference_state_dict(trm).items()}


def test_eval_of_a_reference_checkpoint_with_other_sizes_equals_the_same_weights_loaded_directly(tmp_path):
    import torch

    from tests.data_fixtures import write_synthetic

    dataset = str(tmp_path / "synthetic")
    write_synthetic(dataset, num_groups=4, puzzles_per_group=3, seq_len=8)  # 13 identifiers
    config, trm, reference = reference_weights_with_other_sizes(train.PRESETS["sudoku-att"][1].model, 13)
    reference_file = str(tmp_path / "reference_step_500.pt")
    torch.save(reference, reference_file)
    ours_file = str(tmp_path / "ours.safetensors")
    save_file(trm.state_dict(), ours_file, metadata={"trm_config": json.dumps(dataclasses.asdict(config))})

    def evaluate(*init_from, out):
        # Fewer cycles and ACT steps than the preset keep it quick: flags apply to both the same.
        return train.evaluate_command(["sudoku-att", *init_from, "--data.path", dataset, "--data.cache-dir",
                                       str(tmp_path / "cache"), "--optim.global-batch-size", "16",
                                       "--eval.max-examples", "16", "--model.H-cycles", "2", "--model.L-cycles",
                                       "2", "--model.halt-max-steps", "3", "--run.dir", str(tmp_path / out)])

    direct = evaluate("--init-from", ours_file, out="direct")
    from_reference = evaluate(f"--init-from={reference_file}", out="reference")
    spaced = evaluate("--init-from", reference_file, out="spaced")
    assert direct["count"] > 0
    assert from_reference == direct and spaced == direct

    # Evaluation never resizes a table: on a dataset with other identifiers it is an error.
    other = str(tmp_path / "other")
    write_synthetic(other, num_groups=5, puzzles_per_group=3, seq_len=8)  # 16 identifiers
    with pytest.raises(SystemExit, match="puzzle embedding has 13 identifiers but the dataset at .* has "
                                         "num_puzzle_identifiers=16"):
        train.evaluate_command(["sudoku-att", "--init-from", reference_file, "--data.path", other])


def test_weights_trained_on_other_identifiers_are_refused(demo_path, tmp_path):
    # Same shapes, other identifier names: the demo's table rows would belong to other puzzles.
    run_dir = tmp_path / "run"
    train.main(train.cli(["demo", "--data.path", demo_path, *small(run_dir, tmp_path / "cache", "--optim.max-steps", "1")]))
    renamed = tmp_path / "renamed"
    shutil.copytree(demo_path, renamed)
    (renamed / "identifiers.json").write_text(json.dumps(["<another blank>"]))
    exported = str(tmp_path / "model.safetensors")
    train.command_line(["export", str(run_dir), "--out", exported])
    for source in (str(run_dir), exported):
        with pytest.raises(SystemExit, match="trained on a dataset with other puzzle identifiers"):
            train.evaluate_command(["--init-from", source, "--data.path", str(renamed),
                                    "--data.cache-dir", str(tmp_path / "cache2")])
    with pytest.raises(SystemExit, match="trained on a dataset with other puzzle identifiers"):
        train.main(train.cli(["demo", "--data.path", str(renamed),
                              *small(tmp_path / "finetune", tmp_path / "cache2", "--optim.max-steps", "1",
                                     "--run.init-from", exported)]))
    # Resuming the run on the renamed dataset is a configuration change.
    with pytest.raises(SystemExit, match="puzzle identifiers: fingerprint"):
        train.main(train.cli(["demo", "--data.path", str(renamed),
                              *small(run_dir, tmp_path / "cache2", "--optim.max-steps", "2")]))
