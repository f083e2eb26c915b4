"""An optional mirror of a run, and of a study's report, to Weights & Biases (W&B), for researchers
who compare their runs there. TensorBoard in the run directory stays the record; the mirror only
copies it, and never stops or slows training.

    python train.py demo --report.wandb-project trm                 # needs `pip install wandb`
    WANDB_MODE=offline python train.py demo --report.wandb-project trm   # no account: `wandb sync` later
    python study.py report runs/tiny-study --wandb-project trm      # the report's table and plots

What it sends (process 0 only; run_log.RunLog hands it what it writes to TensorBoard, under the
same names): the step line's scalars (train/..., xla/compiles), the evaluations' (eval/...,
ARC's pass@k included), the puzzle pictures (puzzles/N), the resolved configuration as the W&B
run's config, and the run directory's URL (config run_dir_url, and the run's notes).

Off the training thread: `Mirror` queues what it is given (a put, never a wait) and a daemon
thread of its own imports wandb, starts the W&B run and logs. A failure (no API key, W&B down, no
network, wandb.log raising) prints one warning and the mirror carries on without it; the
TensorBoard files, metrics records and the run are the same as without a mirror. At the end
`close()` waits at most CLOSE_TIMEOUT_S, and W&B's own finish is bounded by that too.

Resume: the W&B run id names the run, not its directory: "trm-" and a hash of the run
directory's URL and its first launch's start (launch_records.first_launch_start: the oldest launch
record in {run.dir}/launches/), kept in {run.dir}/wandb.json (written when the mirror starts)
with the last step the mirror sent. A relaunch continues the same W&B run (resume="allow"); a new
run in the same directory (after it was deleted) has another first launch, so another W&B run,
never the old one's. W&B keeps a run's history in increasing steps, so a relaunch sends nothing
at or below the last step an earlier launch sent (wandb.json's, or for an online run the resumed
run's own starting step, whichever is later): after a resume from an earlier checkpoint the
redone steps keep the values the first launch sent, and the mirror goes on from the step after.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable

from rundir import storage

RECORD = "wandb.json"
"""{run.dir}/wandb.json: the W&B run's id, project and the last step the mirror sent."""
QUEUE_LIMIT = 10_000
"""Logs waiting for W&B beyond this many are dropped (a W&B that cannot keep up costs its copy,
never the run's memory)."""
CLOSE_TIMEOUT_S = 30.0
"""close() waits at most this long for the last logs and W&B's finish."""
INSTALL = "pip install wandb"


def run_url(run_dir: str) -> str:
    """The run directory as a URL: a local one by its absolute path."""
    return run_dir.rstrip("/") if "://" in run_dir else os.path.abspath(run_dir)


def run_id(run_dir: str, first_launch: float) -> str:
    """The W&B run id of the run in `run_dir` first launched at `first_launch`
    (launch_records.first_launch_start): the same for every launch of the run, another for another run
    in the same directory."""
    identity = json.dumps([run_url(run_dir), first_launch])
    return "trm-" + hashlib.sha256(identity.encode()).hexdigest()[:20]


def import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise SystemExit(f"error: the W&B mirror needs the wandb package ({e}): {INSTALL}") from None
    return wandb


def local_dir(url: str) -> str | None:
    """Where wandb keeps its local files: WANDB_DIR if set, else a local run or study directory
    (DIR/wandb/), else wandb's default (./wandb of the working directory)."""
    if os.environ.get("WANDB_DIR") or "://" in url and not url.startswith("file://"):
        return None
    path = storage.filesystem(url)[1]
    os.makedirs(path, exist_ok=True)
    return path


def settings(wandb):
    """No console capture (the run keeps its own host logs), no system metrics (a sampler on the
    TPU host costs CPU and may query the TPU); an unreachable W&B given up on after 60 s, the
    finish bounded (W&B's atexit teardown too)."""
    return wandb.Settings(console="off", x_disable_stats=True, quiet=True, init_timeout=2 * CLOSE_TIMEOUT_S,
                          finish_timeout=CLOSE_TIMEOUT_S / 2)


