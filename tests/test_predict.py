"""`python train.py predict`: the model's answers to given puzzles equal the evaluation's."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import build_data
import data
import train
from commands import predict
from puzzles import builders
from puzzles.build_arc import build_arc
from tests.data_fixtures import arc_files
from tests.test_checkpoint import subprocess_env
from tests.test_eval import TINY_ARC, small
from train import usage
from training.config import PROJECT_DIR, parse_config


def digits(tokens) -> str:
    """A demo puzzle's tokens as the builders' digits (blanks as '0')."""
    return "".join(str(int(t) - 1) for t in tokens)


def write_demo_csv(test_set, path) -> None:
    """The demo's test split as the builders' CSV, answers included."""
    path.write_text("source,question,answer,rating\n" + "".join(
        f"demo,{digits(q)},{digits(a)},0\n" for q, a in zip(test_set.inputs, test_set.labels)))


def test_predict_answers_a_demo_runs_test_puzzles_as_its_evaluation_did(demo_path, tmp_path):
    run_dir = tmp_path / "run"
    # A model this small and short solves few test puzzles (often none): the answers are also compared cell
    # by cell below (the evaluation's token accuracy), which every cell of every answer must match.
    # The same answers by construction: a global batch of 40 rows holds the 40 test puzzles, so the
    # evaluation and predict run the same program on the same rows (5 per device). With batches of 32,
    # the evaluation's 4 rows per device and predict's 5 (one batch of all 40) were other matmul shapes,
    # which a CPU's BLAS may sum in other orders: in bf16 one argmax flipped on a 2-core AMD EPYC.
    trained = train.main(parse_config(["demo", "--data.path", demo_path,
                                    *small(run_dir, tmp_path / "cache", "--optim.max-steps", "40"),
                                    "--optim.global-batch-size", "40"]))
    final = trained["final"]
    test_set = data.open_dataset(demo_path, "test")
    # The test split as the builders' CSV (answers included), and as bare lines.
    csv_file, lines_file = tmp_path / "test.csv", tmp_path / "test.txt"
    write_demo_csv(test_set, csv_file)
    # puzzle 1 comes from the command line below, the other 39 from this file: the same rows again
    lines_file.write_text("".join(digits(q).replace("0", ".") + "\n" for q in test_set.inputs[1:]))
    out_file = tmp_path / "predictions.json"
    # As a user runs it: `python train.py predict`.
    proc = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "train.py"), "predict", "--init-from",
                           str(run_dir), "--puzzle-file", str(csv_file), f"--out={out_file}"],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout
    result = json.loads(out_file.read_text())
    assert len(result["puzzles"]) == final["count"] == 40
    assert result["exact_accuracy"] == pytest.approx(final["exact_accuracy"])
    assert f"exact accuracy {final['exact_accuracy']:.4f} ({round(40 * final['exact_accuracy'])} of 40)" in said
    assert all(1 <= p["act_steps"] <= 4 and 0 < p["q_halt_confidence"] < 1 for p in result["puzzles"])
    # Cell by cell (the evaluation's token accuracy), and q_halt of the last ACT step (its q_halt accuracy).
    cells = [np.mean([a == b for a, b in zip(p["answer"], digits(labels))])
             for p, labels in zip(result["puzzles"], test_set.labels)]
    assert np.mean(cells) == pytest.approx(final["accuracy"], rel=1e-5)
    q_right = [(p["q_halt_confidence"] >= 0.5) == p["correct"] for p in result["puzzles"]]
    assert np.mean(q_right) == pytest.approx(final["q_halt_accuracy"], rel=1e-5)
    first = result["puzzles"][0]
    assert (f"sudoku 1: halts at ACT step {first['act_steps']} of 4, q_halt confidence "
            f"{first['q_halt_confidence']:.4f}") in said
    given, answer = builders.puzzle_grid(first["puzzle"]), builders.puzzle_grid(first["answer"])
    assert f"  {given[:7]}   ->   {answer[:7]}\n  {given[8:15]}        {answer[8:15]}\n" in said

    # Bare lines (no answers) after a puzzle on the command line: the same answers, checked here
    # against the test labels; and a new puzzle (identifier 0: any puzzle works) on its own.
    plain = predict.predict_command(["demo", "--init-from", str(run_dir), "--puzzle",
                                     digits(test_set.inputs[0]).replace("0", "."), "--puzzle-file", str(lines_file)])
    assert len(plain["puzzles"]) == 40
    same = ("answer", "act_steps", "q_halt_confidence")  # the puzzles are spelt with '.' here, '0' there
    assert [[p[k] for k in same] for p in plain["puzzles"]] == [[p[k] for k in same] for p in result["puzzles"]]
    solved = sum(p["answer"] == digits(a) for p, a in zip(plain["puzzles"], test_set.labels))
    assert solved == round(40 * final["exact_accuracy"])
    new = predict.predict_command(["demo", "--init-from", str(run_dir), "--puzzle", "1.3..4....2.2..."])
    assert len(new["puzzles"]) == 1 and len(new["puzzles"][0]["answer"]) == 16  # '.': a predicted blank


def test_act_steps_used_is_the_first_step_whose_q_halt_logit_is_positive():
    logits = np.array([[-1.0, 0.5, 2.0, 3.0], [-1.0, -2.0, -0.1, -3.0], [0.0, 1e-3, -1.0, 1.0]])
    assert predict.act_steps_used(logits).tolist() == [2, 4, 2]


def test_predict_of_arc_tasks_equals_the_checkpoints_submission(tmp_path, capsys):
    arc_path = str(tmp_path / "arc")
    build_arc(arc_path, arc_files(str(tmp_path)), subsets=("training", "evaluation"),
                         test_sets=("evaluation",), num_aug=3, seed=0)
    # Batch 8: the evaluation's batch holds the test split's 8 rows, as predict's does (one row per
    # device): the same computation, so even candidates tied on votes rank alike (by mean q_halt).
    run_dir = tmp_path / "run"
    train.main(parse_config(["arc1", "--data.path", arc_path, "--optim.lr-warmup-steps", "1",
                          *small(run_dir, tmp_path / "cache", "--optim.max-steps", "2"),
                          "--optim.global-batch-size", "8", *TINY_ARC]))
    with open(run_dir / "eval" / "step_2" / "submission.json") as f:
        submission = json.load(f)
    capsys.readouterr()
    args = ["arc1", "--init-from", str(run_dir), "--data.path", arc_path, "--data.cache-dir", str(tmp_path / "cache")]
    result = predict.predict_command([*args, "--task", "task_e", "--out", str(tmp_path / "arc.json")])
    assert result["submission"] == {"task_e": submission["task_e"]}
    assert json.loads((tmp_path / "arc.json").read_text())["submission"] == result["submission"]
    said = capsys.readouterr().out
    assert "task_e, test input 1: " in said and "attempt_2: " in said
    for entry in result["details"]["task_e"]:
        assert entry["attempt_1"]["votes"] >= 1 and 1 <= entry["attempt_1"]["act_steps"] <= 2

    with pytest.raises(SystemExit, match="task_zzz not in the test split of .*embeddings of its augmentations "
                                         "were never trained.*Fine-tuning on new puzzles"):
        predict.predict_command([*args, "--task", "task_zzz"])
    with pytest.raises(SystemExit, match="task_a of .* has no test inputs in its test split .*e.g. task_e"):
        predict.predict_command([*args, "--task", "task_a"])


def test_predict_help_and_refusals(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.command_line(["predict", "--help"])
    assert exit_info.value.code == 0
    said = capsys.readouterr().out
    assert all(name in said for name in ("--init-from", "--puzzle", "--puzzle-file", "--task", "--out"))
    assert "predict" in usage()
    with pytest.raises(SystemExit, match="predict needs puzzles"):
        predict.predict_command(["--init-from", "runs/nothing"])
    with pytest.raises(SystemExit, match="--puzzle-file nothing.txt not found"):
        predict.read_puzzle_lines("nothing.txt")
    with pytest.raises(SystemExit, match="not both"):
        predict.predict_command(["--init-from", "runs/nothing", "--task", "a", "--puzzle", "1234"])
    with pytest.raises(build_data.DatasetError, match="neither a Sudoku .* nor a maze"):
        builders.encode_puzzles(["12x4"], 4, 4)
    with pytest.raises(build_data.DatasetError, match="has 3 cells but the model reads 16"):
        builders.encode_puzzles(["123"], 16, 6)
    kind, tokens = builders.encode_puzzles(["S  #", "#oG "], 4, 6)
    assert kind == "maze" and builders.puzzle_string(kind, tokens[1]) == "#oG "
