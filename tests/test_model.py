"""model.py: numbers against closed forms and slow references, ACT semantics, XLA hygiene."""
import copy
import math

import pytest
import torch

import model
from model import TRM, Carry, TRMConfig, loss_and_metrics
from reference import weights as reference_weights
from training.optim import EMA, AdamATan2, SignSGD


def tiny_config(**overrides) -> TRMConfig:
    fields = dict(seq_len=16, vocab_size=6, num_puzzle_identifiers=10, hidden_size=32, num_heads=4,
                  puzzle_emb_ndim=32, puzzle_emb_len=2, H_cycles=2, L_cycles=2, L_layers=2,
                  halt_max_steps=4, forward_dtype="float32")
    fields.update(overrides)
    return TRMConfig(**fields)


def random_batch(config: TRMConfig, size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(1, config.vocab_size, (size, config.seq_len), generator=g, dtype=torch.int32)
    labels[:, : config.seq_len // 4] = model.IGNORE_LABEL_ID  # like given cells of a puzzle
    return {
        "inputs": torch.randint(0, config.vocab_size, (size, config.seq_len), generator=g, dtype=torch.int32),
        "labels": labels,
        "puzzle_identifiers": torch.randint(0, config.num_puzzle_identifiers, (size,), generator=g, dtype=torch.int32),
    }


# -- loss ---------------------------------------------------------------------------------------


def test_stablemax_cross_entropy_matches_closed_form():
    logits = torch.tensor([[-1.0, 0.0, 2.0], [-3.0, -1.0, 0.5]])
    labels = torch.tensor([2, 0])
    # s(-1)=1/2, s(0)=1, s(2)=3 -> p(2)=3/4.5 ; s(-3)=1/4, s(-1)=1/2, s(0.5)=1.5 -> p(0)=0.25/2.25
    expected = torch.tensor([-math.log(3 / 4.5), -math.log(0.25 / 2.25)])
    torch.testing.assert_close(model.stablemax_cross_entropy(logits, labels), expected)
    ignored = model.stablemax_cross_entropy(logits, torch.tensor([2, model.IGNORE_LABEL_ID]))
    assert ignored[1] == 0 and torch.isclose(ignored[0], expected[0])


def reference_stablemax_cross_entropy_float64(logits, labels):
    """The reference's formula (models/losses.py), evaluated in float64 as it does."""
    x = logits.double()
    s = torch.where(x < 0, 1 / (1 - x + 1e-30), x + 1)
    log_probs = torch.log(s / s.sum(-1, keepdim=True))
    valid = labels != model.IGNORE_LABEL_ID
    picked = log_probs.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return -torch.where(valid, picked, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stablemax_loss_and_gradient_are_finite_and_equal_the_float64_reference(dtype):
    # Exactly 1.0 is where the unused 1/(1-x) branch's derivative overflows float32 (bf16 logits
    # land on it often); 0.0, -0.0 and huge values of both signs are the other edges.
    big = torch.finfo(dtype).max
    rows = [[1.0, 0.0, -0.0, 2.0], [1.0, 1.0, 1.0, 1.0], [-big, big, 1.0, 0.5],
            [big, big, -1.0, -0.0], [-big, -big, -3.0, 1e-3], [-0.5, 7.0, -120.0, 1.0]]
    logits = torch.tensor(rows, dtype=dtype)
    labels = torch.tensor([0, 3, 1, 0, 2, model.IGNORE_LABEL_ID])
    ours = logits.clone().requires_grad_(True)
    loss = model.stablemax_cross_entropy(ours, labels)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(ours.grad).all(), (loss, ours.grad)

    theirs = logits.double().requires_grad_(True)
    expected = reference_stablemax_cross_entropy_float64(theirs, labels)
    expected.sum().backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-6)


def test_bf16_training_step_has_finite_gradients():
    # The presets' dtype at initialisation: a few of the bf16 logits are exactly 1.0.
    torch.manual_seed(0)
    config = tiny_config(forward_dtype="bfloat16")
    m = TRM(config).train()
    batch = random_batch(config, 32, seed=1)
    carry, outputs = m(m.initial_carry(batch), batch)
    assert (outputs["logits"] == 1.0).any()
    loss, _ = loss_and_metrics(carry, outputs)
    loss.backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None] + [m.puzzle_embedding.batch_rows.grad]
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_loss_and_metrics_by_hand():
    # Two rows of three tokens, vocab 2. Row 0 halted and fully correct; row 1 halted, one of two
    # valid tokens wrong; a third row not halted is left out of the metrics but not of the loss.
    big = 5.0
    logits = torch.tensor([
        [[big, 0.0], [0.0, big], [big, 0.0]],
        [[big, 0.0], [big, 0.0], [0.0, 0.0]],
        [[big, 0.0], [big, 0.0], [big, 0.0]],
    ])
    labels = torch.tensor([[0, 1, 0], [0, 1, -100], [0, 0, 0]])
    q_halt = torch.tensor([1.0, -2.0, 3.0])
    carry = Carry(z_H=torch.zeros(3), z_L=torch.zeros(3), steps=torch.tensor([3, 5, 1], dtype=torch.int32),
                  halted=torch.tensor([True, True, False]), current_data={"labels": labels},
                  rng_counter=torch.tensor(0))
    loss, metrics = loss_and_metrics(carry, {"logits": logits, "q_halt_logits": q_halt,
                                             "q_continue_logits": torch.zeros(3)})
    right, wrong = math.log(big + 1 + 1) - math.log(big + 1), math.log(big + 2) - math.log(1)
    lm = (3 * right) / 3 + (right + wrong) / 2 + (3 * right) / 3
    bce = lambda x, y: math.log1p(math.exp(-x)) if y else math.log1p(math.exp(x))  # noqa: E731
    q = bce(1.0, 1) + bce(-2.0, 0) + bce(3.0, 1)
    assert loss.item() == pytest.approx(lm + 0.5 * q, rel=1e-6)
    assert metrics["lm_loss"].item() == pytest.approx(lm, rel=1e-6)
    assert metrics["count"].item() == 2
    assert metrics["accuracy"].item() == pytest.approx(1.0 + 0.5)
    assert metrics["exact_accuracy"].item() == 1
    assert metrics["q_halt_accuracy"].item() == 2  # row 0: q>=0 and correct; row 1: q<0 and wrong
    assert metrics["steps"].item() == 8

    # Evaluation's losses: only the counted rows (halted, with labels), the loss itself unchanged.
    labels[1] = model.IGNORE_LABEL_ID  # a padding row: halted but without labels
    outputs = {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": torch.zeros(3)}
    loss_all, all_rows = loss_and_metrics(carry, outputs)
    loss_counted, counted = loss_and_metrics(carry, outputs, halted_losses=True)
    assert loss_counted.item() == loss_all.item()
    assert counted["count"].item() == 1
    assert counted["lm_loss"].item() == pytest.approx(right, rel=1e-6)
    assert counted["q_halt_loss"].item() == pytest.approx(bce(1.0, 1), rel=1e-6)
    assert all_rows["q_halt_loss"].item() == pytest.approx(bce(1.0, 1) + bce(-2.0, 1) + bce(3.0, 1), rel=1e-6)


# -- the model -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    dict(mlp_t=True, pos_encodings="none"), dict(pos_encodings="rope"), dict(pos_encodings="learned"),
    dict(puzzle_emb_ndim=0, puzzle_emb_len=0), dict(no_ACT_continue=False),
])
def test_training_step_runs_and_reduces_loss(overrides):
    torch.manual_seed(0)
    config = tiny_config(**overrides)
    m = TRM(config)
    batch = random_batch(config, 8, seed=1)
    opt = AdamATan2(m.parameters(), lr=3e-4, weight_decay=0.0)
    losses = []
    for _ in range(15):
        carry = m.initial_carry(batch)
        carry, outputs = m(carry, batch)
        loss, metrics = loss_and_metrics(carry, outputs)
        (loss / 8).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        assert ("q_continue_loss" in metrics) == (not config.no_ACT_continue)
    assert losses[-1] < 0.9 * losses[0]


