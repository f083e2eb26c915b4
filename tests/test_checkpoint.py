"""Checkpoints, resume, preemption, export and TensorBoard, against local dirs and a real GCS server."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors import safe_open

import data
import train
from commands.restore import load_initial_weights
from reference import weights as reference_weights
from rundir import storage
from training import checkpoint
from training.checkpoint import CheckpointWriter, Shard
from training.config import check_against_dataset, parse_config

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_args(demo_path, run_dir, cache_dir, *extra):
    return ["demo", "--data.path", demo_path, "--data.cache-dir", str(cache_dir), "--run.dir", str(run_dir),
            "--model.hidden-size", "32", "--model.puzzle-emb-ndim", "32", "--optim.global-batch-size", "32",
            "--eval.every-epochs", "1000", "--run.log-every", "1", *extra]


def metrics_records(run_dir: str) -> list[dict]:
    """The records of {run_dir}/metrics/part-*.jsonl, in order (local or gs://)."""
    fs, path = storage.filesystem(f"{run_dir}/metrics")
    return [json.loads(line) for part in sorted(fs.glob(path + "/part-*.jsonl")) for line in fs.cat(part).splitlines()]


def subprocess_env(**extra):
    return dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8", PYTHONUNBUFFERED="1", **extra)


def losses_by_step(result):
    return {h["step"]: h["loss"] for h in result["history"]}


# -- the writer and reader ------------------------------------------------------------------------


def sample_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(5, 3, generator=g),
        "model/h": torch.randn(4, generator=g).to(torch.bfloat16),
        "adam/w/step": torch.tensor(7.0),
        "carry/steps": torch.arange(8, dtype=torch.int32),
        "carry/halted": torch.tensor([True, False] * 4),
        "carry/rng_counter": torch.tensor(3, dtype=torch.int64),
    }


def host_shards(state, p, count):
    sizes = {k: v.numel() for k, v in state.items() if not k.startswith("carry/")}
    owners = checkpoint.assign_owners(sizes, count)
    shards = {k: Shard(v, tuple(v.shape)) for k, v in state.items() if owners.get(k) == p}
    for k, v in state.items():
        if k.startswith("carry/") and v.ndim:
            lo, hi = p * len(v) // count, (p + 1) * len(v) // count
            shards[k] = Shard(v[lo:hi], tuple(v.shape), lo)
        elif k == "carry/rng_counter" and p == 0:
            shards[k] = Shard(v, ())
    return shards


def test_round_trip_on_gcs_by_two_hosts(gcs_url):
    state = sample_state()
    writers = [CheckpointWriter(gcs_url, p, 2, attempt="a1") for p in (1, 0)]  # host 0 commits after host 1
    for w in writers:
        w.save(10, host_shards(state, w.process_index, 2), {"step": 10, "config": {"a": 1}})
    for w in writers:
        w.wait()
    assert checkpoint.list_checkpoints(gcs_url) == [(10, checkpoint.step_dir(gcs_url, 10))]
    tensors, saved = checkpoint.read_checkpoint(checkpoint.step_dir(gcs_url, 10))
    assert saved == {"step": 10, "config": {"a": 1}, "hosts": 2, "attempt": "a1"}
    assert tensors.keys() == state.keys()
    for k in state:
        assert tensors[k].dtype == state[k].dtype and torch.equal(tensors[k], state[k]), k
    # Host 1 on resume reads only its rows, whoever wrote them.
    rows, _ = checkpoint.read_checkpoint(checkpoint.step_dir(gcs_url, 10), row_range=lambda name, shape: (4, 8))
    assert torch.equal(rows["carry/steps"], state["carry/steps"][4:])
    # Every file is a plain safetensors file.
    fs, path = storage.filesystem(checkpoint.step_dir(gcs_url, 10))
    for name in ("host_000-a1.safetensors", "host_001-a1.safetensors"):
        local = f"/tmp/{os.getpid()}-{name}"
        fs.get(f"{path}/{name}", local)
        with safe_open(local, framework="pt") as f:
            assert set(f.keys()) <= set(state)
        os.remove(local)


