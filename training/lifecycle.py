"""A training process's life on a slice, apart from the training itself: how it starts (every
check that needs no device, then the runtime, the host group and the same-configuration check:
`start`), how it stops when asked (SIGTERM or Ctrl-C agreed by every host at one step:
`Preemption`, bounded by `ShutdownDeadline`), what ends a hung run (`Watchdog`), and the exit
status each outcome gives (0 done or saved on SIGTERM, 1 a failure a relaunch would repeat,
`EXIT_RETRYABLE` one a relaunch may fix: the contract `launch.sh train --retry` relies on).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import data
from rundir.contract import EXIT_RETRYABLE  # noqa: F401 (train.py's exit status, re-exported)
from training import compile_cache, run_log
from training.config import (
    Config,
    ConfigError,
    check_against_dataset,
    check_batch_layout,
    check_config,
    config_fingerprint,
)

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: train.py and the packages


def check_same_identifiers(trained_on: str | None, dataset: str | None, weights_url: str) -> None:
    """Refuse weights whose puzzle-embedding rows were trained for other identifiers (both
    fingerprints known and different)."""
    if trained_on and dataset and trained_on != dataset:
        raise ConfigError(
            f"{weights_url} was trained on a dataset with other puzzle identifiers (fingerprint "
            f"{trained_on}) than the one given (fingerprint {dataset}): row i of its puzzle-embedding "
            "table belongs to another puzzle there. Use the dataset the model was trained on, or "
            "rebuild it with the same builder, source files and seed")


def start(config: Config, weights_rows: int | None = None, weights_identifiers: str | None = None,
          weights_url: str = ""):
    """Everything that can be checked without a device, then the runtime, the host group and
    the same-configuration check (then callers run `check_devices`). Returns (config with the
    dataset's identifier count, train set, test set, the sharding module, "TPU" or "CPU", the
    dataset's identifiers fingerprint). `weights_rows` and `weights_identifiers`: the rows of
    given weights' puzzle-embedding table and the fingerprint of the identifiers they were
    trained on, which must match the dataset's."""
    try:
        check_config(config)
        train_set, test_set = data.open_train_test(config.data.path, cache_dir=config.data.cache_dir)
        config = check_against_dataset(config, train_set.metadata)
        identifiers = data.identifiers_fingerprint(config.data.path)
        check_same_identifiers(weights_identifiers, identifiers, weights_url)
        if weights_rows is not None and weights_rows != train_set.metadata.num_puzzle_identifiers:
            raise ConfigError(f"the weights' puzzle embedding has {weights_rows} identifiers but the dataset at "
                              f"{config.data.path} has num_puzzle_identifiers="
                              f"{train_set.metadata.num_puzzle_identifiers}: evaluate on the dataset the model "
                              "was trained on")
    except (data.DatasetError, ConfigError) as e:
        raise SystemExit(f"error: {e}")

    import sharding

    compile_cache.restore_run(config.run)  # the bucket's copy, before the runtime reads the cache
    device_kind = sharding.start_runtime(config.run.device, config.run.cpu_devices, compile_cache.local_dir(config.run))
    num_devices, _ = sharding.device_counts()
    try:
        check_batch_layout(config.optim.global_batch_size, num_devices, sharding.process_count())
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    sharding.init_host_group()
    sharding.check_same_config(config_fingerprint(config))
    return config, train_set, test_set, sharding, device_kind, identifiers


def check_devices(sharding) -> None:
    """The self-check that each host's rows land on its own devices (sharding.check_row_placement),
    before anything is trained or evaluated, and one line with the device layout; a failure stops
    every host with the placement of every host."""
    try:
        seconds = sharding.check_row_placement(sharding.data_mesh())
    except sharding.RowPlacementError as e:
        raise SystemExit(f"error: {e}")
    layout = sharding.device_layout()
    if sharding.is_main_process():
        print(f"device layout (host order): {layout}; each host's rows land on its own devices "
              f"(checked in {seconds * 1e3:.0f} ms)", flush=True)


class ShutdownDeadline:
    """Ends the process in bounded time once asked to stop. While it watches (start() to
    close()), the first SIGTERM or SIGINT starts a clock (whoever acts on the signal, e.g.
    Preemption's save-and-stop, has `timeout_s`); when it runs out, a daemon thread prints where
    the main thread is (its stack, the training step) and exits with EXIT_RETRYABLE. A second
    signal exits at once with 128 + its number (130 Ctrl-C, 143 SIGTERM: stopped on demand).

    Signals reach it through signal.set_wakeup_fd, which the interpreter writes to from its C
    signal handler, so it works even while the main thread is stuck in native code (a hung
    collective, an XLA call) and cannot run Python signal handlers. Only signals that have a
    Python handler are seen: SIGINT always, SIGTERM while Preemption's is installed. A clock
    already running keeps running after close(). `loop`: the function whose local `step` the
    message reports (train.training)."""

    def __init__(self, timeout_s: float, loop=None):
        self.timeout_s, self.loop_code = timeout_s, getattr(loop, "__code__", None)
        self.first: str | None = None  # the signal that started the clock

    def start(self) -> None:
        import socket

        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)  # set_wakeup_fd requires it
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="trm-shutdown-deadline")
        self._watcher.start()

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        self._write.send(b"\0")  # not a signal number: tells the watcher to stop
        self._watcher.join()
        self._read.close()
        self._write.close()

    def _watch(self) -> None:
        while (signum := self._read.recv(1)[0]) != 0:
            if signum not in (signal.SIGTERM, signal.SIGINT):
                continue
            name = signal.Signals(signum).name
            if self.first is not None:
                _say_now(f"second {name} (after {self.first}): exiting at once, without saving "
                         f"(status {128 + signum})")
                os._exit(128 + signum)
            self.first = name
            _say_now(f"{name}: stopping (saving a checkpoint first while training); if still running in "
                     f"{self.timeout_s:.0f}s (run.shutdown_timeout_s), exiting with status {EXIT_RETRYABLE}; "
                     f"another {name} exits at once")
            threading.Thread(target=self._expire, daemon=True, name="trm-shutdown-expire").start()

    def _expire(self) -> None:
        time.sleep(self.timeout_s)
        frames = sys._current_frames()
        main_frame = frames.get(threading.main_thread().ident)
        step = "unknown"
        frame = main_frame
        while frame is not None:  # the training loop's step, if the loop is on the stack
            if frame.f_code is self.loop_code:
                step = frame.f_locals.get("step", "none yet")
                break
            frame = frame.f_back
        lines = [f"error: still running {self.timeout_s:.0f}s after {self.first} (run.shutdown_timeout_s): "
                 f"exiting with status {EXIT_RETRYABLE}; a relaunch resumes from the last committed checkpoint. "
                 f"Training step: {step}. The main thread is at:"]
        lines += traceback.format_stack(main_frame) if main_frame is not None else ["  (not found)\n"]
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if thread is not threading.main_thread() and frame is not None \
                    and not thread.name.startswith("trm-shutdown"):
                stack = traceback.extract_stack(frame)
                ours = [f for f in stack if f.filename.startswith(PROJECT_DIR)]  # where in this project
                where = (ours or stack)[-1]
                lines.append(f"thread {thread.name}: {os.path.basename(where.filename)}:{where.lineno} "
                             f"in {where.name}\n")
        _say_now("".join(line if line.endswith("\n") else line + "\n" for line in lines))
        run_log.upload_now()  # the host log's last copy (object stores), bounded
        os._exit(EXIT_RETRYABLE)


