"""Compare a study's runs: one table (a row per run, a row per configuration over its seeds), plots,
and the hyperparameters of every run for TensorBoard's HParams dashboard.

    python study.py report DIR        # DIR: the study's directory (local or gs://), also while it runs

prints the table and writes DIR/results.md, DIR/results.csv and DIR/plots/*.png; each run's
hyperparameters and final metrics go into its TensorBoard directory (DIR/NAME/tb), so that
`tensorboard --logdir DIR` shows the study's table, parallel coordinates and scatter plots. With
--wandb-project P the table (a W&B Table) and the plots (images) also go to that W&B project, as
a run in the study's group (wandb_mirror.attach_study_report; a failure exits 1 after the files).

Intervals: a run's held-out exact accuracy with the Wilson 95% interval of a proportion over its
test examples (`wilson`); a configuration's mean over seeds with the Student t 95% interval
(`seed_interval`); one seed gives no interval. Runs not started, still training, stopped or
failed are shown as such, never dropped.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field

from fleet import goodput, testtime_grid
from fleet.plan import StudyRun, declared_papers
from fleet.runner import read_status
from rundir import storage
from rundir.contract import FINAL
from testtime import curve
from training.config import flat_config

Z95 = 1.959963984540054
"""The normal quantile of a two-sided 95% interval."""
T95 = [12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252,
       2.306004135, 2.262157163, 2.228138852, 2.200985160, 2.178812830, 2.160368656, 2.144786688,
       2.131449546, 2.119905299, 2.109815578, 2.100922040, 2.093024054, 2.085963447, 2.079613845,
       2.073873068, 2.068657610, 2.063898562, 2.059538553, 2.055529439, 2.051830516, 2.048407142,
       2.045229642, 2.042272456]
"""Student t quantiles t(0.975, df) for df = 1..30 (beyond: the normal's, corrected by 1/df)."""
METRICS = ("exact_accuracy", "accuracy", "steps")
TABLE1 = ("effective_depth", "forward_passes")
"""The columns the TRM paper's Table 1 reads beside the accuracy (model_flops.recursion_counts):
effective depth per supervision step, T(n + 1)·n_layers (block applications of one ACT step), and
forward passes of the recursion per example and training step (NFP: 2 where the Q-continue target
takes a second pass)."""


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion p observed over n examples."""
    if n <= 0:
        return math.nan, math.nan
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return center - half, center + half


def t95(df: int) -> float:
    return T95[df - 1] if df <= len(T95) else Z95 * (1 + (Z95 * Z95 + 1) / (4 * df))


def seed_interval(values: list[float]) -> tuple[float, float | None, float | None]:
    """(mean, low, high) of the 95% interval of the mean over seeds; no interval for one seed."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t95(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass
class RunResult:
    """What the report says of one run."""

    run: StudyRun
    status: str
    varied: dict = field(default_factory=dict)
    parameters: int | None = None
    steps_done: int = 0
    steps_total: int | None = None
    train_flops: float | None = None
    effective_depth: int | None = None  # block applications per ACT step (the TRM paper's Table 1 "Depth")
    forward_passes: int | None = None  # forward passes per example per training step (Table 1's "NFP")
    device_hours: float | None = None
    final: dict | None = None  # the final evaluation's metrics
    best: tuple[float, int, int] | None = None  # (exact accuracy, examples, step)
    steps_to_95: int | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, exact accuracy) of each evaluation
    seconds: float | None = None
    last_line: str = ""
    data_path: str = ""
    host: int | None = None  # the study host it ran on (None: the study ran without --host)
    ckpt_every: int | None = None
    scaling: dict = field(default_factory=dict)  # {test-time setting: its metrics}: curve.settings_by_name


def _read_json(url: str):
    return json.loads(storage.read_bytes(url)) if storage.exists(url) else None


