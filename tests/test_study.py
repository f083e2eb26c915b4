"""Studies (study.py): the study file's expansion and checks, the claims (racers, a stale lease's
takeover, locally and on GCS), a study claimed by three real study.py processes running real
train.py runs with one killed and its run taken over, and the report of a finished and of an
unfinished study."""
import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fleet import claims
from fleet.plan import StudyError, fleet_schedule, parse_study
from fleet.report import seed_interval, t95, wilson
from rundir import storage
from tests.ports import free_port
from tests.study_fixtures import LEASE_S, PROJECT_DIR, study, wait_for


def test_grids_and_seeds_expand_into_named_runs(monkeypatch):
    monkeypatch.setenv("TRM_TEST_ROOT", "gs://b/data")
    runs = parse_study("""
        # a comment, then a blank line

        base   demo --optim.lr 1e-3
        grid   demo --model.hidden-size {32,64} --optim.lr={1e-3,3e-3} \\
                    --model.puzzle-emb-ndim 32   # a continued line
        data   demo --data.path $TRM_TEST_ROOT/sudoku-{100,500}-aug-10 --seeds 2
    """)
    assert [r.name for r in runs] == [
        "base", "grid-32-1e-3", "grid-32-3e-3", "grid-64-1e-3", "grid-64-3e-3",
        "data-100-s0", "data-100-s1", "data-500-s0", "data-500-s1"]
    assert runs[2].flags == ("--model.hidden-size", "32", "--optim.lr=3e-3", "--model.puzzle-emb-ndim", "32")
    assert runs[2].line == 5 and runs[0].line == 4
    assert runs[6].flags == ("--data.path", "gs://b/data/sudoku-100-aug-10", "--run.seed", "1")
    assert runs[6].configuration == "data-100" and runs[1].configuration == "grid-32-1e-3"
    assert runs[6].config().run.seed == 1 and runs[4].config().model.hidden_size == 64


def test_bad_lines_are_all_refused_with_their_line_numbers(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("\n".join([
        "good      demo",
        "preset    sudoku --optim.lr 1e-3",
        "flag      demo --optim.lrr 1e-3",
        "range     demo --optim.global-batch-size 0",
        "good      demo --seeds 2",
        "good-s1   demo",
        "dir       demo --run.dir runs/x",
        "unset     demo --data.path $TRM_NOT_SET/x",
        "lonely",
    ]))
    done = study("plan", str(path))
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 1, out
    assert "Traceback" not in out and "good-s0" not in out  # a valid expanded run raises nothing
    expected = [
        r"line 2: preset: unknown preset 'sudoku' \(presets: sudoku-mlp, sudoku-att, maze, arc1, arc2, eqr-sudoku, "
        r"eqr-maze, urm-arc1, urm-arc2, urm-sudoku, demo\)",
        r"line 3: flag: .*--optim.lrr",
        r"line 4: range: optim.global_batch_size=0 must be >= 1 \(set it with --optim.global-batch-size\)",
        r"line 6: run name good-s1 is used twice \(first on line 5\)",
        r"line 7: --run.dir: the study gives each run its directory \(OUT/NAME\); leave --run.dir out",
        r"line 8: \$TRM_NOT_SET/x: \$TRM_NOT_SET is not set in the environment",
        r"line 9: expected NAME PRESET",
    ]
    for pattern in expected:
        assert re.search(r"error: \S*bad.txt:" + pattern, out), (pattern, out)
    with pytest.raises(StudyError, match="no runs"):
        parse_study("# only a comment\n")


RACER = """
import json, os, random, sys, time
from fleet import claims
out, holder, runs, barrier = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mine = claims.Claims(out, holder, lease_s=60.0)
mine.generations("warm-up")  # gcsfs's session, before the start
open(os.path.join(barrier, holder), "w").close()
deadline = time.time() + 120
while len(os.listdir(barrier)) < 2:  # both ready: go (polled each millisecond, not spun: 2 cores)
    if time.time() > deadline:
        sys.exit(f"racer {holder}: the other racer did not arrive in 120 s")
    time.sleep(0.001)
won, order = [], list(range(runs))
random.Random(holder).shuffle(order)  # each its own order: neither is always one request ahead
for i in order:  # each run's claim (generation 1), then its renewal or takeover (2): both race
    won += [(i, g) for g in (1, 2) if mine.write(f"r{i}", g - 1, "running")]
print(json.dumps(won))
"""


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_exactly_one_of_two_racers_wins_each_claim_and_each_takeover(where, tmp_path, request):
    out = str(tmp_path / "study") if where == "local" else request.getfixturevalue("gcs_url")
    if where == "gcs":  # the precondition is enforced (tests/gcs_emulator.py; the bare emulator ignores it)
        assert claims.create_exclusive(out + "/x", b"1") and not claims.create_exclusive(out + "/x", b"2")
        assert storage.read_bytes(out + "/x") == b"1"
    runs, barrier = 60, tmp_path / "barrier"
    barrier.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", RACER, out, holder, str(runs), str(barrier)], cwd=PROJECT_DIR,
                               stdout=subprocess.PIPE, text=True) for holder in ("x", "y")]
    try:
        printed = [r.communicate(timeout=300)[0] for r in racers]
    finally:  # a racer still running (a timeout) is ended, not left behind
        for r in racers:
            if r.poll() is None:
                r.kill()
                r.wait()
    assert all(r.returncode == 0 for r in racers), printed
    won = [{tuple(w) for w in json.loads(text)} for text in printed]
    # Never two winners of a generation. Generation 2 (the newest) has one; generation 1 may have
    # none: its creator, listing after its write, found the other's generation 2 already there.
    assert not won[0] & won[1] and {(i, 2) for i in range(runs)} <= won[0] | won[1]
    assert all(won)  # both won some: they raced
    view = claims.Claims(out, "z", lease_s=60.0)
    for i in range(0, runs, 7):  # the record of each generation names its one winner
        generation, record = view.current(f"r{i}")
        assert generation == 2 and record["holder"] == ("x" if (i, 2) in won[0] else "y")


