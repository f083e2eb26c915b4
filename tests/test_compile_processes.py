"""tpu_compile.compile_isolated (what `study.py plan` and `tpu_compile.py` compile with): every
trace and every compile in a process that ends, so a plan's memory is one program's, however
many programs it has; a plan killed midway keeps what it compiled (the cache) and the next one
compiles only what is missing. Three distinct narrow programs (the demo's evaluation step at
widths 32, 64 and 96, one cycle each: seconds per compile) for a v4-8 host."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import PROJECT_DIR

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="jax[tpu] 0.10 (libtpu's compile-only client) "
                                                                   "needs Python 3.11+")

WIDTHS = (32, 64, 96)
PROCESS_PEAK_BOUND = 2.5e9
"""Bytes: the most one trace or compile process of these narrow programs may hold (measured:
1.1-1.3 GB each on the 2-core test machine, of which ~0.5 GB is importing torch and jax)."""

DRIVER = """
import dataclasses, json, resource, sys
from tpu_costs import compiled_programs
from training.config import PRESETS
base = PRESETS["demo"][1]
narrowed_model = compiled_programs.narrowed_model
jobs = [("demo", dataclasses.replace(base, model=dataclasses.replace(narrowed_model(base.model, width), H_cycles=1,
                                                                    L_cycles=1)), "v4-8") for width in (32, 64, 96)]
