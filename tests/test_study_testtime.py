"""Test-time compute as a study axis (fleet/testtime_grid.py): a study file's @test-time grid, checked;
its evaluations' commands, order and price; a tiny study whose finished run is evaluated once per
setting by real study.py and train.py eval processes, a killed holder's evaluation taken over;
and the report's columns of each setting and its plot."""
import csv
import json
import math
import os
import re
import shutil
import signal

import pytest

from fleet import claims
from fleet.plan import StudyError, parse_study, scaling_settings
from fleet.testtime_grid import evaluation_batches, evaluation_hours, evaluations, fleet_makespan
from tests.study_fixtures import study, wait_for
from testtime.settings import Setting


def test_grid_lines_expand_per_configuration_and_bad_values_are_refused():
    text = """
        w      demo --model.hidden-size {32,64} --model.puzzle-emb-ndim 32 --seeds 2
        other  demo --model.puzzle-emb-ndim 32 --model.halt-max-steps 6
        @test-time K=1,16 noise=0,0.3 D=2,4           # every run
        @test-time w-6* K=100 noise=1 latent=both     # w-64's seeds only
        @test-time other K=4 noise=0.5                # D: the model's halt_max_steps
    """
    runs = parse_study(text)
    settings = {name: [s.name for s in found] for name, found in scaling_settings(text, runs).items()}
    every = ["K1-noise0-D2", "K1-noise0-D4", "K1-noise0.3-D2", "K1-noise0.3-D4", "K16-noise0.3-D2", "K16-noise0.3-D4"]
    assert settings["w-32-s0"] == settings["w-32-s1"] == every  # noise 0 at K=1 only: no K=16 copies of K=1
    assert settings["w-64-s1"] == [*every, "K100-noise1-D4-both"]
    assert settings["other"] == [*every, "K4-noise0.5-D6"]  # D left out: the model's halt_max_steps
    bad = {
        "@test-time K=0 noise=0": "line 2: @test-time K=0: K is a number of trajectories per puzzle >= 1",
        "@test-time K=4": "line 2: @test-time: noise missing; expected @test-time [CONFIGURATIONS] K=",
        "@test-time K=4 noise=-1": "line 2: @test-time noise=-1: noise is the noise's standard deviation >= 0",
        "@test-time K=4 noise=1 D=0": "line 2: @test-time D=0: D is a number of ACT steps per puzzle >= 1",
        "@test-time K=4 noise=1 latent=z": "line 2: @test-time latent=z: 'z' is no latent: use z_L, z_H, both",
        "@test-time K=4 noise=1 depth=8": "line 2: @test-time: 'depth=8' is not KEY=VALUES with a key among K",
        "@test-time K=4 K=8 noise=1": "line 2: @test-time: K given twice",
        "@test-time K=4 noise=1 batch=64,128": "line 2: @test-time batch=64,128: batch is one global batch in rows",
        "@test-time maze K=4 noise=1": "line 2: @test-time maze: no configuration matches it (configurations: w)",
        "@testtime K=4 noise=1": "line 2: @testtime: no such line; the study file's are @dataset, @paper, @test-time",
        "@test-time K=1,200 noise=1": "line 2: @test-time: w at K200-noise1-D4: eval.trajectories K=200 exceeds "
                                      "the 128 rows each of the 1 host(s) holds of a batch of 128",
    }
    parse_study("w demo --model.puzzle-emb-ndim 32\n@test-time K=200 noise=1 batch=256\n")  # a batch that fits K
    for line, message in bad.items():
        with pytest.raises(StudyError, match=re.escape(f"study:{message}")):
            parse_study(f"w demo\n{line}\n")


