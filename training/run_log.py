"""What a run tells its user: progress lines, TensorBoard scalars and profiles in the run
directory, and the history that train.main returns.

A step line (every run.log_every steps) reports a window of steps: loss, exact accuracy, lr,
the mean global norm of the dense gradients, wall ms per step, steps/s, examples/s, model
TFLOP/s per device and, on a TPU whose peak is known (slices.PEAK_TFLOPS_PER_CHIP), MFU; device
memory in use and peak as a share of the limit when the runtime reports it. The same values go
to TensorBoard as train/... scalars.

Metric sums stay on the device during a window of steps and are read by one background
thread, in order, so the step loop never waits for a device value. The reader also watches
for a non-finite loss (`RunLog.nonfinite`), which the loop turns into a stop. Copies of the
TensorBoard files to a remote run directory are best effort, on a thread of their own: storage
trouble costs a warning and never holds the loop or the metrics (`Uploads`).

Process 0 also appends each step line's values and each evaluation's to {run_dir}/metrics/ as
JSON lines (`MetricsFile`: parts rewritten whole, since object stores cannot append), and every
host copies what it prints to {run_dir}/logs/host_I.launch-TIME.log (`HostLog`). With
--report.wandb-project, process 0 hands what TensorBoard gets to the W&B mirror (training/wandb_mirror.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from rundir import storage
from rundir.contract import FINAL, format_duration
from training import halt_steps
from training.model_flops import model_flops, stage_flops
from training.trainer import TRAIN_METRICS

# Token colours of the puzzle pictures: 0 pad (dark grey), 1 white (ARC's end of grid, Sudoku's
# blank, Maze's wall), then ARC's ten colours for tokens 2..11 (Sudoku's digits, Maze's cells).
PALETTE = np.array([(48, 48, 48), (255, 255, 255), (0, 0, 0), (0, 116, 217), (255, 65, 54), (46, 204, 64),
                    (255, 220, 0), (170, 170, 170), (240, 18, 190), (255, 133, 27), (127, 219, 255),
                    (135, 12, 37)], dtype=np.uint8)
PICTURE_PUZZLES = 4
"""Evaluations show this many test puzzles (the first ones, the same every time) as pictures."""
WRONG = np.array((255, 0, 0), dtype=np.uint8)


def grid_picture(tokens: np.ndarray, wrong: np.ndarray | None = None) -> np.ndarray:
    """A sequence of tokens as an RGB picture [H, W, 3] of its square grid (a row when the
    length is not a square), one coloured cell per token, 1-pixel grid lines; the cells where
    `wrong` is true get a red frame. Tokens beyond the palette (or ignored labels, < 0) are pad."""
    length = len(tokens)
    side = math.isqrt(length)
    rows, cols = (side, side) if side * side == length else (1, length)
    cell = max(4, 240 // max(rows, cols))
    colours = PALETTE[np.where((tokens >= 0) & (tokens < len(PALETTE)), tokens, 0)].reshape(rows, cols, 3)
    picture = np.kron(colours, np.ones((cell, cell, 1), dtype=np.uint8))
    if wrong is not None:
        frame, width = np.zeros((cell, cell), dtype=bool), 1 + max(1, cell // 8)
        frame[1:-1, 1:-1] = True
        frame[width:-width, width:-width] = False
        picture[np.kron(wrong.reshape(rows, cols), frame).astype(bool)] = WRONG
    picture[::cell, :] = picture[:, ::cell] = (96, 96, 96)
    return picture


def puzzle_picture(inputs: np.ndarray, prediction: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Input, prediction (its wrong cells framed in red) and answer of one puzzle, side by side."""
    wrong = (labels >= 0) & (prediction != labels)
    panels = [grid_picture(inputs), grid_picture(prediction, wrong), grid_picture(labels)]
    gap = np.full((panels[0].shape[0], 8, 3), 255, dtype=np.uint8)
    return np.concatenate([panels[0], gap, panels[1], gap, panels[2]], axis=1)


