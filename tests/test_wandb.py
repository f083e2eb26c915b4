"""The optional W&B mirror (training/wandb_mirror.py), always in offline mode (WANDB_MODE=offline: nothing
leaves the machine, no account needed).

Reading an offline run back: wandb 0.31 writes it through its Go core (wandb-core) into
DIR/wandb/offline-run-TIME-ID/run-ID.wandb, and no longer ships the Python reader of that file
(wandb.sdk.internal.datastore); no summary or config file is written either. The file is
LevelDB's log format (32 KiB blocks of records, each with a 7-byte header: CRC, length, type
FULL/FIRST/MIDDLE/LAST) after a 7-byte ":W&B" header, and each record is a protobuf
`wandb.proto.wandb_internal_pb2.Record`: `read_offline_run` below joins the chunks and parses them
with wandb's own protobuf classes (the run record: id, group, tags, config; history records: each
step's values, `_step` the step). The event files are read with tensorboard's EventAccumulator.
"""
import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.study_fixtures import study
from tests.test_train import PROJECT_DIR, run_in_fresh_process, tiny_args
from training import launch_records, wandb_mirror
from training.config import config_from_dict, parse_config, with_new_fields

pytest.importorskip("wandb")

FLAGS = ("--model.hidden-size 32 --model.puzzle-emb-ndim 32 --optim.global-batch-size 32 --optim.max-steps 40 "
         "--run.log-every 10 --eval.every-epochs 10").split()  # steps 10-40, evaluations at 31 and 40
