"""train.py and sharding.py: end-to-end SPMD training on the virtual CPU mesh."""
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import train
from data import PrefetchedBatches, TrainBatches
from training.config import PRESETS, OptimConfig, check_against_dataset, parse_config, settings_lines
from training.schedule import lr_at

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_args(demo_path, tmp_path, *extra):
    """CLI arguments of a small demo run (hidden 32) on `demo_path`."""
    return ["demo", "--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache"),
            "--run.dir", str(tmp_path / "run"), "--model.hidden-size", "32", "--model.puzzle-emb-ndim", "32",
            "--optim.global-batch-size", "32", *extra]


def run_in_fresh_process(args, cpu_devices=8):
    """train.main in a new process (its own XLA graph cache, so every compile shows); the
    result's JSON-able parts."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {PROJECT_DIR!r})
        import train
        from training.config import parse_config
        result = train.main(parse_config({args!r}))
        print("RESULT" + json.dumps({{k: result[k] for k in ("history", "evals", "final", "xla",
                                                               "checkpoint_transfers", "startup_transfers")}}))
    """)
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(cpu_devices))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT")[1]), proc.stdout


def test_training_is_clean_on_xla_and_learns(demo_path, tmp_path):
    result, stdout = run_in_fresh_process(tiny_args(demo_path, tmp_path, "--optim.max-steps", "150",
                                                    "--run.log-every", "50", "--eval.every-epochs", "1000",
                                                    "--optim.lr-warmup-steps", "5"))
    xla = result["xla"]
    # One graph to materialise the initial state, one training step, one evaluation step:
    # anything more is a recompile.
    assert xla["compiles"] == 3, xla
    assert not xla["fallbacks"]
    # Device-to-host reads: one per log line and two per evaluation (its metrics, and its first
    # batch's predictions for the puzzle pictures), nothing in the steps. The final checkpoint's
    # copies and the start-up self-check's one read of its rows are counted apart.
    assert result["startup_transfers"] == 1
    assert (xla["transfers"] - result["checkpoint_transfers"] - result["startup_transfers"]
            == len(result["history"]) + 2 * len(result["evals"]) == 3 + 2)
    history = result["history"]
    assert [h["step"] for h in history] == [50, 100, 150]
    assert history[-1]["lm_loss"] < 0.8 * history[0]["lm_loss"], history
    assert history[0]["exact_accuracy"] < 0.05 and history[-1]["exact_accuracy"] > 0.3, history
    assert result["final"]["count"] == 40  # every held-out puzzle, no padding row counted
    # The step line's rates and the grad norm come with the same reads; on CPU no MFU and no
    # memory (said once at start).
    for row in history:
        assert row["step_ms"] > 0 and row["tflops_per_device"] > 0 and 0 < row["grad_norm"] < math.inf, row
        assert row["step_ms"] == pytest.approx(1e3 / row["steps_per_s"])
        assert "mfu" not in row and "memory_used" not in row
    assert stdout.count("memory n/a") == 1 and "MFU" not in stdout
    assert " ms/step " in stdout and "grad norm " in stdout and " ex/s)" in stdout  # the eval line's rate too

    # metrics.jsonl: one record per step line and per evaluation, in order, the history's values.
    records = metrics_records(str(tmp_path / "run"))
    assert [(r["kind"], r["step"]) for r in records] == [("train", 50), ("train", 100), ("train", 150),
                                                         ("eval", 150)]
    for record, row in zip(records, history):
        assert record == pytest.approx(dict(row, kind="train", time=record["time"]))
    assert records[-1] == pytest.approx(dict(result["final"], kind="eval", step=150, time=records[-1]["time"],
                                             seconds=records[-1]["seconds"],
                                             examples_per_s=records[-1]["examples_per_s"]))
    assert records[0]["time"] < records[-1]["time"] and records[-1]["seconds"] > 0
    # The settings printed at start: what differs from the preset, and what the dataset said;
    # and everything the run printed is also in the run directory's log of host 0.
    assert "settings: preset demo, and what differs from it" in stdout
    assert "\n  --optim.max-steps 150 (preset: None)\n" in stdout and "--model.hidden-size 32 (preset: 64)" in stdout
    assert "  --model.num-puzzle-identifiers 1 (from the dataset; preset: 1)" in stdout
    assert "--optim.lr " not in stdout and "--run.seed" not in stdout  # as the preset has them
    [host_log] = (tmp_path / "run" / "logs").glob("host_0.launch-*.log")
    logged = host_log.read_text()
    assert "step 150/150" in logged and "done: 150 steps" in logged and "XLA: 3 graphs compiled" in logged
    # The start-up self-check's line, and after the first steps what the compile cache did.
    assert "device layout (host order): 0,1,2,3,4,5,6,7; each host's rows land on its own devices" in logged
    assert "compile cache: off (the CPU runtime is not given the cache); 2 graphs compiled in" in logged


