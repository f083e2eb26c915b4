"""training/halt_steps.py, modeling/schemes.py and the curriculum (schedule.Curriculum): the halting-step
distribution of an evaluation, the annealed halting exploration, and the recursion curriculum's
stages and resume."""
import dataclasses
import math
import os
import re
import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import data
import model
import train
from commands.eval_command import evaluate_command
from data import EvalBatches
from training import halt_steps
from training.config import PRESETS, parse_config
from training.schedule import Curriculum, resolve_anneal


def test_first_halt_buckets_exploration_anneal_and_curriculum_stages_are_their_closed_forms():
    # Row r first says halt at step r % 5 (0: never) of 4 ACT steps, and keeps saying it after;
    # row 7 has no labels (padding) and is not counted.
    steps_max, rows = 4, 10
    first = torch.arange(rows) % (steps_max + 1)
    labels = torch.ones(rows, 3, dtype=torch.int64)
    labels[7] = model.IGNORE_LABEL_ID
    counted = [r for r in range(rows) if r != 7]
    expected = [sum(1 for r in counted if first[r] == s) for s in (1, 2, 3, 4, 0)]
    # no_ACT_continue: q_halt > 0; with Q-continue: q_halt > q_continue (here q_continue 0.5, so
    # q_halt 0.4 is above 0 but below q_continue, and 0.6 is above both). Each rule on its own.
    for no_act_continue, says_value, quiet_value in ((True, 1.0, -1.0), (False, 0.6, 0.4)):
        tracked, total = torch.zeros(rows, dtype=torch.int32), torch.zeros(steps_max + 1)
        for step in range(1, steps_max + 1):
            carry = types_carry(step, steps_max, labels)
            says = (first > 0) & (first <= step)
            outputs = {"q_halt_logits": torch.where(says, says_value, quiet_value),
                       "q_continue_logits": torch.full((rows,), 0.5)}
            rule = model.TRMConfig(no_ACT_continue=no_act_continue).halt_score
            tracked, counts = halt_steps.first_halt_counts(tracked, carry, outputs, steps_max, rule)
            total = total + counts
        assert total.tolist() == expected == [2, 1, 2, 2, 2], no_act_continue
    # The other rule on the Q-continue logits reads 0.4 as halt: every counted row at step 1.
    tracked = torch.zeros(rows, dtype=torch.int32)
    wrong = torch.zeros(steps_max + 1)
    for step in range(1, steps_max + 1):
        says = (first > 0) & (first <= step)
        outputs = {"q_halt_logits": torch.where(says, 0.6, 0.4), "q_continue_logits": torch.full((rows,), 0.5)}
        tracked, counts = halt_steps.first_halt_counts(tracked, types_carry(step, steps_max, labels), outputs,
                                                       steps_max, model.TRMConfig(no_ACT_continue=True).halt_score)
        wrong = wrong + counts
    assert wrong.tolist() == [9, 0, 0, 0, 0]
    result = dict(zip(halt_steps.metric_names(steps_max), (total / len(counted)).tolist()), count=len(counted))
    halt_steps.with_mean_halt_step(result, steps_max)
    assert result["mean_halt_step"] == pytest.approx((1 * 2 + 2 + 3 * 2 + 4 * 2 + 4 * 2) / 9)
    hist = halt_steps.histogram(result)
    assert hist["bucket_counts"] == pytest.approx([2, 1, 2, 4]) and hist["num"] == pytest.approx(9)

    # The anneal through the model's training step: with the Q head always saying halt, a row
    # stays unhalted after its first step exactly when it explores (min steps >= 2), i.e. when its
    # hashed draw is below start + (final - start) * min(step / span, 1) at step counter + 1.
    config = model.TRMConfig(seq_len=4, vocab_size=5, hidden_size=16, num_heads=2, L_layers=1, H_cycles=1,
                             L_cycles=1, puzzle_emb_ndim=0, halt_max_steps=4, forward_dtype="float32",
                             halt_exploration_prob=0.9, halt_exploration_final=0.1, halt_exploration_anneal_steps=5)
    trm = model.TRM(config, exploration_seed=3).train()
    with torch.no_grad():
        trm.q_head.bias.copy_(torch.tensor([5.0, -5.0]))
    batch = {"inputs": torch.ones(512, 4, dtype=torch.int32), "labels": torch.ones(512, 4, dtype=torch.int32),
             "puzzle_identifiers": torch.zeros(512, dtype=torch.int32)}
    rows_ = torch.arange(512)
    for counter in (0, 2, 4, 9):
        carry = dataclasses.replace(trm.initial_carry(batch), rng_counter=torch.tensor(counter))
        with torch.no_grad():
            new_carry, _ = trm(carry, batch)
        prob = 0.9 + (0.1 - 0.9) * min((counter + 1) / 5, 1.0)
        explores = model.hashed_uniform(3, torch.tensor(counter), rows_, 0) < prob
        assert torch.equal(~new_carry.halted, explores), counter
        assert abs(explores.float().mean().item() - prob) < 0.1
    # 0: over the run's optim.epochs, whatever max_steps says
    resolved = resolve_anneal(dataclasses.replace(PRESETS["demo"][1], model=config), 1250)
    assert resolved.model.halt_exploration_anneal_steps == 5
    unresolved = dataclasses.replace(config, halt_exploration_anneal_steps=0)
    resolved = resolve_anneal(dataclasses.replace(PRESETS["demo"][1], model=unresolved), 1250)
    assert resolved.model.halt_exploration_anneal_steps == 1250

    # The seeds' contrib01 on sudoku-mlp: int(start + progress * (end - start)) with progress the
    # epochs done / 10,000, over a 50,000-epoch run of 65,104 steps.
    recipe = parse_config(["sudoku-mlp", "--optim.curriculum-epochs", "10000"])
    curriculum = Curriculum(recipe, 65104)
    for step in (1, 2, 3256, 3257, 6511, 6512, 9766, 9767, 13021, 13022, 65104):
        progress = min((step - 1) * 50000 / 65104 / 10000, 1.0)
        assert curriculum.at(step) == (int(1 + progress * 2), int(2 + progress * 4)), step
    assert curriculum.stages(65104) == [(1, (1, 2)), (3257, (1, 3)), (6512, (2, 4)), (9767, (2, 5)),
                                        (13022, (3, 6))]
    assert curriculum.stages(5000) == curriculum.stages(65104)[:2]
    assert Curriculum(parse_config(["sudoku-mlp"]), 65104).stages(65104) == [(1, (3, 6))]


