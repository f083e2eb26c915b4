"""Evaluation: D ACT steps per test batch (eval.act_steps; the model's halt_max_steps, as the
reference runs) with the EMA weights, the
reference's metrics over real (non-padding) examples, and for ARC the votes over augmentations
(and over every evaluation of a run), saved under {run.dir}/eval/step_N/; and the training
loop's periodic evaluation (`Evaluations`), which decides itself which steps are its steps.
"""
from __future__ import annotations

import contextlib
import json
import re
import time
from functools import partial
from typing import TYPE_CHECKING

import data
from data import EvalBatches
from puzzles.arc import REFERENCE_PASS_KS, VOTES_FILE, ArcEvaluator, decode_summary, encode_summary, write_submission
from rundir import storage
from testtime import batches as testtime_batches
from testtime import noisy_trajectories
from testtime import settings as testtime_settings
from training import halt_steps
from training.lifecycle import Preempted
from training.run_log import format_duration
from training.trainer import Trainer

if TYPE_CHECKING:
    from training.config import Config
    from training.lifecycle import Preemption, Watchdog
    from training.run_log import RunLog


def evaluate(trainer: Trainer, batches: EvalBatches, sync, arc=None, say=lambda *a: None,
             eval_root: str | None = None, step: int = 0, aggregate: bool = False,
             between_batches=lambda done: False, first_predictions=None, each_act_step=None,
             votes_url: str | None = None):
    """D ACT steps per batch (trainer.eval_steps) with the EMA weights; the reference's
    metrics over real (non-padding) examples, the halting-step distribution (training/halt_steps.py:
    halted_at_S and never_halted, fractions, and mean_halt_step), plus ARC pass@k when `arc`
    (an ArcEvaluator) is given. Returns (metrics, ARC submission or None), or (None, None) when
    `between_batches(batches done)`, called after every batch, returns True (a SIGTERM).
    `first_predictions(host batch, predicted tokens)` gets this host's rows of the first batch;
    `each_act_step(batch index, host batch, preds, q_halt)` is called after every ACT step with
    its device outputs (predict reads them all; a training run's evaluation does not).
    With `trainer.trajectories` (testtime/noisy_trajectories.py), `batches` holds each puzzle's K rows in a row
    (testtime.batches.TrajectoryBatches) and the metrics and votes count each puzzle's best-Q
    answer once; mode_exact_accuracy, pass_exact_accuracy, conv_exact_accuracy and
    conv_top_k_exact_accuracy are mode@K's, pass@K's and the convergence residual's (EqR's). Without,
    every selection is the one answer: each of them is exact_accuracy.

    With `arc` and `eval_root`, process 0 saves this evaluation's votes to
    {eval_root}/step_{step}/arc_votes.json.gz (to `votes_url` instead when given: a test-time
    evaluation's own directory); with `aggregate` too, aggregated_pass@k (and the
    submission) are a vote over them and the saved votes of every earlier step."""
    sharding = trainer.sharding
    trajectories = trainer.trajectories
    names, sums = trainer.eval_metric_names(), trainer.eval_sums()
    started, report_every = time.time(), max(1, len(batches) // 10)
    if arc is not None:
        arc.begin()
    with trainer.ema.swapped_into(trainer.model):
        trainer.model.eval()
        for index in range(len(batches)):
            host_batch = batches.batch(index)
            batch = sharding.host_batch_to_global(host_batch, trainer.mesh)
            for _ in range(trainer.eval_steps):
                # preds and q_halt stay referenced across the sync, so every ACT step is the
                # same graph whether or not this batch's predictions are read.
                sums, preds, q_halt = trainer.eval_act_step(batch, sums)
                sync()
                if each_act_step is not None:
                    each_act_step(index, host_batch, preds, q_halt)
            if arc is not None or (index == 0 and first_predictions is not None):
                # this host's rows only; of K trajectories (testtime/noisy_trajectories.py), each puzzle's first row
                # holds its best-Q answer
                rows = len(host_batch["inputs"])
                every = slice(None) if trajectories is None else trajectories.host_puzzle_rows(rows)
                predicted = sharding.local_rows(preds)[1].numpy()[every]
                puzzles = {k: v[every] for k, v in host_batch.items()}
                if index == 0 and first_predictions is not None:
                    first_predictions(puzzles, predicted)
                if arc is not None:  # votes are summarised before crossing hosts
                    arc.update(puzzles, predicted, sharding.local_rows(q_halt)[1].float().numpy()[every],
                               batches.valid(index)[every])
            done = index + 1
            if between_batches(done):
                trainer.model.train()
                return None, None
            if done % report_every == 0 and done < len(batches):
                elapsed = time.time() - started
                say(f"  eval batch {done}/{len(batches)} ({100 * done / len(batches):.0f}%), "
                    f"ETA {format_duration(elapsed / done * (len(batches) - done))}")
        trainer.model.train()
    # The reference's evaluate divides every sum, the losses included, by count.
    sums = dict(zip(names, sums.cpu().numpy().tolist()))
    result = {k: v if k == "count" else v / max(sums["count"], 1.0) for k, v in sums.items()}
    halt_steps.with_mean_halt_step(result, trainer.eval_steps)  # mean_halt_step
    for name in noisy_trajectories.EXTRA_METRICS:  # one answer: every selection's
        result.setdefault(name, result["exact_accuracy"])
    result["best_q_exact_accuracy"] = result["exact_accuracy"]
    result["num_examples"] = batches.num_examples
    submission = None
    if arc is not None:
        split_over_hosts = sharding.data_split()[1] > 1  # else this host voted on every row
        votes = arc.merge(sharding.all_gather_object(arc.summary()) if split_over_hosts else [arc.summary()])
        result.update(arc.result(votes, REFERENCE_PASS_KS))
        if sharding.is_main_process():
            if votes_url is not None:
                storage.write_bytes(votes_url, encode_summary(votes))
            elif eval_root is not None:
                save_arc_votes(eval_root, step, votes)
        if aggregate:
            if eval_root is None:
                raise ValueError("evaluate: aggregate needs eval_root, where the earlier votes are saved")
            earlier = [v for _, v in saved_arc_votes(eval_root, before_step=step)]
            votes = arc.merge([votes, *earlier])
            result.update({f"aggregated_{k}": v for k, v in arc.result(votes, REFERENCE_PASS_KS).items()})
            result["aggregated_evaluations"] = 1 + len(earlier)
        submission = arc.submission(votes)
    return result, submission


def save_arc_votes(eval_root: str, step: int, votes: dict) -> str:
    """Write an evaluation's merged ARC votes to {eval_root}/step_{step}/arc_votes.json.gz."""
    url = storage.join_url(eval_root, f"step_{step}", VOTES_FILE)
    storage.write_bytes(url, encode_summary(votes))
    return url


def saved_arc_votes(eval_root: str, before_step: int) -> list[tuple[int, dict]]:
    """(step, votes) of every evaluation saved under eval_root at a step before `before_step`,
    oldest first. Later steps are left out: after a resume they belong to the interrupted
    launch and are evaluated (and overwritten) again."""
    fs, path = storage.filesystem(eval_root)
    fs.invalidate_cache(path)
    pattern = re.compile(r"step_(\d+)/" + re.escape(VOTES_FILE) + "$")
    found = storage.with_retries("listing", eval_root, lambda: fs.glob(f"{path.rstrip('/')}/step_*/{VOTES_FILE}"))
    steps = sorted({int(m.group(1)) for m in map(pattern.search, found) if m and int(m.group(1)) < before_step})
    urls = [storage.join_url(eval_root, f"step_{s}", VOTES_FILE) for s in steps]
    return [(s, decode_summary(storage.read_bytes(url), url)) for s, url in zip(steps, urls)]


class Evaluations:
    """Evaluates at the scheduled steps (evaluation_steps) with the EMA weights, on a seeded
    subset of eval.max_examples except the final evaluation; writes {run.dir}/eval/step_N/
    (metrics.json last, as the mark of a finished evaluation) and the ARC submission. A SIGTERM
    on any host stops an evaluation between two batches (Preempted), unwritten. `launch` (a
    launch_records.Launch) counts each evaluation's time."""

    def __init__(self, config: Config, trainer: Trainer, test_set: data.Dataset, log: RunLog, eval_steps: list[int],
                 preemption: Preemption, watchdog: Watchdog, launch=None):
        self.config, self.trainer, self.test_set, self.log, self.launch = config, trainer, test_set, log, launch
        self.preemption, self.watchdog = preemption, watchdog
        self.scheduled = set(eval_steps[:-1])  # the final one runs after the loop
        self.root = storage.join_url(config.run.dir, "eval")
        self.arc = ArcEvaluator.from_dataset(config.data.path) if config.eval.arc else None
        # K must fit a host's rows of a batch: said at start-up, not at the first evaluation
        self.setting = testtime_settings.training_eval_setting(config.eval, config.model.halt_max_steps)
        testtime_batches.host_puzzles(config.optim.global_batch_size, self.setting.k, trainer.sharding.data_split()[1])

    def after_step(self, step: int) -> None:
        if step in self.scheduled:
            self.run(step, final=False)

    def catch_up(self, start_step: int, resumed: bool) -> None:
        """A SIGTERM at an evaluation step saves and stops before evaluating: evaluate the saved
        weights now, so the run (and its ARC vote over evaluations) misses no evaluation."""
        done = storage.join_url(self.root, f"step_{start_step}", "metrics.json")
        if resumed and start_step in self.scheduled and not storage.exists(done):
            self.run(start_step, final=False)

    def run(self, step: int, final: bool) -> None:
        with self.launch.pause("evaluation") if self.launch else contextlib.nullcontext():
            self._run(step, final)

    def _run(self, step: int, final: bool) -> None:
        config, sharding = self.config, self.trainer.sharding
        started = time.time()
        index, count = sharding.data_split()
        # Test-time scaling (testtime/noisy_trajectories.py) if asked for: the last K and noise of eval.trajectories /
        # eval.noise, at eval.act_steps
        noisy_trajectories.set_evaluation(self.trainer, self.setting)
        batches = testtime_batches.eval_batches(self.test_set, config.optim.global_batch_size, self.setting.k, index,
                                                count, None if final else config.eval.max_examples, config.run.seed)

        def between_batches(done: int) -> bool:  # True: stop (SIGTERM on some host)
            self.watchdog.progress(f"evaluation batch {done}/{len(batches)} at step {step}")
            return self.preemption.agreed_now()

        result, submission = evaluate(self.trainer, batches, sharding.sync, self.arc, self.log.say, self.root, step,
                                      config.eval.arc_aggregate, between_batches,
                                      partial(self.log.puzzles, step) if sharding.is_main_process() else None)
        if result is None:
            raise Preempted(step)
        self.log.evaluation(result, step, time.time() - started)
        if sharding.is_main_process():
            out = storage.join_url(self.root, f"step_{step}")
            if submission is not None:
                self.log.say(f"ARC submission: {write_submission(out, submission)}")
            storage.write_bytes(storage.join_url(out, "metrics.json"), json.dumps(dict(result, step=step),
                                                                                   indent=2).encode())