def test_eval_runs_exactly_halt_max_steps():
    config = tiny_config(halt_max_steps=5)
    m = TRM(config).eval()
    with torch.no_grad():
        m.q_head.bias.fill_(10.0)  # would halt at once in training
    batch = random_batch(config, 4, seed=0)
    carry = m.initial_carry(batch)
    with torch.no_grad():
        for step in range(1, 6):
            carry, _ = m(carry, batch)
            assert carry.steps.tolist() == [step] * 4
            assert carry.halted.tolist() == [step == 5] * 4


def test_halted_rows_take_new_data_and_others_keep_theirs():
    config = tiny_config(halt_exploration_prob=0.0)
    m = TRM(config).train()
    first, second = random_batch(config, 4, seed=0), random_batch(config, 4, seed=1)
    carry = m.initial_carry(first)
    carry, _ = m(carry, first)
    assert all(torch.equal(carry.current_data[k], first[k]) for k in first)
    carry.halted = torch.tensor([True, False, True, False])
    z_H_before = carry.z_H.clone()
    carry, _ = m(carry, second)
    for k in first:
        for row, expected in enumerate([second, first, second, first]):
            assert torch.equal(carry.current_data[k][row], expected[k][row])
    assert carry.steps.tolist() == [1, 2, 1, 2]
    # A kept row continues from its state, a reset row from H_init: the states differ from a
    # fresh start only on kept rows.
    fresh = m.initial_carry(second)
    fresh, _ = m(fresh, second)
    assert torch.allclose(carry.z_H[0], fresh.z_H[0]) and torch.allclose(carry.z_H[2], fresh.z_H[2])
    assert not torch.allclose(carry.z_H[1], fresh.z_H[1])
    assert z_H_before.shape == carry.z_H.shape


