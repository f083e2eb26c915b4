"""One trainer per run: a study's train.py may change its run directory only while its holder's
lease on the run is good, and it dies with its holder (fleet/runner.py is the holder's side).

The holder (a `study.py run` process) and its trainer run on one machine and read one clock,
CLOCK_MONOTONIC (time.monotonic: system-wide, not set back, running while a process is stopped).
Every renewal of the claim that succeeded gives the trainer a deadline on that clock: the
renewal's start plus LEASE_FRACTION of the lease. An observer on another VM takes the run over
only after it has seen the same generation for the whole lease on its own clock, so the trainer
is dead, and its writes have landed, well before any other trainer of the run can start
(docs/study-runs.md: the guarantee, its assumptions and margins). The holder passes

    TRM_FENCE_FD         a pipe's read end: a line "DEADLINE" (seconds, time.monotonic) per renewal,
                         "lost" when the holder lost the claim; its end of file: the holder died
    TRM_FENCE_DEADLINE   the first deadline (the claim's own write)
    TRM_FENCE_DIR        the run directory: the changes that ask the fence
    TRM_FENCE_PARENT     the holder's process id (a trainer whose parent is already gone stops)

and the trainer (`start_from_environment`, first thing in train.py) stops at once, with
EXIT_FENCED and a line saying why, when the deadline passes without a new one, when the holder
says "lost", when the pipe ends (the holder was killed), or when a write into the run directory
is about to start past its deadline (storage.set_fence). It saves nothing on the way out: a
deposed trainer's state is the new holder's to redo from the last checkpoint.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time

from rundir import storage
from rundir.contract import EXIT_FENCED

FD_ENV, DEADLINE_ENV, DIR_ENV, PARENT_ENV = "TRM_FENCE_FD", "TRM_FENCE_DEADLINE", "TRM_FENCE_DIR", "TRM_FENCE_PARENT"
LEASE_FRACTION = 0.5
"""A renewal started at time t (the holder's monotonic clock) lets the trainer write until
t + LEASE_FRACTION x lease; observers take over no earlier than t + lease on their own clocks."""
RENEW_FRACTION = 0.125
"""The holder renews every RENEW_FRACTION x lease: three renewals in a row may fail (storage
slow or down) before the trainer's deadline passes."""

PR_SET_PDEATHSIG = 1


def parent_death_signal():
    """A preexec_fn for subprocess.Popen: the child gets SIGKILL when the thread that started it
    ends (Linux prctl; elsewhere nothing). libc is looked up here, in the parent, so that the child
    only makes one system call between fork and exec."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec():
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return preexec


class Fence:
    """The trainer's side: the deadline, the thread that ends the process when it passes or the
    holder goes, and the check before each change to the run directory."""

    def __init__(self, fd: int, deadline: float, run_dir: str, parent: int | None = None):
        self.fd, self.deadline, self.run_dir, self.parent = fd, deadline, run_dir.rstrip("/"), parent
        self.lock = threading.RLock()
        self.pending = b""  # a line not yet whole

    def start(self) -> None:
        storage.set_fence(self.check)
        threading.Thread(target=self._watch, daemon=True, name="trm-fence").start()

    def stop(self, why: str) -> None:
        """End this process now, without saving or writing anything (not even a log copy)."""
        os.write(2, f"error: {why}: this trainer stops at once, without saving (exit status {EXIT_FENCED}); "
                    "the run's holder resumes it from its last checkpoint\n".encode())
        os._exit(EXIT_FENCED)

    def check(self, url: str) -> None:
        """Before changing `url`: past the deadline, a change to the run directory stops the process."""
        if url.rstrip("/") == self.run_dir or url.startswith(self.run_dir + "/"):
            self._read_pipe()  # the holder's latest word first
            late = time.monotonic() - self.deadline
            if late >= 0:
                self.stop(f"not writing {url}: this trainer's lease ran out {late:.1f} s ago "
                          "(its holder could not renew the run's claim, or lost it)")

    def _read_pipe(self) -> None:
        """Take every line the holder has sent so far (without waiting): new deadlines, "lost",
        or the pipe's end."""
        with self.lock:
            while True:
                try:
                    if not select.select([self.fd], [], [], 0)[0]:
                        return
                    chunk = os.read(self.fd, 4096)
                except OSError as e:
                    self.stop(f"the lease's pipe cannot be read ({e})")
                if not chunk:
                    self.stop("its study process ended (the lease's pipe closed)")
                self.pending += chunk
                *lines, self.pending = self.pending.split(b"\n")
                for line in lines:
                    if line.strip() == b"lost":
                        self.stop("its holder lost the run's claim to another holder")
                    try:
                        self.deadline = max(self.deadline, float(line))
                    except ValueError:
                        continue

    def _watch(self) -> None:
        while True:
            # What the holder sent before the deadline is judged: this thread may not have run
            # for a while (another thread holding the interpreter's lock, e.g. importing torch).
            self._read_pipe()
            if self.parent is not None and os.getppid() != self.parent:
                self.stop("its study process ended")
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.stop("its lease ran out (no renewal of the run's claim reached it in time)")
            try:
                select.select([self.fd], [], [], min(remaining, 1.0))
            except OSError as e:
                self.stop(f"the lease's pipe cannot be read ({e})")


def start_from_environment() -> Fence | None:
    """Fence this process if its holder asked (TRM_FENCE_FD set): the trainer of a study's run."""
    if not os.environ.get(FD_ENV):
        return None
    try:
        fd, deadline = int(os.environ[FD_ENV]), float(os.environ[DEADLINE_ENV])
        parent = int(os.environ[PARENT_ENV]) if os.environ.get(PARENT_ENV) else None
        run_dir = os.environ[DIR_ENV]
    except (KeyError, ValueError) as e:
        raise SystemExit(f"error: the lease's environment ({FD_ENV}, {DEADLINE_ENV}, {DIR_ENV}) is incomplete or "
                         f"malformed ({e}): train.py under study.py gets it from study.py; unset {FD_ENV} to "
                         "run it alone")
    fence = Fence(fd, deadline, run_dir, parent)
    fence.start()
    return fence


class Lease:
    """The holder's side, for one launch of train.py: the pipe, and the deadlines it sends."""

    def __init__(self, deadline: float, run_dir: str):
        self.deadline, self.run_dir = deadline, run_dir
        self.read_fd, self.write_fd = os.pipe()  # not inheritable: only pass_fds gives the child its end
        os.set_blocking(self.write_fd, False)  # a stopped child never blocks the holder

    def child_env(self) -> dict[str, str]:
        return {FD_ENV: str(self.read_fd), DEADLINE_ENV: repr(self.deadline), DIR_ENV: self.run_dir,
                PARENT_ENV: str(os.getpid())}

    def started(self) -> None:
        """The child has its end (or failed to start): close ours."""
        os.close(self.read_fd)

    def extend(self, deadline: float) -> None:
        """A renewal succeeded: the trainer may write until `deadline` (time.monotonic)."""
        self.deadline = max(self.deadline, deadline)
        self._send(f"{self.deadline!r}\n")

    def lost(self) -> None:
        self._send("lost\n")

    def _send(self, text: str) -> None:
        try:
            os.write(self.write_fd, text.encode())
        except OSError:  # the child has ended, or its pipe is full (it is stopped): it reads the deadline itself
            pass

    def close(self) -> None:
        try:
            os.close(self.write_fd)
        except OSError:
            pass
