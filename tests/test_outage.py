"""Bounded failure under a storage outage: with_retries' time budget (a fake clock), the
shutdown deadline, and real training runs whose GCS server (an emulator each test starts
itself) dies or freezes mid-run."""
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rundir import storage
from training import checkpoint
from training.lifecycle import EXIT_RETRYABLE

PROJECT_DIR = str(Path(__file__).resolve().parent.parent)


class FakeTime:
    """storage's clock and sleep: sleeping advances the clock, and each failing call costs
    `attempt_s` (gcsfs's own retries inside one of our attempts)."""

    def __init__(self, attempt_s):
        self.now, self.attempt_s, self.sleeps = 0.0, attempt_s, []

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def failing_until(self, recovers_at):
        calls = []

        def fn():
            calls.append(self.now)
            self.now += self.attempt_s
            if self.now < recovers_at:
                raise ConnectionError("Cannot connect to host")
            return "ok"
        return fn, calls


@pytest.fixture
def fake_time(monkeypatch):
    def make(attempt_s):
        clock = FakeTime(attempt_s)
        monkeypatch.setattr(storage, "_clock", lambda: clock.now)
        monkeypatch.setattr(storage, "_sleep", clock.sleep)
        return clock
    return make


def test_with_retries_rides_out_a_short_outage_and_gives_up_on_a_lasting_one(fake_time, capsys):
    # Refused connections: each attempt of ours takes ~33 s (gcsfs retries 6 times inside it).
    clock = fake_time(attempt_s=33)
    fn, calls = clock.failing_until(recovers_at=80)  # a 45 s outage that began ~35 s before
    assert storage.with_retries("writing", "gs://b/x", fn) == "ok"
    assert calls == [0, 33.5, 67.5] and clock.sleeps == [0.5, 1.0]

    clock = fake_time(attempt_s=33)
    fn, calls = clock.failing_until(recovers_at=float("inf"))
    with pytest.raises(storage.StorageError, match=r"writing gs://b/x failed after 4 attempts: ConnectionError: "
                                                   r".*cannot be reached.*\(gave up 136s after"):
        storage.with_retries("writing", "gs://b/x", fn)
    assert calls == [0, 33.5, 67.5, 102.5]  # no attempt starts after RETRY_BUDGET_S (120 s)

    # Fast failures: the pause doubles up to RETRY_MAX_DELAY_S; attempts bound them too.
    clock = fake_time(attempt_s=0)
    fn, calls = clock.failing_until(recovers_at=float("inf"))
    with pytest.raises(storage.StorageError, match=r"failed after 10 attempts: .*gave up 76s after"):
        storage.with_retries("reading", "gs://b/y", fn)
    assert clock.sleeps == [0.5, 1, 2, 4, 8, 15, 15, 15, 15]
    # A budget that an attempt overruns: one attempt, no warning; and a best-effort single attempt.
    clock = fake_time(attempt_s=33)
    capsys.readouterr()
    with pytest.raises(storage.StorageError, match=r"failed after 1 attempt: .*gave up 33s after"):
        storage.with_retries("writing", "gs://b/z", clock.failing_until(float("inf"))[0], budget_s=20)
    with pytest.raises(storage.StorageError, match=r"failed after 1 attempt: .*gave up 33s after"):
        storage.with_retries("writing", "gs://b/z", clock.failing_until(float("inf"))[0], attempts=1)
    assert "warning" not in capsys.readouterr().out


# -- the shutdown deadline, in a light process (no training) ----------------------------------------


DEADLINE_SCRIPT = """
import sys, threading
sys.path.insert(0, {project!r})
from training.lifecycle import Preemption, ShutdownDeadline
preemption = Preemption(1, 10, None, ShutdownDeadline({timeout}))
print("ready", flush=True)
threading.Event().wait()  # the main thread stuck, as on a storage call that never returns
"""


