"""The model card (README.md) of a model directory (reference/model_dir.py): what was trained, on
which dataset, its final metrics, and the commands that evaluate it here and in its arch's own
code (the reference's, EqR's or URM's: the directory's format, whose Target says how). Written
from the directory's config.json and that Target."""
from __future__ import annotations

import json
import os
import shlex

import yaml

METRIC_ORDER = ("exact_accuracy", "accuracy", "q_halt_accuracy", "steps", "lm_loss", "q_halt_loss", "count")


def metrics_table(metrics: dict) -> list[str]:
    names = [k for k in METRIC_ORDER if k in metrics] + sorted(
        k for k, v in metrics.items() if k not in METRIC_ORDER and isinstance(v, (int, float)) and k != "step")
    return ["| metric | value |", "| --- | --- |", *(f"| {k} | {metrics[k]!r} |" for k in names)]


def examples_read(card: dict) -> tuple[str, bool]:
    """(how many test examples the exported step's evaluation read, as the card says it; whether
    that was every one) from config.json's metrics count and the test split's size."""
    found = card.get("evaluated_examples") or {}
    read = found.get("read", (card.get("metrics") or {}).get("count"))
    total = found.get("test_examples")
    if read is None:
        return "(the number of test examples it read was not recorded)", False
    read = int(read)
    if total is None:
        return f"on {read} test examples (the test split's size could not be read: whether that is all of it is " \
            "unknown)", False
    if read >= total:
        return f"on every test example ({read})", True
    return f"on a subset of {read} of the test split's {total} examples (--eval.max-examples)", False


def model_card(card: dict, out: str, goal) -> str:
    """README.md of the model directory `out` described by `card` (its config.json), for the
    codebase `goal` (its model_dir.Target: how its code evaluates the directory)."""
    config, dataset, reference = card["config"], card["dataset"], card["reference"]
    model, arch = config["model"], config["model"]["arch"]
    name = out.rstrip("/").rsplit("/", 1)[-1]
    metrics = card["metrics"]
    local = "://" not in out
    here = os.path.abspath(out) if local else out
    there = here if local else f"/path/to/{name}"  # the reference reads local files: a copy of the directory
    lines = [
        "---",
        f"tags: [tiny-recursive-model, {arch}]",
        "library_name: pytorch",
        "---",
        f"# {name}",
        "",
        f"A Tiny Recursive Model ({arch}, hidden size {model['hidden_size']}, {model['forward_dtype']}): the EMA "
        f"weights of step {card['step']}, from the checkpoint {card['source']}.",
        "",
        "## Dataset",
        "",
        f"Trained on `{dataset['path']}`: {dataset['num_puzzle_identifiers']} puzzle identifiers (the rows of "
        f"the puzzle-embedding table, in the order of the dataset's identifiers.json, fingerprint "
        f"`{dataset['identifiers_fingerprint']}`), sequences of {dataset['seq_len']} tokens of a "
        f"{dataset['vocab_size']}-token vocabulary. Evaluate it only on a dataset with the same identifiers: "
        "both commands below refuse another.",
        "",
        "## Final metrics",
        "",
    ]
    read, whole = examples_read(card)
    if metrics:
        lines += [f"The run's evaluation of step {card['step']} {read}:", "", *metrics_table(metrics)]
    else:
        lines += [f"The run did not evaluate step {card['step']}; the commands below do."]
    lines += [
        "",
        "## Evaluate it here",
        "",
        "```",
        f"python train.py eval --init-from {here} --data.path {dataset['path']}",
        "```",
        "",
        "(`--init-from` takes this directory, local or gs://; it reads every test example, as the run's final "
        "evaluation did" + (".)" if not metrics else ", and gives the metrics above.)" if whole else
                            ": its metrics are the whole test split's, which the metrics above may not be.)"),
        "",
        f"## Evaluate it in {goal.who}'s code",
        "",
        *goal.card_section(card, there, local),
        "",
        "```",
        "python pretrain.py " + " ".join(shlex.quote(o) for o in reference["hydra_overrides"]),
        "```",
        "",
    ]
    if reference["not_in_all_config"]:
        lines += [f"Training settings {goal.who}'s config cannot say (the weights evaluate the same; "
                  "retraining there would differ):", "", *(f"- {s}" for s in reference["not_in_all_config"]), ""]
    lines += [
        "## Training configuration",
        "",
        f"{goal.who[0].upper() + goal.who[1:]}'s (`all_config.yaml`):",
        "",
        "```yaml",
        yaml.safe_dump(reference["all_config"], sort_keys=False).rstrip(),
        "```",
        "",
        "This project's (`config.json`'s `config`):",
        "",
        "```json",
        json.dumps(config, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)