def test_keeps_the_last_k_and_skips_broken_checkpoints(tmp_path, capsys):
    run = str(tmp_path)
    writer = CheckpointWriter(run, 0, 1, keep=2)
    for step in (1, 2, 3):
        writer.save(step, host_shards(sample_state(step), 0, 1), {"step": step, "config": {}})
        writer.wait()
    assert [s for s, _ in checkpoint.list_checkpoints(run)] == [3, 2]
    # A save that never committed (a host died) and a committed one whose file is corrupt.
    os.makedirs(tmp_path / "checkpoints" / "step_00000005")
    (tmp_path / "checkpoints" / "step_00000005" / "host_000-x.safetensors").write_bytes(b"partial")
    [data_file] = (tmp_path / "checkpoints" / "step_00000003").glob("host_000-*.safetensors")
    with open(data_file, "r+b") as f:
        f.write(b"\xff" * 16)
    found = checkpoint.newest_readable(run, checkpoint.read_checkpoint)
    assert found[0] == 2 and torch.equal(found[2][0]["model/w"], sample_state(2)["model/w"])
    err = capsys.readouterr().out
    assert "passing over" in err and "step_00000005: no COMMITTED marker" in err
    assert "passing over unreadable checkpoint" in err and "step_00000003" in err
    # Every committed one unreadable: an error naming them, never "no checkpoint".
    [data_file] = (tmp_path / "checkpoints" / "step_00000002").glob("host_000-*.safetensors")
    data_file.write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="step_00000003.*step_00000002"):
        checkpoint.newest_readable(run, checkpoint.read_checkpoint)


def test_transient_errors_are_retried_and_permanent_ones_name_the_url():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("503 backend error")
        return "ok"

    assert storage.with_retries("writing", "gs://b/x", flaky, first_delay=0.01) == "ok" and len(calls) == 3
    with pytest.raises(storage.StorageError, match=r"writing gs://b/y failed: PermissionError: 403"):
        storage.with_retries("writing", "gs://b/y", lambda: (_ for _ in ()).throw(PermissionError("403")))
    with pytest.raises(storage.StorageError, match=r"gs://b/z failed after 2 attempts: TimeoutError"):
        storage.with_retries("reading", "gs://b/z", lambda: (_ for _ in ()).throw(TimeoutError()),
                                attempts=2, first_delay=0.01)


def kill_after_writing(step, host):
    """Code that makes the process running it SIGKILL itself right after it writes host `host`'s
    tensors of step `step` (before that host's index): the fault injection of the crash tests."""
    return textwrap.dedent(f"""
        import os
        from training import checkpoint
        _write_bytes = checkpoint.write_bytes
        def _write_then_die(url, payload):
            _write_bytes(url, payload)
            if "step_{step:08d}/host_{host:03d}-" in url and url.endswith(".safetensors"):
                os.kill(os.getpid(), 9)
        checkpoint.write_bytes = _write_then_die
    """)


WRITER_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {project!r}); sys.path.insert(0, {tests!r})
    {fault}
    from test_checkpoint import host_shards, sample_state
    from training.checkpoint import CheckpointWriter
    p, count, gate = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    step, seed, attempt = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
    while gate and not os.path.exists(gate):  # a held host: it writes once the test opens its gate
        time.sleep(0.05)
    writer = CheckpointWriter(sys.argv[4], p, count, commit_timeout_s=float(sys.argv[5]), attempt=attempt)
    writer.save(step, host_shards(sample_state(seed), p, count), {{"step": step, "config": {{}}}})
    writer.wait()
    print("written", p, flush=True)
