"""A study file and its plan: the runs it expands to, their checks, their projected cost on a TPU
slice, and the makespan of the runs on a fleet of VMs that claim them longest first.

A study file is plain text, one run per line (a line ending in a backslash goes on):

    # NAME        PRESET       train.py flags...
    baseline      sudoku-mlp   --seeds 3
    hidden        sudoku-mlp   --model.hidden-size {256,384,768} --seeds 3
    lr            sudoku-mlp   --optim.lr={3e-5,1e-3} --optim.lr-schedule {cosine,linear}

A flag value with {a,b,c} in it expands the line into one run per value, the value appended to
the name (hidden-256, hidden-384, ...); several on one line give every combination. `--seeds K`
expands it into K runs with --run.seed 0..K-1, named NAME-s0 ... NAME-s{K-1}. `@paper NAME 87.4`
gives configuration NAME's published accuracy (in %), which the report shows beside its mean (and
`@dataset` lines declare a dataset's sizes for `plan`). `@test-time [CONFIGURATIONS] K=1,16
noise=0,0.3 D=16,64 [latent=z_L,z_H]` evaluates every finished run (or those of the configurations
named: a comma list, `*` globs) at each test-time setting of the grid (fleet/testtime_grid.py). $VARIABLES in
flags come from the environment (gs://$TRM_BUCKET/data/...). Any flag of
`python train.py PRESET --help` works, except --run.dir (the study gives each run its own).
`parse_study` refuses the whole file, every problem with its line number, before anything runs:
unknown presets or flags, values out of range, names used twice.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import io
import itertools
import math
import os
import re
import shlex
from dataclasses import dataclass

import tyro

import data
from testtime import settings as testtime_settings
from tpu_costs.run_costs import PaperDataset, flop_record, project_paper_run
from tpu_costs.slices import SliceSpec
from training.config import PRESETS, Config, ConfigError, check_config, flag_with_value, flat_config, presets_for

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
GRID = re.compile(r"^(.*?)\{([^{}]*)\}(.*)$")
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


class StudyError(ValueError):
    """A study file that cannot run: every problem, one per line, each with its line number."""


@dataclass(frozen=True)
class StudyRun:
    """One run of a study: its name (its directory under the study's), preset and train.py flags."""

    name: str
    preset: str
    flags: tuple[str, ...]
    line: int
    """The study file's line it comes from."""

    @property
    def configuration(self) -> str:
        """The run's name without its seed suffix: the runs of one configuration differ only by seed."""
        return re.sub(r"-s\d+$", "", self.name) if "--run.seed" in self.flags else self.name

    def config(self) -> Config:
        """The training configuration of this run (its preset with its flags)."""
        with contextlib.redirect_stderr(io.StringIO()):
            return tyro.extras.overridable_config_cli(presets_for(self.flags), args=[self.preset, *self.flags])


def _name_part(value: str) -> str:
    """A grid value as it goes into a run's name: a path by its last part, other characters as '_'."""
    value = value.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]", "_", value) or "_"


def _lines(text: str):
    """(line number, text) of each logical line: continuations joined, blank and comment lines left out."""
    pending, first = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        if not pending:
            first = number
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, pending = pending + raw, ""
        if line.strip() and not line.lstrip().startswith("#"):
            yield first, line
    if pending.strip():
        yield first, pending


