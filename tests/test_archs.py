"""Every arch against the reference's own code (tests/reference/, run side by side), and the
paper's two TRM ablations against closed forms: forward, loss, metrics and gradients over
several ACT steps, in training and in evaluation, with the weights moved across both ways."""
import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from model import TRM, TRMConfig, loss_and_metrics
from modeling.schemes import arch_defaults
from reference import weights as reference_weights
from training.config import PRESETS, arch_in, presets_for, with_arch

sys.path.insert(0, str(Path(__file__).resolve().parent / "reference"))

from models.losses import ACTLossHead  # noqa: E402  (the vendored reference)

REFERENCE_CLASSES = {
    "trm": "models.recursive_reasoning.trm.TinyRecursiveReasoningModel_ACTV1",
    "trm_singlez": "models.recursive_reasoning.trm_singlez.TinyRecursiveReasoningModel_ACTV1",
    "trm_hier6": "models.recursive_reasoning.trm_hier6.TinyRecursiveReasoningModel_ACTV1",
    "hrm": "models.recursive_reasoning.hrm.HierarchicalReasoningModel_ACTV1",
    "transformers_baseline": "models.recursive_reasoning.transformers_baseline.Model_ACTV2",
}
BATCH = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_config(arch: str, dtype: str, **overrides) -> TRMConfig:
    fields = dict(seq_len=8, vocab_size=6, num_puzzle_identifiers=5, hidden_size=32, num_heads=4,
                  expansion=2.0, puzzle_emb_ndim=40, puzzle_emb_len=2, H_cycles=2, L_cycles=2,
                  L_layers=2, halt_max_steps=3, halt_exploration_prob=0.0, forward_dtype=dtype,
                  attention="sdpa", pos_encodings="rope")
    fields.update(arch_defaults(arch))
    # Small sizes of each arch's own: HRM's two networks of 2 and 1 blocks; the baseline's 3 heads
    # of width 10 on a 32-wide state (their total, 30, narrower than the state, as 12 x 42 on 512).
    fields.update(dict(hrm=dict(H_cycles=2, L_cycles=2, H_layers=1, L_layers=2),
                       transformers_baseline=dict(H_layers=2, num_heads=3)).get(arch, {}))
    fields.update(overrides)
    return TRMConfig(**fields)


def reference_model(config: TRMConfig) -> ACTLossHead:
    module, name = REFERENCE_CLASSES[config.arch].rsplit(".", 1)
    cls = getattr(__import__(module, fromlist=[name]), name)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return ACTLossHead(cls(dict(fields, batch_size=BATCH)), "stablemax_cross_entropy")


def batches(config: TRMConfig, count: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(count):
        labels = torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=g, dtype=torch.int32)
        labels[:, :2] = -100
        yield {"inputs": torch.randint(0, config.vocab_size, (BATCH, config.seq_len), generator=g, dtype=torch.int32),
               "labels": labels,
               "puzzle_identifiers": torch.randint(0, config.num_puzzle_identifiers, (BATCH,), generator=g,
                                                   dtype=torch.int32)}


def close(ours, theirs, tol, what):
    ours, theirs = ours.double(), theirs.double()
    scale = theirs.abs().max().clamp_min(1e-12)
    err = ((ours - theirs).abs().max() / scale).item()
    assert err <= tol, f"{what}: largest difference {err:.3g} of the largest value (tolerance {tol})"
    return err


def ours_and_theirs(arch: str, dtype: str, **overrides):
    torch.manual_seed(0)
    ours = TRM(small_config(arch, dtype, **overrides))
    with torch.no_grad():
        ours.puzzle_embedding.weight.normal_()
        ours.q_head.weight.normal_(std=0.3)  # so that rows halt at different steps
        ours.q_head.bias.zero_()
    theirs = reference_model(ours.config)
    theirs.load_state_dict(reference_weights.reference_state_dict(ours))
    # ... and back: the reference's own state dict loads into a fresh model of ours.
    fresh = TRM(ours.config)
    reference_weights.load_reference_state_dict(fresh, {"_orig_mod." + k: v for k, v in theirs.state_dict().items()})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), ours.state_dict().values()))
    return ours, theirs


