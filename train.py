"""Train a Tiny Recursive Model (TRM) on a Cloud TPU slice or on a virtual CPU mesh.

Every host of a slice runs this same command; one program spans all devices (PyTorch/XLA SPMD,
data parallel). On a laptop:

    python train.py demo                 # builds data/demo if missing, trains on 8 virtual CPU devices

With a dataset in the reference format (local path or gs://), a preset and any overrides:

    python train.py sudoku-mlp --data.path gs://BUCKET/data/sudoku-extreme-1k-aug-1000 \\
        --run.dir gs://BUCKET/runs/sudoku-mlp-1
    python train.py arc1 --optim.lr 3e-4 --data.path gs://BUCKET/data/arc1 --run.dir gs://BUCKET/runs/x
    python train.py --help               # the presets and the commands
    python train.py arc1 --help          # every setting, with its preset value
    python train.py eval --help          # each command's flags

Relaunching the same command continues from the run directory's latest checkpoint; SIGTERM
(a spot VM's preemption notice) or Ctrl-C saves one and exits 0 (or 75 when that does not end
within run.shutdown_timeout_s; a second signal exits at once). Other commands:

    python train.py export gs://BUCKET/runs/NAME --out gs://BUCKET/models/NAME.safetensors
    python train.py eval --init-from gs://BUCKET/runs/NAME --data.path gs://BUCKET/data/...
    python train.py eval arc1 --init-from reference_step_123.pt --data.path gs://BUCKET/data/arc1
    python train.py predict demo --init-from runs/demo --puzzle 1.3..4....2.2...   # or --puzzle-file, --task

Presets: sudoku-mlp, sudoku-att, maze, arc1, arc2 (the paper's recipes) and demo. On a pod,
`bash launch.sh train RUN_NAME PRESET ...` runs this on every host with PJRT_DEVICE=TPU.

The loop is `training()` below, read top to bottom; each thing it calls has a file of its own:
the flags and presets (training/config.py), the run's length and learning rates (training/schedule.py), where
the state comes from (commands/restore.py), the step (training/trainer.py), the periodic save and evaluation
(training/checkpoint.py, training/evaluate.py), start-up, SIGTERM and the watchdog (training/lifecycle.py), what it
prints and writes (training/run_log.py), where each launch's time went (training/launch_records.py).
"""
from __future__ import annotations

import gc
import sys
import time

import data
from commands import eval_command, export, predict
from commands.restore import resume_or_start
from data import PrefetchedBatches, TrainBatches, total_train_steps
from fleet import fencing
from puzzles import builders
from rundir import storage
from tpu_costs.slices import peak_tflops_per_device
from training import checkpoint, compile_cache
from training.checkpoint import Checkpoints
from training.config import PRESETS, Config, ConfigError, parse_config, reads_demo_data, settings_lines
from training.evaluate import Evaluations
from training.launch_records import Launch, first_launch_start
from training.lifecycle import EXIT_RETRYABLE, Preempted, Preemption, ShutdownDeadline, Watchdog, check_devices, start
from training.run_log import HostLog, Profile, RunLog
from training.schedule import Curriculum, lr_at, resolve_anneal, run_schedule