def expand_line(number: int, line: str) -> list[StudyRun]:
    """The runs of one study line (grids and --seeds expanded); StudyError for its problems."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError as e:
        raise StudyError(f"line {number}: {e}") from None
    if len(words) < 2:
        raise StudyError(f"line {number}: expected NAME PRESET [train.py flags...], got {line.strip()!r}")
    name, preset, flags = words[0], words[1], words[2:]
    if not NAME.fullmatch(name):
        raise StudyError(f"line {number}: run name {name!r}: use letters, digits, '.', '_' and '-'")
    seeds = None
    if "--seeds" in flags or any(f.startswith("--seeds=") for f in flags):
        i = next(i for i, f in enumerate(flags) if f == "--seeds" or f.startswith("--seeds="))
        value = flags[i].split("=", 1)[1] if "=" in flags[i] else (flags[i + 1] if i + 1 < len(flags) else "")
        flags = flags[:i] + flags[i + (1 if "=" in flags[i] else 2):]
        if not value.isdigit() or int(value) < 1:
            raise StudyError(f"line {number}: --seeds takes a number of seeds >= 1, got {value!r}")
        seeds = int(value)
    for f in flags:
        if f.split("=", 1)[0] in ("--run.dir", "--run-dir"):
            raise StudyError(f"line {number}: {f}: the study gives each run its directory (OUT/NAME); "
                             "leave --run.dir out")
        if seeds and f.split("=", 1)[0] == "--run.seed":
            raise StudyError(f"line {number}: --run.seed and --seeds: give one of them")
    for i, f in enumerate(flags):
        flags[i] = os.path.expandvars(f)
        unset = VARIABLE.search(flags[i])
        if unset:
            raise StudyError(f"line {number}: {f}: ${unset[1]} is not set in the environment (export it)")
    grids = [(i, GRID.match(f)) for i, f in enumerate(flags) if GRID.match(f)]
    choices = []
    for i, match in grids:
        values = [v.strip() for v in match[2].split(",")]
        if not all(values):
            raise StudyError(f"line {number}: {flags[i]}: a grid lists values between braces, e.g. {{1,2,3}}")
        choices.append([(i, match[1] + v + match[3], v) for v in values])
    runs = []
    for combination in itertools.product(*choices):
        run_flags, run_name = list(flags), name
        for i, flag, value in combination:
            run_flags[i] = flag
            run_name += "-" + _name_part(value)
        for seed in range(seeds) if seeds else [None]:
            extra = [] if seed is None else ["--run.seed", str(seed)]
            runs.append(StudyRun(run_name + ("" if seed is None else f"-s{seed}"), preset,
                                 tuple(run_flags + extra), number))
    return runs


DATASET_FIELDS = ("groups", "examples", "test", "identifiers")


def _declared_dataset(number: int, line: str) -> PaperDataset:
    """`@dataset PATH groups=G examples=E test=T [identifiers=I]`: a dataset's sizes declared in
    the study file, for `plan` before the dataset is built (E: mean examples per puzzle; T: test
    examples; I: puzzle identifiers, default 1)."""
    words = shlex.split(os.path.expandvars(line), comments=True)
    values = dict(w.split("=", 1) for w in words[2:] if "=" in w)
    usage = (f"line {number}: expected @dataset PATH groups=G examples=E test=T [identifiers=I] "
             f"(the sizes of a dataset not built yet), got {line.strip()!r}")
    if len(words) < 2 or set(values) - set(DATASET_FIELDS) or not {"groups", "examples", "test"} <= set(values) \
            or len(values) != len(words) - 2:
        raise StudyError(usage)
    try:
        sizes = PaperDataset(words[1], int(values["groups"]), float(values["examples"]), int(values["test"]),
                             int(values.get("identifiers", 1)), f"declared in the study file (line {number})")
    except ValueError:
        raise StudyError(usage) from None
    if min(sizes.total_groups, sizes.mean_puzzle_examples, sizes.test_examples, sizes.puzzle_identifiers) <= 0:
        raise StudyError(f"line {number}: @dataset {words[1]}: every size must be positive")
    return sizes


def declared_datasets(text: str) -> dict[str, PaperDataset]:
    """{path: sizes} of the study file's `@dataset` lines (StudyError for a bad one)."""
    return {d.name: d for d in (_declared_dataset(n, line) for n, line in _lines(text)
                                if line.lstrip().startswith("@dataset"))}


def _declared_paper(number: int, line: str) -> tuple[str, float]:
    """`@paper CONFIGURATION PERCENT`: the published result a configuration (a run name without
    its seed suffix) is compared with; the report shows it as paper_% beside the mean."""
    words = shlex.split(line, comments=True)
    try:
        if len(words) != 3 or not 0 <= float(words[2]) <= 100:
            raise ValueError
    except ValueError:
        raise StudyError(f"line {number}: expected @paper CONFIGURATION PERCENT (a published accuracy, 0-100), "
                         f"got {line.strip()!r}") from None
    return words[1], float(words[2])


