"""A study: many TRM runs from one study file, claimed from the study directory by any number of
processes (one per TPU VM of a fleet), resumable, compared in one report.

    python study.py plan studies/tiny.txt                       # a CPU study: its runs and their steps
    python study.py plan studies/sudoku-scaling.txt --slice v4-64 --fleet v4-8x8   # compiled for both
    python study.py plan studies/sudoku-scaling.txt --slice v4-64 --mfu 0.3   # at an MFU a TPU measured
    python study.py run studies/tiny.txt --out runs/tiny-study  # every run, one after another
    python study.py run STUDY --out gs://BUCKET/studies/NAME    # on each VM of a fleet: claims runs
    python study.py report runs/tiny-study                      # the table, the plots, HParams
    python study.py report runs/tiny-study --wandb-project trm  # and the table and plots in W&B

A study file has one run per line, `NAME PRESET [train.py flags...]`; `{a,b,c}` in a flag's
value makes one run per value and `--seeds K` one per seed (fleet/plan.py; docs/studies.md).
Each run trains in OUT/NAME with `python train.py` (fleet/runner.py), claimed under a lease
(fleet/claims.py). On a fleet, `bash launch.sh study STUDY_NAME STUDY_FILE` starts this on every VM.

Exit status of `run`: 0 every run done or recorded as failed (or stopped on SIGTERM:
run it again to go on), 1 a study or flags that cannot run, 75 a run kept exiting 75 (storage
down, a hang: relaunching resumes it), as train.py's.
"""
from __future__ import annotations

import argparse
import sys

from fleet import testtime_grid
from fleet.plan import (
    StudyError,
    changed_flags,
    dataset_sizes,
    declared_datasets,
    fleet_schedule,
    parse_study,
    projected_hours,
    resolved_config,
)
from rundir import storage
from rundir.contract import EXIT_RETRYABLE
from tpu_costs.slices import SliceSpec, slice_spec
from training.schedule import run_schedule


def read_study(url: str, extra_flags: tuple[str, ...] | list[str] = ()) -> tuple[list, str]:
    """(the runs, the text) of a study file (local or gs://), with `extra_flags` (the flags after
    -- of `run`) checked against its evaluations' settings; exits with every problem."""
    try:
        text = storage.read_bytes(url).decode()
    except (storage.StorageError, OSError) as e:
        raise SystemExit(f"error: cannot read the study file {url}: {e}")
    try:
        return parse_study(text, url, extra_flags), text
    except StudyError as e:
        raise SystemExit("error: " + str(e).replace("\n", "\nerror: "))


def fleet_of(text: str | None, spec: SliceSpec) -> tuple[SliceSpec, int]:
    """(one VM's slice, the number of VMs) of a fleet named TYPExN (v4-8x8: eight v4-8 VMs); by
    default, the single-host VMs that hold as many chips as `spec` (v4-64 -> v4-8x8)."""
    if text is None:
        chips = spec.chips // spec.hosts
        return slice_spec(f"{spec.generation}-{2 * chips if spec.generation in ('v4', 'v5p') else chips}"), spec.hosts
    vm, _, count = text.strip().lower().rpartition("x")
    if not vm or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{text!r}: expected TYPExN, N VMs of one slice type (e.g. v4-8x8, v6e-4x2)")
    return slice_spec(vm), int(count)


def _hours(hours: float) -> str:
    return f"{hours:,.1f}" if hours >= 10 else f"{hours:.2f}" if hours >= 0.1 else f"{hours:.2g}"


