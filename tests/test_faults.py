"""What a misbehaving pod does to a run: hosts that disagree, broken checkpoints, a crash in the
final evaluation, SIGTERM on one host, a lost or hung host. Real train.py processes; a slice of
two hosts is simulated on this machine (sharding.SIMULATED_SLICE_ENV): each process runs the
whole program on its own CPU mesh and plays one host for everything that crosses hosts."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import sharding
from tests.ports import free_port
from training import checkpoint

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["--optim.max-steps", "4", "--run.ckpt-every", "2"]


def run_args(demo_path, run_dir, *extra):
    return ["demo", "--data.path", demo_path, "--run.dir", str(run_dir), "--model.hidden-size", "32",
            "--model.puzzle-emb-ndim", "32", "--optim.global-batch-size", "32", "--eval.every-epochs", "1000",
            "--run.log-every", "1", *extra]


def train_process(args, fault="", env=None):
    """train.py's command line in a new process, after the Python code `fault` (monkeypatches)."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {PROJECT_DIR!r})
    """) + textwrap.dedent(fault) + f"\nimport train; sys.exit(train.command_line({args!r}))\n"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", PYTHONUNBUFFERED="1",
                                     **(env or {})))


def run(args, fault="", timeout=600):
    proc = train_process(args, fault)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def slice_of_two(args, faults=("", "")):
    """Two processes playing hosts 0 and 1 of one slice."""
    address = f"tcp://127.0.0.1:{free_port()}"
    return [train_process(args, fault, env={sharding.SIMULATED_SLICE_ENV: f"{rank}/2@{address}"})
            for rank, fault in enumerate(faults)]


def wait_for_line(proc, prefix, timeout=300):
    """Read proc's stdout until a line starts with `prefix`; the lines read."""
    lines, deadline = [], time.time() + timeout
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix) or time.time() > deadline:
            break
    return lines


@pytest.fixture(scope="module")
def trained_run(demo_path, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, made once; tests copy it."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    code, out, err = run(run_args(demo_path, run_dir, *STEPS))
    assert code == 0, err[-3000:]
    assert [s for s, _ in checkpoint.list_checkpoints(str(run_dir))] == [4, 2]
    return run_dir


def copy_of(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def host_logs(run_dir) -> list[str]:
    """The text of each host's {run_dir}/logs/host_I.launch-TIME.log of the latest launch, by host."""
    files = sorted((run_dir / "logs").glob("host_*.launch-*.log"))
    latest = max(f.name.split(".launch-")[1] for f in files)  # the hosts of a launch agree on its name
    return [f.read_text() for f in files if f.name.endswith(latest)]


def data_files(run_dir, step):
    return sorted((run_dir / "checkpoints" / f"step_{step:08d}").glob("host_*.safetensors"))


def test_only_unreadable_checkpoints_stop_the_run_and_name_them(demo_path, trained_run, tmp_path):
    run_dir = copy_of(trained_run, tmp_path)
    for step in (2, 4):
        for f in data_files(run_dir, step):
            f.write_bytes(f.read_bytes()[:100])  # truncated
    config_before = (run_dir / "config.json").read_bytes()
    code, out, err = run(run_args(demo_path, run_dir, "--optim.max-steps", "6"))
    assert code == 1, err[-3000:]
    assert "no committed checkpoint of" in err and "step_00000004" in err and "step_00000002" in err
    assert "--run.start-over" in err and "Traceback" not in err
    assert "passing over checkpoint step 4" in out and "passing over checkpoint step 2" in out
    assert not [line for line in out.splitlines() if line.startswith("step ")], "it trained"
    assert (run_dir / "config.json").read_bytes() == config_before

    # --run.start-over moves them aside and starts from step 0.
    code, out, err = run(run_args(demo_path, run_dir, "--optim.max-steps", "2", "--run.start-over"))
    assert code == 0, err[-3000:]
    assert "moved the unreadable checkpoints to" in out and "step 1/2" in out
    assert [s for s, _ in checkpoint.list_checkpoints(str(run_dir))] == [2]
    assert len(list(run_dir.glob("checkpoints-unreadable-*/step_*"))) == 2


def test_a_checkpoint_missing_tensors_stops_the_resume_and_lists_them(demo_path, trained_run, tmp_path):
    run_dir = copy_of(trained_run, tmp_path)
    [index_file] = (run_dir / "checkpoints" / "step_00000004").glob("host_000-*.json")
    index = json.loads(index_file.read_text())
    removed = sorted(k for k in index["tensors"] if k.startswith("adam/"))
    assert removed
    index["tensors"] = {k: v for k, v in index["tensors"].items() if not k.startswith("adam/")}
    index_file.write_text(json.dumps(index))
    code, out, err = run(run_args(demo_path, run_dir, "--optim.max-steps", "6"))
    assert code == 1, err[-3000:]
    assert "cannot resume from" in err and "(step 4)" in err and "does not hold this run's training state" in err
    for name in removed:
        assert f"missing: {name} " in err
    assert not [line for line in out.splitlines() if line.startswith("step ")], "it trained"


def test_the_final_save_survives_a_crash_in_the_final_evaluation(demo_path, tmp_path):
    # The final save is slowed down so that the crash comes while it is under way.
    fault = """
        import time
        from training import checkpoint, evaluate
        _write_bytes = checkpoint.write_bytes
        def slow_write(url, payload):
            time.sleep(0.5)
            _write_bytes(url, payload)
        checkpoint.write_bytes = slow_write
        def crashing_evaluate(*args, **kwargs):
            raise RuntimeError("evaluation crashed")
        evaluate.evaluate = crashing_evaluate
    """
    code, out, err = run(run_args(demo_path, tmp_path / "run", "--optim.max-steps", "3", "--run.ckpt-every", "100"),
                         fault)
    assert code == 1 and "RuntimeError: evaluation crashed" in err, err[-3000:]
    assert "waiting for the checkpoint of step 3 to be written" in out
    # The host's log in the run directory ends with the traceback.
    logged = host_logs(tmp_path / "run")[0]
    assert "step 3/3" in logged and "Traceback (most recent call last)" in logged
    assert logged.rstrip().endswith("RuntimeError: evaluation crashed")
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path / "run"))] == [3]


