"""What a TRM run costs on a Cloud TPU slice, without running it: the slices (chips, hosts, the
bf16 peak of each generation), the device time of a step's model FLOPs at a given MFU, the
paper datasets' sizes, and a whole recipe's projected hours. bench.py adds its measurements of
the host to these projections, study.py plans a study's device-hours with them, and the step
line's MFU reads the peaks (`peak_tflops_per_device`). All of them count a step by its model
FLOPs (`model_flops`, from the model's shapes).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from data import total_train_steps
from testtime import settings as testtime_settings
from testtime.batches import batch_puzzles
from tpu_costs.slices import SliceSpec, slice_spec
from training.model_flops import model_flops, stage_flops
from training.schedule import Curriculum, run_schedule

if TYPE_CHECKING:
    from training.config import Config

def train_stages(config: Config, metadata, last_step: int, first_step: int = 1) -> list[tuple[tuple[int, int], int]]:
    """((H_cycles, L_cycles), steps) of each stage the training steps first_step..last_step
    recurse in (schedule.Curriculum.stage_steps; one stage, the model's cycles, without a
    curriculum); `metadata`: the train split's sizes (data.Metadata or a PaperDataset), which
    place the curriculum's epochs in steps."""
    full_steps = total_train_steps(metadata, config.optim.epochs, config.optim.global_batch_size)
    return Curriculum(config, full_steps).stage_steps(first_step, last_step)


def train_flops_of(config: Config, stages: list[tuple[tuple[int, int], int]]) -> int:
    """Model FLOPs of the training steps of `stages` (`train_stages`) over the whole global batch."""
    return sum(stage_flops(config.model, cycles)["train"] * steps for cycles, steps in stages) \
        * config.optim.global_batch_size


def projected_ms(flops_per_example: int, global_batch: int, spec: SliceSpec) -> float:
    """Milliseconds for `global_batch` examples at 100% of the slice's peak."""
    return flops_per_example * global_batch / (spec.peak_tflops * 1e12) * 1e3


# ----------------------------------------------------------------------------------------------
# The paper's datasets


@dataclass(frozen=True)
class PaperDataset:
    """A preset's real dataset as the reference's builder writes it: the sizes a paper run
    trains and evaluates on (the projection reads them; the measured steps use synthetic data)."""

    name: str
    """The reference builder's output directory."""
    total_groups: int
    """Groups of the train split (an epoch draws one puzzle of each)."""
    mean_puzzle_examples: float
    """Examples per puzzle of the train split (an epoch's examples per group)."""
    test_examples: int
    """Examples of the test split (an evaluation reads them all, unless eval.max_examples)."""
    puzzle_identifiers: int
    """Rows of the puzzle-embedding table (num_puzzle_identifiers, <blank> included)."""
    source: str
    """Where the numbers come from."""


_SUDOKU = PaperDataset(
    "sudoku-extreme-1k-aug-1000", 1000, 1.0, 423_000, 1,
    "1000 groups of 1001 one-example puzzles (build_sudoku_dataset.py --subsample-size 1000 --num-aug 1000); "
    "test: the whole Sudoku-Extreme test set, which the builder writes without augmentation: 423k puzzles (rounded)")
_ARC_SOURCE = ("counted by running build_data.py's ARC variant drawing (byte-equal to the reference's "
               "build_arc_dataset.py, seed 42, 1000 augmentations) on the reference repository's "
               "kaggle/combined files; test: the test pairs of every variant of the test set's tasks")