def test_a_stale_lease_is_taken_over_once_and_its_holder_learns_it_lost(gcs_url):
    holder, taker = claims.Claims(gcs_url, "h", lease_s=1.0), claims.Claims(gcs_url, "t", lease_s=1.0)
    assert holder.write("r", 0, "running") and taker.current("r")[0] == 1
    assert not taker.stale("r", 1)  # the taker has just seen generation 1
    assert holder.write("r", 1, "running")  # a renewal: generation 2
    time.sleep(0.6)
    assert taker.current("r")[0] == 2 and not taker.stale("r", 2)  # renewed: a new generation, a new wait
    time.sleep(1.1)
    assert taker.current("r")[0] == 2 and taker.stale("r", 2)
    assert taker.write("r", 2, "running", took_from="h")
    assert not holder.write("r", 2, "running")  # the holder's next renewal fails: it stops its run
    generation, record = holder.current("r")
    assert generation == 3 and record["holder"] == "t" and record["took_from"] == "h"
    assert holder.generations("r") == [2, 3]  # the older generations deleted


def test_a_generation_deleted_and_written_again_by_a_long_stalled_process_does_not_win(tmp_path):
    """The holder keeps its newest two generations. A process that last saw generation 1 (then
    stalled) can create generation 2 again after the holder wrote 4 and deleted 1 and 2: the
    create succeeds, but 4 is newer, so the write is not a win and the claim stays the holder's."""
    out = str(tmp_path / "study")
    holder, stalled = claims.Claims(out, "h", lease_s=60.0), claims.Claims(out, "s", lease_s=60.0)
    assert holder.write("r", 0, "running") and stalled.current("r")[0] == 1
    assert all(holder.write("r", g, "running") for g in (1, 2, 3)) and holder.generations("r") == [3, 4]
    assert not stalled.write("r", 1, "running", took_from="h")
    generation, record = stalled.current("r")
    assert generation == 4 and record["holder"] == "h"
    assert holder.write("r", 4, "running")  # the holder's renewal goes on
    # A generation whose removal failed (a storage error) is removed by a later write, however old:
    # each write removes what its own listing shows below the newest two, nothing it cannot see.
    assert all(holder.write("r", g, "running") for g in (5, 6))
    leftover = os.path.join(out, "study", "claims", "r", "00000001.json")
    assert holder._url("r", 1) == leftover and not os.path.exists(leftover)
    with open(leftover, "w") as f:
        f.write("{}")
    assert holder.write("r", 7, "running") and holder.generations("r") == [7, 8]