def test_training_halts_on_q_and_after_halt_max_steps():
    config = tiny_config(halt_exploration_prob=0.0, halt_max_steps=3)
    m = TRM(config).train()
    batch = random_batch(config, 4, seed=0)
    with torch.no_grad():
        m.q_head.bias.fill_(10.0)
    carry, _ = m(m.initial_carry(batch), batch)
    assert carry.halted.all()  # q_halt > 0
    with torch.no_grad():
        m.q_head.bias.fill_(-10.0)
    carry = m.initial_carry(batch)
    halted = []
    for _ in range(3):
        carry, _ = m(carry, batch)
        halted.append(bool(carry.halted.all()))
    assert halted == [False, False, True]


def test_exploration_noise_has_the_reference_distribution():
    rows = torch.arange(200_000)
    u = model.hashed_uniform(7, torch.tensor(3), rows, 0)
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs((u < 0.1).float().mean().item() - 0.1) < 0.003
    draw = model.hashed_uniform(7, torch.tensor(3), rows, 1)
    min_steps = 2 + (draw * 15).to(torch.int32)
    counts = torch.bincount(min_steps, minlength=17)[2:]
    assert counts.min() > 0.9 * 200_000 / 15 and counts.max() < 1.1 * 200_000 / 15
    assert abs(torch.corrcoef(torch.stack([u, draw]))[0, 1].item()) < 0.01
    assert not torch.equal(u, model.hashed_uniform(7, torch.tensor(4), rows, 0))


@pytest.mark.parametrize("field,value,message", [
    ("num_heads", 9, "num_heads=9 gives heads of width hidden_size // num_heads = 3, odd"),
    ("pos_encodings", "alibi", "pos_encodings must be rope, rope2d, learned or none, got 'alibi'"),
    ("forward_dtype", "float64", "forward_dtype must be one of .* got 'float64'"),
    ("H_cycles", 0, "H_cycles=0 must be >= 1"),
    ("L_cycles", -1, "L_cycles=-1 must be >= 1"),
    ("halt_exploration_prob", 1.5, r"halt_exploration_prob=1.5 must be in \[0, 1\]"),
    ("rope_theta", float("inf"), "rope_theta=inf must be a finite number > 0"),
])
def test_bad_config_values_are_named(field, value, message):
    """The model refuses them when built (check_config reports the same before a run)."""
    with pytest.raises(ValueError, match=message):
        TRM(tiny_config(**{field: value}))


def test_reference_state_dict_round_trip_and_identifier_reset():
    source = TRM(tiny_config())
    with torch.no_grad():
        source.puzzle_embedding.weight.normal_()
    saved = {"_orig_mod." + k: v for k, v in reference_weights.reference_state_dict(source).items()}
    assert "_orig_mod.model.inner.L_level.layers.1.self_attn.qkv_proj.weight" in saved

    target = TRM(tiny_config())
    reference_weights.load_reference_state_dict(target, saved)
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name

    other = TRM(tiny_config(num_puzzle_identifiers=3))
    reference_weights.load_reference_state_dict(other, saved)
    mean_row = source.puzzle_embedding.weight.mean(0)
    torch.testing.assert_close(other.puzzle_embedding.weight, mean_row.expand(3, -1))

    with pytest.raises(ValueError, match="missing: .*mlp_t.gate_up_proj"):
        reference_weights.load_reference_state_dict(TRM(tiny_config(mlp_t=True)), saved)