def window_metrics(names, values: np.ndarray, steps: int, global_batch_size: int) -> dict[str, float]:
    """Sums over a window of steps → the reference's normalisation: losses per example, the
    rest per halted (counted) example; grad_norm (one value per step) is the window's mean."""
    sums = dict(zip(names, values.tolist()))
    count = max(sums["count"], 1.0)

    def per(k):
        return global_batch_size * steps if k.endswith("loss") else steps if k == "grad_norm" else count
    return {k: v if k == "count" else v / per(k) for k, v in sums.items()}


def speed(steps: int, seconds: float, global_batch_size: int, flops_per_example: float, devices: int,
          peak_tflops: float | None) -> dict[str, float]:
    """Rates of a window of `steps` steps that took `seconds` of wall time: step_ms,
    steps_per_s, examples_per_s, tflops_per_device (model FLOPs, `model_flops.model_flops`, per
    second and device) and, when the device's peak is known (`peak_tflops`, TFLOP/s per
    device), mfu = achieved / peak. Without a peak (CPU, an unknown TPU) there is no mfu key."""
    step_s = max(seconds, 1e-9) / steps
    out = {"step_ms": 1e3 * step_s, "steps_per_s": 1 / step_s, "examples_per_s": global_batch_size / step_s,
           "tflops_per_device": flops_per_example * global_batch_size / step_s / devices / 1e12}
    if peak_tflops:
        out["mfu"] = out["tflops_per_device"] / peak_tflops
    return out


class Uploads:
    """Best-effort copies of a local directory to a URL (storage.upload_dir, whole files) on a
    daemon thread: `request()` asks for a copy of the directory as it is now; requests made
    while a copy runs are served by one more copy. A failed copy prints one warning (and nothing
    more until a copy succeeds again) and is retried at the next request, so a later copy
    catches up; each copy is a single attempt (storage's request timeouts bound it)."""

    def __init__(self, local: str | None, remote: str, what: str, copy=None):
        """copy: what one copy does (default: storage.upload_dir(local, remote, attempts=1));
        it raises on failure."""
        self.local, self.remote, self.what = local, remote, what
        self.copy = copy or (lambda: storage.upload_dir(self.local, self.remote, attempts=1))
        self.failing = False  # the last copy failed
        self._changed = threading.Condition()
        self._requested = self._finished = 0  # requests made / served by a finished copy
        self._closed = False
        threading.Thread(target=self._run, daemon=True, name="trm-uploads").start()

    def request(self) -> int:
        """Ask for a copy; returns its number, for `wait`."""
        with self._changed:
            self._requested += 1
            self._changed.notify_all()
            return self._requested

    def wait(self, number: int, timeout_s: float) -> bool:
        """Whether copy `number` (or a later one) finished, successfully or not, within timeout_s."""
        with self._changed:
            return self._changed.wait_for(lambda: self._finished >= number, timeout_s)

    def close(self) -> None:
        """The thread ends once the copies asked for are done (no new requests)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._requested > self._finished or self._closed)
                if self._requested == self._finished:
                    return
                number = self._requested
            try:
                self.copy()
            except Exception as e:  # noqa: BLE001 - best effort: reported once, retried next time
                if not self.failing:
                    print(f"warning: copying the {self.what} to {self.remote} failed ({e}); training goes on, "
                          "and each later report tries again (no further warnings until one succeeds)",
                          flush=True)
                self.failing = True
            else:
                if self.failing:
                    print(f"the {self.what} in {self.remote} are up to date again", flush=True)
                self.failing = False
            with self._changed:
                self._finished = number
                self._changed.notify_all()


def json_record(record: dict) -> str:
    """One line of JSON; a non-finite number becomes null (strict JSON, which jq and every
    reader take)."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()})


