"""Where a study's time went (fleet/goodput.py, training/launch_records.py): the report's causes of a study claimed by
three processes with one killed mid-run and its run taken over (conftest.py's `finished_study`), checked
against the runs' own records: the metrics records and checkpoints read right after the kill, the
launch records and the study's status files."""
import csv
import json
import shutil

import pytest

from fleet import goodput
from fleet.plots import write_timeline
from tests.study_fixtures import study
from training.launch_records import read_launches

CAUSE_COLUMNS = [f"{cause}_s" for cause in goodput.CAUSES]


@pytest.fixture(scope="module")
def reported(finished_study):
    """The report of the finished study: (what it printed, its run rows by name)."""
    return report_rows(finished_study.out)


def report_rows(out):
    done = study("report", str(out))
    text = done.communicate(timeout=300)[0]
    assert done.returncode == 0, text
    with open(out / "results.csv") as f:
        return text, {r["name"]: r for r in csv.DictReader(f) if r["kind"] == "run"}


def test_goodput_lost_steps_are_the_steps_past_the_killed_launchs_checkpoint(finished_study, reported):
    out, killed = finished_study.out, finished_study.killed
    # The kill came after a committed checkpoint, at a step past it: some work was lost.
    assert killed["reached"] > killed["committed"] >= 4, killed
    text, rows = reported
    for name, row in rows.items():
        assert int(row["lost_steps"]) == (killed["reached"] - killed["committed"] if name == killed["run"] else 0)
        launches = read_launches(str(out / name))
        assert int(row["launches"]) == len(launches) == (2 if name == killed["run"] else 1)
    first, second = read_launches(str(out / killed["run"]))
    assert first["ended"] is None  # it wrote no end: killed
    assert second["start_step"] == killed["committed"] and second["resumed"] and second["ended"] == "finished"
    # The lost time is the killed launch's time per step, over the steps trained again.
    per_step = first["seconds"]["training"] / (first["step"] - first["start_step"])
    lost = float(rows[killed["run"]]["lost_s"])
    assert lost == pytest.approx((killed["reached"] - killed["committed"]) * per_step, abs=0.06)
    assert "work lost to preemptions" in text and f"({killed['reached'] - killed['committed']} steps trained " \
        "again after 1 relaunch(es))" in text
    assert "goodput (training + evaluation over all of it):" in text
    assert "advice: compiling is" in text  # seconds of compiling in runs of seconds: the largest cause


def test_goodput_causes_add_up_to_each_runs_wall_time(finished_study, reported):
    out, killed = finished_study.out, finished_study.killed
    _, rows = reported
    for name, row in rows.items():
        launches = read_launches(str(out / name))
        # Each launch's wall time, process start to its last record, from the records themselves.
        wall = sum(r["time"] - r["process_start"] for r in launches)
        assert sum(float(row[c]) for c in CAUSE_COLUMNS) == pytest.approx(wall, abs=1.0), row
        assert float(row["launched_s"]) == pytest.approx(wall, abs=0.1)
        status = json.loads((out / "study" / "status" / f"{name}.json").read_text())
        if name != killed["run"]:  # study.py timed the launch from its start to the process's exit. After
            # the last record comes the interpreter's teardown: 17-18 s on a loaded 2-core machine while its
            # final garbage collection walked ~500k objects; since train.py freezes them (gc.freeze), 2.6-6.0 s
            # with the machine at load 9-12 (the rest: atexit handlers, the runtime's and the modules' teardown).
            assert status["seconds_total"] - 15 < wall <= status["seconds_total"] + 0.5
        assert float(row["compiling_s"]) > 0 and float(row["training_s"]) > 0 and float(row["evaluation_s"]) > 0
        good = (float(row["training_s"]) + float(row["evaluation_s"])) / float(row["launched_s"])
        assert float(row["goodput_%"]) == pytest.approx(100 * good, abs=0.1)
        assert float(row["device_hours"]) == pytest.approx(wall * 8 / 3600, abs=1e-4)