def _say_now(text: str) -> None:
    """Write to stderr and the host log without Python's stream locks (which the stuck main
    thread may hold)."""
    os.write(2, (text.rstrip("\n") + "\n").encode(errors="replace"))
    run_log.write_now(text.rstrip("\n") + "\n")


class Preempted(Exception):
    """SIGTERM reached some host: every host stops after `step` (saving it)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


class Preemption:
    """SIGTERM (a spot VM's notice) or Ctrl-C on any host stops every host at the same step:
    hosts agree every run.preempt_check_every steps (every step on one host) and after every
    evaluation batch, and a non-finite loss seen by any host is agreed on the same way. The stop
    must end within `deadline`'s time."""

    def __init__(self, num_hosts: int, check_every: int, sharding, deadline: ShutdownDeadline | None = None):
        self.requested, self.sharding = False, sharding
        self.check_every = 1 if num_hosts == 1 else check_every
        self.previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        # Ctrl-C saves and stops like SIGTERM (a second one exits at once) instead of raising
        # KeyboardInterrupt wherever the main thread happens to be.
        self.previous_sigint = signal.signal(signal.SIGINT, self._on_sigterm)
        self.deadline = deadline
        if deadline:
            deadline.start()

    def _on_sigterm(self, *_) -> None:
        self.requested = True

    def agreed_stop(self, step: int, nonfinite: bool) -> bool:
        """True on every host at the same step once any host got SIGTERM or saw a NaN."""
        return step % self.check_every == 0 and self.sharding.any_host(self.requested or nonfinite)

    def agreed_now(self) -> bool:
        """True on every host once any host got SIGTERM (a collective: all hosts call it)."""
        return self.sharding.any_host(self.requested)

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)
        signal.signal(signal.SIGINT, self.previous_sigint)
        if self.deadline:
            self.deadline.close()


class Watchdog:
    """Ends this process with EXIT_RETRYABLE when nothing completes (a training step, an
    evaluation batch) for run.watchdog_minutes: a hung host or collective. It first prints what
    completed last and where the main thread waits, so that the log of every host that can
    still run says which step or collective hung; launch.sh --retry then relaunches."""

    def __init__(self, minutes: float, host: int):
        self.timeout_s, self.host = minutes * 60, host
        self.last, self.done = time.monotonic(), "the start"
        self.closed = threading.Event()
        if self.timeout_s > 0:
            threading.Thread(target=self._watch, daemon=True, name="trm-watchdog").start()

    def progress(self, done: str) -> None:
        self.last, self.done = time.monotonic(), done

    def _watch(self) -> None:
        # It looks every 5 s (a quarter of the limit when that is shorter): a hang is acted on at
        # most 5 s after the limit, and the look itself costs nothing a step would notice.
        while not self.closed.wait(min(5.0, self.timeout_s / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout_s:
                frame = sys._current_frames().get(threading.main_thread().ident)
                stack = "".join(traceback.format_stack(frame)) if frame else "(unknown)\n"
                # The reason last: launch.sh quotes a host's last line.
                print(f"the main thread waits in:\n{stack}", file=sys.stderr, flush=True)
                print(f"error: host {self.host}: nothing completed for {idle / 60:.1f} min "
                      f"(--run.watchdog-minutes {self.timeout_s / 60:g}) after {self.done}: another host or a "
                      f"collective hangs; exiting with status {EXIT_RETRYABLE} (launch.sh train --retry "
                      "relaunches)", file=sys.stderr, flush=True)
                run_log.upload_now()  # the host log's last copy (object stores), bounded
                os._exit(EXIT_RETRYABLE)

    def close(self) -> None:
        self.closed.set()
