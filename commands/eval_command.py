"""`train.py eval`: evaluate given weights (a run directory, a checkpoint, an exported
model.safetensors or a reference checkpoint) on a dataset's test split, at each test-time setting
its flags name (testtime/settings.py: K trajectories, noise, depth D, noise latent), one directory each:

    {run.dir}/test-time/K{K}-noise{noise}-D{D}[-{latent}]/   metrics.json (last), ARC votes and submission
    {run.dir}/test-time/trajectories.json, trajectories.png   every setting done so far (testtime/curve.py)

run.dir is the weights' own run directory unless --run.dir says otherwise. Nothing is written
into the run's own eval/: a test-time evaluation never replaces a training evaluation. A setting
whose metrics.json holds this step (and data, max_examples, ARC aggregation) is done and skipped,
so a stopped command resumes where it was; delete a setting's metrics.json to evaluate it again.

    python train.py eval --init-from gs://BUCKET/runs/NAME --data.path gs://BUCKET/data/...
    python train.py eval --init-from RUN --data.path DATA --eval.trajectories 1,16 --eval.noise 0,0.3 \
        --eval.act-steps 64
"""
from __future__ import annotations

import json
import time

from commands.restore import load_weights_for_eval
from commands.weights_flags import parse_weights_command
from puzzles.arc import ArcEvaluator, write_submission
from rundir import storage
from testtime import batches as testtime_batches
from testtime import curve, noisy_trajectories
from testtime import settings as testtime_settings
from training.config import PRESETS
from training.evaluate import evaluate
from training.lifecycle import check_devices, start
from training.trainer import Trainer


def evaluate_command(argv: list[str]) -> dict:
    """`python train.py eval [PRESET] --init-from URL --data.path URL [overrides]`: evaluate a
    run directory / checkpoint, an exported model.safetensors or a reference checkpoint on a
    dataset's test split at each test-time setting given; prints and saves the metrics (and ARC
    scores) under {run.dir}/test-time/SETTING/. Returns the last setting's metrics."""
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
    settings = testtime_settings.settings(config.eval, config.model.halt_max_steps,
                                          breadth_without_noise=config.model.scheme.draws)
    try:
        for point in settings:
            testtime_batches.host_puzzles(config.optim.global_batch_size, point.k, data_count)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    mesh = sharding.data_mesh()
    trainer = Trainer(config, sharding, mesh, weights)
    first = testtime_batches.eval_batches(test_set, config.optim.global_batch_size, 1, data_index, data_count,
                                          config.eval.max_examples, config.run.seed)
    trainer.init_carries(sharding.host_batch_to_global(first.batch(0), mesh))
    sharding.sync()
    say(f"evaluating {source} (step {step}) on {first.num_examples} examples of {config.data.path} "
        f"on {device_kind} ({len(first)} batches at K=1), at {len(settings)} test-time setting(s): "
        + ", ".join(p.name for p in settings), flush=True)
    started = time.time()
    arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None
    rows = evaluate_settings(trainer, test_set, config, settings, step, source, data_index, data_count, arc,
                             lambda *a, **k: say(*a, flush=True))
    root = storage.join_url(config.run.dir, testtime_settings.DIR)
    if sharding.is_main_process():
        done = [r for r in curve.saved_settings(config.run.dir) if r.get("step") == step]
        say(f"accuracy against test-time compute ({device_kind}; every setting of {root} at step {step}):\n"
            + curve.curve_table(done), flush=True)
        saved = curve.write_curve(root, done, f"{source} (step {step}) on {config.data.path}")
        say(f"curve saved to {saved[0]} and {saved[1]}", flush=True)
    result = rows[-1]
    shown = ("exact_accuracy", "mode_exact_accuracy", "pass_exact_accuracy", "conv_exact_accuracy", "accuracy")
    scores = "  ".join(f"{k} {result[k]:.4f}" for k in shown if k in result)
    scores += "".join(f"  {k} {v:.4f}" for k, v in result.items() if k.startswith(("pass@", "aggregated_pass@")))
    say(f"eval of {source}: {scores}  ({time.time() - started:.0f}s); saved under {root}", flush=True)
    return result


