"""Where a study's time went: each run's and the study's device time split by cause, the goodput
(training and evaluation over all of it), and what the numbers advise. From the runs' own records
(training/launch_records.py's launch records) and, for a slice's downtime, `launch.sh --retry`'s record.

Per run (the sum of its launches, each from its process start to its last record):
    training     the step loop, less the work lost
    evaluation   evaluations (the loop's and the final one), compiling excluded
    compiling    XLA's compile seconds (its counters), wherever they fell
    startup      process start to the loop's first step (runtime, data, restore), compiling excluded
    checkpoint   the loop's pauses to save (and waits for a save to be written)
    closing      after the loop: the last waits and closes
    lost         steps trained again after a launch ended without saving them: from the step the
                 next launch resumed from to the last step the metrics records held (recorded by
                 that next launch), times the ended launch's time per step (an estimate)
Per study, a host (study.py --host; one "host" when the study ran without it):
    idle         a host with no run (before its first, between its runs, after its last) while
                 others still train, from the study's first launch to its last record
    down         a host waiting for a relaunch: from the last record of a launch that did not
                 finish (killed, SIGTERM, exit 75) to the next launch there
The study's device time: each run's causes times its devices, idle and down times the host's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from rundir import storage
from rundir.contract import format_duration, read_launches, read_records

CAUSES = ("training", "evaluation", "compiling", "startup", "checkpoint", "closing", "lost")
"""A run's causes, in the order printed; a study adds IDLE and DOWN."""
STUDY_CAUSES = (*CAUSES, "idle", "down")
LABELS = {"training": "training steps", "evaluation": "evaluation", "compiling": "compiling", "startup": "start-up",
          "checkpoint": "checkpoint pauses", "closing": "closing", "lost": "work lost to preemptions",
          "idle": "idle hosts", "down": "slice down (waiting for a relaunch)"}
RELAUNCH_AFTER = ("killed", "SIGTERM", "exit 75")
"""How a launch ended when the next one on its host is a relaunch (its gap: down, not idle)."""
RETRY_DIR = ("study", "retry")
"""DIR/study/retry/EVENT-TIME.json: launch.sh --retry's record ({"event": "preempted" or
"relaunched", "time": epoch seconds, "why": text})."""
LARGE = 0.10
"""A cause this large a share of the study's device time gets a sentence of advice."""


@dataclass
class RunTime:
    """Where one run's time went."""

    name: str
    launches: list[dict]
    seconds: dict[str, float]
    wall: float  # its launches' time, process start to last record, summed
    devices: int
    lost_steps: int = 0
    preemptions: int = 0  # launches that ended without finishing and were launched again
    step_s: float | None = None  # time per training step (the loop's, over all launches)
    ckpt_every: int | None = None
    bars: list[dict] = field(default_factory=list)  # one per launch: host, start, end, ended, relaunch

    @property
    def goodput(self) -> float | None:
        return (self.seconds["training"] + self.seconds["evaluation"]) / self.wall if self.wall > 0 else None


def how_it_ended(launch: dict, last: bool, running: bool) -> str:
    if launch.get("ended"):
        return launch["ended"]
    return "running" if last and running else "killed"


def run_time(name: str, launches: list[dict], running: bool, host=None, ckpt_every: int | None = None) -> RunTime:
    """A run's causes from its launch records, oldest first; `running`: the study says it runs now
    (its newest launch without an end is running, not killed); `host`: where launches that do not
    say ran."""
    seconds = dict.fromkeys(CAUSES, 0.0)
    result = RunTime(name, launches, seconds, 0.0, max((r.get("devices", 0) for r in launches), default=0),
                     ckpt_every=ckpt_every)
    trained_steps = trained_s = 0.0
    for i, launch in enumerate(launches):
        ended = how_it_ended(launch, i == len(launches) - 1, running)
        for phase, value in launch["seconds"].items():
            seconds[phase] += value
        result.wall += launch["time"] - launch["process_start"]
        steps = launch.get("step", 0) - launch.get("start_step", 0)
        trained_steps, trained_s = trained_steps + steps, trained_s + launch["seconds"]["training"]
        relaunch = i > 0 and result.bars[-1]["ended"] in RELAUNCH_AFTER
        on = launch["study_host"] if launch.get("study_host") is not None else host
        result.bars.append({"run": name, "host": on, "start": launch["process_start"], "end": launch["time"],
                            "ended": ended, "relaunch": relaunch})
        if relaunch:
            result.preemptions += 1
        reached = launch.get("previous_reached")
        if i > 0 and reached is not None and reached > launch["start_step"]:
            lost = reached - launch["start_step"]
            before = launches[i - 1]
            per_step = before["seconds"]["training"] / max(1, before.get("step", 0) - before.get("start_step", 0))
            moved = min(lost * per_step, seconds["training"])
            result.lost_steps += lost
            seconds["training"] -= moved
            seconds["lost"] += moved
    result.step_s = trained_s / trained_steps if trained_steps else None
    return result