def test_hosts_resume_from_the_same_step_or_stop_together(demo_path, trained_run, tmp_path):
    """Host 1 cannot read the newest checkpoint (storage fails beyond the retries): both hosts stop,
    naming the step and host 1; neither resumes from step 2 on its own."""
    run_dir = copy_of(trained_run, tmp_path)
    fault_host_1 = """
        from rundir import storage
        from training import checkpoint
        _read_bytes = checkpoint.read_bytes
        def failing_read(url):
            if "step_00000004" in url:
                raise storage.StorageError(f"reading {url} failed after 6 attempts: ConnectionError")
            return _read_bytes(url)
        checkpoint.read_bytes = failing_read
    """
    procs = slice_of_two(run_args(demo_path, run_dir, "--optim.max-steps", "6"), faults=("", fault_host_1))
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 1, err[-3000:]
        assert "cannot resume from" in err and "(step 4)" in err and "host 1: StorageError" in err
        assert not [line for line in out.splitlines() if line.startswith("step ")], "it trained"
    # Each host's log in the run directory ends with the error it exited with.
    assert len(host_logs(run_dir)) == 2
    for logged in host_logs(run_dir):
        assert "error: cannot resume from" in logged and "host 1: StorageError" in logged


def test_sigterm_on_one_host_saves_the_same_step_on_both(demo_path, tmp_path):
    run_dir = tmp_path / "run"
    procs = slice_of_two(run_args(demo_path, run_dir, "--optim.max-steps", "1000", "--run.preempt-check-every", "2"))
    wait_for_line(procs[0], "step 3/")
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    stop_step = checkpoint.list_checkpoints(str(run_dir))[0][0]
    assert stop_step % 2 == 0  # the hosts agree every 2 steps
    assert f"saved checkpoint {checkpoint.step_dir(str(run_dir), stop_step)}" in outputs[0][0]
    tensors, state = checkpoint.read_checkpoint(checkpoint.step_dir(str(run_dir), stop_step))
    assert state["hosts"] == 2 and state["step"] == stop_step
    assert tensors["carry/steps"].shape[0] == 32  # both hosts' rows of the carry
    # Each host left its log in the run directory: host 0 the step lines and the save, host 1
    # (which got the signal) its notice; neither shows the other's lines.
    logs = host_logs(run_dir)
    assert len(logs) == 2
    assert f"step {stop_step}/" in logs[0] and "stop requested (SIGTERM or Ctrl-C): saved checkpoint" in logs[0]
    assert "SIGTERM: stopping (saving a checkpoint first" in logs[1] and "step 1/" not in logs[1]


def test_a_lost_host_makes_the_others_exit_75(demo_path, tmp_path):
    procs = slice_of_two(run_args(demo_path, tmp_path / "run", "--optim.max-steps", "1000",
                                  "--run.preempt-check-every", "1"))
    wait_for_line(procs[0], "step 3/")
    procs[1].kill()
    out, err = procs[0].communicate(timeout=300)
    procs[1].wait()
    assert procs[0].returncode == 75, err[-3000:]
    assert "the connection to another host broke" in err


def test_export_takes_the_newest_readable_checkpoint_and_says_which(trained_run, tmp_path):
    run_dir = copy_of(trained_run, tmp_path)
    for f in data_files(run_dir, 4):
        f.write_bytes(b"")
    export = [sys.executable, os.path.join(PROJECT_DIR, "train.py"), "export", str(run_dir)]
    done = subprocess.run([*export, "--out", str(tmp_path / "model.safetensors")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "passing over unreadable checkpoint" in done.stdout and "step_00000004" in done.stdout
    assert "exported the EMA weights of" in done.stdout and "step_00000002 (step 2)" in done.stdout

    # Only saves that never committed: an error that says so (it was "IsADirectoryError").
    for marker in run_dir.glob("checkpoints/step_*/COMMITTED"):
        marker.unlink()
    failed = subprocess.run([*export, "--out", str(tmp_path / "model2.safetensors")], capture_output=True, text=True)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr
    assert "no committed checkpoint in" in failed.stderr and "2 save(s) there did not finish" in failed.stderr
