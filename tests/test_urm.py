"""`--model.arch urm` against URM's own code (github.com/UbiquantAI/URM @ 41de2c3). URM has no
license, so its code is not vendored: tests/reference/urm/record_urm.py ran it once (float32, CPU,
a tiny config in the file's metadata) and saved its weights, inputs, outputs and gradients in
tests/data/urm_fixture.safetensors. Here its weights load into our model under URM's names
(reference/weights.reference_names), the same ACT steps run, and everything is compared: 5 training
steps (logits, q_halt, q_continue, halting, the carried state, loss, metrics, every gradient and
the puzzle rows' gradient), 3 evaluation steps, and one step of URM's Muon from step 0's
gradients. Also the scheme's own settings and checks, and the ConvSwiGLU's conv against torch's
Conv1d, which URM calls."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

import train
from model import TRM, ConvSwiGLU, TRMConfig, loss_and_metrics
from modeling.schemes import SCHEMES, arch_defaults
from reference.weights import reference_names
from training.optim import dense_optimizer

FIXTURE = Path(__file__).resolve().parent / "data" / "urm_fixture.safetensors"
TOL = 2e-6
"""Each compared tensor's largest difference, as a fraction of its largest value: float32 with
other summation orders (measured at most 3.7e-7 over outputs, states and gradients)."""
MUON_TOL = 5e-5
"""The Muon step's largest difference, as a fraction of the largest change URM's step made to that
tensor (measured 1.3e-5: the Newton-Schulz sums written out where URM calls addmm, float32
rounding grown by coefficients up to 15.5 over five iterations; the conv's AdamW steps 5.6e-6)."""

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def recorded():
    tensors = load_file(str(FIXTURE))
    with safe_open(str(FIXTURE), "pt") as f:
        meta = f.metadata()
    return tensors, meta


def urm_config(meta: dict) -> TRMConfig:
    """Our config for the fixture's URM config (its names: num_layers, loops), exploration off:
    the recording checked that URM's exploration changed no row's halting."""
    c = json.loads(meta["config"])
    return TRMConfig(**{**arch_defaults("urm"), **dict(
        seq_len=c["seq_len"], vocab_size=c["vocab_size"], num_puzzle_identifiers=c["num_puzzle_identifiers"],
        puzzle_emb_ndim=c["puzzle_emb_ndim"], L_layers=c["num_layers"], hidden_size=c["hidden_size"],
        expansion=c["expansion"], num_heads=c["num_heads"], rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"], halt_max_steps=c["loops"], H_cycles=c["H_cycles"], L_cycles=c["L_cycles"],
        forward_dtype=c["forward_dtype"], halt_exploration_prob=0.0, attention="sdpa")})


def urm_model(tensors, meta) -> tuple[TRM, dict[str, str]]:
    model = TRM(urm_config(meta))
    names = reference_names(model.config)
    assert {f"weights.inner.{n}" for n in names.values()} == {k for k in tensors if k.startswith("weights.")}
    model.load_state_dict({ours: tensors[f"weights.inner.{theirs}"] for ours, theirs in names.items()}, strict=True)
    return model, names


def close(ours, theirs, what, tol=TOL) -> float:
    ours, theirs = ours.detach().double(), theirs.double()
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} vs URM's {tuple(theirs.shape)}"
    err = ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12)).item()
    assert err <= tol, f"{what}: largest difference {err:.3g} of the largest value (tolerance {tol})"
    return err


def batch_at(tensors, prefix):
    return {k: tensors[f"{prefix}.{k}"] for k in ("inputs", "labels", "puzzle_identifiers")}


def test_training_steps_equal_urms_recorded_outputs_and_gradients(recorded):
    tensors, meta = recorded
    compare_training(*urm_model(tensors, meta), tensors, meta)