class MetricsFile:
    """{run_dir}/metrics/part-NNNNN.jsonl, written by process 0: one JSON record per line, in the
    order they were made. Object stores cannot append (gcsfs replaces the object), so each part
    is rewritten whole when a record is added, until it holds PART_RECORDS records; the next
    record starts the next part. A write thus costs at most one part (~PART_RECORDS x 0.6 KB),
    however long the run, and a reader lists the parts in name order. The writes are best
    effort, on a thread of their own (`Uploads`): a failed write warns once and the next one
    writes every part not yet written whole, so a short outage loses nothing.

    `continue_from(step)` (once, before the first record): a launch that starts at `step` drops
    the records of later steps (those a resume redoes, or a crashed launch made past its last
    checkpoint) and continues the last part, so the records' steps never repeat; `reached` keeps
    the last step they held (training/launch_records.py: the work a killed launch lost)."""

    PART_RECORDS = 200

    def __init__(self, run_dir: str):
        self.root = storage.join_url(run_dir, "metrics")
        self.part, self.lines = 0, []  # the part being filled and its lines
        self.reached: int | None = None  # the last step of the records continue_from found
        self.unwritten: dict[int, str] = {}  # parts whose latest text is not written yet
        self._lock = threading.Lock()
        self.uploads = Uploads(None, self.root, "metrics records", copy=self._write)

    def url(self, part: int) -> str:
        return storage.join_url(self.root, f"part-{part:05d}.jsonl")

    def continue_from(self, step: int) -> int:
        """Drop the records of steps after `step` (retried like other storage work); returns how
        many were dropped."""
        fs, path = storage.filesystem(self.root)
        parts = storage.with_retries("listing", self.root, lambda: sorted(fs.glob(path + "/part-*.jsonl")))
        dropped = 0
        for name in reversed(parts):
            part = int(name.rsplit("part-", 1)[1].split(".")[0])
            url = self.url(part)
            lines = storage.read_bytes(url).decode().splitlines()
            if self.reached is None and any(line.strip() for line in lines):
                self.reached = max(json.loads(line)["step"] for line in lines if line.strip())
            kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
            dropped += len(lines) - len(kept)
            if kept:
                self.part, self.lines = part, kept
                if len(kept) != len(lines):
                    storage.write_bytes(url, "".join(line + "\n" for line in kept).encode())
                break
            storage.with_retries("removing", url, lambda name=name: fs.rm(name))
        if len(self.lines) >= self.PART_RECORDS:
            self.part, self.lines = self.part + 1, []
        return dropped

    def add(self, record: dict) -> None:
        with self._lock:
            self.lines.append(json_record(record))
            self.unwritten[self.part] = "".join(line + "\n" for line in self.lines)
            if len(self.lines) >= self.PART_RECORDS:
                self.part, self.lines = self.part + 1, []
        self.uploads.request()

    def _write(self) -> None:
        with self._lock:
            todo, self.unwritten = self.unwritten, {}
        try:
            for part in sorted(todo):
                storage.write_bytes(self.url(part), todo[part].encode(), attempts=1)
                del todo[part]
        finally:
            with self._lock:  # what failed is written by the next copy, unless a newer text came
                self.unwritten = {**todo, **self.unwritten}


