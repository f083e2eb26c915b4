"""The eqr arch (modeling/schemes.py's EqR) against EqR's own model (tests/reference/eqr/, vendored
from github.com/locuslab/EqR): forward, carried states, halting, loss, metrics and gradients over
several ACT steps in training and evaluation, with EqR's random draws (its initial states and
its noise) replaced by the ones our counter hash drew; and the draws themselves: deterministic,
the right distributions, different per row, step, update and position."""
import ast
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train
from model import TRM, TRMConfig, loss_and_metrics
from modeling import counter_hash
from modeling.schemes import SCHEMES, arch_defaults
from reference import weights as reference_weights
from tests.reference.loading import load_family

EQR_DIR = Path(__file__).resolve().parent / "reference" / "eqr"
BATCH = 6

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_eqr(*names):
    """EqR's modules `names` under their own package names (tests/reference/loading.py): TRM's
    vendored reference (tests/reference/, test_archs.py) has a `models` package too."""
    return load_family(EQR_DIR, *names)


EQR_MODELS, EQR, EQR_LOSSES, EQR_EMA, EQR_TRAINING, EQR_PRINTING, EQR_SCHEMA, EQR_EVAL_CONFIG = load_eqr(
    "models", "models.eqr", "models.losses", "models.ema", "utils.training", "utils.printing", "config.schema",
    "evaluators.eval_config")


def small_config(**overrides) -> TRMConfig:
    fields = dict(seq_len=16, vocab_size=6, hidden_size=32, num_heads=4, expansion=2.0, H_cycles=2, L_cycles=2,
                  L_layers=2, halt_max_steps=3, halt_exploration_prob=0.0, forward_dtype="float32",
                  attention="sdpa", pos_encodings="rope")
    fields.update(arch_defaults("eqr"))
    fields.update(overrides)
    return TRMConfig(**fields)


def their_config(config: TRMConfig) -> dict:
    """EqR's EqRConfig fields for our config (its yaml's names; board_height/width left to its
    square fallback, as the Maze recipe does)."""
    fields = {name: getattr(config, name) for name in SCHEMES["eqr"].reference_fields}
    return dict(fields, batch_size=BATCH, seq_len=config.seq_len, vocab_size=config.vocab_size,
                lambda_=config.eqr_damping, noise_scale=config.eqr_noise, H_init_std=1.0, L_init_std=1.0)


def batches(config: TRMConfig, count: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(count):
        labels = torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=g, dtype=torch.int32)
        labels[:, :2] = -100
        yield {"inputs": torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=g, dtype=torch.int32),
               "labels": labels, "puzzle_identifiers": torch.zeros(BATCH, dtype=torch.int32)}


def ours_and_theirs(config: TRMConfig, seed: int = 0):
    """Our model with small weights (each matrix at half the init's scale: 0.5/sqrt(fan_in), so
    that float rounding does not grow through the recursion) and a Q head that makes rows halt at
    different steps; EqR's model in its ACTLossHead with the same weights, moved by reference_weights."""
    torch.manual_seed(seed)
    ours = TRM(config, exploration_seed=seed)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if param.ndim == 2 and not name.startswith("q_head"):
                param.mul_(0.5)
        ours.q_head.weight.normal_(std=0.3)
        ours.q_head.bias.zero_()
    theirs = EQR_LOSSES.ACTLossHead(EQR.EqRModel(their_config(config)), "stablemax_cross_entropy")
    theirs.load_state_dict(reference_weights.reference_state_dict(ours))
    return ours, theirs


