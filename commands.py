"""The commands besides training, reached from train.py's command line: `eval` (weights on a
test split), `export` (a run's EMA weights as one safetensors file), and the flag parsing that
`eval` and `predict` share (the weights, then any training setting on top of theirs).

    python train.py eval --init-from gs://BUCKET/runs/NAME --data.path gs://BUCKET/data/...
    python train.py export gs://BUCKET/runs/NAME --out gs://BUCKET/models/NAME.safetensors
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro

import checkpoint
import ptrm
import storage
from arc import ArcEvaluator, write_submission
from batches import EvalBatches
from config import PRESETS, Config, presets_for
from evaluate import evaluate
from lifecycle import check_devices, start
from restore import load_weights_for_eval
from trainer import Trainer


@dataclass
class ExportCommand:
    """Write the EMA weights of a checkpoint as one model.safetensors (config in its metadata)."""

    source: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="SOURCE")]
    """A run directory (its newest readable committed checkpoint) or one checkpoint directory."""
    out: str
    """Where to write, local or gs:// (gs://BUCKET/models/sudoku.safetensors; a directory with --format reference)."""
    format: Literal["ours", "reference"] = "ours"
    """ours: one model.safetensors; reference: a model directory that the reference's code runs too."""


def export_command(argv: list[str]) -> None:
    """`python train.py export SOURCE --out URL [--format reference]`."""
    flags = tyro.cli(ExportCommand, args=argv, prog="train.py export")
    if flags.format == "reference":
        from reference_export import export_directory

        export_directory(flags.source, flags.out)
    else:
        export(flags.source, flags.out)


def export(source: str, out: str) -> None:
    """Write the EMA weights of `source` (ExportCommand) to `out`."""
    for what, value in (("the export source", source), ("--out", out)):
        try:
            storage.check_url(value, what)
        except storage.StorageError as e:
            raise SystemExit(f"error: {e}")
    try:
        found = checkpoint.weights_of(source)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    if found is None:
        raise SystemExit(f"error: {source} is not a run or checkpoint directory")
    weights, state, url = found
    checkpoint.export_model(weights, state, out)
    print(f"exported the EMA weights of {url} (step {state['step']}) to {out}", flush=True)


@dataclass
class WeightsCommand:
    """The flags of a command that runs given weights (eval): the weights, then any setting
    of the training configuration (they override what the weights' run used)."""

    init_from: Annotated[str, tyro.conf.arg(help_behavior_hint="(required)")]
    """The weights: a run directory (its newest readable checkpoint), a checkpoint directory, an exported model.safetensors or a reference checkpoint; local or gs://."""  # noqa: E501 (one line: tyro keeps line breaks)
    config: Annotated[Config, tyro.conf.arg(name="")] = field(default_factory=Config)


def parse_weights_command(command: str, argv: list[str], description: str,
                          flags: type[WeightsCommand] = WeightsCommand) -> tuple[str, WeightsCommand, list[str]]:
    """(preset, the command's own flags parsed, the configuration flags as typed) of
    `train.py COMMAND [PRESET] ...`; tyro checks every flag and prints `--help` (exit 0). The
    configuration flags are returned unparsed: they apply on top of the weights' own run
    configuration, not of the preset."""
    preset = argv[0] if argv and argv[0] in PRESETS else "sudoku-mlp"
    rest = argv[1:] if argv and argv[0] in PRESETS else argv
    parsed = tyro.cli(flags, args=rest, default=flags("", presets_for(rest)[preset][1]),
                      prog=f"train.py {command} [PRESET]", description=description)
    if not parsed.init_from:
        raise SystemExit(f"error: {command} needs --init-from URL (a run directory, checkpoint, exported "
                         "model.safetensors or reference checkpoint)")
    own = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(flags) if f.name != "config"}
    overrides, skip = [], False
    for arg in rest:  # every flag but the command's own (`--flag value` or `--flag=value`)
        name = arg.split("=", 1)[0].replace("_", "-")
        if skip:
            skip = False
        elif name in own:
            skip = "=" not in arg
        else:
            overrides.append(arg)
    return preset, parsed, overrides