def test_plan_prints_steps_cost_and_makespans(demo_path, tmp_path):
    path = tmp_path / "plan.txt"
    path.write_text(f"w demo --data.path {demo_path} --model.hidden-size {{32,64}} --model.puzzle-emb-ndim 32 "
                    "--run.device tpu --seeds 2\n")  # the demo's runs name the CPU: these are planned for TPUs
    # An hour of start-up each: the runs' own minutes do not reach the printed tenth of an hour.
    done = study("plan", str(path), "--slice", "v4-16", "--fleet", "v4-8x3", "--mfu", "0.5", "--startup-minutes", "60")
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 0, out
    assert "4 runs of 2 configurations; projected on a fleet of 3 v4-8 VM(s) (4 chips each) and on one v4-16 " \
           "(8 chips)" in out and "50% MFU" in out
    # The demo's 200 epochs of the test data's 100 groups (one 1-example puzzle drawn from each) in
    # batches of 128: 156 steps.
    rows = [line.split() for line in out.splitlines() if line.startswith("w-")]
    assert [r[0] for r in rows] == ["w-32-s0", "w-32-s1", "w-64-s0", "w-64-s1"] and {r[2] for r in rows} == {"156"}
    assert "--model.hidden-size 32 --model.puzzle-emb-ndim 32" in out and "--run.seed 1" in out
    # Longest first: the two w-64 runs on VMs 0 and 1, then both w-32 runs on VM 2 (2 h); one at a
    # time on the v4-16: 4 h.
    assert "makespan on 3 v4-8 VM(s), each claiming the longest run left: 2.0 h (the busiest VM's 2 run(s))" in out
    assert re.search(r"makespan on v4-16, one run at a time on the whole slice.*: 4\.0 h", out)
    assert fleet_schedule({"a": 9.0, "b": 7.0, "c": 6.0, "d": 5.0, "e": 4.0, "f": 4.0, "g": 1.0}, 3) == [
        ["a", "f"], ["b", "e", "g"], ["c", "d"]]  # each run to the VM that frees first (ties: the lower VM)
    bad = study("plan", str(path), "--fleet", "v4-8*8").communicate(timeout=120)[0]
    assert "error: --fleet: 'v4-8*8': expected TYPExN" in bad
    # K=100 trajectories fit one host's 128 rows of the batch, not each of the v4-16's 2 hosts' 64:
    # that run is not projected, with the reason and the fix; the other one is.
    wide = tmp_path / "wide.txt"
    wide.write_text(f"k demo --data.path {demo_path} --run.device tpu --eval.trajectories 1,{{10,100}}\n")
    done = study("plan", str(wide), "--slice", "v4-16", "--mfu", "0.5")
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 0, out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("k-")] == \
        [["k-10", "demo", "156"], ["k-100", "demo", "?"]]
    assert "not projected: k-100: on v4-8 or v4-16, eval.trajectories K=100 exceeds the 64 rows each of the 2 " \
           "host(s) holds of a batch of 128: lower K or raise --optim.global-batch-size to at least 200" in out