class Draws:
    """Our draws of one ACT step, recorded as our scheme makes them (its initial_states and noise),
    then handed to EqR in the order EqR draws: its reset's truncated normals (z_H's, then z_L's,
    of the reset rows) and its torch.randn_like of every update (zeros where ours, with σ = 0,
    draws no noise: EqR adds 0·ε)."""

    def __init__(self, monkeypatch, noisy: bool):
        self.noisy = noisy
        scheme = SCHEMES["eqr"]
        self.initial, self.noise, self.reset_rows = [], [], None
        initial_states, noise = type(scheme).initial_states, type(scheme).noise

        def record_initial(model, keys=None, carry=None):
            out = initial_states(scheme, model, keys, carry)
            self.initial.extend(out)
            return out

        def record_noise(keys, update, z):
            out = noise(scheme, keys, update, z)
            self.noise.append(out)
            return out

        monkeypatch.setattr(scheme, "initial_states", record_initial)
        monkeypatch.setattr(scheme, "noise", record_noise)
        monkeypatch.setattr(EQR, "trunc_normal_init_", self.their_initial)
        monkeypatch.setattr(torch, "randn_like", self.their_noise)

    def their_initial(self, buf, std):
        assert std == 1.0
        state = self.initial.pop(0)[self.reset_rows]
        assert buf.shape == state.shape and buf.dtype == state.dtype
        return buf.copy_(state)

    def their_noise(self, like):
        eps = self.noise.pop(0) if self.noisy else torch.zeros_like(like)
        assert eps.shape == like.shape and eps.dtype == like.dtype
        return eps.clone()

    def start(self, halted: torch.Tensor):
        self.initial, self.noise, self.reset_rows = [], [], halted.nonzero().flatten()

    def handed_over(self) -> bool:
        return not self.noise and (not self.initial or len(self.reset_rows) == 0)


def step_side_by_side(ours, theirs, draws, carry, their_carry, batch):
    """One ACT step of ours and of EqR's model, EqR fed our draws; halting and steps must agree.
    (carry, outputs, their carry, their loss, their metrics, their outputs)."""
    draws.start(carry.halted)
    carry, outputs = ours(carry, batch)
    their_carry, their_loss, their_metrics, their_outputs, _ = theirs(
        carry=their_carry, batch=batch, return_keys=["logits", "q_halt_logits"])
    assert draws.handed_over()
    assert torch.equal(carry.halted, their_carry.halted) and torch.equal(carry.steps, their_carry.steps)
    return carry, outputs, their_carry, their_loss, their_metrics, their_outputs


def close(ours, theirs, tol, what):
    ours, theirs = ours.double(), theirs.double()
    scale = theirs.abs().max().clamp_min(1e-12)
    err = ((ours - theirs).abs().max() / scale).item()
    assert err <= tol, f"{what}: largest difference {err:.3g} of the largest value (tolerance {tol})"
    return err


# float32 throughout. Ours and EqR's compute the same sums, in part through other decompositions
# (SwiGLU's gate and up as two matmuls, mlp_t contracting positions without a transpose), which a
# CPU's BLAS may add in other orders: outputs and carries within OUTPUTS_TOL of their largest value
# (test_archs.py's measured bound for another summation order over 3 ACT steps), gradients GRAD_TOL.
OUTPUTS_TOL, GRAD_TOL = 1e-4, 1e-4
VARIANTS = {"attention-rope": {}, "attention-rope2d": dict(pos_encodings="rope2d"),
            "mlp_t": dict(mlp_t=True, pos_encodings="none"), "no-noise": dict(eqr_noise=0.0),
            "bfloat16": dict(forward_dtype="bfloat16")}


