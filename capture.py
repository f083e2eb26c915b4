"""The training step traced once into one XLA computation and replayed every step.

Lazy tensors re-trace the whole step in Python every step (~100-200 ms for TRM). Here the
unchanged project code (TRM forward, loss, backward, AdamATan2, SignSGD, EMA, carry sharding)
runs once on placeholder tensors; the resulting graph is lowered to an HLO computation
(torch_xla's LoweringContext, as torch_xla.experimental.scan / assume_pure_torch do). Each later
step binds the real tensors to that computation (one `_xla_user_computation` IR node), swaps
the outputs into the training state, and marks the old state buffers as donated so XLA
updates them in place (same input/output aliasing as the in-place optimizer updates).

Rules the traced step must keep (it does today):
  * everything that changes between steps is a tensor in the state, the carry, the batch or
    the lrs vector (Python floats are baked into the graph);
  * no tensor derived from a placeholder may stay alive after tracing (a sync would try to run
    it and crash the runtime: segfault in PjRtComputationClient::Execute*).
"""
import torch
import torch_xla
import torch_xla.core.xla_builder as xb
from model import Carry


def _state_slots(tr):
    """(mutable, get, set) for every tensor of the training state except the carry, fixed order."""
    slots = []
    model = tr.model
    for p in model.parameters():
        slots.append((True, lambda p=p: p.data, lambda v, p=p: setattr(p, "data", v)))
    table = getattr(model, "puzzle_embedding", None)
    for mod in model.modules():
        for name, buf in mod._buffers.items():
            if buf is not None:
                slots.append((mod is table and name == "weight",
                              lambda m=mod, n=name: m._buffers[n],
                              lambda v, m=mod, n=name: m._buffers.__setitem__(n, v)))
    for p in model.parameters():
        st = tr.adam.state[p]
        for k in sorted(st):
            slots.append((True, lambda st=st, k=k: st[k], lambda v, st=st, k=k: st.__setitem__(k, v)))
    sh = tr.ema.shadow
    for k in sorted(sh):
        slots.append((True, lambda k=k: sh[k], lambda v, k=k: sh.__setitem__(k, v)))
    return slots


class CapturedTrainStep:
    """`step(batch, lrs)` == `tr.set_lrs(*lrs); tr.train_step(batch)` without re-tracing.

    lrs: a float32 [2] device tensor (AdamATan2 lr, SignSGD lr)."""

    def __init__(self, trainer):
        self.tr = trainer
        self.slots = _state_slots(trainer)
        self.mutable = [(get, set_) for mut, get, set_ in self.slots if mut]
        self.key = None
        # Let XLA reuse the buffers we mark as donated (the old state) for the new state.
        torch_xla._XLAC._xla_set_enable_alias_with_buffer_donor_config(True)

    def _trace(self, flat):
        tr = self.tr
        fakes = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in flat]
        n_state, n_carry = len(self.slots), len(self.carry_keys)
        saved = ([get() for _, get, _ in self.slots], tr.carry,
                 [g["lr"] for g in tr.adam.param_groups], tr.sign_sgd.lr if tr.sign_sgd else None)
        try:
            work = [f.clone() for f in fakes]  # clones: the placeholders stay the untouched inputs
            for (_, _, set_), v in zip(self.slots, work):
                set_(v)
            tr.carry = Carry.from_tensors(dict(zip(self.carry_keys, work[n_state:n_state + n_carry])))
            lrs = work[-1]
            tr.set_lrs(lrs[0], lrs[1])
            batch = dict(zip(self.batch_keys, work[n_state + n_carry:-1]))
            metrics = tr.train_step(batch)
            new_carry = tr.carry.tensors()
            outputs = [metrics] + [get() for get, _ in self.mutable] + [new_carry[k] for k in self.carry_keys]
            ctx = torch_xla._XLAC.lowering.LoweringContext("TrainStep")
            ctx.set_name_string("train_step")
            ctx.build(outputs)
            self.computation = xb.computation_from_module_proto("train_step", ctx.hlo())
            params = ctx.device_parameter_id_tensor_mapping()  # every HLO parameter: id -> tensor
            self.order = [None] * len(params)  # HLO parameter id -> index into flat, or a constant
            for i, f in enumerate(fakes):
                pid = ctx.tensor_parameter_id(f)
                if pid != -1:
                    self.order[pid] = i
                    del params[pid]
            for pid, t in params.items():  # device data made during tracing: scalar constants only
                if t.dim() != 0:
                    raise RuntimeError(f"the traced step reads a tensor of shape {tuple(t.shape)} that is "
                                       "not part of the training state; add it to the state slots")
                self.order[pid] = t
        finally:
            for (_, _, set_), v in zip(self.slots, saved[0]):
                set_(v)
            tr.carry = saved[1]
            for g, lr in zip(tr.adam.param_groups, saved[2]):
                g["lr"] = lr
            if tr.sign_sgd is not None:
                tr.sign_sgd.lr = saved[3]
                tr.sign_sgd.zero_grad()
            for p in tr.model.parameters():
                p.grad = None

    def __call__(self, batch, lrs):
        tr = self.tr
        carry = tr.carry.tensors()
        flat = [get() for _, get, _ in self.slots]
        if self.key is None:
            self.carry_keys, self.batch_keys = sorted(carry), sorted(batch)
        flat += [carry[k] for k in self.carry_keys] + [batch[k] for k in self.batch_keys] + [lrs]
        key = tuple((t.shape, t.dtype) for t in flat)
        if key != self.key:
            self._trace(flat)
            self.key = key
        inputs = [flat[i] if type(i) is int else i for i in self.order]
        outs = torch_xla._XLAC._xla_user_computation("xla::train_step", inputs, self.computation)
        n = len(self.mutable)
        for (get, set_), new in zip(self.mutable, outs[1:1 + n]):
            torch_xla._XLAC._set_buffer_donation(get(), True)
            set_(new)
        tr.carry = Carry.from_tensors(dict(zip(self.carry_keys, outs[1 + n:])))
        return outs[0]