@pytest.mark.parametrize("optimizer,schedule", [("adamw", "linear"), ("adam", "constant")])
def test_the_studys_optimizers_and_schedules_train_without_recompiling(demo_path, tmp_path, optimizer, schedule):
    # torch's AdamW / Adam in place of AdamATan2 and another schedule after warmup: the same three
    # graphs (the learning rate is a device input), no fallbacks, and the loss falls.
    result, stdout = run_in_fresh_process(tiny_args(
        demo_path, tmp_path, "--optim.max-steps", "60", "--run.log-every", "20", "--eval.every-epochs", "1000",
        "--optim.lr-warmup-steps", "5", "--optim.optimizer", optimizer, "--optim.lr-schedule", schedule,
        "--optim.lr-min-ratio", "0.1", "--optim.weight-decay", "0.01"))
    assert result["xla"]["compiles"] == 3 and not result["xla"]["fallbacks"], result["xla"]
    history = result["history"]
    assert history[-1]["lm_loss"] < 0.9 * history[0]["lm_loss"], history  # 1.71 -> 1.41 and 1.73 -> 1.38
    assert f"--optim.optimizer {optimizer} (preset: adam_atan2)" in stdout
    lrs = [h["lr"] for h in history]  # at steps 20, 40, 60 of 60, after 5 warmup steps
    want = {"linear": [1e-3 * (0.1 + 0.9 * (1 - p)) for p in (15 / 55, 35 / 55, 1.0)], "constant": [1e-3] * 3}
    assert lrs == pytest.approx(want[schedule], rel=1e-6)


def test_lines_printed_by_two_threads_at_once_stay_whole(tmp_path):
    # The metrics reader prints step lines while the main thread prints its own (the compile
    # line after a resumed launch's first step); print() writes text and newline separately, and
    # a step line once lost its start to the other thread's line, in stdout and the host log.
    code = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {PROJECT_DIR!r})
        from training import run_log
        sys.setswitchinterval(1e-6)
        def speak(name):
            for i in range(2000):
                print(name, "line", i, "of", 2000, flush=i % 2 == 0)
        with run_log.HostLog({str(tmp_path)!r}, 0, "now"):
            threads = [threading.Thread(target=speak, args=(name,)) for name in ("step", "compile")]
            [t.start() for t in threads]
            [t.join() for t in threads]
            print("unfinished", end="")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    logged = (tmp_path / "logs" / "host_0.launch-now.log").read_text()
    want = sorted(f"{name} line {i} of 2000" for name in ("step", "compile") for i in range(2000)) + ["unfinished"]
    for text in out, logged:
        assert sorted(text.splitlines()) == want