@pytest.mark.parametrize("variant", VARIANTS)
def test_eqr_equals_its_own_code_side_by_side(variant, monkeypatch):
    """4 training ACT steps (rows halting on the Q head and at halt_max_steps, new examples loaded
    with fresh initial states) then halt_max_steps evaluation steps, EqR fed our draws: halting
    and steps equal, logits, q_halt, z_H and z_L within OUTPUTS_TOL, the loss (ours float32, EqR's
    float64), lm_loss, q_halt_loss, accuracy, exact_accuracy, count and steps within 1e-6, every
    gradient within GRAD_TOL of its largest value. Measured on this machine: every output and
    carry the same bits; gradients within 2.7e-7 in float32 and bitwise in bfloat16 (the token
    embedding's within 1.3e-2 there, summed in float32 here and in bf16 by EqR's kernel); the loss
    within 1.1e-7."""
    config = small_config(**VARIANTS[variant])
    ours, theirs = ours_and_theirs(config)
    draws = Draws(monkeypatch, noisy=config.eqr_noise > 0)
    names = reference_weights.reference_names(config)
    errors = {}
    for training, steps in ((True, 4), (False, config.halt_max_steps)):
        ours.train(training), theirs.train(training)
        data = list(batches(config, steps))
        carry, their_carry = ours.initial_carry(data[0]), theirs.initial_carry(data[0])
        halted_rows = set()
        for batch in data:
            with torch.set_grad_enabled(training):
                carry, outputs, their_carry, their_loss, their_metrics, their_outputs = step_side_by_side(
                    ours, theirs, draws, carry, their_carry, batch)
                loss, metrics = loss_and_metrics(carry, outputs)
            halted_rows.update(carry.steps[carry.halted].tolist())
            for key, theirs_value in (("logits", their_outputs["logits"]),
                                      ("q_halt_logits", their_outputs["q_halt_logits"])):
                errors[key] = max(errors.get(key, 0), close(outputs[key], theirs_value, OUTPUTS_TOL, key))
            for key in ("z_H", "z_L"):
                errors[key] = max(errors.get(key, 0), close(getattr(carry, key),
                                                            getattr(their_carry.inner_carry, key), OUTPUTS_TOL, key))
            errors["loss"] = max(errors.get("loss", 0), close(loss, their_loss, 1e-6, "loss"))
            for key in ("lm_loss", "q_halt_loss", "count", "accuracy", "exact_accuracy", "steps"):
                close(metrics[key], their_metrics[key].float(), 1e-6, key)
            if training:
                for m in (ours, theirs):
                    m.zero_grad(set_to_none=True)
                loss.backward()
                their_loss.backward()
                by_name = dict(theirs.named_parameters())
                for name, param in ours.named_parameters():
                    grad = by_name[f"model.inner.{names[name]}"].grad
                    if name == "token_embedding" and config.forward_dtype == "bfloat16":
                        # summed in float32 here, in bf16 by EqR's CPU kernel (docs/faithfulness.md)
                        errors["token_grad"] = max(errors.get("token_grad", 0), close(param.grad, grad, 2e-2, name))
                        continue
                    errors["grad"] = max(errors.get("grad", 0), close(param.grad, grad, GRAD_TOL, f"grad of {name}"))
        if training:
            assert len(halted_rows) >= 2, f"rows should halt at different steps: {halted_rows}"
    print(variant, {k: f"{v:.1e}" for k, v in errors.items()})


def test_eqr_draws_are_deterministic_and_distributed_as_eqrs():
    """The same (seed, counter, row) gives the same draws in any batch layout and after a resume
    (a function of the key, not of a generator's state); another seed, counter, row, update or
    position another draw; initial states a truncated normal of std 1 within ±2/0.8796, noise
    standard normal."""
    config = small_config(hidden_size=64)
    model = TRM(config, exploration_seed=3).train()
    batch = next(batches(config, 1))
    carry = model.initial_carry(batch)

    def step_draws(model, carry, rows=slice(None)):
        seen = []
        scheme = SCHEMES["eqr"]
        keys = counter_hash.hashed_keys(model.exploration_seed, carry.rng_counter,
                                        torch.arange(BATCH)[rows], 2)
        sub = type(carry)(**{**carry.__dict__, "z_H": carry.z_H[rows], "z_L": carry.z_L[rows]})
        seen.extend(scheme.initial_states(model, keys, sub))
        seen.extend(scheme.noise(keys, u, carry.z_H[rows]) for u in range(6))
        return seen

    first = step_draws(model, carry)
    assert all(torch.equal(a, b) for a, b in zip(first, step_draws(model, carry)))
    # rows 2..4 alone draw what they drew in the whole batch (another batch layout, another host)
    assert all(torch.equal(a[2:5], b) for a, b in zip(first, step_draws(model, carry, slice(2, 5))))
    later = type(carry)(**{**carry.__dict__, "rng_counter": carry.rng_counter + 1})
    other_seed = TRM(config, exploration_seed=4)
    for other in (step_draws(model, later), step_draws(other_seed, carry)):
        assert not any(torch.equal(a, b) for a, b in zip(first, other))
    flat = torch.stack(first).flatten(2)  # draw, row, element
    for i in range(flat.shape[0]):
        for j in range(i + 1, flat.shape[0]):
            assert not torch.equal(flat[i], flat[j])
    assert (flat[:, 0] != flat[:, 1]).float().mean() > 0.99  # rows
    assert (flat[:, :, 0] != flat[:, :, 1]).float().mean() > 0.99  # positions
    init, noise = torch.cat(first[:2]), torch.cat(first[2:])
    bound = 2 / 0.8796
    assert init.abs().max() <= bound * 1.0001 and init.abs().max() > bound * 0.99
    assert abs(init.std().item() - 1) < 0.02 and abs(init.mean().item()) < 0.02
    assert abs(noise.std().item() - 1) < 0.02 and abs(noise.mean().item()) < 0.02 and noise.abs().max() > 3