@dataclass
class StudyTime:
    """Where a study's time went: its runs, its hosts, its totals in device-seconds."""

    runs: dict[str, RunTime]
    hosts: dict = field(default_factory=dict)  # label -> devices, idle, down, intervals
    start: float | None = None
    end: float | None = None
    totals: dict[str, float] = field(default_factory=dict)  # device-seconds per cause
    retry_events: list[dict] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.totals.values())

    @property
    def goodput(self) -> float | None:
        return (self.totals["training"] + self.totals["evaluation"]) / self.total if self.total > 0 else None


def read_retry_events(out: str) -> list[dict]:
    """launch.sh --retry's record of preemptions and relaunches of this study (none: [])."""
    events = read_records(storage.join_url(out, *RETRY_DIR), "*.json")
    return sorted((e for e in events if isinstance(e, dict) and isinstance(e.get("time"), (int, float))),
                  key=lambda e: e["time"])


def retry_down_seconds(events: list[dict]) -> float:
    """The slice's time down by launch.sh --retry's record: each preemption to the relaunch after it."""
    down, since = 0.0, None
    for event in events:
        if event.get("event") == "preempted" and since is None:
            since = event["time"]
        elif event.get("event") == "relaunched" and since is not None:
            down, since = down + event["time"] - since, None
    return down


def study_time(out: str, statuses: dict[str, dict], ckpt_every: dict[str, int] | None = None) -> StudyTime:
    """The study in `out`: each run's launch records (statuses: each run's study status, for its
    host and whether it runs now), its hosts' idle and down time, the totals."""
    runs = {}
    for name, status in statuses.items():
        launches = read_launches(storage.join_url(out, name))
        if launches:
            host = status.get("host")
            runs[name] = run_time(name, launches, status.get("state") == "running",
                                  "all" if host is None else host, (ckpt_every or {}).get(name))
    study = StudyTime(runs, retry_events=read_retry_events(out))
    study.totals = dict.fromkeys(STUDY_CAUSES, 0.0)
    for r in runs.values():
        for cause, value in r.seconds.items():
            study.totals[cause] += value * r.devices
    bars = sorted((b for r in runs.values() for b in r.bars), key=lambda b: b["start"])
    if not bars:
        return study
    study.start, study.end = min(b["start"] for b in bars), max(b["end"] for b in bars)
    for bar in bars:
        host = study.hosts.setdefault(bar["host"], {"devices": 0, "idle": 0.0, "down": 0.0, "bars": [],
                                                    "idle_spans": [], "down_spans": []})
        host["devices"] = max(host["devices"], runs[bar["run"]].devices)
        host["bars"].append(bar)
    for host in study.hosts.values():
        at, after = study.start, None
        for bar in host["bars"]:
            if bar["start"] > at:
                kind = "down" if after in RELAUNCH_AFTER else "idle"
                host[kind] += bar["start"] - at
                host[f"{kind}_spans"].append((at, bar["start"]))
            at, after = max(at, bar["end"]), bar["ended"]
        if study.end > at:
            host["idle"] += study.end - at
            host["idle_spans"].append((at, study.end))
        study.totals["idle"] += host["idle"] * host["devices"]
        study.totals["down"] += host["down"] * host["devices"]
    return study


def run_columns(r: RunTime | None) -> dict:
    """The run's columns of results.csv / results.md (seconds of wall time per cause)."""
    if r is None:
        return {}
    row = {f"{cause}_s": round(r.seconds[cause], 2) for cause in CAUSES}
    row.update(launches=len(r.launches), launched_s=round(r.wall, 2), lost_steps=r.lost_steps,
               **{"goodput_%": "" if r.goodput is None else f"{100 * r.goodput:.1f}"})
    return row


COLUMNS = ["launches", "launched_s", *(f"{c}_s" for c in CAUSES), "lost_steps", "goodput_%"]


def _hours(device_seconds: float) -> str:
    hours = device_seconds / 3600
    return f"{hours:,.1f}" if hours >= 10 else f"{hours:.3f}" if hours >= 0.01 else f"{hours:.2g}"