def compare_training(model: TRM, names: dict[str, str], tensors, meta) -> float:
    """The recording's training ACT steps run on `model` (URM's weights under `names`), every
    output, carry, metric and gradient compared with URM's; the largest difference."""
    model.train()
    batch_size, largest = int(meta["batch"]), 0.0
    carry = None
    for t in range(int(meta["train_steps"])):
        batch = batch_at(tensors, f"train.{t}.batch")
        carry = carry or model.initial_carry(batch)
        carry, outputs = model(carry, batch)
        loss, metrics = loss_and_metrics(carry, outputs)
        (loss / batch_size).backward()
        assert carry.halted.int().tolist() == tensors[f"train.{t}.halted"].tolist(), t
        assert carry.steps.tolist() == tensors[f"train.{t}.steps"].tolist(), t
        for key in ("inputs", "labels", "puzzle_identifiers"):
            assert torch.equal(carry.current_data[key].int(), tensors[f"train.{t}.current_data.{key}"]), (t, key)
        errors = [close(outputs[key], tensors[f"train.{t}.{key}"], f"step {t} {key}")
                  for key in ("logits", "q_halt_logits", "q_continue_logits")]
        errors.append(close(carry.z_L, tensors[f"train.{t}.current_hidden"], f"step {t} state"))
        errors.append(close(loss, tensors[f"train.{t}.loss"], f"step {t} loss"))
        for key, value in metrics.items():
            errors.append(close(value, tensors[f"train.{t}.metric.{key}"], f"step {t} metric {key}"))
        for name, p in model.named_parameters():
            errors.append(close(p.grad, tensors[f"train.{t}.grad.inner.{names[name]}"], f"step {t} grad {name}"))
        errors.append(close(model.puzzle_embedding.batch_rows.grad, tensors[f"train.{t}.grad.puzzle_emb_rows"],
                            f"step {t} puzzle rows' grad"))
        largest = max(largest, *errors)
        model.zero_grad(set_to_none=True)
    print(f"largest difference against URM over {meta['train_steps']} training steps: {largest:.3g}")
    return largest


def test_evaluation_steps_equal_urms(recorded):
    tensors, meta = recorded
    compare_evaluation(urm_model(tensors, meta)[0], tensors)


def compare_evaluation(model: TRM, tensors) -> None:
    """The recording's evaluation ACT steps run on `model`, compared with URM's."""
    model.eval()
    batch = batch_at(tensors, "eval.batch")
    carry = model.initial_carry(batch)
    with torch.no_grad():
        for t in range(model.config.halt_max_steps):
            carry, outputs = model(carry, batch)
            for key in ("logits", "q_halt_logits", "q_continue_logits"):
                close(outputs[key], tensors[f"eval.{t}.{key}"], f"eval step {t} {key}")
            close(carry.z_L, tensors[f"eval.{t}.current_hidden"], f"eval step {t} state")
        loss, _ = loss_and_metrics(carry, outputs)
    assert bool(carry.halted.all())
    close(loss, tensors["eval.loss"], "eval loss")


def test_muon_step_equals_urms_muon(recorded):
    """Our Muon (training/optim.py) with URM's split, at the recording's lr 1e-2 and weight decay 0.1
    (both groups), from the weights and step 0's gradients, against URM's Muon's step."""
    tensors, meta = recorded
    model, names = urm_model(tensors, meta)
    optimizer = dense_optimizer(model.parameters(), "muon", betas=(0.9, 0.95), weight_decay=0.1)
    assert [len(g["params"]) for g in optimizer.param_groups] == [
        sum(p.ndim == 2 for p in model.parameters()), sum(p.ndim != 2 for p in model.parameters())]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(meta["muon_lr"]))
    for name, p in model.named_parameters():
        p.grad = tensors[f"train.0.grad.inner.{names[name]}"].clone()
    optimizer.step()
    for name, p in model.named_parameters():
        before, after = tensors[f"weights.inner.{names[name]}"], tensors[f"muon.after.inner.{names[name]}"]
        close(p - before, after - before, f"Muon's change of {name}", MUON_TOL)