def test_eqr_training_carry_resumes_and_evaluation_draws_do_not_depend_on_the_past():
    """Two training steps straight equal one step, the carry saved and restored, and one more;
    an evaluation step's draws depend on the rows' own ACT steps, not on the carry's counter."""
    config = small_config()
    data = list(batches(config, 2))
    model = TRM(config, exploration_seed=1).train()
    carry = model.initial_carry(data[0])
    with torch.no_grad():
        mid, _ = model(carry, data[0])
        straight, _ = model(mid, data[1])
        restored = type(mid).from_tensors({k: v.clone() for k, v in mid.tensors().items()})
        resumed, _ = model(restored, data[1])
    assert all(torch.equal(a, b) for a, b in zip(straight.tensors().values(), resumed.tensors().values()))
    model.eval()
    with torch.no_grad():
        fresh, out = model(model.initial_carry(data[0]), data[0])
        aged = type(carry)(**{**model.initial_carry(data[0]).__dict__, "rng_counter": torch.tensor(41)})
        aged, aged_out = model(aged, data[0])
    assert torch.equal(out["logits"], aged_out["logits"]) and torch.equal(fresh.z_L, aged.z_L)


def test_choosing_eqr_gives_its_fields_and_checks():
    config = small_config()
    assert (config.puzzle_emb_ndim, config.prefix_len, config.no_ACT_continue) == (0, 0, True)
    assert not [k for k in TRM(config).state_dict() if k.endswith("_init")]
    for fields, message in ((dict(puzzle_emb_ndim=16), "puzzle_emb_ndim=16: the reference's eqr fixes it at 0"),
                            (dict(no_ACT_continue=False), "no_ACT_continue=False"),
                            (dict(pos_encodings="learned"), "pos_encodings='learned': EqR"),
                            (dict(pos_encodings="rope2d", seq_len=15), "seq_len a square")):
        with pytest.raises(ValueError, match=message):
            TRM(small_config(**fields))
    trm = dict(seq_len=16, vocab_size=6, hidden_size=32, num_heads=4)
    for field in ("eqr_damping", "eqr_noise"):
        with pytest.raises(ValueError, match=f"{field}=0.5: a field of arch eqr, not of arch trm"):
            TRM(TRMConfig(**trm, **{field: 0.5}))
    with pytest.raises(ValueError, match="eqr_damping=0.0 must be in"):
        TRM(small_config(eqr_damping=0.0))


def test_an_eqr_checkpoint_is_recognised_and_loads(tmp_path):
    """EqR's state dict (TRM's names, no *_init buffers, no puzzle table; `_orig_mod.` as its
    compiled model saves it) is read as arch eqr and loads into ours tensor for tensor."""
    config = small_config(mlp_t=True, pos_encodings="none")
    ours, theirs = ours_and_theirs(config)
    state = {"_orig_mod." + k: v for k, v in theirs.state_dict().items()}
    found = reference_weights.reference_config(state, TRMConfig())
    assert found.arch == "eqr" and found.mlp_t and found.puzzle_emb_ndim == 0 and found.hidden_size == 32
    fresh = TRM(config)
    reference_weights.load_reference_state_dict(fresh, state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ours.state_dict().values()))
    # Given to a TRM run as --run.init-from: one line that names the file's arch, no traceback.
    from commands.restore import load_initial_weights
    from training.config import ConfigError

    torch.save(state, tmp_path / "eqr.pt")
    trm = dataclasses.replace(config, **{**arch_defaults("trm"), "puzzle_emb_ndim": 8})
    with pytest.raises(ConfigError, match=r"--run.init-from \S+eqr.pt: reference checkpoint does not match this "
                                          r"TRMConfig .*; the file holds a model of arch eqr: pass --model.arch eqr"):
        load_initial_weights(str(tmp_path / "eqr.pt"), trm)


