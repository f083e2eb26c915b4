"""A trained model handed to its arch's own code: `train.py export SOURCE --format reference
--out DIR` writes a model directory in the layout model hubs use, which both this project and
the reference's pretrain.py (github.com/SamsungSAILMontreal/TinyRecursiveModels) read:

    DIR/model.safetensors          our export (EMA weights, model config and identifiers in its metadata)
    DIR/config.json                our whole run configuration, the reference's, the dataset, the metrics
    DIR/README.md                  the model card: training config, dataset, final metrics, how to evaluate
    DIR/step_N                     the reference's checkpoint, as its save_train_state saves it
    DIR/all_config.yaml            the reference's PretrainConfig, as its save_code_and_config writes it
    DIR/evaluate_in_reference.py   its pretrain.load_checkpoint and pretrain.evaluate, unchanged, on DIR

`--format eqr` and `--format urm` write the same directory for EqR's and URM's code, their
checkpoint and config in their own layout (reference/successors.py). Each format is a `Target`:
what differs between the codebases (the checkpoint's file, contents and dtypes, the config
file, what their code cannot express, how to run it); the rest, here, is shared. What a
target's code cannot express is refused, naming the option (`refusals`). Reading back:
`read_model_dir` (train.py eval / --run.init-from DIR), `config_from_all_config` (a checkpoint
beside its all_config.yaml, or with its config inside, ours or their code's own)."""
from __future__ import annotations

import dataclasses
import io
import json

import torch
import yaml

from model import TRM
from modeling.schemes import SCHEMES
from rundir import storage
from training import checkpoint
from training.config import Config, config_from_dict, with_arch, with_new_fields

REFERENCE_REPO = "https://github.com/SamsungSAILMontreal/TinyRecursiveModels"
REFERENCE_COMMIT = "e7b68717f0a6c4cbb4ce6fbef787b14f42083bd9"
"""The reference commit whose model files tests/reference holds and whose pretrain.py this format targets."""
LOSS = {"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy"}
COMPILED_PREFIX = "_orig_mod."
"""pretrain.py compiles the model (unless DISABLE_COMPILE is set): its state_dict, which
save_train_state saves and load_checkpoint loads, names every tensor under this prefix."""
FORMAT = "trm-model/1"
SCRIPT = "evaluate_in_reference.py"


def refusals(config: Config, step: int, full_steps: int | None) -> list[str]:
    """What of this run the reference's code cannot express, each naming the option and why
    (empty: it can be exported). `full_steps`: the run's steps of optim.epochs (None: unknown)."""
    model, out = config.model, []
    if model.separate_H_L:
        out.append("model.separate_H_L=True: the paper's separate f_H/f_L ablation; the reference's trm.py has "
                   "one shared network (its H_layers is ignored) and no flag for a second one")
    if model.one_step_grad:
        out.append("model.one_step_grad=True: the paper's 1-step-gradient ablation; the reference's trm.py "
                   "always takes the gradient through the whole last recursion (L_cycles + 1 updates)")
    if model.conv_kernel:
        out.append(f"model.conv_kernel={model.conv_kernel}" + (" (arch urm)" if model.arch == "urm" else "")
                   + ": URM's ConvSwiGLU; the reference's SwiGLU has no conv, and its code no URM")
    return out + numerics_refusals(config, "the reference") + puzzle_table_refusals(config, "the reference's") \
        + curriculum_refusals(config, step, full_steps, "the reference")