def test_conv_is_torchs_conv1d_as_urm_calls_it():
    """The ConvSwiGLU's conv by shifted products equals torch's depthwise Conv1d with padding k // 2,
    its first T outputs (URM's layer), for kernels 1 to 4."""
    torch.manual_seed(0)
    for kernel in (1, 2, 3, 4):
        mlp = ConvSwiGLU(8, 2.0, kernel)
        u = torch.randn(3, 7, mlp.conv_bias.shape[0])
        conv = F.conv1d(u.transpose(1, 2), mlp.conv_weight, mlp.conv_bias, padding=kernel // 2,
                        groups=mlp.conv_bias.shape[0])[..., :7].transpose(1, 2)
        torch.testing.assert_close(mlp.conv(u), conv, rtol=1e-6, atol=1e-6)
    causal = ConvSwiGLU(8, 2.0, 2)
    u = torch.randn(1, 5, causal.conv_bias.shape[0])
    later = u.clone()
    later[:, 3:] += 1.0
    assert torch.equal(causal.conv(u)[:, :3], causal.conv(later)[:, :3])  # kernel 2 reads t-1 and t only


def test_urm_settings_and_checks():
    defaults = arch_defaults("urm")
    assert defaults == {"arch": "urm", "H_cycles": 4, "L_cycles": 3, "L_layers": 8, "halt_max_steps": 16,
                        "conv_kernel": 2, "puzzle_emb_len": 0, "no_ACT_continue": True, "pos_encodings": "rope",
                        "mlp_t": False}
    config = TRMConfig(**{**defaults, "seq_len": 8, "vocab_size": 6, "hidden_size": 32, "num_heads": 4,
                          "puzzle_emb_ndim": 40, "L_layers": 1, "H_cycles": 2, "L_cycles": 3})
    scheme = SCHEMES["urm"]
    assert config.prefix_len == 2  # ceil(40 / 32)
    assert scheme.schedule(config) == ["L"] * 6 and scheme.grad_updates(config) == 3
    model = TRM(config)
    assert isinstance(model.blocks[0].mlp, ConvSwiGLU) and set(dict(model.named_buffers())) >= {"init_hidden"}
    problems = TRMConfig(**{**config.__dict__, "conv_kernel": 0, "H_layers": 2, "puzzle_emb_len": 4}).problems()
    assert any(p.startswith("conv_kernel=0: the reference's urm fixes it at 2") for p in problems), problems
    assert any(p.startswith("puzzle_emb_len=4") for p in problems), problems
    assert any(p.startswith("H_layers=2: URM has one network") for p in problems), problems
    urm_keys = {"init_hidden", "embed_tokens.embedding_weight", "layers.0.mlp.dwconv.weight"}
    assert [name for name, s in SCHEMES.items() if s.recognises(urm_keys, config)] == ["urm"]
    assert not scheme.recognises({"H_init", "L_init", "L_level.layers.0.mlp.gate_up_proj.weight"}, config)


def test_urm_presets_are_its_scripts():
    """scripts/URM_arcagi1.sh, URM_arcagi2.sh and URM_sudoku.sh over its cfg_pretrain.yaml and urm.yaml."""
    from training.config import PRESETS

    for name in ("urm-arc1", "urm-arc2", "urm-sudoku"):
        c = PRESETS[name][1]
        m, o = c.model, c.optim
        assert (m.arch, m.H_cycles, m.L_cycles, m.L_layers, m.halt_max_steps, m.conv_kernel) == ("urm", 2, 6, 4, 16, 2)
        assert (m.hidden_size, m.num_heads, m.expansion, m.puzzle_emb_ndim, m.prefix_len) == (512, 8, 4.0, 512, 1)
        assert (m.forward_dtype, m.pos_encodings, m.mlp_t, m.halt_exploration_prob) == ("bfloat16", "rope", False, 0.1)
        assert (o.lr, o.lr_warmup_steps, o.lr_min_ratio, o.beta1, o.beta2, o.ema_rate) == (1e-4, 2000, 1.0, 0.9, 0.95,
                                                                                         0.999)
        assert c.eval.every_epochs == 2000 and not m.problems()
    arc1, arc2, sudoku = (PRESETS[n][1] for n in ("urm-arc1", "urm-arc2", "urm-sudoku"))
    for c, path, optimizer in ((arc1, "data/arc1concept-aug-1000", "adam_atan2"),
                               (arc2, "data/arc2concept-aug-1000", "muon")):
        assert (c.data.path, c.optim.optimizer, c.optim.epochs) == (path, optimizer, 200000)
        assert c.optim.global_batch_size == 768
        assert (c.optim.puzzle_emb_lr, c.optim.weight_decay, c.optim.puzzle_emb_weight_decay) == (1e-2, 0.1, 0.1)
        assert c.eval.arc and c.eval.arc_aggregate and c.model.seq_len == 900
    assert (sudoku.data.path, sudoku.optim.optimizer, sudoku.optim.epochs, sudoku.optim.global_batch_size) == (
        "data/sudoku-extreme-1k-aug-1000", "adam_atan2", 50000, 128)
    assert (sudoku.optim.puzzle_emb_lr, sudoku.optim.weight_decay, sudoku.optim.puzzle_emb_weight_decay) == (
        1e-4, 1.0, 1.0)
    for name, reported in (("urm-arc1", "53.8%"), ("urm-arc2", "16.0%"), ("urm-sudoku", "77.6%")):
        assert reported in PRESETS[name][0] and "scripts/URM_" in PRESETS[name][0]