def evaluate_command(argv: list[str]) -> dict:
    """`python train.py eval [PRESET] --init-from URL --data.path URL [overrides]`: evaluate a
    run directory / checkpoint, an exported model.safetensors or a reference checkpoint on a
    dataset's test split; prints and saves the metrics (and ARC scores) under
    {run.dir}/eval/step_N/."""
    preset, flags, args = parse_weights_command("eval", argv, "Evaluate " + " ".join(
        evaluate_command.__doc__.split(":", 1)[1].split()).removeprefix("evaluate "))
    source = flags.init_from
    try:
        storage.check_url(source, "--init-from")
    except storage.StorageError as e:
        raise SystemExit(f"error: {e}")
    config, weights, step, trained_on = load_weights_for_eval(source, PRESETS[preset][1], args)
    table = weights.get("model/puzzle_embedding.weight")
    config, _, test_set, sharding, device_kind, _ = start(config, None if table is None else table.shape[0],
                                                          trained_on, source)
    check_devices(sharding)
    data_index, data_count = sharding.data_split()
    say = print if sharding.is_main_process() else (lambda *a, **k: None)
    mesh = sharding.data_mesh()
    trainer = Trainer(config, sharding, mesh, weights)
    ks, noises = ptrm.parse_trajectories(config.eval.trajectories), ptrm.parse_noises(config.eval.noise)
    try:
        for k in ks:
            ptrm.puzzles_per_batch(config.optim.global_batch_size, k, data_count)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    batches = EvalBatches(test_set, config.optim.global_batch_size, process_index=data_index,
                               process_count=data_count,
                               max_examples=config.eval.max_examples, seed=config.run.seed)
    trainer.init_carries(sharding.host_batch_to_global(batches.batch(0), mesh))
    sharding.sync()
    say(f"evaluating {source} (step {step}) on {batches.num_examples} examples of {config.data.path} "
        f"on {device_kind} ({len(batches)} batches)", flush=True)
    started = time.time()
    arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None
    out = storage.join_url(config.run.dir, "eval", f"step_{step}")
    curve = None
    if ks == [1] and noises == [0.0]:  # the reference's evaluation
        result, submission = evaluate(trainer, batches, sharding.sync, arc, lambda *a: say(*a, flush=True),
                                      storage.join_url(config.run.dir, "eval"), step, config.eval.arc_aggregate)
    else:  # test-time scaling (ptrm.py): one evaluation per (K, noise); ARC votes are saved, not aggregated
        say(f"test-time scaling: K = {', '.join(map(str, ks))} trajectories per puzzle, noise "
            f"{', '.join(f'{n:g}' for n in noises)} on z_L", flush=True)
        curve, results = evaluate_at_trajectories(trainer, test_set, config, ks, noises, data_index, data_count,
                                                  arc, lambda *a, **k: say(*a, flush=True),
                                                  storage.join_url(config.run.dir, "eval"), step)
        result, submission = dict(results[-1], trajectories=curve), None
        say("accuracy against trajectories per puzzle (" + device_kind + "):\n" + ptrm.curve_table(curve),
            flush=True)
    if sharding.is_main_process():
        metrics = json.dumps(dict(result, source=source), indent=2).encode()
        storage.write_bytes(storage.join_url(out, "metrics.json"), metrics)
        if submission is not None:
            write_submission(out, submission)
        if curve is not None:
            saved = ptrm.write_curve(out, curve, f"{source} (step {step}) on {config.data.path}")
            say(f"curve saved to {saved[0]} and {saved[1]}", flush=True)
    scores = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
                       if k not in ("count", "num_examples", "trajectories"))
    say(f"eval of {source}: {scores}  ({time.time() - started:.0f}s); saved to {out}", flush=True)
    return result