def compiled_device_times(jobs: list[tuple], slices: dict[str, str], processes: int | None = None) -> dict:
    """{slice key: {run name: its steps' device time fields}} for (run, config, train split's
    sizes) jobs on each slice of `slices` ({key: slice name}): each run's evaluation step and the
    training step of each recursion curriculum stage it trains in (run_costs.run_programs),
    each distinct program compiled once for each slice (tpu_compile.py: each trace and compile in a
    process that ends, cached by program and topology)."""
    from tpu_costs import compiled_programs, run_costs

    distinct: dict[str, list] = {}  # settings -> [preset, config, programs, label]
    runs: dict[str, list[str]] = {}
    for run, config, sizes in jobs:
        runs[run.name] = []
        for program_config, programs in run_costs.run_programs(config, sizes):
            settings = compiled_programs.program_settings(program_config)
            label = run.configuration if program_config is config else \
                f"{run.configuration} stage H{program_config.model.H_cycles}L{program_config.model.L_cycles}"
            entry = distinct.setdefault(settings, [run.preset, program_config, (), label])
            entry[2] = tuple(p for p in compiled_programs.PROGRAMS if p in entry[2] or p in programs)
            runs[run.name].append(settings)
    for slice_name in slices.values():
        cached = sum(compiled_programs.cached_results(c, slice_name, programs) is not None
                     for _, c, programs, _ in distinct.values())
        print(f"compiling {len(distinct)} distinct program(s) for {slice_name} with the TPU compiler ({cached} cached; "
              "a real-size training step takes minutes on a laptop)", flush=True)
    names = list(dict.fromkeys(slices.values()))
    compiled = compiled_programs.compile_isolated([(preset, config, name, programs) for name in names
                                             for preset, config, programs, _ in distinct.values()],
                                            processes=processes,
                                            labels=[label for _ in names for *_, label in distinct.values()])
    results = {name: dict(zip(distinct, compiled[i * len(distinct):(i + 1) * len(distinct)]))
               for i, name in enumerate(names)}
    return {key: {run.name: run_costs.device_time_fields(
        [r for settings in runs[run.name] for r in results[name][settings]],
        (config.model.H_cycles, config.model.L_cycles)) for run, config, _ in jobs} for key, name in slices.items()}