def evaluate_settings(trainer, test_set, config, settings: list[testtime_settings.Setting], step: int, source: str,
                      data_index: int = 0, data_count: int = 1, arc=None, say=lambda *a, **k: None) -> list[dict]:
    """Evaluate at each setting into {run.dir}/test-time/SETTING/ (metrics.json written last;
    ARC votes and submission before it), skipping a setting already done at this step; returns
    each setting's metrics (a done one's as saved). Besides the evaluation's metrics (best-Q's
    as exact_accuracy and accuracy, mode@K's, pass@K's and conv's), a setting's metrics hold its K,
    noise, D, latent, puzzles, step, the ACT steps per puzzle (K x D), and the seconds per puzzle,
    wall (the device's, on a TPU) and this process's CPU time, of the batches after the first
    (whose ACT steps compile the program; with one batch, less the compile time)."""
    import sharding as runtime

    rows = []
    for point in settings:
        out = testtime_settings.setting_dir(config.run.dir, point.k, point.noise, point.act_steps, point.latent)
        aggregate = bool(config.eval.arc and config.eval.arc_aggregate and point.is_reference)
        # what else changes the result: a setting done otherwise is evaluated again
        inputs = {"step": step, "data_path": config.data.path, "max_examples": config.eval.max_examples,
                  "arc_aggregate": aggregate, "convergence_window": config.eval.convergence_window,
                  "convergence_top_k": config.eval.convergence_top_k}
        done = curve.read_metrics(out)
        if done is not None and all(done.get(k) == v for k, v in inputs.items()):
            say(f"  {point.name}: done at step {step} ({out}/metrics.json; delete it to evaluate again), skipped")
            rows.append(done)
            continue
        noisy_trajectories.set_evaluation(trainer, point)
        batches = testtime_batches.eval_batches(test_set, config.optim.global_batch_size, point.k, data_index,
                                                data_count, config.eval.max_examples, config.run.seed)
        before, marks = runtime.xla_counters(), [(time.time(), time.process_time())]

        def after_batch(done: int, marks=marks) -> bool:  # timed from the first batch's end (it compiles)
            if done == 1:
                marks.append((time.time(), time.process_time()))
            return False

        # Earlier ARC votes are read from the run's own evaluations; this one's go to its setting.
        result, submission = evaluate(trainer, batches, runtime.sync, arc, say,
                                      storage.join_url(config.run.dir, "eval"), step,
                                      aggregate, between_batches=after_batch,
                                      votes_url=storage.join_url(out, "arc_votes.json.gz"))
        after = runtime.xla_counters()
        compiled = after["compile_seconds"] - before["compile_seconds"]
        # puzzles of a global batch, every host's (a K>1 batch's rows hold each puzzle K times)
        per_batch = batches.puzzles.global_batch_size if point.k > 1 else batches.global_batch_size
        first_batch = min(per_batch, batches.num_examples)
        timed = marks[-1] if len(batches) > 1 else marks[0]
        puzzles = max(batches.num_examples - (first_batch if len(batches) > 1 else 0), 1)
        wall, cpu = time.time() - timed[0], time.process_time() - timed[1]
        if len(batches) == 1:
            wall, cpu = wall - compiled, cpu - compiled
        row = dict(result, trajectories=point.k, noise=point.noise, act_steps=point.act_steps,
                   noise_latent=point.latent, num_puzzles=batches.num_examples, **inputs,
                   act_steps_per_puzzle=point.k * point.act_steps, token_accuracy=result["accuracy"],
                   timed_puzzles=puzzles, seconds_per_puzzle=max(wall, 0.0) / puzzles,
                   cpu_seconds_per_puzzle=max(cpu, 0.0) / puzzles, compile_seconds=compiled,
                   # graphs compiled and device-to-host reads of this evaluation (counted as the
                   # training loop counts them): one program per setting, its metrics read once
                   compiles=after["compiles"] - before["compiles"],
                   transfers=after["transfers"] - before["transfers"], source=source)
        if trainer.sharding.is_main_process():
            if submission is not None:
                write_submission(out, submission)
            storage.write_bytes(storage.join_url(out, curve.METRICS), json.dumps(row, indent=2).encode())
        rows.append(row)
        say(f"  {point.name}: best-Q exact {row['exact_accuracy']:.4f}  mode@{point.k} "
            f"{row['mode_exact_accuracy']:.4f}  pass@{point.k} {row['pass_exact_accuracy']:.4f}  "
            f"conv {row['conv_exact_accuracy']:.4f}  "
            f"accuracy {row['accuracy']:.4f}  {row['seconds_per_puzzle']:.5f} s/puzzle")
    noisy_trajectories.set_evaluation(trainer, testtime_settings.Setting(1, 0.0, config.model.halt_max_steps))
    return rows