def metrics_records(run_dir: str) -> list[dict]:
    """The records of {run_dir}/metrics/part-*.jsonl, as the README says to read them."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(run_dir + "/metrics")
    return [json.loads(line) for part in sorted(fs.glob(path + "/part-*.jsonl")) for line in fs.cat(part).splitlines()]


def test_metrics_parts_rotate_and_a_relaunch_drops_the_steps_it_redoes(tmp_path):
    from training import run_log

    def flushed(metrics):
        assert metrics.uploads.wait(metrics.uploads.request(), 10)

    run_dir = str(tmp_path / "run")
    metrics = run_log.MetricsFile(run_dir)
    metrics.PART_RECORDS = 2
    assert metrics.continue_from(0) == 0
    for step in (1, 2, 3, 4, 5):
        metrics.add({"kind": "train", "step": step, "loss": float("nan") if step == 5 else 1.0 / step})
    flushed(metrics)
    assert sorted(os.listdir(tmp_path / "run" / "metrics")) == ["part-00000.jsonl", "part-00001.jsonl",
                                                                "part-00002.jsonl"]
    assert [r["step"] for r in metrics_records(run_dir)] == [1, 2, 3, 4, 5]
    assert metrics_records(run_dir)[-1]["loss"] is None  # strict JSON: non-finite numbers are null
    # A relaunch from the checkpoint of step 3 drops steps 4 and 5 (which it redoes) and continues.
    again = run_log.MetricsFile(run_dir)
    again.PART_RECORDS = 2
    assert again.continue_from(3) == 2
    again.add({"kind": "train", "step": 4, "loss": 0.2})
    flushed(again)
    assert [r["step"] for r in metrics_records(run_dir)] == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "run" / "metrics")) == ["part-00000.jsonl", "part-00001.jsonl"]


def test_the_settings_printed_at_start_are_the_differences_from_the_preset():
    given = parse_config(["arc1", "--optim.lr", "3e-4", "--eval.no-arc-aggregate", "--data.path", "gs://b/my data"])
    resolved = dataclasses.replace(given, model=dataclasses.replace(given.model, num_puzzle_identifiers=1234))
    lines = settings_lines(given, resolved, "arc1")
    assert lines[1:] == ["  --data.path 'gs://b/my data' (preset: data/arc1concept-aug-1000)",
                         "  --optim.lr 0.0003 (preset: 0.0001)",
                         "  --eval.no-arc-aggregate (preset: True)",
                         "  --model.num-puzzle-identifiers 1234 (from the dataset; preset: 1)"]
    # Without the preset's name, the closest preset: arc2 differs from this only by its data.path.
    arc2 = parse_config(["arc2"])
    assert settings_lines(arc2, arc2)[0].startswith("settings: preset arc2,")


def test_sharded_over_8_devices_equals_1_device(demo_path, tmp_path):
    # float32: the partitioned program rounds differently from the one-device one (logits ~1e-6
    # apart), and bfloat16 turns that into 1-ulp flips of ~5% of the logits: ~1e-4 on the loss.
    steps = ("--optim.max-steps", "5", "--run.log-every", "1", "--eval.every-epochs", "1000",
             "--model.forward-dtype", "float32")
    sharded = train.main(parse_config(tiny_args(demo_path, tmp_path / "sharded", *steps)))
    args = tiny_args(demo_path, tmp_path / "one", *steps)

    one_device, stdout = run_in_fresh_process(args + ["--run.cpu-devices", "1"], cpu_devices=1)
    assert "TRM on CPU: 1 devices on 1 host(s)" in stdout
    one_device = [h["loss"] for h in one_device["history"]]
    assert len(one_device) == 5
    for a, b in zip([h["loss"] for h in sharded["history"]], one_device):
        assert a == pytest.approx(b, rel=1e-5)


def test_config_errors_name_the_values(demo_path, tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"model.seq_len=81 but the dataset at .* has seq_len=16: "
                                         r"pass --model.seq-len 16"):
        train.main(parse_config(tiny_args(demo_path, tmp_path, "--model.seq-len", "81")))
    with pytest.raises(SystemExit, match="model.vocab_size=11 but the dataset .* has vocab_size=6"):
        train.main(parse_config(tiny_args(demo_path, tmp_path, "--model.vocab-size", "11")))
    with pytest.raises(SystemExit, match=r"global_batch_size=36 does not divide over the 8 devices .* "
                                         r"use a multiple of 8 \(e.g. 40\)"):
        train.main(parse_config(tiny_args(demo_path, tmp_path, "--optim.global-batch-size", "36")))
    # 1 epoch of the test demo's 100 examples is no step of a global batch of 512 (max_steps 0 is allowed).
    with pytest.raises(SystemExit, match=r"optim.epochs=1 of this dataset's 100 examples per epoch make no step "
                                         r"of optim.global_batch_size=512: raise --optim.epochs to at least 6 "):
        train.main(parse_config(tiny_args(demo_path, tmp_path, "--optim.epochs", "1", "--optim.global-batch-size",
                                       "512", "--optim.max-steps", "5")))
    missing = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit, match="nowhere"):
        train.main(parse_config(tiny_args(demo_path, tmp_path, "--data.path", missing)))
    with pytest.raises(SystemExit):
        parse_config(["sudoku-xl"])
    assert "sudoku-xl" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^error: model.H_cycles=0 must be >= 1 \(set it with --model.H-cycles\)$"):
        parse_config(tiny_args(demo_path, tmp_path, "--model.H-cycles", "0"))


def test_tpu_requested_without_tpu_fails_loudly():
    import sharding

    with pytest.raises(sharding.NoTPUError, match="has no TPU chips.*--run.device cpu"):
        sharding.start_runtime("tpu")


def test_presets_are_the_papers_recipes():
    presets = {name: config for name, (_, config) in PRESETS.items()}
    assert presets["sudoku-mlp"].model.mlp_t and presets["sudoku-mlp"].model.pos_encodings == "none"
    for name in ("sudoku-mlp", "sudoku-att", "maze", "arc1", "arc2"):
        c = presets[name]
        assert (c.optim.global_batch_size, c.optim.lr, c.optim.lr_warmup_steps) == (768, 1e-4, 2000)
        assert (c.model.H_cycles, c.model.hidden_size, c.model.halt_max_steps) == (3, 512, 16)
        assert c.model.L_cycles == (6 if name.startswith("sudoku") else 4)
    assert presets["arc1"].optim.puzzle_emb_lr == 1e-2 and presets["arc1"].optim.weight_decay == 0.1
    assert presets["arc1"].optim.epochs == 100000 and presets["sudoku-att"].optim.epochs == 50000
    # The reference reports ARC pass@k voted over every evaluation of a run (aggregated_voting).
    assert all(presets[name].eval.arc and presets[name].eval.arc_aggregate for name in ("arc1", "arc2"))
    assert not any(presets[name].eval.arc_aggregate for name in ("sudoku-mlp", "sudoku-att", "maze", "demo"))
    # The demo too: the first command users run, and every test built on it, take the bf16 path.
    assert {c.model.forward_dtype for c in presets.values()} == {"bfloat16"}


def test_lr_schedule_matches_the_reference_formula():
    optim = dataclasses.replace(OptimConfig(), lr_warmup_steps=10, lr_min_ratio=0.1)
    assert lr_at(0, 1.0, optim, 110) == 0
    assert lr_at(5, 1.0, optim, 110) == pytest.approx(0.5)
    assert lr_at(10, 1.0, optim, 110) == pytest.approx(1.0)
    assert lr_at(60, 1.0, optim, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, 1.0, optim, 110) == pytest.approx(0.1)
    constant = dataclasses.replace(optim, lr_min_ratio=1.0)
    assert lr_at(80, 2.0, constant, 110) == 2.0
    # The shapes a study compares after the same warmup: a straight line to the floor, or none.
    linear = dataclasses.replace(optim, lr_schedule="linear")
    assert [lr_at(s, 1.0, linear, 110) for s in (5, 10, 60, 110)] == pytest.approx([0.5, 1.0, 0.55, 0.1])
    flat = dataclasses.replace(optim, lr_schedule="constant")
    assert [lr_at(s, 1.0, flat, 110) for s in (5, 10, 60, 110)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_hosts_with_different_configs_all_stop_naming_the_odd_host():
    """Three real processes in a gloo group; host 2 runs different flags."""
    port = _free_port()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {PROJECT_DIR!r})
        import sharding
        rank = int(sys.argv[1])
        sharding.init_host_group("tcp://127.0.0.1:{port}", rank=rank, world_size=3, timeout_s=60)
        assert sharding.broadcast_object({{"run": "abc"}} if rank == 0 else None) == {{"run": "abc"}}
        sharding.barrier()
        try:
            sharding.check_same_config("lr=1e-4" if rank != 2 else "lr=3e-4")
        except sharding.HostMismatchError as e:
            print("MISMATCH", e)
            sys.exit(3)
    """)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(3)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 3, err[-2000:]
        assert "MISMATCH host(s) [2] run a configuration whose hash differs from process 0's" in out


