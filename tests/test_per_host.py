"""The per-host study mode: worker.sh's single-host runtime environment read by torch_xla 2.9's own
TPU functions, and the probe that decides whether a study runs per-host (launch.sh study, check
--per-host) on the stand-in pod of tests/launch_fake_gcloud."""
import json
import os
import subprocess
import sys
import time

import pytest
from test_launch import (
    PROJECT_DIR,
    REAL_GCLOUD,
    STUDY_FILE,
    Pod,
    dry_run_commands,
    real_gcloud_verdicts,
    wait_until,
)

WORKER = PROJECT_DIR / "worker.sh"

# torch_xla's TPU functions in a process of their own, once under each environment given on stdin
# ({name: environment}, each exactly as worker.sh produced it), os.environ replaced by it before
# each round (the functions read os.environ at every call). The metadata server is made to fail
# loudly: any read raises (and is recorded), and requests would go through a proxy on a closed port.
READ_TPU_ENV = r'''
import json, os, sys
from torch_xla._internal import tpu
reads = []
def no_metadata(key):
    reads.append(key)
    raise AssertionError(f"metadata server read: {key}")
tpu._get_metadata = no_metadata
results = {}
for name, env in json.load(sys.stdin).items():
    os.environ.clear()
    os.environ.update(env)
    reads.clear()
    out = results[name] = {}
    for fn in ("get_tpu_env", "version", "get_tpu_type", "num_tpu_workers", "get_worker_ips", "process_bounds_size",
               "worker_id", "task_id"):
        try:
            out[fn] = getattr(tpu, fn)()
        except Exception as e:
            out[fn] = f"{type(e).__name__}: {e}"
    out["metadata_reads"] = list(reads)
print(json.dumps(results))
'''

# One host of each generation launch.sh create supports: (slice, one host's type, version, type).
GENERATIONS = [("v4-64", "v4-8", 4, "v4"), ("v5p-32", "v5p-8", 5, "v5p"),
               ("v5litepod-16", "v5litepod-4", 5, "v5litepod"), ("v6e-16", "v6e-4", 6, "v6e")]


def base_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "CLOUD_TPU", "TRM_"))}
    env.update(HOME=str(tmp_path), http_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9", NO_PROXY="",
               no_proxy="")
    return env


def worker_env(accelerator, tmp_path):
    """The environment a process started by worker.sh's remote_single_host_env runs in."""
    done = subprocess.run(["bash", str(WORKER), "remote_single_host_env", accelerator, "env", "-0"],
                          capture_output=True, env=base_env(tmp_path), timeout=60, check=True)
    return dict(item.split("=", 1) for item in done.stdout.decode().split("\0") if "=" in item)