class HostLog:
    """What this process prints (stdout and stderr, every thread) also goes to
    {run_dir}/logs/host_{host}.launch-{launch}.log: one file per host and launch, so a relaunch
    never overwrites what an earlier one said, and the names sort in launch order. A local run
    directory gets the lines directly (appended as they come); for an object store they go to a
    local file that is copied whole every UPLOAD_EVERY_S seconds and at the end, best effort
    (`Uploads`: a failed copy warns once and never holds or fails the run). Used as a context
    manager around the run: an exception leaving it is written to the file with its traceback
    (the interpreter prints it to stderr after), then the last copy is made."""

    UPLOAD_EVERY_S = 60.0
    CLOSE_TIMEOUT_S = 15.0
    active: HostLog | None = None  # the one of this process (for write_now / upload_now)

    def __init__(self, run_dir: str, host: int, launch: str):
        name = f"host_{host}.launch-{launch}.log"
        self.remote = storage.join_url(run_dir, "logs", name)
        remote = "://" in run_dir and not run_dir.startswith("file://")
        self.path = os.path.join(tempfile.mkdtemp(prefix="trm-log-"), name) if remote else \
            storage.filesystem(self.remote)[1]
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        # Unbuffered appends (os.write): no Python lock, so a thread that must speak while the main
        # thread is stuck (the shutdown deadline, the watchdog) can still write here.
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.uploads = Uploads(None, self.remote, "log lines of this host", copy=self._copy) if remote else None
        self._stop = threading.Event()
        if self.uploads:
            threading.Thread(target=self._every, daemon=True, name="trm-host-log").start()
        self.streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self), _Tee(sys.stderr, self)
        HostLog.active = self

    def write(self, text: str) -> None:
        if self.fd is not None and text:
            try:
                os.write(self.fd, text.encode(errors="replace"))
            except OSError:
                pass  # a full or vanished disk costs the log, never the run

    def _copy(self) -> None:
        with open(self.path, "rb") as f:
            storage.write_bytes(self.remote, f.read(), attempts=1)

    def _every(self) -> None:
        size = -1
        while not self._stop.wait(self.UPLOAD_EVERY_S):
            if os.path.getsize(self.path) != size:
                size = os.path.getsize(self.path)
                self.uploads.request()

    def upload_now(self, timeout_s: float) -> None:
        """One more copy (object stores), waiting for it at most timeout_s."""
        if self.uploads:
            self.uploads.wait(self.uploads.request(), timeout_s)

    def __enter__(self) -> HostLog:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if isinstance(error, SystemExit):
            if isinstance(error.code, str):
                self.write(f"{error.code}\n")
        elif error is not None:
            self.write("".join(traceback.format_exception(kind, error, tb)))
        self.close()

    def close(self) -> None:
        """Stop teeing, make the last copy (object stores: waits at most CLOSE_TIMEOUT_S)."""
        if sys.stdout is not None and isinstance(sys.stdout, _Tee) and sys.stdout.log is self:
            sys.stdout.drain()
            sys.stdout = self.streams[0]
        if sys.stderr is not None and isinstance(sys.stderr, _Tee) and sys.stderr.log is self:
            sys.stderr.drain()
            sys.stderr = self.streams[1]
        if HostLog.active is self:
            HostLog.active = None
        self._stop.set()
        if self.uploads:
            last = self.uploads.request()
            self.uploads.close()
            if not self.uploads.wait(last, self.CLOSE_TIMEOUT_S) or self.uploads.failing:
                print(f"warning: {self.remote} may miss this host's last lines; they are all in {self.path}",
                      file=sys.stderr, flush=True)
        fd, self.fd = self.fd, None
        os.close(fd)


def write_now(text: str) -> None:
    """Add text to this process's host log, if one is open (lock free, for threads that speak
    while the main thread may be stuck)."""
    log = HostLog.active
    if log is not None:
        log.write(text)


def upload_now(timeout_s: float = 5.0) -> None:
    """Before os._exit: copy the host log once more (object stores), waiting at most timeout_s."""
    log = HostLog.active
    if log is not None:
        log.upload_now(timeout_s)


class _Tee:
    """A text stream that also writes to a HostLog, a whole line at a time: print() writes its
    text and its newline in two calls, so lines printed by two threads at once (the metrics
    reader's step line, the main thread's compile line) would otherwise run into each other."""

    def __init__(self, stream, log: HostLog):
        self.stream, self.log = stream, log
        # Reentrant: a signal handler that prints runs on the main thread, maybe inside write().
        self.lock, self.pending = threading.RLock(), {}  # thread id -> its text since its last newline

    def write(self, text: str) -> int:
        with self.lock:
            thread = threading.get_ident()
            lines, newline, rest = (self.pending.pop(thread, "") + text).rpartition("\n")
            if rest:
                self.pending[thread] = rest
            if newline:
                self._emit(lines + newline)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            self._emit(self.pending.pop(threading.get_ident(), ""))
            self.stream.flush()

    def drain(self) -> None:
        """Write out every thread's unfinished line (when the tee is taken down)."""
        with self.lock:
            self._emit("".join(self.pending.values()))
            self.pending.clear()

    def _emit(self, text: str) -> None:
        if text:
            self.log.write(text)
            self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