def test_a_flag_after_dashes_that_sets_an_evaluations_setting_is_refused_when_the_study_plans(tmp_path,
                                                                                              monkeypatch):
    """`study.py run STUDY -- --eval.trajectories 4`: the flags after -- go after each evaluation's own
    --eval.trajectories / --eval.noise / --eval.act-steps / --eval.noise-latent / --optim.global-batch-size
    and would win, its metrics landing in another setting's directory, never done. Refused before
    anything runs, naming both flags and the @test-time line; flags no evaluation sets pass."""
    import study as study_cli
    from fleet import runner as fleet_runner

    text = "w demo --model.puzzle-emb-ndim 32\n\n@test-time K=1,16 noise=0,0.3 D=2,4 batch=256\n"
    path = tmp_path / "study.txt"
    path.write_text(text)
    started = []
    monkeypatch.setattr(fleet_runner, "StudyRunner", lambda *a, **k: started.append(a) or pytest.fail("it ran"))
    with pytest.raises(SystemExit) as refused:
        study_cli.main(["run", str(path), "--out", str(tmp_path / "out"), "--", "--run.device", "cpu",
                        "--eval.trajectories", "4"])
    assert not started and not (tmp_path / "out").exists()
    assert f"{path}:line 3: @test-time: --eval.trajectories 4 after -- conflicts with --eval.trajectories 1,16" \
        in str(refused.value)
    conflicts = {
        ("--eval.noise=0.5",): "--eval.noise=0.5 after -- conflicts with --eval.noise 0,0.3",
        ("--eval.act-steps", "8"): "--eval.act-steps 8 after -- conflicts with --eval.act-steps 2,4",
        ("--eval.noise_latent", "z_H"): "--eval.noise_latent z_H after -- conflicts with --eval.noise-latent z_L",
        ("--optim.global-batch-size", "64"): "--optim.global-batch-size 64 after -- conflicts with "
                                             "--optim.global-batch-size 256",
    }
    for flags, message in conflicts.items():
        with pytest.raises(StudyError, match=re.escape(f"study:line 3: @test-time: {message}")):
            parse_study(text, extra_flags=flags)
    parse_study(text, extra_flags=("--run.device", "cpu", "--eval.arc", "False"))
    # the run's own batch (no batch=): --optim.global-batch-size after -- sets the run's, which its
    # evaluations read, so it is no conflict
    parse_study("w demo\n@test-time K=4 noise=1\n", extra_flags=("--optim.global-batch-size", "64"))


def test_each_evaluation_is_a_train_py_eval_of_its_run_claimed_after_training_most_act_steps_first(demo_path):
    text = (f"w demo --data.path {demo_path} --model.hidden-size {{32,64}} --model.puzzle-emb-ndim 32\n"
            "@test-time K=1,8 noise=0.3 D=2,4 latent=z_L,both\n@test-time w-64 K=8 noise=0.3 D=4 batch=256\n")
    found = evaluations(parse_study(text), text, "gs://b/study")
    assert [e.name for e in found][:4] == ["w-32+K8-noise0.3-D4", "w-32+K8-noise0.3-D4-both", "w-64+K8-noise0.3-D4",
                                           "w-64+K8-noise0.3-D4-both"]
    assert [e.setting.k * e.setting.act_steps for e in found] == [32] * 4 + [16] * 4 + [4] * 4 + [2] * 4
    both = found[1]
    assert both.command("python", ("--run.device", "tpu"))[1:] == [
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py"), "eval", "demo",
        "--init-from", "gs://b/study/w-32", "--run.dir", "gs://b/study/w-32", "--data.path", demo_path,
        "--eval.trajectories", "8", "--eval.noise", "0.3", "--eval.act-steps", "4", "--eval.noise-latent", "both",
        "--run.device", "tpu"]
    assert both.directory == "gs://b/study/w-32/test-time/K8-noise0.3-D4-both"
    assert "--eval.noise-latent" not in found[0].command()  # z_L: train.py eval's default
    assert "--optim.global-batch-size" not in found[0].command()  # the run's batch
    # A setting on two lines: the first's batch (the run's, here); a setting of its own: its line's.
    assert found[2].batch is None and found[2].name == "w-64+K8-noise0.3-D4"
    text += "@test-time w-64 K=16 noise=0.3 D=4 batch=256\n"
    [wide] = [e for e in evaluations(parse_study(text), text, "o") if e.name == "w-64+K16-noise0.3-D4"]
    assert wide.command()[-2:] == ["--optim.global-batch-size", "256"]


