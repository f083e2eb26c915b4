"""bench.py: the FLOP formula against the model's own matmuls, slice names, and a measured run
of tiny presets on the virtual CPU mesh whose JSON has every field."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import bench
import data
from bench import PRESET_NAMES
from data import TrainBatches
from model import TRM, loss_and_metrics
from tpu_costs.run_costs import PAPER_DATASETS, PaperDataset, flop_record, project_paper_run, projected_ms
from tpu_costs.slices import slice_spec
from training.config import PRESETS
from training.model_flops import model_flops
from training.trainer import Trainer

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every field the issue asks for, per preset record (names carry their units).
RECORD_FIELDS = [
    "preset", "parameters", "train_gflop_per_example", "eval_gflop_per_example", "global_batch_size",
    "slice", "slice_chips", "peak_tflops_per_chip", "projected_device_ms_per_train_step",
    "projected_device_ms_per_eval_step", "host_ms_per_step", "host_cpu_ms_per_step", "process_cpu_ms_per_step",
    "data_ms_per_step",
    "trace_ms_per_step", "sync_ms_per_step", "device_ms_per_step", "compiles", "compile_s",
    "compiles_in_timed_steps", "aten_fallbacks", "aten_fallbacks_per_step", "transfers_from_device_per_step",
    "data_rows_per_s_per_host", "host_to_projected_device_ratio", "host_cpu_to_projected_device_ratio",
    "loss", "loss_samples", "eval_host_ms_per_step", "eval_compiles_in_timed_steps",
    "checkpoint_pause_ms", "checkpoint_pause_ms_per_host", "checkpoint_bytes_per_host_max", "checkpoint_bytes",
    "state_bytes_per_device", "carry_bytes_per_device", "puzzle_embedding_bytes_per_device", "paper_run",
]


def counted_flops(config, batch_size=3, train_mode=True):
    """FLOPs that torch's FlopCounterMode sees in one CPU-eager ACT step (with backward when
    training). The math SDPA backend decomposes attention into matmuls it can count."""
    torch.manual_seed(0)
    model = TRM(config).train(train_mode)
    batch = {"inputs": torch.randint(0, config.vocab_size, (batch_size, config.seq_len)),
             "labels": torch.randint(0, config.vocab_size, (batch_size, config.seq_len)),
             "puzzle_identifiers": torch.randint(0, config.num_puzzle_identifiers, (batch_size,))}
    carry = model.initial_carry(batch)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        if train_mode:
            carry, outputs = model(carry, batch)
            loss, _ = loss_and_metrics(carry, outputs)
            loss.backward()
        else:
            with torch.no_grad():
                model(carry, batch)
    return counter.get_total_flops() / batch_size


@pytest.mark.parametrize("preset", ["sudoku-mlp", "sudoku-att", "arc1"])
@pytest.mark.parametrize("no_act_continue", [True, False])
def test_flop_formula_equals_the_models_matmuls(preset, no_act_continue):
    config = dataclasses.replace(bench.tiny_model(PRESETS[preset][1].model), seq_len=20,
                                 num_puzzle_identifiers=5, H_cycles=3, L_cycles=2,
                                 no_ACT_continue=no_act_continue)
    flops = model_flops(config)
    assert counted_flops(config, train_mode=True) == flops["train"] + flops["train_extra"]
    assert counted_flops(config, train_mode=False) == flops["eval"] + flops["eval_extra"]
    if not config.mlp_t:  # 22 positions are one block of keys; in blocks of 16 the form adds its extra
        blocks = dataclasses.replace(config, attention_block=16)
        extra = model_flops(blocks)
        assert flops["train_extra"] == flops["eval_extra"] == 0 < extra["eval_extra"] < extra["train_extra"]
        assert counted_flops(blocks, train_mode=True) == flops["train"] + extra["train_extra"]
        assert counted_flops(blocks, train_mode=False) == flops["eval"] + extra["eval_extra"]
        assert counted_flops(dataclasses.replace(config, attention="sdpa"), train_mode=True) == flops["train"]


def test_sudoku_mlp_costs_what_its_shapes_say():
    flops = model_flops(PRESETS["sudoku-mlp"][1].model)
    # about 43 GFLOP per example (model_flops.model_flops: 21 of the 42 block applications
    # forward, 14 of them backward at twice the cost, the heads, and the recursion's forward again)
    assert 42e9 < flops["train"] < 44e9
    ms = projected_ms(flops["train"], 768, slice_spec("v4-64"))
    assert 3.5 < ms < 4.0  # the paper's global batch on v4-64 at full speed: about 4 ms


def test_a_curriculum_counts_each_stage_at_its_own_cycles():
    """The recursion curriculum's early stages recurse with fewer cycles (schedule.Curriculum):
    their steps' FLOPs are their cycles' (the model's own recursing with them, as
    Trainer.recursing runs it, counted by torch), and so are the step line's MFU, the run's
    training FLOPs and its projected hours; counting them at the model's cycles overstated the
    first Sudoku stage's MFU 3.9 times."""
    from tests.test_train import _Slice
    from tpu_costs.run_costs import train_flops_of, train_stages
    from training import run_log
    from training.model_flops import stage_flops
    from training.schedule import Curriculum
    from training.trainer import TRAIN_METRICS

    tiny = dataclasses.replace(bench.tiny_model(PRESETS["sudoku-mlp"][1].model), seq_len=20, num_puzzle_identifiers=5)
    torch.manual_seed(0)
    model = TRM(tiny)
    model.config = dataclasses.replace(tiny, H_cycles=1, L_cycles=2)  # what Trainer.recursing((1, 2)) does
    batch = {"inputs": torch.randint(0, tiny.vocab_size, (3, tiny.seq_len)),
             "labels": torch.randint(0, tiny.vocab_size, (3, tiny.seq_len)),
             "puzzle_identifiers": torch.randint(0, 5, (3,))}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        carry, outputs = model(model.initial_carry(batch), batch)
        loss_and_metrics(carry, outputs)[0].backward()
    assert counter.get_total_flops() / 3 == stage_flops(tiny, (1, 2))["train"] < model_flops(tiny)["train"]

    config = dataclasses.replace(PRESETS["sudoku-mlp"][1], optim=dataclasses.replace(
        PRESETS["sudoku-mlp"][1].optim, curriculum_epochs=10000))
    stages = train_stages(config, PAPER_DATASETS["sudoku-mlp"], 65104)
    assert stages == [((1, 2), 3256), ((1, 3), 3255), ((2, 4), 3255), ((2, 5), 3255), ((3, 6), 52083)]
    first, final = stage_flops(config.model, (1, 2))["train"], model_flops(config.model)["train"]
    assert final / first == pytest.approx(3.888, abs=1e-3)
    assert train_flops_of(config, stages) == sum(stage_flops(config.model, c)["train"] * n for c, n in stages) * 768
    assert train_flops_of(config, stages) < final * 65104 * 768  # the curriculum row's train_flops, 11% lower
    from fleet import (
        report as study_report,  # the report's train_flops column: the same, or none where the stages cannot be placed
    )

    assert study_report.trained_flops(config, PAPER_DATASETS["sudoku-mlp"], 65104) == train_flops_of(config, stages)
    assert study_report.trained_flops(config, None, 65104) is None
    assert study_report.trained_flops(PRESETS["sudoku-mlp"][1], None, 100) == final * 768 * 100

    # The step line: 100 steps in 2 s on 32 devices of a v4, in the first stage and across the
    # second stage's start (steps 3201-3300: 56 of them at (1, 2), 44 at (1, 3)).
    curriculum = Curriculum(config, 65104)
    assert curriculum.stage_steps(3201, 3300) == [((1, 2), 56), ((1, 3), 44)]
    sums = torch.zeros(len(TRAIN_METRICS))
    sums[TRAIN_METRICS.index("count")] = 768 * 100
    mfu = {}
    for last, given in ((100, curriculum), (3300, curriculum), (100, None)):
        log = run_log.RunLog(config, 65104, main_host=False, sharding=_Slice(32, "TPU v4"), curriculum=given,
                             peak_tflops=275.0)
        log._report_train(sums, last, 100, 2.0, 1e-4)
        log.close()
        mfu[last, given is not None] = log.history[-1]["mfu"]
    per_example = (56 * first + 44 * stage_flops(config.model, (1, 3))["train"]) / 100
    assert mfu[100, True] == pytest.approx(first * 768 / (0.02 * 32 * 275e12))
    assert mfu[3300, True] == pytest.approx(per_example * 768 / (0.02 * 32 * 275e12))
    assert mfu[100, False] / mfu[100, True] == pytest.approx(final / first)  # as it was counted before

    # The projection prices each stage at its own device time: compiled where the record has it,
    # else the stage's FLOPs at the MFU.
    record = flop_record("sudoku-mlp", config, slice_spec("v4-8"))
    at_flops = project_paper_run(record, config, PAPER_DATASETS["sudoku-mlp"], 0.4)
    assert [s["steps"] for s in at_flops["train_stages"]] == [n for _, n in stages]
    assert at_flops["train_hours"] == pytest.approx(
        sum(projected_ms(stage_flops(config.model, c)["train"], 768, slice_spec("v4-8")) / 0.4 * n
            for c, n in stages) / 3.6e6)
    compiled = dict(record, compiled_ms_per_train_step=30.0, compiled_ms_per_eval_step=5.0,
                    compiled_ms_per_train_stage={"1,2": 10.0, "1,3": 12.0, "2,4": 18.0, "2,5": 21.0, "3,6": 30.0},
                    compiled_source="compiled")
    run = project_paper_run(compiled, config, PAPER_DATASETS["sudoku-mlp"], 0.4)
    assert run["train_hours"] == pytest.approx((3256 * 10 + 3255 * (12 + 18 + 21) + 52083 * 30) / 3.6e6)