def credentials_problem(wandb) -> str | None:
    """Why an online W&B run cannot start (no API key), else None; never prompts."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return None
    if not wandb.login(prompt=False, verify=False):
        return "no W&B API key: set WANDB_API_KEY, run `wandb login`, or WANDB_MODE=offline"
    return None


class Mirror:
    """The mirror of one run (process 0): `log(step, values)` in step order (run_log.RunLog calls it
    from its reader thread, in the order TensorBoard gets them), `close()` at the end."""

    def __init__(self, config, config_dict: dict, first_launch: Callable[[], float]):
        """config: config.Config (read: report.wandb_*, run.dir); config_dict: the resolved
        configuration as a dict (the W&B run's config); first_launch: when the run was first
        launched (train.py gives launch_records.first_launch_start of the run directory), asked on the
        mirror's thread when wandb.json holds no id yet."""
        self.report, self.url = config.report, run_url(config.run.dir)
        self.first_launch_of = first_launch
        self.first_launch = None  # the run's first launch's start (wandb.json's), which its id names
        self.record_url = storage.join_url(config.run.dir, RECORD)
        self.config = {**config_dict, "run_dir_url": self.url}
        self.queue: queue.Queue = queue.Queue()
        self.warned = False
        self.sent = self.failed = 0
        self.floor = self.recorded = -1  # send steps above floor; wandb.json holds `recorded`
        self.where = ""  # the W&B run's URL or its local files
        self.thread = threading.Thread(target=self._run, daemon=True, name="trm-wandb")
        self.thread.start()

    def log(self, step: int, values: dict) -> None:
        """Queue scalars and pictures (RGB arrays [H, W, 3]) of a step; returns at once."""
        if self.queue.qsize() >= QUEUE_LIMIT:
            self.failed += 1
            self._warn(f"fell {QUEUE_LIMIT} logs behind (dropping step {step}'s)")
            return
        self.queue.put((step, dict(values)))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is queued and finish the W&B run, waiting at most timeout_s."""
        self.queue.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            print(f"W&B mirror: not finished within {timeout_s:.0f}s; what it had not sent is not in W&B "
                  "(TensorBoard and metrics/ have it all)", flush=True)
        elif self.failed:
            print(f"W&B mirror: {self.failed} of {self.sent + self.failed} logs not sent (the warning above says "
                  "why); TensorBoard and metrics/ have them all", flush=True)

    def _warn(self, what: str, error: BaseException | None = None) -> None:
        if not self.warned:
            self.warned = True
            reason = "" if error is None else f" ({type(error).__name__}: {str(error).strip()[:300]})"
            print(f"warning: the W&B mirror {what}{reason}; training, TensorBoard and metrics/ go on without it, "
                  "and the mirror warns no more", flush=True)

    def _run(self) -> None:
        run = None
        try:
            run = self._start()
        except BaseException as e:  # noqa: BLE001 - whatever W&B raises, the run goes on
            self._warn("could not start", e)
        while (item := self.queue.get()) is not None:
            step, values = item
            if run is None:
                self.failed += 1
            elif step > self.floor:
                self._send(run, step, values)
        if run is not None:
            try:
                run.finish()
            except BaseException as e:  # noqa: BLE001
                self._warn("could not finish its W&B run", e)

    def _start(self):
        wandb = import_wandb()
        try:
            record = json.loads(storage.read_bytes(self.record_url, attempts=1)) \
                if storage.exists(self.record_url) else {}
        except Exception as e:  # noqa: BLE001 - without it: the id from the first launch, every step sent
            print(f"W&B mirror: cannot read {self.record_url} ({e}); going on as a first launch", flush=True)
            record = {}
        problem = credentials_problem(wandb)
        if problem:
            raise RuntimeError(problem)
        r = self.report
        if not record.get("id"):  # the run's first mirrored launch: its id, kept before anything is sent
            first = self.first_launch_of()
            record = {"id": run_id(self.url, first), "first_launch": first, "project": r.wandb_project,
                      "entity": r.wandb_entity, "last_step": -1}
            self._write_record(record)
        self.first_launch = record.get("first_launch")
        run = wandb.init(project=r.wandb_project, entity=r.wandb_entity, id=record["id"],
                         resume="allow", name=r.wandb_name or os.path.basename(self.url), group=r.wandb_group,
                         tags=list(r.wandb_tags) or None, config=self.config, notes=f"run directory: {self.url}",
                         dir=local_dir(self.url), settings=settings(wandb))
        self.recorded = record.get("last_step", -1)
        self.floor = max(self.recorded, run.starting_step - 1 if run.resumed else -1)
        self.where = f"offline, in {os.path.dirname(run.dir)}: `wandb sync` of it uploads it" if run.offline \
            else run.url
        again = f"; steps up to {self.floor} were sent by an earlier launch and are not sent again" \
            if self.floor >= 0 else ""
        print(f"W&B mirror: run {run.id} of project {r.wandb_project} ({self.where}){again}", flush=True)
        return run

    def _send(self, run, step: int, values: dict) -> None:
        import wandb

        try:
            run.log({k: as_media(wandb, v) for k, v in values.items()}, step=step)
        except BaseException as e:  # noqa: BLE001
            self.failed += 1
            self._warn(f"failed to log step {step}", e)
            return
        self.sent += 1
        if step > self.recorded:
            record = {"id": run.id, "first_launch": self.first_launch, "project": self.report.wandb_project,
                      "entity": self.report.wandb_entity, "last_step": step, "time": round(time.time(), 3)}
            if self._write_record(record):
                self.recorded = step

    def _write_record(self, record: dict) -> bool:
        try:
            storage.write_bytes(self.record_url, json.dumps(record).encode(), attempts=1)
            return True
        except Exception as e:  # noqa: BLE001 - the next step's write tries again
            self._warn(f"could not write {self.record_url}", e)
            return False


def as_media(wandb, value):
    """A value as W&B logs it: an image for a picture [H, W, 3], a histogram for training/run_log.py's
    histogram (add_histogram_raw's arguments), else the value."""
    if isinstance(value, dict):
        limits = value["bucket_limits"]
        return wandb.Histogram(np_histogram=(value["bucket_counts"], [limits[0] - 1, *limits]))
    return wandb.Image(value) if getattr(value, "ndim", 0) == 3 else value


def attach_study_report(out: str, project: str, entity: str | None, rows: list[dict], columns: list[str],
                        plots: list[str]) -> str:
    """One W&B run of the study's report (group: the study's name, job type study-report) holding
    its table (study/results, a W&B Table: a row per run and per configuration) and its plots
    (study/plots/NAME); returns where it went. Raises what W&B raises."""
    wandb = import_wandb()
    problem = credentials_problem(wandb)
    if problem:
        raise RuntimeError(problem)
    url, name = run_url(out), os.path.basename(run_url(out))
    run = wandb.init(project=project, entity=entity, group=name, job_type="study-report", name=f"{name} report",
                     config={"study_dir_url": url}, notes=f"study directory: {url}", dir=local_dir(url),
                     settings=settings(wandb))
    try:
        table = wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows],
                            allow_mixed_types=True)
        run.log({"study/results": table, **{f"study/plots/{os.path.splitext(os.path.basename(p))[0]}": wandb.Image(p)
                                             for p in plots}})
        return f"offline, in {os.path.dirname(run.dir)}" if run.offline else run.url
    finally:
        run.finish()