def test_an_evaluation_is_priced_from_batches_of_whole_puzzles_and_d_act_steps():
    # 423,000 Sudoku-Extreme test puzzles at K=100, D=64 in batches of 768 rows: 7 puzzles a batch.
    assert evaluation_batches(Setting(100, 0.3, 64), 768, 423_000) == math.ceil(423_000 / 7) == 60_429
    assert evaluation_batches(Setting(16, 0.3, 64), 768, 1000) == math.ceil(1000 / 48)
    # On 8 hosts each holds 96 of 768 rows: K=100 does not fit (train.py eval refuses it), at 1,600 rows 2 a host do.
    with pytest.raises(ValueError, match="K=100 exceeds the 96 rows each of the 8 host"):
        evaluation_batches(Setting(100, 0.3, 64), 768, 423_000, hosts=8)
    assert evaluation_batches(Setting(100, 0.3, 64), 1600, 423_000, hosts=8) == math.ceil(423_000 / 16)
    assert evaluation_hours(Setting(100, 0.3, 64), 768, 423_000, 2.5) == pytest.approx(60_429 * 64 * 2.5 / 3.6e6)
    # Two VMs: a (3 h) and b (1 h) train; a's two evaluations wait for a, b's starts when b ends.
    assert fleet_makespan([("a", 3.0), ("b", 1.0)], [("a+x", "a", 2.0), ("a+y", "a", 2.0), ("b+x", "b", 1.0)], 2) \
        == 5.0
    assert fleet_makespan([("a", 3.0)], [("a+x", "a", 2.0), ("a+y", "a", 2.0)], 4) == 5.0  # each on a VM of its own


def test_plan_prices_every_evaluation_of_the_grid(demo_path, tmp_path):
    from tpu_costs.run_costs import flop_record
    from tpu_costs.slices import slice_spec

    path = tmp_path / "plan.txt"
    path.write_text(f"w demo --data.path {demo_path} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
                    "--optim.global-batch-size 32 --run.device tpu\n@test-time K=1,12,32 noise=0.3 D=4\n")
    done = study("plan", str(path), "--slice", "v4-8", "--fleet", "v4-8x2", "--mfu", "0.5", "--startup-minutes", "60")
    out = done.communicate(timeout=120)[0]
    assert done.returncode == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("w+")}
    # The demo's 40 test puzzles: 32 a batch at K=1, 2 at K=12 (8 rows padding), 1 at K=32.
    assert {name: int(row[2].replace(",", "")) for name, row in rows.items()} == {
        "w+K1-noise0.3-D4": 2, "w+K12-noise0.3-D4": 20, "w+K32-noise0.3-D4": 40}
    [run] = parse_study(path.read_text())
    ms = flop_record("demo", run.config(), slice_spec("v4-8"))["projected_device_ms_per_eval_step"] / 0.5
    assert float(rows["w+K12-noise0.3-D4"][3]) == pytest.approx(ms, rel=1e-3)
    assert "test-time evaluations (@test-time): 3" in out
    # An hour of start-up each: the training run on one VM, then its three evaluations on both.
    assert "makespan with the evaluations on 2 v4-8 VM(s), evaluations claimed after every training run: 3.0 h" in out


def test_an_evaluation_is_claimed_only_once_its_run_has_finished(demo_path, tmp_path):
    from fleet.runner import StudyRunner

    text = f"w demo --data.path {demo_path} --model.puzzle-emb-ndim 32\n@test-time K=4 noise=0.3 D=2\n"
    runs, out = parse_study(text), tmp_path / "out"
    [evaluation] = evaluations(runs, text, str(out))
    runner = StudyRunner(runs, str(out), text, "h", lease_s=60.0)
    claims.Claims(str(out), "x", 60.0).write("w", 0, "failed")  # its run failed: nothing to claim, nothing held
    assert runner.claim_next([evaluation]) == (None, 0)
    (out / "w").mkdir()
    (out / "w" / "final.json").write_text("{}")  # trained to its end: claimed
    assert runner.claim_next([evaluation]) == (evaluation, 1)
    assert claims.Claims(str(out), "y", 60.0).current("w+K4-noise0.3-D2")[1]["holder"] == "h"
    (out / "w" / "test-time" / "K4-noise0.3-D2").mkdir(parents=True)
    (out / "w" / "test-time" / "K4-noise0.3-D2" / "metrics.json").write_text("{}")
    assert runner.done(evaluation) and runner.claim_next([evaluation]) == (None, 0)  # done: skipped