def test_per_host_env_is_one_host_of_the_slices_generation_for_torch_xla(tmp_path):
    envs = {accelerator: worker_env(accelerator, tmp_path) for accelerator, *_ in GENERATIONS}
    envs["whole slice"] = base_env(tmp_path)  # without it: what a whole-slice run starts with
    done = subprocess.run([sys.executable, "-c", READ_TPU_ENV], input=json.dumps(envs), capture_output=True,
                          text=True, env=base_env(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for accelerator, one_host, version, generation in GENERATIONS:
        got = results[accelerator]
        assert envs[accelerator]["TPU_SKIP_MDS_QUERY"] == "1"
        assert got["metadata_reads"] == [], accelerator
        assert got["get_tpu_env"] == {"ACCELERATOR_TYPE": one_host, "TPU_PROCESS_BOUNDS": "1,1,1",
                                      "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "WORKER_ID": "0"}
        assert got["version"] == version and got["get_tpu_type"] == generation
        assert got["num_tpu_workers"] == 1 and got["get_worker_ips"] == ["localhost"]
        assert got["process_bounds_size"] == 1 and got["worker_id"] == 0 and got["task_id"] == 0
    # Without worker.sh's environment torch_xla asks the metadata server for the slice's tpu-env.
    whole = results["whole slice"]
    assert "tpu-env" in whole["metadata_reads"] and whole["get_tpu_env"].startswith("AssertionError")
    assert whole["process_bounds_size"] is None


def test_per_host_env_refuses_an_unknown_generation(tmp_path):
    done = subprocess.run(["bash", str(WORKER), "remote_single_host_env", "v3-32", "true"], capture_output=True,
                          text=True, env=dict(os.environ, HOME=str(tmp_path)))
    assert done.returncode == 1 and "no single-host runtime known for accelerator type 'v3-32'" in done.stdout


@pytest.fixture
def probed_pod(tmp_path):
    """A stand-in pod of 2 workers (a v4-16) whose checkout holds the real probe.py and sharding.py
    (the stub study.py of test_launch): each worker's probe starts torch_xla's CPU runtime with 4
    devices (TRM_PROBE_DEVICE=cpu, test-only) under worker.sh's single-host environment."""
    pod = Pod(tmp_path, workers=2)
    pod.add_study_stub()
    pod.use_real_code(("probe.py", "sharding.py"))
    pod.env.update(TRM_PROBE_DEVICE="cpu", TRM_PROBE_WAIT="240")
    pod.ready()
    yield pod
    pod.end()


def test_per_host_check_probes_every_worker_and_shows_a_column_each(probed_pod):
    started = time.time()
    result = probed_pod.run("check", "--per-host")
    seconds = time.time() - started
    assert "all 2 workers of v4-16 start their TPU runtime alone" in result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()[1:]}
    assert result.stdout.splitlines()[0].split() == ["worker", "0", "worker", "1"]
    assert rows["probe"] == ["ok", "ok"] and rows["kind"] == ["CPU", "CPU"]
    assert rows["devices"] == ["4", "4"] and rows["processes"] == ["1", "1"] and rows["ids"] == ["0,1,2,3"] * 2
    assert rows["all-reduce"] == ["ok", "10", "(expected", "10)"] * 2
    for w in range(2):  # the environment the probe ran in: the single-host one
        assert not (probed_pod.home(w) / "trm-state" / "probe.err").read_text().count("Traceback")
    print(f"check --per-host on the stand-in (2 workers, real probe.py on CPU): {seconds:.1f} s")


def test_per_host_probe_failure_falls_back_to_whole_slice_or_stops_an_explicit_per_host(probed_pod):
    pod = probed_pod
    # Worker 1's runtime joins the slice: the default mode falls back to --whole-slice, said.
    result = pod.run("study", "s1", str(STUDY_FILE), TRM_TEST_PROBE_FAULT="join:1")
    assert "the per-host probe failed on trm-test (v4-16):" in result.stderr
    assert "worker 1: the runtime joined a slice of 2 processes and 8 devices" in result.stderr
    assert "worker 0:" not in result.stderr.split("probe failed")[1].split("the study runs")[0]
    assert "the study runs --whole-slice instead" in result.stderr
    wait_until(lambda: all(pod.launches(w) for w in range(pod.workers)), "every worker's launch record")
    for w in range(pod.workers):
        record = pod.launch_record(w, 0)
        assert record["argv"][3:] == ["gs://trm-bucket/studies/s1", "--whole-slice", "--", "--run.device", "tpu"]
        assert record["env"]["TRM_SINGLE_HOST_RUNTIME"] is None
    pod.run("stop")
    # An explicit --per-host whose probe hangs on worker 0: the study stops, nothing starts.
    result = pod.run("study", "--per-host", "s2", str(STUDY_FILE), TRM_TEST_PROBE_FAULT="hang:0", TRM_PROBE_WAIT="6",
                     expect=1)
    assert "worker 0: hang: no answer in 6 s" in result.stderr
    assert f"Run it over the whole slice instead: bash launch.sh study --whole-slice s2 {STUDY_FILE}" in result.stderr
    assert [len(pod.launches(w)) for w in range(pod.workers)] == [1, 1]


@pytest.mark.skipif(REAL_GCLOUD is None, reason="the real gcloud CLI is not installed")
def test_per_host_probe_calls_parse_in_the_real_gcloud(probed_pod, tmp_path):
    pod = probed_pod
    calls = []
    for args in (("check", "--per-host"), ("study", "--per-host", "s", str(STUDY_FILE)),
                 ("study", "--per-host", "--retry", "s", str(STUDY_FILE))):
        calls += dry_run_commands(pod.run("--dry-run", *args).stdout)
    probes = [c for c in calls if any("remote_probe" in a for a in c)]
    assert len(probes) == 3
    assert real_gcloud_verdicts(calls, tmp_path) == {}
