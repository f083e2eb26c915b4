"""Running a study: each `study.py run` process (one per VM of a fleet, any number, started at any
time) claims the next unfinished run, longest first, in the study directory (fleet/claims.py), trains it
as `python train.py PRESET FLAGS --run.dir OUT/NAME` in a process of its own under a lease it
renews, and claims the next, until every run is done or failed:

    OUT/study.txt                 the study file as run
    OUT/study/runs.json           every run of the study (name, preset, flags, configuration, line)
    OUT/study/claims/NAME/G.json  generation G of the run's claim: its holder and state (fleet/claims.py)
    OUT/study/status/NAME.json    a started run: running, done, failed or stopped; its holder, the
                                  attempts, the exit status, the last line train.py printed, times
    OUT/study/holders/HOLDER.json a holder (a VM, or a process): the run it is on, how many it did
    OUT/NAME/                     the run's own directory (train.py's: config, checkpoints, metrics,
                                  TensorBoard, logs, final.json once it finished)

The trainer is fenced (fleet/fencing.py): it may write into its run directory only until half a lease
after the start of the holder's last good renewal, stops at once when that deadline passes, when
the holder loses the claim, or when the holder dies (a pipe's end of file, and the kernel's
parent-death signal), so that at any moment at most one trainer of a run can change its run
directory. Two threads keep the lease: one renews it every lease/8 (any failure is counted and
retried, never fatal to the thread), one watches the deadline and kills the trainer when it
passes, whatever the renewing thread is doing.

A run whose final.json exists is skipped; a run taken over (its holder's lease went stale: the
holder was killed or preempted) or handed back resumes from its checkpoint (train.py's own
resume). A run that exits 75 (a relaunch may help: storage down, a hang) is launched again up to
`retries` times, then handed back and the study exits 75 too, so that `launch.sh study --retry`
relaunches it; any other failure is recorded as failed with its last line, and the study goes on
(a process that first saw the run before it failed tries it once more). SIGTERM or Ctrl-C stops the study after
the run under way has saved its checkpoint (train.py gets the signal, from the study if not
already from the system) and hands the run back, and a relaunch carries on from there. A process
with nothing left to claim waits while other holders train, to take over a run whose lease goes
stale, and ends when every run is done or failed.

A study file's `@test-time` grid adds an evaluation of each finished run at each setting, claimed
and recorded as a run is, under the name RUN+SETTING, after every training run (fleet/testtime_grid.py).

On a multi-host slice every host runs the study (`whole_slice`): worker 0 claims, and the other
workers train the run their slice's holder (the same name on every host) holds. A run's end is
worker 0's record (its final.json, then its claim's last write): a follower whose trainer ended
waits for it (up to a lease) and never infers the end from its own trainer's exit. A follower's
trainer is fenced like worker 0's, its deadline from worker 0's claim as the follower reads it
(`_follow`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from fleet import fencing
from fleet.claims import Claims, process_identity
from fleet.plan import StudyRun, dataset_sizes, projected_hours
from fleet.testtime_grid import Evaluation, evaluations
from puzzles.builders import ensure_demo_data
from rundir import storage
from rundir.contract import EXIT_RETRYABLE, FINAL, LAUNCH_STARTED_ENV, STUDY_HOST_ENV, format_duration
from tpu_costs.slices import slice_spec
from training.config import reads_demo_data

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: train.py and the packages
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


def absolute(url: str, base: str | None = None) -> str:
    """A local path made absolute against `base` (default: this process's directory); a URL as it is.
    A study resolves its directory once, where it starts: its trainers run in the checkout
    (PROJECT_DIR), and a relative path would name another directory there."""
    if "://" in url:
        return url
    return os.path.abspath(url if base is None else os.path.join(base, url))


def finished(out: str, name: str) -> bool:
    """The run trained all its steps and evaluated (train.py wrote its final.json)."""
    return storage.exists(storage.join_url(out, name, FINAL))


def run_costs(runs: list[StudyRun]) -> dict[str, float]:
    """Each run's projected hours on one v4 host at full speed: what orders the claims, longest
    first (only their ratios matter). Reads every run's dataset sizes; a run whose dataset cannot
    be read costs 0, claimed last (its train.py then fails, naming the dataset)."""
    spec, sizes, costs = slice_spec("v4-8"), {}, {}
    for run in runs:
        config = run.config()
        if reads_demo_data(config):
            ensure_demo_data(absolute(config.data.path, PROJECT_DIR))
        path = absolute(config.data.path, PROJECT_DIR)  # where its trainer (cwd PROJECT_DIR) reads it
        if path not in sizes:
            try:
                sizes[path] = dataset_sizes(path)
            except Exception as e:  # noqa: BLE001 - the same answer whatever the cause
                sizes[path] = None
                print(f"study: cannot read the size of dataset {path} ({e}): its runs are claimed last", flush=True)
        costs[run.name] = 0.0 if sizes[path] is None else projected_hours(run, spec, 1.0, sizes[path])["hours"]
    return costs


def default_holder() -> str:
    """This process's holder name when none is given: the machine and the process id (a fleet's VM
    gets NAME@ZONE from launch.sh)."""
    return f"{socket.gethostname()}-{os.getpid()}"


class StudyRunner:
    """Claims and trains `runs` into `out` as `holder`, one at a time, until every run is over."""

    def __init__(self, runs: list[StudyRun], out: str, study_text: str, holder: str | None = None,
                 lease_s: float = 120.0, extra_flags: tuple[str, ...] = (), retries: int = 2,
                 whole_slice: bool = False, worker: int = 0, python: str = sys.executable):
        self.runs, self.out, self.text = runs, absolute(out), study_text  # trainers run elsewhere: made absolute
        self.holder = holder or default_holder()
        self.lease_s, self.extra, self.retries = lease_s, tuple(extra_flags), retries
        self.whole_slice, self.worker, self.python = whole_slice, worker, python
        self.claims = Claims(self.out, self.holder, lease_s)
        self.started = time.time()
        self.first_seen: dict[str, int] = {}  # run -> the generation of its claim this process saw first
        self.stopping: str | None = None  # the signal that asked the study to stop
        self.child: subprocess.Popen | None = None
        self.child_signalled = threading.Event()  # the run under way said it got a signal
        self.lost = threading.Event()  # the lease of the run under way went to another holder
        self.generation = 0  # the newest generation this process wrote of the run under way's claim
        self.deadline = 0.0  # time.monotonic() until which the run under way's trainer may write
        self.lease: fencing.Lease | None = None  # the trainer's end of the lease, while one runs
        self.renewal_failures = 0  # renewals in a row that raised
        self.claim_lock = threading.Lock()
        """Every write of a claim by this process (claim_next's, the renewals, the last), one at a time."""
        self.term = 0
        """This process's claims, counted: each renewal and deadline thread acts only while the term it was
        started for is the current one (a stalled renewal of a run that ended never touches the next)."""
        self.state_lock = threading.Lock()
        """The term, the trainer and its lease: held for no storage request, so that the deadline's watcher
        never waits for a stalled write."""
        self.ended = threading.Event()  # the run under way ended: no more renewals
        self.tried: set[str] = set()  # failed runs this process tried again
        self.since = 0  # the generation of the claim under way's first write by this process
        self.followed: set[tuple] = set()  # (run, since) of worker 0's claims this worker trained
        self.looks: dict[str, tuple[float, int]] = {}
        """A follower's last look at each run's claim: (time.monotonic at its start, the generation it saw)."""
        self.looked = 0.0  # the start of a follower's last look at the claim it follows
        self.counts = {"done": 0, "failed": 0, "skipped": 0}
        self.over: set[str] = set()  # the names of the runs and evaluations this process found done

    def say(self, text: str) -> None:
        print(f"study: {text}", flush=True)

    # -- the study directory ---------------------------------------------------------------------

    def _write(self, url: str, record: dict) -> None:
        storage.write_bytes(url, json.dumps(record, indent=2).encode())

    def record(self, run: StudyRun, state: str, **fields) -> None:
        if self.worker > 0:  # worker 0 records the slice's runs
            return
        previous = read_status(self.out, run.name) or {}
        record = {**previous, "name": run.name, "state": state, "host": self.holder, "time": time.time(), **fields}
        self._write(status_url(self.out, run.name), record)

    def where(self, current: str | None) -> None:
        """This holder's place in the study: in the study directory and, for worker.sh, locally."""
        if self.worker == 0:
            self._write(storage.join_url(self.out, "study", "holders", f"{self.holder}.json"),
                        {"out": self.out, "holder": self.holder, "current": current, **self.counts,
                         "time": time.time()})
        local = os.environ.get(STATE_ENV)
        if local:
            with open(local, "w") as f:
                f.write(f"{'on ' + current + ', ' if current else ''}{self.counts['done']} done, "
                        f"{self.counts['failed']} failed, {self.counts['skipped']} finished before, of "
                        f"{len(self.runs)} runs ({self.holder})\n")

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

    # -- claims ------------------------------------------------------------------------------------

    def done(self, item: StudyRun | Evaluation) -> bool:
        """A run trained to its end, or a test-time setting of one evaluated (fleet/testtime_grid.py).
        A yes is remembered: final.json and metrics.json are written last and never removed, so
        each pass over the study asks storage only about what is not over yet."""
        if item.name not in self.over:
            if item.done() if isinstance(item, Evaluation) else finished(self.out, item.name):
                self.over.add(item.name)
        return item.name in self.over

    def _patiently(self, what: str, fn):
        """fn() (a claim operation, whose own retries fit in an eighth of the lease), tried again
        every lease/8 while it raises, for up to storage.RETRY_BUDGET_S in all. Any exception is
        retried (an unexpected one is printed with its traceback): past the budget it is raised as
        a StorageError, so that the study exits 75 and is relaunched, never 1."""
        started = time.monotonic()
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - the study process outlives any one failure
                if not isinstance(e, storage.StorageError):
                    self.say(f"{what} raised an unexpected {type(e).__name__}:\n{traceback.format_exc().rstrip()}")
                if time.monotonic() - started > storage.RETRY_BUDGET_S:
                    if isinstance(e, storage.StorageError):
                        raise
                    raise storage.StorageError(f"{what} failed: {type(e).__name__}: {e}") from e
                self.say(f"{what} failed ({type(e).__name__}: {e}); trying again")
                time.sleep(max(0.5, self.lease_s * fencing.RENEW_FRACTION))

    def claim_next(self, order: list[StudyRun]) -> tuple[StudyRun | None, int]:
        """(the run this process now holds, None if none, the number of runs other holders hold)."""
        held = 0
        for run in order:
            if self.done(run) or (isinstance(run, Evaluation) and not self.done(run.run)):
                continue  # an evaluation waits for its run's end (a run held elsewhere keeps this process waiting)
            looked = time.monotonic()
            current = self.claims.current(run.name)
            generation, record = current or (0, {"state": "free"})
            state, holder = record["state"], record.get("holder")
            # A failure recorded after this process first saw the run is not retried by it (no
            # clock is compared across VMs: the claim's generations order the events).
            first = self.first_seen.setdefault(run.name, generation)
            failed_since = state == "failed" and generation > first
            if self.whole_slice and self.worker > 0:  # follow worker 0's claims, each once
                key = (run.name, record.get("since"))
                before, self.looks[run.name] = self.looks.get(run.name), (looked, generation)
                if state == "running" and holder == self.holder and key not in self.followed:
                    # The trainer's first deadline: half a lease after a look that had not seen this
                    # generation yet (it landed after that look began); none before the claim has moved
                    # under this process's eyes, nor one too close to give a renewal time to be seen.
                    deadline = before[0] + fencing.LEASE_FRACTION * self.lease_s \
                        if before and before[1] != generation else 0.0
                    if deadline - time.monotonic() > self.lease_s * fencing.RENEW_FRACTION:
                        self.followed.add(key)
                        with self.state_lock:
                            self.term += 1
                            self.generation, self.since, self.deadline = generation, record.get("since"), deadline
                            self.looked = looked
                        return run, generation
                held += not (state == "done" or failed_since)
                continue
            if state == "done" or (state == "failed" and (failed_since or run.name in self.tried)):
                continue
            mine = state == "running" and self.claims.mine(record)  # its trainer was stopped: the lease lapsed
            gone = state == "running" and (mine or self.claims.gone(record))
            take = state in ("free", "released", "failed") or gone or self.claims.stale(run.name, generation)
            if take and self._claim(run, generation, holder):
                if state == "failed":
                    self.tried.add(run.name)
                if state == "running":
                    why = ("this process's own, its trainer stopped" if mine else
                           "was held by a process of this machine that ended" if gone else "went stale")
                    who = holder or "an unknown holder (its claim file empty or unreadable: a write that crashed)"
                    self.say(f"{run.name}: taking over from {who} (its lease, generation {generation}, {why})")
                return run, self.generation
            held += 1
        return None, held

    def _claim(self, run: StudyRun, generation: int, holder: str | None) -> bool:
        """Write generation+1 of `run`'s claim (a claim or a takeover): under the claim lock, so
        that it never overlaps a renewal still under way of the run before; if it won, a new term."""
        with self.claim_lock:
            written = self.claims.write(run.name, generation, "running", took_from=holder, since=generation + 1)
            if not written:
                return False
            with self.state_lock:
                self.term += 1
                self.generation = self.since = written
                self.deadline = self._deadline_after_claim(run)
            return True

    def _deadline_after_claim(self, run: StudyRun) -> float:
        """The trainer's deadline after a good claim write: half a lease (fencing.LEASE_FRACTION)
        after the write's first try (an earlier write's retry may be what wrote it)."""
        return self.claims.started[run.name] + fencing.LEASE_FRACTION * self.lease_s

    def _renew(self, run: StudyRun, done: threading.Event, term: int) -> None:
        """Renew the lease on `run` every lease/8 until `done`; each good renewal moves the
        trainer's deadline to half a lease after the renewal's start. A renewal that finds a
        generation it did not write has lost the run: its trainer is killed at once, unsaved
        (its new holder resumes the run from the last checkpoint). Any other failure is counted
        and tried again at the next renewal: this thread ends only with the run or the lease,
        and the deadline's watcher (`_watch_deadline`) stops the trainer if renewals keep failing.
        It acts only for its own `term`: a renewal that returns after its run ended (a stalled
        write) changes nothing of the next run's, and kills no trainer."""
        try:
            while not done.wait(self.lease_s * fencing.RENEW_FRACTION):
                try:
                    with self.claim_lock:
                        if done.is_set() or self.lost.is_set() or self.term != term:
                            return
                        trainer = process_identity(self.child.pid) if self.child else None
                        won = self.claims.write(run.name, self.generation, "running", since=self.since,
                                                trainer=trainer)
                        if done.is_set() or self.lost.is_set() or self.term != term:
                            return  # the run ended meanwhile: the claim's next writer reads what landed
                        if won:
                            self.generation = won
                        else:
                            self._lose(run, "another holder took it over", term)
                            return
                except Exception as e:  # noqa: BLE001 - storage, gcsfs, asyncio: all the same here
                    self._renewal_failed(run, "renewing its lease", e)
                    continue
                with self.state_lock:
                    if self.term != term or done.is_set():
                        return
                    self.renewal_failures = 0
                    self.deadline = max(self.deadline, self._deadline_after_claim(run))
                    if self.lease:
                        self.lease.extend(self.deadline)
        except BaseException as e:  # never silently: the watcher stops the trainer at the deadline
            self.say(f"{run.name}: the lease's renewals stopped ({type(e).__name__}: {e}); its trainer stops at "
                     "its deadline")
            raise

    def _renewal_failed(self, run: StudyRun, doing: str, error: Exception) -> None:
        """Count a failed renewal (a holder's claim write, or a follower's read of worker 0's claim)
        and say so at the 1st, 3rd and every 20th in a row, with how long its trainer may still write."""
        self.renewal_failures += 1
        if self.renewal_failures in (1, 3) or self.renewal_failures % 20 == 0:
            left = self.deadline - time.monotonic()
            self.say(f"{run.name}: {doing} failed ({self.renewal_failures} in a row; "
                     f"{type(error).__name__}: {error}); its trainer may write for {max(0.0, left):.1f} s more")

    def _follow(self, run: StudyRun, done: threading.Event, term: int) -> None:
        """A follower's lease: read worker 0's claim every lease/8 until `done`. Each generation
        newer than the last one seen moves the trainer's deadline to half a lease after the start of
        the look before (the newest look that had not seen it: the renewal landed after it began,
        and an observer takes the run over no earlier than a lease after it landed). A claim that
        moved to another holder or attempt (worker 0 deposed) kills the trainer at once; worker 0's
        last write (done, released, failed) ends the renewals. A failed look is counted and tried
        again: the deadline's watcher stops the trainer if no renewal is seen in time."""
        seen, looked = self.generation, self.looked
        while not done.wait(self.lease_s * fencing.RENEW_FRACTION):
            start = time.monotonic()
            try:
                generation, record = self.claims.current(run.name) or (0, {"state": "free"})
            except Exception as e:  # noqa: BLE001 - storage, gcsfs, asyncio: all the same here
                self._renewal_failed(run, "reading worker 0's claim", e)
                continue
            if record.get("state") != "running":
                return  # worker 0's last write: the run ends, no more renewals
            if (record.get("holder"), record.get("since")) != (self.holder, self.since) or generation < seen:
                self._lose(run, f"worker 0's claim went to {record.get('holder')} (generation {generation}, "
                                f"attempt {record.get('since')})", term)
                return
            with self.state_lock:
                if self.term != term or done.is_set():
                    return
                self.renewal_failures = 0
                if generation != seen:
                    self.deadline = max(self.deadline, looked + fencing.LEASE_FRACTION * self.lease_s)
                    if self.lease:
                        self.lease.extend(self.deadline)
            seen, looked = generation, start

    def _watch_deadline(self, run: StudyRun, done: threading.Event, term: int) -> None:
        """Kill the trainer once its deadline has passed (renewals failing or stuck): on this
        machine's monotonic clock, whatever the renewing thread does (it takes no lock a claim
        write holds)."""
        while not done.wait(min(1.0, self.lease_s / 20)):
            if time.monotonic() >= self.deadline and not self.lost.is_set():
                self._lose(run, (f"no renewal of worker 0's claim seen in time ({self.renewal_failures} looks "
                                 "failed)") if self.whole_slice and self.worker > 0 else
                           f"no renewal succeeded in {fencing.LEASE_FRACTION * self.lease_s:g} s "
                           f"({self.renewal_failures} failed)", term)
                return

    def _lose(self, run: StudyRun, why: str, term: int) -> None:
        """The lease of `term` is lost: its trainer stops at once. Nothing happens once another
        term began (the run ended and this process claimed again)."""
        with self.state_lock:
            if self.term != term or self.lost.is_set():
                return
            self.lost.set()
            if self.lease:
                self.lease.lost()
            child = self.child
            if child and child.poll() is None:
                child.kill()
        self.say(f"{run.name}: lease lost ({why}): stopping its train.py at once, without saving")

    def release(self, run: StudyRun, state: str) -> None:
        """The claim's last write by this holder: done, failed or released (anyone may take it)."""
        with self.claim_lock:
            self.ended.set()  # no renewal after this write
            if (self.whole_slice and self.worker > 0) or self.lost.is_set():
                return
            won = self._patiently(f"{run.name}: writing its claim's {state}",
                                  lambda: self.claims.write(run.name, self.generation, state))
        if not won:
            self.say(f"{run.name}: its claim moved on while it ended (another holder took it over)")

    def _await_end(self, run: StudyRun, status: int) -> None:
        """A follower's trainer ended (exit `status`): the run's end is worker 0's record, never this
        host's exit (worker 0 writes final.json after its last commit, and nothing orders the hosts
        after that). Wait until the run's final.json exists, or worker 0's claim that this host
        followed ends (done, released, failed) or moves to another holder or attempt, for up to a
        lease, looking at storage every lease/8 (at most every second), and while no signal stops
        the study."""
        if self.done(run):
            return
        self.say(f"{run.name}: this host's train.py ended (exit {status}); waiting for worker 0's end of the run "
                 f"(its {FINAL}, or its claim's last write), up to {self.lease_s:g} s")
        until = time.monotonic() + self.lease_s
        while not self.stopping and time.monotonic() < until:
            try:
                if self.done(run):
                    return
                generation, record = self.claims.current(run.name) or (0, {"state": "free"})
                if (record.get("state"), record.get("holder"), record.get("since")) != \
                        ("running", self.holder, self.since):
                    self.done(run)  # (final.json is written before the claim's done)
                    return
            except Exception as e:  # noqa: BLE001 - a failed look is tried again until the bound
                self.say(f"{run.name}: looking for worker 0's end of the run failed ({type(e).__name__}: {e})")
            time.sleep(max(0.05, min(1.0, self.lease_s * fencing.RENEW_FRACTION)))
        if not self.stopping:
            self.say(f"{run.name}: worker 0 recorded no end of the run in {self.lease_s:g} s")

    # -- running -------------------------------------------------------------------------------------

    def wandb_flags(self, run: StudyRun) -> list[str]:
        """For a run mirrored to W&B (--report.wandb-project among its flags or the study's): the
        study's name (its directory's last part) as the W&B group, its configuration as a tag
        (the run's own flags come after, so they may say otherwise)."""
        if not any(f.split("=")[0] == "--report.wandb-project" for f in (*run.flags, *self.extra)):
            return []
        return ["--report.wandb-group", self.out.rstrip("/").rsplit("/", 1)[-1],
                "--report.wandb-tags", run.configuration[:64]]  # W&B's longest tag

    def launch(self, run: StudyRun) -> tuple[int, str]:
        """train.py for `run` (or `train.py eval` for a test-time Evaluation), its output passed
        through, fenced by the lease (fleet/fencing.py): it dies with this process and stops at its
        deadline; (exit status, the last line it printed)."""
        run_dir = run.directory if isinstance(run, Evaluation) else storage.join_url(self.out, run.name)
        command = run.command(self.python, self.extra) if isinstance(run, Evaluation) else \
            [self.python, os.path.join(PROJECT_DIR, "train.py"), run.preset, *self.wandb_flags(run), *run.flags,
             *self.extra, "--run.dir", run_dir]
        self.child_signalled.clear()
        lease = fencing.Lease(self.deadline, run_dir)  # a follower's deadline comes from worker 0's claim
        env = dict(os.environ, PYTHONUNBUFFERED="1", **lease.child_env(),
                   **{LAUNCH_STARTED_ENV: repr(time.time()), STUDY_HOST_ENV: self.holder})  # for its launch record
        with self.claim_lock, self.state_lock:  # a renewal now sends to this child's pipe
            try:
                self.child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              env=env, cwd=PROJECT_DIR, pass_fds=(lease.read_fd,),
                                              preexec_fn=fencing.parent_death_signal())
            finally:
                lease.started()
            self.lease = lease
            lease.extend(self.deadline)  # a renewal made (or seen) while it started
        last = ""
        for line in self.child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                last = line.strip()
            if line.startswith(("SIGTERM: stopping", "SIGINT: stopping")):
                self.child_signalled.set()
        status = self.child.wait()
        with self.state_lock:
            self.lease = None
        lease.close()
        return status, last

    def run(self) -> int:
        """Claim and train runs until none is left; the exit status (0: every run done or recorded
        failed, or stopped on a signal; EXIT_RETRYABLE: a run kept exiting 75)."""
        storage.write_bytes(storage.join_url(self.out, "study.txt"), self.text.encode())
        self._write(storage.join_url(self.out, "study", "runs.json"),
                    {"runs": [{"name": r.name, "preset": r.preset, "flags": list(r.flags), "line": r.line,
                               "configuration": r.configuration} for r in self.runs]})
        costs = run_costs(self.runs)
        order = sorted(self.runs, key=lambda r: (-costs[r.name], r.name)) + evaluations(self.runs, self.text, self.out)
        role = f"worker {self.worker} of slice {self.holder}, following worker 0's claims" if self.worker else \
            f"holder {self.holder}"
        tests = len(order) - len(self.runs)
        self.say(f"{role}: {len(self.runs)} runs in {self.out}, claimed longest first, lease {self.lease_s:g} s"
                 + (f"; then {tests} test-time evaluations of the finished runs" if tests else ""))
        before = [r.name for r in order if self.done(r)]
        if before:
            self.say(f"finished before, skipped: {', '.join(before)}")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        waiting_said = None
        try:
            while not self.stopping:
                run, held = self._patiently("claiming a run", lambda: self.claim_next(order))
                if run is None and not held:
                    break
                if run is None:
                    if waiting_said != held:
                        self.say(f"waiting: {held} run(s) held by other holders (taken over if a lease goes "
                                 f"stale for {self.lease_s:g} s)")
                        waiting_said = held
                    time.sleep(min(self.lease_s / 4, 10.0))
                    continue
                waiting_said = None
                status = self.run_one(run)
                if status is not None:
                    return status
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.where(None)
        self.counts["skipped"] = sum(self.done(r) for r in order) - self.counts["done"]
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        if self.stopping:
            self.say(f"stopped ({self.stopping}): {counts}; run the same command again to go on")
        else:
            self.say(f"{self.holder}: every run is over in {format_duration(time.time() - self.started)}: "
                     f"{counts} by this holder or before"
                     + (f" (failed runs' last lines are in {self.out}/study/status/)" if self.counts["failed"] else ""))
        return 0

    def run_one(self, run: StudyRun) -> int | None:
        """Train the run this process holds to its end, renewing its lease; an exit status when the
        study must stop with it, else None."""
        with self.state_lock:
            self.lost.clear()
            self.ended = threading.Event()
            self.renewal_failures = 0
            term = self.term
        follower = self.whole_slice and self.worker > 0
        threading.Thread(target=self._follow if follower else self._renew, args=(run, self.ended, term),
                         daemon=True, name="trm-follow" if follower else "trm-renew").start()
        threading.Thread(target=self._watch_deadline, args=(run, self.ended, term), daemon=True,
                         name="trm-lease-deadline").start()
        try:
            return self._train(run)
        finally:
            self.ended.set()

    def _train(self, run: StudyRun) -> int | None:
        label = run.name
        before = read_status(self.out, run.name) or {}
        attempts, seconds_total = before.get("attempts", 0), before.get("seconds_total", 0.0)
        for retry in range(self.retries + 1):
            attempts += 1
            self.where(run.name)
            self.record(run, "running", attempts=attempts, started=time.time())
            self.say(f"{label}: {'resuming or starting' if attempts > 1 else 'starting'} (attempt {attempts}): "
                     f"train.py {' '.join([run.preset, *run.flags, *self.extra])}")
            began = time.time()
            status, last = self.launch(run)
            seconds_total += time.time() - began
            fields = dict(attempts=attempts, exit=status, last_line=last, seconds=time.time() - began,
                          seconds_total=seconds_total)
            follower = self.whole_slice and self.worker > 0
            if status == fencing.EXIT_FENCED:
                self.lost.set()  # the trainer saw its deadline pass before this process did
            if self.lost.is_set():
                self.say(f"{label}: stopped, its lease lost (exit {status}); its next holder resumes it")
                return None
            if follower and not self.stopping:
                self._await_end(run, status)
            if (status == 0 or follower) and self.done(run):
                self.counts["done"] += 1
                self.record(run, "done", **fields)
                self.release(run, "done")
                if isinstance(run, Evaluation):
                    self.say(f"{label}: done in {format_duration(fields['seconds'])}: {run.summary()}")
                    return None
                final = json.loads(storage.read_bytes(storage.join_url(self.out, run.name, FINAL)))
                self.say(f"{label}: done in {format_duration(fields['seconds'])}: exact accuracy "
                         f"{100 * final['metrics'].get('exact_accuracy', float('nan')):.2f}%")
                return None
            if status == 0 and follower and not self.stopping:  # worker 0 recorded no end of the run
                self.say(f"{label}: this host's train.py exited 0 but worker 0 recorded no end of the run: "
                         "following worker 0's next claim")
                return None
            if status == 0:  # saved and stopped on a signal the study did not get itself
                self.stopping = self.stopping or "the run was stopped"
            if self.stopping:
                self.record(run, "stopped", **fields)
                self.release(run, "released")
                self.say(f"{label}: stopped (exit {status}); handed back: it resumes from its checkpoint when "
                         "a study process claims it")
                return None
            if status == EXIT_RETRYABLE or (self.whole_slice and status != 1):
                self.record(run, "retrying", **fields)
                if retry < self.retries and not self.whole_slice:
                    self.say(f"{label}: exit {status} (a relaunch may help): launching it again; last line: {last}")
                    time.sleep(5)
                    continue
                self.release(run, "released")
                self.say(f"{label}: exit {status}; last line: {last}; stopping the study with status "
                         f"{EXIT_RETRYABLE} (relaunching it resumes this run)")
                return EXIT_RETRYABLE
            self.counts["failed"] += 1
            self.record(run, "failed", **fields)
            self.release(run, "failed")
            self.say(f"{label}: failed (exit {status}), going on with the next run; its last line: {last}")
            return None
        return None