def test_parameter_counts_of_the_paper_configurations():
    # Sizes quoted in the paper: about 5M for TRM-MLP on Sudoku and 7M for attention TRM.
    def count(**kw):
        return sum(p.numel() for p in TRM(TRMConfig(**kw)).parameters())
    sudoku_mlp = count(seq_len=81, vocab_size=11, mlp_t=True, pos_encodings="none")
    sudoku_att = count(seq_len=81, vocab_size=11)
    arc = count(seq_len=900, vocab_size=12, num_puzzle_identifiers=1000, H_cycles=3, L_cycles=4)
    assert 4.5e6 < sudoku_mlp < 5.5e6
    assert 6.5e6 < sudoku_att < 7.5e6
    assert 6.5e6 < arc < 7.5e6


# -- XLA ----------------------------------------------------------------------------------------


def _train_steps(m, batches, lrs, device, shard=None):
    """Run one TRM step per batch on `device`; returns losses (device tensors) and the model."""
    opt = AdamATan2(m.parameters(), betas=(0.9, 0.95), weight_decay=0.1)
    sgd = SignSGD(m.puzzle_embedding, weight_decay=0.1)
    ema = EMA(m, rate=0.9)
    carry = None
    losses, compiles_after = [], []
    for batch, lr in zip(batches, lrs):
        batch = {k: v.to(device) for k, v in batch.items()}
        if shard:
            batch = {k: shard(v) for k, v in batch.items()}
        if carry is None:
            carry = m.initial_carry(batch)
            if shard:
                carry = Carry.from_tensors({k: shard(v) if v.ndim else v for k, v in carry.tensors().items()})
        lr_tensor = torch.tensor(lr).to(device)  # a graph input, not a constant: no recompile
        for group in opt.param_groups:
            group["lr"] = lr_tensor
        sgd.lr = lr_tensor
        carry, outputs = m(carry, batch)
        loss, _ = loss_and_metrics(carry, outputs)
        (loss / batch["inputs"].shape[0]).backward()
        opt.step()
        sgd.step()
        opt.zero_grad(set_to_none=True)
        sgd.zero_grad()
        ema.update(m)
        losses.append(loss.detach())
        if device.type == "xla":
            import torch_xla
            import torch_xla.debug.metrics as met
            torch_xla.sync()
            compiles_after.append(met.counter_value("UncachedCompile") or 0)
    return losses, ema, compiles_after


def test_sharded_xla_step_equals_cpu_eager(spmd_mesh):
    import torch_xla.debug.metrics as met

    import sharding

    torch.manual_seed(0)
    config = tiny_config(halt_max_steps=3)
    cpu_model = TRM(config).train()
    with torch.no_grad():
        cpu_model.q_head.weight.normal_(std=0.5)  # so that q-halting and exploration both occur
    xla_model = copy.deepcopy(cpu_model).to(sharding.device())
    batches = [random_batch(config, 16, seed=s) for s in range(6)]
    lrs = [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3]

    met.clear_all()
    xla_losses, xla_ema, compiles = _train_steps(
        xla_model, batches, lrs, sharding.device(), shard=lambda t: sharding.shard_batch_dim(t, spmd_mesh))
    assert compiles[2] == compiles[-1], f"recompiled after warm-up: {compiles}"
    fallbacks = [name for name in met.counter_names() if name.startswith("aten::")]
    assert not fallbacks, f"CPU fallbacks: {fallbacks}"
    assert met.metric_data("TransferFromDeviceTime") is None, "the step read a device value"

    cpu_losses, cpu_ema, _ = _train_steps(cpu_model, batches, lrs, torch.device("cpu"))
    torch.testing.assert_close(torch.stack(xla_losses).cpu(), torch.stack(cpu_losses), rtol=1e-5, atol=1e-5)
    for name, p in xla_model.state_dict().items():
        torch.testing.assert_close(p.cpu(), cpu_model.state_dict()[name], rtol=1e-5, atol=1e-5, msg=name)
    for name in cpu_ema.shadow:
        torch.testing.assert_close(xla_ema.shadow[name].cpu(), cpu_ema.shadow[name], rtol=1e-5, atol=1e-5)
