"""The per-host probe: does this worker's TPU runtime start as a slice of its own?

worker.sh's remote_probe runs it on every worker at once, under r_single_host_env (the runtime of
one host alone, launch.sh study --per-host) and within a time limit: it starts the runtime, checks
that it sees exactly this host's chips as devices and is one process, and runs one all-reduce
over the host's devices. It prints KEY<TAB>VALUE lines for worker.sh (kind, devices,
local_devices, processes, device_ids, all_reduce, seconds) and last `probe ok` or `probe ERROR
what failed`; the exit status is 0 only with `probe ok`. launch.sh check --per-host shows the
answers per worker; launch.sh study starts per-host only when every worker answers ok.

    python probe.py --worker 3 --chips 4 [--device tpu]

Test-only (the stand-in pod of tests/test_launch.py, never set on a slice): --device cpu (a
virtual CPU mesh of --chips devices), and TRM_TEST_PROBE_FAULT=KIND:WORKER[,KIND:WORKER...] makes
the probe on WORKER act out a fault: `join` (its runtime joined the slice: 2 processes and twice
the devices are reported) or `hang` (it never answers).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

FAULT_ENV = "TRM_TEST_PROBE_FAULT"


def say(key: str, value) -> None:
    print(f"{key}\t{value}", flush=True)


def fault_for(worker: str) -> str:
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        kind, _, who = item.partition(":")
        if who == worker:
            return kind
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", required=True, help="this worker's number (for messages and test faults)")
    parser.add_argument("--chips", type=int, default=4, help="devices one host must show (its chips)")
    parser.add_argument("--device", choices=("tpu", "cpu"), default="tpu", help="tpu on a slice; cpu: tests only")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    fault = fault_for(args.worker)
    if fault == "hang":
        print(f"({FAULT_ENV}: worker {args.worker} hangs)", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    problems = []
    try:
        import sharding

        if args.device == "cpu":  # the stand-in pod: one host's chips as CPU devices, whatever the caller had
            os.environ["CPU_NUM_DEVICES"] = str(args.chips)
        kind = sharding.start_runtime(args.device, cpu_devices=args.chips)
        say("kind", sharding.accelerator_kind() if kind == "TPU" else kind)
        devices, local = sharding.device_counts()
        processes = sharding.process_count()
        if fault == "join":
            devices, processes = 2 * devices, 2
        say("devices", devices)
        say("local_devices", local)
        say("processes", processes)
        say("device_ids", ",".join(str(i) for i in sharding.local_device_ids()))
        if processes != 1:
            problems.append(f"the runtime joined a slice of {processes} processes and {devices} devices "
                            "(it did not start alone)")
        elif devices != args.chips or local != args.chips:
            problems.append(f"{devices} devices ({local} here), one host has {args.chips} chips")
        else:
            total, expected = sharding.host_all_reduce()
            ok = total == expected
            say("all_reduce", f"{'ok' if ok else 'ERROR'} {total:g} (expected {expected:g})")
            if not ok:
                problems.append(f"the all-reduce over the host's devices gave {total:g}, expected {expected:g}")
    except Exception as e:  # noqa: BLE001 - any failure to start is the answer
        problems.append(f"{type(e).__name__}: {e}".replace("\n", " ")[:300])
    say("seconds", f"{time.perf_counter() - started:.1f}")
    say("probe", "ok" if not problems else "ERROR " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