def main(config: Config, preset: str | None = None) -> dict:
    """Train (and evaluate) as configured, resuming from the run directory's latest
    checkpoint; returns the logged history, the evaluations and the XLA counters. `preset`: the
    preset the flags were applied to (for the settings printed at start; default: the closest)."""
    # 1. Checks (before any device work), then the runtime and the hosts; from then on what this
    # host prints also goes to {run.dir}/logs/host_I.launch-TIME.log. Each host's rows must land
    # on its own devices before anything trains.
    original = config
    config, train_set, test_set, sharding, device_kind, identifiers = start(config)
    launch = sharding.broadcast_object(time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    with HostLog(config.run.dir, sharding.process_index(), launch):
        check_devices(sharding)
        if sharding.is_main_process():
            print("\n".join(settings_lines(original, config, preset)), flush=True)
        return training(config, train_set, test_set, sharding, device_kind, identifiers)


def training(config: Config, train_set: data.Dataset, test_set: data.Dataset, sharding, device_kind: str,
             identifiers: str | None) -> dict:
    """main() once the runtime runs: the run itself."""
    startup_transfers = sharding.xla_counters()["transfers"]  # the start-up self-check's read
    num_devices, local_devices = sharding.device_counts()
    num_hosts, host = sharding.process_count(), sharding.process_index()
    optim = config.optim
    try:
        total_steps, eval_steps = run_schedule(train_set.metadata, optim, config.eval.every_epochs)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    full_steps = total_train_steps(train_set.metadata, optim.epochs, optim.global_batch_size)
    config, curriculum = resolve_anneal(config, full_steps), Curriculum(config, full_steps)
    log = RunLog(config, total_steps, sharding.is_main_process(), sharding, curriculum=curriculum,
                 peak_tflops=peak_tflops_per_device(device_kind),  # None off a known TPU: no MFU
                 first_launch=lambda: first_launch_start(config.run.dir))  # names the run's W&B run, if mirrored
    log.say(f"TRM on {device_kind}: {num_devices} devices on {num_hosts} host(s) ({local_devices} here); "
            f"global batch {optim.global_batch_size}, {total_steps} steps, {len(eval_steps)} evaluations "
            f"(steps {', '.join(map(str, eval_steps[:3]))}{', ...' if len(eval_steps) > 4 else ''}"
            f"{', ' + str(eval_steps[-1]) if len(eval_steps) > 3 else ''})")
    if optim.curriculum_epochs:  # each stage compiles its own training step
        log.say("recursion curriculum: " + ", ".join(f"H_cycles {h} L_cycles {l_} from step {s}"
                                                     for s, (h, l_) in curriculum.stages(total_steps)))

    # 2. Resume from the newest committed checkpoint (one decision for all hosts), or start
    # (optionally from given weights).
    mesh = sharding.data_mesh()
    start_step, trainer, resumed = resume_or_start(config, identifiers, sharding, mesh, log)
    log.continue_from(start_step)  # metrics.jsonl continues from here
    log.say(f"model: {sum(p.numel() for p in trainer.model.parameters()):,} parameters; data: {config.data.path}")
    data_index, data_count = sharding.data_split()  # this host's rows of every batch
    train_batches = TrainBatches(train_set, optim.global_batch_size, seed=config.run.seed,
                                 process_index=data_index, process_count=data_count)

    # 3. The periodic jobs; each decides for itself whether a step is its step. `launch` records
    # where this launch's time goes ({run.dir}/launches/), as of its start.
    launch = Launch(config, sharding, start_step, resumed, log.metrics.reached if log.metrics else None)
    checkpoints = Checkpoints(config, trainer, log, identifiers, total_steps, start_step if resumed else None,
                              launch)
    preemption = Preemption(num_hosts, config.run.preempt_check_every, sharding,
                            ShutdownDeadline(config.run.shutdown_timeout_s, loop=training))
    watchdog = Watchdog(config.run.watchdog_minutes, host)
    evaluations = Evaluations(config, trainer, test_set, log, eval_steps, preemption, watchdog, launch)
    profile = Profile(config, start_step + 10, sharding.is_main_process(), sharding, log.say)
    compiles = compile_cache.CompileCache.for_run(config.run, sharding.is_main_process(), start_step,
                                                  sharding.xla_counters, device_kind)

    # 4. The loop. Nothing in it reads a device value: metric sums are read by a background
    # thread at the end of each logging window, while the host runs the following steps.
    trainer.init_carries(sharding.host_batch_to_global(train_batches.batch(start_step), mesh))
    sharding.sync()  # materialise weights, optimizer state and carries before the first step
    log.start_window(trainer.device)
    loop_start, preempted = launch.training(), False
    batches = PrefetchedBatches(lambda step: sharding.host_batch_to_global(train_batches.batch(step - 1), mesh),
                                start_step + 1, total_steps)
    try:
        evaluations.catch_up(start_step, resumed)
        for step in range(start_step + 1, total_steps + 1):
            batch = batches.get(step)
            lr = lr_at(step, optim.lr, optim, total_steps)
            profile.before_step(step)
            log.add_step(trainer.step(batch, lr, lr_at(step, optim.puzzle_emb_lr, optim, total_steps),
                                      curriculum.at(step)))
            sharding.sync()
            watchdog.progress(f"step {step}")
            profile.after_step(step)
            compiles.after_step(step)  # says what the compile cache did, once
            stop = preemption.agreed_stop(step, log.nonfinite is not None)
            log.after_step(step, lr, end_window=stop or checkpoints.due(step))
            if stop:  # SIGTERM on some host (a NaN stops inside save instead)
                raise Preempted(step)
            checkpoints.after_step(step)
            evaluations.after_step(step)  # raises Preempted on SIGTERM between evaluation batches
            launch.after_step(step)

        # 5. The final save and evaluation (a relaunch of a finished run only evaluates).
        checkpoints.save(total_steps)
        evaluations.run(total_steps, final=True)
        checkpoints.wait()
        log.finished(total_steps, time.time() - loop_start)  # and {run.dir}/final.json
    except Preempted as stop:
        checkpoints.save(stop.step, wait=True)
        log.say(f"stop requested (SIGTERM or Ctrl-C): saved checkpoint "
                f"{checkpoint.step_dir(config.run.dir, stop.step)}; "
                "run the same command again to resume")
        preempted = True
    finally:
        launch.closing()
        batches.close()
        checkpoints.close()  # a save under way commits (or is reported) however the loop ends
        watchdog.close()
        compiles.close()  # best effort, bounded (after SIGTERM by the shutdown deadline too)
        preemption.close()  # last: its shutdown deadline also bounds the wait for the save
        launch.end(preempted)  # how this launch ended (an exception on its way out: failed or exit 75)
    log.close()
    xla = sharding.xla_counters()
    fallbacks = f" {xla['fallbacks']}" if xla["fallbacks"] else ""
    log.say(f"XLA: {xla['compiles']} graphs compiled ({xla['compile_seconds']:.1f}s), "
            f"{sum(xla['fallbacks'].values())} aten:: CPU fallbacks{fallbacks}, "
            f"{xla['transfers']} device-to-host transfers")
    return {"history": log.history, "evals": log.evals, "final": log.evals[-1] if log.evals else None,
            "xla": xla, "checkpoint_transfers": checkpoints.transfers, "startup_transfers": startup_transfers,
            "preempted": preempted, "start_step": start_step}


COMMANDS = {"eval": eval_command.evaluate_command, "export": export.export_command, "predict": predict.predict_command}
"""The commands besides training (`python train.py COMMAND --help` for each one's flags)."""


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


def command_line(argv: list[str]) -> int:
    """Run a command; the exit status: 0 done (or saved and stopped on SIGTERM), 1 a failure a
    relaunch would repeat, EXIT_RETRYABLE one it may not (storage failing beyond its retries, a
    lost peer host; the watchdog exits with it too); under study.py, fencing.EXIT_FENCED when its
    lease ran out or its holder died."""
    fencing.start_from_environment()  # a study's trainer: dies with its holder, writes only under its lease
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        if argv[0] in COMMANDS:
            COMMANDS[argv[0]](argv[1:])
            return 0
        config = parse_config(argv)
        if reads_demo_data(config):  # `python train.py demo` on a fresh checkout
            builders.ensure_demo_data(config.data.path)
        result = main(config, argv[0] if argv[0] in PRESETS else None)
        return 0 if result["final"] is not None or result["preempted"] else 1
    except storage.StorageError as e:
        print(f"error: {e}\nStorage failed beyond its retries; relaunching may help (exit status {EXIT_RETRYABLE}).",
              file=sys.stderr, flush=True)
        return EXIT_RETRYABLE
    except RuntimeError as e:
        sharding = sys.modules.get("sharding")  # imported by start(): it brings torch_xla
        if sharding is None or not isinstance(e, sharding.HostLostError):
            raise
        print(f"error: the connection to another host broke ({e}); that host was most likely lost or "
              f"preempted: relaunch the slice (exit status {EXIT_RETRYABLE}).", file=sys.stderr, flush=True)
        return EXIT_RETRYABLE


if __name__ == "__main__":
    status = command_line(sys.argv[1:])
    # Everything is written and closed by now. The interpreter's last garbage collection walks the
    # objects torch, torch_xla and the run hold, seconds of exit (docs/measurements.md) that a study
    # counts in the launch's time. Frozen objects are not walked.
    gc.freeze()
    sys.exit(status)