def test_a_curriculum_run_compiles_each_stages_training_step():
    """run_costs.run_programs: a curriculum run compiles its evaluation step and the training
    step of each stage (the model at the stage's cycles, the curriculum off: the program
    Trainer.recursing runs); device_time_fields names each stage's estimate by its cycles."""
    from tpu_costs import run_costs

    config = dataclasses.replace(PRESETS["sudoku-mlp"][1], optim=dataclasses.replace(
        PRESETS["sudoku-mlp"][1].optim, curriculum_epochs=10000))
    programs = run_costs.run_programs(config, PAPER_DATASETS["sudoku-mlp"])
    assert programs[0] == (config, ("train_step", "eval_step"))
    assert [(c.model.H_cycles, c.model.L_cycles, c.optim.curriculum_epochs, p) for c, p in programs[1:]] == [
        (1, 2, 0, ("train_step",)), (1, 3, 0, ("train_step",)), (2, 4, 0, ("train_step",)), (2, 5, 0, ("train_step",))]
    short = dataclasses.replace(config, optim=dataclasses.replace(config.optim, max_steps=100))  # the first stage only
    assert [(c.model.H_cycles, c.model.L_cycles, p) for c, p in run_costs.run_programs(
        short, PAPER_DATASETS["sudoku-mlp"])] == [(3, 6, ("eval_step",)), (1, 2, ("train_step",))]
    assert run_costs.run_programs(PRESETS["sudoku-mlp"][1], PAPER_DATASETS["sudoku-mlp"]) == [
        (PRESETS["sudoku-mlp"][1], ("train_step", "eval_step"))]
    results = [{"program": "train_step", "cycles": [3, 6], "compiled": True, "estimate_ms": 30.0,
                "estimate_source": "XLA"},
               {"program": "eval_step", "cycles": [3, 6], "compiled": True, "estimate_ms": 5.0},
               {"program": "train_step", "cycles": [1, 2], "compiled": True, "estimate_ms": 10.0},
               {"program": "train_step", "cycles": [1, 3], "compiled": False, "error": "RESOURCE_EXHAUSTED"}]
    fields = run_costs.device_time_fields(results, (3, 6))
    assert fields["compiled_ms_per_train_step"] == 30.0 and fields["compiled_ms_per_eval_step"] == 5.0
    assert fields["compiled_ms_per_train_stage"] == {"3,6": 30.0, "1,2": 10.0}
    assert fields["refused"] == ["train_step (H_cycles 1 L_cycles 3)"]


