"""The pictures of a study's report: PNG plots (matplotlib) and the hyperparameters of every run
for TensorBoard's HParams dashboard (the tensorboard package's own hparams summaries).

Plots, one point per configuration (the mean over its finished seeds, with its 95% interval):
held-out exact accuracy against parameters and against training compute (log scales, the Pareto
front marked), against each flag the study varies, and the learning curves (each
configuration's mean exact accuracy over seeds at every evaluation). And where each run ran: a
timeline per host (`write_timeline`, from fleet/goodput.py's StudyTime). And for a study with a
test-time grid, exact accuracy against test-time compute beside training compute
(`write_test_time`).
"""
from __future__ import annotations

import math
import os
import re
import tempfile

from rundir import storage

HPARAMS_FILE = "events.out.tfevents.study-hparams"
"""The event file of a run's hyperparameters in its TensorBoard directory (one name: a report
made again replaces it)."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    return plt


def _title(results, what: str) -> str:
    presets = sorted({r.run.preset for r in results})
    datasets = sorted({os.path.basename(r.data_path.rstrip("/")) for r in results if r.data_path})
    return f"{what}\npreset {', '.join(presets)}; data {', '.join(datasets[:3])}{' ...' if len(datasets) > 3 else ''}"


def _points(configs, x_of):
    """(x, mean, low, high, label, each seed's value) of the configurations with a finished seed and an x."""
    out = []
    for c in configs:
        x = x_of(c)
        if c["mean"] is not None and x is not None:
            out.append((x, 100 * c["mean"], None if c["low"] is None else 100 * c["low"],
                        None if c["high"] is None else 100 * c["high"], c["configuration"],
                        [100 * v for v in c["values"]]))
    return out


def _scatter(plt, points, xlabel: str, title: str, path: str, log_x: bool, pareto: bool) -> str | None:
    if not points:
        return None
    figure, axes = plt.subplots(figsize=(7.5, 5))
    for i, (x, mean, low, high, label, seeds) in enumerate(points):
        error = None if low is None else [[mean - low], [high - mean]]
        axes.errorbar([x], [mean], yerr=error, fmt="o", capsize=4, color="tab:blue",
                      label="mean over seeds, 95% interval" if i == 0 else None)
        axes.plot([x] * len(seeds), seeds, ".", color="grey", alpha=0.6, label="each seed" if i == 0 else None)
        axes.annotate(label, (x, mean), textcoords="offset points", xytext=(5, 4), fontsize=7)
    if pareto:  # no other point has at most this cost and more accuracy
        front = sorted((p for p in points if not any(q[0] <= p[0] and q[1] > p[1] for q in points)),
                       key=lambda p: p[0])
        axes.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:red", label="Pareto front")
    axes.legend(loc="lower right", fontsize=8)
    axes.set_ylim(-2, 102)
    if log_x:
        axes.set_xscale("log")
    axes.set_xlabel(xlabel)
    axes.set_ylabel("held-out exact accuracy (%)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def write_plots(results, configs, varied: list[str], directory: str) -> list[str]:
    """The report's PNG files in `directory`; their paths."""
    plt = _pyplot()
    written = [
        _scatter(plt, _points(configs, lambda c: c["parameters"]), "trainable parameters (log scale)",
                 _title(results, "Held-out exact accuracy vs model size"),
                 os.path.join(directory, "accuracy_vs_parameters.png"), True, True),
        _scatter(plt, _points(configs, lambda c: c["train_flops"]), "training compute, FLOPs (log scale)",
                 _title(results, "Held-out exact accuracy vs training compute"),
                 os.path.join(directory, "accuracy_vs_compute.png"), True, True),
    ]
    for name in varied:
        numeric = all(_number(c["varied"].get(name)) is not None for c in configs)
        values = sorted({repr(c["varied"].get(name)) for c in configs})
        x_of = (lambda c, n=name: c["varied"].get(n)) if numeric else \
            (lambda c, n=name, v=values: v.index(repr(c["varied"].get(n))))
        path = os.path.join(directory, f"accuracy_vs_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.png")
        written.append(_scatter(plt, _points(configs, x_of), f"--{name.replace('_', '-')}"
                                + ("" if numeric else f" ({', '.join(values)})"),
                                _title(results, f"Held-out exact accuracy vs {name}"), path,
                                numeric and _log_spread([c["varied"].get(name) for c in configs]), False))
    written.append(_curves(plt, results, configs, os.path.join(directory, "learning_curves.png")))
    return [p for p in written if p]


def _log_spread(values) -> bool:
    positive = [v for v in values if isinstance(v, (int, float)) and v > 0]
    return len(positive) == len(values) and max(positive) / min(positive) >= 20


def _curves(plt, results, configs, path: str) -> str | None:
    figure, axes = plt.subplots(figsize=(7.5, 5))
    drawn = 0
    for c in configs:
        by_step = {}
        for r in c["results"]:
            for step, accuracy in r.curve:
                by_step.setdefault(step, []).append(accuracy)
        if not by_step:
            continue
        steps = sorted(by_step)
        axes.plot(steps, [100 * sum(by_step[s]) / len(by_step[s]) for s in steps], marker="o", markersize=3,
                  label=f"{c['configuration']} ({len(c['results'])} seeds)")
        drawn += 1
    if not drawn:
        plt.close(figure)
        return None
    axes.set_xlabel("training step")
    axes.set_ylabel("held-out exact accuracy (%), mean over seeds")
    axes.set_title(_title(results, "Learning curves"), fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_hparams(out: str, results, varied: list[str]) -> int:
    """Each run's hyperparameters (the flags the study varies, preset, configuration, seed) and
    final metrics into its TensorBoard directory, and the experiment's list of them at the study's
    root, as TensorBoard's HParams dashboard reads them; the number of runs written."""
    from tensorboard.plugins.hparams import summary_v2 as hp
    from torch.utils.tensorboard import SummaryWriter

    def value(v):
        return v if isinstance(v, (bool, int, float, str)) else str(v)

    hparam_names = [*varied, "preset", "configuration", "run.seed"]
    metrics = [("study/final_exact_accuracy", "final exact accuracy"),
               ("study/best_exact_accuracy", "best exact accuracy"),
               ("study/token_accuracy", "token accuracy"), ("study/mean_act_steps", "mean ACT steps")]
    written = 0
    with tempfile.TemporaryDirectory(prefix="trm-hparams-") as local:
        for r in results:
            if r.final is None and r.best is None:
                continue  # nothing measured yet
            run_dir = os.path.join(local, r.run.name)
            with SummaryWriter(run_dir) as writer:
                hparams = {**{k: value(r.varied.get(k)) for k in varied}, "preset": r.run.preset,
                           "configuration": r.run.configuration, "run.seed": _seed(r.run)}
                writer.file_writer.add_summary(hp.hparams_pb(hparams, trial_id=r.run.name))
                step = r.steps_done
                for tag, number in (("study/final_exact_accuracy", r.final and r.final.get("exact_accuracy")),
                                    ("study/best_exact_accuracy", r.best and r.best[0]),
                                    ("study/token_accuracy", r.final and r.final.get("accuracy")),
                                    ("study/mean_act_steps", r.final and r.final.get("steps"))):
                    if isinstance(number, (int, float)) and not math.isnan(number):
                        writer.add_scalar(tag, number, step)
            _upload_events(run_dir, storage.join_url(out, r.run.name, "tb"))
            written += 1
        root = os.path.join(local, "_experiment")
        with SummaryWriter(root) as writer:
            writer.file_writer.add_summary(hp.hparams_config_pb(
                [hp.HParam(name) for name in hparam_names], [hp.Metric(tag, display_name=d) for tag, d in metrics]))
        _upload_events(root, out)
    return written


def _seed(run) -> int:
    flags = list(run.flags)
    return int(flags[flags.index("--run.seed") + 1]) if "--run.seed" in flags else 0


def _upload_events(local_dir: str, url: str) -> None:
    """The one event file of `local_dir`, as HPARAMS_FILE under `url` (replacing an older one)."""
    [name] = [n for n in os.listdir(local_dir) if "tfevents" in n]
    with open(os.path.join(local_dir, name), "rb") as f:
        storage.write_bytes(storage.join_url(url, HPARAMS_FILE), f.read())


def write_timeline(study, path: str) -> tuple[str, dict]:
    """A timeline per host (goodput.StudyTime): each launch of a run a bar (its name in it), a launch
    that ended without finishing marked x, a relaunch marked >, idle time grey, time down waiting
    for a relaunch hatched red, launch.sh --retry's preemptions and relaunches as vertical lines.
    Returns (path, what it drew: the hosts in order and each bar, span and mark)."""
    plt = _pyplot()
    hosts = sorted(study.hosts, key=str)
    labels = [str(h) if h not in (None, "all") else "the study's host" for h in hosts]
    unit, per = ("hours", 3600) if study.end - study.start >= 7200 else ("minutes", 60)
    hours = lambda t: (t - study.start) / per  # noqa: E731
    drawn = {"hosts": labels, "bars": [], "idle": [], "down": [], "ended": [], "relaunched": []}
    figure, axes = plt.subplots(figsize=(9, 1.2 + 0.6 * len(hosts)))
    colours = plt.get_cmap("tab20")
    order = sorted(study.runs)
    for y, host in enumerate(hosts):
        info = study.hosts[host]
        for kind, colour, hatch in (("idle", "lightgrey", None), ("down", "mistyrose", "//")):
            for start, end in info[f"{kind}_spans"]:
                axes.broken_barh([(hours(start), hours(end) - hours(start))], (y - 0.3, 0.6), facecolors=colour,
                                 edgecolor="tab:red" if hatch else "none", hatch=hatch, linewidth=0)
                drawn[kind].append((labels[y], start, end))
        for bar in info["bars"]:
            x0, x1 = hours(bar["start"]), hours(bar["end"])
            axes.broken_barh([(x0, x1 - x0)], (y - 0.3, 0.6), facecolors=colours(order.index(bar["run"]) % 20),
                             edgecolor="black", linewidth=0.5)
            axes.text((x0 + x1) / 2, y, bar["run"], ha="center", va="center", fontsize=6, clip_on=True)
            drawn["bars"].append((labels[y], bar["run"], bar["start"], bar["end"], bar["ended"]))
            if bar["ended"] not in ("finished", "running"):
                axes.plot([x1], [y + 0.38], "x", color="tab:red", markersize=7)
                drawn["ended"].append((labels[y], bar["run"], bar["end"], bar["ended"]))
            if bar["relaunch"]:
                axes.plot([x0], [y + 0.38], ">", color="tab:green", markersize=6)
                drawn["relaunched"].append((labels[y], bar["run"], bar["start"]))
    for event in study.retry_events:
        if study.start <= event["time"] <= study.end:
            axes.axvline(hours(event["time"]), color="tab:red" if event.get("event") == "preempted" else "tab:green",
                         linestyle="--", linewidth=0.8)
    axes.plot([], [], "x", color="tab:red", label="ended without finishing (killed, SIGTERM, exit 75, failed)")
    axes.plot([], [], ">", color="tab:green", label="relaunched")
    axes.broken_barh([], (0, 0), facecolors="lightgrey", label="idle")
    axes.broken_barh([], (0, 0), facecolors="mistyrose", edgecolor="tab:red", hatch="//", label="down")
    axes.set_yticks(range(len(hosts)), labels)
    axes.set_ylim(-0.6, len(hosts) - 0.4)
    axes.invert_yaxis()
    axes.set_xlabel(f"{unit} since the study's first launch")
    goodput = "" if study.goodput is None else f"; goodput {100 * study.goodput:.1f}%"
    axes.set_title(f"Where each run ran: a bar per launch{goodput}", fontsize=10, pad=22)
    axes.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, frameon=False)
    axes.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path, drawn


def write_test_time(points: list[dict], results, path: str) -> str | None:
    """Exact accuracy against test-time compute (testtime_grid.plot_points): on the left against K x D
    ACT steps per puzzle (log scale), a colour per (configuration, noise, latent), best-Q solid,
    mode@K dashed, pass@K (an oracle) dotted, noise 0 (one trajectory) squares; on the right the
    same best-Q points against the configuration's training compute (FLOPs, log scale), a marker per
    setting, the configuration named, so that the two computes are read side by side."""
    if not points:
        return None
    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    colours = plt.get_cmap("tab10")
    configurations = list(dict.fromkeys(p["configuration"] for p in points))
    settings = list(dict.fromkeys(p["setting"] for p in sorted(points, key=lambda p: (p["compute"], p["setting"]))))
    markers, drawn = "o^vD<>pPX*h", 0
    for i, configuration in enumerate(configurations):
        mine = [p for p in points if p["configuration"] == configuration]
        for j, (noise, latent) in enumerate(dict.fromkeys((p["noise"], p["latent"]) for p in mine)):
            drawn += 1
            series = sorted((p for p in mine if (p["noise"], p["latent"]) == (noise, latent)),
                            key=lambda p: p["compute"])
            xs = [p["compute"] for p in series]
            for rule, style in (("best-Q", "-"), ("mode", "--"), ("pass@K", ":")):
                ys = [100 * p[rule] for p in series if rule in p]
                if len(ys) != len(xs):
                    continue
                label = f"{configuration}, noise {noise:g}" + ("" if latent == "z_L" else f" on {latent}") \
                    if rule == "best-Q" else None
                left.plot(xs, ys, style, marker="s" if noise == 0 else markers[j % len(markers)], markersize=4,
                          color=colours((drawn - 1) % 10), alpha=1.0 if rule == "best-Q" else 0.6, label=label)
        shown = [p for p in mine if p.get("train_flops") and "best-Q" in p]
        for p in shown:
            k = settings.index(p["setting"])
            right.plot([p["train_flops"]], [100 * p["best-Q"]], markers[k % len(markers)], color="tab:blue",
                       label=p["setting"] if i == 0 else None)
        if shown:
            top = max(shown, key=lambda p: p["best-Q"])
            right.annotate(configuration, (top["train_flops"], 100 * top["best-Q"]), textcoords="offset points",
                           xytext=(6, 4), fontsize=7)
    for style, rule in (("k-", "best-Q"), ("k--", "mode@K"), ("k:", "pass@K (oracle)")):
        left.plot([], [], style, label=rule)
    left.set_xscale("log")
    left.set_xlabel("test-time compute: K x D ACT steps per puzzle (log scale)")
    left.set_ylabel("held-out exact accuracy (%), mean over seeds")
    left.set_title(_title(results, "Exact accuracy vs test-time compute"), fontsize=10)
    left.legend(fontsize=7, loc="lower right")
    for handle in (left, right):
        handle.set_ylim(-2, 102)
        handle.grid(True, alpha=0.3)
    if right.lines:
        right.set_xscale("log")
        right.legend(fontsize=7, loc="lower right", title="setting (best-Q)", title_fontsize=7)
    right.set_xlabel("training compute, FLOPs (log scale), each configuration's at its mean")
    right.set_title("The same against the training compute", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