def plan(args) -> int:
    runs, text = read_study(args.study)
    try:
        spec = slice_spec(args.slice)
    except ValueError as e:
        raise SystemExit(f"error: --slice: {e}")
    try:
        host, vms = fleet_of(args.fleet, spec)  # one VM of the fleet, and how many
    except ValueError as e:
        raise SystemExit(f"error: --fleet: {e}")
    compiled = args.mfu is None  # the device time of each step from its compiled program, else at --mfu
    mfu = args.mfu or 0.4
    whole_mfu = args.whole_slice_mfu or mfu
    declared = declared_datasets(text)
    sizes, known, rows = {}, [], []
    configs = {run.name: run.config() for run in runs}  # each run's configuration parsed once here
    paths = {name: config.data.path for name, config in configs.items()}
    cpu = {name for name, config in configs.items() if config.run.device == "cpu"}  # no TPU cost, nothing compiled
    for run in runs:
        path = paths[run.name]
        if path in declared:  # as the study file declares them: no read (the dataset may not exist yet)
            sizes[path] = declared[path]
        if path not in sizes:
            try:
                sizes[path] = dataset_sizes(path)
            except Exception as e:  # noqa: BLE001 - said once per dataset below
                sizes[path] = e
        if not isinstance(sizes[path], Exception) and run.name not in cpu:
            known.append((run, resolved_config(run, sizes[path]), sizes[path]))
    if cpu:
        print(f"{len(cpu)} of {len(runs)} run(s) name the CPU (run.device cpu, as the demo preset does): "
              "they train on this machine's CPU mesh, so the plan lists their steps only (no TPU program is compiled "
              "for them, no TPU hours); --run.device tpu in the study file plans them for TPUs", flush=True)
    if len(cpu) == len(runs):
        return plan_on_cpu(args, runs, sizes, configs)
    device = {"host": {}, "whole": {}}
    if compiled and known:
        from tpu_costs import compiled_programs

        try:
            device = compiled_device_times(known, {"host": host.name, "whole": spec.name}, args.jobs)
        except compiled_programs.CompileError as e:
            raise SystemExit(f"error: {e}; or project at a stated MFU: --mfu 0.4")
        except KeyboardInterrupt:
            raise SystemExit(130)
    runs = [run for run in runs if run.name not in cpu]  # the TPU runs, planned below
    unlaid = {}  # run name: why its evaluation cannot be laid out on a slice (K above a host's rows)
    for run in runs:
        path = paths[run.name]
        refused = compiled and any(device[k].get(run.name, {}).get("refused", True) for k in ("host", "whole"))
        if isinstance(sizes[path], Exception) or refused:
            rows.append((run, None, None))
            continue
        try:
            rows.append((run, projected_hours(run, host, mfu, sizes[path], device["host"].get(run.name)),
                         projected_hours(run, spec, whole_mfu, sizes[path], device["whole"].get(run.name))))
        except ValueError as e:  # testtime.batches.host_puzzles: the run itself would refuse it
            unlaid[run.name] = str(e)
            rows.append((run, None, None))
    how = ("each step's device time from its program compiled for one fleet VM and for the whole slice (the TPU "
           "compiler's estimate)" if compiled else f"{100 * mfu:g}% MFU")
    width = max(len(r.name) for r in runs)
    print(f"study {args.study}: {len(runs)} runs of {len({r.configuration for r in runs})} configurations; "
          f"projected on a fleet of {vms} {host.name} VM(s) ({host.chips} chips each) and on one {spec.name} "
          f"({spec.chips} chips), {spec.peak_tflops_per_chip:g} TFLOP/s bf16 a chip, at {how}")
    print(f"{'run'.ljust(width)}  {'preset':<10}  {'steps':>9}  {'VM h':>7}  {'device-h':>8}  "
          "flags beyond the preset")
    for run, on_host, _ in rows:
        steps = "?" if on_host is None else f"{on_host['steps']:,}"
        hours = "?" if on_host is None else _hours(on_host["hours"])
        dev = "?" if on_host is None else _hours(on_host["device_hours"])
        print(f"{run.name.ljust(width)}  {run.preset:<10}  {steps:>9}  {hours:>7}  {dev:>8}  "
              f"{' '.join(changed_flags(run)) or '(the preset)'}")
    projected = [(run, h, w) for run, h, w in rows if h is not None]
    startup = args.startup_minutes / 60
    loads = {run.name: h["hours"] + startup for run, h, _ in projected}
    shares = fleet_schedule(loads, vms)
    fleet_h = max((sum(loads[n] for n in share) for share in shares), default=0.0)
    whole_h = sum(w["hours"] + startup for _, _, w in projected)
    print(f"total: {sum(h['device_hours'] for _, h, _ in projected):,.1f} device-hours (chip-hours of training and "
          f"evaluation, each run on one {host.name}, at {how}; checkpoints and restarts not counted)")
    print(f"makespan on {vms} {host.name} VM(s), each claiming the longest run left: {fleet_h:.1f} h"
          f" (the busiest VM's {max((len(s) for s in shares), default=0)} run(s))")
    print(f"makespan on {spec.name}, one run at a time on the whole slice"
          + ("" if compiled else f" at {100 * whole_mfu:g}% MFU (a small batch per device usually runs at a "
                                 "lower MFU: --whole-slice-mfu)") + f": {whole_h:.1f} h")
    print(f"each run counts {args.startup_minutes:g} min of start-up (runtime, compiles, the dataset's copy); "
          "projections assume every step device-bound (bench.py measures the host's part)"
          + ("; the compiler's estimates assume Google's published clock and HBM bandwidth, only a TPU measures "
             "a step (launch.sh smoke)" if compiled else ""))
    testtime_grid.print_plan(runs, text, sizes, host, spec, vms, mfu, whole_mfu, compiled, args.jobs,
                              sorted(loads.items(), key=lambda item: (-item[1], item[0])), whole_h, startup)
    for path, error in sizes.items():
        names = [r.name for r, h, _ in rows if h is None and paths[r.name] == path]
        if isinstance(error, Exception) and names:
            print(f"not projected: {len(names)} run(s) of {path}: its size cannot be read ({error}); build it first, "
                  f"or declare its sizes in the study file: @dataset {path} groups=G examples=E test=T")
    for key, where in (("host", host.name), ("whole", spec.name)):
        for name, fields in device[key].items():
            if fields["refused"]:
                print(f"not projected: {name}'s {', '.join(fields['refused'])} does not compile for {where}: "
                      f"{fields['compiled_source']}")
    for name, why in unlaid.items():
        print(f"not projected: {name}: on {host.name} or {spec.name}, {why}")
    return 0