def test_eqr_trains_on_the_demo_on_the_mesh_and_resumes_exactly(demo_path, tmp_path):
    """`--model.arch eqr` through train.main on the 8-device CPU mesh, in the demo's bfloat16: finite,
    falling losses with no aten:: CPU fallbacks (the hash, erfinv and the damped updates all lower
    to XLA); stopped after 2 steps and relaunched, the same losses and final evaluation bit for bit
    (the draws are keyed by the carry's restored rng_counter; the evaluation's by the rows' steps)."""
    import train
    from tests.test_train import tiny_args
    from training.config import parse_config

    def args(name, steps):
        return tiny_args(demo_path, tmp_path / name, "--model.arch", "eqr", "--model.puzzle-emb-ndim", "0",
                         "--model.num-heads", "4", "--optim.max-steps", str(steps), "--run.log-every", "1",
                         "--eval.every-epochs", "1000", "--optim.lr-warmup-steps", "1")

    straight = train.main(parse_config(args("straight", 6)))
    losses = [h["loss"] for h in straight["history"]]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    assert not straight["xla"]["fallbacks"], straight["xla"]
    assert straight["final"]["count"] == 40
    first = train.main(parse_config(args("resumed", 2)))
    resumed = train.main(parse_config(args("resumed", 6)))
    assert resumed["start_step"] == 2
    assert [h["loss"] for h in first["history"] + resumed["history"]] == losses
    assert resumed["final"] == straight["final"]


def eqr_functions(path: Path, *names) -> dict:
    """Functions of EqR's vendored `path` (evaluate.py, utils/checkpoint.py), their source
    unchanged, defined alone: the modules they are in need wandb, omegaconf, hydra or CUDA. Their
    globals: what they use of torch, EqR's modules and the standard library."""
    import dataclasses
    import os
    import random
    import typing

    import numpy as np

    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == set(names)
    namespace = {"torch": torch, "nn": torch.nn, "np": np, "os": os, "random": random, "Path": Path,
                 "replace": dataclasses.replace,
                 **{k: getattr(typing, k) for k in ("Any", "Dict", "List", "Tuple", "Optional")},
                 "PretrainConfig": EQR_SCHEMA.PretrainConfig, "EvalConfig": EQR_EVAL_CONFIG.EvalConfig,
                 "EMAHelper": EQR_EMA.EMAHelper, "TrainState": EQR_TRAINING.TrainState,
                 "DataLoader": torch.utils.data.DataLoader, "tree_to_cpu_detached": EQR_TRAINING.tree_to_cpu_detached,
                 "get_env": lambda name: None,  # utils.env: no environment overrides
                 "get_run_id": lambda: None, "wandb": SimpleNamespace(run=None),  # no W&B run
                 **{k: getattr(EQR_PRINTING, k) for k in ("colored_exception", "rank_zero_print_warning",
                                                          "rank_zero_print_info", "print_info")}}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def evaluated_by_eqr(checkpoint_path: Path, vocab_size: int, seq_len: int):
    """The model EqR's evaluate.py evaluates from a checkpoint file, by its `_run_checkpoint`'s
    steps with its own functions: `_load_checkpoint` (torch.load), `_base_config` (its
    PretrainConfig from the file's "config", the evaluation's loss head InferenceLossHead), the
    model its pretrain.create_model builds from it (arch fields, the dataset's sizes), its
    init_train_state's EMA helper, `load_model_state_dict(strict=config.load_strict, assign=True)`
    and `load_ema`. (model, config, checkpoint object)."""
    run = eqr_functions(EQR_DIR / "evaluate.py", "_load_checkpoint", "_base_config", "_dataset_path", "_seed")
    load = eqr_functions(EQR_DIR / "utils" / "checkpoint.py", "canonicalize_orig_mod_wrappers",
                         "load_model_state_dict", "load_ema")
    ckpt, path = run["_load_checkpoint"](str(checkpoint_path))
    config = run["_base_config"](EQR_EVAL_CONFIG.EvalConfig(), ckpt, path, 0)
    classes = {"eqr": EQR, "losses": EQR_LOSSES}
    load_class = lambda name: getattr(classes[name.split("@")[0]], name.split("@")[1])
    model_cfg = dict(**config.arch.__pydantic_extra__, batch_size=BATCH, vocab_size=vocab_size, seq_len=seq_len,
                     causal=False)
    model = load_class(config.arch.loss.name)(load_class(config.arch.name)(model_cfg),
                                              **config.arch.loss.__pydantic_extra__)
    ema = None
    if config.ema:
        ema = EQR_EMA.EMAHelper(mu=config.ema_rate)
        ema.register(model)
    state = EQR_TRAINING.TrainState(model=model, optimizers=[], optimizer_lrs=[], carry=None, step=0, total_steps=1,
                                    steps_per_epoch=1, ema_helper=ema)
    load["load_model_state_dict"](state.model, ckpt.get("model", ckpt), strict=bool(config.load_strict), assign=True)
    if config.ema and "ema" in ckpt:
        state = load["load_ema"](ckpt, state, config, 0)
    return state.model, config, ckpt