def test_a_failed_run_is_recorded_with_its_last_line_and_the_study_goes_on(demo_path, tmp_path):
    path = tmp_path / "failing.txt"
    path.write_text(f"missing demo --data.path {tmp_path}/no-such-dataset\n"
                    f"fine demo --data.path {demo_path} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
                    "--optim.global-batch-size 32 --optim.max-steps 2\n")
    out = tmp_path / "out"
    done = study("run", str(path), "--out", str(out), "--", "--run.log-every", "7")
    said = done.communicate(timeout=600)[0]
    assert done.returncode == 0, said
    # The run whose dataset cannot be read is claimed last.
    assert said.index("study: fine: starting") < said.index("study: missing: starting (attempt 1): train.py demo")
    assert "--run.log-every 7" in said  # the flags after -- go to every run
    status = json.loads((out / "study" / "status" / "missing.json").read_text())
    assert status["state"] == "failed" and status["exit"] == 1
    assert status["last_line"].startswith("error: Dataset root") and "does not exist" in status["last_line"]
    assert "study: missing: failed (exit 1), going on with the next run; its last line: error: Dataset" in said
    assert json.loads((out / "study" / "status" / "fine.json").read_text())["state"] == "done"
    assert "done in" in said and "1 done, 1 failed, 0 skipped" in said
    # Run again: the finished run is skipped, the failed one tried again.
    again = study("run", str(path), "--out", str(out)).communicate(timeout=600)[0]
    assert "finished before, skipped: fine" in again and "missing: resuming or starting (attempt 2)" in again


def test_on_a_multi_host_slice_worker_0_claims_and_the_slice_trains_each_run_whole(demo_path, tmp_path):
    import sharding

    path, out = tmp_path / "slice.txt", tmp_path / "out"
    path.write_text(f"w demo --data.path {demo_path} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
                    "--optim.global-batch-size 32 --optim.max-steps 3 --eval.every-epochs 1000\n")
    address = f"tcp://127.0.0.1:{free_port()}"
    workers = [study("run", str(path), "--out", str(out), "--holder", "vm", "--whole-slice", "--worker", str(w),
                     env={sharding.SIMULATED_SLICE_ENV: f"{w}/2@{address}", "CPU_NUM_DEVICES": "4"})
               for w in (1, 0)][::-1]  # worker 1 first: it waits for worker 0's claim
    said = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], said
    assert "worker 1 of slice vm, following worker 0's claims" in said[1]
    # One launch on both hosts (4 devices on 2 hosts), claimed once by the slice; worker 1 waited
    # for worker 0's claim and ended once the run was done.
    [launch] = [json.loads(p.read_text()) for p in (out / "w" / "launches").glob("launch-*.json")]
    assert launch["hosts"] == 2 and launch["devices"] == 4 and launch["ended"] == "finished"
    assert [len(re.findall(r"study: w: (?:resuming or )?starting \(attempt", text)) for text in said] == [1, 1]
    generation, claim = claims.Claims(str(out), "test", 1.0).current("w")
    assert claim["state"] == "done" and claim["holder"] == "vm" and "study: vm: every run is over" in said[1]


# -- a study claimed by three processes -------------------------------------------------------------

def test_three_holders_train_every_run_once_and_a_killed_holders_run_is_taken_over(finished_study, demo_path,
                                                                                   tmp_path):
    out, outputs, killed = finished_study.out, finished_study.outputs, finished_study.killed
    runs = ["cycles-1-s0", "cycles-1-s1", "cycles-2-s0", "cycles-2-s1"]
    assert all((out / name / "final.json").exists() for name in runs)
    # Longest first: a and c claimed the two runs of 2 L-cycles; the late b trained at least one run,
    # a fresh one or the killed run it took over (then its only one, when a took the rest).
    assert killed["run"].startswith("cycles-2-")
    assert re.search(r"study: \S+: (?:resuming or )?starting \(attempt \d+\)", outputs["b"]), outputs["b"]
    for name in runs:  # one holder at a time: each launch began after the one before it ended
        launches = sorted((json.loads(p.read_text()) for p in (out / name / "launches").glob("launch-*.json")),
                          key=lambda r: r["process_start"])
        assert len(launches) == (2 if name == killed["run"] else 1), name
        assert all(x["time"] <= y["process_start"] for x, y in zip(launches, launches[1:])), name
        generation, claim = claims.Claims(str(out), "test", 1.0).current(name)
        assert claim["state"] == "done" and claim["holder"] == launches[-1]["study_host"] != "c"
        status = json.loads((out / "study" / "status" / f"{name}.json").read_text())
        assert status["state"] == "done" and status["attempts"] == len(launches)
        if name == killed["run"]:
            first, second = launches
            taker = second["study_host"]
            # Taken over as soon as a holder looked (c's process and its trainer, of this machine,
            # no longer ran: no lease to wait for), from its last checkpoint: no step before it
            # trained again.
            takeover_s = second["process_start"] - killed["time"]
            print(f"takeover of {name} by {taker}: {takeover_s:.1f} s after the kill (lease {LEASE_S:g} s)")
            assert first["study_host"] == "c"
            assert second["start_step"] == killed["committed"] and second["previous_reached"] == killed["reached"]
            assert f"study: {name}: taking over from c (its lease, generation" in outputs[taker]
            assert "was held by a process of this machine that ended" in outputs[taker]
            assert re.search(rf"resuming from \S*{name}/checkpoints/step_0+{killed['committed']} ", outputs[taker])
    # The resumed run ends as the same run trained without interruption.
    flags = next(r for r in parse_study((out / "study.txt").read_text()) if r.name == killed["run"]).flags
    straight = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "train.py"), "demo", *flags, "--run.dir",
                               str(tmp_path / "straight")], capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    final = json.loads((out / killed["run"] / "final.json").read_text())
    assert final["metrics"] == json.loads((tmp_path / "straight" / "final.json").read_text())["metrics"]
    assert final["step"] == 40 and final["devices"] == 8


