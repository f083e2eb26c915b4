"""`train.py eval`: evaluate given weights (a run directory, a checkpoint, an exported
model.safetensors or model directory, or a checkpoint of the reference's, EqR's or URM's code)
on a dataset's test split, at each test-time setting its flags name (testtime/settings.py: K
trajectories, noise, depth D, noise latent), one directory each:

    {run.dir}/test-time/K{K}-noise{noise}-D{D}[-{latent}]/   metrics.json (last), ARC votes and submission

The curve of accuracy against test-time compute is rebuilt from the settings' own metrics.json by
whoever reads it (testtime/curve.py): the table printed at the end (every setting done with these
weights and data, another process's included), the study report. No file outside a setting's
directory is written: the plot, trajectories.png, goes into the last setting this command evaluated.

Every example of the test split is read unless --eval.max-examples is given on this command line
(a run's training-time subset is not kept); each line and metrics.json (num_puzzles) say how many
puzzles were read. Without --run.dir, a run directory's results go into that directory, as it was
given (local or gs://: a copy of a run is evaluated into the copy, never into the run.dir of its
saved config); a checkpoint directory's into its run; a model file or directory's (model.safetensors,
train.py export --format reference|eqr|urm, a checkpoint of the reference's, EqR's or URM's code)
into MODEL.eval/ beside it, never a preset's shared runs/ directory. The first and last lines say
where. Nothing is written into the run's own eval/: a test-time evaluation never replaces a
training evaluation.

A setting's metrics.json records what was read (testtime/identity.py): the weights' fingerprint
(sha256 over their tensors), the test split's fingerprint (its contents, not its path), the
subset and seed, the ARC aggregation and the setting. A setting whose metrics.json has this
identity is done and skipped, so a stopped command resumes where it was; one of other weights,
other data or another subset is evaluated again and its metrics.json replaced (the line says
what differed). Delete a setting's metrics.json to evaluate it again.

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
from testtime import identity as testtime_identity
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
    config, _, test_set, sharding, device_kind, identifiers = start(
        config, None if table is None else table.shape[0], trained_on, source)
    arc_puzzles = storage.join_url(config.data.path, "test_puzzles.json")  # what scores ARC's answers
    scored_by = storage.read_bytes(arc_puzzles) if config.eval.arc and storage.exists(arc_puzzles) else b""
    identity = {"weights": testtime_identity.weights_fingerprint(weights),
                "data": testtime_identity.data_fingerprint(test_set, identifiers, scored_by)}
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
    root = storage.join_url(config.run.dir, testtime_settings.DIR)
    say(f"evaluating {source} (step {step}) on {first.num_examples} examples of {config.data.path} "
        f"on {device_kind} ({len(first)} batches at K=1), at {len(settings)} test-time setting(s): "
        + ", ".join(p.name for p in settings) + f"; results into {root}", flush=True)
    started = time.time()
    arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None
    evaluated: list[str] = []  # the settings' directories evaluated (not skipped) here
    rows = evaluate_settings(trainer, test_set, config, settings, step, source, identity, data_index, data_count,
                             arc, lambda *a, **k: say(*a, flush=True), evaluated)
    if sharding.is_main_process():
        # Rebuilt from every setting's own metrics.json (another holder's included), never kept in
        # a shared file; the plot goes into the last setting evaluated here, where this command writes.
        done = [r for r in curve.saved_settings(config.run.dir) if all(r.get(k) == v for k, v in identity.items())]
        say(f"accuracy against test-time compute ({device_kind}; every setting of {root} with these weights and "
            f"data, step {step}):\n"
            + curve.curve_table(done), flush=True)
        if evaluated:
            plot = curve.write_plot(evaluated[-1], done, f"{source} (step {step}) on {config.data.path}")
            say(f"curve drawn in {plot}", flush=True)
    result = rows[-1]
    read = f"on {result['num_puzzles']} puzzles"
    shown = ("exact_accuracy", "mode_exact_accuracy", "pass_exact_accuracy", "conv_exact_accuracy", "accuracy")
    scores = "  ".join(f"{k} {result[k]:.4f}" for k in shown if k in result)
    scores += "".join(f"  {k} {v:.4f}" for k, v in result.items() if k.startswith(("pass@", "aggregated_pass@")))
    say(f"eval of {source} {read}: {scores}  ({time.time() - started:.0f}s); saved under {root}", flush=True)
    return result


def evaluate_settings(trainer, test_set, config, settings: list[testtime_settings.Setting], step: int, source: str,
                      identity: dict, data_index: int = 0, data_count: int = 1, arc=None,
                      say=lambda *a, **k: None, evaluated: list[str] | None = None) -> list[dict]:
    """Evaluate at each setting into {run.dir}/test-time/SETTING/ (metrics.json written last;
    ARC votes and submission before it), skipping a setting done with this `identity` ({"weights":
    fingerprint, "data": fingerprint}, and the subset, seed, aggregation and setting); returns
    each setting's metrics (a done one's as saved). Besides the evaluation's metrics (best-Q's
    as exact_accuracy and accuracy, mode@K's, pass@K's and conv's), a setting's metrics hold its K,
    noise, D, latent, puzzles, step, identity, the ACT steps per puzzle (K x D), and the seconds per puzzle,
    wall (the device's, on a TPU) and this process's CPU time, of the batches after the first
    (whose ACT steps compile the program; with one batch, less the compile time). `evaluated`, when
    given, receives the directory of each setting evaluated (not skipped)."""
    import sharding as runtime

    rows, evaluated = [], [] if evaluated is None else evaluated
    for point in settings:
        out = testtime_settings.setting_dir(config.run.dir, point.k, point.noise, point.act_steps, point.latent)
        aggregate = bool(config.eval.arc and config.eval.arc_aggregate and point.is_reference)
        # What the evaluation reads (testtime/identity.py): a setting done with other weights, other
        # data, another subset, aggregation or convergence window is evaluated again, its metrics.json replaced.
        inputs = dict(identity, max_examples=config.eval.max_examples, seed=config.run.seed, arc_aggregate=aggregate,
                      trajectories=point.k, noise=point.noise, act_steps=point.act_steps, noise_latent=point.latent,
                      convergence_window=config.eval.convergence_window,
                      convergence_top_k=config.eval.convergence_top_k)
        done = curve.read_metrics(out)
        differ = testtime_identity.differences(done, inputs)
        if not differ:
            say(f"  {point.name}: {done.get('num_puzzles')} puzzles, done with these weights (step {done.get('step')}) "
                f"and data ({out}/metrics.json; delete it to evaluate again), skipped")
            rows.append(done)
            continue
        if done is not None:
            say(f"  {point.name}: {out}/metrics.json is another evaluation's ({'; '.join(differ)}): "
                "evaluating again, replacing it")
            if trainer.sharding.is_main_process():
                stale = storage.join_url(out, curve.METRICS)
                fs, path = storage.filesystem(stale)
                storage.with_retries("deleting", stale, lambda fs=fs, path=path: fs.rm(path))
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
        row = dict(result, **inputs, step=step, data_path=config.data.path, num_puzzles=batches.num_examples,
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
        evaluated.append(out)
        say(f"  {point.name}: {row['num_puzzles']} puzzles, best-Q exact {row['exact_accuracy']:.4f}  mode@{point.k} "
            f"{row['mode_exact_accuracy']:.4f}  pass@{point.k} {row['pass_exact_accuracy']:.4f}  "
            f"conv {row['conv_exact_accuracy']:.4f}  "
            f"accuracy {row['accuracy']:.4f}  {row['seconds_per_puzzle']:.5f} s/puzzle")
    noisy_trajectories.set_evaluation(trainer, testtime_settings.Setting(1, 0.0, config.model.halt_max_steps))
    return rows
