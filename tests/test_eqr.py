"""The eqr arch (modeling/schemes.py's EqR) against EqR's own model (tests/reference/eqr/, vendored
from github.com/locuslab/EqR): forward, carried states, halting, loss, metrics and gradients over
several ACT steps in training and evaluation, with EqR's random draws (its initial states and
its noise) replaced by the ones our counter hash drew; and the draws themselves: deterministic,
the right distributions, different per row, step, update and position."""
import importlib
import sys
from pathlib import Path

import pytest
import torch

from model import TRM, TRMConfig, loss_and_metrics
from modeling import counter_hash
from modeling.schemes import SCHEMES, arch_defaults
from reference import weights as reference_weights

EQR_DIR = Path(__file__).resolve().parent / "reference" / "eqr"
BATCH = 6

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_eqr():
    """EqR's models.eqr and models.losses, imported with their folder first on sys.path under
    their own package names (`models`, `utils`), which are then put back as they were: TRM's
    vendored reference (tests/reference/, test_archs.py) has a `models` package too."""
    ours = lambda name: name.split(".")[0] in ("models", "utils")
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
    sys.path.insert(0, str(EQR_DIR))
    try:
        return importlib.import_module("models.eqr"), importlib.import_module("models.losses")
    finally:
        sys.path.remove(str(EQR_DIR))
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


EQR, EQR_LOSSES = load_eqr()


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
            draws.start(carry.halted)
            with torch.set_grad_enabled(training):
                carry, outputs = ours(carry, batch)
                loss, metrics = loss_and_metrics(carry, outputs)
                their_carry, their_loss, their_metrics, their_outputs, _ = theirs(
                    carry=their_carry, batch=batch, return_keys=["logits", "q_halt_logits"])
            assert draws.handed_over()
            assert torch.equal(carry.halted, their_carry.halted) and torch.equal(carry.steps, their_carry.steps)
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
