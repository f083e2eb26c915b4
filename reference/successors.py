"""Model directories for EqR's and URM's own code (`train.py export SOURCE --format eqr|urm --out
DIR`): reference/model_dir.py's directory (model.safetensors, config.json, README.md,
all_config.yaml) with the checkpoint each one's code saves and loads, in its layout. Written from
reading their code (EqR: github.com/locuslab/EqR, Apache-2.0; URM: github.com/UbiquantAI/URM, no
license, none of it copied); reading their checkpoints back is reference/checkpoint_file.py's.

    --format eqr   DIR/checkpoints/step_N.pth  utils/checkpoint.save_checkpoint's dict: "model" (the
                                              state dict, model.inner.*, the names EqR's loaders load
                                              into its uncompiled model strictly), "ema" {"mu",
                                              "shadow": _orig_mod.model.inner.*, as its compiled
                                              training names them; load_ema strips the prefix},
                                              "config" (its PretrainConfig, with load_strict true),
                                              "step"
                   DIR/all_config.yaml        the same PretrainConfig, where its runs keep it (the run
                                              directory above checkpoints/)
    --format urm   DIR/step_N.pt              pretrain.save_train_state's dict: "model_state_dict"
                                              (_orig_mod.model.inner.*, as its compiled model loads
                                              strictly, the convs in bfloat16 as its model holds
                                              them), "step"
                   DIR/all_config.yaml        its PretrainConfig beside the checkpoint, where its
                                              load_config_from_checkpoint_path and
                                              evaluate_trained_model.py read it (the arch first, then
                                              beta1: that script reads the flat fields from there on)

The weights are our EMA weights in both (EqR's evaluate.py evaluates the "ema" shadow, URM saves
its EMA copy as the model)."""
from __future__ import annotations

import torch

from modeling.schemes import SCHEMES
from reference.model_dir import (
    COMPILED_PREFIX,
    Target,
    arc_evaluators,
    curriculum_refusals,
    eval_interval,
    not_in_all_config,
    numerics_refusals,
    puzzle_table_refusals,
    reference_arch,
    reference_data_path,
    reference_state_dict,
    training_fields,
)


class Successor(Target):
    """A codebase of one arch (EqR's eqr, URM's urm), whose own evaluation has an entry point."""

    arch = ""

    def refusals(self, config, step, full_steps):
        model, out = config.model, []
        if model.arch != self.arch:
            out.append(f"model.arch={model.arch}: {self.who}'s code runs its {self.arch} (this project's "
                       f"--model.arch {self.arch}); export --format reference for the reference's archs")
        if model.conv_kernel and self.arch != "urm":
            out.append(f"model.conv_kernel={model.conv_kernel}: URM's ConvSwiGLU; {self.who}'s SwiGLU has no conv")
        return out + numerics_refusals(config, self.who) + curriculum_refusals(config, step, full_steps, self.who)

    def files(self, checkpoint_name):
        return {}


