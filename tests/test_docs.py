"""Every command the README and docs/ show works as written: each `python train.py`,
`build_data.py`, `bench.py` and `study.py` line parses with the program's own parser and passes
its checks that need no dataset or device (a study file's every line), and each `bash launch.sh`
line runs with --dry-run against the stand-in gcloud. The quick start is `bash demo.sh` and
`bash test.sh`, each run here with a stand-in Python (test_quickstart.py), and CI runs test.sh; the
demo's training itself is run by test_train.py's tests of the demo preset."""
import os
import re
import shlex
from pathlib import Path

import pytest
import tyro

import build_data
import study
import train
from bench import BenchConfig
from commands import export, predict, weights_flags
from tests.test_launch import Pod
from tests.test_quickstart import INSTALL, StandInClone
from training.config import PRESETS, check_config

PROJECT_DIR = Path(__file__).resolve().parent.parent
DOCS = [PROJECT_DIR / "README.md", *sorted((PROJECT_DIR / "docs").glob("*.md"))]
# The walkthrough's settings (README step 0), for the commands that use them.
SETTINGS = {"TRM_TPU": "trm-v4-64", "TRM_ZONE": "us-central2-b", "TRM_PROJECT": "my-project",
            "TRM_BUCKET": "my-trm-bucket", "TRM_DATA": "gs://my-trm-bucket/data/sudoku-extreme-1k-aug-1000"}
QUICK_START = ["bash demo.sh", "bash test.sh"]
# The manual form of what test.sh does (CI runs test.sh), and commands that need a cloud account.
NOT_CHECKED_HERE = ("python3 -m venv", ".venv/bin/pip install", ".venv/bin/ruff", ".venv/bin/python -m pytest",
                    "gcloud ", "export ")


def documented_commands() -> list[tuple[str, str]]:
    """(doc file, command) of every command line in the docs' bash blocks: continuation lines
    joined, comments dropped, `a && b` split, the walkthrough's $TRM_* settings filled in."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                words = shlex.split(line, comments=True)
                for command in " ".join(shlex.quote(w) for w in words).split(" && "):
                    if command:
                        command = re.sub(r"\$(TRM_\w+)", lambda m: SETTINGS[m[1]], command)
                        found.append((path.name, command))
    return found


COMMANDS = documented_commands()


def check_train_py(argv: list[str]) -> None:
    """Parse a train.py command line as train.py would, without running it."""
    if not argv or argv == ["--help"] or argv[-1] == "--help":
        with pytest.raises(SystemExit) as done:
            if train.command_line(argv) == 0:
                raise SystemExit(0)
        assert done.value.code in (0, None)
        return
    if argv[0] == "export":
        tyro.cli(export.ExportCommand, args=argv[1:])
        return
    if argv[0] in ("eval", "predict"):
        parse = (lambda a: weights_flags.parse_weights_command("eval", a, "")) if argv[0] == "eval" \
            else predict.parse_predict_command
        preset, _, overrides = parse(argv[1:])
        config = tyro.cli(type(PRESETS[preset][1]), default=PRESETS[preset][1], args=overrides)
    else:
        config = tyro.extras.overridable_config_cli(PRESETS, args=argv)
    check_config(config)


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    pod = Pod(tmp_path_factory.mktemp("docs-pod"), workers=2)
    pod.env.update(SETTINGS)
    return pod


def test_the_docs_show_commands():
    kinds = {command.split()[1] if command.startswith(("python", ".venv")) else command.split()[0]
             for _, command in COMMANDS}
    assert {"train.py", "build_data.py", "study.py", "bash"} <= kinds, kinds


def test_the_quick_start_is_demo_sh_and_test_sh_and_ci_runs_test_sh(tmp_path):
    quick_start = (PROJECT_DIR / "README.md").read_text().split("\n## Quick start")[1].split("\n## ")[0]
    first_block = re.search(r"```bash\n(.*?)```", quick_start, re.S)[1]
    assert [" ".join(shlex.split(line, comments=True)) for line in first_block.splitlines()] == QUICK_START
    clone = StandInClone(tmp_path)
    ok = [clone.run(script) for script in ("test.sh", ".ci/run")]
    assert all(result.returncode == 0 for result in ok), [result.stdout + result.stderr for result in ok]
    suite = "-m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests"  # CI: test.sh, the whole suite
    assert clone.calls() == ["-m venv .venv", INSTALL, "-m ruff check .", suite, "-m ruff check .", suite]
    assert "test.sh: reusing .venv" in ok[1].stdout


@pytest.mark.parametrize("doc,command", COMMANDS, ids=[f"{d}: {c[:60]}" for d, c in COMMANDS])
def test_documented_command_works_as_written(doc, command, pod, capsys, monkeypatch, tmp_path):
    if command.startswith(NOT_CHECKED_HERE):
        return
    words = shlex.split(command)
    program, argv = (words[1], words[2:]) if words[0] in ("python", ".venv/bin/python") else (words[0], words[1:])
    if program == "train.py":
        check_train_py(argv)
    elif program == "build_data.py":
        build_data.command_parser().parse_args(argv)
    elif program == "bench.py":
        tyro.cli(BenchConfig, args=argv)
    elif program == "study.py":
        args = study.parser().parse_args(argv)
        if args.command in ("plan", "run"):  # the study file as shipped: every line checked
            for name, value in SETTINGS.items():
                monkeypatch.setenv(name, value)
            study.read_study(args.study)
    elif command in QUICK_START:   # setup and all run, with a Python that only records its calls
        result = StandInClone(tmp_path).run(*argv)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    elif program == "bash" and argv[0] == "launch.sh":
        pod.set_tpu(accelerator="v4-64")
        result = pod.run("--dry-run", *argv[1:], expect=None)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    else:
        pytest.fail(f"{doc} shows a command this test cannot check: {command}")
    assert os.path.isdir(PROJECT_DIR)  # nothing above may change directory


def test_the_readmes_eval_example_writes_where_the_readme_says():
    """The README's `train.py eval` of a run directory: the setting directory the README names is
    where the command writes (the run it read, commands/restore.results_dir; the preset's plain
    setting, testtime/settings.py), and so is its line on an exported model file."""
    from commands.restore import results_dir
    from testtime import settings as testtime_settings

    readme = (PROJECT_DIR / "README.md").read_text()
    (command,) = [c for doc, c in COMMANDS if doc == "README.md" and c.startswith("python train.py eval ")]
    preset, flags, overrides = weights_flags.parse_weights_command("eval", shlex.split(command)[3:], "")
    config = tyro.cli(type(PRESETS[preset][1]), default=PRESETS[preset][1], args=overrides)
    (setting,) = testtime_settings.settings(config.eval, config.model.halt_max_steps)
    run = results_dir(flags.init_from, f"{flags.init_from}/checkpoints/step_00001000")
    said = testtime_settings.setting_dir(run, setting.k, setting.noise, setting.act_steps, setting.latent)
    assert f"`{said}/metrics.json`" in readme
    assert "`MODEL.safetensors.eval/test-time/...`" in readme and results_dir("MODEL.safetensors") == \
        "MODEL.safetensors.eval"