def run_side_by_side(arch: str, dtype: str, training: bool, steps: int, tol: float, **overrides) -> dict[str, float]:
    """Each ACT step of both: every output, the loss, each metric and (training) every
    gradient, compared; returns the largest relative difference of each kind."""
    ours, theirs = ours_and_theirs(arch, dtype, **overrides)
    ours.train(training), theirs.train(training)
    names = reference_weights.reference_names(ours.config)
    errors: dict[str, float] = {}
    data = list(batches(ours.config, steps))
    carry, their_carry = ours.initial_carry(data[0]), theirs.initial_carry(data[0])
    for step, batch in enumerate(data):
        with torch.set_grad_enabled(training):
            carry, outputs = ours(carry, batch)
            loss, metrics = loss_and_metrics(carry, outputs)
            their_carry, their_loss, their_metrics, their_outputs, _ = theirs(
                carry=their_carry, batch=batch, return_keys=list(outputs))
        assert torch.equal(carry.halted, their_carry.halted) and torch.equal(carry.steps, their_carry.steps)
        assert set(outputs) == set(their_outputs)
        # logits, q_halt, q_continue, the Q-continue target: ours and the reference's are other
        # decompositions of the same sums, which a CPU's BLAS may add in other orders (OUTPUTS_TOL).
        for key, value in outputs.items():
            errors["outputs"] = max(errors.get("outputs", 0), close(value, their_outputs[key], OUTPUTS_TOL[dtype], key))
        bitwise = all(torch.equal(value, their_outputs[key]) for key, value in outputs.items())
        # The loss: ours in float32, theirs in float64 (docs/faithfulness.md), of the same logits
        # (1e-6) or of logits as far apart as OUTPUTS_TOL.
        errors["loss"] = max(errors.get("loss", 0), close(loss, their_loss, 1e-6 if bitwise else OUTPUTS_TOL[dtype],
                                                          "loss"))
        assert set(metrics) == set(their_metrics)
        for key, value in metrics.items():
            # Argmax-derived metrics move by a whole token when one logit's rounding flips an argmax:
            # compared when the logits are the same bits, the losses always.
            if bitwise or "loss" in key:
                close(value, their_metrics[key].float(), 1e-6 if bitwise else OUTPUTS_TOL[dtype], key)
        # Gradients of outputs as far apart as OUTPUTS_TOL are as far apart as they are.
        grad_tol = tol if bitwise else max(tol, OUTPUTS_TOL[dtype])
        if training:
            for m in (ours, theirs):
                m.zero_grad(set_to_none=True)
            loss.backward()
            their_loss.backward()
            theirs_by_name = dict(theirs.named_parameters())
            for name, param in ours.named_parameters():
                grad = theirs_by_name[f"model.inner.{names[name]}"].grad
                if name == "token_embedding" and dtype == "bfloat16":
                    # Ours sums the tokens' rows in float32 (docs/faithfulness.md), the reference's
                    # CPU kernel in bf16: its rounding, not ours, sets this difference.
                    errors["token_grad"] = max(errors.get("token_grad", 0), close(param.grad, grad, 2e-2, name))
                    continue
                errors["grad"] = max(errors.get("grad", 0), close(param.grad, grad, grad_tol, f"gradient of {name}"))
            errors["grad"] = max(errors["grad"], close(ours.puzzle_embedding.batch_rows.grad,
                                                       theirs.model.inner.puzzle_emb.local_weights.grad, grad_tol,
                                                       "gradient of the puzzle-embedding rows"))
            # The reference's local_weights buffer keeps its grad across steps: clear it as its
            # optimizer would (it reads then zeroes it).
            theirs.model.inner.puzzle_emb.local_weights.grad = None
        if not bitwise and dtype == "bfloat16":
            errors["stopped_after_step"] = step + 1  # OUTPUTS_TOL says why
            break
    return errors