def evaluate_at_trajectories(trainer, test_set, config, ks: list[int], noises: list[float], data_index: int,
                             data_count: int, arc=None, say=lambda *a: None, eval_root: str | None = None,
                             step: int = 0):
    """`train.py eval` at every (K, sigma) of test-time scaling (ptrm.py): (rows of the curve, the
    metrics of each). A row holds K, sigma, the exact and token accuracy of the chosen answers
    (and ARC pass@k), and the seconds per puzzle, wall (the device's, on a TPU) and this process's
    CPU time, of the batches after the first (whose ACT steps compile the program; with one batch,
    less the compile time)."""
    import sharding as runtime

    rows, results = [], []
    for noise in noises:
        # Without noise every trajectory is the first: K > 1 would cost K times for K=1's answers.
        for k in ks if noise else ks[:1]:
            trainer.set_trajectories(ptrm.trajectories_of(k, noise, config.run.seed))
            batches = ptrm.eval_batches(test_set, config.optim.global_batch_size, k, data_index, data_count,
                                   config.eval.max_examples, config.run.seed)
            before, marks = runtime.xla_counters(), [(time.time(), time.process_time())]

            def after_batch(done: int, marks=marks) -> bool:  # timed from the first batch's end (it compiles)
                if done == 1:
                    marks.append((time.time(), time.process_time()))
                return False

            result, _ = evaluate(trainer, batches, runtime.sync, arc, say, eval_root, step, False,
                                 between_batches=after_batch)
            after = runtime.xla_counters()
            compiled = after["compile_seconds"] - before["compile_seconds"]
            first_batch = min(ptrm.puzzles_per_batch(config.optim.global_batch_size, k, 1), batches.num_examples)
            timed = marks[-1] if len(batches) > 1 else marks[0]
            puzzles = max(batches.num_examples - (first_batch if len(batches) > 1 else 0), 1)
            wall, cpu = time.time() - timed[0], time.process_time() - timed[1]
            if len(batches) == 1:
                wall, cpu = wall - compiled, cpu - compiled
            row = {"trajectories": k, "noise": noise, "exact_accuracy": result["exact_accuracy"],
                   "timed_puzzles": puzzles,
                   "accuracy": result["accuracy"], "q_halt_accuracy": result["q_halt_accuracy"],
                   "oracle_exact_accuracy": result.get("oracle_exact_accuracy", result["exact_accuracy"]),
                   "seconds_per_puzzle": max(wall, 0.0) / puzzles, "cpu_seconds_per_puzzle": max(cpu, 0.0) / puzzles,
                   "compile_seconds": compiled, "examples": batches.num_examples,
                   # graphs compiled and device-to-host reads of this evaluation (counted as the
                   # training loop counts them): one program per K, its metrics read once
                   "compiles": after["compiles"] - before["compiles"],
                   "transfers": after["transfers"] - before["transfers"]}
            row.update({name: v for name, v in result.items() if name.startswith("pass@")})
            rows.append(row)
            results.append(result)
            say(f"  K={k} noise={noise:g}: exact_accuracy {row['exact_accuracy']:.4f}  accuracy {row['accuracy']:.4f}"
                f"  {row['seconds_per_puzzle']:.5f} s/puzzle", flush=True)
    trainer.set_trajectories(None)
    return rows, results


def usage() -> str:
    """`python train.py --help`: the presets and the commands."""
    width = max(map(len, PRESETS))
    return "\n".join([
        "usage: python train.py PRESET [FLAGS]                          train (PRESET --help: every flag)",
        "       python train.py eval [PRESET] --init-from URL [FLAGS]   evaluate weights on a test split",
        "       python train.py export SOURCE --out URL                 the EMA weights as one safetensors file",
        "       python train.py export SOURCE --format reference --out DIR   a model directory the reference also runs",
        "       python train.py predict [PRESET] --init-from URL ...    answers to --puzzle / --puzzle-file / --task",
        "", "presets:", *(f"  {name.ljust(width)}  {about}" for name, (about, _) in PRESETS.items()),
        "", "Each command's --help lists its flags; flags take `--flag value` or `--flag=value`."])
