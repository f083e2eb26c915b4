"""What a run's compiled TPU programs say it costs: the programs a run compiles (its evaluation
step, and the training step of each recursion curriculum stage it trains in: each stage recurses
with its own cycles, a program of its own), and the device-time fields a projection reads from
their compiled results (projection.project_paper_run). study.py plan and bench.py compile with
tpu_compile.py and price with these.
"""
from __future__ import annotations

import dataclasses

from config import Config
from projection import cycles_key, train_stages
from schedule import run_schedule


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
    (data.Metadata or projection.PaperDataset), which place the stages in steps."""
    last = run_schedule(metadata, config.optim, config.eval.every_epochs)[0]
    final = (config.model.H_cycles, config.model.L_cycles)
    stages = [cycles for cycles, _ in train_stages(config, metadata, last)] or [final]
    return [(config, ("train_step", "eval_step") if final in stages else ("eval_step",))] + \
        [(stage_config(config, cycles), ("train_step",)) for cycles in stages if cycles != final]


def device_time_fields(results: list[dict], cycles: tuple[int, int] | None = None) -> dict:
    """A projection record's device time of each step from a run's compiled results
    (projection.project_paper_run reads these keys): compiled_ms_per_eval_step,
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