ARCHS = list(REFERENCE_CLASSES)
# How far ours and the reference's outputs (relative to their largest value) may be apart. Both
# compute the same sums, but not through the same decompositions (mlp_t contracts the positions
# where the reference transposes, for one), and a CPU's BLAS may add a decomposition's terms in
# another order: on this machine they are the same bits, on a 2-core AMD EPYC with OpenBLAS
# trm-mlp_t's bf16 logits were not. Measured by adding in another order on purpose (permuting
# the SwiGLU hidden units, which leaves the function unchanged): float32 outputs moved by up to
# 7.4e-5 over 3 ACT steps (float32 rounding, 1.2e-7, amplified by the recursion); bfloat16
# outputs by up to 3.8e-2 within one ACT step (a one-ulp flip is 2**-8 = 3.9e-3 of a value,
# amplified by the step's block passes) and 0.35 over 3 steps of mlp_t, hence one step in bf16.
# A bf16 run that leaves the same bits stops after that step (run_side_by_side): later steps
# start from carries the flips have moved, and would test the BLAS rather than the code.
OUTPUTS_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
MLP_T = dict(mlp_t=True, pos_encodings="none")  # sudoku-mlp's token mixing: a SwiGLU across positions


@pytest.mark.parametrize("arch,overrides", [(arch, {}) for arch in ARCHS] + [("trm", MLP_T)],
                         ids=ARCHS + ["trm-mlp_t"])
def test_each_arch_equals_the_reference_side_by_side(arch, overrides):
    """Training (4 ACT steps, rows halting on the Q head and at halt_max_steps, new examples
    loaded) and evaluation (halt_max_steps steps), in float32 and bfloat16 (the presets' dtype):
    the same halting, outputs within OUTPUTS_TOL (here: the same bits), and with the same output
    bits the loss and metrics within 1e-6 and every gradient within 1e-5 (float32) and 5e-3
    (bfloat16) of its largest value (else OUTPUTS_TOL, and a bf16 run stops after that step,
    where this machine's BLAS, not the code, made the difference). Measured in bfloat16: trm,
    trm_singlez and hrm bitwise equal; trm_hier6 1.8e-3, transformers_baseline 4.8e-4 and trm
    with mlp_t 2.4e-3 (one-ulp flips where float32 sums in another order round otherwise: qkv's
    three blocks of x's gradient, mlp_t's weight gradient over rows and channels; 3.1e-2 and
    2.1e-2 when each block's x gradient was rounded to bf16 before the sum, device_grads._Use)."""
    measured = {}
    for dtype, tol in (("float32", 1e-5), ("bfloat16", 5e-3)):
        measured[dtype, "train"] = run_side_by_side(arch, dtype, True, 4, tol, **overrides)
        measured[dtype, "eval"] = run_side_by_side(arch, dtype, False, 3, tol, **overrides)
    print(arch, {f"{d}/{m}": {k: f"{v:.1e}" for k, v in e.items()} for (d, m), e in measured.items()})


