"""The training state on the XLA devices and the steps that change it.

`Trainer` holds the TRM, the dense weights' optimizer (AdamATan2, or torch's Adam / AdamW),
SignSGD, the EMA and the ACT carries, and names every tensor of that state in one fixed order
(`state_tensors`): checkpoints save and restore it by those names, and training/capture.py binds it as the
inputs and outputs of the captured step.

`Trainer.train_step` and `Trainer.eval_step` are the training step and the evaluation ACT step
as plain PyTorch: by default (`run.capture_step`) each runs once, on placeholder tensors, to be
traced into one XLA computation (training/capture.py), and the computation is replayed every step after;
with capture off they are traced again every step.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model import TRM, Carry, loss_and_metrics
from modeling.device_grads import per_device_weight_grads
from testtime import noisy_trajectories
from training import halt_steps
from training.checkpoint import IncompleteCheckpointError, Shard, assign_owners, state_differences
from training.optim import EMA, SignSGD, dense_optimizer

TRAIN_METRICS = ("count", "accuracy", "exact_accuracy", "q_halt_accuracy", "steps", "lm_loss", "q_halt_loss",
                 "grad_norm")
"""The training step's metric vector: sums over the batch's halted rows (count and the rest),
the batch's summed losses, and the step's global gradient norm (`dense_grad_norm`)."""
TABLE = "model/puzzle_embedding.weight"  # the puzzle-embedding table's checkpoint name
EVAL_METRICS = ("count", "accuracy", "exact_accuracy", "q_halt_accuracy", "steps", "lm_loss", "q_halt_loss")


@dataclass(frozen=True)
class StateTensor:
    """One tensor of the training state, read and replaced through `get` and `set` (replacing,
    not copying into, so a captured step can hand over its output buffers)."""

    name: str  # checkpoint name: model/..., ema/..., adam/<param>/<key>; "" for tensors not saved
    get: Callable[[], torch.Tensor]
    set: Callable[[torch.Tensor], None]
    written_by_step: bool  # the training step updates it (weights, table, optimizer state, EMA)


def dense_grad_norm(parameters) -> torch.Tensor:
    """The global L2 norm of the gradients of `parameters` (float32, a lazy device value): the
    total norm `torch.nn.utils.clip_grad_norm_` reports, without clipping anything. The
    training step passes the dense optimizer's parameters, the dense weights; the puzzle-embedding table
    (a buffer trained by SignSGD) is not among them, so its gradient is not in the norm."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms))


