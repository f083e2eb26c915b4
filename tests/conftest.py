"""Test environment: a virtual 8-device CPU mesh in SPMD mode, and a local GCS server.

The PJRT variables must be set before torch_xla starts its runtime, so they are set at import
time of this file, which pytest loads before any test module.
"""
import fcntl
import os
import pickle
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "8"
# gcsfs 2026.x otherwise waits 60 s per bucket on a gRPC call the emulator lacks.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

PROJECT_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT_DIR))

NUM_VIRTUAL_DEVICES = 8

import sharding  # noqa: E402 - after the PJRT variables and the path

# The CPU client's thread pool, as start_runtime sizes it for the product's runs (sharding.py says
# why twice the device count: with as many threads as devices, an all-reduce can wait 10 s for a
# device whose task has no thread, and the process aborts).
sharding.size_cpu_client_pool(NUM_VIRTUAL_DEVICES)


@pytest.fixture(scope="session", autouse=True)
def spmd_mesh():
    """The global 1-D data mesh over the 8 virtual CPU devices, SPMD mode switched on.

    Autouse, so the XLA runtime starts before any test runs CPU autograd: torch's autograd
    engine sizes its per-device queues once, and XLA devices registered later crash it.
    """
    sharding.init_spmd()
    mesh = sharding.data_mesh()
    assert mesh.size() == NUM_VIRTUAL_DEVICES
    return mesh


# Every test's time limit (pytest-timeout), unless it or its file says otherwise
# (@pytest.mark.timeout), so a hang fails its own test by name, with every thread's stack, instead
# of eating CI's time: the slowest tests take about 4 minutes on 2 loaded cores. pytest-timeout's
# signal method fails the test where it waits (a subprocess, a sleep, a socket) with every thread's
# stack; its thread method would end the worker process, which pytest-xdist 3.8 then restarts on
# the same test again and again.
TEST_TIMEOUT_S = 900


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # --timeout, PYTEST_TIMEOUT or an ini's timeout, when given, win
    if getattr(config.option, "timeout", "absent") is None and not os.environ.get("PYTEST_TIMEOUT") \
            and not config.getini("timeout"):
        config.option.timeout = TEST_TIMEOUT_S


LONGEST_FIRST = ("test_recipes_eqr.py", "test_tpu_compile.py", "test_recipes_urm.py", "test_fencing.py",
                 "test_launch.py", "test_study.py", "test_recipes.py", "test_outage.py", "test_faults.py",
                 "test_train.py", "test_checkpoint.py", "test_archs_runs.py", "test_ptrm.py", "test_smoke.py",
                 "test_device_order.py", "test_wandb.py", "test_study_testtime.py", "test_eval.py", "test_archs.py",
                 "test_puzzle_table.py", "test_bench.py", "test_halting.py", "test_cpu_mesh.py")
"""Test files by their time in the whole suite, longest first (docs/measurements.md: how measured):
test.sh's three pytest-xdist workers take whole files in collection order (--no-loadscope-reorder),
so the longest start first and the short ones fill in at the end, where xdist's own order (by the
number of tests) can start a long file late and leave the other workers idle for its end. Files
not named here follow, in pytest's order."""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept


@pytest.fixture
def one_torch_thread():
    """Eager ops on tensors as small as the tests' run ~30x faster on one thread than on two busy cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def gcs_server():
    """A real GCS JSON-API server (gcp-storage-emulator, with GCS's ifGenerationMatch precondition on
    inserts: tests/gcs_emulator.py) on loopback; yields its bucket name.

    STORAGE_EMULATOR_HOST points gcsfs (and subprocesses started by tests) at it.
    """
    from tests.ports import free_port

    bucket = "trm-test"
    for _attempt in range(3):  # a port taken between the pick and the bind by a process outside this test run
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, str(PROJECT_DIR / "tests" / "gcs_emulator.py"), "start", "--host", "127.0.0.1",
             "--port", str(port), "--in-memory",
             "--default-bucket", bucket],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        if proc.poll() is None and time.time() < deadline:
            break
        proc.kill()
        proc.wait()
    else:
        raise RuntimeError(f"gcp-storage-emulator did not start (3 tries, the last on port {port})")
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    try:
        yield bucket
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old


@pytest.fixture
def gcs_url(gcs_server):
    """A fresh gs:// prefix inside the emulator's bucket, unique per test."""
    return f"gs://{gcs_server}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory):
    """A small 4x4-Sudoku demo dataset (100 groups of 8 puzzles, 40 held-out puzzles), built once."""
    from puzzles import builders
    path = str(tmp_path_factory.mktemp("demo"))
    builders.build_demo(path, train_puzzles=100, num_aug=7, test_puzzles=40, seed=0)
    return path


@pytest.fixture(scope="session")
def finished_study(demo_path, tmp_path_factory):
    """A study claimed by three processes, one killed mid-run and its run taken over (study_fixtures.py's
    run_three_holders_with_a_kill): once per session, for test_study.py and test_goodput.py.

    With pytest-xdist (--dist loadfile) the two files may run on two workers at once: the first
    worker to ask runs the study under a lock in the directory all workers' temporary directories
    share, and saves it there; the other waits for it and reads it, so the study never runs twice,
    nor beside itself under its timing assertions."""
    from tests.study_fixtures import run_three_holders_with_a_kill

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return run_three_holders_with_a_kill(demo_path, tmp_path_factory.mktemp("study"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's, above each worker's own
    with open(shared / "finished_study.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = shared / "finished_study.pickle"
        if not saved.exists():
            root = shared / "finished_study"
            root.mkdir()
            saved.write_bytes(pickle.dumps(run_three_holders_with_a_kill(demo_path, root)))
        return pickle.loads(saved.read_bytes())