def test_wilson_and_seed_intervals_are_the_closed_forms():
    p, n, z = 0.25, 400, 1.959963984540054
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert wilson(p, n) == pytest.approx((center - half, center + half), rel=1e-12)
    # Published values (Newcombe 1998, z = 1.96): 0 of 10 -> [0, 0.2775], 5 of 10 -> [0.2366, 0.7634].
    assert wilson(0.0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(0.5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert t95(1) == pytest.approx(12.7062047) and t95(4) == pytest.approx(2.7764451) and t95(1000) < 1.97
    assert seed_interval([0.4]) == (0.4, None, None)  # one seed: no interval
    mean, low, high = seed_interval([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4) and high - mean == pytest.approx(4.302652730 * 0.2 / math.sqrt(3))


def report_of(out):
    done = study("report", str(out))
    text = done.communicate(timeout=300)[0]
    assert done.returncode == 0, text
    with open(out / "results.csv") as f:
        return text, list(csv.DictReader(f))


def test_a_cpu_study_is_planned_as_one_without_compiling(tmp_path):
    """studies/tiny.txt's runs name the CPU (the demo preset's run.device): `plan` lists them and
    their steps (at most their max_steps while the demo data is not built), compiles nothing and
    counts no TPU hours; a study with both kinds plans the TPU runs and says which are CPU runs."""
    done = study("plan", os.path.join(PROJECT_DIR, "studies", "tiny.txt"), env={"TRM_TPU_COMPILE_CACHE": str(tmp_path)})
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 0, out
    assert "4 of 4 run(s) name the CPU" in out and "all on the CPU" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("width-")]
    # "<=150" while data/demo is not built, "150" once another test or the demo has built it
    assert [r[:2] for r in rows] == [[f"width-{w}-s{s}", "demo"] for w in (32, 64) for s in (0, 1)]
    assert all(r[2] in ("150", "<=150") for r in rows), rows
    assert "compiling" not in out and "TFLOP/s" not in out and "makespan" not in out and not os.listdir(tmp_path)
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("@dataset gs://b/x groups=100 examples=1 test=300\n"
                     "cpu demo --data.path gs://b/x\ntpu demo --data.path gs://b/x --run.device tpu\n")
    done = study("plan", str(mixed), "--mfu", "0.4", "--slice", "v4-8")
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 0, out
    assert "1 of 2 run(s) name the CPU" in out and "1 runs of 1 configurations" in out
    assert [line.split()[:3] for line in out.splitlines() if line.startswith(("cpu ", "tpu "))] == \
        [["tpu", "demo", "156"]]


def test_report_of_a_finished_study(finished_study):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata as hparams_metadata

    out = finished_study.out
    text, rows = report_of(out)
    runs = [r for r in rows if r["kind"] == "run"]
    configs = {r["name"]: r for r in rows if r["kind"] == "configuration"}
    assert len(runs) == 4 and sorted(configs) == ["cycles-1", "cycles-2"]
    for name, row in configs.items():  # the mean and interval over seeds, by hand from the runs' own records
        finals = []
        for seed in (0, 1):
            records = [json.loads(line) for part in sorted((out / f"{name}-s{seed}" / "metrics").glob("*.jsonl"))
                       for line in part.read_text().splitlines()]
            finals.append([r for r in records if r["kind"] == "eval"][-1]["exact_accuracy"])
        mean = sum(finals) / 2
        sd = abs(finals[0] - finals[1]) / math.sqrt(2)  # the sample standard deviation of two values
        half = 12.706204736 * sd / math.sqrt(2)  # t(0.975, 1 degree of freedom) x the standard error
        assert float(row["mean_exact_%"]) == pytest.approx(100 * mean, abs=0.005)
        low, high = row["mean_exact_95%"].split("-")
        assert float(low) == pytest.approx(100 * max(0.0, mean - half), abs=0.005)
        assert float(high) == pytest.approx(100 * min(1.0, mean + half), abs=0.005)
        assert row["seeds"] == "2" and row["model.L_cycles"] == name[-1]
        # Table 1's columns: the demo's H_cycles 2 x (L_cycles + 1) x 2 layers, one forward pass (trm)
        assert (row["effective_depth"], row["forward_passes"]) == (str(2 * (int(name[-1]) + 1) * 2), "1")
    for row in runs:
        final = json.loads((out / row["name"] / "final.json").read_text())["metrics"]
        low, high = wilson(final["exact_accuracy"], int(final["num_examples"]))
        assert row["status"] == "done" and row["steps"] == "40/40"
        assert row["final_exact_95%"] == f"{100 * low:.2f}-{100 * high:.2f}"
        assert int(row["parameters"]) > 0 and float(row["train_flops"]) > 1e9 and float(row["device_hours"]) > 0
    assert "cycles-1-s0" in text and "2 of 2 seeds done" in text and (out / "results.md").exists()
    plots = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert plots == ["accuracy_vs_compute.png", "accuracy_vs_model.L_cycles.png", "accuracy_vs_parameters.png",
                     "learning_curves.png", "timeline.png"]
    for name in plots:
        png = (out / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    for row in runs:  # TensorBoard's own reader finds each run's hyperparameters
        events = EventAccumulator(str(out / row["name"] / "tb"))
        events.Reload()
        content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
        start = hparams_metadata.parse_session_start_info_plugin_data(content[hparams_metadata.SESSION_START_INFO_TAG])
        assert start.hparams["model.L_cycles"].number_value == int(row["model.L_cycles"])
        assert start.hparams["configuration"].string_value == row["configuration"]
        assert events.Scalars("study/final_exact_accuracy")[-1].value == pytest.approx(
            float(row["final_exact_%"]) / 100, abs=5e-5)
    experiment = EventAccumulator(str(out))
    experiment.Reload()
    assert hparams_metadata.EXPERIMENT_TAG in experiment.PluginTagToContent(hparams_metadata.PLUGIN_NAME)


def test_report_marks_a_run_still_training_and_a_failed_one(finished_study, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_study.out, out)
    for name, state, line in (("cycles-1-s1", "running", ""), ("cycles-2-s0", "failed", "error: something broke")):
        (out / name / "final.json").unlink()
        status = out / "study" / "status" / f"{name}.json"
        status.write_text(json.dumps(dict(json.loads(status.read_text()), state=state, last_line=line)))
    shutil.rmtree(out / "cycles-2-s1")  # never started
    (out / "study" / "status" / "cycles-2-s1.json").unlink()
    text, rows = report_of(out)
    runs = {r["name"]: r for r in rows if r["kind"] == "run"}
    assert runs["cycles-1-s1"]["status"] == "running" and runs["cycles-1-s1"]["final_exact_%"] == ""
    assert runs["cycles-1-s1"]["steps"] == "40/40" and runs["cycles-1-s1"]["best_exact_%"] != ""
    assert runs["cycles-2-s0"]["status"] == "failed: error: something broke"
    assert runs["cycles-2-s1"]["status"] == "not started" and runs["cycles-2-s1"]["steps"] == "0/40"
    configs = {r["name"]: r for r in rows if r["kind"] == "configuration"}
    assert configs["cycles-1"]["seeds"] == "1" and configs["cycles-1"]["mean_exact_95%"] == ""  # no fake interval
    assert configs["cycles-1"]["mean_exact_%"] == runs["cycles-1-s0"]["final_exact_%"]
    assert configs["cycles-2"]["seeds"] == "0" and configs["cycles-2"]["mean_exact_%"] == ""
    assert "1 done" in text and "1 failed" in text and "1 running" in text and "1 not started" in text
    assert storage.exists(str(out / "plots" / "learning_curves.png"))


def test_the_shipped_studies_parse(monkeypatch):
    monkeypatch.setenv("TRM_BUCKET", "my-bucket")
    counts = {}
    for path in sorted(set(os.listdir(os.path.join(PROJECT_DIR, "studies"))) - {"paper-ablations.txt"}):  # test_halting
        with open(os.path.join(PROJECT_DIR, "studies", path)) as f:
            runs = parse_study(f.read(), path)
        counts[path] = (len(runs), len({r.configuration for r in runs}))
    # The tiny one: 2 widths x 2 seeds; the Sudoku plan: experiments 1-5 and 8, 35 configurations x 3 seeds;
    # PTRM's: the paper's TRM rows on Sudoku-Extreme and Maze-Hard x 3 seeds.
    # The successors: TRM, EqR and URM on Sudoku-Extreme and ARC-AGI-1/2, and EqR on its Maze-Unique, one seed each.
    assert counts == {"sudoku-scaling.txt": (105, 35), "tiny.txt": (4, 2), "ptrm-paper.txt": (6, 2),
                      "successors.txt": (8, 8)}


def test_sigterm_stops_the_study_after_its_run_saved_whether_or_not_the_run_got_it(demo_path, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(f"long demo --data.path {demo_path} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
                    "--optim.global-batch-size 32 --run.log-every 1\n")  # 625 steps
    out = tmp_path / "out"
    for launch, to_the_group in ((1, True), (2, False)):
        # A VM that shuts down signals every process (the group); launch.sh stop signals study.py alone.
        proc = study("run", str(path), "--out", str(out), start_new_session=True)
        lines = []
        assert wait_for(proc, r"^step \d+/625", lines)  # the launch's first step
        if to_the_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        said = "".join(lines) + proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, said
        assert said.count("SIGTERM: stopping (saving a checkpoint first") == 1  # the run got one signal
        assert "second SIGTERM" not in said and "stop requested (SIGTERM or Ctrl-C): saved checkpoint" in said
        assert "study: long: stopped (exit 0); handed back: it resumes from its checkpoint" in said
        assert "study: stopped (SIGTERM): 0 done, 0 failed, 0 skipped; run the same command again" in said
        status = json.loads((out / "study" / "status" / "long.json").read_text())
        assert status["state"] == "stopped" and status["attempts"] == launch
        assert (launch == 1) or re.search(r"resuming from \S*long/checkpoints/step_\d+", said)


def test_a_study_started_with_a_relative_out_from_another_directory_finishes(demo_path, tmp_path):
    """--out is resolved where the study starts: its trainers run in the checkout, and a relative
    --out there named another directory (the run trained to its end, then the study found no
    final.json, said "stopped (the run was stopped): 0 done", and did the same on every relaunch)."""
    path, elsewhere = tmp_path / "rel.txt", tmp_path / "elsewhere"
    path.write_text(f"r demo --data.path {demo_path} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
                    "--optim.global-batch-size 32 --optim.max-steps 2 --eval.every-epochs 1000\n")
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "study.py"), "run", str(path), "--out", "out"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "PYTHONUNBUFFERED": "1"})
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "1 done, 0 failed, 0 skipped" in said, said
    assert (elsewhere / "out" / "r" / "final.json").exists() and not os.path.exists(os.path.join(PROJECT_DIR, "out"))
    assert f"runs in {elsewhere / 'out'}" in said  # said absolute