def test_profile_of_a_few_steps_lands_in_the_tensorboard_dir(demo_path, tmp_path):
    train.main(parse_config(tiny_args(demo_path, tmp_path, "--optim.max-steps", "12", "--run.profile-steps", "2",
                                   "--eval.every-epochs", "1000")))
    profiles = [os.path.join(root, name) for root, _, names in os.walk(tmp_path / "run" / "tb" / "plugins" / "profile")
                for name in names if name.endswith(".xplane.pb")]
    assert profiles and os.path.getsize(profiles[0]) > 0


def test_captured_step_equals_the_retraced_step(demo_path, tmp_path):
    """The step traced once and replayed gives the same numbers as re-tracing it every step."""
    args = ("--optim.max-steps", "8", "--run.log-every", "1", "--eval.every-epochs", "1000")
    replayed = train.main(parse_config(tiny_args(demo_path, tmp_path / "a", *args)))
    retraced = train.main(parse_config(tiny_args(demo_path, tmp_path / "b", *args, "--run.no-capture-step")))
    assert [h["loss"] for h in replayed["history"]] == [h["loss"] for h in retraced["history"]]
    assert replayed["final"] == retraced["final"]


def test_host_batch_lands_split_over_the_devices_by_rows():
    """Every key, whatever its rank, is split on dim 0 over the 8 devices (a spec of the wrong
    rank would leave it replicated) and holds the host's values."""
    import numpy as np
    import torch_xla

    import sharding

    host = {"inputs": np.arange(8 * 5, dtype=np.int32).reshape(8, 5),
            "puzzle_identifiers": np.arange(100, 108, dtype=np.int32)}
    batch = sharding.host_batch_to_global(host, sharding.data_mesh())
    tiles = {"inputs": "[8,1]", "puzzle_identifiers": "[8]"}
    for key, array in host.items():
        assert torch_xla._XLAC._get_xla_sharding_spec(batch[key]).startswith("{devices=" + tiles[key])
        assert np.array_equal(batch[key].cpu().numpy(), array)