class EqRTarget(Successor):
    name, who, arch = "eqr", "EqR", "eqr"
    repository = "https://github.com/locuslab/EqR"
    commit = "4d45856c05b47de33512d4398c863f4b7fbf721c"

    def checkpoint_name(self, step):
        return f"checkpoints/step_{step}.pth"

    def checkpoint(self, weights, config, step):
        theirs = reference_state_dict(weights, config, prefix="")
        saved = {"step": step, "model": theirs, "config": self.all_config(config)}
        if config.optim.ema_rate > 0:  # every tensor of EqR's model is a parameter, so all are averaged
            saved["ema"] = {"mu": config.optim.ema_rate, "shadow": {COMPILED_PREFIX + k: v for k, v in theirs.items()}}
        return saved

    def all_config(self, config):
        """EqR's PretrainConfig (config/schema.py; config/arch/eqr.yaml's arch fields): what its
        save_checkpoint saves as "config" and evaluate.py builds the model from."""
        arch = reference_arch(config)
        arch = {"name": arch.pop("name"), "short_name": "EqR", "loss": arch.pop("loss"), **arch,
                "H_init_std": SCHEMES["eqr"].INIT_STD, "L_init_std": SCHEMES["eqr"].INIT_STD,
                "board_height": None, "board_width": None}  # rope2d: EqR's square board of seq_len cells
        path, training = reference_data_path(config.data.path), training_fields(config)
        return {
            "arch": arch,
            "dataset": {"name": path.rstrip("/").rsplit("/", 1)[-1], "data_path": path,
                        "evaluators": arc_evaluators(config)},
            "optimizer_kwargs": {},
            **{k: training[k] for k in ("global_batch_size", "epochs", "lr", "lr_min_ratio", "lr_warmup_steps")},
            "gradient_accumulation_steps": 1,
            **{k: training[k] for k in ("weight_decay", "beta1", "beta2")},
            "grad_clip_norm": None,
            "target_q_update_every": 4,
            "project_name": None, "run_name": None, "checkpoint_path": None,
            "load_checkpoint": None, "load_weights_only": False,
            "load_strict": True,  # its evaluate.py and load_training_state then load every tensor or fail
            "seed": training["seed"],
            "train_epochs_per_iter": None,
            "eval_interval_steps": None,
            "checkpoint_interval_steps": None,
            "max_steps": config.optim.max_steps,
            "ema": training["ema"],
            "ema_rate": training["ema_rate"],
        }

    def not_in_all_config(self, config):
        return not_in_all_config(config, self.who, max_steps=True)

    def card_section(self, card, there, local):
        ckpt = card["reference"]["checkpoint"]
        data_path = card["reference"]["all_config"]["dataset"]["data_path"]
        return [
            f"EqR ({card['reference']['repository']}, commit {card['reference']['commit']}) reads `{ckpt}` (its "
            "`save_checkpoint`'s format: the state dict under `model`, `model.inner.*`; the EMA's under `ema`; its "
            "`PretrainConfig` under `config`, with `load_strict: true`, and in `all_config.yaml` above `checkpoints/` "
            "as its runs keep it). Its `evaluate.py` loads it strictly and evaluates the EMA weights. From a "
            "checkout of EqR, on a CUDA machine with its requirements"
            + ("" if local else " (after copying this directory there)") + ":",
            "",
            "```",
            f"cd EqR && python evaluate.py checkpoint={there}/{ckpt} dataset_data_path={data_path}",
            "```",
            "",
            f"(`scripts/eval.sh {there}/{ckpt} halt_max_steps=64 different_init=128 convergence_top_k=1` for its "
            "depth x breadth evaluation.) EqR draws its initial states and noise from torch's generator, this "
            "project from a counter hash of (seed, step, row): the same distributions, other samples, so single "
            "examples may come out otherwise there; the weights are the same.",
            "",
            f"To train or fine-tune from it there: `python pretrain.py --config-path {there} --config-name "
            f"all_config load_checkpoint={there}/{ckpt} load_weights_only=true`, or with the same settings as "
            "overrides of EqR's own config:",
        ]


URM_EVALUATION_FIELDS = ("loops", "num_heads", "num_layers", "pos_encodings", "puzzle_emb_ndim", "hidden_size",
                         "expansion", "H_cycles", "L_cycles")
"""The arch fields URM's evaluate_trained_model.py reads from all_config.yaml (by pattern, the
expansion as an integer); it builds the rest of URMConfig at its defaults (URM_DEFAULTS)."""
URM_DEFAULTS = {"forward_dtype": "bfloat16", "rope_theta": 10000.0, "rms_norm_eps": 1e-5}