def summary(study: StudyTime) -> str:
    """The study's lines: a line per cause (device-hours, share), the goodput, the advice."""
    if not study.runs:
        return "where the time went: no launch records yet (runs trained before training/launch_records.py kept none)"
    total = study.total
    launches = sum(len(r.launches) for r in study.runs.values())
    lost_steps = sum(r.lost_steps for r in study.runs.values())
    preemptions = sum(r.preemptions for r in study.runs.values())
    lines = [f"where the device time went ({launches} launches of {len(study.runs)} runs on "
             f"{len(study.hosts)} host(s), {format_duration(study.end - study.start)} from the first launch to the "
             f"last record; device-hours = hours x devices):"]
    for cause in STUDY_CAUSES:
        value = study.totals[cause]
        note = f"  ({lost_steps} steps trained again after {preemptions} relaunch(es))" if cause == "lost" else ""
        lines.append(f"  {LABELS[cause]:<36} {_hours(value):>9} device-h  {100 * value / total:5.1f}%{note}")
    lines.append(f"  {'total':<36} {_hours(total):>9} device-h")
    if study.retry_events:
        down = retry_down_seconds(study.retry_events)
        count = sum(e.get("event") == "preempted" for e in study.retry_events)
        lines.append(f"launch.sh --retry recorded {count} preemption(s); the slice was down {format_duration(down)} "
                     "from each to its relaunch")
    lines.append(f"goodput (training + evaluation over all of it): {100 * study.goodput:.1f}%")
    lines += advice(study)
    return "\n".join(lines)


def advice(study: StudyTime) -> list[str]:
    """A sentence for each cause that is a large share of the study's device time."""
    total, said = study.total, []
    share = {c: study.totals[c] / total for c in STUDY_CAUSES}
    runs = list(study.runs.values())
    preemptions = sum(r.preemptions for r in runs)
    if share["lost"] >= LARGE / 2 and preemptions:
        run_hours = sum(r.wall for r in runs) / 3600
        between = sum(r.wall for r in runs) / preemptions
        # The interval in effect: --run.ckpt-every, or the run's end when that comes first.
        intervals = sorted({min(r.ckpt_every, max(x.get("step", 0) for x in r.launches)) for r in runs
                            if r.preemptions and r.ckpt_every})
        pauses = [(r.seconds["checkpoint"], sum(x.get("checkpoint_pauses", 0) for x in r.launches)) for r in runs]
        pause = sum(s for s, _ in pauses) / max(1, sum(n for _, n in pauses))
        steps = [r.step_s for r in runs if r.step_s]
        text = (f"advice: work lost to preemptions is {100 * share['lost']:.0f}% of the device time ({preemptions} in "
                f"{run_hours:.2g} run-hours, one every {format_duration(between)} of a run): a preemption loses half "
                "a checkpoint interval on average, so ")
        text += (f"--run.ckpt-every {max(1, intervals[0] // 2)} (saving every {intervals[0]} steps now) would "
                 "about halve it"
                 if len(intervals) == 1 else "half the --run.ckpt-every would about halve it")
        if steps and pause > 0:
            young = math.sqrt(2 * pause * between) / (sum(steps) / len(steps))
            text += (f"; for pauses of {pause:.1f}s the interval with the least pauses plus lost work is about "
                     f"{max(1, round(young))} steps (Young: sqrt(2 x pause x time between preemptions))")
        said.append(text + ".")
    if share["compiling"] >= LARGE:
        launches = sum(len(r.launches) for r in runs)
        per = sum(r.seconds["compiling"] for r in runs) / max(1, launches)
        said.append(f"advice: compiling is {100 * share['compiling']:.0f}% of the device time ({per:.0f}s per launch, "
                    f"{launches} launches): every launch compiles again (torch_xla 2.9 cannot reuse a compile cache "
                    "on a TPU), so short runs and relaunches pay it most; longer runs amortise it.")
    if share["evaluation"] >= 2 * LARGE:
        said.append(f"advice: evaluation is {100 * share['evaluation']:.0f}% of the device time: a larger "
                    "--eval.every-epochs or a smaller --eval.max-examples costs less, if its curve still informs.")
    if share["startup"] >= LARGE:
        said.append(f"advice: start-up is {100 * share['startup']:.0f}% of the device time (runtime, data, "
                    "restore before the first step): fewer, longer runs pay it less often.")
    if share["idle"] >= LARGE:
        said.append(f"advice: hosts sat idle {100 * share['idle']:.0f}% of the device time while others still "
                    "trained: a host's share ends with its longest run; more runs than hosts, or runs of similar "
                    "length, keep them busy.")
    if share["down"] >= LARGE:
        said.append(f"advice: the slice was down {100 * share['down']:.0f}% of the device time between a "
                    "preemption and the relaunch: launch.sh --retry relaunches by itself; --queued may get a "
                    "slice back sooner.")
    return said