def test_the_trm_reference_export_refuses_urm():
    from reference.model_dir import refusals
    from training.config import PRESETS

    assert any(r.startswith("model.conv_kernel=2 (arch urm): URM's ConvSwiGLU")
               for r in refusals(PRESETS["urm-arc1"][1], 0, None))


def their_names(tensors) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """URM's checkpoint names (its compiled ACTLossHead's: `_orig_mod.model.` + its URM's
    state_dict names) of the recorded weights, with each tensor's shape and the dtype URM's model
    holds it in: the recording's, but the ConvSwiGLU's conv, which URM builds in bfloat16 (the
    recording cast it to float32: its metadata's conv_dtype)."""
    return {"_orig_mod.model." + k.removeprefix("weights."): (tuple(t.shape), torch.bfloat16 if ".dwconv." in k
                                                                else t.dtype)
            for k, t in tensors.items() if k.startswith("weights.")}


def test_an_exported_model_has_urms_checkpoint_and_config(recorded, tmp_path):
    """`export --format urm` of a trained urm run at the recording's config: step_N.pt is
    save_train_state's dict, its model_state_dict the names, shapes and dtypes of URM's own (the
    recording's weights: strictly the same set), loadable with torch.load's weights_only;
    all_config.yaml's arch is the recording's URMConfig under its names, and the flat fields
    evaluate_trained_model.py reads from the line `beta1:` on hold its PretrainConfig's required
    fields, the arch fields it finds by pattern being the arch's. Back through train.py eval's
    loader: our weights bit for bit, the convs rounded to bfloat16 (as URM holds them)."""
    import re

    import yaml

    from commands.restore import load_weights_for_eval
    from tests.test_reference_export import trained_checkpoint
    from training.config import PRESETS

    tensors, meta = recorded
    assert meta["conv_dtype"] == "float32"
    config = urm_config(meta)
    run_dir, trained = trained_checkpoint(tmp_path, config)
    out = tmp_path / "model"
    assert train.command_line(["export", str(run_dir), "--format", "urm", "--out", str(out)]) == 0
    saved = torch.load(out / "step_3.pt", weights_only=True)
    assert set(saved) == {"step", "model_state_dict"} and saved["step"] == 3
    assert {k: (tuple(v.shape), v.dtype) for k, v in saved["model_state_dict"].items()} == their_names(tensors)

    raw = (out / "all_config.yaml").read_text()
    arch = yaml.safe_load(raw)["arch"]
    assert (arch.pop("name"), arch.pop("loss")) == ("urm.urm@URM", {"name": "losses@ACTLossHead",
                                                                   "loss_type": "stablemax_cross_entropy"})
    recorded_config = json.loads(meta["config"])
    assert arch == {k: v for k, v in recorded_config.items()
                    if k not in ("batch_size", "seq_len", "vocab_size", "num_puzzle_identifiers")}
    flat = yaml.safe_load(raw[raw.index("\nbeta1:") + 1:])
    assert "arch" not in flat and {"data_path", "global_batch_size", "epochs", "lr", "lr_min_ratio", "lr_warmup_steps",
                                   "weight_decay", "beta1", "beta2", "target_q_update_every", "puzzle_emb_lr",
                                   "puzzle_emb_weight_decay"} <= set(flat)
    for field in ("loops", "num_heads", "num_layers", "pos_encodings", "puzzle_emb_ndim", "hidden_size",
                  "H_cycles", "L_cycles"):
        assert re.search(rf"\b{field}:\s*(\w+)", raw).group(1) == str(arch[field]), field
    card = json.loads((out / "config.json").read_text())
    assert any("forward_dtype='float32'" in c for c in card["reference"]["caveats"])

    loaded, weights, _, _ = load_weights_for_eval(str(out / "step_3.pt"), PRESETS["urm-arc1"][1], [
        "--model.seq-len", str(config.seq_len), "--model.attention", "sdpa", "--model.halt-exploration-prob", "0"])
    assert loaded.model == config
    conv_change = 0.0
    for name, value in trained.state_dict().items():
        if ".conv_" in name:
            rounded = value.to(torch.bfloat16).float()
            assert torch.equal(weights[f"model/{name}"], rounded), name
            conv_change = max(conv_change, ((rounded - value).abs().max() / value.abs().max()).item())
        else:
            assert torch.equal(weights[f"model/{name}"], value), name
    print(f"the convs' bfloat16 rounding: at most {conv_change:.3g} of each one's largest value")