def types_carry(step: int, steps_max: int, labels: torch.Tensor):
    """The eval carry of an ACT step: every row at `step`, halted at the last one."""
    rows = labels.shape[0]
    return model.Carry(z_H=torch.zeros(rows), z_L=torch.zeros(rows), steps=torch.full((rows,), step, dtype=torch.int32),
                       halted=torch.full((rows,), step >= steps_max), current_data={"labels": labels},
                       rng_counter=torch.tensor(0))


def demo_args(demo_path, tmp_path, run, *extra):
    """A float32 demo run (hidden 32, L_cycles 3) with a curriculum from L_cycles 2 (step 5 on:
    the dataset's 156 steps of 200 epochs, 5 curriculum epochs) and an annealed exploration."""
    return ["demo", "--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache"), "--run.dir",
            str(tmp_path / run), "--model.hidden-size", "32", "--model.puzzle-emb-ndim", "32", "--model.L-cycles", "3",
            "--model.forward-dtype", "float32", "--optim.curriculum-epochs", "5", "--optim.curriculum-start-H-cycles",
            "2", "--optim.curriculum-start-L-cycles", "2", "--model.halt-exploration-prob", "0.6",
            "--model.halt-exploration-final", "0.1", "--model.halt-exploration-anneal-steps", "6",
            "--run.log-every", "1", "--eval.every-epochs", "1000", "--optim.lr-warmup-steps", "1", *extra]


