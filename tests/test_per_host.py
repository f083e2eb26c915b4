"""The per-host study mode: worker.sh's single-host runtime environment read by torch_xla 2.9's own
TPU functions, and the probe that decides whether a study runs per-host (launch.sh study, check
--per-host) on the stand-in pod of tests/launch_fake_gcloud."""
import json
import os
import subprocess
import sys

import pytest
from test_launch import PROJECT_DIR

WORKER = PROJECT_DIR / "worker.sh"

# torch_xla's TPU functions in a process of their own, under the environment worker.sh produced.
# The metadata server is made to fail loudly: any read raises (and is recorded), and requests
# would go through a proxy on a closed port.
READ_TPU_ENV = r'''
import json, sys
from torch_xla._internal import tpu
reads = []
def no_metadata(key):
    reads.append(key)
    raise AssertionError(f"metadata server read: {key}")
tpu._get_metadata = no_metadata
out = {}
for name in ("get_tpu_env", "version", "get_tpu_type", "num_tpu_workers", "get_worker_ips", "process_bounds_size",
             "worker_id", "task_id"):
    try:
        out[name] = getattr(tpu, name)()
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
out["metadata_reads"] = reads
print(json.dumps(out))
'''

# One host of each generation launch.sh create supports: (slice, one host's type, version, type).
GENERATIONS = [("v4-64", "v4-8", 4, "v4"), ("v5p-32", "v5p-8", 5, "v5p"),
               ("v5litepod-16", "v5litepod-4", 5, "v5litepod"), ("v6e-16", "v6e-4", 6, "v6e")]


def tpu_functions_under(accelerator, tmp_path, single_host=True):
    """What torch_xla's functions answer in a process started by worker.sh's remote_single_host_env
    (single_host=False: the same process without it, as a whole-slice run starts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "CLOUD_TPU", "TRM_"))}
    env.update(HOME=str(tmp_path), http_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9", NO_PROXY="",
               no_proxy="")
    command = [sys.executable, "-c", READ_TPU_ENV]
    if single_host:
        command = ["bash", str(WORKER), "remote_single_host_env", accelerator, *command]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("accelerator,one_host,version,generation", GENERATIONS)
def test_per_host_env_is_one_host_of_the_slices_generation_for_torch_xla(tmp_path, accelerator, one_host, version,
                                                                         generation):
    got = tpu_functions_under(accelerator, tmp_path)
    assert got["metadata_reads"] == []
    assert got["get_tpu_env"] == {"ACCELERATOR_TYPE": one_host, "TPU_PROCESS_BOUNDS": "1,1,1",
                                  "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1", "WORKER_ID": "0"}
    assert got["version"] == version and got["get_tpu_type"] == generation
    assert got["num_tpu_workers"] == 1 and got["get_worker_ips"] == ["localhost"]
    assert got["process_bounds_size"] == 1 and got["worker_id"] == 0 and got["task_id"] == 0


def test_per_host_env_is_needed_torch_xla_reads_the_metadata_server_without_it(tmp_path):
    got = tpu_functions_under("v4-64", tmp_path, single_host=False)
    assert "tpu-env" in got["metadata_reads"] and got["get_tpu_env"].startswith("AssertionError")
    assert got["process_bounds_size"] is None


def test_per_host_env_refuses_an_unknown_generation(tmp_path):
    done = subprocess.run(["bash", str(WORKER), "remote_single_host_env", "v3-32", "true"], capture_output=True,
                          text=True, env=dict(os.environ, HOME=str(tmp_path)))
    assert done.returncode == 1 and "no single-host runtime known for accelerator type 'v3-32'" in done.stdout