PAPER_DATASETS: dict[str, PaperDataset] = {
    "sudoku-mlp": _SUDOKU,
    "sudoku-att": _SUDOKU,
    "maze": PaperDataset("maze-30x30-hard-1k", 1000, 1.0, 1000, 1,
                         "build_maze_dataset.py defaults: 1000 train and 1000 test mazes, no augmentation"),
    # 960 tasks; 876,405 puzzles (tasks with few colours or symmetries have fewer than 1000
    # distinct augmentations) holding 3,633,410 train examples
    "arc1": PaperDataset("arc1concept-aug-1000", 960, 3_633_410 / 876_405, 385_815, 876_406,
                         "subsets training evaluation concept, test set evaluation; " + _ARC_SOURCE),
    # 1280 tasks; 1,191,729 puzzles holding 5,163,277 train examples
    "arc2": PaperDataset("arc2concept-aug-1000", 1280, 5_163_277 / 1_191_729, 170_393, 1_191_730,
                         "subsets training2 evaluation2 concept, test set evaluation2; " + _ARC_SOURCE),
}
PAPER_DATASETS.update({"urm-arc1": PAPER_DATASETS["arc1"], "urm-arc2": PAPER_DATASETS["arc2"],
                       "urm-sudoku": _SUDOKU, "eqr-sudoku": _SUDOKU,  # the successors train on the same datasets
                       "eqr-maze": PaperDataset("maze-30x30-unique-1k", 1000, 1.0, 1000, 1,
                                                "build_data.py build-maze-unique defaults (EqR's recipe): 1000 "
                                                "train and 1000 test perfect mazes, no augmentation")})


def project_paper_run(record: dict, config: Config, dataset: PaperDataset, mfu: float) -> dict:
    """Wall time of the preset's whole recipe on the record's slice, from its measured host
    times and its device time at `mfu` of the slice's peak; each step takes the longer of the
    two (the host dispatches a step while the device runs the one before).

      train steps  schedule.run_schedule (epochs x total_groups x mean_puzzle_examples / global batch,
                   or optim.max_steps if fewer)
      evaluations  schedule.run_schedule's evaluation steps, the final one included; each reads
                   ceil(examples / puzzles per batch) batches (examples: the whole test split, or
                   eval.max_examples of it except in the final one), a batch holding
                   the global batch's puzzles, or at K > 1 hosts x ((global batch / hosts) // K)
                   (K: eval.trajectories, testtime/noisy_trajectories.py),
                   D ACT steps each (eval.act_steps; the model's halt_max_steps)
      checkpoints  every run.ckpt_every steps and the final one (checkpoint.Checkpoints), each
                   pausing the loop for checkpoint_pause_ms
    Not counted: start-up, compiles, the evaluation's other host work (reading predictions,
    ARC votes), restarts. A record without host times (--flops-only) counts device time only.
    """
    optim, model = config.optim, config.model
    global_batch = optim.global_batch_size
    # The run's steps and evaluations as train.py schedules them (optim.max_steps included): the
    # dataset's two size fields are all the schedule reads.
    train_steps, evaluation_at = run_schedule(dataset, optim, config.eval.every_epochs)
    capped = min(dataset.test_examples, config.eval.max_examples or dataset.test_examples)
    # At K trajectories per puzzle (noisy_trajectories.py; eval.trajectories' last K, as training takes it) each
    # host's rows of a batch hold (global_batch / hosts) // K whole puzzles (testtime_batches); at
    # K=1 a batch is the global batch's puzzles, one row each.
    setting = testtime_settings.training_eval_setting(config.eval, model.halt_max_steps)
    hosts = slice_spec(record["slice"]).hosts
    puzzles_per_batch = batch_puzzles(global_batch, setting.k, hosts)
    eval_batches = (len(evaluation_at) - 1) * math.ceil(capped / puzzles_per_batch) \
        + math.ceil(dataset.test_examples / puzzles_per_batch)
    eval_act_steps = eval_batches * setting.act_steps
    checkpoints = (train_steps - 1) // config.run.ckpt_every + 1
    # Device time: the compiled TPU program's estimate where the record has one (tpu_compile.py,
    # `compiled_ms_per_*_step`, and each curriculum stage's `compiled_ms_per_train_stage`), else
    # the model FLOPs at `mfu` of the slice's peak. A curriculum's stages are priced each by its
    # own program (or FLOPs): its first stages recurse with fewer cycles.
    eval_device_ms = record.get("compiled_ms_per_eval_step") or record["projected_device_ms_per_eval_step"] / mfu
    stages = []
    for cycles, steps in train_stages(config, dataset, train_steps):
        device_ms = stage_device_ms(record, config, cycles, mfu)
        stages.append({"cycles": list(cycles), "steps": steps, "device_ms_per_step": device_ms,
                       "ms_per_step": max(record.get("host_ms_per_step", 0.0), device_ms)})
    train_step_ms = sum(s["steps"] * s["ms_per_step"] for s in stages) / max(1, train_steps) if stages else \
        max(record.get("host_ms_per_step", 0.0), stage_device_ms(record, config, None, mfu))
    eval_step_ms = max(record.get("eval_host_ms_per_step", 0.0), eval_device_ms)
    pause_ms = record.get("checkpoint_pause_ms", 0.0)
    train_h = train_steps * train_step_ms / 3.6e6
    eval_h = eval_act_steps * eval_step_ms / 3.6e6
    checkpoint_h = checkpoints * pause_ms / 3.6e6
    return {
        "dataset": dataclasses.asdict(dataset), "mfu": mfu, "slice": record["slice"],
        "device_time_source": record["compiled_source"] if "compiled_ms_per_train_step" in record
        else f"model FLOPs at {mfu:.0%} MFU (assumed)",
        "train_steps": train_steps, "train_ms_per_step": train_step_ms, "train_hours": train_h,
        "train_stages": stages,
        "evaluations": len(evaluation_at), "eval_batches": eval_batches, "eval_act_steps": eval_act_steps,
        "eval_ms_per_act_step": eval_step_ms, "eval_hours": eval_h,
        # one evaluation of the whole test split at K (`train.py eval --eval.trajectories K`)
        "trajectories": setting.k, "act_steps": setting.act_steps,
        "eval_ms_per_puzzle": setting.act_steps * eval_step_ms / puzzles_per_batch,
        "test_eval_hours": math.ceil(dataset.test_examples / puzzles_per_batch) * setting.act_steps
        * eval_step_ms / 3.6e6,
        "checkpoints": checkpoints, "checkpoint_pause_ms": pause_ms, "checkpoint_minutes": checkpoint_h * 60,
        "total_hours": train_h + eval_h + checkpoint_h,
    }