def test_slice_names():
    v4 = slice_spec("v4-64")
    assert (v4.chips, v4.hosts, v4.peak_tflops_per_chip, v4.peak_tflops) == (32, 8, 275.0, 8800.0)
    assert (slice_spec("v4-8").chips, slice_spec("v4-8").hosts) == (4, 1)
    assert (slice_spec("v4-32").chips, slice_spec("v4-32").hosts) == (16, 4)
    assert (slice_spec("v5e-16").chips, slice_spec("v5e-16").hosts,
            slice_spec("v5e-16").peak_tflops_per_chip) == (16, 4, 197.0)
    assert (slice_spec("v6e-8").chips, slice_spec("v6e-8").hosts,
            slice_spec("v6e-8").peak_tflops_per_chip) == (8, 1, 918.0)
    # v5p counts TensorCores like v4 (launch.sh create supports it): 64 chips on 16 hosts, 459 TFLOP/s each.
    assert (slice_spec("v5p-128").chips, slice_spec("v5p-128").hosts,
            slice_spec("v5p-128").peak_tflops_per_chip) == (64, 16, 459.0)
    for bad in ("v4-12", "v3-8", "tpu", "v5e-0", "v5p-12"):
        with pytest.raises(ValueError, match="slice"):
            slice_spec(bad)


