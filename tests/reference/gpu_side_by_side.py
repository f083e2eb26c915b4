"""Ours (model.py) against each arch's own code at the presets' real sizes on a GPU, side by side:
a developer's check, never run by pytest (tests/test_archs.py, test_eqr.py and test_urm.py are the
CPU tests at tiny sizes that this one scales up).

    # On a GPU machine, from the repository's root, with .urm_src (URM's files: HEAD of
    # github.com/UbiquantAI/URM, e.g. `git --git-dir URM.git archive HEAD | tar -x -C .urm_src`)
    # and .whl (wheels of pydantic, which the TRM reference's, EqR's and URM's configs are, and
    # its dependencies: `pip download --only-binary=:all: --python-version 3.12 --platform
    # manylinux2014_x86_64 -d .whl pydantic==2.14.4`), neither committed; ~2-4 minutes on an H200
    # (the wheels unzipped where pip is missing; the JSON is rewritten after every run):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl || { mkdir -p /tmp/site; for w in .whl/*.whl; do \\
        python3 -m zipfile -e "$w" /tmp/site; done; }; PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \\
        python3 tests/reference/gpu_side_by_side.py --out $OUT/sbs.json
    # Here, on the CPU, at narrow widths (the presets' depth: cycles, layers, ACT steps; ~3 minutes):
    .venv/bin/python tests/reference/gpu_side_by_side.py --device cpu --small --out /tmp/sbs.json

What it checks. For each preset (default: sudoku-att, sudoku-mlp, arc1 with arch trm against the
vendored reference, tests/reference/models; eqr-sudoku against EqR's vendored code,
tests/reference/eqr; urm-arc1 against URM's own code, imported from --urm, default .urm_src, never
vendored: URM has no license), at the preset's hidden size, heads, layers, cycles, halt_max_steps,
seq_len, vocab and puzzle-embedding width (training/config.py's PRESETS), with its attention
setting, a puzzle table of --rows rows and a synthetic random batch (BATCH per preset; --batch):

  * the same weights in both: ours built with torch.manual_seed(0), every 2-D weight but the Q
    head's then scaled by the weight scale (q_head ~ N(0, 0.3^2), bias 0, puzzle table ~ N(0, 1),
    so that rows halt at different ACT steps, as the CPU tests do), moved into the reference's
    model by reference/weights.reference_state_dict. Weight scales (--weight-scales, default
    0.5,1): 0.5, as tests/test_eqr.py and record_urm.py, is judged; 1, the init's own scale, is
    reported as information. At the init's scale the untrained recursion amplifies rounding by
    orders of magnitude (at width 32 on a CPU: sudoku-att's float32 states 2e-5 apart after one
    ACT step, 1e-2 after seven; bfloat16 0.1 to 0.8 within one step, and each bf16 model as far
    from the float32 twin below), so that a difference there says how chaotic the untrained model
    is rather than whether the two compute the same thing; at half scale the same code at the
    same sizes is contractive (5e-7 and 2e-2 there);
  * --train-steps ACT steps in training mode (a new random batch each step: rows that halted take
    its examples; forward, the ACT loss, backward of loss / batch) then --eval-steps steps in
    evaluation mode (no gradient), exploration off in both (ours: halt_exploration_prob 0; URM's
    hard-coded 0.1 draw is answered "no" by a torch.rand_like that returns ones during its call);
  * each step: the largest absolute difference, and that difference relative to the largest
    magnitude of the reference's value, of the logits, q_halt logits, carried states (z_H, z_L;
    URM's current_hidden), the loss (ours float32, the references' float64), every parameter's
    gradient (the worst few named) and the puzzle rows' gradient; halting and steps compared;
  * float32 (forward_dtype float32, TF32 off everywhere: the equivalence check) and the preset's
    own forward_dtype, bfloat16, with each reference's own dtype handling (URM's ConvSwiGLU conv in
    bfloat16 as URM builds it: our conv weights rounded to bf16 values first, so both hold the same
    numbers). Both dtypes of the judged runs hand the reference our carry after each step (states,
    halting, steps; the informational scales' float32 runs go on independently, with no twin),
    so that every step's difference is measured from the same state instead of compounding;
    rows whose halting the two decided differently are counted. Each step is also run by a twin
    of ours from the same carry, and each model's values are compared with the twin's: in
    float32 the twin's every weight is one float32 ulp up or down at random (vs_perturbed_twin:
    how far one rounding of the weights moves a step at this size, the floor of any two float32
    implementations' difference; --no-floor runs the float32 models independently over all steps,
    without it); in bfloat16 the twin is a float32 copy of ours (vs_float32_twin: each bf16
    model's own rounding error);
  * one training ACT step of each timed (forward, loss, backward; --warmup then --repeats timed,
    synchronised; the median): informational only, not a verdict.

Verdict (exit status 1 on any failure of a judged run; the JSON holds everything): every relative
difference of every step within its bar, and (float32) halting identical. A quantity's bar is
TOL[dtype] or twice the twin's difference of it (the larger of ours' and the reference's), which
is larger. TOL float32 = 1e-4 (tests/test_archs.py's bar for another summation order at tiny
sizes); TOL bfloat16 = 5e-2 (one bf16 ulp is 3.9e-3 of a value, and a flip grows through one ACT
step's block passes: tests/test_archs.py OUTPUTS_TOL). At the presets' widths an attention
preset's step moves by 1e-4 to 4e-3 when each weight moves by one ulp (measured on an H200:
docs/faithfulness.md), so a difference at that level is rounding: ours and the references compute
the same sums in other orders (q, k, v and gate, up as separate matmuls, blockwise attention
against the fused SDPA kernel). A real bug (a wrong scale, a missing term) moves values by O(1).

Shims (none is the references' code): `flash_attn_interface.flash_attn_func` (URM's attention
imports flash-attn unconditionally, EqR's calls it on CUDA tensors) is torch's
scaled_dot_product_attention on [batch, seq, heads, head_dim] (the default scale, non-causal as
they call it); URM's ConvSwiGLU conv cast to float32 in the float32 runs (URM builds it in
bfloat16 whatever forward_dtype is); EqR's draws (its reset's truncated normals, its
torch.randn_like noise) replaced by the ones our counter hash drew, as tests/test_eqr.py's Draws
do. No torch.compile runs: nothing here compiles (URM's compiled msign is in its Muon, not
imported). Each reference's modules are imported under their own package names (`models`, ...)
and taken out of sys.modules again, so the three `models` packages do not collide.

Imports: torch, numpy, einops (the TRM reference's layers) and pydantic (the three references'
configs), nothing else outside the standard library. training/config.py imports tyro and, through
rundir/storage.py, fsspec at module level but uses them only in functions this script never calls:
where either is missing a stub module stands in. Nothing imports torch_xla.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import platform
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "reference"
sys.path.insert(0, str(ROOT))

for _name in ("tyro", "fsspec"):  # training/config.py's module-level imports, used only in its functions
    try:
        importlib.import_module(_name)
    except ImportError:
        sys.modules[_name] = types.ModuleType(_name)

import torch  # noqa: E402

from model import TRM, TRMConfig, loss_and_metrics  # noqa: E402
from modeling.schemes import SCHEMES  # noqa: E402
from reference import weights as reference_weights  # noqa: E402
from tests.reference.loading import install_flash_attn_shim, load_family  # noqa: E402
from training.config import PRESETS  # noqa: E402

TOL = {"float32": 1e-4, "bfloat16": 5e-2}
BATCH = {"sudoku-att": 128, "sudoku-mlp": 128, "maze": 32, "arc1": 32, "eqr-sudoku": 128, "eqr-maze": 32,
         "urm-sudoku": 128, "urm-arc1": 16}
"""A real per-device batch of each preset (the recipes' global 768 over 8 devices is 96; arc and
maze sequences are 900 long, URM's steps 2 x 6 x 4 block passes)."""
DEFAULT_PRESETS = ["sudoku-att", "sudoku-mlp", "arc1", "eqr-sudoku", "urm-arc1"]
SMALL = dict(hidden_size=32, num_heads=4, expansion=2.0)
"""--small: narrower widths (depth, seq_len and vocab stay the preset's); a puzzle row of 40."""
TRM_CLASSES = {"trm": "models.recursive_reasoning.trm.TinyRecursiveReasoningModel_ACTV1"}
WORST = 5  # gradients named in the report


# ----------------------------------------------------------------------------------------------
# The references' code


class Reference:
    """One arch's own code: its model in its ACTLossHead, and how its carry maps to ours."""

    family = ""

    def build(self, config: TRMConfig, batch_size: int, device: torch.device) -> torch.nn.Module:
        raise NotImplementedError

    def prepare(self, ours: TRM, theirs: torch.nn.Module) -> None:
        """Before loading our weights into theirs: dtype fix-ups."""

    def states(self, carry) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def set_states(self, carry, ours_carry) -> None:
        raise NotImplementedError

    def our_states(self, carry) -> dict[str, torch.Tensor]:
        return {"z_H": carry.z_H, "z_L": carry.z_L}

    @contextlib.contextmanager
    def step_context(self, ours: TRM, ours_carry):
        """Around one side-by-side step (ours first, then theirs)."""
        yield

    @contextlib.contextmanager
    def their_call(self, training: bool):
        yield


class TRMReference(Reference):
    family = "trm (vendored reference, tests/reference/models)"

    def __init__(self):
        (self.losses,) = load_family(REFERENCE, "models.losses")
        self.classes = {}
        for arch, path in TRM_CLASSES.items():
            module, name = path.rsplit(".", 1)
            self.classes[arch] = getattr(load_family(REFERENCE, module)[0], name)

    def build(self, config, batch_size, device):
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        with torch.device(device):
            return self.losses.ACTLossHead(self.classes[config.arch](dict(fields, batch_size=batch_size)),
                                           "stablemax_cross_entropy")

    def states(self, carry):
        return {"z_H": carry.inner_carry.z_H, "z_L": carry.inner_carry.z_L}

    def set_states(self, carry, ours_carry):
        carry.inner_carry.z_H = ours_carry.z_H.clone()
        carry.inner_carry.z_L = ours_carry.z_L.clone()


class EqRReference(Reference):
    family = "eqr (EqR's vendored code, tests/reference/eqr)"

    def __init__(self):
        self.eqr, self.losses = load_family(REFERENCE / "eqr", "models.eqr", "models.losses")

    def build(self, config, batch_size, device):
        fields = {name: getattr(config, name) for name in SCHEMES["eqr"].reference_fields}
        fields = dict(fields, batch_size=batch_size, seq_len=config.seq_len, vocab_size=config.vocab_size,
                      lambda_=config.eqr_damping, noise_scale=config.eqr_noise, H_init_std=1.0, L_init_std=1.0)
        with torch.device(device):
            return self.losses.ACTLossHead(self.eqr.EqRModel(fields), "stablemax_cross_entropy")

    states = TRMReference.states
    set_states = TRMReference.set_states

    @contextlib.contextmanager
    def step_context(self, ours, ours_carry):
        """tests/test_eqr.py's Draws: our draws recorded as our scheme makes them, handed to EqR in
        the order EqR draws (its reset's truncated normals of z_H then z_L for the reset rows, then
        its torch.randn_like of every update)."""
        scheme = SCHEMES["eqr"]
        initial, noise = [], []
        reset_rows = ours_carry.halted.nonzero().flatten()
        own_initial, own_noise = type(scheme).initial_states, type(scheme).noise
        saved = (self.eqr.trunc_normal_init_, torch.randn_like)

        def record_initial(model, keys=None, carry=None):
            out = own_initial(scheme, model, keys, carry)
            initial.extend(out)
            return out

        def record_noise(keys, update, z):
            out = own_noise(scheme, keys, update, z)
            noise.append(out)
            return out

        def their_initial(buf, std):
            state = initial.pop(0)[reset_rows]
            assert buf.shape == state.shape and buf.dtype == state.dtype and std == 1.0
            return buf.copy_(state)

        def their_noise(like):
            eps = noise.pop(0) if ours.config.eqr_noise > 0 else torch.zeros_like(like)
            assert eps.shape == like.shape and eps.dtype == like.dtype
            return eps.clone()

        scheme.initial_states, scheme.noise = record_initial, record_noise
        self.eqr.trunc_normal_init_, torch.randn_like = their_initial, their_noise
        try:
            yield
            if noise or (initial and len(reset_rows)):
                raise AssertionError(f"EqR took fewer draws than ours made ({len(noise)} noise, {len(initial)} "
                                     "initial states left)")
        finally:
            del scheme.initial_states, scheme.noise
            self.eqr.trunc_normal_init_, torch.randn_like = saved


class URMReference(Reference):
    family = "urm (URM's own code from --urm, not vendored)"

    def __init__(self, folder: Path):
        if not (folder / "models" / "urm" / "urm.py").is_file():
            raise FileNotFoundError(f"no URM checkout at {folder} (models/urm/urm.py): extract HEAD of "
                                    "github.com/UbiquantAI/URM there, or pass --urm")
        self.urm, self.losses = load_family(folder, "models.urm.urm", "models.losses")

    def build(self, config, batch_size, device):
        fields = dict(batch_size=batch_size, seq_len=config.seq_len, puzzle_emb_ndim=config.puzzle_emb_ndim,
                      num_puzzle_identifiers=config.num_puzzle_identifiers, vocab_size=config.vocab_size,
                      num_layers=config.L_layers, hidden_size=config.hidden_size, expansion=config.expansion,
                      num_heads=config.num_heads, pos_encodings=config.pos_encodings, rms_norm_eps=config.rms_norm_eps,
                      rope_theta=config.rope_theta, loops=config.halt_max_steps, L_cycles=config.L_cycles,
                      H_cycles=config.H_cycles, forward_dtype=config.forward_dtype)
        with torch.device(device):
            head = self.losses.ACTLossHead(self.urm.URM(fields), loss_type="stablemax_cross_entropy")
        if config.forward_dtype == "float32":  # URM builds its conv in bf16 whatever the dtype
            for block in head.model.inner.layers:
                block.mlp.dwconv.float()
        return head

    def prepare(self, ours, theirs):
        dtype = theirs.model.inner.layers[0].mlp.dwconv.weight.dtype
        with torch.no_grad():  # the numbers URM's conv can hold, in ours too
            for block in ours.blocks:
                block.mlp.conv_weight.copy_(block.mlp.conv_weight.to(dtype).float())
                block.mlp.conv_bias.copy_(block.mlp.conv_bias.to(dtype).float())

    def states(self, carry):
        return {"z_L": carry.current_hidden}

    def our_states(self, carry):
        return {"z_L": carry.z_L}

    def set_states(self, carry, ours_carry):
        carry.current_hidden = ours_carry.z_L.clone()

    @contextlib.contextmanager
    def their_call(self, training):
        """URM's training halting explores with a hard-coded probability 0.1 from torch.rand_like:
        answered "no" (ones), as ours runs with halt_exploration_prob 0."""
        saved = torch.rand_like
        if training:
            torch.rand_like = lambda t, *a, **k: torch.ones_like(t)
        try:
            yield
        finally:
            torch.rand_like = saved


# ----------------------------------------------------------------------------------------------
# Configs, models, batches


def preset_config(name: str, dtype: str, rows: int, small: bool, attention: str | None) -> TRMConfig:
    base = PRESETS[name][1].model
    fields = dict(forward_dtype=dtype, halt_exploration_prob=0.0, halt_exploration_final=None,
                  num_puzzle_identifiers=rows)
    if attention:
        fields["attention"] = attention
    if small:
        fields.update(SMALL)
        if base.puzzle_emb_ndim:
            fields["puzzle_emb_ndim"] = 40
    return dataclasses.replace(base, **fields)


def make_models(config: TRMConfig, reference: Reference, batch_size: int, device: torch.device,
                weight_scale: float):
    torch.manual_seed(0)
    ours = TRM(config)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if param.ndim == 2 and not name.startswith("q_head"):
                param.mul_(weight_scale)
        if config.puzzle_emb_ndim:
            ours.puzzle_embedding.weight.normal_()
        ours.q_head.weight.normal_(std=0.3)  # so that rows halt at different steps
        ours.q_head.bias.zero_()
    ours.to(device)
    theirs = reference.build(config, batch_size, device)
    reference.prepare(ours, theirs)
    theirs.load_state_dict(reference_weights.reference_state_dict(ours))
    return ours, theirs


def make_batches(config: TRMConfig, batch_size: int, count: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        shape = (batch_size, config.seq_len)
        labels = torch.randint(0, config.vocab_size, shape, generator=g, dtype=torch.int32)
        labels[torch.rand(shape, generator=g) < 0.1] = -100  # positions without a target
        batch = {"inputs": torch.randint(0, config.vocab_size, shape, generator=g, dtype=torch.int32),
                 "labels": labels,
                 "puzzle_identifiers": torch.randint(0, config.num_puzzle_identifiers, (batch_size,), generator=g,
                                                     dtype=torch.int32)}
        out.append({k: v.to(device) for k, v in batch.items()})
    return out


# ----------------------------------------------------------------------------------------------
# Comparing


def difference(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    ours, theirs = ours.detach().double(), theirs.detach().double()
    if ours.shape != theirs.shape:
        raise AssertionError(f"shape {tuple(ours.shape)} vs the reference's {tuple(theirs.shape)}")
    diff = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    return {"abs": diff, "rel": diff / max(scale, 1e-12), "scale": scale}


class Tally:
    """The largest difference of each quantity over the steps, per step, and per gradient."""

    def __init__(self):
        self.max: dict[str, dict[str, float]] = {}
        self.grads: dict[str, dict[str, float]] = {}
        self.steps: list[dict] = []

    def add(self, step: dict, key: str, d: dict[str, float]) -> None:
        step[key] = {"abs": d["abs"], "rel": d["rel"]}
        best = self.max.setdefault(key, {"abs": 0.0, "rel": 0.0})
        best["abs"], best["rel"] = max(best["abs"], d["abs"]), max(best["rel"], d["rel"])

    def add_grad(self, step: dict, name: str, d: dict[str, float]) -> None:
        g = self.grads.setdefault(name, {"abs": 0.0, "rel": 0.0})
        g["abs"], g["rel"] = max(g["abs"], d["abs"]), max(g["rel"], d["rel"])
        worst = step.setdefault("grad", {"abs": 0.0, "rel": 0.0, "name": name})
        if d["rel"] >= worst["rel"]:
            worst.update(rel=d["rel"], name=name)
        worst["abs"] = max(worst["abs"], d["abs"])
        best = self.max.setdefault("grad", {"abs": 0.0, "rel": 0.0})
        best["abs"], best["rel"] = max(best["abs"], d["abs"]), max(best["rel"], d["rel"])

    def worst_grads(self) -> list[dict]:
        ranked = sorted(self.grads.items(), key=lambda kv: -kv[1]["rel"])[:WORST]
        return [{"name": name, **d} for name, d in ranked]


def side_by_side(ours: TRM, theirs, reference: Reference, batches, training: bool, sync: bool, tally: Tally,
                 names: dict[str, str], mode: str, device: torch.device, twin: TRM | None = None,
                 twin_tallies: tuple[Tally, Tally] | None = None) -> int:
    """Each ACT step of both models (ours first); returns the rows whose halting differed. `twin`: a
    float32 copy of ours, run after each step from the carry both started it from, each model's
    outputs and gradients compared with its (twin_tallies: ours', the reference's)."""
    ours.train(training), theirs.train(training)
    if twin is not None:
        twin.train(training)
    batch_size = batches[0]["inputs"].shape[0]
    carry = ours.initial_carry(batches[0])
    with torch.device(device):
        their_carry = theirs.initial_carry(batches[0])
    by_name = dict(theirs.named_parameters())
    puzzle = ours.config.puzzle_emb_ndim > 0
    halting_mismatches = 0
    for t, batch in enumerate(batches):
        step: dict = {"mode": mode, "step": t}
        start, their_rows_grad = carry, None
        with torch.set_grad_enabled(training), reference.step_context(ours, carry):
            carry, outputs = ours(carry, batch)
            loss, _ = loss_and_metrics(carry, outputs)
            with reference.their_call(training), torch.device(device):
                their_carry, their_loss, _, their_outputs, _ = theirs(
                    carry=their_carry, batch=batch, return_keys=["logits", "q_halt_logits"])
        halted_differs = int((carry.halted != their_carry.halted).sum())
        steps_differ = int((carry.steps != their_carry.steps).sum())
        step.update(halted=int(carry.halted.sum()), halting_mismatch_rows=halted_differs,
                    steps_mismatch_rows=steps_differ)
        halting_mismatches += max(halted_differs, steps_differ)
        for key in ("logits", "q_halt_logits"):
            tally.add(step, key, difference(outputs[key], their_outputs[key]))
        their_states = reference.states(their_carry)
        for key, value in reference.our_states(carry).items():
            tally.add(step, key, difference(value, their_states[key]))
        tally.add(step, "loss", difference(loss, their_loss))
        if training:
            for m in (ours, theirs):
                m.zero_grad(set_to_none=True)
            (loss / batch_size).backward()
            (their_loss / batch_size).backward()
            for name, param in ours.named_parameters():
                grad = by_name[f"model.inner.{names[name]}"].grad
                if param.grad is None or grad is None:
                    raise AssertionError(f"gradient of {name}: ours {param.grad is not None}, "
                                         f"the reference's {grad is not None}")
                tally.add_grad(step, name, difference(param.grad, grad))
            if puzzle:
                rows = theirs.model.inner.puzzle_emb.local_weights
                their_rows_grad = rows.grad
                tally.add(step, "puzzle_rows_grad", difference(ours.puzzle_embedding.batch_rows.grad, their_rows_grad))
                rows.grad = None  # the reference's optimizer reads then clears it
            step["loss_value"] = loss.item()
        tally.steps.append(step)
        if twin is not None:
            compare_with_twin(twin, start, batch, training, names, outputs, their_outputs, reference.our_states(carry),
                              their_states, loss, their_loss, ours, by_name, their_rows_grad, twin_tallies)
        if sync:  # every step from our carry: each step's own difference, not the compounded one
            reference.set_states(their_carry, carry)
            their_carry.halted, their_carry.steps = carry.halted.clone(), carry.steps.clone()
    ours.zero_grad(set_to_none=True), theirs.zero_grad(set_to_none=True)
    return halting_mismatches


def compare_with_twin(twin: TRM, start, batch, training, names, outputs, their_outputs, our_states, their_states,
                      loss, their_loss, ours: TRM, their_params: dict, their_rows_grad, tallies: tuple[Tally, Tally]
                      ) -> None:
    """One step of the float32 twin from `start` (the carry ours and the reference started this step
    from, its states cast to float32), each bf16 model's values compared with the twin's."""
    batch_size = batch["inputs"].shape[0]
    carry = dataclasses.replace(start, z_H=start.z_H.float(), z_L=start.z_L.float())
    with torch.set_grad_enabled(training):
        carry, twin_outputs = twin(carry, batch)
        twin_loss, _ = loss_and_metrics(carry, twin_outputs)
    twin_states = {"z_H": carry.z_H, "z_L": carry.z_L}
    if training:
        twin.zero_grad(set_to_none=True)
        (twin_loss / batch_size).backward()
    for tally, model_outputs, states, model_loss, grad_of, rows in (
            (tallies[0], outputs, our_states, loss, lambda name: dict(ours.named_parameters())[name].grad,
             lambda: ours.puzzle_embedding.batch_rows.grad),
            (tallies[1], their_outputs, their_states, their_loss,
             lambda name: their_params[f"model.inner.{names[name]}"].grad, lambda: their_rows_grad)):
        step: dict = {}
        for key in ("logits", "q_halt_logits"):
            tally.add(step, key, difference(model_outputs[key], twin_outputs[key]))
        for key, value in states.items():
            tally.add(step, key, difference(value, twin_states[key]))
        tally.add(step, "loss", difference(model_loss, twin_loss))
        if training:
            for name, param in twin.named_parameters():
                tally.add_grad(step, name, difference(grad_of(name), param.grad))
            if twin.config.puzzle_emb_ndim:
                tally.add(step, "puzzle_rows_grad", difference(rows(), twin.puzzle_embedding.batch_rows.grad))
        tally.steps.append(step)
    twin.zero_grad(set_to_none=True)


def float32_without_tf32() -> dict[str, str]:
    """float32 is float32: no TF32 in cuBLAS's matmuls (off by default) nor in cuDNN's convolutions
    (on by default; URM's conv). Through torch's fp32_precision settings where it has them, every one
    of them (torch raises on a mix of those and the legacy allow_tf32 flags), else the legacy flags."""
    backends = torch.backends
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        settings = [backends, backends.cuda.matmul, backends.cudnn, backends.cudnn.conv, backends.cudnn.rnn]
        for s in settings:
            if hasattr(s, "fp32_precision"):
                s.fp32_precision = "ieee"
        return {"fp32_precision_matmul": backends.cuda.matmul.fp32_precision,
                "fp32_precision_cudnn_conv": backends.cudnn.conv.fp32_precision}
    backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = False
    return {"tf32_matmul": str(backends.cuda.matmul.allow_tf32), "tf32_cudnn": str(backends.cudnn.allow_tf32)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training_step(ours: TRM, theirs, reference: Reference, batch, device, warmup: int, repeats: int) -> dict:
    """Median seconds of one training ACT step (forward from a fresh carry, loss, backward) of each:
    the references' own draws (no shims but the flash-attn one and URM's exploration)."""
    batch_size = batch["inputs"].shape[0]
    ours.train(), theirs.train()

    def run_ours():
        carry, outputs = ours(ours.initial_carry(batch), batch)
        loss, _ = loss_and_metrics(carry, outputs)
        (loss / batch_size).backward()
        ours.zero_grad(set_to_none=True)

    def run_theirs():
        with reference.their_call(True), torch.device(device):
            _, loss, _, _, _ = theirs(carry=theirs.initial_carry(batch), batch=batch, return_keys=[])
            (loss / batch_size).backward()
        theirs.zero_grad(set_to_none=True)
        if ours.config.puzzle_emb_ndim:
            theirs.model.inner.puzzle_emb.local_weights.grad = None

    out = {}
    for who, fn in (("ours", run_ours), ("theirs", run_theirs)):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - start)
        out[f"{who}_ms"] = 1e3 * statistics.median(times)
    out["ours_over_theirs"] = out["ours_ms"] / out["theirs_ms"]
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return out


def run_one(preset: str, dtype: str, weight_scale: float, judged: bool, reference: Reference, args,
            device: torch.device) -> dict:
    config = preset_config(preset, dtype, args.rows, args.small, args.attention)
    batch_size = args.batch or (2 if args.small else BATCH.get(preset, 32))
    record = {"preset": preset, "family": reference.family, "dtype": dtype, "batch": batch_size,
              "config": dataclasses.asdict(config), "train_steps": args.train_steps, "eval_steps": args.eval_steps,
              "carry": "ours handed to the reference after each step" if dtype != "float32" else "independent",
              "tolerance": TOL[dtype], "weight_scale": weight_scale, "judged": judged}
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ours, theirs = make_models(config, reference, batch_size, device, weight_scale)
    names = reference_weights.reference_names(config)
    tally = Tally()
    floor = dtype == "float32" and args.floor and judged
    sync = dtype != "float32" or floor
    twin, twin_tallies = None, (Tally(), Tally())
    if (dtype != "float32" and args.twin) or floor:
        twin = TRM(dataclasses.replace(config, forward_dtype="float32")).to(device)
        twin.load_state_dict(ours.state_dict())
    if floor:  # every float weight of the twin one float32 ulp up or down, at random
        g = torch.Generator(device="cpu").manual_seed(7)
        with torch.no_grad():
            for param in twin.parameters():
                if param.is_floating_point():
                    sign = torch.randint(0, 2, param.shape, generator=g).to(param.device) * 2 - 1
                    param.copy_(torch.nextafter(param, param + sign * torch.finfo(param.dtype).max))
        record["carry"] = "ours handed to the reference after each step (--floor)"
    seed = 1 + 1000 * DEFAULT_PRESETS.index(preset) if preset in DEFAULT_PRESETS else 1
    mismatches = side_by_side(ours, theirs, reference, make_batches(config, batch_size, args.train_steps, seed, device),
                              True, sync, tally, names, "train", device, twin, twin_tallies)
    eval_batch = make_batches(config, batch_size, 1, seed + 500, device)[0]
    mismatches += side_by_side(ours, theirs, reference, [eval_batch] * args.eval_steps, False, sync, tally, names,
                               "eval", device, twin, twin_tallies)
    if twin is not None and floor:
        record["vs_perturbed_twin"] = {
            "what": "each model's values against a float32 copy of ours whose every weight is one ulp up or down, "
                    "run from the same carry each step (largest relative difference over the steps): how far "
                    "one rounding of each weight moves a step, the scale of a rounding-only difference",
            **{who: {"max": t.max, "worst_grads": t.worst_grads()} for who, t in zip(("ours", "theirs"), twin_tallies)}}
        del twin
    elif twin is not None:
        record["vs_float32_twin"] = {
            "what": "each bf16 model's values against a float32 copy of ours run from the same carry each step "
                    "(largest relative difference over the steps): the bf16 rounding of each, the scale of the "
                    "ours-vs-reference difference above",
            **{who: {"max": t.max, "worst_grads": t.worst_grads()} for who, t in zip(("ours", "theirs"), twin_tallies)}}
        del twin
    record.update(max=tally.max, worst_grads=tally.worst_grads(), per_step=tally.steps,
                  halting_mismatch_rows=mismatches,
                  rows_halted_in_training=[s["halted"] for s in tally.steps if s["mode"] == "train"])
    # The bar of each quantity: TOL[dtype], or twice what the twin shows one rounding does to it
    # (the larger of ours' and the reference's), where a twin ran.
    rounding = {key: max(t.max[key]["rel"] for t in twin_tallies if key in t.max)
                for key in tally.max if any(key in t.max for t in twin_tallies)}
    bars = {key: max(TOL[dtype], 2 * rounding.get(key, 0.0)) for key in tally.max}
    record["bars"] = bars
    failures = [f"{key}: {d['rel']:.3g} relative (bar {bars[key]:.3g})" for key, d in tally.max.items()
                if not d["rel"] <= bars[key]]  # NaN fails too
    if dtype == "float32" and mismatches:
        failures.append(f"halting or steps differ in {mismatches} row-steps")
    record["failures"], record["pass"] = failures, not failures
    record["compare_s"] = time.perf_counter() - started
    if args.repeats and judged:
        record["time"] = time_training_step(ours, theirs, reference, eval_batch, device, args.warmup, args.repeats)
    del ours, theirs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


# ----------------------------------------------------------------------------------------------
# Report


def row(record: dict) -> str:
    head = f"{record['preset']:<11} {record['dtype']:<9} {record['weight_scale']:>5g}"
    if "error" in record:
        return f"{head} ERROR {record['error'].splitlines()[0]}"
    m = record["max"]
    cell = lambda key: f"{m[key]['rel']:.1e}" if key in m else "-"
    states = max((m[k]["rel"] for k in ("z_H", "z_L") if k in m), default=float("nan"))
    t = record.get("time")
    timing = f"{t['ours_ms']:8.1f} {t['theirs_ms']:8.1f}" if t else f"{'-':>8} {'-':>8}"
    worst = record["worst_grads"][0]["name"] if record["worst_grads"] else "-"
    verdict = ("pass" if record["pass"] else "FAIL") if record["judged"] else "info"
    return (f"{head} {record['batch']:>5} {cell('logits'):>8} {cell('q_halt_logits'):>8} {states:8.1e} "
            f"{cell('loss'):>8} {cell('grad'):>8} {cell('puzzle_rows_grad'):>8} {record['halting_mismatch_rows']:>5} "
            f"{timing} {verdict:<5} {worst}")


HEADER = (f"{'preset':<11} {'dtype':<9} {'scale':>5} {'batch':>5} {'logits':>8} {'q_halt':>8} {'states':>8} "
          f"{'loss':>8} {'grads':>8} {'puzzle':>8} {'halt':>5} {'ours_ms':>8} {'ref_ms':>8} {'':<5} worst gradient")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write (rewritten after every run)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="narrow widths (hidden 32, 4 heads, batch 4)")
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma list of PRESETS names")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma list: float32 and/or bfloat16")
    parser.add_argument("--batch", type=int, default=0, help="batch size of every preset (default: BATCH's)")
    parser.add_argument("--rows", type=int, default=64, help="puzzle-embedding table rows")
    parser.add_argument("--train-steps", type=int, default=4)
    parser.add_argument("--eval-steps", type=int, default=3)
    parser.add_argument("--weight-scales", default="0.5,1",
                        help="comma list: every 2-D weight but the Q head's times this after the init; the "
                             "first is judged, the others are informational (default 0.5,1: see the docstring)")
    parser.add_argument("--attention", choices=["blockwise", "sdpa"], help="ours' attention (default: the preset's)")
    parser.add_argument("--sdpa-backend", choices=["math", "efficient", "flash", "cudnn"],
                        help="every torch SDPA call of both sides on this kernel (default: torch's choice); with "
                             "--attention sdpa, math puts both sides on one kernel, which tells the attention "
                             "kernels' rounding from a difference of the models")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="judged float32 runs the two models independently over all steps, without the "
                             "1-ulp twin (see the docstring)")
    parser.add_argument("--no-twin", dest="twin", action="store_false",
                        help="bfloat16 runs without the float32 twin of ours (see the docstring)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed training steps before the timed ones")
    parser.add_argument("--repeats", type=int, default=5, help="timed training steps (0: no timing; --small: 1)")
    parser.add_argument("--urm", default=str(ROOT / ".urm_src"), help="a checkout of URM's files (default .urm_src)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (--device cpu)")
    args = parser.parse_args()
    if args.small and "--repeats" not in sys.argv:
        args.warmup, args.repeats = 1, 1

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device (use --device cpu --small for a CPU run)")
    torch.set_num_threads(args.threads)
    tf32 = float32_without_tf32()
    install_flash_attn_shim()

    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise SystemExit(f"error: unknown presets {unknown}")
    references: dict[str, Reference] = {}

    def reference_for(arch: str) -> Reference:
        if arch not in references:
            references[arch] = (EqRReference() if arch == "eqr" else URMReference(Path(args.urm)) if arch == "urm"
                                else TRMReference())
        return references[arch]

    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or platform.machine(),
              "torch": torch.__version__, "python": platform.python_version(), "small": args.small,
              "settings": {**tf32, "threads": torch.get_num_threads()},
              "tolerance": TOL, "argv": sys.argv[1:], "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    if args.sdpa_backend:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[args.sdpa_backend]
        on_one_kernel = contextlib.ExitStack()  # held to the end of main (the process)
        on_one_kernel.enter_context(sdpa_kernel([backend]))
    scales = [float(x) for x in args.weight_scales.split(",") if x]
    for scale in scales:  # the judged runs of every preset first, then the informational ones
        judged = scale == scales[0]
        for preset in presets:
            arch = PRESETS[preset][1].model.arch
            for dtype in [d for d in args.dtypes.split(",") if d]:
                try:
                    record = run_one(preset, dtype, scale, judged, reference_for(arch), args, device)
                except Exception as e:  # noqa: BLE001 (one run's failure is reported; the others still run)
                    record = {"preset": preset, "dtype": dtype, "weight_scale": scale, "judged": judged, "pass": False,
                              "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                    print(record["traceback"], file=sys.stderr, flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                result["runs"].append(record)
                result["pass"] = all(r["pass"] for r in result["runs"] if r["judged"])
                out.write_text(json.dumps(result, indent=1, default=float))
                print(row(record), flush=True)
                for failure in record.get("failures", []):
                    print(f"    {failure}{'' if judged else ' (info)'}", flush=True)
                twin_key = "vs_perturbed_twin" if "vs_perturbed_twin" in record else "vs_float32_twin"
                for who, t in record.get(twin_key, {}).items():
                    if who != "what":
                        label = who + (" vs 1-ulp twin" if twin_key == "vs_perturbed_twin" else " vs float32")
                        print(f"    {label:<22} " + " ".join(
                            f"{key} {d['rel']:.1e}" for key, d in t["max"].items()), flush=True)
    print(f"\n{'all pass' if result['pass'] else 'FAILED'}: the largest difference over the steps, relative to "
          f"each quantity's largest magnitude, within float32 {TOL['float32']:g}, bfloat16 {TOL['bfloat16']:g} or "
          f"twice the twin's (the difference one rounding makes) at "
          f"weight scale {scales[0]:g} (other scales: info, not judged); halt = row-steps whose halting differed; "
          f"ms = one training ACT step. JSON: {out}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