def test_prefetched_batches_come_in_step_order_from_a_background_thread():
    import threading

    loaded = []

    def load(step):
        loaded.append((step, threading.current_thread().name))
        if step == 4:
            raise OSError("bucket went away")
        return {"step": step}

    batches = PrefetchedBatches(load, first_step=2, last_step=5)
    assert [batches.get(step)["step"] for step in (2, 3)] == [2, 3]
    with pytest.raises(OSError, match="bucket went away"):
        batches.get(4)  # the loader's error reaches the training loop at the step that needs it
    assert batches.get(5)["step"] == 5
    batches.close()
    assert [step for step, _ in loaded] == [2, 3, 4, 5]  # each step once, none past the last
    assert all(name.startswith("trm-batches") for _, name in loaded)


def test_a_nan_stop_writes_the_non_finite_window_before_it_exits(demo_path, tmp_path, monkeypatch):
    # A NaN stop is a SystemExit from inside the loop: the metrics records of the window that went
    # non-finite must be written before it leaves, however slow the writes (an object store).
    from training import run_log

    write = run_log.MetricsFile._write

    def slow_write(self):
        time.sleep(1.0)
        write(self)
    monkeypatch.setattr(run_log.MetricsFile, "_write", slow_write)
    with pytest.raises(SystemExit, match="not finite"):
        train.main(parse_config(tiny_args(demo_path, tmp_path, "--optim.lr", "1e30", "--optim.max-steps", "8",
                                       "--run.log-every", "4", "--run.ckpt-every", "4")))
    records = metrics_records(str(tmp_path / "run"))  # read at once: the exit waited for the write
    assert records and (records[-1]["step"], records[-1]["loss"]) == (4, None), records