def numerics_refusals(config: Config, who: str) -> list[str]:
    """Attention computed otherwise than `who`'s code computes it (one softmax over all keys)."""
    model = config.model
    if model.attention == "blockwise" and model.total_len > model.attention_block and model.forward_dtype != "float32":
        blocks = -(-model.total_len // model.attention_block)
        return [f"model.attention_block={model.attention_block}: this model's attention ran over {blocks} key "
                f"blocks of its {model.total_len} positions with an online softmax whose {model.forward_dtype} "
                f"probabilities are rounded against each block's running maximum, where {who} computes "
                "one softmax over all keys (SDPA): other numerics in every attention layer (in float32 the "
                "two agree to float32 rounding). Train with --model.attention-block "
                f"{model.total_len} or more, or --model.attention sdpa"]
    return []


def puzzle_table_refusals(config: Config, whose: str) -> list[str]:
    """A model without a puzzle embedding, which `whose` pretrain.load_checkpoint cannot load."""
    if config.model.puzzle_emb_ndim == 0:
        return [f"model.puzzle_emb_ndim=0: {whose} pretrain.load_checkpoint reads "
                "model.model.puzzle_emb.weights.shape whatever the model, and a model without a puzzle "
                "embedding has none (AttributeError): its code cannot load this model"]
    return []


def curriculum_refusals(config: Config, step: int, full_steps: int | None, who: str) -> list[str]:
    """A checkpoint trained, at this step, with other cycles than the model's (`who` has no curriculum)."""
    model, optim = config.model, config.optim
    if not optim.curriculum_epochs:
        return []
    from training.schedule import Curriculum

    cycles = (model.H_cycles, model.L_cycles)
    at = Curriculum(config, full_steps).at(step) if full_steps else None
    if at == cycles:
        return []
    return [f"optim.curriculum_epochs={optim.curriculum_epochs}: "
            + (f"step {step} trained with H_cycles {at[0]}, L_cycles {at[1]}, not the model's "
               f"{cycles[0]}, {cycles[1]}" if at else
               "the dataset is unreadable, so whether the curriculum was over cannot be told")
            + f"; {who} has no recursion curriculum. Export a checkpoint past the curriculum"]


def reference_arch(config: Config) -> dict:
    """all_config.yaml's `arch`: the model class, the loss and the fields its config class reads
    (under its names: URM's num_layers, EqR's lambda_)."""
    model = config.model
    scheme = SCHEMES[model.arch]
    arch = {"name": scheme.reference_class, "loss": dict(LOSS)}
    for name in scheme.reference_fields:
        value = getattr(model, name)
        arch[name] = float(value) if name == "expansion" else value
    for theirs, ours in scheme.reference_renames.items():
        arch[theirs] = getattr(model, ours)
    return arch


def reference_data_path(path: str) -> str:
    """A local path as it is; a bucket's dataset as the reference's data/NAME (its builders' place)."""
    return "data/" + path.rstrip("/").rsplit("/", 1)[-1] if "://" in path else path


def all_config(config: Config) -> dict:
    """The reference's PretrainConfig (pretrain.py) with this run's architecture, data and
    training settings: what its save_code_and_config writes as all_config.yaml, and what
    `python pretrain.py --config-path DIR --config-name all_config` rebuilds."""
    training = training_fields(config)
    return {
        "arch": reference_arch(config),
        "data_paths": [reference_data_path(config.data.path)],
        "data_paths_test": [],
        "evaluators": arc_evaluators(config),
        **{k: training[k] for k in ("global_batch_size", "epochs", "lr", "lr_min_ratio", "lr_warmup_steps",
                                    "weight_decay", "beta1", "beta2", "puzzle_emb_lr", "puzzle_emb_weight_decay")},
        "project_name": None,
        "run_name": None,
        "load_checkpoint": None,
        "checkpoint_path": None,
        "seed": training["seed"],
        "checkpoint_every_eval": False,
        "eval_interval": eval_interval(config),
        "min_eval_interval": 0,
        "eval_save_outputs": [],
        "ema": training["ema"],
        "ema_rate": training["ema_rate"],
        "freeze_weights": False,
    }


def training_fields(config: Config) -> dict:
    """The training settings every target's PretrainConfig has, under the names the three codes
    share (each target's all_config picks and orders them as its own config class has them)."""
    optim = config.optim
    return {"global_batch_size": optim.global_batch_size, "epochs": optim.epochs, "lr": optim.lr,
            "lr_min_ratio": 1.0 if optim.lr_schedule == "constant" else optim.lr_min_ratio,
            "lr_warmup_steps": optim.lr_warmup_steps, "weight_decay": optim.weight_decay, "beta1": optim.beta1,
            "beta2": optim.beta2, "puzzle_emb_lr": optim.puzzle_emb_lr,
            "puzzle_emb_weight_decay": optim.puzzle_emb_weight_decay, "seed": config.run.seed,
            "ema": optim.ema_rate > 0, "ema_rate": optim.ema_rate if optim.ema_rate > 0 else 0.999}


def arc_evaluators(config: Config) -> list[dict]:
    return [{"name": "arc@ARC"}] if config.eval.arc else []


def eval_interval(config: Config) -> int | None:
    """Epochs between evaluations (the reference's and URM's eval_interval, which must divide
    epochs), or None when this run's does not divide them."""
    every = min(config.eval.every_epochs, config.optim.epochs)
    return every if config.optim.epochs % every == 0 else None


def hydra_value(value) -> str:
    """A value in hydra's override grammar (YAML-like literals)."""
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()


def hydra_overrides(saved: dict, arch: str) -> list[str]:
    """all_config.yaml as overrides of the reference's own config (`python pretrain.py ...`):
    the arch's config group (its config/arch/ARCH.yaml), then every value with `++` (add or
    override: its yamls leave some fields out, e.g. rope_theta); the loss and the evaluators'
    default (ARC's) as its yamls have them."""
    out = [f"arch={arch}"]
    out += [f"++arch.{k}={hydra_value(v)}" for k, v in saved["arch"].items() if k not in ("name", "loss")]
    for key, value in saved.items():
        if key == "arch" or value is None or (key == "evaluators" and value):
            continue
        out.append(f"++{key}={hydra_value(value)}")
    return out


def not_in_all_config(config: Config, who: str = "the reference",
                      optimizers: tuple[str, ...] = ("adam_atan2",), max_steps: bool = False) -> list[str]:
    """Training settings of this run that `who`'s PretrainConfig cannot say (the weights do not
    depend on them at evaluation; retraining there would differ). `optimizers`: the ones its
    code has; `max_steps`: whether its config has a max_steps (EqR's)."""
    optim, model, out = config.optim, config.model, []
    if optim.optimizer not in optimizers:
        out.append(f"optim.optimizer={optim.optimizer} ({who}: {', '.join(optimizers)} only)")
    if optim.lr_schedule == "linear" and optim.lr_min_ratio < 1:
        out.append(f"optim.lr_schedule=linear ({who}: cosine only)")
    if not model.act_enabled and "act_enabled" not in SCHEMES[model.arch].reference_fields:
        out.append(f"model.act_enabled=False ({who}'s {model.arch} always halts on its Q head in training)")
    if model.halt_exploration_final is not None:
        out.append(f"model.halt_exploration_final={model.halt_exploration_final} ({who}: a constant "
                   "halt_exploration_prob, written as the anneal's start)")
    if optim.curriculum_epochs:
        out.append(f"optim.curriculum_epochs={optim.curriculum_epochs} (over by this step; {who} has "
                   "no curriculum)")
    if optim.max_steps is not None and not max_steps:
        out.append(f"optim.max_steps={optim.max_steps} ({who} trains whole epochs)")
    return out


def reference_state_dict(weights: dict[str, torch.Tensor], config: Config,
                         prefix: str = COMPILED_PREFIX) -> dict[str, torch.Tensor]:
    """Our EMA weights (our names) as the arch's own code names them (`model.inner.*` under
    `prefix`: the reference's compiled ACTLossHead's `_orig_mod.`), each tensor in our dtype,
    which is the dtype the reference's own model holds it in (load_checkpoint assigns them as
    they are): float32 weights, the initial-state buffers in forward_dtype (as ours)."""
    from reference.weights import reference_state_dict as theirs

    model = TRM(config.model)
    model.load_state_dict(weights, strict=True)
    return {prefix + k: v.detach().clone().contiguous() for k, v in theirs(model).items()}


class Target:
    """A codebase that a model directory is written for (`train.py export --format NAME`): this
    one is the TRM reference's (its pretrain.py and model files at REFERENCE_COMMIT); EqR's and
    URM's, and the registry of all three (TARGETS), are in reference/successors.py. A target
    says what differs: what of a run its code cannot express, its checkpoint's file name and
    contents (names, dtypes, the dict around the state dict), its config file, extra files and
    how the card runs it."""

    name = "reference"
    who = "the reference"
    """How the texts name its code."""
    repository, commit = REFERENCE_REPO, REFERENCE_COMMIT

    def refusals(self, config: Config, step: int, full_steps: int | None) -> list[str]:
        """What of this run its code cannot express, each naming the option (`full_steps`: the
        run's steps of optim.epochs, None when unknown)."""
        return refusals(config, step, full_steps)

    def checkpoint_name(self, step: int) -> str:
        """The checkpoint's path in the directory, as its code names it."""
        return f"step_{step}"

    def checkpoint(self, weights: dict[str, torch.Tensor], config: Config, step: int):
        """What torch.save writes into the checkpoint: its save function's object for `weights`."""
        return reference_state_dict(weights, config)

    def all_config(self, config: Config) -> dict:
        return all_config(config)

    def not_in_all_config(self, config: Config) -> list[str]:
        return not_in_all_config(config)

    def caveats(self, config: Config) -> list[str]:
        """What its own evaluation does otherwise with this model than it was trained (said in the card)."""
        return []

    def files(self, checkpoint_name: str) -> dict[str, str]:
        """Other files of the directory: name -> text."""
        return {SCRIPT: evaluation_script(checkpoint_name)}

    def card_section(self, card: dict, there: str, local: bool) -> list[str]:
        """The model card's lines on evaluating (and training from) the directory in its code,
        `there` being the directory's path there."""
        reference = card["reference"]
        ckpt = reference["checkpoint"]
        return [
            f"The reference ({reference['repository']}, commit {reference['commit']}) reads `{ckpt}` (its "
            "`save_train_state`'s format, `_orig_mod.model.inner.*`) and `all_config.yaml` (its `PretrainConfig`). "
            "It has no evaluation-only entry point: `evaluate_in_reference.py` runs the evaluating part of its "
            "`pretrain.launch`, calling its `create_model` (whose `load_checkpoint` loads the weights) and "
            "`evaluate` unchanged. From a checkout of the reference, on a CUDA machine with its requirements"
            + ("" if local else " (after copying this directory there)") + ":",
            "",
            "```",
            f"cd TinyRecursiveModels && python {there}/evaluate_in_reference.py --data "
            f"{reference['all_config']['data_paths'][0]}",
            "```",
            "",
            "To train or fine-tune from it there: `python pretrain.py --config-path "
            f"{there} --config-name all_config load_checkpoint={there}/{ckpt}`, or with the same settings as "
            "overrides of the reference's own config:",
        ]


def run_dir_of(checkpoint_url: str) -> str:
    """RUN from RUN/checkpoints/step_N."""
    return checkpoint_url.rstrip("/").rsplit("/", 2)[0]


def final_metrics(checkpoint_url: str, step: int) -> dict | None:
    """The run's evaluation of this step (its eval/step_N/metrics.json), or None."""
    url = storage.join_url(run_dir_of(checkpoint_url), "eval", f"step_{step}", "metrics.json")
    if not storage.exists(url):
        return None
    return json.loads(storage.read_bytes(url))


def _full_steps(config: Config) -> int | None:
    import data
    from data import total_train_steps

    try:
        metadata = data.read_metadata(config.data.path, "train")
    except (data.DatasetError, OSError):
        return None
    return total_train_steps(metadata, config.optim.epochs, config.optim.global_batch_size)


def export_reference(source: str, out: str, say=print, goal: Target | None = None) -> dict:
    """`train.py export SOURCE --format FORMAT --out DIR`: the model directory (module
    docstring) of SOURCE's EMA weights for `goal`, the format's Target (None: the reference's);
    returns its config.json. Raises ValueError naming what the target's code cannot express."""
    goal = goal or Target()
    found = checkpoint.weights_of(source, say)
    if found is None:
        raise ValueError(f"{source} is not a run or checkpoint directory (the {goal.name} format needs the run's "
                         "configuration, which a checkpoint holds)")
    weights, state, url = found
    config = config_from_dict(with_new_fields(state["config"]))
    step = state["step"]
    refused = goal.refusals(config, step, _full_steps(config) if config.optim.curriculum_epochs else None)
    if refused:
        raise ValueError(f"{goal.who}'s code cannot express this model:\n  " + "\n  ".join(refused))
    ckpt = goal.checkpoint_name(step)
    theirs = goal.checkpoint(weights, config, step)
    reference = goal.all_config(config)
    metrics = final_metrics(url, step)
    import data

    try:  # how many examples the test split holds, to say whether the evaluation read a subset
        test_examples = data.split_examples(config.data.path, "test")
    except (data.DatasetError, OSError):
        test_examples = None
    card = {
        "format": FORMAT,
        "step": step,
        "source": url,
        "config": dataclasses.asdict(config),
        "dataset": {"path": config.data.path, "identifiers_fingerprint": state.get("dataset_identifiers"),
                    "num_puzzle_identifiers": config.model.num_puzzle_identifiers,
                    "seq_len": config.model.seq_len, "vocab_size": config.model.vocab_size},
        "metrics": metrics,
        # examples the step's evaluation read (its metrics' count) and the test split's, None when unknown
        "evaluated_examples": {"read": (metrics or {}).get("count"), "test_examples": test_examples},
        "reference": {"format": goal.name, "repository": goal.repository, "commit": goal.commit, "checkpoint": ckpt,
                      "all_config": reference, "hydra_overrides": hydra_overrides(reference, config.model.arch),
                      "not_in_all_config": goal.not_in_all_config(config), "caveats": goal.caveats(config)},
    }
    buffer = io.BytesIO()
    torch.save(theirs, buffer)
    checkpoint.export_model(weights, state, storage.join_url(out, "model.safetensors"))
    storage.write_bytes(storage.join_url(out, ckpt), buffer.getvalue())
    storage.write_bytes(storage.join_url(out, "all_config.yaml"),
                        yaml.safe_dump(reference, sort_keys=False).encode())
    for name, text in goal.files(ckpt).items():
        storage.write_bytes(storage.join_url(out, name), text.encode())
    storage.write_bytes(storage.join_url(out, "config.json"), json.dumps(card, indent=2).encode())
    from reference.model_card import model_card

    storage.write_bytes(storage.join_url(out, "README.md"), model_card(card, out, goal).encode())
    return card


def export_directory(source: str, out: str, goal: Target | None = None) -> None:
    """The command line's `export SOURCE --format FORMAT --out DIR` (its URLs checked by
    export.export_command; `goal` the format's Target): errors as one line each."""
    goal = goal or Target()
    try:
        card = export_reference(source, out, goal=goal)
    except (ValueError, checkpoint.CheckpointError) as e:
        raise SystemExit(f"error: {e}")
    ref = card["reference"]
    print(f"exported the EMA weights of {card['source']} (step {card['step']}) to {out}: model.safetensors, "
          f"{goal.who}'s {ref['checkpoint']} and all_config.yaml, config.json, README.md (the model card, "
          f"with the commands that evaluate it here and in {goal.who}'s code)", flush=True)


def model_dir_config(url: str) -> dict | None:
    """The config.json of a model directory (this format, beside model.safetensors), None when
    `url` is no such directory."""
    if url.endswith(".safetensors") or not storage.exists(storage.join_url(url, "config.json")):
        return None
    try:
        card = json.loads(storage.read_bytes(storage.join_url(url, "config.json")))
    except (ValueError, OSError):
        return None
    return card if isinstance(card, dict) and card.get("format") == FORMAT else None


def read_model_dir(url: str) -> tuple[dict[str, torch.Tensor], dict, int, str | None] | None:
    """(our weights, the run's configuration as a dict, step, identifiers fingerprint) of a
    model directory; None when `url` is not one."""
    card = model_dir_config(url)
    if card is None:
        return None
    weights, _, trained_on = checkpoint.read_exported(storage.join_url(url, "model.safetensors"))
    trained_on = trained_on or card["dataset"]["identifiers_fingerprint"]
    return weights, with_new_fields(card["config"]), card["step"], trained_on


def files_beside_checkpoint(checkpoint_url: str) -> tuple[dict | None, str | None]:
    """(all_config.yaml, identifiers fingerprint of our config.json) in the directory of a
    checkpoint of an arch's own code, each None when absent: the reference and URM write
    all_config.yaml beside their step_N files, EqR in the run directory above its checkpoints/
    (looked for there too), our model directory both."""
    folder = checkpoint_url.rstrip("/").rsplit("/", 1)[0] if "/" in checkpoint_url else "."
    folders = [folder]
    if folder.rstrip("/").rsplit("/", 1)[-1] == "checkpoints":  # EqR's RUN/checkpoints/step_N.pth
        folders.append(folder.rstrip("/").rsplit("/", 1)[0] if "/" in folder.rstrip("/") else ".")
    found, card = None, None
    for place in folders:
        if found is None and storage.exists(storage.join_url(place, "all_config.yaml")):
            found = yaml.safe_load(storage.read_bytes(storage.join_url(place, "all_config.yaml")))
        card = card or model_dir_config(place)
    return found, card["dataset"]["identifiers_fingerprint"] if card else None


def config_from_all_config(saved: dict, base: Config) -> Config:
    """`base` with what a saved PretrainConfig says (the reference's or URM's all_config.yaml,
    EqR's, which its checkpoints also hold): the arch (its model class) and every model field its
    config class reads (under its names: URM's num_layers, EqR's lambda_), the data path, batch
    size, optimizer settings, EMA, seed and ARC evaluation. The rest (attention, run settings)
    stays as `base` says. ValueError for a value the arch's scheme cannot compute."""
    arch = saved.get("arch") or {}
    by_class = {s.reference_class: name for name, s in SCHEMES.items()}
    if arch.get("name") not in by_class:
        raise ValueError(f"all_config.yaml's arch.name {arch.get('name')!r} is none of the models of the "
                         f"reference, EqR or URM: {', '.join(by_class)}")
    name = by_class[arch["name"]]
    scheme = SCHEMES[name]
    problems = scheme.reference_problems(arch)
    if problems:
        raise ValueError(f"the saved config's arch ({arch['name']}) has what --model.arch {name} cannot compute: "
                         + "; ".join(problems))
    base = with_arch(base, name)
    fields = {}
    for theirs, ours in [(f, f) for f in scheme.reference_fields] + list(scheme.reference_renames.items()):
        if theirs in arch:
            if isinstance(arch[theirs], str) and arch[theirs].startswith("${"):
                raise ValueError(f"all_config.yaml's arch.{theirs} is {arch[theirs]!r}: an unresolved hydra "
                                 "interpolation; give the value")
            fields[ours] = arch[theirs]
    if "expansion" in fields:
        fields["expansion"] = float(fields["expansion"])
    model = dataclasses.replace(base.model, **fields)
    optim = dataclasses.replace(base.optim, **{k: saved[k] for k in (
        "global_batch_size", "epochs", "lr", "lr_min_ratio", "lr_warmup_steps", "weight_decay", "beta1", "beta2",
        "puzzle_emb_lr", "puzzle_emb_weight_decay") if k in saved},
        ema_rate=saved.get("ema_rate", 0.999) if saved.get("ema") else 0.0)
    if saved.get("use_muon"):  # URM's
        optim = dataclasses.replace(optim, optimizer="muon")
    dataset = saved.get("dataset") or {}  # EqR's: name, data_path, evaluators
    paths = saved.get("data_paths") or [saved.get("data_path") or dataset.get("data_path") or base.data.path]
    evaluators = saved.get("evaluators") or dataset.get("evaluators") or []
    return dataclasses.replace(
        base, model=model, optim=optim, data=dataclasses.replace(base.data, path=paths[0]),
        run=dataclasses.replace(base.run, seed=saved.get("seed", base.run.seed)),
        eval=dataclasses.replace(base.eval, arc=any(str(e.get("name", "")).startswith("arc@") for e in evaluators)))


def evaluation_script(ckpt: str) -> str:
    """DIR/evaluate_in_reference.py: the reference has no evaluation-only entry point; this runs
    the part of its pretrain.launch that evaluates, calling its own functions unchanged."""
    return _SCRIPT.replace("@CHECKPOINT@", ckpt).replace("@COMMIT@", REFERENCE_COMMIT)


_SCRIPT = '''"""Evaluate this model directory with the reference's own code
(https://github.com/SamsungSAILMontreal/TinyRecursiveModels, commit @COMMIT@): its
pretrain.py builds the model from all_config.yaml (create_model, whose load_checkpoint reads
@CHECKPOINT@) and runs its evaluate() on the test split, as its training loop evaluates. Nothing
of the reference is changed. Run it from the reference's checkout, on a CUDA machine with its
requirements installed:

    cd TinyRecursiveModels && python /path/to/this/evaluate_in_reference.py --data data/DATASET

--data: the dataset directory (built by the reference's builders or this project's, the same
layout); its identifiers.json must be the one the model was trained on (checked).
"""
import argparse
import hashlib
import json
import os
import sys
import tempfile

import torch
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def fingerprint(data_path):
    """The hash of the dataset's identifier names in order, as the exporting project computes it."""
    path = os.path.join(data_path, "identifiers.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        names = json.load(f)
    return hashlib.sha256(json.dumps(names, separators=(",", ":")).encode()).hexdigest()[:16]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\\n\\n")[0])
    parser.add_argument("--data", help="the dataset directory (default: all_config.yaml's data_paths)")
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    import pretrain  # the reference's, from its checkout (the current directory)

    with open(os.path.join(HERE, "all_config.yaml")) as f:
        raw = yaml.safe_load(f)
    with open(os.path.join(HERE, "config.json")) as f:
        trained_on = json.load(f)["dataset"]["identifiers_fingerprint"]
    if args.data:
        raw["data_paths"], raw["data_paths_test"] = [args.data], []
    found = fingerprint(raw["data_paths"][0])
    if trained_on and found and found != trained_on:
        sys.exit(f"error: {raw['data_paths'][0]} has other puzzle identifiers (fingerprint {found}) than the "
                 f"model was trained on ({trained_on}): row i of its puzzle table belongs to another puzzle there")
    checkpoint = os.path.join(HERE, "@CHECKPOINT@")
    if "DISABLE_COMPILE" in os.environ:  # an uncompiled model names its tensors without _orig_mod.
        state = torch.load(checkpoint, map_location="cpu")
        checkpoint = os.path.join(tempfile.mkdtemp(), "@CHECKPOINT@")
        torch.save({k.removeprefix("_orig_mod."): v for k, v in state.items()}, checkpoint)
    raw.update(load_checkpoint=checkpoint, checkpoint_path=None)
    config = pretrain.PretrainConfig(**raw)
    kwargs = dict(epochs_per_iter=1, global_batch_size=config.global_batch_size, rank=0, world_size=1)
    _, train_metadata = pretrain.create_dataloader(config, "train", test_set_mode=False, **kwargs)
    eval_loader, eval_metadata = pretrain.create_dataloader(config, "test", test_set_mode=True, **kwargs)
    evaluators = pretrain.create_evaluators(config, eval_metadata)
    train_state = pretrain.init_train_state(config, train_metadata, rank=0, world_size=1)  # load_checkpoint
    train_state.model.eval()
    metrics = pretrain.evaluate(config, train_state, eval_loader, eval_metadata, evaluators, rank=0,
                                world_size=1, cpu_group=None)
    print(json.dumps(metrics, indent=2, default=float))


if __name__ == "__main__":
    main()
'''