class RunLog:
    """Progress lines (process 0), TensorBoard scalars under {run_dir}/tb (process 0) and the
    returned history. Device values are read on one background thread, in order, so the step
    loop never waits for them; the event files are copied to a remote run directory by
    `Uploads`, which never hold the reader.

    Each history row (and train/... scalar) holds the window's normalised metrics (`window_metrics`:
    grad_norm is the mean over the window's steps of the step's dense gradient norm), lr, loss,
    the rates of `speed` (wall time of the window over its steps: the time from the end of the
    previous window's last step to the end of this one's, which includes the host's waits, with
    no extra device read), and memory_used / memory_peak (fractions of the device's limit) when
    the runtime reports memory.
    """

    CLOSE_TIMEOUT_S = 30.0
    """close() waits at most this long for the last copy of the event files."""

    def __init__(self, config, total_steps: int, main_host: bool, sharding, peak_tflops: float | None = None,
                 curriculum=None, first_launch=None):
        """config: config.Config (read: run.dir, run.log_every, optim.global_batch_size, model);
        peak_tflops: the bf16 peak TFLOP/s of one device, the MFU's denominator (train.py reads it
        from the slice table for the accelerator's kind); None (a CPU, an unknown TPU): no MFU.
        curriculum: the run's recursion
        curriculum (schedule.Curriculum), whose stages recurse with fewer cycles: each window's
        FLOPs are counted from the cycles its steps trained with (None: the model's). first_launch:
        when the run was first launched (a callable; train.py's launch_records.first_launch_start), which
        names its W&B run (training/wandb_mirror.py; None: now)."""
        self.config, self.total_steps, self.main_host, self.sharding = config, total_steps, main_host, sharding
        self.curriculum = curriculum
        self.flops_per_example = model_flops(config.model)["train"]  # at the model's cycles
        self._stage_flops: dict[tuple[int, int], int] = {}
        self.devices = sharding.device_counts()[0]
        self.peak_tflops = peak_tflops
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.nonfinite: str | None = None  # the first window whose loss or metrics were NaN/inf
        self.reader = ThreadPoolExecutor(max_workers=1)
        self.tb = None
        if main_host:
            from torch.utils.tensorboard import SummaryWriter

            # Event files grow by appending, which object stores cannot do (gcsfs silently
            # overwrites): write them locally and upload whole copies after each write.
            self.tb_remote = storage.join_url(config.run.dir, "tb")
            self.tb_local = self.tb_remote if "://" not in config.run.dir else tempfile.mkdtemp(prefix="trm-tb-")
            self.tb = SummaryWriter(self.tb_local)
            self.uploads = Uploads(self.tb_local, self.tb_remote, "TensorBoard logs") \
                if self.tb_local != self.tb_remote else None
        self.memory = None  # whether the runtime reports device memory: asked at the first window
        self.metrics = MetricsFile(config.run.dir) if main_host else None
        self.mirror = None  # the W&B mirror (process 0, --report.wandb-project): what TensorBoard gets
        if main_host and config.report.wandb_project:
            from training import wandb_mirror

            self.mirror = wandb_mirror.Mirror(config, dataclasses.asdict(config), first_launch or time.time)

    def say(self, *parts) -> None:
        if self.main_host:
            print(*parts, flush=True)

    def _in_order(self, fn, *args) -> None:
        self.reader.submit(fn, *args).add_done_callback(_raise_in_main_thread)

    def continue_from(self, step: int) -> None:
        """Before the first step of a launch that starts at `step`: metrics.jsonl's records of
        later steps (made past the checkpoint this launch resumes from) are dropped, so that the
        records continue without repeating a step."""
        if self.metrics:
            dropped = self.metrics.continue_from(step)
            if dropped:
                self.say(f"metrics records: dropped {dropped} of steps after {step} (this launch redoes them)")

    def finished(self, step: int, seconds: float) -> None:
        """The run trained its last step and evaluated: one line says so, and process 0 writes
        {run.dir}/final.json (the step, the final evaluation's metrics, the devices and hosts it
        ran on, the loop's seconds), the mark of a finished run (study.py skips it, its report
        reads it)."""
        final = self.evals[-1]
        self.say(f"done: {step} steps in {format_duration(seconds)}; final exact accuracy "
                 f"{100 * final['exact_accuracy']:.2f}% on held-out puzzles")
        if self.main_host:
            record = {"step": step, "metrics": json.loads(json_record(final)), "devices": self.devices,
                      "hosts": self.sharding.process_count(), "seconds": seconds, "time": time.time()}
            storage.write_bytes(storage.join_url(self.config.run.dir, FINAL),
                                json.dumps(record, indent=2).encode())

    def config_text(self, config) -> None:
        if self.tb:
            text = json.dumps(dataclasses.asdict(config), indent=2)
            self._in_order(self.tb.add_text, "config", f"```\n{text}\n```", 0)

    def start_window(self, device) -> None:
        """A fresh window of summed step metrics (a device tensor, added to by every step)."""
        if self.memory is None:  # once, before the first step: memory is read at log lines only
            self.memory = False
            if self.main_host:
                try:
                    self.sharding.memory_info()
                    self.memory = True
                except Exception as e:  # noqa: BLE001 - any runtime's refusal: the field is left out
                    reason = str(e).strip().splitlines()[-1][-160:] if str(e).strip() else type(e).__name__
                    self.say(f"memory n/a: step lines leave device memory out ({reason})")
        self.window_sums = torch.zeros(len(TRAIN_METRICS)).to(device)
        self.window_steps, self.window_start = 0, time.time()

    def add_step(self, metrics: torch.Tensor) -> None:
        """Add a step's metric vector to the window, before the step's sync (so the sum is part
        of the step's graph and is computed by the time the window is read)."""
        self.window_sums = self.window_sums + metrics
        self.window_steps += 1

    def after_step(self, step: int, lr: float, end_window: bool = False) -> None:
        """After the step's sync: the window ends (its sums are read in the background and
        reported) every run.log_every steps, at the last step, and when the caller asks (before
        a save, so that every saved step has had its loss checked)."""
        if end_window or step % self.config.run.log_every == 0 or step == self.total_steps:
            now = time.time()
            self._in_order(self._report_train, self.window_sums, step, self.window_steps,
                           now - self.window_start, lr, now)
            self.start_window(self.window_sums.device)

    def _report_train(self, sums, step, steps, seconds, lr, now=None):
        batch_size = self.config.optim.global_batch_size
        row = window_metrics(TRAIN_METRICS, sums.cpu().numpy(), steps, batch_size)
        row.update(step=step, lr=lr, loss=row["lm_loss"] + 0.5 * row["q_halt_loss"])
        row.update(speed(steps, seconds, batch_size, self.window_flops_per_example(step - steps + 1, step),
                         self.devices, self.peak_tflops))
        memory = ""
        info = self._memory()
        if info:
            row["memory_used"] = info["used"] / info["limit"]
            memory = f"  mem {100 * row['memory_used']:.0f}%"
            if "peak" in info:
                row["memory_peak"] = info["peak"] / info["limit"]
                memory += f" (peak {100 * row['memory_peak']:.0f}%)"
            memory += f" of {info['limit'] / 1e9:.1f} GB"
        self.history.append(row)
        if self.metrics:
            self.metrics.add({"kind": "train", "step": step, "time": round(now or time.time(), 3),
                              **{k: v for k, v in row.items() if k != "step"}})
        bad = sorted((k for k, v in row.items() if not math.isfinite(v)), key=lambda k: k != "loss")
        if bad and self.nonfinite is None:
            self.nonfinite = f"steps {step - steps + 1}-{step}: " + ", ".join(f"{k} {row[k]}" for k in bad)
        mfu = f"  MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
        self.say(f"step {step}/{self.total_steps} ({100 * step / self.total_steps:.1f}%)  loss {row['loss']:.4f}  "
                 f"exact {row['exact_accuracy']:.3f}  lr {lr:.2e}  grad norm {row['grad_norm']:.3g}  "
                 f"{row['step_ms']:.0f} ms/step  {row['steps_per_s']:.2f} steps/s  {row['examples_per_s']:.0f} ex/s  "
                 f"{row['tflops_per_device']:.3g} TFLOP/s/device{mfu}{memory}  "
                 f"ETA {format_duration((self.total_steps - step) / row['steps_per_s'])}")
        if self.tb:
            self._scalars({**{f"train/{k}": v for k, v in row.items() if k != "step"},
                           "xla/compiles": self.sharding.xla_counters()["compiles"]}, step)
            self._upload_tb()

    def window_flops_per_example(self, first: int, last: int) -> float:
        """Model FLOPs per example of a training step, averaged over the steps first..last: each
        step's at the cycles it recursed with (a curriculum's stage, model_flops.stage_flops)."""
        if self.curriculum is None or not self.config.optim.curriculum_epochs or last < first:
            return self.flops_per_example
        total = 0
        for cycles, steps in self.curriculum.stage_steps(first, last):
            if cycles not in self._stage_flops:
                self._stage_flops[cycles] = stage_flops(self.config.model, cycles)["train"]
            total += self._stage_flops[cycles] * steps
        return total / (last - first + 1)

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        """TensorBoard scalars of a step, and the same to the W&B mirror when there is one (on the
        reader thread: both get them in order)."""
        for tag, value in scalars.items():
            self.tb.add_scalar(tag, value, step)
        if self.mirror:
            self.mirror.log(step, scalars)

    def _picture(self, tag: str, picture: np.ndarray, step: int) -> None:
        self.tb.add_image(tag, picture.transpose(2, 0, 1), step)
        if self.mirror:
            self.mirror.log(step, {tag: picture})

    def _histogram(self, tag: str, histogram: dict, step: int) -> None:
        self.tb.add_histogram_raw(tag, global_step=step, **histogram)
        if self.mirror:
            self.mirror.log(step, {tag: histogram})

    def _memory(self) -> dict[str, int] | None:
        """The device's memory now (process 0, when the runtime reports it), or None."""
        if not self.memory:
            return None
        try:
            return self.sharding.memory_info()
        except Exception:  # noqa: BLE001 - reported at start; a later refusal only drops the field
            return None

    def _upload_tb(self) -> int:
        """Flush the event files; for a remote run directory, ask for a copy (its number)."""
        self.tb.flush()
        return self.uploads.request() if self.uploads else 0

    def puzzles(self, step: int, host_batch: dict, predictions: np.ndarray) -> None:
        """TensorBoard pictures (puzzles/N) of the first PICTURE_PUZZLES rows of an evaluation's
        first batch: input, prediction and answer; process 0, which holds those rows."""
        if self.tb:
            for row in range(min(PICTURE_PUZZLES, len(predictions))):
                picture = puzzle_picture(host_batch["inputs"][row], predictions[row], host_batch["labels"][row])
                self._in_order(self._picture, f"puzzles/{row}", picture, step)

    def evaluation(self, result: dict[str, float], step: int, seconds: float) -> None:
        """An evaluation's line and eval/... scalars (its metrics, eval/seconds: the
        evaluation's wall time, eval/examples_per_s) and the eval/halt_step histogram (of the
        first halting steps, training/halt_steps.py); the history keeps only its metrics."""
        self.evals.append(dict(result, step=step))
        arc = "  ".join(f"{k} {v:.4f}" for k, v in result.items() if k.startswith(("pass@", "aggregated_pass@")))
        if "aggregated_evaluations" in result:
            count = result["aggregated_evaluations"]
            arc += f" (aggregated over {count} evaluation{'s' if count != 1 else ''})"
        self.say(f"eval @ step {step}: exact_accuracy {result['exact_accuracy']:.4f}  "
                 f"accuracy {result['accuracy']:.4f}  q_halt_accuracy {result['q_halt_accuracy']:.4f}  "
                 f"steps {result['steps']:.2f}  lm_loss {result['lm_loss']:.4f}  "
                 f"q_halt_loss {result['q_halt_loss']:.4f}  mean_halt_step {result.get('mean_halt_step', 0):.2f}  "
                 f"{arc + '  ' if arc else ''}"
                 + (f"mode_exact_accuracy {result['mode_exact_accuracy']:.4f}  pass_exact_accuracy "
                    f"{result['pass_exact_accuracy']:.4f}  " if "mode_exact_accuracy" in result else "")
                 + f"on {result['num_examples']} examples in {seconds:.0f}s "
                 f"({result['num_examples'] / max(seconds, 1e-9):.0f} ex/s)")
        timing = {"seconds": seconds, "examples_per_s": result["num_examples"] / max(seconds, 1e-9)}
        if self.metrics:  # in order with the train records (the reader adds those)
            self._in_order(self.metrics.add, {"kind": "eval", "step": step, "time": round(time.time(), 3),
                                              **{k: v for k, v in {**result, **timing}.items() if k != "step"}})
        if self.tb:  # the halting buckets as one histogram (training/halt_steps.py), not a scalar each
            self._in_order(self._scalars, {f"eval/{k}": v for k, v in {**result, **timing}.items()
                                           if not halt_steps.is_bucket(k)}, step)
            if halt_steps.histogram(result):
                self._in_order(self._histogram, "eval/halt_step", halt_steps.histogram(result), step)
            self._in_order(self._upload_tb)

    def drain(self) -> None:
        """Wait until every queued read has finished."""
        self.reader.submit(lambda: None).result()

    def close(self) -> None:
        """Wait for the queued reads, then for the last writes of metrics.jsonl and copy of the
        event files, at most CLOSE_TIMEOUT_S (a complete local copy of the event files stays
        behind when it does not finish), then for the W&B mirror (its own bound)."""
        self.reader.shutdown(wait=True)
        if self.metrics:
            last = self.metrics.uploads.request()
            self.metrics.uploads.close()
            if not self.metrics.uploads.wait(last, self.CLOSE_TIMEOUT_S) or self.metrics.uploads.failing:
                print(f"warning: the metrics records in {self.metrics.root} miss the latest steps (the last "
                      "write did not succeed)", flush=True)
        if self.tb:
            self.tb.close()
            if self.uploads:
                last = self.uploads.request()
                self.uploads.close()
                if not self.uploads.wait(last, self.CLOSE_TIMEOUT_S):
                    print(f"warning: the last copy of the TensorBoard logs to {self.tb_remote} did not finish "
                          f"within {self.CLOSE_TIMEOUT_S:.0f}s; they are complete in {self.tb_local}", flush=True)
                elif self.uploads.failing:
                    print(f"warning: the TensorBoard logs in {self.tb_remote} miss the latest steps (the last "
                          f"copy failed); they are complete in {self.tb_local}", flush=True)
        if self.mirror:
            self.mirror.close()  # last, bounded: W&B's copy matters least