def _records(run_dir: str) -> list[dict]:
    fs, path = storage.filesystem(storage.join_url(run_dir, "metrics"))
    try:
        parts = sorted(fs.glob(path + "/part-*.jsonl"))
    except FileNotFoundError:
        return []
    return [json.loads(line) for part in parts for line in fs.cat(part).decode().splitlines() if line.strip()]


def parameter_count(model_config) -> int:
    """Trainable parameters (the puzzle-embedding table, a SignSGD buffer, is not one), counted on
    the meta device: nothing is allocated."""
    import torch

    from model import TRM

    with torch.device("meta"):
        return sum(p.numel() for p in TRM(model_config).parameters())


def trained_flops(config, metadata, steps: int) -> float | None:
    """Model FLOPs of a run's first `steps` training steps over the global batch, each at the
    cycles it recursed with (a recursion curriculum's stages: run_costs.train_stages, placed in
    steps by the train split's `metadata`); None for a curriculum whose dataset cannot be read
    (its stages cannot be placed)."""
    from tpu_costs.run_costs import train_flops_of, train_stages

    if not config.optim.curriculum_epochs:
        return float(train_flops_of(config, [((config.model.H_cycles, config.model.L_cycles), steps)]))
    if metadata is None or isinstance(metadata, Exception):
        return None
    return float(train_flops_of(config, train_stages(config, metadata, steps)))


def collect(out: str) -> list[RunResult]:
    """Every run of the study directory `out` (DIR/study/runs.json), with what it has done so far."""
    from training.config import config_from_dict, with_new_fields
    from training.model_flops import recursion_counts
    from training.schedule import run_schedule

    listing = _read_json(storage.join_url(out, "study", "runs.json"))
    if listing is None:
        raise SystemExit(f"error: {out} is not a study directory (no study/runs.json): give the --out of "
                         "`study.py run` or gs://BUCKET/studies/NAME")
    runs = [StudyRun(r["name"], r["preset"], tuple(r["flags"]), r["line"]) for r in listing["runs"]]
    configs = {r.name: flat_config(r.config()) for r in runs}
    varied = sorted(k for k in set().union(*configs.values()) if k not in ("run.seed", "run.dir")
                    and len({repr(c.get(k)) for c in configs.values()}) > 1)
    results, sizes = [], {}
    for run in runs:
        run_dir = storage.join_url(out, run.name)
        status = read_status(out, run.name) or {}
        final = _read_json(storage.join_url(run_dir, FINAL))
        state = "done" if final else status.get("state", "not started")
        result = RunResult(run, state, {k: configs[run.name].get(k) for k in varied},
                           last_line=status.get("last_line", ""), seconds=status.get("seconds_total"))
        saved = _read_json(storage.join_url(run_dir, "config.json"))
        config = config_from_dict(with_new_fields(saved)) if saved else run.config()
        result.data_path, result.host, result.ckpt_every = config.data.path, status.get("host"), config.run.ckpt_every
        result.parameters = parameter_count(config.model)
        result.effective_depth, _, result.forward_passes = recursion_counts(config.model)
        result.scaling = curve.settings_by_name(run_dir)
        records = _records(run_dir)
        trained = [r["step"] for r in records if r.get("kind") == "train"]
        result.steps_done = final["step"] if final else max(trained, default=0)
        try:
            if config.data.path not in sizes:
                import data
                sizes[config.data.path] = data.read_metadata(config.data.path, "train")
            result.steps_total = run_schedule(sizes[config.data.path], config.optim, config.eval.every_epochs)[0]
        except Exception:  # noqa: BLE001 - the table says "?" for a dataset it cannot read
            result.steps_total = final["step"] if final else None
        result.train_flops = trained_flops(config, sizes.get(config.data.path), result.steps_done)
        if final and result.seconds is not None:
            result.device_hours = result.seconds * final.get("devices", 0) / 3600
        evals = [r for r in records if r.get("kind") == "eval" and r.get("exact_accuracy") is not None]
        result.curve = [(r["step"], r["exact_accuracy"]) for r in evals]
        if evals:
            top = max(evals, key=lambda r: (r["exact_accuracy"], -r["step"]))
            result.best = (top["exact_accuracy"], int(top.get("num_examples", 0)), top["step"])
        if final:
            result.final = final["metrics"]
            target = 0.95 * result.final.get("exact_accuracy", 0.0)
            result.steps_to_95 = next((s for s, acc in result.curve if acc >= target), final["step"])
        results.append(result)
    return results