def test_grad_norm_is_clip_grad_norms_total_norm_of_the_eager_cpu_gradients(demo_path, tmp_path):
    """The captured step's grad_norm (AdamATan2's parameters; the table's SignSGD gradient is not
    in it) equals torch.nn.utils.clip_grad_norm_'s total norm of the same gradients computed
    eagerly on the CPU from the same weights, batch and carry, in float32."""
    import torch

    import data
    import sharding
    from model import TRM, Carry, loss_and_metrics
    from training.trainer import TRAIN_METRICS, Trainer

    config = parse_config(tiny_args(demo_path, tmp_path, "--model.forward-dtype", "float32", "--model.H-cycles", "2",
                                 "--model.L-cycles", "1"))  # smaller than the demo's 3 x 6: compiles faster
    train_set = data.open_dataset(demo_path, "train")
    config = check_against_dataset(config, train_set.metadata)
    mesh = sharding.data_mesh()
    trainer = Trainer(config, sharding, mesh)
    host_batch = TrainBatches(train_set, config.optim.global_batch_size, seed=0).batch(0)
    trainer.init_carries(sharding.host_batch_to_global(host_batch, mesh))
    sharding.sync()
    weights = {k: v.cpu() for k, v in trainer.model.state_dict().items()}
    carry = {k: v.cpu() for k, v in trainer.carry.tensors().items()}
    metrics = trainer.step(sharding.host_batch_to_global(host_batch, mesh), 1e-4, 1e-4)
    sharding.sync()
    grad_norm = metrics.cpu()[TRAIN_METRICS.index("grad_norm")].item()

    model = TRM(config.model, exploration_seed=config.run.seed).train()
    model.load_state_dict(weights)
    new_carry, outputs = model(Carry.from_tensors(carry), {k: torch.from_numpy(v) for k, v in host_batch.items()})
    loss, _ = loss_and_metrics(new_carry, outputs)
    (loss / config.optim.global_batch_size).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")).item()
    assert expected > 0
    assert grad_norm == pytest.approx(expected, rel=1e-5)  # float32 sums in another order


class _Slice:
    """What RunLog asks of sharding.py, for a slice of `devices` devices of `kind`."""

    def __init__(self, devices: int, kind: str):
        self.devices, self.kind = devices, kind

    def device_counts(self):
        return self.devices, self.devices

    def accelerator_kind(self):
        return self.kind

    def memory_info(self):
        raise RuntimeError("no memory statistics here")