""")


def start_writers(url, count, timeout_s, fault_host=None, step=7, seed=0, attempt="a1", hosts=None, gates=None):
    """One writer process per host of `count` (all of them, or those in `hosts`), each saving `step`
    of sample_state(seed) under save attempt `attempt`; a host with a path in `gates` ({host: path})
    waits until that file exists, so a test decides when a late host writes (no timing guesses)."""
    procs = []
    for p in range(count):
        if hosts is not None and p not in hosts:
            continue
        fault = kill_after_writing(step, p) if p == fault_host else ""
        script = WRITER_SCRIPT.format(project=PROJECT_DIR, tests=os.path.join(PROJECT_DIR, "tests"),
                                      fault=fault)
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(p), str(count), str((gates or {}).get(p, "")),
                                       url, str(timeout_s), str(step), str(seed), attempt], env=subprocess_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def test_multi_host_commit_waits_for_every_host(gcs_url, tmp_path):
    marker = checkpoint.step_dir(gcs_url, 7) + "/COMMITTED"
    gate = tmp_path / "host-3-writes"
    procs = start_writers(gcs_url, 4, timeout_s=300, gates={3: gate})
    for p in procs[1:3]:
        p.wait(timeout=300)
    time.sleep(1)  # host 0 has had time to commit, were it not waiting for host 3
    assert procs[3].poll() is None and procs[0].poll() is None  # host 3 held, host 0 waiting
    assert not storage.exists(marker), "committed before host 3 wrote its part"
    gate.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [o[1][-1500:] for o in outputs]
    assert storage.exists(marker)
    tensors, _ = checkpoint.read_checkpoint(checkpoint.step_dir(gcs_url, 7))
    assert all(torch.equal(tensors[k], v) for k, v in sample_state().items())


def test_a_host_killed_before_the_commit_leaves_no_marker(gcs_url):
    procs = start_writers(gcs_url, 4, timeout_s=20, fault_host=2)
    outputs = [p.communicate(timeout=120) for p in procs]
    assert procs[2].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0 and "no index of this save from ['host_002-a1.json']" in outputs[0][1]
    assert not storage.exists(checkpoint.step_dir(gcs_url, 7) + "/COMMITTED")
    assert checkpoint.list_checkpoints(gcs_url) == []


def test_a_stale_step_directory_never_mixes_into_the_commit(gcs_url, tmp_path):
    """An interrupted save of another trajectory left host 1's files in step_10; the next save
    of step 10 (host 1 late) commits only once host 1's new index exists, with the new values."""
    stale = start_writers(gcs_url, 2, timeout_s=1, step=10, seed=1, attempt="old", hosts={1})
    assert [p.wait(timeout=300) for p in stale] == [0]
    directory = checkpoint.step_dir(gcs_url, 10)
    assert storage.exists(directory + "/host_001-old.json") and not storage.exists(directory + "/COMMITTED")

    gate = tmp_path / "host-1-writes"
    procs = start_writers(gcs_url, 2, timeout_s=300, step=10, seed=2, attempt="new", gates={1: gate})
    deadline = time.time() + 300
    while not storage.exists(directory + "/host_000-new.json") and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # host 0's part is written and host 1's stale index is there: the old code committed here
    assert procs[1].poll() is None, "host 1 should still be held"
    assert not storage.exists(directory + "/COMMITTED"), "committed with the stale index of host 1"
    gate.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outputs]
    tensors, saved = checkpoint.read_checkpoint(directory)
    assert saved["attempt"] == "new"
    for k, v in sample_state(2).items():
        assert torch.equal(tensors[k], v), k
    fs, path = storage.filesystem(directory)
    assert not any("-old." in f for f in fs.ls(path, detail=False)), "the stale files were left behind"


def test_a_deposed_hosts_late_index_neither_delays_nor_breaks_the_new_commit(gcs_url):
    """A deposed host 1 of an old launch (frozen, then woken after another holder took the run
    over) writes its part of step 10 late: after the new launch's host 1 wrote its index, before
    host 0 commits, and again after the commit. Its index once had the same name as the new
    one's (host_001.json), so the commit waited for commit_timeout_s and failed, or the
    committed checkpoint read as "files of two saves mixed"; now each attempt's index has its
    own name, and the new save commits at once and reads back whole."""
    def write(p, attempt, seed, **kwargs):
        writer = CheckpointWriter(gcs_url, p, 2, attempt=attempt, **kwargs)
        writer.save(10, host_shards(sample_state(seed), p, 2), {"step": 10, "config": {}})
        return writer

    write(1, "new", seed=2).wait()
    write(1, "old", seed=1).wait()  # the deposed host's late write, after the new one's
    started = time.monotonic()
    write(0, "new", seed=2, commit_timeout_s=10).wait()  # before: CheckpointError after 10 s
    assert time.monotonic() - started < 8, "the commit waited for the late index to go"
    directory = checkpoint.step_dir(gcs_url, 10)
    fs, path = storage.filesystem(directory)
    fs.invalidate_cache(path)
    assert not any("-old." in f for f in fs.ls(path, detail=False)), "the old attempt's files were left behind"
    write(1, "old", seed=1).wait()  # and once more, after the commit

    tensors, saved = checkpoint.read_checkpoint(directory)
    assert saved["attempt"] == "new"
    for k, v in sample_state(2).items():
        assert torch.equal(tensors[k], v), k
    assert checkpoint.newest_readable(gcs_url, checkpoint.read_checkpoint)[0] == 10