def study_papers(out: str) -> dict[str, float]:
    """The published accuracies (plan.declared_papers) of the study file as run (OUT/study.txt)."""
    url = storage.join_url(out, "study.txt")
    return declared_papers(storage.read_bytes(url).decode()) if storage.exists(url) else {}


def configurations(results: list[RunResult]) -> list[dict]:
    """One row per configuration (runs that differ only by seed): seeds, and over the finished
    ones the mean final exact accuracy with its 95% interval over seeds, min and max."""
    rows = {}
    for r in results:
        row = rows.setdefault(r.run.configuration, {"configuration": r.run.configuration, "preset": r.run.preset,
                                                     "varied": r.varied, "runs": 0, "values": [], "results": []})
        row["runs"] += 1
        row["results"].append(r)
        if r.final is not None:
            row["values"].append(r.final["exact_accuracy"])
    for row in rows.values():
        values = row["values"]
        row["seeds"] = len(values)
        row["mean"], row["low"], row["high"] = seed_interval(values) if values else (None, None, None)
        if row["low"] is not None:  # an accuracy: the interval clipped to [0, 1]
            row["low"], row["high"] = max(0.0, row["low"]), min(1.0, row["high"])
        row["min"], row["max"] = (min(values), max(values)) if values else (None, None)
        done = [r for r in row["results"] if r.final is not None]
        row["parameters"] = row["results"][0].parameters
        row["effective_depth"] = row["results"][0].effective_depth
        row["forward_passes"] = row["results"][0].forward_passes
        counted = [r.train_flops for r in done if r.train_flops is not None]
        row["train_flops"] = sum(counted) / len(counted) if counted else None
    return list(rows.values())


def _pct(value, digits: int = 2) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.{digits}f}"


def run_rows(results: list[RunResult], study: goodput.StudyTime) -> list[dict]:
    """The run rows of the table, as printed and written (strings and numbers); the device-hours
    and where the time went from the runs' launch records (fleet/goodput.py) where they kept them."""
    rows = []
    for r in results:
        spent = study.runs.get(r.run.name)
        device_hours = spent.wall * spent.devices / 3600 if spent is not None else r.device_hours
        final_exact = r.final.get("exact_accuracy") if r.final else None
        n = int(r.final.get("num_examples", 0)) if r.final else 0
        low, high = wilson(final_exact, n) if final_exact is not None else (None, None)
        best_low, best_high = wilson(r.best[0], r.best[1]) if r.best else (None, None)
        status = r.status if r.status != "failed" else f"failed: {r.last_line[:80]}"
        rows.append({
            "kind": "run", "name": r.run.name, "configuration": r.run.configuration, "status": status,
            "preset": r.run.preset, **{k: v for k, v in r.varied.items()}, "parameters": r.parameters,
            "effective_depth": r.effective_depth, "forward_passes": r.forward_passes,
            "steps": f"{r.steps_done}/{r.steps_total if r.steps_total is not None else '?'}",
            "train_flops": None if r.train_flops is None else f"{r.train_flops:.3g}",
            "device_hours": None if device_hours is None else round(device_hours, 4),
            "final_exact_%": _pct(final_exact),
            "final_exact_95%": f"{_pct(low)}-{_pct(high)}" if low is not None else "",
            "best_exact_%": _pct(r.best[0]) if r.best else "",
            "best_exact_95%": f"{_pct(best_low)}-{_pct(best_high)}" if r.best else "",
            "token_accuracy_%": _pct(r.final.get("accuracy")) if r.final else "",
            "arc_aggregated_pass@2_%": _pct(r.final.get("aggregated_pass@2")) if r.final else "",
            "steps_to_95%_of_final": r.steps_to_95 if r.steps_to_95 is not None else "",
            "mean_act_steps": round(r.final["steps"], 2) if r.final and "steps" in r.final else "",
            "mean_halt_step": round(r.final["mean_halt_step"], 2) if r.final and "mean_halt_step" in r.final else "",
            "wall_time_s": "" if r.seconds is None else round(r.seconds),
            **goodput.run_columns(spent),
        })
    return rows