def test_goodput_timeline_shows_each_run_on_its_holder(finished_study, reported, tmp_path):
    out, killed = finished_study.out, finished_study.killed
    png = (out / "plots" / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    statuses = {p.stem: json.loads(p.read_text()) for p in (out / "study" / "status").glob("*.json")}
    spent = goodput.study_time(str(out), statuses)
    _, drawn = write_timeline(spent, str(tmp_path / "timeline.png"))
    first, second = read_launches(str(out / killed["run"]))
    taker = second["study_host"]
    assert drawn["hosts"] == sorted({"a", "b", "c"}) and first["study_host"] == "c" and taker in ("a", "b")
    for holder in ("a", "b", "c"):  # each run where it ran, once per launch, as its launch records say
        launched = [r["study_host"] for name in statuses for r in read_launches(str(out / name))]
        assert len([bar for bar in drawn["bars"] if bar[0] == holder]) == launched.count(holder)
    assert [bar[1] for bar in drawn["bars"] if bar[0] == "c"] == [killed["run"]]
    assert [(h, run, ended) for h, run, _, ended in drawn["ended"]] == [("c", killed["run"], "killed")]
    assert [(h, run) for h, run, _ in drawn["relaunched"]] == [(taker, killed["run"])]
    # No holder waited for its own relaunch (the killed run went to another), and c idles from its
    # killed launch's last record to the study's end.
    assert drawn["down"] == [] and spent.totals["down"] == 0
    assert ("c", first["time"], spent.end) in drawn["idle"]


def test_goodput_report_of_a_study_with_a_run_training_and_one_not_started(finished_study, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_study.out, out)
    training, never = "cycles-1-s1", "cycles-2-s1"
    (out / training / "final.json").unlink()
    status = out / "study" / "status" / f"{training}.json"
    status.write_text(json.dumps(dict(json.loads(status.read_text()), state="running")))
    record = sorted((out / training / "launches").glob("launch-*.json"))[-1]  # its newest launch: still writing
    record.write_text(json.dumps(dict(json.loads(record.read_text()), ended=None)))
    shutil.rmtree(out / never)
    (out / "study" / "status" / f"{never}.json").unlink()
    text, rows = report_rows(out)
    assert rows[never]["status"] == "not started" and rows[never]["goodput_%"] == "" and rows[never]["launches"] == ""
    assert rows[training]["status"] == "running" and float(rows[training]["goodput_%"]) > 0
    holders = {r["study_host"] for name in ("cycles-1-s0", "cycles-1-s1", "cycles-2-s0")
               for r in read_launches(str(out / name))}
    assert f"3 runs on {len(holders)} host(s)" in text and (out / "plots" / "timeline.png").exists()
    statuses = {p.stem: json.loads(p.read_text()) for p in (out / "study" / "status").glob("*.json")}
    _, drawn = write_timeline(goodput.study_time(str(out), statuses), str(tmp_path / "timeline.png"))
    assert [ended for _, run, _, _, ended in drawn["bars"] if run == training][-1] == "running"
    assert never not in {run for _, run, *_ in drawn["bars"]}


def test_goodput_lost_work_and_its_advice_from_two_launch_records():
    """Closed forms on two hand-made launch records: a launch killed at step 30 of a run saving every 20
    steps, and its relaunch from step 20, which found records up to step 30."""
    def record(start, end, start_step, step, training, checkpoint, pauses, ended, reached=None):
        return {"process_start": start, "time": end, "start_step": start_step, "step": step, "devices": 4,
                "previous_reached": reached, "checkpoint_pauses": pauses, "ended": ended, "study_host": 0,
                "seconds": {"startup": 5.0, "training": training, "evaluation": 0.0, "checkpoint": checkpoint,
                            "closing": 0.0, "compiling": end - start - 5.0 - training - checkpoint}}
    killed = record(0.0, 100.0, 0, 30, 60.0, 2.0, 1, None)  # 2 s per step
    relaunch = record(160.0, 260.0, 20, 100, 80.0, 8.0, 4, "finished", reached=30)
    spent = goodput.run_time("r", [killed, relaunch], running=False, ckpt_every=20)
    assert spent.lost_steps == 10 and spent.preemptions == 1
    assert spent.seconds["lost"] == pytest.approx(10 * 60.0 / 30)
    assert spent.seconds["training"] == pytest.approx(60.0 + 80.0 - 20.0)
    assert sum(spent.seconds.values()) == pytest.approx(spent.wall) and spent.wall == pytest.approx(200.0)
    study = goodput.StudyTime({"r": spent}, totals={c: 4 * v for c, v in spent.seconds.items()} | {"idle": 0.0,
                                                                                                   "down": 240.0})
    [lost] = [line for line in goodput.advice(study) if "work lost" in line]
    # Young's interval: sqrt(2 x 2 s mean pause x 200 s between preemptions) / (140 s / 110 steps).
    young = round((2 * 2.0 * 200.0) ** 0.5 / (140.0 / 110))
    assert "--run.ckpt-every 10 (saving every 20 steps now) would about halve it" in lost
    assert f"is about {young} steps" in lost