def test_the_ablations_against_closed_forms():
    """separate_H_L with its H network a copy of the shared one computes trm's values, and the
    two networks' gradients sum to the shared one's; one_step_grad computes the same values as
    trm with the gradient of hrm's scheme (trm's updates, gradient through the last L and H
    update): with H = L weights, its gradient is the sum of hrm's two networks' gradients, and
    hrm with H_layers = L_layers equals trm with both ablations, weight for weight (to float32
    rounding: other decompositions of the same sums)."""
    def step(m, config):
        m.train()
        batch = next(batches(config, 1))
        carry, outputs = m(m.initial_carry(batch), batch)
        loss, _ = loss_and_metrics(carry, outputs)
        loss.backward()
        return outputs, {n: p.grad for n, p in m.named_parameters()}

    def shared_to_separate(shared: TRM, config: TRMConfig) -> TRM:
        m = TRM(config)
        state = shared.state_dict()
        state.update({k.replace("blocks.", "H_blocks.", 1): v for k, v in state.items() if k.startswith("blocks.")})
        m.load_state_dict(state)
        return m

    base = small_config("trm", "float32", no_ACT_continue=False, puzzle_emb_len=0)
    torch.manual_seed(0)
    trm = TRM(base)
    trm_out, trm_grads = step(trm, base)
    for flags, twin in ((dict(separate_H_L=True), trm),
                        (dict(one_step_grad=True), None)):
        config = dataclasses.replace(base, **flags)
        m = shared_to_separate(trm, config) if "separate_H_L" in flags else copy.deepcopy(trm)
        m.config = config
        out, grads = step(m, config)
        for key in trm_out:
            torch.testing.assert_close(out[key], trm_out[key], rtol=1e-5, atol=1e-6)
        if twin is not None:  # the two networks' gradients add up to the shared network's
            for name, grad in trm_grads.items():
                total = grads[name] + grads.get(name.replace("blocks.", "H_blocks.", 1), 0) \
                    if name.startswith("blocks.") else grads[name]
                torch.testing.assert_close(total, grad, rtol=1e-4, atol=1e-6)
        else:
            one_step_grads = grads
            assert not torch.allclose(grads["blocks.0.mlp.down.weight"], trm_grads["blocks.0.mlp.down.weight"])
    # hrm (its networks 2 + 2 blocks, H a copy of L) vs trm with one_step_grad.
    hrm_config = dataclasses.replace(base, **{**arch_defaults("hrm"), "H_cycles": base.H_cycles,
                                              "L_cycles": base.L_cycles, "H_layers": 2, "L_layers": 2})
    hrm = shared_to_separate(trm, hrm_config)
    hrm_out, hrm_grads = step(hrm, hrm_config)
    for key in trm_out:
        torch.testing.assert_close(hrm_out[key], trm_out[key], rtol=1e-5, atol=1e-6)
    for name, grad in one_step_grads.items():
        total = hrm_grads[name] + hrm_grads[name.replace("blocks.", "H_blocks.", 1)] \
            if name.startswith("blocks.") else hrm_grads[name]
        torch.testing.assert_close(total, grad, rtol=1e-4, atol=1e-6)
    both = dataclasses.replace(base, separate_H_L=True, one_step_grad=True)
    twin = TRM(both)
    twin.load_state_dict(hrm.state_dict())
    twin_out, twin_grads = step(twin, both)
    # Two decompositions of the same sums (hrm's networks, trm's two flags), which another CPU
    # may add in other orders: float32 rounding apart, the tolerances of the comparisons above.
    for key in hrm_out:
        torch.testing.assert_close(twin_out[key], hrm_out[key], rtol=1e-5, atol=1e-6)
    for name, grad in hrm_grads.items():
        torch.testing.assert_close(twin_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_choosing_an_arch_gives_its_yaml_values_and_checks_what_its_code_cannot_run():
    hrm = with_arch(PRESETS["sudoku-mlp"][1], "hrm").model
    assert (hrm.H_cycles, hrm.L_cycles, hrm.H_layers, hrm.L_layers) == (2, 2, 4, 4)
    assert hrm.puzzle_emb_len == 0 and hrm.prefix_len == 1 and not hrm.no_ACT_continue
    assert hrm.mlp_t  # the preset's mlp_t stays: HRM's file has it, and hrm.yaml's False is trm.yaml's too
    baseline = presets_for(["--model.arch=transformers_baseline"])["maze"][1].model
    assert (baseline.H_layers, baseline.num_heads, baseline.L_cycles, baseline.seq_len) == (8, 12, 4, 900)
    assert not baseline.mlp_t and baseline.problems() == []  # 12 heads of 42 on 512 are allowed
    assert presets_for([])["sudoku-att"][1] == PRESETS["sudoku-att"][1]
    assert arch_in(["--model.arch", "trm_hier6", "--model.arch", "hrm"]) == "hrm"
    for arch, fields, message in (
            ("trm_hier6", dict(L_cycles=7), "L_cycles=7: trm_hier6"),
            ("hrm", dict(no_ACT_continue=True), "no_ACT_continue=True: the reference's hrm fixes it at False"),
            ("hrm", dict(puzzle_emb_len=16), "puzzle_emb_len=16: the reference's hrm fixes it at 0"),
            ("transformers_baseline", dict(pos_encodings="none"), "pos_encodings='none'"),
            ("transformers_baseline", dict(act_inference=True), "act_inference=True"),
            ("trm_singlez", dict(one_step_grad=True), "one_step_grad is an ablation of trm"),
    ):
        with pytest.raises(ValueError, match=message):
            TRM(small_config(arch, "float32", **fields))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_reference_checkpoint_of_each_arch_loads_for_eval(arch, tmp_path):
    """`train.py eval PRESET --init-from ref.pt [--model.arch ARCH]`'s loading: the arch read from
    the checkpoint's tensors, its yaml's values, the sizes from the shapes, the weights as saved."""
    from commands.restore import load_weights_for_eval

    ours, theirs = ours_and_theirs(arch, "float32")
    found = reference_weights.reference_config(theirs.state_dict(), TRMConfig())
    assert found.arch == arch and found.hidden_size == ours.config.hidden_size
    assert found.L_layers == ours.config.L_layers or arch == "transformers_baseline"  # it has no L network
    assert found.H_layers == ours.config.H_layers or arch not in ("hrm", "transformers_baseline")
    path = tmp_path / "step_1000"
    torch.save({"_orig_mod." + k: v for k, v in theirs.state_dict().items()}, path)
    c = ours.config
    flags = ["--model.seq-len", str(c.seq_len), "--model.num-heads", str(c.num_heads), "--model.H-cycles",
             str(c.H_cycles), "--model.L-cycles", str(c.L_cycles), "--model.forward-dtype", "float32"]
    for given in ([], ["--model.arch", arch]):
        config, weights, _, _ = load_weights_for_eval(str(path), PRESETS["sudoku-att"][1], flags + given)
        assert config.model.arch == arch and config.model.puzzle_emb_len == (0 if arch in (
            "hrm", "transformers_baseline") else PRESETS["sudoku-att"][1].model.puzzle_emb_len)
        state = ours.state_dict()
        assert set(weights) == {f"model/{k}" for k in state}
        assert all(torch.equal(weights[f"model/{k}"], v) for k, v in state.items())


@pytest.mark.parametrize("arch,retrace", [("trm_hier6", True), ("transformers_baseline", False)])
def test_each_arch_trains_through_the_captured_step_on_the_mesh(demo_path, tmp_path, arch, retrace):
    """The demo's training in bf16 on the 8-device CPU mesh, with no aten:: CPU fallbacks, the
    loss falling; for trm_hier6 the captured step replayed gives the retraced step's numbers.
    Two archs (compiles are CI's cost): the six-slot carry [B, 6, T, D], and the placeholder z_H
    [B, 1, 1] with an H network only (trm_singlez carries the same shapes; hrm's networks are
    trm's separate_H_L ablation's, checked against it bitwise in test_the_ablations_...)."""
    import train
    from tests.test_train import tiny_args
    from training.config import parse_config

    args = ("--model.arch", arch, "--model.num-heads", "4", "--optim.max-steps", "4", "--run.log-every", "1",
            "--eval.every-epochs", "1000", "--optim.lr-warmup-steps", "1")
    replayed = train.main(parse_config(tiny_args(demo_path, tmp_path / "a", *args)))
    losses = [h["loss"] for h in replayed["history"]]
    if retrace:
        retraced = train.main(parse_config(tiny_args(demo_path, tmp_path / "b", *args, "--run.no-capture-step")))
        assert losses == [h["loss"] for h in retraced["history"]] and replayed["final"] == retraced["final"]
    assert len(losses) == 4 and replayed["final"]["count"] == 40
    assert losses[-1] < losses[0], losses
    assert not replayed["xla"]["fallbacks"]


@pytest.mark.parametrize("arch,flags", [("trm_singlez", {}), ("trm_hier6", {}), ("hrm", {}),
                                        ("transformers_baseline", {}), ("trm", dict(separate_H_L=True)),
                                        ("trm", dict(one_step_grad=True, no_ACT_continue=False)),
                                        ("eqr", {}), ("eqr", dict(pos_encodings="rope2d", seq_len=9))])
def test_flop_count_of_each_arch_equals_its_matmuls(arch, flags):
    """model_flops.model_flops (the step line's MFU, tpu_compile's model count, a plan's
    device-hours) against the matmuls torch counts in one training and one evaluation step."""
    from tests.test_bench import counted_flops
    from training.model_flops import model_flops

    config = small_config(arch, "float32", **flags)
    flops = model_flops(config)
    assert counted_flops(config, train_mode=True) == flops["train"]
    assert counted_flops(config, train_mode=False) == flops["eval"]
