"""training/optim.py: AdamATan2 against the adam-atan2 kernel's rule, SignSGD against a per-id loop, EMA."""
import copy
import math

import pytest
import torch

import model
from model import TRM
from tests.test_model import tiny_config
from training.optim import EMA, AdamATan2, SignSGD, dense_optimizer


def test_adam_atan2_matches_hand_computed_steps():
    torch.manual_seed(0)
    p0, p1 = torch.randn(5), torch.randn(2, 3)
    grads = [(torch.randn(5), torch.randn(2, 3)) for _ in range(4)]
    lrs = [0.0, 0.1, 0.05, 0.3]
    decays, (b1, b2) = (0.5, 0.0), (0.9, 0.95)
    params = [torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p1.clone())]
    opt = AdamATan2([{"params": [params[0]], "weight_decay": decays[0]},
                     {"params": [params[1]], "weight_decay": decays[1]}], betas=(b1, b2))
    for (g0, g1), lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = torch.tensor(lr)
        params[0].grad, params[1].grad = g0.clone(), g1.clone()
        opt.step()

    # The rule written out element by element in float64.
    for i, (start, decay) in enumerate([(p0, decays[0]), (p1, decays[1])]):
        for index in range(start.numel()):
            theta, m, v = start.flatten()[index].item(), 0.0, 0.0
            for t, (step_grads, lr) in enumerate(zip(grads, lrs), start=1):
                g = step_grads[i].flatten()[index].item()
                theta *= 1 - lr * decay
                m = m + (g - m) * (1 - b1)
                v = v + (g * g - v) * (1 - b2)
                # The adam-atan2 kernel: bias correction 1 scales the step, outside atan2.
                theta -= lr / (1 - b1 ** t) * math.atan2(m, math.sqrt(v) / math.sqrt(1 - b2 ** t))
            assert params[i].flatten()[index].item() == pytest.approx(theta, abs=1e-6)


def test_adam_atan2_first_step_is_the_kernels_not_the_bias_corrected_atan2():
    # Step 1 from zero state: the kernel moves lr/(1-b1)·atan(1-b1) ≈ 0.997·lr; putting the
    # correction inside atan2 would move atan2(g, |g|) = π/4·lr, 27% less.
    p = torch.nn.Parameter(torch.zeros(3))
    opt = AdamATan2([p], lr=torch.tensor(0.01), betas=(0.9, 0.95))
    p.grad = torch.tensor([2.0, -0.5, 1e-3])
    opt.step()
    expected = -0.01 / 0.1 * math.atan(0.1)
    torch.testing.assert_close(p.detach(), torch.tensor([expected, -expected, expected]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_torch_adam_and_adamw_on_xla_with_a_tensor_lr_equal_torch_on_the_cpu(name):
    # As the training step runs them: on the XLA device, capturable, a device tensor lr written into
    # the group every step (so the traced graph never changes), state made before the first step.
    import torch_xla

    import sharding

    torch.manual_seed(0)
    start = [torch.randn(5), torch.randn(2, 3)]
    grads = [[torch.randn(5), torch.randn(2, 3)] for _ in range(4)]
    lrs = [0.0, 0.1, 0.05, 0.3]
    reference = [torch.nn.Parameter(p.clone()) for p in start]
    torch_cpu = (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(
        reference, lr=0.0, betas=(0.9, 0.95), weight_decay=0.5)
    device = sharding.device()
    params = [torch.nn.Parameter(p.clone().to(device)) for p in start]
    ours = dense_optimizer(params, name, betas=(0.9, 0.95), weight_decay=0.5)
    assert sorted(ours.state[params[0]]) == ["exp_avg", "exp_avg_sq", "step"]  # made before the first step
    for step_grads, lr in zip(grads, lrs):
        for group in torch_cpu.param_groups:
            group["lr"] = lr
        for group in ours.param_groups:
            group["lr"] = torch.tensor(lr).to(device)
        for p, q, g in zip(reference, params, step_grads):
            p.grad, q.grad = g.clone(), g.clone().to(device)
        torch_cpu.step()
        ours.step()
        torch_xla.sync()
    for p, q in zip(reference, params):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)


def test_dense_optimizer_names_the_choices():
    with pytest.raises(ValueError, match="unknown optimizer 'lion': use one of adam_atan2, adamw, adam"):
        dense_optimizer([torch.nn.Parameter(torch.zeros(2))], "lion")


def test_adam_atan2_refuses_betas_that_round_to_one_in_float32():
    p = torch.nn.Parameter(torch.zeros(2))
    AdamATan2([p], betas=(0.9, 0.99999994))  # the largest float32 below 1 is fine
    with pytest.raises(ValueError, match=r"betas must be .* below 1 in float32 .* got \(0.9, 0.99999999\)"):
        AdamATan2([p], betas=(0.9, 0.99999999))


def test_signsgd_with_duplicate_ids_matches_per_id_loop():
    torch.manual_seed(0)
    table = torch.randn(20, 8)
    ids = torch.tensor([3, 5, 3, 3, 7, 5, 0, 19, 19, 2, 3, 11])
    grad = torch.randn(len(ids), 8)
    lr, decay = 0.01, 0.1
    emb = model.SparseEmbedding(20, 8)
    emb.weight.copy_(table)
    emb.train()
    emb(ids)
    emb.batch_rows.grad = grad
    SignSGD(emb, lr=lr, weight_decay=decay).step()

    expected = table.clone()
    for row_id in set(ids.tolist()):
        summed = grad[ids == row_id].sum(0)
        expected[row_id] = table[row_id] * (1 - lr * decay) - lr * torch.sign(summed)
    torch.testing.assert_close(emb.weight, expected)
    untouched = [i for i in range(20) if i not in set(ids.tolist())]
    assert torch.equal(emb.weight[untouched], table[untouched])


def test_signsgd_sums_exactly_and_keeps_a_nan_row_to_its_own_id():
    # Per id the float32 sum decides the sign: 1 + (-1 + 2^-12) > 0 survives only without the
    # bf16 rounding a default-precision matmul applies on a TPU. A NaN gradient of id 5 must not
    # touch the rows of other ids (an equality-matrix matmul spreads it to every row).
    emb = model.SparseEmbedding(8, 2)
    emb.train()
    ids = torch.tensor([3, 5, 3, 1, 5])
    emb(ids)
    emb.batch_rows.grad = torch.tensor([[1.0, -2.0], [float("nan"), 0.0], [-1.0 + 2 ** -12, 2.0 - 2 ** -11],
                                        [0.0, -1.0], [1.0, 1.0]])
    SignSGD(emb, lr=0.5, weight_decay=0.0).step()
    assert emb.weight[3].tolist() == [-0.5, 0.5]  # signs of (2^-12, -2^-11)
    assert emb.weight[1].tolist() == [0.0, 0.5]
    assert emb.weight[5, 1].item() == -0.5  # (its NaN column gets whatever sign(NaN) gives)
    untouched = [0, 2, 4, 6, 7]
    assert torch.equal(emb.weight[untouched], torch.zeros(5, 2))


def test_ema_is_the_closed_form_average_and_skips_the_puzzle_table():
    m = TRM(tiny_config())
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    ema = EMA(m, rate=0.9)
    assert "puzzle_embedding.weight" not in ema.shadow
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    ema.update(m)
    ema.update(m)
    target = copy.deepcopy(m)
    ema.copy_to(target)
    for name, p in target.named_parameters():
        # two updates toward start+1: start + 1 - 0.9^2
        torch.testing.assert_close(p, start[name] + (1 - 0.81))