# -- a tiny study with a test-time grid, run by real processes ---------------------------------------

LEASE_S = 4.0


@pytest.fixture(scope="module")
def evaluated_study(demo_path, tmp_path_factory):
    """A study of one run (trained 4 steps) with two test-time settings. Holder c trains the run and is killed
    (SIGKILL, with its train.py eval) in its first evaluation; holder a, started after the kill,
    evaluates the other setting and takes the killed one over once its lease is stale."""
    root = tmp_path_factory.mktemp("testtime-study")
    study_file, out = root / "study.txt", root / "out"
    study_file.write_text(
        f"w demo --data.path {demo_path} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
        "--optim.global-batch-size 32 --optim.max-steps 4 --eval.every-epochs 1000 --run.cpu-devices 2\n"
        "@test-time K=1 noise=0 D=2\n@test-time K=4 noise=0.3 D=2\n")
    def holder(name, **popen):
        return study("run", str(study_file), "--out", str(out), "--holder", name, "--lease-s", str(LEASE_S),
                     env={"CPU_NUM_DEVICES": "2"}, **popen)
    c, said = holder("c", start_new_session=True), []
    first = wait_for(c, r"study: w\+\S+: starting ", said)
    assert first and wait_for(c, r"^evaluating ", said), "".join(said)  # its train.py eval is under way
    os.killpg(c.pid, signal.SIGKILL)
    c.wait()
    a = holder("a")
    outputs = {"c": "".join(said), "a": a.communicate(timeout=900)[0]}
    assert a.returncode == 0, outputs["a"]
    return out, outputs, first.split()[1].rstrip(":")


def test_every_finished_run_is_evaluated_once_per_setting_and_a_killed_holders_evaluation_is_taken_over(
        evaluated_study):
    out, outputs, killed = evaluated_study
    assert killed == "w+K4-noise0.3-D2"  # the most ACT steps per puzzle first
    view = claims.Claims(str(out), "test", 1.0)
    for setting in ("K1-noise0-D2", "K4-noise0.3-D2"):
        name = f"w+{setting}"
        metrics = json.loads((out / "w" / "test-time" / setting / "metrics.json").read_text())
        assert (metrics["trajectories"], metrics["noise"], metrics["act_steps"]) == (
            int(setting[1]), 0.3 if "0.3" in setting else 0.0, 2)
        assert metrics["act_steps_per_puzzle"] == 2 * metrics["trajectories"] and metrics["num_puzzles"] == 40
        status = json.loads((out / "study" / "status" / f"{name}.json").read_text())
        # Launched once, or twice for the killed one: its first launch by c, then a's.
        assert status["state"] == "done" and status["attempts"] == (2 if name == killed else 1), status
        assert view.current(name)[1]["state"] == "done" and view.current(name)[1]["holder"] == "a"
        assert outputs["a"].count(f"study: {name}: done in") == 1
    assert f"study: {killed}: taking over from c (its lease" in outputs["a"]
    # a evaluates the other setting too; the killed one it takes over at once or after the lease (a
    # claim left by a dead process of the same machine is taken at once, fleet/claims.py), so in either order.
    assert "study: w+K1-noise0-D2: starting" in outputs["a"]
    # Run again: everything done is skipped, nothing launched.
    again = study("run", str(out.parent / "study.txt"), "--out", str(out), "--holder", "a",
                  env={"CPU_NUM_DEVICES": "2"}).communicate(timeout=600)[0]
    assert "finished before, skipped: w, w+K4-noise0.3-D2, w+K1-noise0-D2" in again, again
    assert "starting" not in again and "0 done, 0 failed, 3 skipped" in again, again