def test_arc_like_synthetic_data_has_many_identifiers_and_puzzle_sizes(tmp_path):
    model = PRESETS["arc1"][1].model
    metadata = bench.write_synthetic_dataset(str(tmp_path), "arc1", model, table_rows=876_406)
    dataset = data.open_dataset(str(tmp_path), "train")
    assert (metadata.seq_len, metadata.vocab_size) == (900, 12)
    assert metadata.num_puzzle_identifiers == 876_406 and len(np.unique(dataset.puzzle_identifiers)) == 8000
    assert len(np.unique(np.diff(dataset.puzzle_indices))) > 1
    batch = TrainBatches(dataset, 768, seed=0).batch(3)
    assert batch["inputs"].shape == (768, 900)
    assert bench.data_rows_per_s(dataset, 768, hosts=8, batches=2) > 0


def test_a_small_table_still_holds_every_synthetic_identifier(tmp_path):
    bench.write_synthetic_dataset(str(tmp_path), "arc1", bench.tiny_model(PRESETS["arc1"][1].model), 50)
    identifiers = data.open_dataset(str(tmp_path), "train").puzzle_identifiers
    assert identifiers.min() == 1 and identifiers.max() == 49  # 0 is the blank row


def test_table_rows_default_to_the_real_datasets():
    assert [PAPER_DATASETS[p].puzzle_identifiers for p in PRESET_NAMES] == [1, 1, 1, 876_406, 1_191_730]


def test_bytes_per_device_of_a_replicated_and_a_row_sharded_tensor(spmd_mesh):
    import torch_xla.distributed.spmd as xs

    import sharding

    replicated = sharding.replicate(torch.zeros(10, 4).to(sharding.device()), spmd_mesh)
    assert sharding.bytes_per_device(replicated) == 10 * 4 * 4
    rows = torch.zeros(10, 4).to(sharding.device())
    xs.mark_sharding(rows, spmd_mesh, ("data", None))
    assert sharding.bytes_per_device(rows) == 2 * 4 * 4  # ceil(10 / 8) = 2 rows of 4 floats
    unannotated = torch.zeros(3, 5, dtype=torch.bfloat16).to(sharding.device())
    assert sharding.bytes_per_device(unannotated) == 3 * 5 * 2  # SPMD puts it whole on every device
    grid = xs.Mesh(np.arange(8), (4, 2), ("x", "y"))
    halves = torch.zeros(10, 4).to(sharding.device())
    xs.mark_sharding(halves, grid, (None, "y"))  # 2 tiles of columns, replicated over x
    assert sharding.bytes_per_device(halves) == 10 * 2 * 4


RECIPE = dataclasses.replace(
    PRESETS["sudoku-mlp"][1],
    optim=dataclasses.replace(PRESETS["sudoku-mlp"][1].optim, epochs=100, global_batch_size=100),
    eval=dataclasses.replace(PRESETS["sudoku-mlp"][1].eval, every_epochs=25),
    run=dataclasses.replace(PRESETS["sudoku-mlp"][1].run, ckpt_every=400))
SMALL_SET = PaperDataset("small", total_groups=1000, mean_puzzle_examples=1.5, test_examples=2000,
                               puzzle_identifiers=1, source="test")