def test_checkpoints_in_the_earlier_index_layouts_still_load(tmp_path):
    """Checkpoints written before the index's name carried the attempt (host_{p:03d}.json, with the
    attempt inside) and before attempts existed (host_{p:03d}.json holding the tensors' entries
    alone, no attempt in COMMITTED or state.json) load as they did."""
    state = sample_state(3)
    writers = [CheckpointWriter(str(tmp_path / "run"), p, 2, attempt="a1") for p in (1, 0)]
    for w in writers:
        w.save(4, host_shards(state, w.process_index, 2), {"step": 4, "config": {}})
        w.wait()
    directory = tmp_path / "run" / "checkpoints" / "step_00000004"
    for p in (0, 1):
        (directory / f"host_{p:03d}-a1.json").rename(directory / f"host_{p:03d}.json")
    tensors, saved = checkpoint.read_checkpoint(str(directory))
    assert saved["attempt"] == "a1" and all(torch.equal(tensors[k], v) for k, v in state.items())

    # A deposed process 0's late state.json (another attempt's) under this commit is refused.
    good_state = (directory / "state.json").read_text()
    (directory / "state.json").write_text(json.dumps(dict(json.loads(good_state), attempt="old")))
    with pytest.raises(checkpoint.CheckpointError, match="state.json belongs to save attempt old, the commit to a1"):
        checkpoint.read_checkpoint(str(directory))
    (directory / "state.json").write_text(good_state)

    # Another save's index under the old name is still refused.
    index = json.loads((directory / "host_001.json").read_text())
    (directory / "host_001.json").write_text(json.dumps(dict(index, attempt="other")))
    with pytest.raises(checkpoint.CheckpointError, match="host_001.json belongs to save attempt other"):
        checkpoint.read_checkpoint(str(directory))

    for p in (0, 1):  # before attempts: the index was the entries alone
        index_path = directory / f"host_{p:03d}.json"
        index_path.write_text(json.dumps(json.loads(index_path.read_text())["tensors"]))
    for name in ("COMMITTED", "state.json"):
        saved_json = json.loads((directory / name).read_text())
        saved_json.pop("attempt")
        (directory / name).write_text(json.dumps(saved_json))
    tensors, saved = checkpoint.read_checkpoint(str(directory))
    assert "attempt" not in saved and all(torch.equal(tensors[k], v) for k, v in state.items())
    assert checkpoint.weights_of(str(tmp_path / "run"))[2] == str(directory)


# -- training runs ----------------------------------------------------------------------------------