def test_the_report_has_a_column_per_setting_and_selection_and_the_test_time_plot(evaluated_study, tmp_path):
    from fleet.plots import write_test_time
    from fleet.report import collect, configurations
    from fleet.testtime_grid import plot_points

    out = tmp_path / "out"
    shutil.copytree(evaluated_study[0], out)
    planted = out / "w" / "test-time" / "K4-noise0.3-D2" / "metrics.json"  # distinct values: each column its key
    planted.write_text(json.dumps(dict(json.loads(planted.read_text()), best_q_exact_accuracy=0.25,
                                       mode_exact_accuracy=0.5, pass_exact_accuracy=0.75,
                                       conv_exact_accuracy=0.125)))
    done = study("report", str(out))
    text = done.communicate(timeout=300)[0]
    assert done.returncode == 0, text
    with open(out / "results.csv") as f:
        rows = {(r["kind"], r["name"]): r for r in csv.DictReader(f)}
    settings = ["K1-noise0-D2", "K4-noise0.3-D2"]  # the grid's order
    columns = [f"{s}_{rule}_%" for s in settings for rule in ("best-Q", "mode", "pass@K", "conv")]
    header = (out / "results.md").read_text().split("Test-time compute")[1].split("\n\n")[1].splitlines()[0]
    assert header == "| " + " | ".join(["name", *columns]) + " |"
    for kind, name in (("run", "w"), ("configuration", "w")):
        row = rows[kind, name]
        assert [row[f"K4-noise0.3-D2_{rule}_%"] for rule in ("best-Q", "mode", "pass@K", "conv")] == \
            ["25.00", "50.00", "75.00", "12.50"]
        for setting in settings[:1]:
            metrics = json.loads((out / "w" / "test-time" / setting / "metrics.json").read_text())
            assert row[f"{setting}_mode_%"] == f"{100 * metrics['mode_exact_accuracy']:.2f}"
    print(text[text.index("test-time settings"):])  # the tiny study's columns, for the record
    assert "test-time settings, exact accuracy in %:" in text
    png = (out / "plots" / "accuracy_vs_test_time_compute.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    results = collect(str(out))
    points = {p["setting"]: p for p in plot_points(configurations(results), {r.run.name: r.scaling for r in results})}
    assert sorted(points) == sorted(settings) and points["K4-noise0.3-D2"]["compute"] == 8
    assert (points["K4-noise0.3-D2"]["best-Q"], points["K4-noise0.3-D2"]["pass@K"]) == (0.25, 0.75)
    assert points["K1-noise0-D2"]["train_flops"] > 0
    assert write_test_time([], results, str(tmp_path / "none.png")) is None  # no evaluation: no plot
    (out / "w" / "test-time" / "K1-noise0-D2" / "metrics.json").unlink()  # as if not evaluated yet
    done = study("report", str(out))
    assert done.communicate(timeout=300)[0] and done.returncode == 0
    with open(out / "results.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["kind"] == "run")
    assert [row[f"K1-noise0-D2_{rule}_%"] for rule in ("best-Q", "mode", "pass@K", "conv")] == ["", "", "", ""]  # not 0
    assert row["K4-noise0.3-D2_best-Q_%"] == "25.00"


def test_a_configurations_cell_and_its_plot_point_are_one_mean_over_the_same_runs():
    """The mean of a selection over a configuration's runs evaluated at a setting, in its table
    cell and its plot point alike; a selection one of those runs lacks (a metrics.json of another
    version) is left out of both, not averaged over the runs that have it."""
    from types import SimpleNamespace

    from fleet.testtime_grid import configuration_cells, plot_points

    def metrics(best_q, mode=None):
        return {"trajectories": 4, "noise": 0.3, "act_steps": 2, "best_q_exact_accuracy": best_q,
                "pass_exact_accuracy": 0.9, **({} if mode is None else {"mode_exact_accuracy": mode})}

    scaling = {"a": {"S": metrics(0.2, mode=0.4)}, "b": {"S": metrics(0.6)}, "c": {}}  # c: not evaluated at S
    cells = configuration_cells([scaling[n] for n in "abc"], ["S"])
    assert cells == {"S_best-Q_%": "40.00", "S_mode_%": "", "S_pass@K_%": "90.00", "S_conv_%": ""}
    config = {"configuration": "w", "results": [SimpleNamespace(run=SimpleNamespace(name=n)) for n in "abc"]}
    [point] = plot_points([config], scaling)
    assert point["runs"] == 2 and point["best-Q"] == pytest.approx(0.4) and point["pass@K"] == 0.9
    assert "mode" not in point