@pytest.mark.parametrize("max_examples, host_ms, eval_act_steps, train_hours, eval_hours, total_hours", [
    # 1500 steps of max(5, 3/0.5) = 6 ms = 9 s; 4 evaluations of 20 batches of 16 ACT steps of
    # max(2, 0.5/0.5) = 2 ms = 2.56 s; checkpoints at 400, 800, 1200 and 1500, 1.5 s each = 6 s
    (None, 5.0, 1280, 9 / 3600, 2.56 / 3600, 17.56 / 3600),
    # host-bound training, 8 ms; 3 capped evaluations of 5 batches + the final one of 20:
    # 35 batches, 560 ACT steps of 2 ms; 12 s + 1.12 s + 6 s
    (500, 8.0, 560, 12 / 3600, 1.12 / 3600, 19.12 / 3600),
])
def test_paper_run_projection(max_examples, host_ms, eval_act_steps, train_hours, eval_hours, total_hours):
    recipe = dataclasses.replace(RECIPE, eval=dataclasses.replace(RECIPE.eval, max_examples=max_examples))
    record = {"slice": "v4-64", "host_ms_per_step": host_ms, "eval_host_ms_per_step": 2.0,
              "projected_device_ms_per_train_step": 3.0, "projected_device_ms_per_eval_step": 0.5,
              "checkpoint_pause_ms": 1500.0}
    run = project_paper_run(record, recipe, SMALL_SET, mfu=0.5)
    assert (run["train_steps"], run["evaluations"], run["eval_act_steps"], run["checkpoints"]) == \
        (1500, 4, eval_act_steps, 4)
    assert run["train_hours"] == pytest.approx(train_hours)
    assert run["eval_hours"] == pytest.approx(eval_hours)
    assert run["checkpoint_minutes"] == pytest.approx(0.1)
    assert run["total_hours"] == pytest.approx(total_hours)


def test_paper_runs_of_the_presets():
    """The recipes' step counts: Sudoku 50,000 epochs of 1000 one-example groups at 768 per
    step (int(50,000 x 1000 / 768): 65,104 steps), evaluated every 5000 epochs with 16 ACT steps per batch
    of the 423k test puzzles (README: about 88k ACT steps)."""
    sudoku = project_paper_run(flop_record("sudoku-mlp", PRESETS["sudoku-mlp"][1],
                                                       slice_spec("v4-64")),
                                     PRESETS["sudoku-mlp"][1], PAPER_DATASETS["sudoku-mlp"], 0.4)
    assert (sudoku["train_steps"], sudoku["evaluations"], sudoku["checkpoints"]) == (65104, 10, 33)
    assert sudoku["eval_act_steps"] == 10 * 551 * 16
    arc1 = project_paper_run(flop_record("arc1", PRESETS["arc1"][1], slice_spec("v4-64")),
                                   PRESETS["arc1"][1], PAPER_DATASETS["arc1"], 0.4)
    assert arc1["train_steps"] == 100_000 * 3_633_410 * 960 // (876_405 * 768)
    assert arc1["evaluations"] == 10 and arc1["eval_act_steps"] == 10 * 503 * 16  # 385,815 test examples


def test_flops_only_needs_no_device():
    result = bench.run(bench.BenchConfig(presets=("sudoku-mlp", "arc1"), flops_only=True, slice="v6e-8",
                                         device_time="mfu"))
    assert result["peak_tflops_per_chip"] == 918.0 and result["slice_chips"] == 8
    assert [r["preset"] for r in result["records"]] == ["sudoku-mlp", "arc1"]
    assert all(r["parameters"] > 1_000_000 for r in result["records"])
    assert all(r["paper_run"]["total_hours"] > 0 for r in result["records"])  # device time alone


