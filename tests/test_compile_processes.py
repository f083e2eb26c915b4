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
import tpu_compile
from config import PRESETS
base = PRESETS["demo"][1]
jobs = [("demo", dataclasses.replace(base, model=dataclasses.replace(tpu_compile.narrow(base.model, width), H_cycles=1,
                                                                    L_cycles=1)), "v4-8") for width in (32, 64, 96)]
results = tpu_compile.compile_isolated(jobs, programs=("eval_step",), processes=int(sys.argv[1]))
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
