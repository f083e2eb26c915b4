"""A new architecture is one class registered once (modeling/schemes.py; docs/faithfulness.md, "Adding
an architecture"). The toy scheme below is defined in this file alone, and the product takes it
everywhere an arch goes: --model.arch and --help, its yaml values and the fields it fixes, its own
config checks, its halting rule, a reference-format checkpoint recognised as it, and training
through train.py on the 8-device CPU mesh."""
import dataclasses
import re

import pytest
import torch

from model import TRM, TRMConfig
from modeling.schemes import PLACEHOLDER, RecursionScheme, arch_defaults, register
from reference import weights as reference_weights
from tests.test_train import tiny_args
from training.config import parse_config


@register  # at import, as an arch's module does: the toy is an arch in this test process from here on
class Echo(RecursionScheme):
    """One state z (carried as z_L): z <- L(z, x) L_cycles times, the last with gradient; the
    heads read z. Halts where q_halt exceeds q_continue by more than 1, with no Q-continue target."""

    name = "toy_echo"
    inits = ("Z_init",)
    yaml = dict(H_cycles=1, L_cycles=3)
    forced = dict(no_ACT_continue=False)
    bootstraps_q_continue = False

    def state_shapes(self, config):
        return PLACEHOLDER, (config.total_len, config.hidden_size)

    def initial_states(self, model):
        return torch.zeros((), dtype=model.Z_init.dtype, device=model.Z_init.device), model.Z_init

    def grad_updates(self, config):
        return 1

    def schedule(self, config):
        return ["L"] * config.L_cycles

    def updates(self, model, x):
        return [lambda z_H, z_L: (z_H, model.net(z_L, x, "L"))] * model.config.L_cycles

    def output(self, z_H, z_L):
        return z_L

    def halt_score(self, config, q_halt, q_continue=None):
        return q_halt - q_continue - 1

    def problems(self, config):
        if config.L_cycles < 2:
            return [f"L_cycles={config.L_cycles}: toy_echo echoes at least twice; use L_cycles >= 2"]
        return []


def small(**fields) -> TRMConfig:
    return TRMConfig(**{**dict(seq_len=8, vocab_size=6, num_puzzle_identifiers=3, hidden_size=32, num_heads=4,
                               puzzle_emb_ndim=32, halt_max_steps=4, halt_exploration_prob=0.0,
                               forward_dtype="float32"), **arch_defaults("toy_echo"), **fields})


def test_the_flags_take_the_toy_with_its_values_and_checks(demo_path, tmp_path, capsys):
    """--help lists it among the choices; choosing it gives its yaml values and the field it fixes;
    its own check, the fixed field and another arch's ablation are config errors naming the value."""
    with pytest.raises(SystemExit):
        parse_config(["demo", "--help"])
    out = capsys.readouterr().out
    start = out.index("--model.arch {") + len("--model.arch {")
    choices = re.sub(r"[\s│]", "", out[start:out.index("}", start)])  # the choices as --help wraps them
    assert choices == "trm,trm_singlez,trm_hier6,hrm,transformers_baseline,eqr,urm,toy_echo", out
    model = parse_config(tiny_args(demo_path, tmp_path, "--model.arch", "toy_echo")).model
    assert (model.arch, model.H_cycles, model.L_cycles, model.no_ACT_continue) == ("toy_echo", 1, 3, False)
    with pytest.raises(SystemExit, match="model.L_cycles=1: toy_echo echoes at least twice"):
        parse_config(tiny_args(demo_path, tmp_path, "--model.arch", "toy_echo", "--model.L-cycles", "1"))
    assert small(no_ACT_continue=True, separate_H_L=True).problems() == [
        "no_ACT_continue=True: the reference's toy_echo fixes it at False",
        "separate_H_L is an ablation of trm (the paper's), not of arch toy_echo"]
    assert "arch must be one of trm, trm_singlez, trm_hier6, hrm, transformers_baseline, eqr, urm, toy_echo" in \
        small(arch="nope").problems()[0]


def test_the_model_halts_by_the_toys_rule_and_its_checkpoint_is_recognised():
    """Training halts where the toy's halt_score is > 0 (q_halt - q_continue - 1, not trm's
    q_halt > q_continue); its weights in the reference's format are recognised as toy_echo."""
    torch.manual_seed(0)
    model = TRM(small()).train()
    batch = {"inputs": torch.randint(0, 6, (4, 8)), "labels": torch.randint(0, 6, (4, 8)),
             "puzzle_identifiers": torch.zeros(4, dtype=torch.int32)}
    for bias, halts in (((-1.0, -1.5), False), ((-1.0, -2.5), True)):  # q_halt > q_continue in both
        with torch.no_grad():
            model.q_head.weight.zero_()
            model.q_head.bias.copy_(torch.tensor(bias))
        carry, outputs = model(model.initial_carry(batch), batch)
        assert "target_q_continue" not in outputs and carry.halted.tolist() == [halts] * 4
    state = reference_weights.reference_state_dict(model)
    found = reference_weights.reference_config(state, TRMConfig())
    sizes = ("arch", "H_cycles", "L_cycles", "hidden_size", "L_layers", "vocab_size", "puzzle_emb_ndim",
             "num_puzzle_identifiers", "no_ACT_continue")
    assert [getattr(found, k) for k in sizes] == [getattr(model.config, k) for k in sizes]
    fresh = TRM(dataclasses.replace(found, seq_len=8, num_heads=4, forward_dtype="float32"))  # not in the weights
    reference_weights.load_reference_state_dict(fresh, state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_the_toy_trains_through_train_py_on_the_mesh(demo_path, tmp_path):
    """The demo's training (width 32, 3 steps) with --model.arch toy_echo through train.main on
    the 8-device CPU mesh: the toy's initial state in the model, the loss falling, no CPU fallbacks."""
    import train

    args = ("--model.arch", "toy_echo", "--model.num-heads", "4", "--optim.max-steps", "3", "--run.log-every", "1",
            "--eval.every-epochs", "1000", "--optim.lr-warmup-steps", "1")
    result = train.main(parse_config(tiny_args(demo_path, tmp_path, *args)))
    losses = [h["loss"] for h in result["history"]]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert not result["xla"]["fallbacks"]
