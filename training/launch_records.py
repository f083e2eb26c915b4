"""What each launch of a run did, beside its metrics: {run.dir}/launches/launch-TIME.json, one
file per launch (process 0 writes it; a local path or gs://, through rundir/storage.py).

    process_start      when the process started (study.py passes its launch time; else /proc)
    loop_start         when the training loop began (its first step)
    start_step         the step it resumed from (0: a fresh run); resumed: from a checkpoint
    step               the last step it trained, as of `time` (the record's last write)
    previous_reached   the last step the metrics records held when this launch started: the step
                       the launch before reached (past `start_step`: steps it trains again)
    seconds            where its wall time went, by phase: startup (process start to the loop,
                       compiling excluded), training (the step loop), evaluation, checkpoint (the
                       loop's pauses to save), closing (after the loop) and compiling (the XLA
                       counters' compile seconds, taken out of the phase they fell in)
    evaluations, checkpoint_pauses, compiles   how many
    ended              null while it runs (or if it was killed), else finished, SIGTERM,
                       exit 75 or "failed: REASON"

The record is rewritten (best effort, on a thread: `run_log.Uploads`) after each logging window
and at the end, so a killed launch leaves what it had; what it could not write (the steps past
its last checkpoint) the next launch derives from the metrics records it drops (`previous_reached`).
The loop calls `after_step` every step; the record decides itself when to write.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

from rundir import storage
from rundir.contract import LAUNCH_DIR, LAUNCH_STARTED_ENV, STUDY_HOST_ENV, read_launches  # noqa: F401 (re-exported)
from training.run_log import Uploads

PHASES = ("startup", "training", "evaluation", "checkpoint", "closing", "compiling")
WRITE_EVERY_S = 60.0
"""Between logging windows, the record is rewritten at most this often."""


def process_start_time() -> float:
    """When this process started: study.py's launch time, else the kernel's start time of the
    process (Linux), else now."""
    now = time.time()
    try:
        return min(now, float(os.environ[LAUNCH_STARTED_ENV]))
    except (KeyError, ValueError):
        pass
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return min(now, boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return now


class Launch:
    """The record of this launch; `sharding` gives the compile counters and which process writes."""

    def __init__(self, config, sharding, start_step: int, resumed: bool, previous_reached: int | None):
        self.sharding, self.log_every = sharding, config.run.log_every
        self.on = sharding.is_main_process()
        started = process_start_time()
        name = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
        self.url = storage.join_url(config.run.dir, LAUNCH_DIR, f"launch-{name}.json")
        host = os.environ.get(STUDY_HOST_ENV, "")
        self.record = {
            "process_start": started, "loop_start": None, "start_step": start_step, "resumed": resumed,
            "step": start_step, "previous_reached": previous_reached, "devices": sharding.device_counts()[0],
            "hosts": sharding.process_count(), "study_host": host or None,
            "seconds": dict.fromkeys(PHASES, 0.0), "evaluations": 0, "checkpoint_pauses": 0, "compiles": 0,
            "time": started, "ended": None}
        self.phase, self.mark, self.compile_mark = "startup", started, 0.0  # the counters start with the process
        self.last_write = 0.0
        self._lock = threading.Lock()
        self.uploads = Uploads(None, self.url, "launch record", copy=self._write) if self.on else None
        self._account()
        self.write()

    def _account(self) -> None:
        """Add the time since the last mark to the phase under way, its compile seconds apart."""
        now, counters = time.time(), self.sharding.xla_counters()
        elapsed = max(0.0, now - self.mark)
        compiling = min(elapsed, max(0.0, counters["compile_seconds"] - self.compile_mark))
        seconds = self.record["seconds"]
        seconds[self.phase] += elapsed - compiling
        seconds["compiling"] += compiling
        self.mark, self.compile_mark = now, counters["compile_seconds"]
        self.record.update(time=now, compiles=counters["compiles"])

    def _switch(self, phase: str) -> str:
        self._account()
        previous, self.phase = self.phase, phase
        return previous

    def training(self) -> float:
        """The loop begins; returns the time."""
        self._switch("training")
        self.record["loop_start"] = self.mark
        self.write()
        return self.mark

    @contextlib.contextmanager
    def pause(self, phase: str, count: bool = True):
        """An evaluation or a checkpoint save inside (or around) the loop (`count`: one more of them)."""
        previous = self._switch(phase)
        if count:
            self.record["evaluations" if phase == "evaluation" else "checkpoint_pauses"] += 1
        try:
            yield
        finally:
            self._switch(previous)

    def after_step(self, step: int) -> None:
        """Rewrites the record at each logging window and at least every WRITE_EVERY_S."""
        self.record["step"] = step
        if step % self.log_every == 0 or time.time() - self.last_write > WRITE_EVERY_S:
            self._account()
            self.write()

    def closing(self) -> None:
        """The loop is over (done, stopped or failing): what follows is closing."""
        self._switch("closing")

    def end(self, preempted: bool) -> None:
        """The last write: how the launch ended (an exception on its way out: a failure)."""
        error = sys.exc_info()[1]
        if error is None:
            ended = "SIGTERM" if preempted else "finished"
        elif isinstance(error, storage.StorageError) or type(error).__name__ == "HostLostError":
            ended = "exit 75"
        elif isinstance(error, SystemExit) and error.code in (0, None):
            ended = "finished"
        else:
            reason = str(error.code if isinstance(error, SystemExit) else repr(error)).strip().splitlines()
            ended = "failed: " + (reason[-1][:200] if reason else type(error).__name__)
        self._account()
        self.record["ended"] = ended
        if self.on:
            number = self.write()
            self.uploads.close()
            self.uploads.wait(number, 1.0 if self.uploads.failing else 15.0)  # storage down: not for long

    def write(self) -> int:
        """Ask for the record to be written as it is now (best effort, in the background)."""
        if not self.on:
            return 0
        with self._lock:
            self.text = json.dumps(self.record, indent=1)
        self.last_write = time.time()
        return self.uploads.request()

    def _write(self) -> None:
        with self._lock:
            text = self.text
        storage.write_bytes(self.url, text.encode(), attempts=1)


def first_launch_start(run_dir: str) -> float:
    """When the run in `run_dir` was first launched: its oldest launch record's process_start, or
    this process's start (`process_start_time`, what this launch's record says) when none is
    written yet. With the directory's URL it names the run: a run started again in the same
    directory after it was deleted is another run, with another first launch."""
    return min([r["process_start"] for r in read_launches(run_dir)] + [process_start_time()])