def test_bench_runs_tiny_presets_on_the_cpu_mesh(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    proc = subprocess.run(
        [sys.executable, os.path.join(PROJECT_DIR, "bench.py"), "--tiny", "--presets", "sudoku-mlp", "sudoku-att",
         "--steps", "2", "--warmup", "1", "--data-batches", "3", "--slice", "v4-32", "--json", str(out),
         "--table-rows", "1000", "--checkpoint-repeats", "1", "--device-time", "mfu"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["slice"], result["slice_chips"], result["peak_tflops_per_chip"]) == ("v4-32", 16, 275.0)
    assert result["devices"] == 8 and result["tiny"]
    assert [r["preset"] for r in result["records"]] == ["sudoku-mlp", "sudoku-att"]
    for record in result["records"]:
        missing = [f for f in RECORD_FIELDS if record.get(f) is None]
        assert not missing, f"{record['preset']}: no {missing}"
        assert record["measured_batch"] == 8 and record["model"]["hidden_size"] == 32
        assert record["host_ms_per_step"] > 0 and record["device_ms_per_step"] > 0
        assert record["compiles"] >= 1 and record["compiles_in_timed_steps"] == 0  # one graph per step
        assert record["aten_fallbacks_per_step"] == 0 and record["transfers_from_device_per_step"] == 0
        assert record["executions_per_step"] == 1
        assert record["eval_host_ms_per_step"] > 0 and record["eval_compiles_in_timed_steps"] == 0
        assert len(record["loss_samples"]) == 2 and record["loss"] == record["loss_samples"][-1]
        assert all(math.isfinite(step["loss"]) and step["loss"] > 0 for step in record["steps"])
        # the table, 1000 rows of 32 float32, is split by rows: 125 rows on each of the 8 devices,
        # 250 in each of the 4 hosts' checkpoint files
        assert record["puzzle_embedding_rows"] == 1000 and record["puzzle_embedding_bytes_per_device"] == 16_000
        assert record["carry_bytes_per_device"] > 0
        assert record["state_bytes_per_device"] > 16_000 + record["carry_bytes_per_device"]
        assert len(record["checkpoint_bytes_per_host"]) == 4 and record["checkpoint_pause_ms"] > 0
        assert min(record["checkpoint_bytes_per_host"]) >= 32_000
        assert record["checkpoint_bytes"] > record["checkpoint_bytes_per_host_max"]
        assert record["paper_run"]["train_steps"] == 65104 and record["paper_run"]["total_hours"] > 0
    assert "host/peak" in proc.stdout and "sudoku-att" in proc.stdout
    assert proc.stdout.split("\n-")[0].split()[-1] == "loss"  # the table's last column
    assert "at 40% MFU" in proc.stdout and "total h" in proc.stdout


def test_bench_times_the_retraced_step_too(tmp_path):
    """--no-capture-step: the lazy step traced in Python every time, in this process."""
    result = bench.run(bench.BenchConfig(presets=("sudoku-mlp",), tiny=True, capture_step=False, steps=1,
                                         warmup=1, data_batches=2, json=str(tmp_path / "bench.json"),
                                         device_time="mfu"))
    record = result["records"][0]
    assert result["capture_step"] is False
    assert record["host_ms_per_step"] > 0 and record["trace_ms_per_step"] > 0
    assert record["compiles_in_timed_steps"] == 0 and record["transfers_from_device_per_step"] == 0
    assert record["eval_host_ms_per_step"] > 0 and record["eval_compiles_in_timed_steps"] == 0
    assert json.loads((tmp_path / "bench.json").read_text())["records"][0]["preset"] == "sudoku-mlp"


def test_bench_fails_naming_the_preset_and_step_whose_loss_is_not_finite(tmp_path, monkeypatch, capsys):
    """A NaN in the metrics of the first timed step (step 3 after 2 warmup steps): the table and
    the JSON still come out, then bench.py exits non-zero naming the preset and the step."""
    real_step, calls = Trainer.step, []

    def nan_at_step_3(self, batch, lr, puzzle_emb_lr):
        calls.append(lr)
        metrics = real_step(self, batch, lr, puzzle_emb_lr)
        return metrics * float("nan") if len(calls) == 3 else metrics

    monkeypatch.setattr(Trainer, "step", nan_at_step_3)
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit, match=r"error: the training loss is not finite: sudoku-mlp at step 3 of 4 "
                                         r"\(2 warmup\): loss nan"):
        bench.main(["--tiny", "--presets", "sudoku-mlp", "--steps", "2", "--warmup", "2", "--data-batches", "2",
                    "--json", str(out), "--device-time", "mfu"])
    assert calls == [PRESETS["sudoku-mlp"][1].optim.lr] * 4  # the preset's lr after warmup
    losses = [s["loss"] for s in json.loads(out.read_text())["records"][0]["steps"]]
    assert math.isnan(losses[2]) and all(math.isfinite(loss) for i, loss in enumerate(losses) if i != 2)
    assert f"wrote {out}" in capsys.readouterr().out