def configuration_rows(configs: list[dict], papers: dict[str, float] | None = None) -> list[dict]:
    """One row per configuration; paper_%: its published accuracy (the study file's @paper lines);
    mean_halt_step: the mean over its finished runs of their final evaluation's (modeling/schemes.py)."""
    papers = papers or {}
    rows = []
    for c in configs:
        halts = [r.final["mean_halt_step"] for r in c["results"] if r.final and "mean_halt_step" in r.final]
        rows.append({"kind": "configuration", "name": c["configuration"], "configuration": c["configuration"],
                     "status": f"{c['seeds']} of {c['runs']} seeds done", "preset": c["preset"], **c["varied"],
                     "parameters": c["parameters"], "effective_depth": c.get("effective_depth"),
                     "forward_passes": c.get("forward_passes"), "seeds": c["seeds"], "mean_exact_%": _pct(c["mean"]),
                     "mean_exact_95%": f"{_pct(c['low'])}-{_pct(c['high'])}" if c["low"] is not None else "",
                     "paper_%": papers.get(c["configuration"], ""), "min_exact_%": _pct(c["min"]),
                     "max_exact_%": _pct(c["max"]),
                     "mean_halt_step": round(sum(halts) / len(halts), 2) if halts else ""})
    return rows


def table_text(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "") if r.get(c) is not None else "").ljust(widths[c]) for c in columns)
              for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict], columns: list[str]) -> str:
    cell = lambda v: "" if v is None else str(v).replace("|", "\\|")
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                     + ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows])