@pytest.mark.parametrize("variant", ["attention-rope", "mlp_t"])
def test_an_exported_model_runs_in_eqrs_evaluation_bit_for_bit_and_back(variant, tmp_path, monkeypatch):
    """`export --format eqr` of a trained eqr run: EqR's evaluate.py steps load
    checkpoints/step_N.pth strictly (its config's load_strict), the EMA shadow naming every
    parameter, and its model (InferenceLossHead, as its evaluation) fed our draws gives the logits,
    q_halt, z_H, z_L, halting and steps of ours bit for bit over 2 training and halt_max_steps
    evaluation ACT steps. Back: the file, read by `train.py eval`'s loader (its config from the
    file), and the directory, by --run.init-from's, give our weights bit for bit."""
    from commands.restore import load_initial_weights, load_weights_for_eval
    from tests.test_reference_export import trained_checkpoint
    from training.config import PRESETS

    config = small_config(**VARIANTS[variant])
    run_dir, trained = trained_checkpoint(tmp_path, config)
    out = tmp_path / "model"
    assert train.command_line(["export", str(run_dir), "--format", "eqr", "--out", str(out)]) == 0
    path = out / "checkpoints" / "step_3.pth"
    theirs, their_config, ckpt = evaluated_by_eqr(path, config.vocab_size, config.seq_len)
    assert their_config.load_strict is True and their_config.arch.loss.name == "losses@InferenceLossHead"
    assert {k.removeprefix("_orig_mod.") for k in ckpt["ema"]["shadow"]} == {n for n, _ in theirs.named_parameters()}
    assert set(ckpt["model"]) == set(theirs.state_dict())

    # Back: the file through train.py eval's loader, the directory through --run.init-from's.
    loaded_config, weights, _, _ = load_weights_for_eval(str(path), PRESETS["eqr-maze"][1], [
        "--model.seq-len", str(config.seq_len), "--model.attention", "sdpa", "--model.halt-exploration-prob", "0"])
    assert loaded_config.model == config
    assert set(weights) == {f"model/{k}" for k in trained.state_dict()}
    assert all(torch.equal(weights[f"model/{k}"], v) for k, v in trained.state_dict().items())
    started = load_initial_weights(str(out), config)
    assert all(torch.equal(started[f"model/{k}"], v) for k, v in trained.state_dict().items())

    ours = TRM(loaded_config.model, exploration_seed=0)
    ours.load_state_dict({k.removeprefix("model/"): v for k, v in weights.items()})
    draws = Draws(monkeypatch, noisy=True)
    for training, steps in ((True, 2), (False, config.halt_max_steps)):
        ours.train(training), theirs.train(training)
        data = list(batches(config, steps))
        carry, their_carry = ours.initial_carry(data[0]), theirs.initial_carry(data[0])
        with torch.no_grad():
            for batch in data:
                carry, outputs, their_carry, _, _, their_outputs = step_side_by_side(
                    ours, theirs, draws, carry, their_carry, batch)
                for key in ("logits", "q_halt_logits"):
                    assert torch.equal(outputs[key], their_outputs[key]), key
                assert torch.equal(carry.z_H, their_carry.inner_carry.z_H)
                assert torch.equal(carry.z_L, their_carry.inner_carry.z_L)


