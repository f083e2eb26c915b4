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
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import testtime
from attention import blockwise_extra_flops
from batches import total_train_steps
from model import TRMConfig, swiglu_width
from schedule import Curriculum, run_schedule
from testtime_batches import batch_puzzles

if TYPE_CHECKING:
    from config import Config

# ----------------------------------------------------------------------------------------------
# Model FLOPs (projection.py's device time, the step line's TFLOP/s and MFU)


def block_flops(c: TRMConfig) -> int:
    """Forward FLOPs of one block for one example (2·m·n·k per matmul, nothing else counted).

    With T = seq_len + prefix positions, h = hidden_size, I = swiglu_width(h), I_T = swiglu_width(T),
    a = num_heads · (h // num_heads) the heads' total width (h, unless the heads do not divide h):
      SwiGLU over channels:      gate_up 2·T·h·2I + down 2·T·I·h              = 6·T·h·I
      attention (not mlp_t):     qkv 2·T·h·3a + scores 2·T·T·a + values 2·T·T·a + out 2·T·a·h
                                                                              = 8·T·h·a + 4·T²·a
      token-mixing SwiGLU (mlp_t, over positions for each of the h channels) = 6·h·T·I_T
    """
    T, h = c.total_len, c.hidden_size
    channel_mlp = 6 * T * h * swiglu_width(h, c.expansion)
    if c.mlp_t:
        mixing = 6 * h * T * swiglu_width(T, c.expansion)
    else:
        a = c.num_heads * (h // c.num_heads)
        mixing = 8 * T * h * a + 4 * T * T * a
    return mixing + channel_mlp


def heads_flops(c: TRMConfig) -> int:
    """Forward FLOPs of the output heads for one example: lm_head over all T positions
    (the prefix is dropped after the matmul) 2·T·h·vocab, and q_head on position 0, 2·h·2."""
    return 2 * c.total_len * c.hidden_size * c.vocab_size + 2 * c.hidden_size * 2


def recursion_counts(c: TRMConfig) -> tuple[int, int, int]:
    """(block applications of one ACT step, those of them that run backward, forward passes of
    the recursion per example in a training step): the arch's updates (recursion.py), each a
    network of some blocks. The first is the TRM paper's "effective depth per supervision step"
    (Table 1: T(n + 1)·n_layers; trm's H_cycles·(L_cycles + 1)·L_layers, 42 for sudoku-mlp, 24 for
    HRM's 2·3·4), the last its "number of forward passes (NFP) per optimization step": 2 where
    the Q-continue target needs a second pass of the recursion (HRM, "w/ ACT"), else 1."""
    scheme = c.scheme
    layers = scheme.networks(c)
    per_update = [layers[scheme.network_of(kind, c)] for kind in scheme.schedule(c)]
    target = scheme.q_continue_target(c)
    return sum(per_update), sum(per_update[-scheme.grad_updates(c):]), 2 if target else 1


def model_flops(c: TRMConfig) -> dict[str, int]:
    """Model FLOPs per example of one training step and of one evaluation ACT step.

    One ACT step applies the arch's updates (recursion.py's schedule; trm: H_cycles · (L_cycles + 1),
    each cycle L_cycles updates of z_L and one of z_H), each a network of some blocks (trm: the one
    shared network of L_layers), then the heads once: A block applications. Only the last G
    updates (trm: the last cycle, L_cycles + 1; hrm and one_step_grad: 2) and the heads run
    backward, which costs twice their forward (gradients of inputs and of weights); with G_b their
    blocks:

      eval  = A · block + heads
      train = A · block + heads + 2 · (G_b · block + heads)
              (+ A · block + heads without gradient when the Q-continue target is computed)

    Embedding lookups, norms, RoPE, activations, the loss and the optimizers are not counted
    (elementwise; SignSGD's [B, B] id-matching matmul adds 2·B·puzzle_emb_ndim per example,
    under 0.01% here). For sudoku-mlp: 21 forward applications, 7 of them with backward,
    about 43 GFLOP per example.

    "train_extra", "eval_extra" (not in MFU): the blockwise attention's own work over blocks of
    keys (T > attention_block): row sums in the forward, the scores again in the backward."""
    block, heads = block_flops(c), heads_flops(c)
    applications, with_grad, passes = recursion_counts(c)
    forward = applications * block + heads
    train_flops = forward + 2 * (with_grad * block + heads)
    target = passes == 2
    if target:
        train_flops += forward
    blocks = not c.mlp_t and c.attention == "blockwise" and c.total_len > c.attention_block
    width = c.num_heads * (c.hidden_size // c.num_heads)
    row_sums, scores_again = blockwise_extra_flops(c.total_len, width, c.num_heads) if blocks else (0, 0)
    eval_extra = applications * row_sums
    train_extra = eval_extra * (2 if target else 1) + with_grad * scores_again
    return {"train": train_flops, "eval": forward, "train_extra": train_extra, "eval_extra": eval_extra}


def stage_flops(c: TRMConfig, cycles: tuple[int, int]) -> dict[str, int]:
    """`model_flops` of the model recursing with (H_cycles, L_cycles) = `cycles`: a stage of the
    recursion curriculum (schedule.Curriculum), whose steps recurse with fewer cycles than the
    model's (the first stage of contrib01's Sudoku curriculum, (1, 2), costs 1/7 of (3, 6)'s)."""
    return model_flops(dataclasses.replace(c, H_cycles=cycles[0], L_cycles=cycles[1]))


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


# ----------------------------------------------------------------------------------------------
# TPU generations and slices

PEAK_TFLOPS_PER_CHIP = {"v4": 275.0, "v5e": 197.0, "v5p": 459.0, "v6e": 918.0}  # bf16 dense, Google's figures
"""Peak bf16 TFLOP/s of one chip per TPU generation (v5p: docs.cloud.google.com/tpu/docs/v5p-training).
A chip is one PyTorch/XLA device on each of them (the two TensorCores of a v4 or v5p chip are one
megacore device), so this is also the peak per device."""

# The runtime's device kind (PJRT's name, e.g. "TPU v4"; v5e calls itself "TPU v5 lite", v5p
# "TPU v5", v6e "TPU v6 lite") -> the generation of PEAK_TFLOPS_PER_CHIP.
_KIND_GENERATIONS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5litepod": "v5e",
                     "tpu v5": "v5p", "tpu v5p": "v5p", "tpu v6 lite": "v6e", "tpu v6e": "v6e"}


def peak_tflops_per_device(device_kind: str | None) -> float | None:
    """bf16 peak TFLOP/s of one device of this kind ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v6
    lite"), or None for any other kind (CPU, an unknown TPU): no peak, so no MFU."""
    generation = _KIND_GENERATIONS.get((device_kind or "").strip().lower())
    return PEAK_TFLOPS_PER_CHIP[generation] if generation else None


@dataclass(frozen=True)
class SliceSpec:
    name: str
    generation: str
    chips: int
    hosts: int
    peak_tflops_per_chip: float

    @property
    def peak_tflops(self) -> float:
        return self.chips * self.peak_tflops_per_chip


def slice_spec(name: str) -> SliceSpec:
    """Chips and hosts of a slice from its name, as Cloud TPU names them.

    v4-N and v5p-N count TensorCores (2 per chip): N/2 chips, 4 chips per host (v4-8: 1 host,
    v4-64: 32 chips on 8 hosts). v5e-N and v6e-N count chips: a slice of up to 8 chips is one
    host, larger ones have 4 chips per host. Peak per chip (bf16): v4 275, v5e 197, v5p 459, v6e
    918 TFLOP/s.
    """
    match = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", name.strip().lower())
    if not match:
        raise ValueError(f"unknown TPU slice {name!r}: use v4-N, v5e-N, v5p-N or v6e-N (e.g. v4-64, v5e-16, v6e-8)")
    generation, n = match.group(1), int(match.group(2))
    if generation in ("v4", "v5p"):
        if n < 8 or n % 8:
            raise ValueError(f"{name}: a {generation} slice counts TensorCores, a multiple of 8 "
                             f"({generation}-8, {generation}-16, ...)")
        chips = n // 2
        hosts = chips // 4
    else:
        if n < 1:
            raise ValueError(f"{name}: a slice has at least one chip")
        chips = n
        hosts = 1 if n <= 8 else -(-n // 4)
    return SliceSpec(name.strip().lower(), generation, chips, hosts, PEAK_TFLOPS_PER_CHIP[generation])


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
                   (K: eval.trajectories, ptrm.py),
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
    # At K trajectories per puzzle (ptrm.py; eval.trajectories' last K, as training takes it) each
    # host's rows of a batch hold (global_batch / hosts) // K whole puzzles (testtime_batches); at
    # K=1 a batch is the global batch's puzzles, one row each.
    setting = testtime.training_eval_setting(config.eval, model.halt_max_steps)
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