def cycles_key(cycles: tuple[int, int]) -> str:
    """A curriculum stage's name in records: "H_cycles,L_cycles" ("1,2")."""
    return f"{cycles[0]},{cycles[1]}"


def stage_device_ms(record: dict, config: Config, cycles: tuple[int, int] | None, mfu: float) -> float:
    """Device milliseconds of one training step recursing with `cycles` (None: the model's): the
    record's compiled estimate of that stage's program (`compiled_ms_per_train_stage`, or
    `compiled_ms_per_train_step` for the model's own cycles) where it has one, else the stage's
    model FLOPs at `mfu` of the slice's peak (the record's `projected_device_ms_per_train_step`, at
    the model's cycles, scaled by the stage's share of its FLOPs)."""
    model = config.model
    final = (model.H_cycles, model.L_cycles)
    cycles = cycles or final
    compiled = record.get("compiled_ms_per_train_stage", {}).get(cycles_key(cycles))
    if compiled is None and cycles == final:
        compiled = record.get("compiled_ms_per_train_step")
    if compiled:
        return compiled
    share = 1.0 if cycles == final else stage_flops(model, cycles)["train"] / model_flops(model)["train"]
    return record["projected_device_ms_per_train_step"] * share / mfu


def flop_record(preset: str, config: Config, spec: SliceSpec) -> dict:
    flops = model_flops(config.model)
    global_batch = config.optim.global_batch_size
    return {
        "preset": preset,
        "model": dataclasses.asdict(config.model),
        "global_batch_size": global_batch,
        "train_gflop_per_example": flops["train"] / 1e9,
        "eval_gflop_per_example": flops["eval"] / 1e9,
        "train_tflop_per_global_step": flops["train"] * global_batch / 1e12,
        "slice": spec.name,
        "slice_chips": spec.chips,
        "slice_hosts": spec.hosts,
        "peak_tflops_per_chip": spec.peak_tflops_per_chip,
        "projected_device_ms_per_train_step": projected_ms(flops["train"], global_batch, spec),
        "projected_device_ms_per_eval_step": projected_ms(flops["eval"], global_batch, spec),
    }


