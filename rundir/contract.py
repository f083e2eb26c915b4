"""A run directory's contract: what train.py promises whoever runs it and reads it back (a
study's runner and report, launch.sh --retry), so that they need none of the training loop's code.
The layout's names, train.py's exit statuses, the environment variables a study sets for its
trainer, and the readers of the records train.py leaves:

    {run.dir}/final.json                 the run trained all its steps and evaluated (FINAL)
    {run.dir}/launches/launch-TIME.json  each launch's record (LAUNCH_DIR; read_launches)
"""
from __future__ import annotations

import json

from rundir import storage

FINAL = "final.json"
"""Written by process 0 last, after the run's last checkpoint and evaluation: the run is done."""
LAUNCH_DIR = "launches"
"""Each launch's record, launch-TIME.json (training/launch_records.py writes them)."""

EXIT_RETRYABLE = 75
"""train.py's exit status when a relaunch may help (EX_TEMPFAIL): a hang (the watchdog), a lost
peer host, storage failing beyond its retries. launch.sh train --retry relaunches on it; 1 means
a failure that a relaunch would repeat."""
EXIT_FENCED = 76
"""train.py's exit status when it stopped because its lease is no longer good (or its holder
died): the holder's run goes to whoever holds its claim next, from the last checkpoint."""

LAUNCH_STARTED_ENV = "TRM_LAUNCH_STARTED"
"""study.py sets it to the time it started train.py (more exact than the process's start in /proc)."""
STUDY_HOST_ENV = "TRM_STUDY_HOST"
"""study.py sets it to the study's holder (the VM, or HOSTNAME-PID) that trains the run."""


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def read_records(directory: str, pattern: str) -> list[dict]:
    """The JSON records in `directory` whose names match `pattern` (a glob), in name order; a
    record cut short (a kill mid-write) is left out, a missing directory gives []."""
    fs, path = storage.filesystem(directory)
    try:
        fs.invalidate_cache(path)
        names = sorted(fs.glob(f"{path.rstrip('/')}/{pattern}"))
    except FileNotFoundError:
        return []
    records = []
    for name in names:
        try:
            records.append(json.loads(fs.cat(name)))
        except (ValueError, OSError):
            continue
    return records


def read_launches(run_dir: str) -> list[dict]:
    """The launch records of a run directory, oldest first (none: [])."""
    records = read_records(storage.join_url(run_dir, LAUNCH_DIR), "launch-*.json")
    return sorted((r for r in records if isinstance(r, dict) and "process_start" in r),
                  key=lambda r: r["process_start"])
