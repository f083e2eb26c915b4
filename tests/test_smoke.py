"""launch.sh smoke end to end on the stand-in pod (tests/launch_fake_gcloud): two simulated
workers run the real pod/smoke.py and train.py on their CPUs (sharding.SIMULATED_SLICE_ENV),
the bucket is the local GCS server; TPU-only numbers read "no TPU"."""
import json
import subprocess
import sys

import pytest
from test_launch import REAL_GCLOUD, Pod, dry_run_commands, real_gcloud_verdicts

from tests.ports import free_port

TINY = ["--run.device", "cpu", "--model.hidden-size", "32", "--model.puzzle-emb-ndim", "32",
        "--optim.global-batch-size", "32", "--eval.every-epochs", "1000", "--run.preempt-check-every", "1"]


@pytest.fixture
def smoke_pod(tmp_path, demo_path, gcs_server):
    pod = Pod(tmp_path, workers=2)
    pod.use_real_code()  # the real trainer and report
    if (pod.repo / "tpu_compile.py").exists():  # minutes of TPU compiles: not part of this test
        pod.git("rm", "-q", "tpu_compile.py")
        pod.commit()
    import sharding

    # Each simulated worker's python: host W of a 2-host slice.
    python = tmp_path / "python-of-a-simulated-host"
    python.write_text(f'#!/bin/sh\nexport {sharding.SIMULATED_SLICE_ENV}="$FAKE_WORKER_ID/2@tcp://127.0.0.1:'
                      f'{free_port()}"\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    pod.env.update(FAKE_PYTHON=str(python), CPU_NUM_DEVICES="2", TRM_POLL_SECONDS="0.3", TRM_BUCKET=gcs_server,
                   TRM_SMOKE_MB="1", TRM_DATA=demo_path)
    pod.ready()
    yield pod
    pod.end()


def smoke(pod, *args, **env):
    return subprocess.run(["bash", str(pod.repo / "launch.sh"), "smoke", *args], capture_output=True, text=True,
                          env=dict(pod.env, **env), timeout=600)


def test_smoke_runs_every_check_on_the_stand_in_and_fails_when_resumed_losses_differ(smoke_pod, gcs_server):
    from rundir import storage

    pod = smoke_pod
    result = smoke(pod, "--steps", "24", "demo", *TINY)
    print(result.stdout, result.stderr[-3000:], sep="\n")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "every check passed" in result.stderr
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
             for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| check")}
    assert set(table) == {"runtime", "host group", "mesh self-check", "step time", "MFU", "compile",
                          "stop and resume", "bucket"}
    assert all(verdict == "ok" for _, _, verdict in table.values()), table
    assert table["runtime"][1] == "CPU, 2 devices on 2 hosts; device ids host 0: 0; host 1: 1"
    assert "device ms/step: no TPU" in table["step time"][1] and table["MFU"][1] == "no TPU"
    assert table["step time"][0] == "compiler's estimate: no compiler estimate (tpu_compile.py not available)"
    assert "equal the uninterrupted run" in table["stop and resume"][1]
    out = next(line.split("written to ")[1].split("/smoke.md")[0] for line in result.stdout.splitlines()
               if "written to " in line)
    assert out.startswith(f"gs://{gcs_server}/smoke/")
    saved = json.loads(storage.read_bytes(f"{out}/smoke.json"))
    assert saved["failed"] == [] and [r["check"] for r in saved["rows"]] == list(table)
    assert storage.read_bytes(f"{out}/smoke.md").decode() in result.stdout

    # The same records with the resumed losses shifted (test hook): the comparison fails, exit 1.
    state = pod.home(0) / "trm-state"
    report = subprocess.run(
        [str(pod.env["FAKE_PYTHON"]), str(pod.home(0) / "trm" / "pod" / "smoke.py"), "report",
         "--out", out + "-shifted",
         "--accelerator", "v4-16", "--workers", "2", "--preset", "demo", "--steps", "24",
         "--run-a", saved["run_a"], "--log-a", str(state / "logs" / f"{saved['run_a'].rsplit('/', 1)[1]}.log"),
         "--run-b", saved["run_b"], "--log-b", str(state / "logs" / f"{saved['run_b'].rsplit('/', 1)[1]}.log"),
         "--facts", str(state / "smoke-facts.txt")],
        capture_output=True, text=True, env=dict(pod.env, TRM_TEST_SMOKE_SHIFT_RESUMED="0.001"), timeout=120)
    assert report.returncode == 1, report.stdout + report.stderr
    assert "FAILED: stop and resume" in report.stdout and "differ from the uninterrupted run by up to 0.001" \
        in report.stdout


@pytest.mark.skipif(REAL_GCLOUD is None, reason="the real gcloud CLI is not installed")
def test_smoke_calls_parse_in_the_real_gcloud(tmp_path):
    pod = Pod(tmp_path, workers=2)
    pod.set_tpu()
    dry = pod.run("--dry-run", "smoke", "--steps", "10", "demo", "--data.path", "gs://b/d")
    later = "\n".join(line[len("#   "):] for line in dry.stdout.splitlines() if line.startswith("#   gcloud "))
    calls = dry_run_commands(dry.stdout) + dry_run_commands(later)
    commands = [next((a for a in c if a.startswith("--command=")), "") for c in calls]
    for fn in ("remote_smoke_rates", "remote_preflight", "remote_launch", "remote_status",
               "remote_logs", "remote_stop", "remote_smoke_report"):
        assert any(f"worker.sh {fn}" in c for c in commands), fn
    assert real_gcloud_verdicts(calls, tmp_path) == {}


def test_smoke_reads_the_compilers_estimate_from_tpu_compile_json(tmp_path, capsys):
    from pod import smoke

    path = tmp_path / "compile.json"  # tpu_compile.py PRESET --slice SLICE --json FILE
    path.write_text(json.dumps({"programs": [
        {"program": "eval_step", "compiled": True, "estimate_ms": 3.0, "estimate_source": "x"},
        {"program": "train_step", "compiled": True, "estimate_ms": 12.345, "estimate_source": "XLA cost model"}]}))
    assert smoke.main(["estimate", str(path)]) == 0
    assert capsys.readouterr().out == "12.3 ms/step (XLA cost model)\n"
    path.write_text(json.dumps({"programs": [{"program": "train_step", "compiled": False}]}))
    smoke.main(["estimate", str(path)])
    assert capsys.readouterr().out.startswith("no compiler estimate (tpu_compile.py's ")