def test_mfu_is_model_flops_over_time_and_peak_and_absent_on_cpu():
    import torch

    from tpu_costs.slices import peak_tflops_per_device
    from training import run_log
    from training.model_flops import model_flops
    from training.trainer import TRAIN_METRICS

    # 43 GFLOP per example, 768 per step, 100 steps in 2 s (20 ms each) on 32 devices of a v4:
    # 43e9 * 768 / 0.02 s / 32 = 51.6 TFLOP/s per device, 51.6 / 275 = 18.76% MFU.
    rates = run_log.speed(100, 2.0, 768, 43e9, 32, 275.0)
    assert rates["step_ms"] == pytest.approx(20.0) and rates["examples_per_s"] == pytest.approx(38400.0)
    assert rates["tflops_per_device"] == pytest.approx(51.6) and rates["mfu"] == pytest.approx(51.6 / 275)
    assert "mfu" not in run_log.speed(100, 2.0, 768, 43e9, 32, None)
    assert [peak_tflops_per_device(k) for k in ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6 lite", "CPU", "TPU",
                                                None)] == [275.0, 197.0, 459.0, 918.0, None, None, None]

    # Through RunLog's step line, with the accelerator kind injected, and the real FLOP formula.
    config = PRESETS["sudoku-mlp"][1]
    flops = model_flops(config.model)["train"]
    sums = torch.zeros(len(TRAIN_METRICS))
    sums[TRAIN_METRICS.index("count")] = 768 * 100
    sums[TRAIN_METRICS.index("grad_norm")] = 0.25 * 100  # 100 steps of norm 0.25: the window's mean is 0.25
    rows = {}
    for kind in ("TPU v4", "CPU"):
        log = run_log.RunLog(config, 1000, main_host=False, sharding=_Slice(32, "CPU"),
                             peak_tflops=peak_tflops_per_device(kind))
        log._report_train(sums, 100, 100, 2.0, 1e-4)
        log.close()
        rows[kind] = log.history[-1]
    assert rows["TPU v4"]["mfu"] == pytest.approx(flops * 768 / (0.02 * 32 * 275e12))
    assert rows["TPU v4"]["grad_norm"] == pytest.approx(0.25)
    assert "mfu" not in rows["CPU"]
    assert rows["CPU"]["tflops_per_device"] == pytest.approx(flops * 768 / 0.02 / 32 / 1e12)
    assert rows["CPU"]["step_ms"] == pytest.approx(20.0)


def test_the_demo_in_float32_trains_as_recorded(demo_path, tmp_path):
    """The demo's model and step in float32, 3 steps and the final evaluation, against the values
    recorded before the step was rewritten for fewer bytes (tests/data/demo_float32_steps.json):
    a rewrite must compute the same math, so they agree within float32 rounding. Every loss, the
    first included, is compared at that rounding (rel 5e-6), never bit for bit: another
    CPU, BLAS kernel or thread count sums in another order (measured: the first loss bitwise on the
    recording machine, 6e-8 relative on an AVX-512 EPYC; the rest within 6e-7). The presets' bf16
    differs in its last bits where a rewrite sums in another order, and the recursion carries that on."""
    recorded = json.loads((Path(__file__).parent / "data" / "demo_float32_steps.json").read_text())
    result, _ = run_in_fresh_process(tiny_args(demo_path, tmp_path, "--model.forward-dtype", "float32",
                                               "--optim.max-steps", "3", "--run.log-every", "1",
                                               "--eval.every-epochs", "1000", "--optim.lr-warmup-steps", "5"))
    # The metrics an argmax or a sign decides (a token right, a puzzle right, the Q head right, the
    # step a row halts at) are means over `count` examples of per-example terms: one example whose
    # deciding logits lie within float32 rounding of each other may go the other way on another
    # CPU, moving its term by up to 1 (halting step: up to halt_max_steps - 1 = 3). They are compared
    # as those sums, with that one example's allowance; the losses and the gradient norm, which
    # pin the math, at float32 rounding.
    allowance = {"accuracy": 1.0, "exact_accuracy": 1.0, "q_halt_accuracy": 1.0, "steps": 3.0}

    def same(got, expected, where):
        for name, value in expected.items():
            if name in allowance:
                assert abs(got[name] - value) * expected["count"] <= allowance[name], (where, name, got[name], value)
            else:
                assert got[name] == pytest.approx(value, rel=5e-6, abs=1e-7), (where, name)

    for row, expected in zip(result["history"], recorded["history"], strict=True):
        same(row, expected, row["step"])
    same(result["final"], recorded["final"], "final")