def test_urms_recorded_weights_in_its_checkpoint_format_give_its_outputs_here(recorded, tmp_path):
    """The recording's weights as URM's save_train_state saves them (`_orig_mod.model.*`, the convs
    in bfloat16: the recorded values are bf16 ones) beside an all_config.yaml of the recording's
    URMConfig: `train.py eval`'s loader reads the arch, sizes and settings, and the model it
    builds gives URM's recorded evaluation; --run.init-from's loader gives the weights whose
    training steps equal URM's recorded outputs and gradients."""
    import yaml

    from commands.restore import load_initial_weights, load_weights_for_eval
    from training.config import PRESETS

    tensors, meta = recorded
    c = json.loads(meta["config"])
    state = {}
    for name, (_, dtype) in their_names(tensors).items():
        value = tensors["weights." + name.removeprefix("_orig_mod.model.")]
        assert torch.equal(value.to(dtype).float(), value.float())
        state[name] = value.to(dtype)
    folder = tmp_path / "urm_run"
    folder.mkdir()
    torch.save({"step": 0, "model_state_dict": state}, folder / "step_0.pt")
    urm_yaml = {"name": "urm.urm@URM", "loss": {"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy"},
                **{k: v for k, v in c.items() if k not in ("batch_size", "seq_len", "vocab_size",
                                                           "num_puzzle_identifiers")}}
    (folder / "all_config.yaml").write_text(yaml.safe_dump({
        "arch": urm_yaml, "data_path": "data/urm-fixture", "evaluators": [], "global_batch_size": c["batch_size"],
        "epochs": 10, "lr": 1e-4, "lr_min_ratio": 1.0, "lr_warmup_steps": 10, "weight_decay": 0.1, "beta1": 0.9,
        "beta2": 0.95, "target_q_update_every": 4, "puzzle_emb_lr": 1e-2, "puzzle_emb_weight_decay": 0.1,
        "ema": True, "ema_rate": 0.999}))
    config = urm_config(meta)
    loaded, weights, _, _ = load_weights_for_eval(str(folder / "step_0.pt"), PRESETS["sudoku-mlp"][1], [
        "--model.seq-len", str(c["seq_len"]), "--model.attention", "sdpa", "--model.halt-exploration-prob", "0"])
    assert loaded.model == config and loaded.data.path == "data/urm-fixture" and loaded.optim.puzzle_emb_lr == 1e-2
    model = TRM(loaded.model)
    model.load_state_dict({k.removeprefix("model/"): v for k, v in weights.items()})
    compare_evaluation(model, tensors)
    model = TRM(config)
    model.load_state_dict({k.removeprefix("model/"): v
                           for k, v in load_initial_weights(str(folder / "step_0.pt"), config).items()})
    compare_training(model, reference_names(config), tensors, meta)