# ----------------------------------------------------------------------------------------------
# What a run's compiled TPU programs say it costs
#
# What a run's compiled TPU programs say it costs: the programs a run compiles (its evaluation
# step, and the training step of each recursion curriculum stage it trains in: each stage recurses
# with its own cycles, a program of its own), and the device-time fields a projection reads from
# their compiled results (run_costs.project_paper_run). study.py plan and bench.py compile with
# tpu_compile.py and price with these.


def stage_config(config: Config, cycles: tuple[int, int]) -> Config:
    """The configuration whose training step is a recursion curriculum stage's program: the model
    recursing with (H_cycles, L_cycles) = `cycles`, the curriculum off. A stage's steps run the
    run's model with its config's cycles replaced (trainer.Trainer.recursing): the same
    parameters and state, and the same program as a run of those cycles."""
    model = dataclasses.replace(config.model, H_cycles=cycles[0], L_cycles=cycles[1])
    return dataclasses.replace(config, model=model, optim=dataclasses.replace(config.optim, curriculum_epochs=0))


def run_programs(config: Config, metadata) -> list[tuple[Config, tuple[str, ...]]]:
    """(config, programs) of every program a run compiles: its evaluation step (always at the
    model's cycles), and the training step of each recursion curriculum stage its steps train in
    (`stage_config`; one, the model's, without a curriculum). `metadata`: the train split's sizes
    (data.Metadata or run_costs.PaperDataset), which place the stages in steps."""
    last = run_schedule(metadata, config.optim, config.eval.every_epochs)[0]
    final = (config.model.H_cycles, config.model.L_cycles)
    stages = [cycles for cycles, _ in train_stages(config, metadata, last)] or [final]
    return [(config, ("train_step", "eval_step") if final in stages else ("eval_step",))] + \
        [(stage_config(config, cycles), ("train_step",)) for cycles in stages if cycles != final]


def device_time_fields(results: list[dict], cycles: tuple[int, int] | None = None) -> dict:
    """A projection record's device time of each step from a run's compiled results
    (run_costs.project_paper_run reads these keys): compiled_ms_per_eval_step,
    compiled_ms_per_train_step (at the run's model `cycles`; None: the first training step's),
    compiled_ms_per_train_stage ({"H,L": ms} of each recursion curriculum stage's training step),
    compiled_source, and `refused` (the programs the compiler refused, each left out)."""
    fields, stages = {}, {}
    for r in results:
        if not r["compiled"]:
            continue
        if r["program"] == "eval_step":
            fields["compiled_ms_per_eval_step"] = r["estimate_ms"]
            continue
        stages[cycles_key(r["cycles"])] = r["estimate_ms"]
        if cycles is None and "compiled_ms_per_train_step" not in fields or cycles is not None \
                and tuple(r["cycles"]) == tuple(cycles):
            fields["compiled_ms_per_train_step"] = r["estimate_ms"]
    if len(stages) > 1 or stages and "compiled_ms_per_train_step" not in fields:
        fields["compiled_ms_per_train_stage"] = stages
    compiled = next((r for r in results if r["compiled"]), None)
    fields["compiled_source"] = ("compiled TPU program: " + compiled["estimate_source"]) if compiled else \
        "not compiled: " + results[0].get("error", "")[:200]
    fields["refused"] = [r["program"] + (f" (H_cycles {r['cycles'][0]} L_cycles {r['cycles'][1]})"
                                         if r["program"] == "train_step" else "")
                         for r in results if not r["compiled"]]
    return fields


def eval_ms_per_puzzle(result: dict) -> float | None:
    """An evaluation program's device time per test puzzle: D ACT steps (eval.act_steps; the
    model's halt_max_steps) of the estimated step time over the batch's puzzles (global_batch_size // K)."""
    if not result.get("compiled") or not result.get("puzzles_per_batch"):
        return None
    return result["estimate_ms"] * result.get("act_steps", result["halt_max_steps"]) / result["puzzles_per_batch"]