def test_a_checkpoint_saved_by_eqrs_code_evaluates_here_as_there(tmp_path, monkeypatch):
    """EqR's own save_checkpoint (utils/checkpoint.py, unchanged) on its compiled model with an EMA
    that has moved off the weights, its carry (its own dataclasses) and numpy's generator state
    in the file: `train.py eval`'s loader reads the EMA weights (as EqR's evaluate.py) and the
    arch's settings from the file's config, --run.init-from the same, and ours then computes
    what EqR's evaluation of that file computes, bit for bit."""
    from commands.restore import load_initial_weights, load_weights_for_eval
    from training.config import PRESETS

    config = small_config(mlp_t=True, pos_encodings="none")
    _, theirs = ours_and_theirs(config)
    arch = {"name": "eqr@EqRModel", "short_name": "EqR",  # config/arch/eqr.yaml's fields, our sizes
            "loss": {"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy"},
            "halt_exploration_prob": 0.1, "halt_max_steps": 3, "H_cycles": 2, "L_cycles": 2, "H_layers": 0,
            "L_layers": 2, "hidden_size": 32, "num_heads": 4, "expansion": 2, "pos_encodings": "none",
            "board_height": None, "board_width": None, "forward_dtype": "float32", "mlp_t": True, "lambda_": 0.9,
            "noise_scale": 0.02, "H_init_std": 1.0, "L_init_std": 1.0}
    saved = EQR_SCHEMA.PretrainConfig(
        arch=arch, dataset={"name": "tiny", "data_path": str(tmp_path / "data")}, global_batch_size=BATCH,
        epochs=10, lr=1e-4, lr_min_ratio=1.0, lr_warmup_steps=10, weight_decay=1.0, beta1=0.9, beta2=0.95,
        target_q_update_every=4, ema=True, checkpoint_path=str(tmp_path / "run" / "checkpoints"))
    theirs.model.config.lambda_, theirs.model.config.noise_scale = 0.9, 0.02
    compiled = torch.compile(theirs)  # its pretrain.py: tensors saved as _orig_mod.model.inner.*
    ema = EQR_EMA.EMAHelper(mu=0.5)
    ema.register(compiled)
    with torch.no_grad():
        for p in compiled.parameters():
            p.mul_(1.5)  # a training step's worth: the EMA is now half way
    ema.update(compiled)
    batch = next(batches(config, 1))
    carry, *_ = theirs(carry=theirs.initial_carry(batch), batch=batch, return_keys=[])
    state = EQR_TRAINING.TrainState(model=compiled, optimizers=[], optimizer_lrs=[1e-4], carry=carry, step=7,
                                    total_steps=10, steps_per_epoch=1, ema_helper=ema)
    def importable(patch):  # EqR's modules where pickle finds its carry's classes (in EqR's checkout)
        for name, module in (("models", EQR_MODELS), ("models.eqr", EQR), ("models.losses", EQR_LOSSES)):
            patch.setitem(sys.modules, name, module)

    save = eqr_functions(EQR_DIR / "utils" / "checkpoint.py", "save_checkpoint")["save_checkpoint"]
    with monkeypatch.context() as patch:
        importable(patch)
        save(saved, state, SimpleNamespace(dataset=SimpleNamespace(state_dict=lambda: {"epoch": 1})),
             next_iteration=1, rank=0)
    path = tmp_path / "run" / "checkpoints" / "step_7.pth"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(path))  # its classes, numpy's state
    # Read here without EqR's modules (sys.modules as it was): its classes are not imported.

    loaded, weights, step, _ = load_weights_for_eval(str(path), PRESETS["eqr-sudoku"][1], [
        "--model.seq-len", str(config.seq_len), "--model.attention", "sdpa"])
    assert step == 7  # the step EqR saved (reported with the evaluation's results; was 0)
    expected = dataclasses.replace(config, eqr_damping=0.9, eqr_noise=0.02, halt_exploration_prob=0.1)
    assert loaded.model == expected and loaded.data.path == str(tmp_path / "data") and loaded.optim.ema_rate == 0.999
    shadow = {n.removeprefix("_orig_mod."): v for n, v in ema.state_dict().items()}
    names = reference_weights.reference_names(config)
    assert all(torch.equal(weights[f"model/{ours}"], shadow[f"model.inner.{t}"]) for ours, t in names.items())
    assert not torch.equal(weights["model/lm_head.weight"], theirs.model.inner.lm_head.weight)  # not the weights
    started = load_initial_weights(str(path), expected)
    assert all(torch.equal(started[k], v) for k, v in weights.items())

    with monkeypatch.context() as patch:
        importable(patch)
        evaluated, _, _ = evaluated_by_eqr(path, config.vocab_size, config.seq_len)
    ours = TRM(expected, exploration_seed=0)
    ours.load_state_dict({k.removeprefix("model/"): v for k, v in weights.items()})
    draws = Draws(monkeypatch, noisy=True)
    ours.eval(), evaluated.eval()
    carry, their_carry = ours.initial_carry(batch), evaluated.initial_carry(batch)
    with torch.no_grad():
        for _ in range(config.halt_max_steps):
            carry, outputs, their_carry, _, _, their_outputs = step_side_by_side(
                ours, evaluated, draws, carry, their_carry, batch)
            assert torch.equal(outputs["logits"], their_outputs["logits"])
            assert torch.equal(outputs["q_halt_logits"], their_outputs["q_halt_logits"])