class URMTarget(Successor):
    name, who, arch = "urm", "URM", "urm"
    repository = "https://github.com/UbiquantAI/URM"
    commit = "41de2c38d3dda7bb3a5c13b61a590125e5df1bd9"

    def refusals(self, config, step, full_steps):
        return super().refusals(config, step, full_steps) + puzzle_table_refusals(config, "URM's")

    def checkpoint_name(self, step):
        return f"step_{step}.pt"

    def checkpoint(self, weights, config, step):
        """save_train_state's dict; its model's dtypes: the ConvSwiGLU's conv in bfloat16 (URM casts
        it at construction; ours trains it in float32, rounded here), init_hidden in forward_dtype."""
        theirs = reference_state_dict(weights, config)
        return {"step": step, "model_state_dict": {k: v.to(torch.bfloat16) if ".mlp.dwconv." in k else v
                                                   for k, v in theirs.items()}}

    def all_config(self, config):
        """URM's PretrainConfig (its pretrain.py; config/arch/urm.yaml's arch fields), the arch
        first and the flat fields from beta1 on (evaluate_trained_model.py yaml-loads the text from
        the first line `beta1:`)."""
        training, optim = training_fields(config), config.optim
        return {
            "arch": reference_arch(config),
            **{k: training[k] for k in ("beta1", "beta2")},
            "data_path": reference_data_path(config.data.path),
            "evaluators": arc_evaluators(config),
            **{k: training[k] for k in ("global_batch_size", "epochs", "lr", "lr_min_ratio", "lr_warmup_steps",
                                        "weight_decay")},
            "target_q_update_every": 4,
            **{k: training[k] for k in ("puzzle_emb_lr", "puzzle_emb_weight_decay")},
            "grad_accum_steps": 1,
            "project_name": None, "run_name": None, "checkpoint_path": None, "load_checkpoint": None,
            "load_strict": True, "load_optimizer_state": True,
            "seed": training["seed"],
            "checkpoint_every_eval": False,
            "eval_interval": eval_interval(config) or optim.epochs,  # its launch divides epochs by it
            "eval_save_outputs": [],
            "loop_deltas": [],
            "ema": training["ema"],
            "ema_rate": training["ema_rate"],
            "use_muon": optim.optimizer == "muon",
        }

    def not_in_all_config(self, config):
        out = not_in_all_config(config, self.who, optimizers=("adam_atan2", "muon"))
        if config.model.halt_exploration_prob != 0.1:
            out.append(f"model.halt_exploration_prob={config.model.halt_exploration_prob} (URM: a constant 0.1 "
                       "in its code)")
        return out

    def caveats(self, config):
        model = config.model
        out = [f"{name}={getattr(model, name)!r}" for name, value in URM_DEFAULTS.items()
               if getattr(model, name) != value]
        if model.expansion != int(model.expansion):
            out.append(f"expansion={model.expansion} (it reads {int(model.expansion)})")
        return [f"evaluate_trained_model.py builds {', '.join(out)} otherwise: it reads only "
                f"{', '.join(URM_EVALUATION_FIELDS)} of all_config.yaml's arch and builds the rest at URMConfig's "
                f"defaults ({', '.join(f'{k} {v}' for k, v in URM_DEFAULTS.items())}); evaluate this model with "
                "its pretrain.py (load_checkpoint reads all_config.yaml whole)"] if out else []

    def card_section(self, card, there, local):
        reference = card["reference"]
        ckpt = reference["checkpoint"]
        lines = [
            f"URM ({reference['repository']}, commit {reference['commit']}) reads `{ckpt}` (its "
            "`save_train_state`'s format: `model_state_dict`, `_orig_mod.model.inner.*`, the convs in bfloat16 as "
            "its model holds them) and `all_config.yaml` beside it (its `PretrainConfig`); its "
            "`evaluate_trained_model.py` loads it strictly. From a checkout of URM, on a CUDA machine with its "
            "requirements" + ("" if local else " (after copying this directory there)") + ":",
            "",
            "```",
            f"cd URM && python evaluate_trained_model.py --checkpoint-path {there}/{ckpt} "
            f"--data-path {reference['all_config']['data_path']} --output-dir {there}/eval_results",
            "```",
            "",
        ]
        lines += [f"Note: {c}." for c in reference.get("caveats", [])]
        return lines + ([""] if reference.get("caveats") else []) + [
            f"To train or fine-tune from it there: `python pretrain.py --config-path {there} --config-name "
            f"all_config load_checkpoint={there}/{ckpt}`, or with the same settings as overrides of URM's own "
            "config:",
        ]


TARGETS: dict[str, Target] = {"reference": Target(), "eqr": EqRTarget(), "urm": URMTarget()}
"""Every export format but ours (one model.safetensors), by its --format name."""