def run_train_subprocess(args, timeout=600, kill_after_writing_step=None):
    fault = "" if kill_after_writing_step is None else kill_after_writing(kill_after_writing_step, 0)
    code = (f"import sys; sys.path.insert(0, {PROJECT_DIR!r})\n{fault}\n"
            f"import train; sys.exit(train.command_line({args!r}))")
    return subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_killed_during_a_save_resumes_and_matches_the_uninterrupted_run(demo_path, tmp_path):
    steps = ["--optim.max-steps", "12", "--run.ckpt-every", "4"]
    uninterrupted = train.main(parse_config(run_args(demo_path, tmp_path / "straight", tmp_path / "cache",
                                                  *steps)))

    args = run_args(demo_path, tmp_path / "crashy", tmp_path / "cache", *steps)
    crashed = run_train_subprocess(args, kill_after_writing_step=8)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert "step 8/12" in crashed.stdout
    resumed = run_train_subprocess(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "passing over" in resumed.stdout and "step_00000008: no COMMITTED marker" in resumed.stdout
    assert "(step 4)" in resumed.stdout
    relaunched = {int(line.split()[1].split("/")[0]): float(line.split("loss ")[1].split()[0])
                  for line in resumed.stdout.splitlines() if line.startswith("step ")}
    assert sorted(relaunched) == list(range(5, 13))
    expected = losses_by_step(uninterrupted)
    for step, loss in relaunched.items():
        assert loss == pytest.approx(expected[step], abs=5e-5), step  # printed with 4 decimals
    final_line = [line for line in resumed.stdout.splitlines() if line.startswith("eval @ step 12")][0]
    # metrics.jsonl: the records the killed launch made past step 4 were dropped and made again.
    records = metrics_records(str(tmp_path / "crashy"))
    assert [(r["kind"], r["step"]) for r in records] == [("train", s) for s in range(1, 13)] + [("eval", 12)]
    assert [round(r["loss"], 4) for r in records[4:-1]] == [relaunched[s] for s in range(5, 13)]
    assert f"exact_accuracy {uninterrupted['final']['exact_accuracy']:.4f}" in final_line
    assert f"accuracy {uninterrupted['final']['accuracy']:.4f}" in final_line


def test_sigterm_saves_exits_0_and_the_relaunch_resumes(demo_path, tmp_path):
    args = run_args(demo_path, tmp_path / "run", tmp_path / "cache", "--optim.max-steps", "100000")
    code = (f"import sys; sys.path.insert(0, {PROJECT_DIR!r}); import train; "
            f"sys.exit(train.command_line({args!r}))")
    proc = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    for line in proc.stdout:
        if line.startswith("step 5/") or time.time() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    saved = [line for line in out.splitlines()
             if line.startswith("stop requested (SIGTERM or Ctrl-C): saved checkpoint")]
    assert saved and "run the same command again to resume" in saved[0]
    stop_step = int(saved[0].split("step_")[1][:8])
    assert checkpoint.list_checkpoints(str(tmp_path / "run"))[0][0] == stop_step

    # The relaunch (shortened so the test ends) continues from that step.
    again = run_args(demo_path, tmp_path / "run", tmp_path / "cache", "--optim.max-steps", str(stop_step + 2))
    resumed = train.main(parse_config(again))
    assert resumed["start_step"] == stop_step
    assert [h["step"] for h in resumed["history"]] == [stop_step + 1, stop_step + 2]
    # metrics.jsonl continues the sequence; each launch left its own log of host 0.
    assert [(r["kind"], r["step"]) for r in metrics_records(str(tmp_path / "run"))] == \
        [("train", s) for s in range(1, stop_step + 3)] + [("eval", stop_step + 2)]
    first, second = [p.read_text() for p in sorted((tmp_path / "run" / "logs").glob("host_0.launch-*.log"))]
    assert saved[0] in first and "SIGTERM: stopping (saving a checkpoint first" in first
    assert f"resuming from {checkpoint.step_dir(str(tmp_path / 'run'), stop_step)}" in second


def test_changed_config_refuses_to_resume_unless_allowed(demo_path, tmp_path):
    base = run_args(demo_path, tmp_path / "run", tmp_path / "cache", "--optim.max-steps", "2")
    train.main(parse_config(base))
    with pytest.raises(SystemExit, match=r"(?s)created with another configuration:.*optim.lr: 0.001 in the "
                                         r"run directory, 0.002 now.*--run.allow-config-change"):
        train.main(parse_config(base + ["--optim.lr", "0.002"]))
    result = train.main(parse_config(base + ["--optim.lr", "0.002", "--run.allow-config-change",
                                          "--optim.max-steps", "3"]))
    assert result["start_step"] == 2 and [h["step"] for h in result["history"]] == [3]


def test_gcs_run_export_and_init_from(demo_path, tmp_path, gcs_url):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = f"{gcs_url}/runs/a"
    result = train.main(parse_config(run_args(demo_path, run_dir, tmp_path / "cache", "--optim.max-steps", "6",
                                           "--run.ckpt-every", "3")))
    assert [s for s, _ in checkpoint.list_checkpoints(run_dir)] == [6, 3]
    assert json.loads(storage.read_bytes(f"{run_dir}/config.json"))["model"]["hidden_size"] == 32

    # TensorBoard scalars, read back by tensorboard's own reader from a local copy of {run_dir}/tb.
    fs, path = storage.filesystem(f"{run_dir}/tb")
    fs.get(path, str(tmp_path / "tb"), recursive=True)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4, 5, 6]
    assert [round(e.value, 5) for e in losses] == [round(h["loss"], 5) for h in result["history"]]
    assert events.Scalars("eval/exact_accuracy")[-1].step == 6
    assert "xla/compiles" in events.Tags()["scalars"] and "config/text_summary" in events.Tags()["tensors"]
    # The first 4 test puzzles as pictures at the evaluation: input | prediction | answer, each a
    # 4x4 grid of 60-pixel cells, 8-pixel gaps between them.
    assert sorted(events.Tags()["images"]) == [f"puzzles/{i}" for i in range(4)]
    for tag in events.Tags()["images"]:
        assert [(e.step, e.width, e.height) for e in events.Images(tag)] == [(6, 3 * 240 + 2 * 8, 240)]

    # metrics.jsonl's records and host 0's log, in the bucket.
    records = metrics_records(run_dir)
    assert [(r["kind"], r["step"]) for r in records] == [("train", s) for s in range(1, 7)] + [("eval", 6)]
    assert [r["loss"] for r in records[:-1]] == pytest.approx([h["loss"] for h in result["history"]])
    assert records[-1]["exact_accuracy"] == pytest.approx(result["final"]["exact_accuracy"])
    [host_log] = fs.glob(f"{storage.filesystem(run_dir)[1]}/logs/host_0.launch-*.log")
    logged = fs.cat(host_log).decode()
    assert "settings: preset demo" in logged and "step 6/6" in logged and "done: 6 steps" in logged

    # Export, then load it in a process without torch_xla, and start a new run from it.
    exported = f"{gcs_url}/models/demo.safetensors"
    assert train.command_line(["export", run_dir, "--out", exported]) == 0
    loader = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {PROJECT_DIR!r})
        import model
        from training import checkpoint
        weights, config, _ = checkpoint.read_exported({exported!r})
        trm = model.TRM(model.TRMConfig(**config)); trm.load_state_dict(weights)
        assert "torch_xla" not in sys.modules
        print("LOADED", sum(p.numel() for p in trm.parameters()))
    """)
    loaded = subprocess.run([sys.executable, "-c", loader], env=subprocess_env(), capture_output=True,
                            text=True)
    assert loaded.returncode == 0 and "LOADED" in loaded.stdout, loaded.stderr[-2000:]

    # Zero further steps from the exported EMA weights evaluate exactly like the run's own final evaluation.
    fresh = train.main(parse_config(run_args(demo_path, tmp_path / "from-export", tmp_path / "cache",
                                          "--optim.max-steps", "0", "--run.init-from", exported)))
    for key in ("exact_accuracy", "accuracy", "q_halt_accuracy"):
        assert fresh["final"][key] == pytest.approx(result["final"][key], abs=1e-6)


def test_init_from_a_reference_checkpoint(demo_path, tmp_path):
    import model

    base = run_args(demo_path, tmp_path / "ours", tmp_path / "cache", "--optim.max-steps", "0")
    config = check_against_dataset(parse_config(base), data.open_dataset(demo_path, "train").metadata)
    torch.manual_seed(123)
    reference_model = model.TRM(config.model)
    with torch.no_grad():
        reference_model.puzzle_embedding.weight.normal_()
    reference_file = tmp_path / "reference_step_1000"
    torch.save({"_orig_mod." + k: v for k, v in reference_weights.reference_state_dict(reference_model).items()},
               reference_file)
    weights = load_initial_weights(str(reference_file), config.model)
    for name, value in reference_model.state_dict().items():
        assert torch.equal(weights[f"model/{name}"], value), name
    result = train.main(parse_config(base + ["--run.init-from", str(reference_file)]))
    assert result["final"]["count"] == 40


def test_a_nan_stops_every_step_without_saving_over_the_last_good_checkpoint(demo_path, tmp_path):
    run_dir = tmp_path / "run"
    train.main(parse_config(run_args(demo_path, run_dir, tmp_path / "cache", "--optim.max-steps", "4",
                                  "--run.ckpt-every", "2")))
    # Continue with a learning rate that overflows the weights within a step or two.
    args = run_args(demo_path, run_dir, tmp_path / "cache", "--optim.max-steps", "12", "--optim.lr", "1e30",
                    "--run.allow-config-change", "--run.ckpt-every", "4", "--run.log-every", "4")
    proc = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "train.py"), *args],
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "error: the training loss or metrics are not finite (steps 5-8: loss nan" in proc.stderr, \
        proc.stderr[-2000:]
    assert f"Last committed checkpoint: {checkpoint.step_dir(str(run_dir), 4)} (step 4)" in proc.stderr
    assert "Try a lower --optim.lr (now 1e+30)" in proc.stderr and "Traceback" not in proc.stderr
    assert [step for step, _ in checkpoint.list_checkpoints(str(run_dir))] == [4, 2]
    assert not os.path.exists(checkpoint.step_dir(str(run_dir), 8))
    # The window that went non-finite is in the metrics records (loss null) before the exit.
    last = [r for r in metrics_records(str(run_dir)) if r["kind"] == "train"][-1]
    assert (last["step"], last["loss"]) == (8, None), last