def plan_on_cpu(args, runs: list, sizes: dict, configs: dict) -> int:
    """The plan of a study whose runs all train on the CPU: each run's steps (from its dataset's
    sizes, or at most its optim.max_steps while the dataset is not built yet); `study.py run`
    trains them one after another on this machine."""
    width = max(len(r.name) for r in runs)
    print(f"study {args.study}: {len(runs)} runs of {len({r.configuration for r in runs})} configurations, all on "
          "the CPU (`study.py run` trains them one after another here); --slice, --fleet and --mfu do not apply")
    print(f"{'run'.ljust(width)}  {'preset':<10}  {'steps':>9}  flags beyond the preset")
    for run in runs:
        config = configs[run.name]
        known = sizes[config.data.path]
        if not isinstance(known, Exception):
            steps = f"{run_schedule(known, config.optim, config.eval.every_epochs)[0]:,}"
        else:
            steps = "?" if config.optim.max_steps is None else f"<={config.optim.max_steps:,}"
        flags = " ".join(changed_flags(run)) or "(the preset)"
        print(f"{run.name.ljust(width)}  {run.preset:<10}  {steps:>9}  {flags}")
    missing = sorted({c.data.path for c in configs.values() if isinstance(sizes[c.data.path], Exception)})
    if missing:
        print(f"steps as at most --optim.max-steps (or ?) where the dataset is not built yet: {', '.join(missing)} "
              "(train.py builds the demo's at its first run)")
    return 0


def run(args) -> int:
    from fleet.runner import StudyRunner

    runs, text = read_study(args.study, args.train_flags)
    if args.lease_s <= 0:
        raise SystemExit(f"error: --lease-s {args.lease_s:g} must be above 0 (seconds; default 120)")
    if args.worker < 0 or (args.worker and not args.whole_slice):
        raise SystemExit(f"error: --worker {args.worker}: a worker number of a multi-host slice, with --whole-slice")
    try:
        storage.check_url(args.out, "--out")
    except storage.StorageError as e:
        raise SystemExit(f"error: {e}")
    runner = StudyRunner(runs, args.out, text, args.holder, args.lease_s, tuple(args.train_flags), args.retries,
                         whole_slice=args.whole_slice, worker=args.worker)
    try:
        return runner.run()
    except StudyError as e:
        raise SystemExit(f"error: {e}")
    except storage.StorageError as e:
        print(f"error: {e}\nStorage failed beyond its retries; relaunching the study may help (exit status "
              f"{EXIT_RETRYABLE}).", file=sys.stderr, flush=True)
        return EXIT_RETRYABLE