def declared_papers(text: str) -> dict[str, float]:
    """{configuration: published accuracy in %} of the study file's `@paper` lines."""
    return dict(_declared_paper(n, line) for n, line in _lines(text) if line.lstrip().startswith("@paper"))


TEST_TIME_KEYS = {"k": "K", "noise": "noise", "d": "D", "latent": "latent", "batch": "batch"}
TEST_TIME_USAGE = ("@test-time [CONFIGURATIONS] K=1,16,100 noise=0,0.3 [D=16,64] [latent=z_L,z_H,both] [batch=B] "
                   "(K: trajectories per puzzle; noise: its standard deviation; D: ACT steps per puzzle, "
                   "default the model's halt_max_steps; latent: where the noise enters, default z_L; batch: the "
                   "evaluation's global batch in rows, default the run's)")


@dataclass(frozen=True)
class ScalingGrid:
    """One `@test-time` line: the test-time settings (every combination of its values) at which
    the finished runs of its configurations are evaluated (fleet/testtime_grid.py)."""

    configurations: tuple[str, ...]
    """Configuration names or fnmatch patterns (trm*, *-maze); empty: every configuration."""
    ks: tuple[int, ...]
    noises: tuple[float, ...]
    depths: tuple[int, ...] | None
    """D values; None: each run's own halt_max_steps."""
    latents: tuple[str, ...]
    line: int
    batch: int | None = None
    """The evaluations' global batch (rows); None: the run's own. A larger one fits a K above a
    host's rows of the training batch (a v4-64's 8 hosts hold 96 rows each of 768)."""

    def applies_to(self, run: StudyRun) -> bool:
        return not self.configurations or any(fnmatch.fnmatchcase(run.configuration, p) for p in self.configurations)

    def settings(self, halt_max_steps: int, breadth_without_noise: bool = False) -> list[testtime_settings.Setting]:
        """Every (K, noise, D, latent) of the grid, but noise 0 at K=1 on z_L only: without noise
        every trajectory is the first, wherever the (zero) noise would enter; unless
        `breadth_without_noise` (an arch whose rows draw their own initial states, EqR: noise 0 at
        each K on z_L, EqR's breadth)."""
        found = []
        for noise, k, d, latent in itertools.product(self.noises, self.ks, self.depths or (halt_max_steps,),
                                                     self.latents):
            setting = (testtime_settings.Setting(k, noise, d, latent) if noise else
                       testtime_settings.Setting(k if breadth_without_noise else 1, 0.0, d))
            if setting not in found:
                found.append(setting)
        return found


def _test_time_values(number: int, key: str, parts: list[str]) -> tuple:
    """The values of one KEY=a,b,c of a @test-time line, checked."""
    def bad(what: str) -> StudyError:
        return StudyError(f"line {number}: @test-time {key}={','.join(parts)}: {what}")
    if key in ("K", "D"):
        try:
            values = tuple(int(p) for p in parts)
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            raise bad("K is a number of trajectories per puzzle >= 1 (e.g. K=1,16,100)" if key == "K" else
                      "D is a number of ACT steps per puzzle >= 1 (e.g. D=16,64; leave D out for each model's "
                      "halt_max_steps)")
        return values
    if key == "batch":
        if len(parts) != 1 or not parts[0].isdigit() or int(parts[0]) < 1:
            raise bad("batch is one global batch in rows >= 1 for every evaluation of the line (e.g. batch=1600)")
        return (int(parts[0]),)
    if key == "noise":
        try:
            values = tuple(float(p) for p in parts)
        except ValueError:
            values = ()
        if not values or not all(math.isfinite(v) and v >= 0 for v in values):
            raise bad("noise is the noise's standard deviation >= 0 (e.g. noise=0,0.3)")
        return values
    unknown = [p for p in parts if p not in testtime_settings.NOISE_LATENTS]
    if unknown:
        raise bad(f"{unknown[0]!r} is no latent: use {', '.join(testtime_settings.NOISE_LATENTS)} (latent=z_L,both)")
    return tuple(parts)