def write_outputs(out: str, runs: list[dict], configs: list[dict], varied: list[str], spent: str,
                  test_time: list[str] = ()) -> str:
    """results.csv, results.md; returns the text printed to the terminal. `test_time`: the columns
    of the test-time settings (testtime_grid.add_columns): in the CSV, and a table of their own."""
    run_columns = ["name", "status", "preset", *varied, "parameters", *TABLE1, "steps", "train_flops", "device_hours",
                   "final_exact_%", "final_exact_95%", "best_exact_%", "best_exact_95%", "token_accuracy_%",
                   "arc_aggregated_pass@2_%", "steps_to_95%_of_final", "mean_act_steps", "mean_halt_step",
                   "wall_time_s", *goodput.COLUMNS]
    config_columns = ["name", "status", "preset", *varied, "parameters", *TABLE1, "seeds", "mean_exact_%",
                      "mean_exact_95%",
                      "paper_%", "min_exact_%", "max_exact_%", "mean_halt_step"]
    buffer = io.StringIO()
    all_columns = ["kind", "configuration"] + list(dict.fromkeys(run_columns + config_columns + list(test_time)))
    writer = csv.DictWriter(buffer, fieldnames=all_columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(runs + configs)
    storage.write_bytes(storage.join_url(out, "results.csv"), buffer.getvalue().encode())
    md = (f"# Study {out}\n\nEach run: held-out exact accuracy in %, with the Wilson 95% interval over its test "
          "examples.\n\n" + markdown(runs, run_columns) + "\n\nEach configuration (its runs differ only by seed): "
          "mean final exact accuracy in %, with the Student t 95% interval over seeds (none for one seed; clipped to "
          "0-100%).\n\n"
          + markdown(configs, config_columns) + "\n\nWhere the time went (each run's seconds per cause in the "
          "columns after wall_time_s; docs/goodput.md says what each counts):\n\n```\n" + spent + "\n```\n")
    if test_time:  # a table of its own: a column per setting and selection is wide
        md += ("\nTest-time compute: each setting (K trajectories per puzzle, noise, D ACT steps) with its exact "
               "accuracy in % by best Q, by the most frequent answer (mode@K) and by any trajectory (pass@K, an "
               "oracle); a configuration's: the mean over its runs evaluated there.\n\n"
               + markdown(runs + configs, ["name", *test_time]) + "\n")
    storage.write_bytes(storage.join_url(out, "results.md"), md.encode())
    short = ["name", "status", *varied, "parameters", "steps", "final_exact_%", "final_exact_95%", "best_exact_%",
             "steps_to_95%_of_final", "mean_halt_step", "device_hours", "goodput_%"]
    text = (table_text(runs, short) + "\n\n"
            + table_text(configs, ["name", "status", *varied, *TABLE1, "seeds", "mean_exact_%", "mean_exact_95%",
                                   "paper_%", "min_exact_%", "max_exact_%", "mean_halt_step"]) + "\n\n" + spent)
    if test_time:
        text += "\n\ntest-time settings, exact accuracy in %:\n" + table_text(runs + configs, ["name", *test_time])
    return text


def main(args) -> int:
    from fleet.plots import write_hparams, write_plots, write_test_time, write_timeline

    status, started = 0, time.time()
    mirror = getattr(args, "wandb_project", None)
    if mirror:  # before any work: a missing package says how to install it
        from training import wandb_mirror

        wandb_mirror.import_wandb()
    results = collect(args.out)
    configs = configurations(results)
    varied = list(results[0].varied) if results else []
    study = goodput.study_time(args.out, {r.run.name: {"host": r.host, "state": r.status} for r in results},
                               {r.run.name: r.ckpt_every for r in results})
    rows = run_rows(results, study) + configuration_rows(configs, study_papers(args.out))
    test_time = testtime_grid.add_columns(args.out, results, rows[:len(results)], rows[len(results):], configs)
    text = write_outputs(args.out, rows[:len(results)], rows[len(results):], varied, goodput.summary(study),
                         test_time)
    print(text)
    with tempfile.TemporaryDirectory(prefix="trm-report-") as local:
        plots = write_plots(results, configs, varied, local)
        if study.runs:
            plots.append(write_timeline(study, os.path.join(local, "timeline.png"))[0])
        scaling = write_test_time(testtime_grid.plot_points(configs, {r.run.name: r.scaling for r in results}),
                                  results, os.path.join(local, "accuracy_vs_test_time_compute.png"))
        plots += [scaling] if scaling else []
        storage.upload_dir(local, storage.join_url(args.out, "plots"))
        if mirror:
            try:
                where = wandb_mirror.attach_study_report(args.out, mirror, args.wandb_entity, rows,
                                                         list(dict.fromkeys(k for row in rows for k in row)), plots)
            except Exception as e:  # noqa: BLE001 - the report's files are written either way
                print(f"error: attaching the report to W&B project {mirror} failed ({type(e).__name__}: {e}); "
                      f"its files are in {args.out}", flush=True)
                status = 1
            else:
                print(f"W&B: the table and {len(plots)} plots attached to project {mirror} ({where})", flush=True)
    hparams = write_hparams(args.out, results, varied)
    states = {}
    for r in results:
        states[r.status.split(":")[0]] = states.get(r.status.split(":")[0], 0) + 1
    print(f"\n{len(results)} runs ({', '.join(f'{v} {k}' for k, v in sorted(states.items()))}), "
          f"{len(configs)} configurations; wrote {args.out}/results.md, results.csv, "
          f"{len(plots)} plots in plots/ ({', '.join(os.path.basename(p) for p in plots)}), and the hparams of "
          f"{hparams} runs for TensorBoard (tensorboard --logdir {args.out}) in {time.time() - started:.0f}s")
    return status
