"""modeling/attention.py: the blockwise attention computes the plain attention's outputs and gradients
(float32 and bf16, on CPU eager and on the XLA device the trainer uses, where its backward is
fenced by an optimization barrier), and a model built with either gives the same loss and
gradients. The tolerances are errors against a float64 reference of the same inputs: float32
rounding for float32; for bf16, no more than 1.5x the plain attention's own bf16 error (measured:
the blockwise form's errors are 1.0-1.4x the plain attention's)."""
import dataclasses

import pytest
import torch

from model import TRM, TRMConfig, loss_and_metrics
from modeling import attention

SHAPE = (2, 4, 100, 16)  # batch, heads, seq, head_dim: 100 keys are 3 blocks of 32 and one of 4


def attention_and_grads(kind, dtype, device="cpu", block=32, seed=0):
    """The attention's output and the gradients of q, k, v for a fixed upstream gradient, as float64 on CPU."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, upstream = (2 * torch.randn(SHAPE, dtype=torch.float64, generator=generator) for _ in range(4))
    leaves = [t.to(dtype).to(device).requires_grad_() for t in (q, k, v)]
    out = attention.attend(*leaves, kind, block)
    out.backward(upstream.to(dtype).to(device))
    return [t.detach().cpu().double() for t in (out, *(leaf.grad for leaf in leaves))]


def max_errors(got, truth):
    return [(a - b).abs().max().item() for a, b in zip(got, truth)]


@pytest.mark.parametrize("block", [32, 100, 512])
def test_blockwise_attention_equals_the_plain_attention_in_float32(block):
    truth = attention_and_grads("sdpa", torch.float64)
    errors = max_errors(attention_and_grads("blockwise", torch.float32, block=block), truth)
    assert max(errors) < 3e-5, errors
    # In float64 it is the plain attention up to the order of the sums.
    assert max_errors(attention_and_grads("blockwise", torch.float64, block=block), truth)[0] < 1e-12


def test_blockwise_attention_in_bf16_is_as_accurate_as_the_plain_attention():
    truth = attention_and_grads("sdpa", torch.float64)
    plain = max_errors(attention_and_grads("sdpa", torch.bfloat16), truth)
    blockwise = max_errors(attention_and_grads("blockwise", torch.bfloat16), truth)
    for name, p, b in zip(("output", "dq", "dk", "dv"), plain, blockwise):
        assert b <= 1.5 * p, (name, b, p)


def test_blockwise_attention_on_xla_equals_cpu_and_fences_its_backward():
    import torch_xla

    from training import capture  # noqa: F401 - sets the barrier, as a training run does
    device = torch_xla.device()
    truth = attention_and_grads("sdpa", torch.float64)
    for dtype, tolerance in ((torch.float32, 3e-5), (torch.bfloat16, None)):
        on_xla = attention_and_grads("blockwise", dtype, device)
        if tolerance:
            assert max(max_errors(on_xla, truth)) < tolerance
        else:  # bf16: the XLA device's plain attention computes in float32; bound by the CPU's bf16 error
            plain = max_errors(attention_and_grads("sdpa", dtype), truth)
            assert all(e <= 1.5 * p for e, p in zip(max_errors(on_xla, truth), plain))
    # The backward's inputs pass an optimization barrier (else XLA merges the recomputed scores
    # with the forward's and keeps them alive): it is in the gradient's graph.
    q, k, v = (torch.randn(SHAPE).to(device).requires_grad_() for _ in range(3))
    attention.attend(q, k, v, "blockwise", 32).sum().backward()
    assert "opt-barrier" in torch_xla._XLAC._get_xla_tensors_hlo([q.grad])


def test_a_model_with_blockwise_attention_trains_as_with_the_plain_attention():
    """The same weights and batch, one training ACT step in float32 on CPU: the loss and every
    weight's gradient agree within float32 rounding."""
    config = TRMConfig(seq_len=30, vocab_size=6, num_puzzle_identifiers=3, hidden_size=32, num_heads=2,
                       expansion=2.0, H_cycles=2, L_cycles=2, puzzle_emb_ndim=32, halt_max_steps=2,
                       forward_dtype="float32", attention_block=8)
    generator = torch.Generator().manual_seed(0)
    batch = {"inputs": torch.randint(0, 6, (4, 30), generator=generator),
             "labels": torch.randint(0, 6, (4, 30), generator=generator),
             "puzzle_identifiers": torch.randint(0, 3, (4,), generator=generator)}
    results = {}
    for kind in ("sdpa", "blockwise"):
        torch.manual_seed(0)
        model = TRM(dataclasses.replace(config, attention=kind)).train()
        carry, outputs = model(model.initial_carry(batch), batch)
        loss, _ = loss_and_metrics(carry, outputs)
        loss.backward()
        results[kind] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (plain_loss, plain_grads), (loss, grads) = results["sdpa"], results["blockwise"]
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for name, grad in grads.items():
        scale = plain_grads[name].abs().max().item()
        assert (grad - plain_grads[name]).abs().max().item() <= 1e-4 * scale + 1e-7, name
