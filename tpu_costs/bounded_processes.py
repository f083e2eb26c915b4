"""Commands run in processes that end, as many at once as the machine's memory allows: each
one's peak resident memory read from the OS when it ends (wait4's ru_maxrss), the next started
only when the memory available (/proc/meminfo) holds the largest peak measured so far of its
kind, beside what the running ones may still grow to, and all of them together stay within a
third of the machine's memory (BUDGET_FRACTION). tpu_compile.py runs its traces and
compiles this way, so a plan of many programs holds one program's memory per process, never the
sum of them all (a process's caches grow from program to program and are never given back).

    run(tasks, processes=None, say=print) -> [Finished]   every task and the tasks they add

`processes` None: measured (at most the CPU count; the first task of each kind runs alone);
a number: that many at once, whatever the memory. Each child dies with this process (Linux's
parent-death signal), and Ctrl-C or SIGTERM here ends the running ones: what they finished
stays finished (tpu_compile.py's cache), what they had not is started again next time.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HEADROOM_BYTES = 1 << 30
"""Memory left to the rest of the machine when sizing the concurrency."""
BUDGET_FRACTION = 1 / 3
"""Of the machine's physical memory, what the processes run at once may hold together (their
measured peaks): a plan shares a laptop with the user's other work (8 GB of 24, 5.3 of 16). A
process alone may exceed it: the first task always starts."""


@dataclass
class Task:
    """One command to run in a process of its own."""

    name: str
    argv: list[str]
    kind: str
    """Tasks of one kind take about the same memory: the largest peak of a kind sizes the next of
    that kind, never another's (tpu_compile.py: one kind per step, program, preset and slice, so a
    Sudoku program's peak does not size an ARC one's); the first of a kind runs alone."""
    then: Callable[[Finished], list[Task]] | None = None
    """Called in this process when the task ends; returns the tasks it adds (run before those waiting)."""


@dataclass
class Finished:
    task: Task
    returncode: int
    seconds: float
    peak_bytes: int
    """The process's peak resident memory (the OS's ru_maxrss of the child)."""
    output: str = field(repr=False, default="")
    """Its stdout and stderr together."""


def meminfo_bytes(field: str = "MemAvailable") -> int | None:
    """A field of /proc/meminfo in bytes, MemAvailable by default (None where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is no /proc)."""
    return meminfo_bytes("MemAvailable")


def resident_bytes(pid: int) -> int:
    """VmRSS of a running process (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _parent_death_signal() -> Callable[[], None] | None:
    """What a child runs between fork and exec so that it dies with this process (Linux's
    PR_SET_PDEATHSIG, then a check that this process did not end before it was set), or None
    where it cannot (no Linux, no libc). Everything it needs is loaded here, in the parent, before
    any fork: the child of a threaded parent must not import or load a library (another thread
    may have held the import lock or the loader's when it forked: a deadlock); it only calls
    prctl and getppid through pointers resolved before."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl, getppid = libc.prctl, os.getppid
    except (OSError, AttributeError):
        return None
    parent, kill, exit_now = os.getpid(), int(signal.SIGKILL), os._exit

    def die_with_parent() -> None:  # in the child, before exec
        prctl(1, kill)  # PR_SET_PDEATHSIG
        if getppid() != parent:  # the parent ended before the signal was set
            exit_now(1)
    return die_with_parent


@dataclass
class _Running:
    task: Task
    process: subprocess.Popen
    log: object
    started: float


def _may_start(task: Task, running: list[_Running], peaks: dict[str, int], processes: int | None) -> bool:
    if not running:
        return True
    if processes is not None:
        return len(running) < processes
    if len(running) >= (os.cpu_count() or 1):
        return False
    expected = peaks.get(task.kind)
    available = available_bytes()
    if expected is None or available is None:
        return False  # not measured yet: one at a time
    growth = sum(max(0, peaks.get(r.task.kind, expected) - resident_bytes(r.process.pid)) for r in running)
    held = sum(max(peaks.get(r.task.kind, expected), resident_bytes(r.process.pid)) for r in running)
    budget = BUDGET_FRACTION * (meminfo_bytes("MemTotal") or 0)
    return available - growth - HEADROOM_BYTES >= 1.15 * expected and held + 1.15 * expected <= budget


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _stop(running: list[_Running]) -> None:
    for r in running:
        if r.process.poll() is None:
            r.process.terminate()
    deadline = time.time() + 10
    for r in running:
        try:
            r.process.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.process.wait()
        r.log.close()


def run(tasks: list[Task], processes: int | None = None, poll_s: float = 0.2) -> list[Finished]:
    """Run every task (and those their `then` adds), each in a process of its own; the
    Finished of each in the order they end."""
    if processes is not None and processes < 1:
        raise ValueError(f"processes={processes}: give at least 1 (or None to size it from the memory)")
    pending, running, done = list(tasks), [], []
    peaks: dict[str, int] = {}
    die_with_parent = _parent_death_signal()  # prepared here, before any fork
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if previous is signal.SIG_DFL:  # SIGTERM ends the children too, as Ctrl-C does
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        while pending or running:
            while pending and _may_start(pending[0], running, peaks, processes):
                task = pending.pop(0)
                log = tempfile.TemporaryFile(mode="w+")
                process = subprocess.Popen(task.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           preexec_fn=die_with_parent)
                running.append(_Running(task, process, log, time.perf_counter()))
            ended = None
            for r in running:
                pid, status, usage = os.wait4(r.process.pid, os.WNOHANG)
                if pid:
                    ended = r
                    r.process.returncode = os.waitstatus_to_exitcode(status)
                    break
            if ended is None:
                time.sleep(poll_s)
                continue
            running.remove(ended)
            ended.log.seek(0)
            finished = Finished(ended.task, ended.process.returncode, time.perf_counter() - ended.started,
                                usage.ru_maxrss * 1024, ended.log.read())
            ended.log.close()
            peaks[ended.task.kind] = max(peaks.get(ended.task.kind, 0), finished.peak_bytes)
            done.append(finished)
            if ended.task.then is not None:  # first: what a task adds finishes its work before others start
                pending[0:0] = ended.task.then(finished)
    except BaseException:
        _stop(running)
        raise
    finally:
        if previous is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
    return done