class Profile:
    """An XLA profile of run.profile_steps steps, written locally then copied to
    {run_dir}/tb/plugins/profile (object stores cannot take the profiler's writes)."""

    def __init__(self, config, first_step: int, main_host: bool, sharding, say):
        """config: config.Config (read: run.profile_steps, run.dir); off when profile_steps is 0
        and on every host but process 0."""
        self.on = bool(config.run.profile_steps) and main_host
        self.first, self.last = first_step, first_step + config.run.profile_steps - 1
        self.remote = storage.join_url(config.run.dir, "tb")
        self.sharding, self.say = sharding, say
        self.local = tempfile.mkdtemp(prefix="trm-profile-") if self.on else None

    def before_step(self, step: int) -> None:
        if self.on and step == self.first:
            self.sharding.start_profile(self.local)

    def after_step(self, step: int) -> None:
        if self.on and step == self.last:
            self.sharding.stop_profile()
            try:  # best effort, one attempt: a profile is not worth stopping or stalling the run
                storage.upload_dir(self.local, self.remote, attempts=1)
            except storage.StorageError as e:
                self.say(f"warning: the XLA profile stays in {self.local}: {e}")
                return
            self.say(f"XLA profile of steps {self.first}-{self.last} written to {self.remote}/plugins/profile")


def _raise_in_main_thread(future) -> None:
    if future.exception() is not None:  # a failed metrics read must not pass silently
        import _thread
        print(f"error: reading metrics failed: {future.exception()!r}", file=sys.stderr, flush=True)
        _thread.interrupt_main()
