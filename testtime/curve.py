"""What a run's test-time evaluations found, read back from {RUN}/test-time/*/metrics.json
(commands/eval_command.py writes them): the table `train.py eval` prints, the plot of exact accuracy
against test-time compute (K x D ACT steps per puzzle) for best-Q, mode@K and pass@K, and the
study report's columns. The curve is always rebuilt from the settings' own metrics by whoever reads
it: no shared file holds it (two evaluations of one run's settings at once would race on one).
"""
from __future__ import annotations

import json

from rundir import storage
from testtime import settings as testtime_settings

METRICS = "metrics.json"
"""A setting's metrics, written last: its presence means the setting is done."""
CURVE_PLOT = "trajectories.png"
"""The plot `train.py eval` draws into the last setting directory it evaluated."""


def read_metrics(setting_dir: str) -> dict | None:
    """A setting directory's metrics.json, or None when the setting is not done."""
    url = storage.join_url(setting_dir, METRICS)
    return json.loads(storage.read_bytes(url)) if storage.exists(url) else None


def settings_by_name(run_dir: str) -> dict[str, dict]:
    """{setting directory name: its metrics} of every done setting of {run_dir}/test-time/ (those
    of a study's grid and any evaluated by hand), in name order."""
    root = storage.join_url(run_dir, testtime_settings.DIR)
    fs, path = storage.filesystem(root)
    try:
        fs.invalidate_cache(path)
        found = sorted(fs.glob(f"{path.rstrip('/')}/*/{METRICS}"))
    except FileNotFoundError:
        return {}
    names = [f.rstrip("/").split("/")[-2] for f in found]
    rows = {name: read_metrics(storage.join_url(root, name)) for name in names}
    return {name: row for name, row in rows.items() if row}


def saved_settings(run_dir: str) -> list[dict]:
    """The metrics of every done setting of {run_dir}/test-time/, by (noise, latent, D, K)."""
    return sorted(settings_by_name(run_dir).values(),
                  key=lambda r: (r["noise"], r.get("noise_latent", "z_L"), r["act_steps"], r["trajectories"]))


def curve_table(rows: list[dict]) -> str:
    """The settings' rows as the lines `train.py eval` prints."""
    lines = ["    K    D  noise  latent  best-Q  mode@K  pass@K  token acc  wall s/puzzle  CPU s/puzzle   "
             "(exact accuracy; pass@K: some trajectory solves it, an oracle; times: the batches after the "
             "first, which compiles)"]
    for r in rows:
        lines.append(f"{r['trajectories']:>5} {r['act_steps']:>4}  {r['noise']:>5g}  {r.get('noise_latent', 'z_L'):>6}"
                     f"  {r['exact_accuracy']:>6.4f}  {r['mode_exact_accuracy']:>6.4f}"
                     f"  {r['pass_exact_accuracy']:>6.4f}  {r['accuracy']:>9.4f}"
                     f"  {r['seconds_per_puzzle']:>13.5f}  {r['cpu_seconds_per_puzzle']:>12.5f}")
    return "\n".join(lines)


def write_plot(out_dir: str, rows: list[dict], title: str) -> str:
    """Draw the settings' rows as trajectories.png in out_dir (a setting's directory, where its
    evaluation writes): exact accuracy against K x D ACT steps per puzzle, one line per (noise,
    latent, D) and selection; returns its URL."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_url = storage.join_url(out_dir, CURVE_PLOT)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["noise"] == 0 and r["trajectories"] == 1:  # the evaluation without noise, as a level
            ax.axhline(100 * r["exact_accuracy"], color="gray", linestyle="--", linewidth=1,
                       label=f"K=1 D={r['act_steps']}, no noise")
    lines = sorted({(r["noise"], r.get("noise_latent", "z_L"), r["act_steps"]) for r in rows if r["noise"]})
    for noise, latent, depth in lines:
        line = sorted((r for r in rows if (r["noise"], r.get("noise_latent", "z_L"), r["act_steps"])
                       == (noise, latent, depth)), key=lambda r: r["trajectories"])
        x = [r["trajectories"] * r["act_steps"] for r in line]
        name = f"noise {noise:g} on {latent}, D={depth}"
        drawn = ax.plot(x, [100 * r["exact_accuracy"] for r in line], "o-", label=f"{name}: best-Q")
        color = drawn[0].get_color()
        ax.plot(x, [100 * r["mode_exact_accuracy"] for r in line], "s--", color=color, label=f"{name}: mode@K")
        ax.plot(x, [100 * r["pass_exact_accuracy"] for r in line], ":", color=color, label=f"{name}: pass@K")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("test-time compute: K x D ACT steps per puzzle")
    ax.set_ylabel("exact accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    storage.write_bytes(png_url, buffer.getvalue())
    return png_url


def name_of(row: dict) -> str:
    """The setting name (testtime_settings.setting_name) of a setting's metrics."""
    return testtime_settings.setting_name(row["trajectories"], row["noise"], row["act_steps"],
                                          row.get("noise_latent", "z_L"))
