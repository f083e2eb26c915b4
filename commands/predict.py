"""`python train.py predict`: a trained model's answers to given puzzles (Sudoku and Maze strings
or files, ARC tasks of a dataset's test split), the ACT step where it would halt and its q_halt
confidence; run by evaluate() itself, so that the answers are the evaluation's.

    python train.py predict demo --init-from runs/demo --puzzle 1.3..4....2.2...
    python train.py predict arc1 --init-from gs://BUCKET/runs/NAME --data.path gs://BUCKET/data/arc1 \\
        --task 00576224 --out answers.json
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
import tyro

import data
from commands.restore import load_weights_for_eval
from commands.weights_flags import WeightsCommand, parse_weights_command
from data import EvalBatches
from puzzles import builders
from puzzles.arc import Q_SCALE, ArcEvaluator, grid_key, parse_arc_identifier, sigmoid
from rundir import storage
from testtime import batches as testtime_batches
from testtime import noisy_trajectories
from testtime import settings as testtime_settings
from training import compile_cache
from training.config import PRESETS, Config, ConfigError, check_batch_layout, check_config
from training.evaluate import evaluate
from training.lifecycle import start
from training.trainer import Trainer


@dataclass
class PredictCommand(WeightsCommand):
    """The flags of `train.py predict`: the weights, the puzzles, then any setting of the
    training configuration (they override what the weights' run used)."""

    puzzle: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """A Sudoku or maze (repeatable), written as the builders read it from their CSV: a Sudoku as
    its n*n digits row by row, '.' or '0' for blanks; a maze as its cells in the characters '# SGo'."""
    puzzle_file: str | None = None
    """A file of such puzzles, one per line; or a CSV with the builders' header
    (source,question,answer,rating), whose answers are then checked."""
    task: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """An ARC task of the test split of --data.path (repeatable; its augmentations' embeddings
    were trained): the two attempts voted over the augmentations the dataset holds."""
    out: str | None = None
    """Also write the predictions as JSON to this file (local or gs://)."""


def parse_predict_command(argv: list[str]) -> tuple[str, PredictCommand, list[str]]:
    """parse_weights_command for `train.py predict`, which also needs puzzles."""
    preset, parsed, overrides = parse_weights_command("predict", argv, "Print " + " ".join(
        predict_command.__doc__.split(":", 1)[1].split()).removeprefix("print "), PredictCommand)
    if not (parsed.puzzle or parsed.puzzle_file or parsed.task):
        raise SystemExit("error: predict needs puzzles: --puzzle STRING, --puzzle-file FILE (Sudoku, Maze) "
                         "or --task NAME (ARC)")
    if parsed.task and (parsed.puzzle or parsed.puzzle_file):
        raise SystemExit("error: predict takes either --task (ARC) or --puzzle / --puzzle-file (Sudoku, "
                         "Maze), not both")
    return preset, parsed, overrides


def read_puzzle_lines(url: str) -> tuple[list[str], list[str] | None]:
    """(puzzles, answers or None) of a --puzzle-file: one puzzle per line, or a CSV with the
    builders' header source,question,answer,rating (read as the builders read it)."""
    if not storage.exists(url):
        raise SystemExit(f"error: --puzzle-file {url} not found")
    text = storage.read_bytes(url).decode()
    if text.lstrip().lower().startswith("source,question,answer,rating"):
        try:
            return builders.read_puzzle_csv(url)
        except data.DatasetError as e:
            raise SystemExit(f"error: {e}")
    return [line.rstrip("\r") for line in text.split("\n") if line.strip("\r")], None


def _in_memory_split(url: str, metadata: data.Metadata, inputs, labels, identifiers) -> data.Dataset:
    """One example per puzzle, in the given order, as EvalBatches reads a split."""
    count = len(inputs)
    return data.Dataset(url, "predict", metadata, inputs, labels, np.asarray(identifiers, np.int32),
                        np.arange(count + 1), np.arange(count + 1), 0)


def _predict_runtime(config: Config):
    """The runtime for puzzles that need no dataset (Sudoku, Maze): the checks of start() that
    apply, on one host."""
    try:
        check_config(config)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    import sharding  # brings torch_xla: after the checks

    device_kind = sharding.start_runtime(config.run.device, config.run.cpu_devices,
                                         compile_cache.local_dir(config.run))
    return sharding, device_kind


def _predict_batches(split: data.Dataset, config: Config, sharding, k: int = 1):
    """The puzzles in batches of at most optim.global_batch_size rows, the last padded to a
    multiple of the device count (as evaluation pads its last batch); with K trajectories
    (testtime/noisy_trajectories.py), each puzzle's row K times in a row, then padding rows (testtime/batches.py)."""
    num_devices, _ = sharding.device_counts()
    if sharding.process_count() > 1:
        raise SystemExit("error: predict runs on one host (a CPU or one TPU VM, e.g. a v4-8), not on a "
                         f"slice of {sharding.process_count()} hosts")
    rows = min(config.optim.global_batch_size, -(-split.num_examples * k // num_devices) * num_devices)
    try:
        check_batch_layout(rows, num_devices, 1)
        testtime_batches.host_puzzles(rows, k, 1)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    return testtime_batches.eval_batches(split, rows, k), rows


def run_predictions(trainer: Trainer, batches: EvalBatches, sync, arc=None):
    """(predicted tokens [examples, seq_len] after all halt_max_steps ACT steps, q_halt logits
    [examples, halt_max_steps] of every step) of every real example: evaluate() itself (the EMA
    weights, the same ACT steps; `arc`, an ArcEvaluator, gets the votes), which reads these
    outputs after each ACT step."""
    local_rows = trainer.sharding.local_rows
    tokens, logits, steps = [], [], []
    trajectories = trainer.trajectories

    def read(index, host_batch, preds, q_halt):
        rows = len(host_batch["inputs"])  # each puzzle's first row (its best-Q answer)
        every = slice(None) if trajectories is None else trajectories.host_puzzle_rows(rows)
        steps.append(local_rows(q_halt)[1].float().numpy()[every])
        if len(steps) == trainer.eval_steps:  # the batch's last ACT step
            valid = batches.valid(index)[every]
            tokens.append(local_rows(preds)[1].numpy()[every][valid])
            logits.append(np.stack(steps, axis=1)[valid])
            steps.clear()

    evaluate(trainer, batches, sync, arc, each_act_step=read)
    return np.concatenate(tokens), np.concatenate(logits)


def act_steps_used(q_halt_logits):
    """Per row of [rows, halt_max_steps] q_halt logits: the first ACT step (from 1) whose logit is
    above 0, where training would halt; halt_max_steps when none is."""
    halts = q_halt_logits > 0
    return np.where(halts.any(axis=1), halts.argmax(axis=1) + 1, q_halt_logits.shape[1])


def _model_for_predict(config: Config, weights: dict, sharding, split: data.Dataset):
    ks = testtime_settings.parse_trajectories(config.eval.trajectories)
    noises = testtime_settings.parse_noises(config.eval.noise)
    if len(ks) > 1 or len(noises) > 1:
        raise SystemExit(f"error: predict takes one --eval.trajectories K and one --eval.noise, got "
                         f"{config.eval.trajectories!r} and {config.eval.noise!r} (a curve is `train.py eval`'s)")
    batches, rows = _predict_batches(split, config, sharding, ks[0])
    mesh = sharding.data_mesh()
    trainer = Trainer(config, sharding, mesh, weights)
    setting = testtime_settings.Setting(ks[0], noises[0],
                                        testtime_settings.act_steps_of(config.eval, config.model.halt_max_steps),
                               config.eval.noise_latent)
    noisy_trajectories.set_evaluation(trainer, setting, rows)
    if trainer.trajectories is not None:
        print(f"test-time scaling: {ks[0]} trajectories per puzzle, noise {noises[0]:g} on {setting.latent}; each "
              "answer is its puzzle's best-Q trajectory (the halting rule's highest score)", flush=True)
    trainer.init_carries(sharding.host_batch_to_global(batches.batch(0), mesh))
    sharding.sync()
    return trainer, batches


def predict_puzzles(config: Config, weights: dict, source: str, strings: list[str],
                    answers: list[str] | None, where: str) -> dict:
    """Sudoku / Maze: the model's answer to each puzzle string (identifier 0, the blank)."""
    try:
        kind, inputs = builders.encode_puzzles(strings, config.model.seq_len, config.model.vocab_size, where)
        labels = (builders.encode_puzzles(answers, config.model.seq_len, config.model.vocab_size, where)[1]
                  if answers else np.zeros_like(inputs))
    except data.DatasetError as e:
        raise SystemExit(f"error: {e}")
    sharding, device_kind = _predict_runtime(config)
    metadata = data.Metadata(pad_id=0, ignore_label_id=0, blank_identifier_id=0,
                             vocab_size=config.model.vocab_size, seq_len=config.model.seq_len,
                             num_puzzle_identifiers=config.model.num_puzzle_identifiers,
                             total_groups=len(inputs), mean_puzzle_examples=1.0, total_puzzles=len(inputs),
                             sets=("all",))
    split = _in_memory_split(where, metadata, inputs, labels, np.zeros(len(inputs)))
    trainer, batches = _model_for_predict(config, weights, sharding, split)
    print(f"predicting {len(strings)} {kind}(s) with {source} on {device_kind} "
          f"({trainer.eval_steps} ACT steps)", flush=True)
    tokens, q_halt = run_predictions(trainer, batches, sharding.sync)
    used = act_steps_used(q_halt)
    puzzles = []
    for i, text in enumerate(strings):
        answer = builders.puzzle_string(kind, tokens[i])
        entry = {"puzzle": text, "answer": answer, "act_steps": int(used[i]),
                 "q_halt_confidence": float(sigmoid(q_halt[i, -1]))}
        if answers:
            entry["correct"] = answer == builders.puzzle_string(kind, labels[i])
        puzzles.append(entry)
        verdict = "" if not answers else ("; correct" if entry["correct"] else "; WRONG")
        print(f"{kind} {i + 1}: halts at ACT step {entry['act_steps']} of {trainer.eval_steps}, "
              f"q_halt confidence {entry['q_halt_confidence']:.4f}{verdict}")
        rows = zip(builders.puzzle_grid(text).split("\n"), builders.puzzle_grid(answer).split("\n"))
        print("\n".join(f"  {given}   {'->' if r == 0 else '  '}   {found}" for r, (given, found) in enumerate(rows)))
    result = {"weights": source, "kind": kind, "halt_max_steps": config.model.halt_max_steps, "puzzles": puzzles}
    if answers:
        result["exact_accuracy"] = sum(p["correct"] for p in puzzles) / len(puzzles)
        print(f"exact accuracy {result['exact_accuracy']:.4f} ({sum(p['correct'] for p in puzzles)} of "
              f"{len(puzzles)})")
    return result


def predict_arc_tasks(config: Config, weights: dict, step: int, trained_on: str | None, source: str,
                      tasks: list[str]) -> dict:
    """ARC: each task's two attempts, voted over the augmentations of its test inputs that the
    dataset's test split holds, as the evaluation's submission.json gives them for these weights
    (one evaluation's votes, as `eval --eval.no-arc-aggregate`)."""
    table = weights.get("model/puzzle_embedding.weight")
    config, _, test_set, sharding, device_kind, _ = start(config, None if table is None else table.shape[0],
                                                          trained_on, source)
    try:
        arc = ArcEvaluator.from_dataset(config.data.path)
    except data.DatasetError as e:
        raise SystemExit(f"error: --task needs an ARC dataset (built by `build_data.py build-arc`): {e}")
    trained_only = sorted({parse_arc_identifier(name)[0] for name in arc.identifiers} & set(tasks)
                          - set(arc.test_puzzles))
    if trained_only:
        raise SystemExit(f"error: {', '.join(trained_only)} of {config.data.path} has no test inputs in its test "
                         "split (a task of the training subsets: its test pairs were trained on); name tasks of "
                         f"the test split, e.g. {', '.join(sorted(arc.test_puzzles)[:3])}")
    unknown = [t for t in tasks if t not in arc.test_puzzles]
    if unknown:
        raise SystemExit(
            f"error: {', '.join(unknown)} not in the test split of {config.data.path}: the puzzle embeddings of "
            "its augmentations were never trained, so this model cannot answer it. Build a dataset with the "
            "task's demonstration pairs in its train split (`python build_data.py build-arc`), fine-tune on it "
            "with --run.init-from (README, \"Fine-tuning on new puzzles\"), then predict with that run and "
            "dataset")
    # The test rows of the tasks, in the dataset's order.
    wanted = set(tasks)
    blank = test_set.metadata.blank_identifier_id
    puzzles = np.array([p for p, i in enumerate(test_set.puzzle_identifiers)
                        if i != blank and parse_arc_identifier(arc.identifiers[i])[0] in wanted], dtype=np.int64)
    examples = np.concatenate([np.arange(test_set.puzzle_indices[p], test_set.puzzle_indices[p + 1])
                               for p in puzzles])
    identifiers = np.repeat(test_set.puzzle_identifiers[puzzles], np.diff(test_set.puzzle_indices)[puzzles])
    split = _in_memory_split(test_set.url, test_set.metadata, test_set.inputs[examples],
                             test_set.labels[examples], identifiers)
    trainer, batches = _model_for_predict(config, weights, sharding, split)
    print(f"predicting {len(tasks)} ARC task(s) with {source} (step {step}) on {device_kind}: {len(examples)} "
          f"augmented test inputs of {config.data.path}, {trainer.eval_steps} ACT steps", flush=True)
    arc.begin()
    tokens, q_halt = run_predictions(trainer, batches, sharding.sync, arc)
    votes = arc.summary()
    submission = arc.submission(votes)
    used = act_steps_used(q_halt)
    steps_of = {}  # (task, input key, candidate key) -> ACT steps of the rows that voted for it
    for row in range(len(tokens)):
        task, grid = arc.original_grid(split.inputs[row], identifiers[row])
        _, answer = arc.original_grid(tokens[row], identifiers[row])
        steps_of.setdefault((task, grid_key(grid), grid_key(answer)), []).append(int(used[row]))
    details = {}
    for task in tasks:
        details[task] = []
        for number, (pair, attempts) in enumerate(zip(arc.test_puzzles[task]["test"], submission[task]), start=1):
            input_key = grid_key(np.array(pair["input"]))
            candidates = votes["votes"].get((task, input_key), {})
            print(f"{task}, test input {number}: {sum(c for c, _ in candidates.values())} augmentations voted "
                  f"for {len(candidates)} distinct answers")
            entry = {}
            for name, grid in attempts.items():
                key = grid_key(np.array(grid))
                count, q_sum = candidates.get(key, (0, 0))
                steps = steps_of.get((task, input_key, key), [])
                entry[name] = {"votes": count, "q_halt_confidence": q_sum / Q_SCALE / count if count else None,
                               "act_steps": sum(steps) / len(steps) if steps else None}
                confidence = f"{entry[name]['q_halt_confidence']:.4f}" if count else "-"
                act = f"{entry[name]['act_steps']:.2f}" if steps else "-"
                print(f"  {name}: {count} votes, q_halt confidence {confidence}, ACT steps {act} (mean)")
                print("\n".join("    " + " ".join(map(str, line)) for line in grid))
            details[task].append(entry)
    return {"weights": source, "step": step, "dataset": config.data.path,
            "halt_max_steps": config.model.halt_max_steps,
            "submission": {task: submission[task] for task in tasks}, "details": details}


def predict_command(argv: list[str]) -> dict:
    """`python train.py predict [PRESET] --init-from URL (--puzzle P | --puzzle-file FILE | --task NAME)
    [--out FILE.json] [overrides]`: print the model's answer to each puzzle, the ACT step at which
    it halts and its q_halt confidence; --out also writes them as JSON.

    The weights run exactly halt_max_steps ACT steps, as in evaluation, and the answer is the
    prediction after the last; "halts at ACT step k" is the first step whose q_halt logit is
    above 0 (where training would stop; halt_max_steps if none), the confidence sigmoid of the
    last q_halt logit. Sudoku and Maze puzzles take the blank identifier, so any new puzzle works;
    an ARC task must be in the test split of --data.path (its augmentations' embeddings were
    trained) and its answer is the two attempts voted over them, as in submission.json."""
    preset, flags, overrides = parse_predict_command(argv)
    for what, value in (("--init-from", flags.init_from), ("--out", flags.out), ("--puzzle-file", flags.puzzle_file)):
        try:
            if value is not None:
                storage.check_url(value, what)
        except storage.StorageError as e:
            raise SystemExit(f"error: {e}")
    config, weights, step, trained_on = load_weights_for_eval(flags.init_from, PRESETS[preset][1], overrides)
    if flags.task:
        result = predict_arc_tasks(config, weights, step, trained_on, flags.init_from, list(flags.task))
    else:
        strings, answers = list(flags.puzzle), None
        if flags.puzzle_file:
            from_file, answers = read_puzzle_lines(flags.puzzle_file)
            answers = None if answers is None or flags.puzzle else answers
            strings += from_file
        result = predict_puzzles(config, weights, flags.init_from, strings, answers,
                                 flags.puzzle_file or "--puzzle")
    if flags.out:
        storage.write_bytes(flags.out, json.dumps(result, indent=2).encode())
        print(f"wrote {flags.out}", flush=True)
    return result
