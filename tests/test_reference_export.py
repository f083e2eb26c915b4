"""`train.py export --format reference`: a model trained here runs in the reference's own code
(tests/reference, its model files unchanged). For each arch: the exported checkpoint loads as
the reference's load_checkpoint loads it (strict, assign, into its compiled ACTLossHead built
from the exported all_config.yaml as its create_model builds it) and the reference's forward
gives our logits and Q values; the round trip back into our eval is bitwise; what the reference
cannot express is refused by name; the model directory's card holds the metrics that
`train.py eval --init-from DIR` reproduces."""
import ast
import dataclasses
import importlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import train
from model import TRM, TRMConfig, loss_and_metrics
from modeling.schemes import SCHEMES
from tests.test_archs import BATCH, ACTLossHead, batches, small_config
from training.checkpoint import CheckpointWriter, Shard, read_exported
from training.config import Config, DataConfig, parse_config

ARCHS = ["trm", "trm_singlez", "trm_hier6", "hrm", "transformers_baseline"]
PRETRAIN = Path(__file__).resolve().parent / "reference" / "pretrain.py"  # the reference's, unchanged


def pretrain_definitions() -> dict[str, ast.AST]:
    return {n.name: n for n in ast.parse(PRETRAIN.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def reference_load_checkpoint():
    """pretrain.load_checkpoint, its source unchanged, run on the CPU: the module it is defined
    in needs hydra, wandb and CUDA, so it runs alone, with torch.load mapping to the CPU where
    it maps to "cuda"."""
    def load(f, map_location):
        assert map_location == "cuda"
        return torch.load(f, map_location="cpu")

    namespace = {"torch": SimpleNamespace(load=load, mean=torch.mean, Size=torch.Size), "nn": torch.nn,
                 "PretrainConfig": object}
    exec(compile(ast.Module(body=[pretrain_definitions()["load_checkpoint"]], type_ignores=[]), str(PRETRAIN),
                 "exec"), namespace)
    return namespace["load_checkpoint"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def trained_checkpoint(tmp_path, model_config, steps=3, config: Config | None = None):
    """Our model trained `steps` Adam steps on random batches (eagerly: each arch's compiles
    would cost CI minutes), saved by the trainer's own checkpoint writer as a run's step."""
    torch.manual_seed(0)
    model = TRM(model_config)
    with torch.no_grad():
        if model_config.puzzle_emb_ndim:  # the reference starts it at 0: make every row count
            model.puzzle_embedding.weight.normal_()
        model.q_head.weight.normal_(std=0.3)  # so that rows halt at different steps
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = list(batches(model_config, steps))
    carry = model.initial_carry(data[0])
    for batch in data:
        carry, outputs = model(carry, batch)
        loss, _ = loss_and_metrics(carry, outputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    config = dataclasses.replace(config or Config(data=DataConfig(path=str(tmp_path / "data"))), model=model_config)
    run_dir = tmp_path / "run"
    writer = CheckpointWriter(str(run_dir), 0, 1)
    shards = {f"model/{k}": Shard(v.detach().clone(), tuple(v.shape)) for k, v in model.state_dict().items()}
    writer.save(steps, shards, {"step": steps, "config": dataclasses.asdict(config),
                                "dataset_identifiers": "0123456789abcdef"})
    assert writer.wait()
    return run_dir, model


def reference_from_directory(out, num_puzzle_identifiers, seq_len, vocab_size):
    """What the reference's pretrain.create_model and load_checkpoint do with the directory:
    the model class and loss head named by all_config.yaml, built from its arch fields and the
    dataset's sizes, compiled (torch.compile's wrapper: its state_dict names every tensor
    `_orig_mod.`), then its load_checkpoint."""
    with open(out / "all_config.yaml") as f:
        saved = yaml.safe_load(f)
    arch = dict(saved["arch"])
    name, loss = arch.pop("name"), arch.pop("loss")
    module, cls = name.split("@")
    model_cls = getattr(importlib.import_module("models." + module), cls)
    loss_module, loss_cls = loss.pop("name").split("@")
    head_cls = getattr(importlib.import_module("models." + loss_module), loss_cls)
    model_cfg = dict(**arch, batch_size=BATCH, vocab_size=vocab_size, seq_len=seq_len,
                     num_puzzle_identifiers=num_puzzle_identifiers, causal=False)
    fresh = head_cls(model_cls(model_cfg), **loss)
    own_dtypes = {k: v.dtype for k, v in fresh.state_dict().items()}
    compiled = torch.compile(fresh)
    (ckpt,) = [p for p in out.iterdir() if p.name.startswith("step_")]
    # load_state_dict(state_dict, assign=True): strict, every tensor named and none left over.
    reference_load_checkpoint()(compiled, SimpleNamespace(load_checkpoint=str(ckpt)))
    loaded = compiled._orig_mod
    assert {k: v.dtype for k, v in loaded.state_dict().items()} == own_dtypes  # assign kept the reference's dtypes
    return loaded, saved


def largest_difference(ours, theirs):
    ours, theirs = ours.double(), theirs.double()
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12)).item()


def compare_forward(ours: TRM, theirs, steps: int) -> float:
    """Both in evaluation over `steps` ACT steps of one batch: the largest difference of the
    logits and Q values relative to the largest value; halting must agree exactly."""
    ours.eval(), theirs.eval()
    batch = next(batches(ours.config, 1))
    carry, their_carry = ours.initial_carry(batch), theirs.initial_carry(batch)
    worst = 0.0
    with torch.no_grad():
        for _ in range(steps):
            carry, outputs = ours(carry, batch)
            their_carry, _, _, their_outputs, _ = theirs(carry=their_carry, batch=batch, return_keys=list(outputs))
            assert torch.equal(carry.halted, their_carry.halted) and torch.equal(carry.steps, their_carry.steps)
            for key in ("logits", "q_halt_logits", "q_continue_logits"):
                if key in outputs:
                    worst = max(worst, largest_difference(outputs[key], their_outputs[key]))
    return worst


CASES = [(arch, dtype, {}) for arch in ARCHS for dtype in ("float32", "bfloat16")] + [
    ("trm", "bfloat16", dict(attention="blockwise")),  # the presets' attention: one block of keys here
    ("trm", "float32", dict(mlp_t=True, pos_encodings="none")),
    ("trm", "bfloat16", dict(mlp_t=True, pos_encodings="none")),
    ("trm", "float32", dict(pos_encodings="learned", puzzle_emb_len=0)),
    ("hrm", "float32", dict(mlp_t=True, pos_encodings="learned", H_layers=2)),
]


@pytest.mark.parametrize("arch,dtype,overrides", CASES,
                         ids=[f"{a}-{d}" + "".join(f"-{k}={v}" for k, v in o.items()) for a, d, o in CASES])
def test_an_exported_model_runs_in_the_reference_as_here(arch, dtype, overrides, tmp_path):
    """The reference's forward on the exported checkpoint, built from the exported yaml, against
    ours: float32 within float32 rounding (1e-6 of the largest value), bfloat16 within
    test_archs' 5e-3. Measured: every case with the reference's attention (sdpa) bitwise equal (0.0)."""
    config = small_config(arch, dtype, **overrides)
    run_dir, ours = trained_checkpoint(tmp_path, config)
    out = tmp_path / "model"
    assert train.command_line(["export", str(run_dir), "--format", "reference", "--out", str(out)]) == 0
    theirs, saved = reference_from_directory(out, config.num_puzzle_identifiers, config.seq_len, config.vocab_size)
    assert saved["arch"]["forward_dtype"] == dtype
    worst = compare_forward(ours, theirs, config.halt_max_steps)
    print(f"{arch} {dtype} {overrides}: largest difference {worst:.3g}")
    if config.attention == "blockwise" and dtype != "float32":
        # The weights are exact: ours computing attention as the reference's SDPA gives its values
        # bit for bit. The blockwise form rounds as the fused GPU kernels the reference runs on
        # (probabilities meet v in bf16); on the CPU, SDPA's math path keeps them in float32:
        # measured 1.2e-2 of the largest logit after 3 ACT steps.
        twin = TRM(dataclasses.replace(config, attention="sdpa"))
        twin.load_state_dict(ours.state_dict())
        assert compare_forward(twin, theirs, config.halt_max_steps) == 0
        assert worst <= 2e-2, worst
    else:
        assert worst <= (1e-6 if dtype == "float32" else 5e-3), worst
    # The directory's own export holds the same weights as the run's checkpoint.
    from reference.model_dir import read_model_dir

    weights, saved_config, step, trained_on = read_model_dir(str(out))
    assert step == 3 and trained_on == "0123456789abcdef" and saved_config["model"]["arch"] == arch
    assert all(torch.equal(weights[k], v) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("flags,fields,message", [
    ("--model.separate-H-L", dict(separate_H_L=True), "model.separate_H_L=True"),
    ("--model.one-step-grad", dict(one_step_grad=True), "model.one_step_grad=True"),
    ("--model.attention-block", dict(attention="blockwise", attention_block=8), "model.attention_block=8"),
    ("--model.puzzle-emb-ndim 0", dict(puzzle_emb_ndim=0, puzzle_emb_len=0), "model.puzzle_emb_ndim=0"),
])
def test_what_the_reference_cannot_express_is_refused_by_name(flags, fields, message, tmp_path, capsys):
    config = small_config("trm", "bfloat16", **fields)
    run_dir, _ = trained_checkpoint(tmp_path, config, steps=1)
    with pytest.raises(SystemExit, match=message.replace(".", r"\.")):
        train.command_line(["export", str(run_dir), "--format", "reference", "--out", str(tmp_path / "model")])
    assert not (tmp_path / "model").exists()
    if "puzzle_emb_ndim" in fields:  # the reason: its own load_checkpoint fails on such a model
        module, cls = SCHEMES["trm"].reference_class.split("@")
        model_cls = getattr(importlib.import_module("models." + module), cls)
        arch = {f: getattr(config, f) for f in SCHEMES["trm"].reference_fields}
        theirs = torch.compile(ACTLossHead(model_cls(dict(arch, batch_size=BATCH, vocab_size=config.vocab_size,
                                                          seq_len=config.seq_len, num_puzzle_identifiers=1)),
                                           "stablemax_cross_entropy"))
        torch.save(theirs.state_dict(), tmp_path / "step_0")
        with pytest.raises(AttributeError, match="puzzle_emb"):
            reference_load_checkpoint()(theirs, SimpleNamespace(load_checkpoint=str(tmp_path / "step_0")))
    # float32 blockwise attention over several blocks agrees with one softmax to float32 rounding: exported.
    if "attention_block" in fields:
        config = dataclasses.replace(config, forward_dtype="float32")
        run_dir, _ = trained_checkpoint(tmp_path / "f32", config, steps=1)
        assert train.command_line(["export", str(run_dir), "--format", "reference",
                                   "--out", str(tmp_path / "f32" / "model")]) == 0


@pytest.mark.parametrize("format,arch,fields,message", [
    ("eqr", "trm", {}, "model.arch=trm: EqR's code runs its eqr"),
    ("urm", "trm", {}, "model.arch=trm: URM's code runs its urm"),
    ("urm", "urm", dict(puzzle_emb_ndim=0), "model.puzzle_emb_ndim=0: URM's pretrain.load_checkpoint"),
    ("eqr", "eqr", dict(attention="blockwise", attention_block=8, seq_len=16), "model.attention_block=8"),
])
def test_what_eqrs_and_urms_code_cannot_express_is_refused_by_name(format, arch, fields, message, tmp_path):
    """--format eqr and urm refuse, naming the option, another arch than their code's, a model its
    loader cannot load (URM's load_checkpoint reads the puzzle table's shape, as the reference's)
    and attention computed otherwise than their one softmax; nothing is written."""
    config = small_config(arch, "bfloat16", **fields)
    run_dir, _ = trained_checkpoint(tmp_path, config, steps=1)
    with pytest.raises(SystemExit, match=message.replace(".", r"\.")):
        train.command_line(["export", str(run_dir), "--format", format, "--out", str(tmp_path / "model")])
    assert not (tmp_path / "model").exists()


def tiny_run(demo_path, tmp_path, *extra):
    return ["demo", "--data.path", demo_path, "--data.cache-dir", str(tmp_path / "cache"), "--run.dir",
            str(tmp_path / "run"), "--model.hidden-size", "32", "--model.puzzle-emb-ndim", "32",
            "--optim.global-batch-size", "32", "--eval.every-epochs", "1000", "--optim.lr-warmup-steps", "1", *extra]


def test_a_checkpoint_inside_the_curriculum_is_refused(demo_path, tmp_path):
    """Mid-curriculum weights were trained with fewer cycles than the model's: the reference has
    no curriculum (optim.curriculum_epochs named); past it, the export goes through."""
    from reference.model_dir import refusals

    config = parse_config(tiny_run(demo_path, tmp_path, "--optim.curriculum-epochs", "100", "--optim.epochs", "200",
                                   "--optim.curriculum-start-H-cycles", "1"))
    model = small_config("trm", "float32", H_cycles=3, L_cycles=2)
    config = dataclasses.replace(config, model=dataclasses.replace(
        model, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size))
    run_dir, _ = trained_checkpoint(tmp_path, config.model, steps=1, config=config)
    full_steps = 100
    assert any("optim.curriculum_epochs=100" in r for r in refusals(config, 1, full_steps))
    assert any("optim.curriculum_epochs=100" in r for r in refusals(config, 1, None))
    assert refusals(config, 51, full_steps) == []  # half of 200 epochs: the curriculum is over
    with pytest.raises(SystemExit, match=r"optim\.curriculum_epochs=100"):
        train.command_line(["export", str(run_dir), "--format", "reference", "--out", str(tmp_path / "model")])


def test_the_model_directory_round_trip_and_card(demo_path, tmp_path, gcs_url):
    """The demo trained here, exported to the reference format: its card holds the run's final
    metrics, `train.py eval --init-from DIR` gives them bit for bit, and the reference checkpoint
    in it (read back through its all_config.yaml) evaluates bit for bit as our own export."""
    from commands.eval_command import evaluate_command

    trained = train.main(parse_config(tiny_run(demo_path, tmp_path, "--optim.max-steps", "6")))
    final = trained["final"]
    out = tmp_path / "model"
    assert train.command_line(["export", str(tmp_path / "run"), "--format", "reference", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", "README.md", "all_config.yaml",
                                               "step_6", "evaluate_in_reference.py"}
    card = (out / "README.md").read_text()
    for key in ("exact_accuracy", "accuracy", "q_halt_accuracy"):
        assert f"| {key} | {final[key]!r} |" in card
    assert f"--init-from {out}" in card and "evaluate_in_reference.py --data" in card
    compile((out / "evaluate_in_reference.py").read_text(), "evaluate_in_reference.py", "exec")
    saved = json.loads((out / "config.json").read_text())
    assert saved["metrics"]["exact_accuracy"] == final["exact_accuracy"]
    assert saved["dataset"]["identifiers_fingerprint"] and saved["config"]["data"]["path"] == demo_path

    elsewhere = ["--run.dir", str(tmp_path / "elsewhere"), "--data.cache-dir", str(tmp_path / "cache")]
    from_directory = evaluate_command(["--init-from", str(out), "--data.path", demo_path, *elsewhere])
    for key in ("exact_accuracy", "accuracy", "q_halt_accuracy", "lm_loss", "steps"):
        assert from_directory[key] == final[key], key

    # The same from a bucket (the GCS emulator), and as the weights a fine-tuning starts from.
    from commands.restore import load_initial_weights

    remote = gcs_url + "/models/demo"
    assert train.command_line(["export", str(tmp_path / "run"), "--format", "reference", "--out", remote]) == 0
    from_bucket = evaluate_command(["--init-from", remote, "--data.path", demo_path, *elsewhere])
    assert from_bucket == from_directory
    fingerprint = saved["dataset"]["identifiers_fingerprint"]
    start = load_initial_weights(remote, TRMConfig(**saved["config"]["model"]), fingerprint)
    exported, _, _ = read_exported(str(out / "model.safetensors"))
    assert all(torch.equal(start[f"model/{k}"], v) for k, v in exported.items())

    # The reference checkpoint, read back as this project reads the reference's own: the arch
    # and sizes from all_config.yaml beside it, the identifiers from config.json.
    same = ["--model.attention", saved["config"]["model"]["attention"],
            "--run.cpu-devices", str(saved["config"]["run"]["cpu_devices"])]
    ours = evaluate_command(["demo", "--init-from", str(out / "model.safetensors"), "--data.path", demo_path,
                             *elsewhere, *same])
    theirs = evaluate_command(["demo", "--init-from", str(out / "step_6"), "--data.path", demo_path,
                               *elsewhere, *same])
    assert theirs == ours
    assert ours["exact_accuracy"] == final["exact_accuracy"]

    # Another dataset's identifiers are refused for both.
    other = tmp_path / "other"
    import shutil

    shutil.copytree(demo_path, other)
    names = json.loads((other / "identifiers.json").read_text())
    (other / "identifiers.json").write_text(json.dumps(names[:-1] + [names[-1] + "-renamed"]))
    for source in (out, out / "step_6"):
        with pytest.raises(SystemExit, match="other puzzle identifiers"):
            evaluate_command(["demo", "--init-from", str(source), "--data.path", str(other), *elsewhere])


def test_the_model_card_says_how_many_test_examples_the_exported_steps_evaluation_read(demo_path, tmp_path):
    """A run whose evaluations read a subset (--eval.max-examples 8) but its final one every test
    example (the demo's 40): the card of the step-3 checkpoint says its evaluation read 8 of the 40,
    the card of the final step that it read every one."""
    train.main(parse_config(tiny_run(demo_path, tmp_path, "--optim.max-steps", "4", "--eval.every-epochs", "1",
                                     "--eval.max-examples", "8", "--run.ckpt-every", "3")))
    checkpoints = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [p.name[-1] for p in checkpoints] == ["3", "4"]
    cards = {}
    for checkpoint_dir in checkpoints:
        out = tmp_path / f"model{checkpoint_dir.name[-1]}"
        assert train.command_line(["export", str(checkpoint_dir), "--format", "reference", "--out", str(out)]) == 0
        cards[checkpoint_dir.name[-1]] = (out / "README.md").read_text()
        saved = json.loads((out / "config.json").read_text())
        assert saved["evaluated_examples"]["test_examples"] == 40
    assert "The run's evaluation of step 3 on a subset of 8 of the test split's 40 examples" in cards["3"]
    assert "every test example" not in cards["3"].split("## Evaluate it here")[0]
    assert "The run's evaluation of step 4 on every test example (40):" in cards["4"]


def test_all_config_and_the_evaluation_script_fit_the_references_pretrain(tmp_path):
    """all_config.yaml holds every field the reference's PretrainConfig requires and none it does
    not have; every call evaluate_in_reference.py makes into pretrain names a function (or the
    config class) of the reference's pretrain.py with parameters it has."""
    config = small_config("trm", "bfloat16")
    run_dir, _ = trained_checkpoint(tmp_path, config, steps=1)
    out = tmp_path / "model"
    assert train.command_line(["export", str(run_dir), "--format", "reference", "--out", str(out)]) == 0
    definitions = pretrain_definitions()

    def fields(cls):
        return {n.target.id: n.value is None for n in definitions[cls].body if isinstance(n, ast.AnnAssign)}

    saved = yaml.safe_load((out / "all_config.yaml").read_text())
    declared = fields("PretrainConfig")
    assert set(saved) == set(declared)  # every field written: its save_code_and_config dumps them all
    assert {"name", "loss"} <= set(saved["arch"]) and set(saved["arch"]["loss"]) == {"name", "loss_type"}
    # The overrides form: the arch's config group, then every value, each reading back as written.
    overrides = json.loads((out / "config.json").read_text())["reference"]["hydra_overrides"]
    assert overrides[0] == "arch=trm"
    rebuilt = {"arch": {k: v for k, v in saved["arch"].items() if k in ("name", "loss")}, "evaluators": []}
    for override in overrides[1:]:
        key, value = override.removeprefix("++").split("=", 1)
        *parents, leaf = key.split(".")
        (rebuilt[parents[0]] if parents else rebuilt)[leaf] = yaml.safe_load(value)
    assert rebuilt == {k: v for k, v in saved.items() if v is not None}
    script = ast.parse((out / "evaluate_in_reference.py").read_text())
    calls = [n for n in ast.walk(script) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "pretrain"]
    assert {c.func.attr for c in calls} == {"PretrainConfig", "create_dataloader", "create_evaluators",
                                           "init_train_state", "evaluate"}
    for call in calls:
        definition = definitions[call.func.attr]
        if isinstance(definition, ast.ClassDef):
            continue  # PretrainConfig(**all_config): checked above
        params = [a.arg for a in definition.args.args]
        assert len(call.args) <= len(params), call.func.attr
        named = {k.arg for k in call.keywords if k.arg}
        assert named <= set(params) or definition.args.kwarg, (call.func.attr, named - set(params))
        assert set(params[len(call.args):]) - named <= {a.arg for a in definition.args.args[
            len(definition.args.args) - len(definition.args.defaults):]} or any(k.arg is None for k in call.keywords)


STAND_IN_PRETRAIN = '''"""A stand-in for the reference's pretrain.py (which needs CUDA, hydra and wandb): records what
the evaluation script hands each function; init_train_state reads the checkpoint as its
load_checkpoint would."""
import json
import sys
from types import SimpleNamespace

import torch

def PretrainConfig(**fields):
    return SimpleNamespace(**fields)

def create_dataloader(config, split, rank, world_size, **kwargs):
    return f"loader of {split}", {"split": split}

def create_evaluators(config, eval_metadata):
    return []

def init_train_state(config, train_metadata, rank, world_size):
    keys = sorted(torch.load(config.load_checkpoint, map_location="cpu"))
    print("LOADED " + json.dumps({"path": config.load_checkpoint, "keys": keys, "data": config.data_paths,
                                  "metadata": train_metadata}))
    return SimpleNamespace(model=SimpleNamespace(eval=lambda: None))

def evaluate(config, train_state, eval_loader, eval_metadata, evaluators, rank, world_size, cpu_group):
    return {"all": {"accuracy": 0.5, "loader": eval_loader}}
'''


def test_the_evaluation_script_checks_the_identifiers_and_hands_the_checkpoint_to_pretrain(demo_path, tmp_path):
    """evaluate_in_reference.py run (from the reference's checkout: here a stand-in pretrain.py)
    on the demo's identifiers: load_checkpoint gets step_N (its keys stripped of `_orig_mod.` in
    a copy under DISABLE_COMPILE, where pretrain.py does not compile), the dataset given by
    --data; a dataset with other identifiers is refused before anything loads."""
    import os
    import shutil
    import subprocess
    import sys

    import data

    config = small_config("trm", "float32")
    run_dir, _ = trained_checkpoint(
        tmp_path, config, steps=1, config=Config(data=DataConfig(path=demo_path)))
    # The checkpoint's state names the demo's identifiers, as a run on it would.
    state_file = next((run_dir / "checkpoints").iterdir()) / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps(dict(state, dataset_identifiers=data.identifiers_fingerprint(demo_path))))
    out = tmp_path / "model"
    assert train.command_line(["export", str(run_dir), "--format", "reference", "--out", str(out)]) == 0
    checkout = tmp_path / "TinyRecursiveModels"
    checkout.mkdir()
    (checkout / "pretrain.py").write_text(STAND_IN_PRETRAIN)

    def run(*args, **env):
        return subprocess.run([sys.executable, str(out / "evaluate_in_reference.py"), *args], cwd=checkout,
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))

    done = run("--data", demo_path)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.split("LOADED ")[1].splitlines()[0])
    assert loaded["path"] == str(out / "step_1") and loaded["data"] == [demo_path]
    assert loaded["metadata"] == {"split": "train"}  # the model sized by the training split, as launch does
    assert all(k.startswith("_orig_mod.model.inner.") for k in loaded["keys"])
    assert json.loads(done.stdout[done.stdout.index('{\n  "all"'):]) == {"all": {"accuracy": 0.5,
                                                                               "loader": "loader of test"}}
    uncompiled = run("--data", demo_path, DISABLE_COMPILE="1")
    assert uncompiled.returncode == 0, uncompiled.stderr
    keys = json.loads(uncompiled.stdout.split("LOADED ")[1].splitlines()[0])["keys"]
    assert keys == sorted(k.removeprefix("_orig_mod.") for k in loaded["keys"])
    other = tmp_path / "other"
    shutil.copytree(demo_path, other)
    names = json.loads((other / "identifiers.json").read_text())
    (other / "identifiers.json").write_text(json.dumps(names[:-1] + [names[-1] + "-renamed"]))
    refused = run("--data", str(other))
    assert refused.returncode == 1 and "other puzzle identifiers" in refused.stderr and "LOADED" not in refused.stdout
