"""Test-time compute as a study axis: a study file's `@test-time` lines (plan.ScalingGrid)
name settings (K trajectories per puzzle, noise sigma, D ACT steps, the latent the noise enters)
at which `study.py run` evaluates every finished run, claimed under the same leases as training;
the report's columns and plot of each setting; and the grid's price for `study.py plan`.

    @test-time K=1,16,100 noise=0,0.3 D=16,64     # every run: 2 + 6 settings (noise 0 at K=1 only)
    @test-time trm,hrm-* K=100 noise=0.3 D=64     # the runs of these configurations (fnmatch patterns)

Each (run, setting) is one `Evaluation`, claimed as RUN+SETTING (fleet/claims.py: OUT/study/claims/
RUN+K16-noise0.3-D64/, status in OUT/study/status/RUN+K16-noise0.3-D64.json) by any study process,
after every training run of the study is claimed (most ACT steps per puzzle first), and only once
its run has trained to its end (OUT/RUN/final.json). It runs

    python train.py eval PRESET --init-from OUT/RUN --run.dir OUT/RUN --data.path DATA \\
        --eval.trajectories K --eval.noise S --eval.act-steps D [--eval.noise-latent L] [flags after --]

which writes OUT/RUN/test-time/SETTING/ (testtime/settings.py), metrics.json last: a setting whose
metrics.json exists is done and skipped; a holder killed during one loses its lease and another
holder evaluates the setting again; a failed one is tried again by a later study process, as a
failed run is.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

from fleet.plan import StudyRun, eval_config, scaling_settings
from rundir import storage
from testtime import curve
from testtime import settings as testtime_settings

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: train.py and the packages
SELECTIONS = (("best_q_exact_accuracy", "best-Q"), ("mode_exact_accuracy", "mode"), ("pass_exact_accuracy", "pass@K"),
              ("conv_exact_accuracy", "conv"))
"""The exact accuracies of a setting's metrics.json the report shows, each by its column's name:
the answer of the trajectory with the best Q (the halting rule's), the most frequent answer
(mode@K), any trajectory right (pass@K, an oracle), and the trajectory whose logits changed least
over the last ACT steps (conv, EqR's convergence residual)."""


@dataclass(frozen=True)
class Evaluation:
    """One test-time setting of one finished run: the study's unit of claim besides a training run."""

    run: StudyRun
    setting: testtime_settings.Setting
    out: str
    """The study's directory."""
    batch: int | None = None
    """The evaluation's global batch (rows); None: the run's (the @test-time line's batch=)."""

    @property
    def name(self) -> str:
        """The claim's and status file's name: RUN+SETTING ('+' is in no run name)."""
        return f"{self.run.name}+{self.setting.name}"

    @property
    def configuration(self) -> str:
        return self.run.configuration

    @property
    def run_dir(self) -> str:
        return storage.join_url(self.out, self.run.name)

    @property
    def directory(self) -> str:
        """Where `train.py eval` writes this setting: OUT/RUN/test-time/SETTING."""
        return storage.join_url(self.run_dir, testtime_settings.DIR, self.setting.name)

    @property
    def preset(self) -> str:  # what fleet/runner.py prints after "train.py": the eval command
        return "eval"

    @property
    def flags(self) -> tuple[str, ...]:
        """`train.py eval`'s arguments (the study's flags after -- go after them)."""
        s = self.setting
        return (self.run.preset, "--init-from", self.run_dir, "--run.dir", self.run_dir,
                "--data.path", self.run.config().data.path, "--eval.trajectories", str(s.k),
                "--eval.noise", f"{s.noise:g}", "--eval.act-steps", str(s.act_steps),
                *(() if s.latent == "z_L" else ("--eval.noise-latent", s.latent)),
                *(() if self.batch is None else ("--optim.global-batch-size", str(self.batch))))

    def command(self, python: str = sys.executable, extra: tuple[str, ...] = ()) -> list[str]:
        return [python, os.path.join(PROJECT_DIR, "train.py"), "eval", *self.flags, *extra]

    def done(self) -> bool:
        """Evaluated: metrics.json, which `train.py eval` writes last, exists."""
        return storage.exists(storage.join_url(self.directory, curve.METRICS))

    def summary(self) -> str:
        """The line the study prints once it is done: each selection's exact accuracy."""
        metrics = curve.read_metrics(self.directory)
        return ", ".join(f"{label} {100 * metrics[key]:.2f}%" for key, label in SELECTIONS if key in metrics) + \
            f" exact over {metrics.get('num_puzzles', '?')} puzzles"


def evaluations(runs: list[StudyRun], text: str, out: str) -> list[Evaluation]:
    """The study's evaluations (its `@test-time` lines over its runs), in the order they are
    claimed: the most ACT steps per puzzle (K x D) first, then the runs' order."""
    settings = scaling_settings(text, runs)
    found = [Evaluation(run, s, out, batch) for run in runs for s, batch in settings.get(run.name, {}).items()]
    position = {run.name: i for i, run in enumerate(runs)}
    return sorted(found, key=lambda e: (-e.setting.k * e.setting.act_steps, position[e.run.name]))


# ----------------------------------------------------------------------------------------------
# The report


def setting_columns(name: str) -> list[str]:
    """The report's columns of one setting: its exact accuracy in % under each selection."""
    return [f"{name}_{label}_%" for _, label in SELECTIONS]


def settings_in_order(out: str, runs: list[StudyRun], scaling: dict[str, dict[str, dict]]) -> list[str]:
    """The setting names the report shows: the study file's grid (OUT/study.txt) over its runs, in
    its order, then any other setting a run was evaluated at, in name order."""
    names: list[str] = []
    text = storage.join_url(out, "study.txt")
    if storage.exists(text):
        for settings in scaling_settings(storage.read_bytes(text).decode(), runs).values():
            names += [s.name for s in settings if s.name not in names]
    return names + sorted({n for found in scaling.values() for n in found} - set(names))


def _pct(value) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"


def run_cells(found: dict[str, dict], names: list[str]) -> dict[str, str]:
    """A run row's cells of each setting (empty: not evaluated yet)."""
    cells = {}
    for name in names:
        metrics = found.get(name, {})
        cells.update({column: _pct(metrics.get(key)) for column, (key, _) in zip(setting_columns(name), SELECTIONS)})
    return cells


def selection_means(rows: list[dict]) -> dict[str, float]:
    """{selection's metric key: its mean over `rows`} (one setting's metrics of a configuration's
    runs evaluated there), for each selection every row has: a mean over some of them would
    be a mean of other runs than the cell says."""
    return {key: sum(r[key] for r in rows) / len(rows) for key, _ in SELECTIONS if rows and all(key in r for r in rows)}


def configuration_cells(members: list[dict[str, dict]], names: list[str]) -> dict[str, str]:
    """A configuration row's cells of each setting: the mean over its runs evaluated there."""
    cells = {}
    for name in names:
        means = selection_means([found[name] for found in members if name in found])
        cells.update({column: _pct(means.get(key)) for column, (key, _) in zip(setting_columns(name), SELECTIONS)})
    return cells


def plot_points(configs: list[dict], scaling: dict[str, dict[str, dict]]) -> list[dict]:
    """One point per (configuration, setting) evaluated: its test-time compute (K x D ACT steps per
    puzzle), its training compute, and each selection's exact accuracy, mean over its runs."""
    points = []
    for c in configs:
        members = [scaling.get(r.run.name, {}) for r in c["results"]]
        for name in sorted({n for found in members for n in found}):
            rows = [found[name] for found in members if name in found]
            first, means = rows[0], selection_means(rows)
            points.append({
                "configuration": c["configuration"], "setting": name, "runs": len(rows),
                "k": first["trajectories"], "noise": first["noise"], "act_steps": first["act_steps"],
                "latent": first.get("noise_latent", "z_L"),
                "compute": first.get("act_steps_per_puzzle", first["trajectories"] * first["act_steps"]),
                "train_flops": c.get("train_flops"),
                **{label: means[key] for key, label in SELECTIONS if key in means}})
    return points


def add_columns(out: str, results: list, runs: list[dict], configs: list[dict], configurations: list[dict]
                ) -> list[str]:
    """The report's test-time columns, added to its run rows (`results`' order) and configuration
    rows (`configurations`' order): each setting's exact % under each selection; the names of
    those columns, in the grid's order."""
    scaling = {r.run.name: r.scaling for r in results}
    names = settings_in_order(out, [r.run for r in results], scaling)
    for result, row in zip(results, runs):
        row.update(run_cells(result.scaling, names))
    for c, row in zip(configurations, configs):
        row.update(configuration_cells([r.scaling for r in c["results"]], names))
    return [column for name in names for column in setting_columns(name)]


# ----------------------------------------------------------------------------------------------
# The price (study.py plan)


def evaluation_batches(setting: testtime_settings.Setting, global_batch: int, puzzles: int, hosts: int = 1) -> int:
    """Evaluation batches of `global_batch` rows that hold every puzzle's K trajectories on a slice
    of `hosts` hosts: each host's global_batch / hosts rows hold (global_batch / hosts) // K whole
    puzzles, the rest padding (K need not divide the batch: testtime/batches.py); ValueError
    for a K above a host's rows."""
    from testtime.batches import batch_puzzles

    return math.ceil(puzzles / batch_puzzles(global_batch, setting.k, hosts))


def evaluation_hours(setting: testtime_settings.Setting, global_batch: int, puzzles: int, ms_per_act_step: float,
                     hosts: int = 1) -> float:
    """Device hours of one evaluation of `puzzles` test puzzles at the setting: batches x D ACT
    steps x the evaluation program's time per ACT step (one batch of global_batch rows)."""
    return evaluation_batches(setting, global_batch, puzzles, hosts) * setting.act_steps * ms_per_act_step / 3.6e6


def compiled_eval_ms(jobs: list[tuple[Evaluation, object]], slices: dict[str, str], processes: int | None = None
                     ) -> dict[str, dict[str, dict]]:
    """{slice key: {evaluation name: device_time_fields of its evaluation program}} for
    (evaluation, the run's resolved config) jobs: each distinct evaluation program (the run's
    model and batch at the setting's K, noise and latent: eval_config) compiled once per slice by
    the TPU compiler (compiled_programs.compile_isolated, cached), its training step not compiled."""
    from tpu_costs import compiled_programs

    configs = {e.name: eval_config(config, e.setting) for e, config in jobs}
    distinct: dict[str, tuple] = {}
    for e, _ in jobs:
        distinct.setdefault(compiled_programs.program_settings(configs[e.name]),
                            (e.run.preset, configs[e.name], f"{e.configuration} at {e.setting.name}"))
    names = list(dict.fromkeys(slices.values()))
    if distinct:
        print(f"compiling {len(distinct)} distinct evaluation program(s) of the test-time grid for "
              f"{' and '.join(names)} with the TPU compiler", flush=True)
    compiled = compiled_programs.compile_isolated([(preset, config, name) for name in names
                                             for preset, config, _ in distinct.values()], programs=("eval_step",),
                                            processes=processes,
                                            labels=[label for _ in names for _, _, label in distinct.values()])
    results = {name: dict(zip(distinct, compiled[i * len(distinct):(i + 1) * len(distinct)]))
               for i, name in enumerate(names)}
    return {key: {e.name: compiled_programs.device_time_fields(results[name][compiled_programs.program_settings(
        configs[e.name])]) for e, _ in jobs} for key, name in slices.items()}


def plan_rows(runs: list[StudyRun], text: str, sizes: dict, specs: dict, mfu: dict, compiled: bool,
              processes: int | None = None) -> list[dict]:
    """One row per evaluation of the study's grid: its batches, ACT steps per puzzle, and device
    hours on each slice of `specs` ({key: SliceSpec}), from each evaluation program's time per ACT
    step compiled for that slice (`compiled`), else the model's evaluation FLOPs at mfu[key] of
    the slice's peak; `sizes`: {dataset path: PaperDataset, or the Exception reading it}. Its whole
    test split each, every K x D ACT steps of it: `evaluation_hours`."""
    from fleet.plan import resolved_config
    from tpu_costs.run_costs import flop_record

    found = evaluations(runs, text, "OUT")
    jobs, rows = [], []
    for e in found:
        size = sizes.get(e.run.config().data.path)
        if size is not None and not isinstance(size, Exception):
            jobs.append((e, eval_config(resolved_config(e.run, size), e.setting, e.batch)))
    device = compiled_eval_ms(jobs, {k: s.name for k, s in specs.items()}, processes) if compiled and jobs else {}
    for e, config in jobs:
        row = {"evaluation": e, "puzzles": sizes[config.data.path].test_examples}
        for key, spec in specs.items():
            fields = device.get(key, {}).get(e.name, {})
            ms = fields.get("compiled_ms_per_eval_step") if compiled else \
                flop_record(e.run.preset, config, spec)["projected_device_ms_per_eval_step"] / mfu[key]
            row[key], row[key + "_why"] = None, fields.get("compiled_source", "")
            try:
                batches = evaluation_batches(e.setting, config.optim.global_batch_size, row["puzzles"], spec.hosts)
            except ValueError as error:  # K above a host's rows of the batch on this slice
                row[key + "_why"] = str(error)
                continue
            if ms is not None:
                row[key] = {"ms_per_act_step": ms, "batches": batches, "hours": evaluation_hours(
                    e.setting, config.optim.global_batch_size, row["puzzles"], ms, spec.hosts)}
        rows.append(row)
    return rows + [{"evaluation": e, "unknown": True} for e in found if e.name not in {j.name for j, _ in jobs}]


def fleet_makespan(training: list[tuple[str, float]], tests: list[tuple[str, str, float]], vms: int) -> float:
    """Hours until the last evaluation ends on `vms` VMs claiming as `study.py run` does: each VM,
    once free, takes the first item in claim order that it may start, the training runs ((name,
    hours), longest first) before the evaluations ((name, its run, hours)), an evaluation only once
    its run has ended (with none ready, the VM waits for the next run's end)."""
    pending = [(name, None, hours) for name, hours in training] + list(tests)
    free, ended = [0.0] * vms, {}
    while pending:
        vm = min(range(vms), key=lambda h: (free[h], h))
        ready = [i for i, (_, run, _) in enumerate(pending) if run is None or ended.get(run, math.inf) <= free[vm]]
        if not ready:
            later = [ended[run] for _, run, _ in pending if ended.get(run, math.inf) < math.inf]
            if not later:  # evaluations of runs not projected: not counted
                break
            free[vm] = min(later)
            continue
        name, run, hours = pending.pop(ready[0])
        free[vm] += hours
        if run is None:
            ended[name] = free[vm]
    return max(free, default=0.0)


def _hours(hours: float) -> str:
    return f"{hours:,.1f}" if hours >= 10 else f"{hours:.2f}" if hours >= 0.1 else f"{hours:.2g}"


def print_plan(runs, text, sizes, host, spec, vms: int, mfu: float, whole_mfu: float, compiled: bool,
               processes: int | None, training: list[tuple[str, float]], whole_training_h: float,
               startup_h: float) -> None:
    """`study.py plan`'s part for the study's `@test-time` grid: each evaluation's batches and
    device-hours on one fleet VM, the total, and the makespans with the evaluations."""
    if not any(line.lstrip().startswith("@test-time") for line in text.splitlines()):
        return
    rows = plan_rows(runs, text, sizes, {"host": host, "whole": spec}, {"host": mfu, "whole": whole_mfu}, compiled,
                     processes)
    how = "each evaluation program compiled for the slice (the TPU compiler's estimate)" if compiled else \
        f"{100 * mfu:g}% MFU"
    print(f"\ntest-time evaluations (@test-time): {len(rows)}, each of its run's whole test split at K trajectories "
          f"per puzzle (a host's rows // K puzzles per host and batch) and D ACT steps per batch, on one {host.name} "
          f"at {how}")
    width = max(len(r["evaluation"].name) for r in rows)
    print(f"{'evaluation'.ljust(width)}  {'K x D':>7}  {'batches':>9}  {'ms/ACT step':>11}  {'VM h':>7}  "
          f"{'device-h':>8}")
    done = []
    for row in rows:
        e = row["evaluation"]
        on_host = None if row.get("unknown") else row["host"]
        if on_host is None:
            reason = "dataset size unknown" if row.get("unknown") else f"not projected: {row['host_why']}"
            print(f"{e.name.ljust(width)}  {e.setting.k * e.setting.act_steps:>7,}  ? ({reason})")
            continue
        done.append(row)
        print(f"{e.name.ljust(width)}  {e.setting.k * e.setting.act_steps:>7,}  {on_host['batches']:>9,}  "
              f"{on_host['ms_per_act_step']:>11.4g}  {_hours(on_host['hours']):>7}  "
              f"{_hours(on_host['hours'] * host.chips):>8}")
    tests = [(r["evaluation"].name, r["evaluation"].run.name, r["host"]["hours"] + startup_h) for r in done]
    whole = sum(r["whole"]["hours"] + startup_h for r in done if r.get("whole"))
    for row in done:
        if row.get("whole") is None:
            print(f"not projected on {spec.name}: {row['evaluation'].name}: {row['whole_why']}")
    print(f"test-time total: {sum(r['host']['hours'] for r in done) * host.chips:,.1f} device-hours on {host.name} VMs "
          f"(each evaluation {60 * startup_h:g} min of start-up besides)")
    print(f"makespan with the evaluations on {vms} {host.name} VM(s), evaluations claimed after every training run: "
          f"{fleet_makespan(training, tests, vms):.1f} h; on {spec.name}, one at a time: "
          f"{whole_training_h + whole:.1f} h"
          + (f" ({missing} evaluation(s) not projected there, above)" if (missing := sum(
              r.get("whole") is None for r in done)) else ""))