def _declared_test_time(number: int, line: str) -> ScalingGrid:
    """`@test-time [CONFIGURATIONS] K=... noise=... [D=...] [latent=...]` (TEST_TIME_USAGE)."""
    words = shlex.split(line, comments=True)[1:]
    patterns: tuple[str, ...] = ()
    if words and "=" not in words[0]:
        patterns, words = tuple(p for p in words[0].split(",") if p), words[1:]
    values: dict[str, tuple] = {}
    for word in words:
        key, equals, text = word.partition("=")
        key = TEST_TIME_KEYS.get(key.lower())
        if not equals or key is None:
            raise StudyError(f"line {number}: @test-time: {word!r} is not KEY=VALUES with a key among K, noise, D, "
                             f"latent; expected {TEST_TIME_USAGE}")
        if key in values:
            raise StudyError(f"line {number}: @test-time: {key} given twice; list its values once (e.g. K=1,16)")
        parts = [p.strip() for p in text.split(",")]
        if not all(parts):
            raise StudyError(f"line {number}: @test-time {word}: list the values between commas (e.g. K=1,16,100)")
        values[key] = _test_time_values(number, key, parts)
    missing = [k for k in ("K", "noise") if k not in values]
    if missing:
        raise StudyError(f"line {number}: @test-time: {' and '.join(missing)} missing; expected {TEST_TIME_USAGE}")
    return ScalingGrid(patterns, values["K"], values["noise"], values.get("D"), values.get("latent", ("z_L",)),
                       number, values.get("batch", (None,))[0])


def scaling_grids(text: str) -> list[ScalingGrid]:
    """The study file's `@test-time` lines (StudyError for a bad one)."""
    return [_declared_test_time(n, line) for n, line in _lines(text) if line.lstrip().startswith("@test-time")]


def scaling_settings(text: str, runs: list[StudyRun]) -> dict[str, dict[testtime_settings.Setting, int | None]]:
    """{run name: {its test-time setting: the evaluation's global batch, None for the run's}, in
    the file's order} for the runs a `@test-time` line applies to (D left out: each run's model's
    halt_max_steps; a setting named by two lines: the first's batch)."""
    grids, found = scaling_grids(text), {}
    for run in runs:
        applying = [g for g in grids if g.applies_to(run)]
        if not applying:
            continue
        halt = run.config().model.halt_max_steps if any(g.depths is None for g in applying) else 0
        # EqR's breadth: its rows differ without test-time noise (the arch's config read only then)
        breadth = (any(0 in g.noises and any(k > 1 for k in g.ks) for g in applying)
                   and run.config().model.scheme.draws)
        settings = found.setdefault(run.name, {})
        for grid in applying:
            for setting in grid.settings(halt, breadth):
                settings.setdefault(setting, grid.batch)
    return found


DIRECTIVES = ("@dataset", "@paper", "@test-time")


def parse_study(text: str, source: str = "study", extra_flags: tuple[str, ...] | list[str] = ()) -> list[StudyRun]:
    """Every run of a study file, checked: StudyError lists each problem as SOURCE:LINE: ...
    `extra_flags`: the flags after -- of `study.py run`, which go to every train.py (flag_conflicts)."""
    runs, problems, papers, grids = [], [], [], []
    for number, line in _lines(text):
        directive = line.split()[0] if line.lstrip().startswith("@") else None
        try:
            if directive == "@dataset":
                _declared_dataset(number, line)
            elif directive == "@paper":
                papers.append((number, _declared_paper(number, line)[0]))
            elif directive == "@test-time":
                grids.append(_declared_test_time(number, line))
            elif directive is not None:
                raise StudyError(f"line {number}: {directive}: no such line; the study file's are "
                                 f"{', '.join(DIRECTIVES)} (or a run: NAME PRESET [train.py flags...])")
            else:
                runs += expand_line(number, line)
        except StudyError as e:
            problems.append(f"{source}:{e}")
    configurations = {run.configuration for run in runs}
    problems += [f"{source}:line {number}: @paper {name}: no configuration of that name (configurations: "
                 f"{', '.join(sorted(configurations))})" for number, name in papers if name not in configurations]
    problems += [f"{source}:line {grid.line}: @test-time {pattern}: no configuration matches it (configurations: "
                 f"{', '.join(sorted(configurations))})" for grid in grids for pattern in grid.configurations
                 if runs and not any(fnmatch.fnmatchcase(c, pattern) for c in configurations)]
    seen = {}
    for run in runs:
        if run.name in seen:
            problems.append(f"{source}:line {run.line}: run name {run.name} is used twice (first on line "
                            f"{seen[run.name]}); names must be unique")
        seen.setdefault(run.name, run.line)
        problems += [f"{source}:line {run.line}: {run.name}: {p}" for p in run_problems(run)]
    problems += [f"{source}:{p}" for p in flag_conflicts(grids, runs, extra_flags)]
    if not problems:
        problems += [f"{source}:{p}" for p in scaling_problems(grids, runs)]
    if not runs and not problems:
        problems.append(f"{source}: no runs (each line: NAME PRESET [train.py flags...])")
    if problems:
        raise StudyError("\n".join(problems))
    return runs


