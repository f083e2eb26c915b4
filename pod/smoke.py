"""The worker's side of `launch.sh smoke`: the bucket's read and write rates, and the smoke report.

launch.sh smoke (launch_smoke.sh) runs, on the user's slice: this file's
`rates` on every worker, a real-size run of the preset (A), the same run stopped by SIGTERM half
way and resumed (B), then this file's `report` on worker 0, which reads both runs' records and
worker 0's logs and sets *what was assumed* beside *what this slice shows*, one row per check:

    python pod/smoke.py rates gs://BUCKET/smoke/TIME --worker W [--megabytes 64]
    python pod/smoke.py estimate COMPILE.json   (on the laptop: tpu_compile.py's estimate, one line)
    python pod/smoke.py report --out gs://BUCKET/smoke/TIME --accelerator v4-64 --workers 8 --preset P
        --steps N --run-a RUN_DIR --log-a FILE --run-b RUN_DIR --log-b FILE --facts FILE

`rates` prints KEY<TAB>VALUE lines (write_mb_s, read_mb_s, or rates ERROR ...). `report` writes
smoke.md and smoke.json under --out, prints the table, and exits 1 when a check failed. --facts
holds the laptop's answers (lines TRM|WORKER|KEY|VALUE: the rates', the compiler's
estimate). What each row verifies and what a failure means: docs/pod.md, "smoke".

Test-only: TRM_TEST_SMOKE_SHIFT_RESUMED=X adds X to the resumed run's losses before they are
compared (the stand-in's check that a difference fails the comparison).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

if not __package__:  # run as a script (python pod/smoke.py, as worker.sh runs it): the checkout's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHIFT_ENV = "TRM_TEST_SMOKE_SHIFT_RESUMED"
COMPARED_STEPS = 5  # losses compared after the resume
NO_TPU = "no TPU"


def say(key: str, value) -> None:
    print(f"{key}\t{value}", flush=True)


def rates(url: str, worker: str, megabytes: int) -> int:
    """Write, read back and remove `megabytes` MB under url/rates/ (one object), timed."""
    from rundir import storage

    target = storage.join_url(url, "rates", f"worker-{worker}.bin")
    payload = os.urandom(megabytes << 20)
    try:
        started = time.perf_counter()
        storage.write_bytes(target, payload, attempts=2)
        wrote = time.perf_counter() - started
        started = time.perf_counter()
        back = storage.read_bytes(target, attempts=2)
        read = time.perf_counter() - started
        fs, path = storage.filesystem(target)
        fs.rm(path)
    except Exception as e:  # noqa: BLE001 - the failure is the answer
        say("rates", f"ERROR {type(e).__name__}: {e}".replace("\n", " ")[:300])
        return 1
    if back != payload:
        say("rates", f"ERROR the {megabytes} MB read back differ from those written")
        return 1
    say("write_mb_s", f"{megabytes / wrote:.1f}")
    say("read_mb_s", f"{megabytes / read:.1f}")
    say("rates", "ok")
    return 0


def records(run_dir: str) -> dict[int, dict]:
    """The run's train records by step (metrics/part-*.jsonl; a resumed launch rewrote the rest)."""
    from rundir import storage

    fs, path = storage.filesystem(storage.join_url(run_dir, "metrics"))
    try:
        parts = sorted(fs.glob(path + "/part-*.jsonl"))
    except FileNotFoundError:
        return {}
    lines = [json.loads(line) for part in parts for line in fs.cat(part).decode().splitlines() if line.strip()]
    return {r["step"]: r for r in lines if r.get("kind") == "train"}


