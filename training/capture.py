"""The training step and the evaluation ACT step, each traced once into one XLA computation and
replayed every step.

Lazy tensors re-trace the whole step in Python every step, which takes far longer than the step
takes on a TPU (README, Speed). Here the unchanged project code (TRM forward, loss, backward,
AdamATan2, SignSGD, EMA, carry sharding) runs once on placeholder tensors; the resulting graph
is lowered to an HLO computation (torch_xla's LoweringContext, as torch_xla.experimental.scan /
assume_pure_torch do). Each later step binds the real tensors to that computation (one
`_xla_user_computation` IR node), swaps the outputs into the trainer's state, and marks the old
state buffers as donated so XLA updates them in place (same input/output aliasing as the
in-place optimizer updates).

`CapturedComputation` is that machinery for any function of a flat list of tensors;
`CapturedTrainStep` and `CapturedEvalStep` bind the trainer's state, carry and inputs to it.

Rules a traced step must keep (both do today):
  * everything that changes between steps is a tensor in the state, the carry, the batch or
    the step's other tensor inputs (Python floats are baked into the graph);
  * no tensor derived from a placeholder may stay alive after tracing (a sync would try to run
    it and crash the runtime: segfault in PjRtComputationClient::Execute*).
"""
import contextlib

import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_model as xm

from model import Carry
from modeling import attention

# The blockwise attention's backward recomputes the forward's scores; without a barrier XLA
# merges the two and keeps the forward's alive until the backward (modeling/attention.py).
attention.use_barrier(xm.optimization_barrier_)


class CapturedComputation:
    """`run(flat)` == `fn(flat)` for a list of XLA tensors, traced once per list of shapes and
    dtypes and then replayed as one computation.

    `fn(values)` gets clones of placeholder tensors in the order of `flat` and returns the list
    of output tensors; it must leave nothing derived from them behind (restore what it set).
    `run` donates nothing: the caller marks inputs it replaces (`donate`) after the call.
    """

    def __init__(self, name: str, fn):
        self.name, self.fn, self.key = name, fn, None
        # Let XLA reuse the buffers we mark as donated (the old state) for the new state.
        torch_xla._XLAC._xla_set_enable_alias_with_buffer_donor_config(True)

    def _trace(self, flat):
        fakes = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in flat]
        outputs = self.fn([f.clone() for f in fakes])  # clones: the placeholders stay the untouched inputs
        ctx = torch_xla._XLAC.lowering.LoweringContext(self.name)
        ctx.set_name_string(self.name)
        ctx.build(outputs)
        del outputs
        self.computation = xb.computation_from_module_proto(self.name, ctx.hlo())
        params = ctx.device_parameter_id_tensor_mapping()  # every HLO parameter: id -> tensor
        # HLO parameter id -> the index into `flat` that feeds it, or None for a constant.
        self.flat_index: list[int | None] = [None] * len(params)
        for i, f in enumerate(fakes):
            pid = ctx.tensor_parameter_id(f)
            if pid != -1:
                self.flat_index[pid] = i
                del params[pid]
        for t in params.values():  # device data made during tracing: scalar constants only
            if t.dim() != 0:
                raise RuntimeError(f"the traced {self.name} reads a tensor of shape {tuple(t.shape)} that "
                                   "is not one of its inputs; add it to Trainer.state_tensors")
        self.constants = params

    def __call__(self, flat):
        key = tuple((t.shape, t.dtype) for t in flat)
        if key != self.key:
            self._trace(flat)
            self.key = key
        inputs = [self.constants[pid] if i is None else flat[i] for pid, i in enumerate(self.flat_index)]
        return torch_xla._XLAC._xla_user_computation(f"xla::{self.name}", inputs, self.computation)


def donate(tensor) -> None:
    """Let XLA reuse `tensor`'s buffer for an output of the next computation that reads it
    (the caller drops its reference)."""
    torch_xla._XLAC._set_buffer_donation(tensor, True)


@contextlib.contextmanager
def bound(state, values):
    """Within the block, each StateTensor of `state` holds the value at its position in `values`
    (placeholders while tracing); afterwards the tensors they held before."""
    saved = [s.get() for s in state]
    try:
        for s, v in zip(state, values):
            s.set(v)
        yield
    finally:
        for s, v in zip(state, saved):
            s.set(v)


class _CapturedStep:
    """What both captured steps share: the computation's inputs are the tensors of `state`
    (StateTensors, bound while tracing), a carry's and a batch's tensors (each by sorted name)
    and the step's other tensors, flattened in that order."""

    def __init__(self, trainer, state, name: str):
        self.trainer, self.state = trainer, state
        self.carry_keys = self.batch_keys = None
        self.computation = CapturedComputation(name, self._traced)

    def _run(self, carry: Carry, batch, extras: list) -> list:
        """The computation's outputs for these inputs (the state as it is now)."""
        tensors = carry.tensors()
        if self.carry_keys is None:
            self.carry_keys, self.batch_keys = sorted(tensors), sorted(batch)
        return self.computation([s.get() for s in self.state] + [tensors[k] for k in self.carry_keys]
                                + [batch[k] for k in self.batch_keys] + list(extras))

    def _inputs(self, work, extras: int) -> tuple:
        """(carry, batch, the `extras` last tensors) of a flat input list; its first tensors are the state's."""
        n_state, n_carry = len(self.state), len(self.carry_keys)
        return (self._carry(work[n_state:n_state + n_carry]),
                dict(zip(self.batch_keys, work[n_state + n_carry:len(work) - extras])), work[len(work) - extras:])

    def _carry(self, tensors) -> Carry:
        return Carry.from_tensors(dict(zip(self.carry_keys, tensors)))

    def _traced(self, work) -> list:
        raise NotImplementedError