results = compiled_programs.compile_isolated(jobs, programs=("eval_step",), processes=int(sys.argv[1]))
print("RESULT", json.dumps({"children_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                            "results": [r[0] for r in results]}))
"""


def driver(processes: int, cache, **popen):
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(processes)], cwd=PROJECT_DIR, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, TRM_TPU_COMPILE_CACHE=str(cache)), **popen)


def entries(cache) -> list[str]:
    return sorted(p for p in os.listdir(cache) if p.endswith(".json")) if cache.exists() else []


def test_a_killed_plan_keeps_what_it_compiled_and_the_next_compiles_only_the_rest_in_bounded_processes(tmp_path):
    cache = tmp_path / "cache"
    # One process at a time; killed (SIGKILL, no clean-up of its own) once the first program is in the cache.
    first = driver(1, cache)
    deadline = time.time() + 300
    while not entries(cache) and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert entries(cache), first.communicate()[0][-3000:]
    os.kill(first.pid, signal.SIGKILL)
    output = first.communicate()[0]
    kept = entries(cache)
    assert 1 <= len(kept) < len(WIDTHS), output[-3000:]
    # Its children die with it (the parent-death signal): no process of its session is left.
    deadline, left = time.time() + 30, ["?"]
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-s", str(first.pid)], capture_output=True,
                              text=True).stdout.splitlines()
    assert left == [], left
    assert not [p for p in os.listdir(cache) if "partial" in p]  # no half-written entry
    # Two at a time: only the programs not cached are traced and compiled, each in its own process.
    second = driver(2, cache)
    output = second.communicate(timeout=600)[0]
    assert second.returncode == 0, output[-3000:]
    missing = len(WIDTHS) - len(kept)
    assert f"{missing} program(s) to compile, {missing} trace(s) first; 2 process(es) at once" in output, output
    traced = re.findall(r"traced demo .* process peak ([\d.]+) GB \(measured\)", output)
    compiled = re.findall(r"\[(\d)/(\d)\] demo .* eval_step: compiled in \d+s, process peak ([\d.]+) GB", output)
    assert len(traced) == missing and [(int(i), int(n)) for i, n, _ in compiled] == \
        [(i, missing) for i in range(1, missing + 1)], output
    result = json.loads(output.split("RESULT ", 1)[1])
    # The OS's peak of every process this plan started (wait4's, the largest of its children).
    assert 0 < result["children_peak"] < PROCESS_PEAK_BOUND, result["children_peak"]
    assert all(float(gb) * 1e9 < PROCESS_PEAK_BOUND for gb in traced + [c[2] for c in compiled])
    assert len(entries(cache)) == len(WIDTHS) and set(kept) <= set(entries(cache))
    widths = [r for r in result["results"]]
    assert all(r["compiled"] and r["program"] == "eval_step" for r in widths), widths
    assert sum(not r["cached"] for r in widths) == missing
    # Wider programs do more work: the compiler's FLOPs grow with the width.
    flops = [r["flops"] for r in widths]
    assert flops == sorted(flops) and flops[0] < flops[-1], flops


def test_a_writer_killed_mid_write_leaves_no_partial_file_for_ever(tmp_path, monkeypatch):
    """_store writes .KEY.PID.partial, then renames it: a compile killed between the two leaves
    the file. clean_partials (which compile_isolated runs as it ends) removes those whose writer
    has ended and keeps one whose writer still runs (another plan writing now)."""
    from tpu_costs import compiled_programs

    monkeypatch.setattr(compiled_programs, "CACHE_DIR", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead, alive = tmp_path / f".k1.{ended.pid}.partial", tmp_path / f".k2.{os.getpid()}.partial"
    dead.write_text("{")
    alive.write_text("{")
    compiled_programs._store("k3", {"compiled": True})
    assert compiled_programs.clean_partials() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "k3.json"]


def test_memory_kinds_are_per_program_and_preset_so_a_sudoku_peak_never_sizes_an_arc_program(monkeypatch, tmp_path):
    """bounded_processes sizes the next process of a kind by the largest peak of that kind: the
    traces and compiles of a Sudoku and an ARC program in one plan are of different kinds (and
    the two programs of one run too), so neither's peak sizes the other's."""
    import dataclasses

    from tpu_costs import bounded_processes, compiled_programs
    from training.config import PRESETS

    monkeypatch.setattr(compiled_programs, "CACHE_DIR", str(tmp_path))
    kinds = {}

    def run(tasks, processes=None):  # what compile_isolated hands bounded_processes: the traces, then their compiles
        for task in tasks:
            kinds[task.name] = task.kind
            for compile_task in task.then(bounded_processes.Finished(task, 0, 1.0, 1 << 30)):
                kinds[compile_task.name] = compile_task.kind
        raise KeyboardInterrupt  # nothing traced or compiled

    monkeypatch.setattr(bounded_processes, "run", run)
    jobs = [(p, dataclasses.replace(PRESETS[p][1], model=compiled_programs.narrowed_model(PRESETS[p][1].model)), "v4-8")
            for p in ("sudoku-mlp", "arc1")]
    with pytest.raises(KeyboardInterrupt):
        compiled_programs.compile_isolated(jobs, labels=["sudoku", "arc"], say=lambda *a, **k: None)
    assert kinds == {"sudoku for v4-8": "trace sudoku-mlp v4-8", "arc for v4-8": "trace arc1 v4-8",
                     "sudoku for v4-8 train_step": "compile train_step sudoku-mlp v4-8",
                     "sudoku for v4-8 eval_step": "compile eval_step sudoku-mlp v4-8",
                     "arc for v4-8 train_step": "compile train_step arc1 v4-8",
                     "arc for v4-8 eval_step": "compile eval_step arc1 v4-8"}


THREADED_PARENT = """
import sys, threading, time
from tpu_costs import bounded_processes
threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(int, 1)], daemon=True).start()  # a busy thread
bounded_processes.run([bounded_processes.Task("sleeper", ["sleep", "120"], "sleep")], processes=1)
"""


def test_a_child_of_a_threaded_parent_dies_with_it():
    """The parent-death signal is prepared before the fork (nothing is imported or loaded in the
    child of a threaded parent, which could deadlock): a child started beside a busy thread
    starts, and dies when its parent is killed."""
    parent = subprocess.Popen([sys.executable, "-c", THREADED_PARENT], cwd=PROJECT_DIR, start_new_session=True)
    session = lambda: subprocess.run(["ps", "-o", "pid=,args=", "-s", str(parent.pid)], capture_output=True,  # noqa: E731
                                     text=True).stdout.splitlines()
    deadline = time.time() + 60
    while not any("sleep 120" in line for line in session()) and time.time() < deadline:
        time.sleep(0.2)
    assert any("sleep 120" in line for line in session()), session()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 30
    while session() and time.time() < deadline:
        time.sleep(0.2)
    assert session() == []