def run_problems(run: StudyRun) -> list[str]:
    """What train.py would refuse in this run's preset and flags (nothing needs the dataset)."""
    if run.preset not in PRESETS:
        return [f"unknown preset {run.preset!r} (presets: {', '.join(PRESETS)})"]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            config = tyro.extras.overridable_config_cli(presets_for(run.flags), args=[run.preset, *run.flags])
    except SystemExit:
        return [_tyro_error(captured.getvalue()) or f"train.py refuses the flags {' '.join(run.flags)}"]
    try:
        check_config(config)
    except ConfigError as e:
        return str(e).split("\nerror: ")
    return []


def _tyro_error(text: str) -> str:
    """tyro's error message for bad flags, as one line (its box drawing left out)."""
    lines = [re.sub(r"[│╭╮╰╯─]+", " ", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.lower().startswith(("usage:", "for full helptext",
                                                                           "python", "train.py", "study.py"))]
    return " ".join(lines).replace("  ", " ").strip()


def eval_config(config: Config, setting: testtime_settings.Setting, batch: int | None = None) -> Config:
    """The run's configuration as `train.py eval` runs it at a test-time setting: its evaluation
    program (tpu_compile.py traces one ACT step at the global batch, the run's unless `batch`, at
    the setting's K, noise, D and latent)."""
    fields = {"trajectories": str(setting.k), "noise": f"{setting.noise:g}"}
    names = {f.name for f in dataclasses.fields(config.eval)}
    fields.update({k: v for k, v in (("act_steps", setting.act_steps), ("noise_latent", setting.latent))
                   if k in names})
    optim = config.optim if batch is None else dataclasses.replace(config.optim, global_batch_size=batch)
    return dataclasses.replace(config, eval=dataclasses.replace(config.eval, **fields), optim=optim)


def scaling_problems(grids: list[ScalingGrid], runs: list[StudyRun]) -> list[str]:
    """What train.py eval would refuse at each setting of the grids (check_config on each
    configuration's first run at each of its settings): 'line N: @test-time: CONFIGURATION at
    SETTING: why'."""
    problems, seen = [], set()
    for run in runs:
        if run.configuration in seen or not any(g.applies_to(run) for g in grids):
            continue
        seen.add(run.configuration)
        config = run.config()
        for grid in grids:
            for setting in grid.settings(config.model.halt_max_steps) if grid.applies_to(run) else []:
                try:
                    check_config(eval_config(config, setting, grid.batch))
                except ConfigError as e:
                    problems += [f"line {grid.line}: @test-time: {run.configuration} at {setting.name}: {p}"
                                 for p in str(e).split("\nerror: ")]
    return problems


def given_flags(flags: tuple[str, ...] | list[str]) -> dict[str, str]:
    """{flag name, dashes for underscores: the flag as given, with its value} of a train.py command line."""
    found = {}
    for i, word in enumerate(flags):
        if not word.startswith("--"):
            continue
        name, equals, _ = word.partition("=")
        value = "" if equals or i + 1 == len(flags) or flags[i + 1].startswith("--") else " " + flags[i + 1]
        found[name.replace("_", "-")] = word + value
    return found


def flag_conflicts(grids: list[ScalingGrid], runs: list[StudyRun], extra_flags: tuple[str, ...] | list[str]
                   ) -> list[str]:
    """'line N: @test-time: FLAG after -- conflicts with FLAG VALUES ...' for each flag after -- of
    `study.py run` that sets what an evaluation of a `@test-time` line (applying to a run) sets:
    it would come after the evaluation's own flag and win, so its metrics would land in another
    setting's directory and the setting would never be done. --optim.global-batch-size conflicts
    only with a line's batch= (without it the evaluations read the run's batch, which the flag set)."""
    given = given_flags(extra_flags)
    problems = []
    for grid in grids:
        if not any(grid.applies_to(run) for run in runs):
            continue
        sets = {"--eval.trajectories": ",".join(str(k) for k in grid.ks),
                "--eval.noise": ",".join(f"{n:g}" for n in grid.noises),
                "--eval.act-steps": ",".join(str(d) for d in grid.depths) if grid.depths else
                "(each run's halt_max_steps)",
                "--eval.noise-latent": ",".join(grid.latents)}
        if grid.batch is not None:
            sets["--optim.global-batch-size"] = str(grid.batch)
        problems += [f"line {grid.line}: @test-time: {given[flag]} after -- conflicts with {flag} {values}, which "
                     "this line's evaluations set (the flag after -- would win: the metrics would land in another "
                     "setting's directory and the setting would never be done); drop it from the flags after -- "
                     "or change the line" for flag, values in sets.items() if flag in given]
    return problems


def changed_flags(run: StudyRun) -> list[str]:
    """The run's settings that differ from its preset, as flags (--model.hidden-size 256 ...)."""
    mine, base = flat_config(run.config()), flat_config(PRESETS[run.preset][1])
    return [flag_with_value(k, v) for k, v in mine.items() if base[k] != v]


# ----------------------------------------------------------------------------------------------
# Projected cost and the fleet makespan


def dataset_sizes(url: str) -> PaperDataset:
    """The sizes a projection needs, read from a dataset's dataset.json files and test inputs'
    header (data.DatasetError when they cannot be read)."""
    train = data.read_metadata(url, "train")
    return PaperDataset(url, train.total_groups, train.mean_puzzle_examples, data.split_examples(url, "test"),
                        train.num_puzzle_identifiers, f"read from {url}")


def resolved_config(run: StudyRun, sizes: PaperDataset) -> Config:
    """The run's configuration with its dataset's puzzle-embedding table (the program it compiles)."""
    config = run.config()
    return dataclasses.replace(config, model=dataclasses.replace(
        config.model, num_puzzle_identifiers=sizes.puzzle_identifiers))


def projected_hours(run: StudyRun, spec: SliceSpec, mfu: float, sizes: PaperDataset,
                    device_time: dict | None = None) -> dict:
    """The run's training steps and wall hours on `spec` (each step's device time from its
    compiled TPU program, `device_time` (run_costs.device_time_fields), else the model FLOPs at
    `mfu` of the bf16 peak; training and evaluation steps, checkpoints not counted) and
    device-hours."""
    config = resolved_config(run, sizes)
    record = dict(flop_record(run.preset, config, spec), **(device_time or {}))
    projected = project_paper_run(record, config, sizes, mfu)
    if config.optim.max_steps is not None:  # a run cut short trains fewer steps
        share = min(1.0, config.optim.max_steps / max(1, projected["train_steps"]))
        projected["train_steps"] = min(projected["train_steps"], config.optim.max_steps)
        projected["train_hours"] *= share
    hours = projected["train_hours"] + projected["eval_hours"]
    return {"steps": projected["train_steps"], "hours": hours, "device_hours": hours * spec.chips}


def fleet_schedule(costs: dict[str, float], vms: int) -> list[list[str]]:
    """The runs each VM of a fleet trains when every VM, once free, claims the longest run left
    (fleet/runner.py's claims): longest first, each onto the VM that frees first (ties: the lower VM,
    names in order). Its longest share is the study's makespan on the fleet."""
    loads, shares = [0.0] * vms, [[] for _ in range(vms)]
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        vm = min(range(vms), key=lambda h: (loads[h], h))
        shares[vm].append(name)
        loads[vm] += costs[name]
    return shares