def start_deadline_process(tmp_path, timeout_s):
    script = tmp_path / f"stuck_{timeout_s}.py"
    script.write_text(DEADLINE_SCRIPT.format(project=PROJECT_DIR, timeout=timeout_s))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_a_stuck_stop_exits_75_at_the_deadline_and_a_second_signal_at_once(tmp_path):
    proc = start_deadline_process(tmp_path, 3)
    signalled = time.time()
    proc.send_signal(signal.SIGINT)  # Ctrl-C: no KeyboardInterrupt, the stop is asked for and timed
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_RETRYABLE == 75, err
    assert 3 <= time.time() - signalled < 15
    assert "SIGINT: stopping" in err and "another SIGINT exits at once" in err and "KeyboardInterrupt" not in err
    assert "error: still running 3s after SIGINT (run.shutdown_timeout_s): exiting with status 75" in err
    assert "threading.Event().wait()" in err  # the main thread's stack: where it is stuck

    proc = start_deadline_process(tmp_path, 60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - signalled < 5, err
    assert "second SIGTERM (after SIGTERM): exiting at once, without saving (status 143)" in err


# -- training runs through an outage -----------------------------------------------------------------


class Emulator:
    """A GCS server of the test's own (gcp-storage-emulator, in memory) to kill or freeze."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        exe = Path(sys.executable).parent / "gcp-storage-emulator"
        self.proc = subprocess.Popen([str(exe), "start", "--host", "127.0.0.1", "--port", str(self.port),
                                      "--in-memory", "--default-bucket", "outage"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.time() < deadline, "the emulator did not start"
                time.sleep(0.1)
        self.host = f"http://127.0.0.1:{self.port}"

    def signal(self, sig):
        self.proc.send_signal(sig)

    def close(self):
        self.proc.kill()  # also ends a stopped (SIGSTOP) process
        self.proc.wait(timeout=30)


@pytest.fixture
def emulator(monkeypatch):
    server = Emulator()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.host)  # for this process's checks too
    yield server
    server.close()


class Training:
    """train.py on the demo data in a subprocess (run dir on the emulator), its output read
    line by line on threads so that a test can wait for a line with a timeout."""

    def __init__(self, demo_path, tmp_path, run_dir, *extra, env=None):
        args = ["demo", "--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache"), "--run.dir", run_dir,
                "--model.hidden-size", "32", "--model.puzzle-emb-ndim", "32", "--optim.global-batch-size", "32",
                "--eval.every-epochs", "1000", "--run.log-every", "1", *extra]
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, os.path.join(PROJECT_DIR, "train.py"), *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout, self.stderr, self.lines = [], [], queue.Queue()
        self.readers = [threading.Thread(target=self._read, args=(stream, out), daemon=True)
                        for stream, out in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, out):
        for line in stream:
            out.append(line)
            self.lines.put(line)

    def wait_for_line(self, prefix, timeout_s=300):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if self.lines.get(timeout=1).startswith(prefix):
                    return
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.stderr)[-3000:]
        raise AssertionError(f"no line {prefix!r} within {timeout_s}s: " + "".join(self.stdout)[-2000:])

    def wait(self, timeout_s):
        """(exit status, seconds it took); kills the process if it runs longer than timeout_s."""
        started = time.time()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running after {timeout_s}s: " + "".join(self.stderr)[-3000:])
        for reader in self.readers:  # each ends at its pipe's end of file: every line is read
            reader.join(timeout=120)
        return self.proc.returncode, time.time() - started

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def trainings():
    started = []
    yield lambda *args, **kwargs: started.append(Training(*args, **kwargs)) or started[-1]
    for t in started:
        t.kill()


def test_a_lasting_outage_stops_the_run_with_a_storage_error(demo_path, tmp_path, emulator, trainings):
    # A 30 s retry budget (120 s by default): one attempt against refused connections takes ~35 s
    # of gcsfs's own retries, so the save fails at its first attempt's end.
    run = trainings(demo_path, tmp_path, "gs://outage/run", "--optim.max-steps", "40", "--run.ckpt-every", "5",
                    env={"TRM_STORAGE_RETRY_BUDGET_S": "30"})
    run.wait_for_line("step 3/")
    emulator.close()  # for good: connections refused from now on
    status, seconds = run.wait(timeout_s=300)
    out, err = "".join(run.stdout), "".join(run.stderr)
    print(f"exited {status} {seconds:.0f}s after the emulator died")
    assert status == EXIT_RETRYABLE, out[-2000:] + err[-3000:]
    # The save of step 5 (under way when the emulator died) names the file it could not reach.
    assert re.search(r"error: \w+ gs://outage/run/checkpoints/step_00000005/\S+ failed after \d+ attempts?: "
                     r".*the storage service cannot be reached", err), err[-3000:]
    # The event-file copies failed with one warning, and reading the metrics went on regardless.
    assert sum("warning: copying the TensorBoard logs" in line for line in run.stdout) == 1, out[-3000:]
    assert "step 10/40" in out
    assert "out of retries" not in err  # gcsfs's tracebacks of each request it gave up on


def test_sigterm_during_an_outage_ends_the_run_at_the_deadline(demo_path, tmp_path, emulator, trainings):
    run = trainings(demo_path, tmp_path, "gs://outage/run", "--optim.max-steps", "100000",
                    "--run.shutdown-timeout-s", "10")
    run.wait_for_line("step 3/")
    emulator.signal(signal.SIGSTOP)  # frozen: requests hang (no answer, no refusal)
    run.proc.send_signal(signal.SIGTERM)  # the save it asks for cannot finish
    status, seconds = run.wait(timeout_s=120)
    err = "".join(run.stderr)
    assert status == EXIT_RETRYABLE, err[-3000:]
    assert 10 <= seconds < 30, seconds
    assert "error: still running 10s after SIGTERM (run.shutdown_timeout_s): exiting with status 75" in err
    assert "Training step: " in err and "Training step: unknown" not in err, err[-3000:]
    assert "in save" in err  # the main thread's stack: in Checkpoints.save, waiting for the write


def test_a_45s_outage_is_ridden_out(demo_path, tmp_path, emulator, trainings):
    run = trainings(demo_path, tmp_path, "gs://outage/run", "--optim.max-steps", "30", "--run.ckpt-every", "10")
    run.wait_for_line("step 3/")
    emulator.signal(signal.SIGSTOP)
    frozen = time.time()
    # Progress lines go on while the copies of the event files hang (the save at step 10 too):
    # the loop stops only at step 20, whose save waits for step 10's.
    run.wait_for_line("step 20/30", timeout_s=44)
    time.sleep(max(0.0, 45 - (time.time() - frozen)))
    emulator.signal(signal.SIGCONT)
    status, seconds = run.wait(timeout_s=300)
    out = "".join(run.stdout)
    assert status == 0, "".join(run.stderr)[-3000:]
    assert "done: 30 steps" in out
    assert checkpoint.list_checkpoints("gs://outage/run")[0][0] == 30
    assert storage.exists("gs://outage/run/checkpoints/step_00000030/COMMITTED")
    # The copies of the event files caught up: every step's loss is in the bucket's copy.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fs, path = storage.filesystem("gs://outage/run/tb")
    fs.get(path, str(tmp_path / "tb"), recursive=True)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 31))