TIMING = {"step_ms", "steps_per_s", "examples_per_s", "tflops_per_device", "seconds"}  # wall-clock values


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def wandb_records(path: Path):
    """The protobuf records of a .wandb file (LevelDB's log format after wandb's header)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's last bytes, too few for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:  # the zero-filled rest of a block
            pos += -pos % block
        elif kind in (1, 2):  # FULL, FIRST
            pending = chunk
        else:  # MIDDLE, LAST
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_offline_run(directory: Path) -> dict:
    """An offline run's id, group, tags, name, config ({key: value}) and history ({step: {key: value}})."""
    [path] = directory.glob("run-*.wandb")
    out = {"history": {}}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(id=run.run_id, group=run.run_group, tags=list(run.tags), name=run.display_name,
                       project=run.project, config={u.key: json.loads(u.value_json) for u in run.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            out["history"].setdefault(row.pop("_step"), {}).update(row)
    return out


def offline_runs(run_dir: Path) -> list[dict]:
    """Every offline run under run_dir/wandb, oldest first."""
    return [read_offline_run(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]


def tensorboard(run_dir: Path) -> tuple[dict, dict]:
    """({scalar tag: [(step, value)]}, {image tag: [step]}) of a run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return ({tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]},
            {tag: [e.step for e in events.Images(tag)] for tag in events.Tags()["images"]})


def scalars_of(history: dict) -> dict:
    """{tag: [(step, value)]} of a W&B history's numbers (not its _runtime, _timestamp or pictures)."""
    out = {}
    for step, row in sorted(history.items()):
        for key, value in row.items():
            if not key.startswith("_") and "/_" not in key and isinstance(value, (int, float)) \
                    and not key.startswith("puzzles/"):
                out.setdefault(key, []).append((step, value))
    return out


@pytest.fixture(scope="module")
def mirrored_study(demo_path, tmp_path_factory):
    """A study of one run (one seed), mirrored in offline mode (flags after --), then its report
    attached: study.py's way of running, so the group and tag come from the study."""
    root = tmp_path_factory.mktemp("wandb-study")
    out, study_file = root / "wandb-study", root / "study.txt"
    study_file.write_text(f"mirrored demo --data.path {demo_path} --data.cache-dir {root / 'cache'} "
                          + " ".join(FLAGS) + " --seeds 1\n")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    ran = study("run", str(study_file), "--out", str(out), "--", "--report.wandb-project", "trm-test", env=env)
    ran_text = ran.communicate(timeout=900)[0]
    assert ran.returncode == 0 and "mirrored-s0: done" in ran_text, ran_text
    reported = study("report", str(out), "--wandb-project", "trm-test", env=env)
    report_text = reported.communicate(timeout=600)[0]
    assert reported.returncode == 0, report_text
    return out, ran_text, report_text


def test_an_offline_run_holds_the_tensorboard_scalars_and_pictures_at_the_same_steps(mirrored_study):
    out, ran_text, _ = mirrored_study
    run_dir = out / "mirrored-s0"
    [run] = offline_runs(run_dir)
    tb_scalars, tb_images = tensorboard(run_dir)
    # (study/...: the report's HParams metrics, which study.py report adds to the run's tb/ after it)
    tb_scalars = {tag: points for tag, points in tb_scalars.items() if not tag.startswith("study/")}
    assert {"train/loss", "train/exact_accuracy", "train/grad_norm", "xla/compiles", "eval/exact_accuracy",
            "eval/num_examples", "eval/seconds"} <= set(tb_scalars)
    mirrored = scalars_of(run["history"])
    assert sorted(mirrored) == sorted(tb_scalars)  # the same names, nothing more, nothing less
    for tag, points in tb_scalars.items():  # TensorBoard keeps float32, W&B the float64 values
        assert [s for s, _ in mirrored[tag]] == [s for s, _ in points], tag
        assert [v for _, v in mirrored[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    assert [s for s, _ in tb_scalars["train/loss"]] == [10, 20, 30, 40]
    assert [s for s, _ in tb_scalars["eval/exact_accuracy"]] == [31, 40]
    # The puzzle pictures at each evaluation, as W&B images of the same names.
    assert tb_images and {tag: [s for s in sorted(run["history"]) if run["history"][s].get(f"{tag}/_type")
                                == "image-file"] for tag in tb_images} == tb_images
    # The resolved configuration (the dataset's fields included) and the run directory's URL.
    saved = json.loads((run_dir / "config.json").read_text())
    for section in ("data", "model", "optim", "eval"):
        assert run["config"][section] == saved[section], section
    assert run["config"]["run_dir_url"] == str(run_dir) and run["config"]["model"]["num_puzzle_identifiers"] == 1
    # One id, derived from the run directory, and recorded there with the last step sent.
    record = json.loads((run_dir / wandb_mirror.RECORD).read_text())
    first = min(r["process_start"] for r in launch_records.read_launches(str(run_dir)))  # the run's first launch
    assert run["id"] == record["id"] == wandb_mirror.run_id(str(run_dir), first) and record["last_step"] == 40
    assert run["project"] == "trm-test" and f"W&B mirror: run {run['id']} of project trm-test (offline" in ran_text
    assert "W&B mirror: " in ran_text and "warning: the W&B mirror" not in ran_text


def test_a_study_run_is_grouped_by_study_and_tagged_by_configuration(mirrored_study):
    out, ran_text, _ = mirrored_study
    [run] = offline_runs(out / "mirrored-s0")
    assert (run["group"], run["tags"], run["name"]) == ("wandb-study", ["mirrored"], "mirrored-s0")
    assert "\n  --report.wandb-group wandb-study (preset: None)\n  --report.wandb-tags mirrored (preset: ())\n" \
        in ran_text, ran_text


def test_the_study_report_attaches_its_table_and_plots(mirrored_study):
    out, _, report_text = mirrored_study
    [report] = offline_runs(out)
    assert report["group"] == "wandb-study" and report["config"]["study_dir_url"] == str(out)
    [row] = report["history"].values()
    plots = sorted(p.stem for p in (out / "plots").glob("*.png"))
    assert plots and sorted(k[len("study/plots/"):-len("/_type")] for k in row
                            if k.startswith("study/plots/") and k.endswith("/_type")) == plots
    assert row["study/results/_type"] == "table-file"
    [table_file] = (next((out / "wandb").glob("offline-run-*")) / "files").glob("media/table/study/results*.json")
    table = json.loads(table_file.read_text())
    column = {name: [r[i] for r in table["data"]] for i, name in enumerate(table["columns"])}
    assert column["name"] == ["mirrored-s0", "mirrored"] and column["kind"] == ["run", "configuration"]
    assert column["status"][0] == "done" and float(column["final_exact_%"][0]) >= 0
    assert f"W&B: the table and {len(plots)} plots attached to project trm-test (offline" in report_text


def test_a_resumed_run_continues_one_wandb_run_without_repeating_a_step(demo_path, tmp_path):
    # The first launch trains 40 steps (checkpoints 20 and 40) and sends steps 10-40; its last
    # checkpoint then goes missing, so the relaunch (to 60 steps) resumes from step 20 and redoes
    # 21-40: W&B gets only what is new, steps 50 and 60.
    flags = ["--run.log-every", "10", "--run.ckpt-every", "20", "--eval.every-epochs", "1000",
             "--report.wandb-project", "trm-test"]
    run_in_fresh_process(tiny_args(demo_path, tmp_path, "--optim.max-steps", "40", *flags))
    run_dir = tmp_path / "run"
    shutil.rmtree(run_dir / "checkpoints" / "step_00000040")
    _, stdout = run_in_fresh_process(tiny_args(demo_path, tmp_path, "--optim.max-steps", "60", *flags))
    assert "(step 20)" in stdout and "steps up to 40 were sent by an earlier launch" in stdout, stdout
    first, second = offline_runs(run_dir)
    started = min(r["process_start"] for r in launch_records.read_launches(str(run_dir)))  # the first launch's
    assert first["id"] == second["id"] == wandb_mirror.run_id(str(run_dir), started)  # one W&B run (`wandb sync`)
    assert sorted(first["history"]) == [10, 20, 30, 40] and sorted(second["history"]) == [50, 60]
    assert "eval/exact_accuracy" in first["history"][40] and "eval/exact_accuracy" in second["history"][60]
    tb_scalars, _ = tensorboard(run_dir)  # the relaunch's values of 50 and 60 are TensorBoard's
    for step in (50, 60):
        assert dict(tb_scalars["train/loss"])[step] == pytest.approx(second["history"][step]["train/loss"], rel=1e-6)
    assert json.loads((run_dir / wandb_mirror.RECORD).read_text())["last_step"] == 60


def test_a_new_run_in_a_deleted_run_directory_is_a_new_wandb_run(tmp_path):
    """The W&B run id names the run by its directory and its first launch (the oldest launch
    record): every launch of one run, its wandb.json lost or not, continues one W&B run, and a run
    started again in the same directory after it was deleted gets another (reopening the old one
    would drop every step up to the old run's last online)."""
    run_dir = tmp_path / "run"
    config = parse_config(["demo", "--data.path", str(tmp_path / "data"), "--run.dir", str(run_dir),
                           "--report.wandb-project", "trm-test"])

    def mirrored(first_launch: float | None) -> str:
        """The id a launch's mirror opens, after the launch records of a run first launched then."""
        if first_launch is not None:
            records = run_dir / launch_records.LAUNCH_DIR
            records.mkdir(parents=True, exist_ok=True)
            (records / "launch-first.json").write_text(json.dumps({"process_start": first_launch}))
        mirror = wandb_mirror.Mirror(config, {}, lambda: launch_records.first_launch_start(str(run_dir)))
        mirror.log(1, {"train/loss": 1.0})
        mirror.close()
        record = json.loads((run_dir / wandb_mirror.RECORD).read_text())
        assert record["id"] == wandb_mirror.run_id(str(run_dir), record["first_launch"]), record
        return record["id"]

    first = mirrored(1000.0)
    (run_dir / wandb_mirror.RECORD).unlink()  # wandb.json lost: the launch records still name the run
    assert mirrored(None) == first
    shutil.rmtree(run_dir)  # the run deleted, and started again in the same directory
    assert mirrored(2000.0) != first
    shutil.rmtree(run_dir)  # a first launch whose own record is not written yet: this process's start
    assert mirrored(None) == wandb_mirror.run_id(str(run_dir), launch_records.process_start_time()) != first


def run_with_wandb_down(args) -> tuple[dict, str]:
    """train.main in a new process whose wandb.log raises at every call (as test_train's
    run_in_fresh_process, with that patch first)."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {PROJECT_DIR!r})
        import wandb
        def down(self, *args, **kwargs):
            raise ConnectionError("W&B is down")
        wandb.sdk.wandb_run.Run.log = down
        import train
        from training.config import parse_config
        result = train.main(parse_config({args!r}))
        print("RESULT" + json.dumps({{k: result[k] for k in ("history", "evals", "final", "xla")}}))
    """)
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="8")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT")[1]), proc.stdout


def test_a_failing_mirror_changes_neither_the_run_nor_its_tensorboard_files(demo_path, tmp_path):
    # wandb.log raising at every call (in the training process, before it starts): one warning,
    # and the run, its history and its event files are those of a run without a mirror.
    args = FLAGS + ["--data.cache-dir", str(tmp_path / "cache")]
    plain, _ = run_in_fresh_process(["demo", "--data.path", demo_path, "--run.dir", str(tmp_path / "plain"), *args])
    failing, stdout = run_with_wandb_down(["demo", "--data.path", demo_path, "--run.dir", str(tmp_path / "failing"),
                                           *args, "--report.wandb-project", "trm-test"])
    assert stdout.count("warning: the W&B mirror") == 1 and "failed to log step 10 (ConnectionError: W&B is down)" \
        in stdout, stdout
    assert re.search(r"W&B mirror: (\d+) of \1 logs not sent", stdout), stdout
    untimed = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert untimed(failing["history"]) == untimed(plain["history"]) and failing["evals"] == plain["evals"]
    assert failing["final"] == plain["final"] and failing["xla"]["compiles"] == plain["xla"]["compiles"]
    (want, want_images), (got, got_images) = tensorboard(tmp_path / "plain"), tensorboard(tmp_path / "failing")
    assert sorted(got) == sorted(want) and got_images == want_images
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        if tag.split("/")[-1] not in TIMING:
            assert got[tag] == want[tag], tag
    assert not (tmp_path / "plain" / wandb_mirror.RECORD).exists()


def test_the_mirror_without_wandb_installed_stops_at_start_saying_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import fail
    with pytest.raises(SystemExit, match="needs the wandb package: pip install wandb"):
        parse_config(["demo", "--data.path", str(tmp_path), "--report.wandb-project", "p"])
    with pytest.raises(SystemExit, match="pip install wandb"):
        wandb_mirror.import_wandb()
    parse_config(["demo", "--data.path", str(tmp_path / "demo")])  # without the mirror: no need of it


def test_a_run_saved_before_the_report_section_resumes_without_it():
    saved = json.loads(json.dumps(dataclasses.asdict(parse_config(["demo", "--data.path", "x"]))))
    del saved["report"]
    config = config_from_dict(with_new_fields(saved))
    assert config.report.wandb_project is None and config.report.wandb_tags == ()
    assert config_from_dict(saved).report.wandb_project is None
