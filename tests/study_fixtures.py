"""Helpers of the study tests (test_study.py, test_goodput.py): study.py as a subprocess on the
virtual CPU mesh, reading its output, and a study run as two simulated hosts with one killed
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


def study(*args, env=None, **popen):
    return subprocess.Popen([sys.executable, os.path.join(PROJECT_DIR, "study.py"), *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=PROJECT_DIR,
                            env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", PYTHONUNBUFFERED="1",
                                     **(env or {})), **popen)


def wait_for(proc, pattern, lines, timeout=300):
    deadline = time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line) or time.time() > deadline:
            return line
    return None


def metrics_records(run_dir) -> list[dict]:
    """A run's metrics records (report.MetricsFile's parts), in order."""
    return [json.loads(line) for part in sorted((run_dir / "metrics").glob("part-*.jsonl"))
            for line in part.read_text().splitlines() if line.strip()]


class KilledStudy(NamedTuple):
    out: object  # the study's directory (a pathlib.Path)
    outputs: dict  # what each study.py process printed
    study_file: object
    killed: dict  # the killed run: its name, the last step its metrics records held and its last
    # committed checkpoint's step, read from its directory right after the kill


def run_two_hosts_with_a_kill(demo_path, root) -> KilledStudy:
    """A study of 2 configurations x 2 seeds run as hosts 0 and 1 of 2, host 1 killed (SIGKILL, with
    its run) in the middle of its second run, past its committed checkpoint of step 4, and started
    again."""
    study_file, out = root / "study.txt", root / "out"
    study_file.write_text(STUDY_LINE.format(data=demo_path))
    host0 = study("run", str(study_file), "--out", str(out), "--host", "0", "--hosts", "2")
    host1 = study("run", str(study_file), "--out", str(out), "--host", "1", "--hosts", "2", start_new_session=True)
    killed = []
    second = wait_for(host1, r"study: \[2/2\] ", killed)  # its second run starts
    assert second and wait_for(host1, r"^step 5/40", killed)
    name = second.split()[2].rstrip(":")
    def state():  # the last step its metrics records hold, and its last committed checkpoint's step
        steps = [int(p.parent.name.split("_")[1]) for p in (out / name / "checkpoints").glob("step_*/COMMITTED")]
        return {"run": name, "reached": max((r["step"] for r in metrics_records(out / name)), default=0),
                "committed": max(steps, default=0)}
    # Freeze the host (SIGSTOP: its files stay as they are) and look: once its records hold a step
    # past a committed checkpoint of step 4 or later, kill it frozen; otherwise let it run a moment
    # more. A kill timed by the clock alone raced the checkpoint of step 8 on a loaded machine.
    deadline = time.time() + 120
    while True:
        os.killpg(host1.pid, signal.SIGSTOP)
        at_kill = state()
        if at_kill["reached"] > at_kill["committed"] >= 4 or time.time() > deadline:
            break
        os.killpg(host1.pid, signal.SIGCONT)
        time.sleep(0.02)
    os.killpg(host1.pid, signal.SIGKILL)  # the host goes away, its run with it
    host1.wait()
    assert state() == at_kill, (state(), at_kill)
    again = study("run", str(study_file), "--out", str(out), "--host", "1", "--hosts", "2")
    outputs = {"host 0": host0.communicate(timeout=900)[0], "host 1 killed": "".join(killed),
               "host 1 again": again.communicate(timeout=900)[0]}
    assert host0.returncode == 0 and again.returncode == 0, outputs
    return KilledStudy(out, outputs, study_file, at_kill)