class CapturedTrainStep(_CapturedStep):
    """`step(batch, lrs)` == `trainer.set_lrs(*lrs); trainer.train_step(batch)` without re-tracing.

    The computation's inputs are, in order: `trainer.state_tensors()`, the carry's tensors, the
    batch's tensors (both by sorted name) and lrs, a float32 [2] device tensor (AdamATan2 lr,
    SignSGD lr). Its outputs: the metric vector, the state tensors the step writes, the new carry.
    """

    def __init__(self, trainer):
        super().__init__(trainer, trainer.state_tensors(), "train_step")
        self.written = [s for s in self.state if s.written_by_step]

    def _traced(self, work):
        trainer = self.trainer
        saved_carry, saved_lrs = trainer.carry, trainer.lrs()
        try:
            with bound(self.state, work):
                trainer.carry, batch, (lrs,) = self._inputs(work, 1)
                trainer.set_lrs(lrs[0], lrs[1])
                metrics = trainer.train_step(batch)
                new_carry = trainer.carry.tensors()
                return [metrics] + [s.get() for s in self.written] + [new_carry[k] for k in self.carry_keys]
        finally:
            trainer.carry = saved_carry
            trainer.set_lrs(*saved_lrs)
            trainer.clear_gradients()

    def __call__(self, batch, lrs):
        outs = self._run(self.trainer.carry, batch, [lrs])
        n = len(self.written)
        for s, new in zip(self.written, outs[1:1 + n]):
            donate(s.get())
            s.set(new)
        self.trainer.carry = self._carry(outs[1 + n:])
        return outs[0]


class CapturedEvalStep(_CapturedStep):
    """`step(batch, sums)` == `metrics, preds, q_halt = trainer.eval_step(batch);
    (sums + metrics, preds, q_halt)` without re-tracing: one evaluation ACT step on
    `trainer.eval_carry` with whatever weights the model holds (training/evaluate.py swaps the EMA's in;
    the state is read, not bound, at every call).

    The computation's inputs are, in order: the model's tensors of `trainer.state_tensors()`
    (parameters and buffers), the eval carry's tensors, the batch's tensors (both by sorted
    name), sums and `trainer.eval_state()` (first_halt, training/halt_steps.py; with trajectories also
    the convergence residual's state). Its outputs: the new sums, the predicted tokens, the q_halt
    logits, the new eval_state(), the new eval carry. It writes no state and donates nothing.
    """

    def __init__(self, trainer):
        super().__init__(trainer, [s for s in trainer.state_tensors() if not s.name.startswith(("adam/", "ema/"))],
                         "eval_step")

    def _traced(self, work):
        trainer = self.trainer
        saved_carry, saved_state = trainer.eval_carry, trainer.eval_state()
        n = len(saved_state)
        try:
            with bound(self.state, work):
                trainer.eval_carry, batch, (sums, *state) = self._inputs(work, 1 + n)
                trainer.set_eval_state(state)
                metrics, preds, q_halt = trainer.eval_step(batch)
                new_carry = trainer.eval_carry.tensors()
                return [sums + metrics, preds, q_halt] + trainer.eval_state() + [new_carry[k] for k in self.carry_keys]
        finally:
            trainer.eval_carry = saved_carry
            trainer.set_eval_state(saved_state)

    def __call__(self, batch, sums):
        state = self.trainer.eval_state()
        n = len(state)
        outs = self._run(self.trainer.eval_carry, batch, [sums] + state)
        self.trainer.set_eval_state(outs[3:3 + n])
        self.trainer.eval_carry = self._carry(outs[3 + n:])
        return outs[0], outs[1], outs[2]


def program_hlo(outputs: list, donated: list, parameters: list = ()) -> tuple[bytes, list[int], list[int]]:
    """The HLO module (serialized HloModuleProto) that a sync of `outputs` would compile, without
    compiling or running it: the pending graph over its device-data inputs, each parameter
    carrying its tensor's sharding (as torch_xla's SPMD executor hands it to XLA), the
    parameter numbers of the `donated` input tensors (the buffers the executor lets XLA reuse:
    the state a captured training step replaces), and the parameter number of each tensor of
    `parameters` (-1: not an input). tpu_compile.py compiles it for a TPU."""
    ctx = torch_xla._XLAC.lowering.LoweringContext("program")
    ctx.set_name_string("program")
    ctx.build(outputs)
    donors = sorted(pid for pid in (ctx.tensor_parameter_id(t) for t in donated) if pid != -1)
    return ctx.hlo(), donors, [ctx.tensor_parameter_id(t) for t in parameters]