def facts(path: str) -> dict[str, dict[str, str]]:
    """{worker: {key: value}} of lines TRM|WORKER|KEY|VALUE (the last value of a key wins)."""
    out: dict[str, dict[str, str]] = {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("|", 3)
            if len(parts) == 4 and parts[0] == "TRM":
                out.setdefault(parts[1], {})[parts[2]] = parts[3]
    return out


def last_match(pattern: str, text: str) -> re.Match | None:
    found = list(re.finditer(pattern, text, re.M))
    return found[-1] if found else None


def row(check: str, assumed: str, shows: str, verdict: str) -> dict:
    return {"check": check, "assumed": assumed, "shows": shows, "verdict": verdict}


def build_rows(args, a: dict[int, dict], b: dict[int, dict], log_a: str, log_b: str,
               known: dict[str, dict[str, str]]) -> list[dict]:
    workers = sorted((w for w in known if w.isdigit()), key=int)
    rows = []
    # The runtime: kind, devices, hosts and each host's device ids (worker 0's log of run A).
    started = last_match(r"TRM on (.+?): (\d+) devices on (\d+) host\(s\)", log_a)
    layout = last_match(r"^device layout \(host order\): (.+?); each host's rows land on its own devices "
                        r"\(checked in (\d+) ms\)", log_a)
    if started:
        kind, devices, hosts = started.group(1), int(started.group(2)), int(started.group(3))
        rows.append(row("runtime", f"{args.accelerator}: {args.workers} hosts of 4 chips, device ids from the "
                        "runtime (not host-contiguous on every slice)",
                        f"{kind}, {devices} devices on {hosts} hosts; device ids "
                        + ("; ".join(f"host {i}: {ids}" for i, ids in enumerate(layout.group(1).split(" | ")))
                           if layout else "unknown"),
                        "ok" if hosts == args.workers else "FAIL"))
        rows.append(row("host group", "gloo over the VMs' network (TCP to worker 0's port 12355)",
                        f"{hosts} hosts met and agreed on one configuration",
                        "ok" if hosts == args.workers else "FAIL"))
    else:
        rows.append(row("runtime", f"{args.accelerator}: {args.workers} hosts", "run A did not start (its log: "
                        f"{args.log_a})", "FAIL"))
    rows.append(row("mesh self-check", "each host's rows land on its own devices in the host-ordered mesh",
                    f"checked in {layout.group(2)} ms" if layout else "no self-check line in run A's log",
                    "ok" if layout else "FAIL"))
    # The real-size run.
    final = last_match(r"^done: .*", log_a)
    steady = [a[s] for s in sorted(a) if s > min(2, args.steps - 1)]
    if steady and final:
        ms = statistics.median(r["step_ms"] for r in steady)
        mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
        device_kind = started.group(1) if started else "?"
        tpu = device_kind.startswith("TPU")
        estimate = known.get("laptop", {}).get("estimate", "no compiler estimate (tpu_compile.py not available)")
        rows.append(row("step time", f"compiler's estimate: {estimate}",
                        f"host {ms:.1f} ms/step (median of steps {steady[0]['step']}-{steady[-1]['step']}, wall time); "
                        f"device ms/step: {'not measured by train.py (a profile shows it)' if tpu else NO_TPU}",
                        "ok"))
        rows.append(row("MFU", "10 / 25 / 40% bands until a TPU measures it",
                        f"{100 * statistics.median(mfu):.1f}% (measured)" if mfu else
                        (NO_TPU if not tpu else "unknown: no peak FLOP/s for this device kind"), "ok"))
    else:
        rows.append(row("step time", f"{args.steps} steps of {args.preset} finish", f"run A did not finish "
                        f"({len(a)} steps recorded; its log: {args.log_a})", "FAIL"))
    cache = last_match(r"^compile cache.*", log_a)
    xla = last_match(r"^XLA: .*", log_a)
    rows.append(row("compile", "every launch compiles on a TPU: torch_xla 2.9 cannot load its cache "
                    "(pytorch/xla#9094)", "; ".join(m.group(0) for m in (cache, xla) if m) or "no compile line",
                    "ok" if xla else "FAIL"))
    rows.append(resume_row(args, a, b, log_b))
    # The bucket, per worker.
    rate_rows = {w: known[w] for w in workers}
    failed = {w: k.get("rates", "no answer") for w, k in rate_rows.items() if k.get("rates") != "ok"}
    if rate_rows and not failed:
        write = [float(k["write_mb_s"]) for k in rate_rows.values()]
        read = [float(k["read_mb_s"]) for k in rate_rows.values()]
        shows = (f"write {min(write):.1f}-{max(write):.1f} MB/s, read {min(read):.1f}-{max(read):.1f} MB/s "
                 f"per worker ({len(write)} workers at once)")
    else:
        shows = "; ".join(f"worker {w}: {v}" for w, v in failed.items()) or "no worker answered"
    rows.append(row("bucket", "every worker writes and reads gs://BUCKET", shows,
                    "ok" if rate_rows and not failed else "FAIL"))
    return rows


def resume_row(args, a: dict[int, dict], b: dict[int, dict], log_b: str) -> dict:
    assumed = "a SIGTERM saves and stops every host; the resume's next losses equal an uninterrupted run's"
    stopped = last_match(r"stop requested \(SIGTERM or Ctrl-C\): saved checkpoint", log_b)
    resumed = last_match(r"resuming from \S+ \(step (\d+)\)", log_b)
    if not stopped or not resumed:
        what = "no save on SIGTERM" if not stopped else "no resume"
        return row("stop and resume", assumed, f"{what} in run B's log ({args.log_b})", "FAIL")
    step = int(resumed.group(1))
    shift = float(os.environ.get(SHIFT_ENV, "0"))
    steps = [s for s in range(step + 1, step + 1 + COMPARED_STEPS) if s in a and s in b]
    if not steps:
        return row("stop and resume", assumed, f"stopped at step {step}: no records after it to compare", "FAIL")
    diffs = [abs((b[s]["loss"] + shift) - a[s]["loss"]) for s in steps]
    same = max(diffs) == 0
    verdict = "equal the uninterrupted run" if same else f"differ from the uninterrupted run by up to {max(diffs):.3g}"
    return row("stop and resume", assumed,
               f"stopped at step {step}, resumed; losses of steps {steps[0]}-{steps[-1]} {verdict}",
               "ok" if same else "FAIL")


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| check | assumed | this slice shows | verdict |", "|---|---|---|---|"]
    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a literal | inside a markdown table cell

    lines += [f"| {cell(r['check'])} | {cell(r['assumed'])} | {cell(r['shows'])} | {r['verdict']} |" for r in rows]
    return "\n".join(lines) + "\n"


def report(args) -> int:
    from rundir import storage

    known = facts(args.facts)
    with open(args.log_a, errors="replace") as f:
        log_a = f.read()
    with open(args.log_b, errors="replace") as f:
        log_b = f.read()
    rows = build_rows(args, records(args.run_a), records(args.run_b), log_a, log_b, known)
    failed = [r["check"] for r in rows if r["verdict"] == "FAIL"]
    header = (f"# smoke: {args.preset} on {args.accelerator} ({args.workers} workers), {args.steps} steps, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
              f"{'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    text = markdown(rows, header)
    storage.write_bytes(storage.join_url(args.out, "smoke.md"), text.encode())
    storage.write_bytes(storage.join_url(args.out, "smoke.json"), json.dumps(
        {"accelerator": args.accelerator, "workers": args.workers, "preset": args.preset, "steps": args.steps,
         "run_a": args.run_a, "run_b": args.run_b, "rows": rows, "failed": failed, "facts": known},
        indent=2).encode())
    print(text + f"\n(written to {args.out}/smoke.md and smoke.json)", flush=True)
    return 1 if failed else 0


def estimate(path: str) -> str:
    """The compiler's estimate of the training step, from tpu_compile.py's --json file."""
    try:
        with open(path) as f:
            programs = json.load(f)["programs"]
        step = next(p for p in programs if p["program"] == "train_step" and p.get("compiled"))
        return f"{float(step['estimate_ms']):.1f} ms/step ({step.get('estimate_source', 'the TPU compiler')})"
    except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        return f"no compiler estimate (tpu_compile.py's {path} holds no compiled train_step estimate: {e})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rates", help="the bucket's write and read rates from this worker")
    r.add_argument("url")
    r.add_argument("--worker", required=True)
    r.add_argument("--megabytes", type=int, default=64)
    p = sub.add_parser("report", help="the smoke table from the runs' records and logs")
    for name in ("out", "accelerator", "preset", "run-a", "log-a", "run-b", "log-b", "facts"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    e = sub.add_parser("estimate", help="(on the laptop, no dependencies) the train_step estimate of a "
                       "tpu_compile.py --json file, as one line")
    e.add_argument("json")
    args = parser.parse_args(argv)
    if args.command == "estimate":
        print(estimate(args.json))
        return 0
    if args.command == "rates":
        return rates(args.url, args.worker, args.megabytes)
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