def report(args) -> int:
    from fleet import report as study_report

    return study_report.main(args)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="study.py", description=__doc__.split("\n\n")[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("plan", help="the expanded runs and their steps; for TPU runs their projected cost and "
                                         "the makespans (runs that name the CPU: steps only, nothing compiled)")
    p.add_argument("study", help="the study file (local or gs://)")
    p.add_argument("--slice", default="v4-64",
                   help="the TPU slice of the one-run-at-a-time projection, each run over it whole (default v4-64)")
    p.add_argument("--fleet", default=None,
                   help="the fleet of the study: N VMs of one type, TYPExN (default: single-host VMs of as many chips "
                        "as --slice, v4-64 -> v4-8x8), each VM claiming the longest run left")
    p.add_argument("--mfu", type=float, default=None,
                   help="project at this model FLOPs utilisation of a run on one fleet VM (a TPU's measured MFU) "
                        "instead of compiling each program for the slice with the TPU compiler (the default)")
    p.add_argument("--whole-slice-mfu", type=float, default=None,
                   help="with --mfu: the MFU of a run on the whole slice (default: --mfu)")
    p.add_argument("--jobs", type=int, default=None,
                   help="compiling: processes at once (default: as many as the memory allows, measured from each "
                        "process's peak; each holds one program: docs/studies.md#the-memory-a-plan-needs)")
    p.add_argument("--startup-minutes", type=float, default=3.0,
                   help="start-up of each run: runtime, compiles, the dataset's copy (default 3)")
    p.set_defaults(handler=plan)
    p = commands.add_parser("run", help="claim the study's unfinished runs, longest first, and train them")
    p.add_argument("study", help="the study file (local or gs://)")
    p.add_argument("--out", required=True, help="the study's directory: OUT/NAME per run (local or gs://)")
    p.add_argument("--holder", default=None,
                   help="this process's name in the claims (default HOSTNAME-PID; launch.sh gives NAME@ZONE): a "
                        "claim left by an ended process of this machine is taken back at once, any other waits for "
                        "its lease")
    p.add_argument("--lease-s", type=float, default=120.0,
                   help="a claim not renewed for this long (seconds, by the observer's clock) may be taken over: "
                        "the run resumes from its checkpoint (default 120; renewed every eighth of it; the run's "
                        "train.py stops when half of it passes without a renewal: fleet/fencing.py)")
    p.add_argument("--whole-slice", action="store_true",
                   help="every host of a multi-host slice runs this command with the same --holder: worker 0 claims "
                        "and the slice trains each run whole; a run exiting other than 0 or 1 stops the study with 75")
    p.add_argument("--worker", type=int, default=0, help="with --whole-slice: this host's worker number (0 claims)")
    p.add_argument("--retries", type=int, default=2, help="launches again of a run that exits 75 (default 2)")
    p.epilog = "Flags after -- go to every run's train.py, e.g. -- --run.device tpu."
    p.set_defaults(handler=run)
    p = commands.add_parser("report", help="compare the runs of a study directory: a table, plots, HParams")
    p.add_argument("out", help="the study's directory (local or gs://)")
    p.add_argument("--wandb-project", default=None,
                   help="also attach the table (a W&B Table) and the plots to this Weights & Biases project, as a "
                        "run of the study's group (needs `pip install wandb`; WANDB_MODE=offline honoured)")
    p.add_argument("--wandb-entity", default=None, help="the W&B entity of --wandb-project (default: the key's)")
    p.set_defaults(handler=report)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    train_flags = argv[argv.index("--") + 1:] if "--" in argv else []  # every run's extra train.py flags
    args = parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.train_flags = train_flags
    if train_flags and args.command != "run":
        raise SystemExit(f"error: train.py flags after -- go with `run`, not `{args.command}`")
    if args.command == "plan" and args.mfu is not None and not (0 < args.mfu <= 1
                                                                and 0 < (args.whole_slice_mfu or args.mfu) <= 1):
        raise SystemExit("error: --mfu and --whole-slice-mfu must be in (0, 1]")
    if args.command == "plan" and args.jobs is not None and args.jobs < 1:
        raise SystemExit(f"error: --jobs {args.jobs}: give at least 1 process (or leave it out: sized from the memory)")
    if args.command == "plan" and args.whole_slice_mfu is not None and args.mfu is None:
        raise SystemExit("error: --whole-slice-mfu goes with --mfu (without it each program is compiled)")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
