"""Running a study: its runs one after another, each as `python train.py PRESET FLAGS --run.dir
OUT/NAME` in a process of its own, and the study directory that records how each went:

    OUT/study.txt                the study file as run
    OUT/study/runs.json          every run of the study (name, preset, flags, configuration, line)
    OUT/study/status/NAME.json   a started run: running, done, failed or stopped; the host, the
                                 attempts, the exit status, the last line train.py printed, times
    OUT/study/hosts/host_I.json  host I's share of the runs, the run it is on, how many are done
    OUT/NAME/                    the run's own directory (train.py's: config, checkpoints, metrics,
                                 TensorBoard, logs, final.json once it finished)

A run whose final.json exists is skipped; a started one resumes from its checkpoint (train.py's
own resume); one that exits 75 (a relaunch may help: storage down, a hang) is launched again up
to `retries` times, then the study exits 75 too, so that `launch.sh study --retry` relaunches
it; any other failure is recorded as failed with its last line, and the study goes on. SIGTERM
or Ctrl-C stops the study after the run under way has saved its checkpoint (train.py gets the
signal, from the study if not already from the system), and a relaunch carries on from there.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import storage
from config import ensure_demo_data
from launches import LAUNCH_STARTED_ENV, STUDY_HOST_ENV
from lifecycle import EXIT_RETRYABLE  # train.py's: a relaunch may help
from projection import slice_spec
from report import format_duration
from study_plan import StudyError, StudyRun, dataset_sizes, projected_hours, split_over_hosts

PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))
FORWARD_AFTER_S = 2.0
"""A signal the study gets is passed to the run under way unless it says within this long that
it got one itself (on a VM that shuts down, every process gets SIGTERM: a second one would make
train.py exit at once, without saving)."""
STATE_ENV = "TRM_STUDY_STATE"
"""A local file where the study keeps one line of where it is (worker.sh's status shows it)."""


def status_url(out: str, name: str) -> str:
    return storage.join_url(out, "study", "status", f"{name}.json")


def read_status(out: str, name: str) -> dict | None:
    url = status_url(out, name)
    return json.loads(storage.read_bytes(url)) if storage.exists(url) else None


def finished(out: str, name: str) -> bool:
    """The run trained all its steps and evaluated (train.py wrote its final.json)."""
    return storage.exists(storage.join_url(out, name, "final.json"))


def run_costs(runs: list[StudyRun]) -> dict[str, float]:
    """Each run's projected hours on one v4 host at full speed: what the split balances (only
    their ratios matter). Reads every run's dataset sizes."""
    spec, sizes, costs = slice_spec("v4-8"), {}, {}
    for run in runs:
        config = run.config()
        ensure_demo_data(config)
        path = config.data.path
        if path not in sizes:
            try:
                sizes[path] = dataset_sizes(path)
            except Exception as e:  # noqa: BLE001 - the same refusal whatever the cause
                raise StudyError(f"run {run.name}: cannot read the size of its dataset {path} ({e}); every "
                                 "host needs every run's size to split the study the same way") from None
        costs[run.name] = projected_hours(run, spec, 1.0, sizes[path])["hours"]
    return costs


class StudyRunner:
    """Runs `runs` (this host's share with host/hosts) into `out`, one after another."""

    def __init__(self, runs: list[StudyRun], out: str, study_text: str, host: int | None = None,
                 hosts: int | None = None, extra_flags: tuple[str, ...] = (), retries: int = 2,
                 whole_slice: bool = False, python: str = sys.executable):
        self.runs, self.out, self.text = runs, out, study_text
        self.host, self.hosts, self.extra, self.retries = host, hosts, tuple(extra_flags), retries
        self.whole_slice, self.python = whole_slice, python
        self.stopping: str | None = None  # the signal that asked the study to stop
        self.child: subprocess.Popen | None = None
        self.child_signalled = threading.Event()  # the run under way said it got a signal
        self.counts = {"done": 0, "failed": 0, "skipped": 0}

    def say(self, text: str) -> None:
        print(f"study: {text}", flush=True)

    # -- the study directory ---------------------------------------------------------------------

    def _write(self, url: str, record: dict) -> None:
        storage.write_bytes(url, json.dumps(record, indent=2).encode())

    def record(self, run: StudyRun, state: str, **fields) -> None:
        previous = read_status(self.out, run.name) or {}
        record = {**previous, "name": run.name, "state": state, "host": self.host, "time": time.time(), **fields}
        self._write(status_url(self.out, run.name), record)

    def where(self, share: list[StudyRun], current: str | None) -> None:
        """This host's place in the study: in the study directory and, for worker.sh, locally."""
        state = {"out": self.out, "host": self.host, "hosts": self.hosts, "runs": len(share), "current": current,
                 **self.counts, "time": time.time()}
        if self.host is not None:
            self._write(storage.join_url(self.out, "study", "hosts", f"host_{self.host}.json"),
                        dict(state, share=[r.name for r in share]))
        local = os.environ.get(STATE_ENV)
        if local:
            on = f"on {current} ({[r.name for r in share].index(current) + 1} of {len(share)}), " if current else ""
            with open(local, "w") as f:
                f.write(f"{on}{self.counts['done']} done, {self.counts['failed']} failed, "
                        f"{self.counts['skipped']} finished before, of {len(share)} runs\n")

    # -- signals -----------------------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.stopping:  # a second signal: the run under way stops at once too
            if self.child and self.child.poll() is None:
                self.child.send_signal(signum)
            return
        self.stopping = name
        self.say(f"{name}: stopping after the run under way has saved its checkpoint")
        threading.Thread(target=self._forward, args=(signum,), daemon=True).start()

    def _forward(self, signum) -> None:
        if not self.child_signalled.wait(FORWARD_AFTER_S) and self.child and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    # -- running -------------------------------------------------------------------------------------

    def share(self) -> list[StudyRun]:
        if self.hosts is None:
            return list(self.runs)
        shares = split_over_hosts(run_costs(self.runs), self.hosts)
        by_name = {r.name: r for r in self.runs}
        return [by_name[name] for name in shares[self.host]]

    def wandb_flags(self, run: StudyRun) -> list[str]:
        """For a run mirrored to W&B (--report.wandb-project among its flags or the study's): the
        study's name (its directory's last part) as the W&B group, its configuration as a tag
        (the run's own flags come after, so they may say otherwise)."""
        if not any(f.split("=")[0] == "--report.wandb-project" for f in (*run.flags, *self.extra)):
            return []
        return ["--report.wandb-group", self.out.rstrip("/").rsplit("/", 1)[-1],
                "--report.wandb-tags", run.configuration[:64]]  # W&B's longest tag

    def launch(self, run: StudyRun) -> tuple[int, str]:
        """train.py for `run`, its output passed through; (exit status, the last line it printed)."""
        command = [self.python, os.path.join(PROJECT_DIR, "train.py"), run.preset, *self.wandb_flags(run),
                   *run.flags, *self.extra, "--run.dir", storage.join_url(self.out, run.name)]
        self.child_signalled.clear()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{LAUNCH_STARTED_ENV: repr(time.time())},
                   **({} if self.host is None else {STUDY_HOST_ENV: str(self.host)}))  # for its launch record
        self.child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=PROJECT_DIR)
        last = ""
        for line in self.child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last = line.strip()
            if line.startswith(("SIGTERM: stopping", "SIGINT: stopping")):
                self.child_signalled.set()
        return self.child.wait(), last

    def run(self) -> int:
        """Run this host's share; the exit status (0: every run done or recorded failed, or stopped
        on a signal; EXIT_RETRYABLE: a run kept exiting 75)."""
        storage.write_bytes(storage.join_url(self.out, "study.txt"), self.text.encode())
        self._write(storage.join_url(self.out, "study", "runs.json"),
                    {"runs": [{"name": r.name, "preset": r.preset, "flags": list(r.flags), "line": r.line,
                               "configuration": r.configuration} for r in self.runs]})
        share = self.share()
        where = "" if self.hosts is None else f"host {self.host} of {self.hosts}: "
        self.say(f"{where}{len(share)} of {len(self.runs)} runs into {self.out}: "
                 + ", ".join(r.name for r in share))
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        started = time.time()
        try:
            for index, run in enumerate(share, start=1):
                if self.stopping:
                    break
                status = self.run_one(run, f"[{index}/{len(share)}] {run.name}", share)
                if status is not None:
                    return status
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.where(share, None)
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        if self.stopping:
            self.say(f"stopped ({self.stopping}): {counts}; run the same command again to go on")
        else:
            self.say(f"{where}done in {format_duration(time.time() - started)}: {counts}"
                     + (f" (their last lines are in {self.out}/study/status/)" if self.counts["failed"] else ""))
        return 0

    def run_one(self, run: StudyRun, label: str, share: list[StudyRun]) -> int | None:
        """Run one run to its end; an exit status when the study must stop with it, else None."""
        if finished(self.out, run.name):
            self.counts["skipped"] += 1
            self.say(f"{label}: finished before, skipped")
            return None
        before = read_status(self.out, run.name) or {}
        attempts, seconds_total = before.get("attempts", 0), before.get("seconds_total", 0.0)
        for retry in range(self.retries + 1):
            attempts += 1
            self.where(share, run.name)
            self.record(run, "running", attempts=attempts, started=time.time())
            self.say(f"{label}: {'resuming or starting' if attempts > 1 else 'starting'} (attempt {attempts}): "
                     f"train.py {' '.join([run.preset, *run.flags, *self.extra])}")
            began = time.time()
            status, last = self.launch(run)
            seconds_total += time.time() - began
            fields = dict(attempts=attempts, exit=status, last_line=last, seconds=time.time() - began,
                          seconds_total=seconds_total)
            if status == 0 and finished(self.out, run.name):
                self.counts["done"] += 1
                final = json.loads(storage.read_bytes(storage.join_url(self.out, run.name, "final.json")))
                self.record(run, "done", **fields)
                self.say(f"{label}: done in {format_duration(fields['seconds'])}: exact accuracy "
                         f"{100 * final['metrics'].get('exact_accuracy', float('nan')):.2f}%")
                return None
            if status == 0:  # saved and stopped on a signal the study did not get itself
                self.stopping = self.stopping or "the run was stopped"
            if self.stopping:
                self.record(run, "stopped", **fields)
                self.say(f"{label}: stopped (exit {status}); it resumes from its checkpoint when the study runs again")
                return None
            if status == EXIT_RETRYABLE or (self.whole_slice and status != 1):
                self.record(run, "retrying", **fields)
                if retry < self.retries and not self.whole_slice:
                    self.say(f"{label}: exit {status} (a relaunch may help): launching it again; last line: {last}")
                    time.sleep(5)
                    continue
                self.say(f"{label}: exit {status}; last line: {last}; stopping the study with status "
                         f"{EXIT_RETRYABLE} (relaunching it resumes this run)")
                return EXIT_RETRYABLE
            self.counts["failed"] += 1
            self.record(run, "failed", **fields)
            self.say(f"{label}: failed (exit {status}), going on with the next run; its last line: {last}")
            return None
        return None