class Trainer:
    """Model, optimizers, EMA and ACT carries on the XLA devices, and the steps.

    `config` is config.Config (read: model, optim, run.seed, run.capture_step). `restore` (CPU
    tensors under checkpoint names, see `named_state`) replaces the fresh state: a full
    checkpoint, or only `model/*` weights to start from.
    """

    def __init__(self, config, sharding, mesh, restore: dict[str, torch.Tensor] | None = None):
        self.config, self.sharding, self.mesh = config, sharding, mesh
        self.device = sharding.device()
        restore = restore or {}
        torch.manual_seed(config.run.seed)  # identical initial weights on every host
        model = TRM(config.model, exploration_seed=config.run.seed).train()
        restored_weights = {k: v for k, v in restore.items() if k.startswith("model/")}
        problems = state_differences({f"model/{k}": (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()},
                                     restored_weights) if restore else []
        if restore and not problems:
            model.load_state_dict({k.removeprefix("model/"): v for k, v in restored_weights.items()})
        # The puzzle table goes to the devices split by rows (`row_split`): moved with the model,
        # the whole table would first land on every device.
        table = model.puzzle_embedding.weight if config.model.puzzle_emb_ndim > 0 else None
        if table is not None:
            model.puzzle_embedding.weight = table[:0]
        self.model = model.to(self.device)
        self.row_split = set()  # names of state tensors split by rows over the mesh (not replicated)
        if table is not None:
            if config.run.shard_puzzle_table and table.shape[0] >= mesh.size():
                self.model.puzzle_embedding.weight = sharding.rows_to_device(table, mesh)
                self.row_split.add(TABLE)
            else:
                self.model.puzzle_embedding.weight = table.to(self.device)
        optim = config.optim
        # The dense weights' optimizer (optim.optimizer; AdamATan2 in the paper's recipes).
        self.dense = dense_optimizer(self.model.parameters(), optim.optimizer, betas=(optim.beta1, optim.beta2),
                                    weight_decay=optim.weight_decay)
        self.sign_sgd = (SignSGD(self.model.puzzle_embedding, weight_decay=optim.puzzle_emb_weight_decay)
                         if config.model.puzzle_emb_ndim > 0 else None)
        self.ema = EMA(self.model, rate=optim.ema_rate)
        self.carry: Carry | None = None
        self.eval_carry: Carry | None = None
        self.first_halt: torch.Tensor | None = None  # [B] int32: each eval row's first halting step (halt_steps.py)
        # With trajectories, each eval row's last logits [B, T, V] float32 and its running sum of the
        # convergence residual [B] (noisy_trajectories.Trajectories.residual_step): EqR's conv selection
        self.residual_logits: torch.Tensor | None = None
        self.residual_sum: torch.Tensor | None = None
        self.trajectories = None  # noisy_trajectories.Trajectories of the evaluation ACT step; None: one, no noise
        self.act_steps: int | None = None  # D, ACT steps per evaluation batch; None: model.halt_max_steps
        self.captured_train = self.captured_eval = None  # training/capture.py's steps, made at first use
        self.captured_cycles = None  # the (H_cycles, L_cycles) captured_train recurses with
        if len(restored_weights) < len(restore):  # a whole checkpoint, not only weights to start from
            problems += self._restore_differences(restore)
        if problems:
            raise IncompleteCheckpointError("the checkpoint does not hold this run's training state "
                                            f"({len(problems)} difference(s)):\n  " + "\n  ".join(problems))
        for name, tensor in self.named_state().items():
            if name in restore and not name.startswith("model/"):
                tensor.data = restore[name].to(self.device)
        for name, tensor in self.named_state().items():
            if name not in self.row_split:
                sharding.replicate(tensor, mesh)
        if "carry/rng_counter" in restore:
            host_rows = {k.removeprefix("carry/"): v for k, v in restore.items()
                         if k.startswith("carry/") and v.ndim}
            restored = self.sharding.host_batch_to_global(host_rows, mesh)
            restored["rng_counter"] = sharding.replicate(restore["carry/rng_counter"].to(self.device), mesh)
            self.restored_carry = Carry.from_tensors(restored)
        else:
            self.restored_carry = None

    def _restore_differences(self, restore: dict[str, torch.Tensor]) -> list[str]:
        """How a checkpoint's optimizer state, EMA and carry differ from this state's."""
        expected = {n: (tuple(t.shape), t.dtype) for n, t in self.named_state().items() if not n.startswith("model/")}
        problems = state_differences(expected, {k: v for k, v in restore.items()
                                                if not k.startswith(("model/", "carry/"))})
        carry_fields = [f"carry/{f.name}" for f in dataclasses.fields(Carry) if f.name != "current_data"]
        problems += [f"missing: {name}" for name in carry_fields if name not in restore]
        if not any(k.startswith("carry/current_data.") for k in restore):
            problems.append("missing: carry/current_data.*")
        return problems

    def state_tensors(self) -> list[StateTensor]:
        """Every tensor a training step reads or writes besides the carry, the batch and the
        learning rates, in an order that is the same on every host and every launch:
        parameters, buffers, the dense optimizer's state, the EMA."""
        model, state = self.model, []
        for name, p in model.named_parameters():
            state.append(StateTensor(f"model/{name}", lambda p=p: p.data, lambda v, p=p: setattr(p, "data", v), True))
        saved_buffers = set(model.state_dict(keep_vars=True))
        for module_name, module in model.named_modules():
            for name, _ in module.named_buffers(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                state.append(StateTensor(
                    f"model/{full}" if full in saved_buffers else "",
                    lambda m=module, n=name: getattr(m, n), lambda v, m=module, n=name: setattr(m, n, v),
                    full == "puzzle_embedding.weight"))  # SignSGD writes the table; other buffers are fixed
        for name, p in model.named_parameters():
            adam = self.dense.state[p]
            for key in sorted(adam):
                state.append(StateTensor(f"adam/{name}/{key}", lambda s=adam, k=key: s[k],
                                         lambda v, s=adam, k=key: s.__setitem__(k, v), True))
        shadow = self.ema.shadow
        for name in sorted(shadow):
            state.append(StateTensor(f"ema/{name}", lambda n=name: shadow[n],
                                     lambda v, n=name: shadow.__setitem__(n, v), True))
        return state

    def named_state(self) -> dict[str, torch.Tensor]:
        """Every saved tensor of the training state under its checkpoint name (not the carries)."""
        return {s.name: s.get() for s in self.state_tensors() if s.name}

    def checkpoint_shards(self, host: int, layout=None, row_split: bool = True) -> dict[str, Shard]:
        """Host `host`'s share of the state, copied to the CPU: the replicated tensors it owns,
        its rows of the carry and of the row-split puzzle table, read from its own devices
        (left out with row_split=False: bench.py times that copy apart). `layout`: the slice's
        sharding.DeviceLayout unless given (bench.py's hypothetical slices)."""
        layout = layout or self.sharding.device_layout()
        hosts = len(layout.hosts)

        def rows_of_host(t: torch.Tensor) -> Shard:
            start, rows = self.sharding.host_rows(t, host, layout)
            return Shard(rows, tuple(t.shape), start)

        state = self.named_state()
        replicated = {n: t for n, t in state.items() if n not in self.row_split}
        owners = assign_owners({n: t.numel() * t.element_size() for n, t in replicated.items()}, hosts)
        shards = {n: Shard(self.sharding.local_copy(t), tuple(t.shape)) for n, t in replicated.items()
                  if owners[n] == host}
        shards.update({n: rows_of_host(state[n]) for n in self.row_split if row_split})
        for name, t in self.carry.tensors().items():
            if t.ndim == 0:
                if host == 0:
                    shards[f"carry/{name}"] = Shard(self.sharding.local_copy(t), ())
            else:
                shards[f"carry/{name}"] = rows_of_host(t)
        return shards

    def init_carries(self, batch: dict[str, torch.Tensor]) -> None:
        """All-halted carries for training and evaluation, so that the first step of each
        loads its whole batch. Created before the first step (and materialised by the caller's
        sync) so that every step, the first included, traces the same graph."""
        self.carry = self.restored_carry or self._sharded_carry(self.model.initial_carry(batch))
        self.eval_carry = self._sharded_carry(self.model.initial_carry(batch))
        self.first_halt = self.sharding.shard_batch_dim(self.eval_carry.steps.clone(), self.mesh)

    def _sharded_carry(self, carry: Carry) -> Carry:
        return Carry.from_tensors({k: self.sharding.shard_batch_dim(v, self.mesh)
                                   for k, v in carry.tensors().items()})

    def step(self, batch: dict[str, torch.Tensor], lr: float, puzzle_emb_lr: float,
             cycles: tuple[int, int] | None = None) -> torch.Tensor:
        """One training step at these learning rates; returns the metric vector (lazy). `cycles`
        (H_cycles, L_cycles), the recursion curriculum's stage (schedule.Curriculum): the model
        recurses with these instead of its own; each stage is a program of its own (captured
        anew, and the last stage's dropped, when the stage changes)."""
        # Uploaded as graph inputs (device data), so a new value does not change the graph.
        lrs = torch.tensor([lr, puzzle_emb_lr], dtype=torch.float32).to(self.device)
        cycles = cycles or (self.config.model.H_cycles, self.config.model.L_cycles)
        with self.recursing(cycles):
            if self.config.run.capture_step:
                if self.captured_train is None or self.captured_cycles != cycles:
                    from training.capture import CapturedTrainStep  # imports torch_xla: not at module import

                    self.captured_train, self.captured_cycles = CapturedTrainStep(self), cycles
                return self.captured_train(batch, lrs)
            self.set_lrs(lrs[0], lrs[1])
            return self.train_step(batch)

    def recursing(self, cycles: tuple[int, int]):
        """Within the block the model recurses with (H_cycles, L_cycles) = `cycles`."""
        return self.configured(H_cycles=cycles[0], L_cycles=cycles[1])

    @contextlib.contextmanager
    def configured(self, **changes):
        """Within the block the model's config has `changes` (left as it is when it has them)."""
        config = self.model.config
        if all(getattr(config, name) == value for name, value in changes.items()):
            yield
            return
        self.model.config = dataclasses.replace(config, **changes)
        try:
            yield
        finally:
            self.model.config = config

    def set_lrs(self, lr: torch.Tensor, puzzle_emb_lr: torch.Tensor) -> None:
        for group in self.dense.param_groups:
            group["lr"] = lr
        if self.sign_sgd is not None:
            self.sign_sgd.lr = puzzle_emb_lr

    def lrs(self) -> tuple:
        """The learning rates now set (the dense optimizer's, SignSGD's or None)."""
        return self.dense.param_groups[0]["lr"], None if self.sign_sgd is None else self.sign_sgd.lr

    def clear_gradients(self) -> None:
        """Drop every gradient a step left behind (the tracing step leaves placeholders' ones)."""
        self.dense.zero_grad(set_to_none=True)
        if self.sign_sgd is not None:
            self.sign_sgd.zero_grad()

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> tuple[Carry, dict[str, torch.Tensor]]:
        """One ACT segment on the training carry and the backward of loss / global batch: the new
        carry and the metrics; the gradients are in the weights' .grad (the table's rows' in
        SignSGD's). Each dense weight's gradient is summed over its uses on each device, then once
        across the devices, in float32, as the reference's all-reduce of each param.grad sums it (device_grads.py)."""
        with per_device_weight_grads(self.model, self.mesh.size(),
                                     lambda t: self.sharding.shard_batch_dim(t, self.mesh)):
            carry, outputs = self.model(self.carry, batch)
            loss, metrics = loss_and_metrics(carry, outputs)
            (loss / self.config.optim.global_batch_size).backward()
        return carry, metrics

    def train_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One ACT segment, backward, both optimizers and the EMA; returns the metric vector
        (TRAIN_METRICS order) as a lazy device tensor, the norm of the dense gradients (of the
        loss / global batch, which the dense optimizer steps with) included: part of the same graph, read
        with the other metrics. With run.capture_step (the default) this runs once, on
        placeholders, and training/capture.py replays its traced computation after."""
        carry, metrics = self.forward_backward(batch)
        metrics["grad_norm"] = dense_grad_norm(p for group in self.dense.param_groups for p in group["params"])
        self.dense.step()
        self.dense.zero_grad(set_to_none=True)
        if self.sign_sgd is not None:
            self.sign_sgd.step()
            self.sign_sgd.zero_grad()
            if TABLE in self.row_split:  # keep the written table's annotation, as the carry's
                self.sharding.shard_batch_dim(self.model.puzzle_embedding.weight, self.mesh)
        self.ema.update(self.model)
        self.carry = self._sharded_carry(carry)
        return torch.stack([metrics[k] for k in TRAIN_METRICS])

    def eval_metric_names(self) -> tuple[str, ...]:
        """The names of the evaluation step's metric vector, in its order: EVAL_METRICS, ptrm's
        extra ones with trajectories, then the halting buckets (halt_steps.metric_names)."""
        extra = () if self.trajectories is None else noisy_trajectories.EXTRA_METRICS
        return EVAL_METRICS + extra + halt_steps.metric_names(self.eval_steps)

    @property
    def eval_steps(self) -> int:
        """D: the ACT steps an evaluation runs per batch (eval.act_steps; the model's halt_max_steps)."""
        return self.act_steps or self.config.model.halt_max_steps

    def eval_sums(self) -> torch.Tensor:
        """Zero sums of the evaluation step's metric vector, on the devices."""
        return torch.zeros(len(self.eval_metric_names())).to(self.device)

    def eval_act_step(self, batch: dict[str, torch.Tensor],
                      sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One evaluation ACT step (`eval_step`) with its metric vector added to `sums`:
        (sums + metrics, predictions, q_halt logits), all lazy. With run.capture_step the step
        is traced once and replayed (training/capture.py), else traced again every call."""
        self._residual_state(batch)
        if self.config.run.capture_step:
            if self.captured_eval is None:
                from training.capture import CapturedEvalStep  # imports torch_xla: not at module import

                self.captured_eval = CapturedEvalStep(self)
            return self.captured_eval(batch, sums)
        metrics, predictions, q_halt = self.eval_step(batch)
        return sums + metrics, predictions, q_halt

    def _residual_state(self, batch: dict[str, torch.Tensor]) -> None:
        """With trajectories, zero convergence-residual state (residual_logits, residual_sum) of
        the batch's rows when there is none of its shape (a row's step 1 starts its sum over, so
        these zeros are never read as a previous step's)."""
        if self.trajectories is None:
            return
        rows, length = batch["inputs"].shape
        shape = (rows, length, self.config.model.vocab_size)
        if self.residual_logits is None or tuple(self.residual_logits.shape) != shape:
            zeros = lambda *s: self.sharding.shard_batch_dim(torch.zeros(s, dtype=torch.float32, device=self.device),
                                                             self.mesh)
            self.residual_logits, self.residual_sum = zeros(*shape), zeros(rows)

    def eval_state(self) -> list[torch.Tensor]:
        """The per-row tensors the evaluation ACT step reads and writes besides the carry:
        first_halt, and with trajectories residual_logits and residual_sum."""
        return [self.first_halt] + ([] if self.trajectories is None else [self.residual_logits, self.residual_sum])

    def set_eval_state(self, tensors: list[torch.Tensor]) -> None:
        """Put eval_state()'s tensors back (in its order)."""
        self.first_halt = tensors[0]
        if self.trajectories is not None:
            self.residual_logits, self.residual_sum = tensors[1:]

    def set_evaluation(self, trajectories, act_steps: int | None = None) -> None:
        """Evaluate with K noisy trajectories per puzzle (a noisy_trajectories.Trajectories; its batches are
        testtime_batches') or, with None, one per puzzle as the reference does; for D = act_steps
        ACT steps per batch (None: the model's halt_max_steps). A new value is a new evaluation
        program: the captured one is traced again at its next call."""
        act_steps = None if act_steps == self.config.model.halt_max_steps else act_steps
        if (trajectories, act_steps) != (self.trajectories, self.act_steps):
            self.trajectories, self.act_steps, self.captured_eval = trajectories, act_steps, None

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ACT step in eval mode on the persistent eval carry: the metric vector of rows
        that halted (`eval_metric_names` order), the predicted tokens and the q_halt logits; each
        row's first halting step (`first_halt`) follows the carry. With
        `trajectories`, every row holds its puzzle's chosen trajectory's outputs and the
        metrics count each puzzle once (noisy_trajectories.Trajectories.select)."""
        trajectories, model = self.trajectories, self.model
        # D ACT steps: the rows halt (and the next batch loads) at step D instead of halt_max_steps
        with self.configured(halt_max_steps=self.eval_steps):
            carry, outputs = model(self.eval_carry, batch,
                                   perturb=None if trajectories is None else trajectories.perturb)
        self.eval_carry = self._sharded_carry(carry)
        extra = []
        if trajectories is not None:  # best-Q's outputs; mode, pass@K, conv (noisy_trajectories.EXTRA_METRICS)
            logits, total = trajectories.residual_step(self.residual_logits, self.residual_sum, outputs["logits"],
                                                       carry.steps, self.eval_steps)
            self.residual_logits = self.sharding.shard_batch_dim(logits, self.mesh)
            self.residual_sum = self.sharding.shard_batch_dim(total, self.mesh)
            carry, outputs, extra = trajectories.select(carry, outputs,
                                                        trajectories.residual(total, self.eval_steps))
        _, metrics = loss_and_metrics(carry, outputs, halted_losses=True)
        first_halt, halts = halt_steps.first_halt_counts(self.first_halt, carry, outputs, self.eval_steps,
                                                         self.config.model.halt_score)
        self.first_halt = self.sharding.shard_batch_dim(first_halt, self.mesh)
        predictions = outputs["logits"].argmax(-1)
        vector = torch.cat([torch.stack([metrics[k] for k in EVAL_METRICS] + extra), halts])
        return vector, predictions, outputs["q_halt_logits"]
