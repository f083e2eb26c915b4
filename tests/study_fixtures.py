"""Helpers of the study tests (test_study.py, test_goodput.py): study.py as a subprocess on the
virtual CPU mesh, reading its output, and a study claimed by three processes with one killed
(conftest.py's `finished_study`, shared by both files: it runs once per test session)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import NamedTuple

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY_LINE = ("cycles demo --data.path {data} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
              "--optim.global-batch-size 32 --optim.max-steps 40 --run.ckpt-every 4 --run.log-every 1 "
              "--eval.every-epochs 10 --model.L-cycles {{1,2}} --seeds 2\n")


def study(*args, env=None, wrap=(), **popen):
    """`python study.py ARGS` on the 8-device CPU mesh, its output piped; `wrap`: a command line that
    runs it (e.g. `unshare --pid --fork --mount-proc`)."""
    return subprocess.Popen([*wrap, sys.executable, os.path.join(PROJECT_DIR, "study.py"), *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=PROJECT_DIR,
                            env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "PYTHONUNBUFFERED": "1",
                                 **(env or {})}, **popen)


def wait_for(proc, pattern, lines, timeout=300):
    deadline = time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line) or time.time() > deadline:
            return line
    return None


def metrics_records(run_dir) -> list[dict]:
    """A run's metrics records (run_log.MetricsFile's parts), in order."""
    return [json.loads(line) for part in sorted((run_dir / "metrics").glob("part-*.jsonl"))
            for line in part.read_text().splitlines() if line.strip()]


LEASE_S = 4.0
"""The fixture's lease: a killed holder's run is taken over this long after its last renewal."""


class KilledStudy(NamedTuple):
    out: object  # the study's directory (a pathlib.Path)
    outputs: dict  # what each study.py process printed, by holder
    study_file: object
    killed: dict  # the killed run: its name, the last step its metrics records held, its last committed
    # checkpoint's step, read from its directory right after the kill, and the kill's time


def run_three_holders_with_a_kill(demo_path, root) -> KilledStudy:
    """A study of 2 configurations x 2 seeds claimed by three study.py processes (holders a, b, c):
    a and c start together, c is killed (SIGKILL, with its run) in the middle of its first run, past
    its committed checkpoint of step 4, and b starts after the kill. The killed run is taken over
    once its lease goes stale."""
    study_file, out = root / "study.txt", root / "out"
    study_file.write_text(STUDY_LINE.format(data=demo_path))
    def holder(name, **popen):
        return study("run", str(study_file), "--out", str(out), "--holder", name, "--lease-s", str(LEASE_S), **popen)
    a, c = holder("a"), holder("c", start_new_session=True)
    killed = []
    first = wait_for(c, r"study: \S+: starting ", killed)  # its first run starts
    assert first and wait_for(c, r"^step 5/40", killed), "".join(killed)
    name = first.split()[1].rstrip(":")
    def state():  # the last step its metrics records hold, and its last committed checkpoint's step
        steps = [int(p.parent.name.split("_")[1]) for p in (out / name / "checkpoints").glob("step_*/COMMITTED")]
        return {"run": name, "reached": max((r["step"] for r in metrics_records(out / name)), default=0),
                "committed": max(steps, default=0)}
    # Freeze the holder (SIGSTOP: its files stay as they are) and look: once its records hold a step
    # past a committed checkpoint of step 4 or later, kill it frozen; otherwise let it run a moment
    # more. A kill timed by the clock alone raced the checkpoint of step 8 on a loaded machine.
    deadline = time.time() + 120
    while True:
        os.killpg(c.pid, signal.SIGSTOP)
        at_kill = state()
        if at_kill["reached"] > at_kill["committed"] >= 4 or time.time() > deadline:
            break
        os.killpg(c.pid, signal.SIGCONT)
        time.sleep(0.02)
    os.killpg(c.pid, signal.SIGKILL)  # the VM goes away, its run with it
    c.wait()
    at_kill["time"] = time.time()
    assert state() == {k: v for k, v in at_kill.items() if k != "time"}, (state(), at_kill)
    b = holder("b")  # a late process
    outputs = {"a": a.communicate(timeout=900)[0], "c": "".join(killed), "b": b.communicate(timeout=900)[0]}
    assert a.returncode == 0 and b.returncode == 0, outputs
    return KilledStudy(out, outputs, study_file, at_kill)