def test_a_resume_across_a_curriculum_stage_equals_the_uninterrupted_run_and_halting_is_reported(
        demo_path, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    straight = train.main(parse_config(demo_args(demo_path, tmp_path, "straight", "--optim.max-steps", "6")))
    out = capsys.readouterr().out
    assert "recursion curriculum: H_cycles 2 L_cycles 2 from step 1, H_cycles 2 L_cycles 3 from step 5" in out
    first = train.main(parse_config(demo_args(demo_path, tmp_path, "resumed", "--optim.max-steps", "3")))
    resumed = train.main(parse_config(demo_args(demo_path, tmp_path, "resumed", "--optim.max-steps", "6")))
    assert resumed["start_step"] == 3
    assert [h["loss"] for h in first["history"] + resumed["history"]] == [h["loss"] for h in straight["history"]]
    assert resumed["final"] == straight["final"]

    # The distribution: fractions of the counted puzzles over steps 1..4 and never, and its mean.
    final = straight["final"]
    fractions = [final[name] for name in halt_steps.metric_names(4)]
    assert sum(fractions) == pytest.approx(1.0) and final["count"] == 40
    assert final["mean_halt_step"] == pytest.approx(sum(s * f for s, f in zip((1, 2, 3, 4, 4), fractions)))
    events = EventAccumulator(str(tmp_path / "straight" / "tb"), size_guidance={"histograms": 0}).Reload()
    (histogram,) = events.Histograms("eval/halt_step")
    assert histogram.step == 6 and histogram.histogram_value.num == 40
    assert list(histogram.histogram_value.bucket) == pytest.approx(
        [40 * f for f in fractions[:3]] + [40 * (fractions[3] + fractions[4])])
    assert "eval/mean_halt_step" in events.Tags()["scalars"] and "eval/halted_at_1" not in events.Tags()["scalars"]

    # A Q head whose q_halt changes sign across rows and steps: the captured evaluation on the
    # 8-device mesh counts what an eager CPU run of the same weights says, row by row.
    exported = str(tmp_path / "model.safetensors")
    train.command_line(["export", str(tmp_path / "straight"), "--out", exported])
    weights = load_file(exported)
    generator = torch.Generator().manual_seed(0)
    weights["q_head.weight"] = torch.randn(weights["q_head.weight"].shape, generator=generator) * 3
    weights["q_head.bias"] = torch.tensor([0.0, -5.0])
    with safe_open(exported, "pt") as f:
        metadata = f.metadata()  # the model's config, which eval reads
    save_file(weights, exported, metadata=metadata)
    result = evaluate_command(["--init-from", exported, "--data.path", demo_path, "--data.cache-dir",
                               str(tmp_path / "cache"), "--run.dir", str(tmp_path / "eval"), "--model.hidden-size",
                               "32", "--model.puzzle-emb-ndim", "32", "--model.L-cycles", "3",
                               "--model.forward-dtype", "float32"])
    config = parse_config(demo_args(demo_path, tmp_path, "x")).model
    trm = model.TRM(dataclasses.replace(config, num_puzzle_identifiers=weights["puzzle_embedding.weight"].shape[0]))
    trm.load_state_dict(weights)
    batches = EvalBatches(data.open_dataset(demo_path, "test"), 128)
    batch = {k: torch.from_numpy(v) for k, v in batches.batch(0).items()}
    first_halt = torch.zeros(128, dtype=torch.int64)
    with torch.no_grad():
        carry = trm.eval().initial_carry(batch)
        for step in range(1, 5):
            carry, outputs = trm(carry, batch)
            first_halt = torch.where((first_halt == 0) & (outputs["q_halt_logits"] > 0), step, first_halt)
    real = first_halt[torch.from_numpy(batches.valid(0))]
    by_hand = [(real == s).float().mean().item() for s in (1, 2, 3, 4, 0)]
    assert [result[name] for name in halt_steps.metric_names(4)] == pytest.approx(by_hand, abs=1e-6)
    assert sum(1 for f in by_hand if f > 0) >= 2, by_hand  # the case tests something
    assert not math.isnan(result["mean_halt_step"])


def test_the_paper_ablations_study_plans_before_its_datasets_exist_with_the_papers_numbers(tmp_path, monkeypatch,
                                                                                          capsys):
    """studies/paper-ablations.txt: 19 configurations, 53 runs, each Sudoku and Maze one over 3
    seeds, every @paper line naming one of them; `plan` prints every run without any dataset."""
    import study
    from fleet import report as study_report
    from fleet.plan import StudyError, declared_papers, parse_study

    monkeypatch.setenv("TRM_BUCKET", "my-bucket")
    text = open(os.path.join(os.path.dirname(__file__), "..", "studies", "paper-ablations.txt")).read()
    papers = declared_papers(text)
    assert papers["trm"] == 87.4 and papers["hrm"] == 55.0 and papers["hrm-arc1"] == 40.3 and len(papers) == 15
    expected = (53, 19)
    path = tmp_path / "paper-ablations.txt"
    path.write_text(text)
    assert study.main(["plan", str(path), "--slice", "v4-8", "--mfu", "0.4"]) == 0
    out = capsys.readouterr().out
    assert f"{expected[0]} runs of {expected[1]} configurations" in out
    names = [line.split()[0] for line in out.splitlines() if re.match(r"[a-zA-Z0-9-]+-s\d ", line)]
    assert len(names) == expected[0] and {n.rsplit("-", 1)[0] for n in names} >= set(declared_papers(text))
    assert sum(n.startswith("trm-arc1") for n in names) == 1 and sum(n.startswith("trm-s") for n in names) == 3

    with pytest.raises(StudyError, match=r"line 3: expected @paper CONFIGURATION PERCENT .*\n"
                                         r"s:line 2: @paper b: no configuration of that name \(configurations: a\)"):
        parse_study("a demo --seeds 2\n@paper b 50\n@paper a 150\n", "s")

    # The report's configuration rows carry the paper's number and the runs' mean halting step.
    run = types.SimpleNamespace(final={"exact_accuracy": 0.8, "mean_halt_step": 6.0})
    config = {"configuration": "trm", "runs": 2, "seeds": 2, "preset": "sudoku-mlp", "varied": {}, "parameters": 1,
              "mean": 0.8, "low": None, "high": None, "min": 0.8, "max": 0.8,
              "results": [run, types.SimpleNamespace(final={"exact_accuracy": 0.8, "mean_halt_step": 9.0})]}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "study.txt").write_text(text)
    (row,) = study_report.configuration_rows([config], study_report.study_papers(str(tmp_path / "out")))
    assert row["paper_%"] == 87.4 and row["mean_halt_step"] == 7.5 and row["mean_exact_%"] == "80.00"
