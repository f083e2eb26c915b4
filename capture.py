"""The training step traced once into one XLA computation and replayed every step.

Lazy tensors re-trace the whole step in Python every step, which takes far longer than the step
takes on a TPU (README, Speed). Here the unchanged project code (TRM forward, loss, backward,
AdamATan2, SignSGD, EMA, carry sharding) runs once on placeholder tensors; the resulting graph
is lowered to an HLO computation (torch_xla's LoweringContext, as torch_xla.experimental.scan /
assume_pure_torch do). Each later step binds the real tensors to that computation (one
`_xla_user_computation` IR node), swaps the outputs into the training state, and marks the old
state buffers as donated so XLA updates them in place (same input/output aliasing as the
in-place optimizer updates).

Rules the traced step must keep (it does today):
  * everything that changes between steps is a tensor in the state, the carry, the batch or
    the lrs vector (Python floats are baked into the graph);
  * no tensor derived from a placeholder may stay alive after tracing (a sync would try to run
    it and crash the runtime: segfault in PjRtComputationClient::Execute*).
"""
import torch_xla
import torch_xla.core.xla_builder as xb

from model import Carry


class CapturedTrainStep:
    """`step(batch, lrs)` == `trainer.set_lrs(*lrs); trainer.train_step(batch)` without re-tracing.

    The computation's inputs are, in order: `trainer.state_tensors()`, the carry's tensors, the
    batch's tensors (both by sorted name) and lrs, a float32 [2] device tensor (AdamATan2 lr,
    SignSGD lr). Its outputs: the metric vector, the state tensors the step writes, the new carry.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.state = trainer.state_tensors()
        self.written = [s for s in self.state if s.written_by_step]
        self.key = None
        # Let XLA reuse the buffers we mark as donated (the old state) for the new state.
        torch_xla._XLAC._xla_set_enable_alias_with_buffer_donor_config(True)

    def _trace(self, flat):
        trainer = self.trainer
        fakes = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in flat]
        n_state, n_carry = len(self.state), len(self.carry_keys)
        saved_state, saved_carry, saved_lrs = [s.get() for s in self.state], trainer.carry, trainer.lrs()
        try:
            work = [f.clone() for f in fakes]  # clones: the placeholders stay the untouched inputs
            for s, v in zip(self.state, work):
                s.set(v)
            trainer.carry = Carry.from_tensors(dict(zip(self.carry_keys, work[n_state:n_state + n_carry])))
            lrs = work[-1]
            trainer.set_lrs(lrs[0], lrs[1])
            batch = dict(zip(self.batch_keys, work[n_state + n_carry:-1]))
            metrics = trainer.train_step(batch)
            new_carry = trainer.carry.tensors()
            outputs = [metrics] + [s.get() for s in self.written] + [new_carry[k] for k in self.carry_keys]
            ctx = torch_xla._XLAC.lowering.LoweringContext("TrainStep")
            ctx.set_name_string("train_step")
            ctx.build(outputs)
            self.computation = xb.computation_from_module_proto("train_step", ctx.hlo())
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
                    raise RuntimeError(f"the traced step reads a tensor of shape {tuple(t.shape)} that is "
                                       "not part of the training state; add it to Trainer.state_tensors")
            self.constants = params
        finally:
            for s, v in zip(self.state, saved_state):
                s.set(v)
            trainer.carry = saved_carry
            trainer.set_lrs(*saved_lrs)
            trainer.clear_gradients()

    def __call__(self, batch, lrs):
        trainer = self.trainer
        carry = trainer.carry.tensors()
        flat = [s.get() for s in self.state]
        if self.key is None:
            self.carry_keys, self.batch_keys = sorted(carry), sorted(batch)
        flat += [carry[k] for k in self.carry_keys] + [batch[k] for k in self.batch_keys] + [lrs]
        key = tuple((t.shape, t.dtype) for t in flat)
        if key != self.key:
            self._trace(flat)
            self.key = key
        inputs = [self.constants[pid] if i is None else flat[i] for pid, i in enumerate(self.flat_index)]
        outs = torch_xla._XLAC._xla_user_computation("xla::train_step", inputs, self.computation)
        n = len(self.written)
        for s, new in zip(self.written, outs[1:1 + n]):
            torch_xla._XLAC._set_buffer_donation(s.get(), True)
            s.set(new)
        trainer.carry = Carry.from_tensors(dict(zip(self.carry_keys, outs[1 + n:])))
        return outs[0]
