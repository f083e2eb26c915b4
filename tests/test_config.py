"""check_config and storage.check_url: bad flags fail before the dataset is opened and the
runtime starts, naming the field, its flag and the value; which fields a resume may change."""
import dataclasses
import os
import re
import subprocess
import sys
import typing

import pytest

import train
from commands.eval_command import evaluate_command
from commands.export import export
from training.config import PRESETS, Config, check_config, config_differences, parse_config, resumable_fields
from training.lifecycle import start

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSING = "/nonexistent/trm-dataset"  # never opened: the checks come first


def cli(*flags):
    return parse_config(["demo", "--data.path", MISSING, *flags])


def test_every_numeric_field_declares_its_range():
    for section in dataclasses.fields(Config):
        cls = type(getattr(Config(), section.name))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, float, int | None, float | None):
                assert f.metadata.get("range"), f"{section.name}.{f.name} declares no range"


@pytest.mark.parametrize("flag,value,message", [
    ("--optim.global-batch-size", "0", "optim.global_batch_size=0 must be >= 1"),
    ("--optim.global-batch-size", "-8", "optim.global_batch_size=-8 must be >= 1"),
    ("--optim.epochs", "0", "optim.epochs=0 must be >= 1"),
    ("--optim.max-steps", "-1", "optim.max_steps=-1 must be >= 0 .*leave it out"),
    ("--optim.lr", "-0.001", "optim.lr=-0.001 must be >= 0"),
    ("--optim.lr", "nan", "optim.lr=nan must be a finite number >= 0"),
    ("--optim.lr-warmup-steps", "-1", "optim.lr_warmup_steps=-1 must be >= 0"),
    ("--optim.lr-min-ratio", "1.5", r"optim.lr_min_ratio=1.5 must be in \[0, 1\]"),
    ("--optim.beta1", "-0.1", r"optim.beta1=-0.1 must be in \[0, 0.99999994\]"),
    ("--optim.beta2", "1.0", r"optim.beta2=1.0 must be in \[0, 0.99999994\] \(below 1 in float32"),
    ("--optim.weight-decay", "-1", "optim.weight_decay=-1.0 must be >= 0"),
    ("--optim.puzzle-emb-weight-decay", "inf", "optim.puzzle_emb_weight_decay=inf must be a finite number"),
    ("--optim.ema-rate", "1", r"optim.ema_rate=1.0 must be in \[0, 1\)"),
    ("--eval.every-epochs", "0", "eval.every_epochs=0 must be >= 1"),
    ("--eval.max-examples", "0", "eval.max_examples=0 must be >= 1"),
    ("--run.seed", "-3", r"run.seed=-3 must be in \[0, 4294967295\]"),
    ("--run.cpu-devices", "0", "run.cpu_devices=0 must be >= 1"),
    ("--run.log-every", "0", "run.log_every=0 must be >= 1"),
    ("--run.ckpt-every", "0", "run.ckpt_every=0 must be >= 1"),
    ("--run.keep-checkpoints", "0", "run.keep_checkpoints=0 must be >= 1"),
    ("--run.preempt-check-every", "0", "run.preempt_check_every=0 must be >= 1"),
    ("--run.profile-steps", "-2", "run.profile_steps=-2 must be >= 0"),
    ("--run.watchdog-minutes", "-1", "run.watchdog_minutes=-1.0 must be >= 0 \\(0 = off"),
    ("--model.hidden-size", "0", "model.hidden_size=0 must be >= 1"),
    ("--model.H-cycles", "0", "model.H_cycles=0 must be >= 1"),
    ("--model.L-cycles", "-1", "model.L_cycles=-1 must be >= 1"),
    ("--model.halt-max-steps", "0", "model.halt_max_steps=0 must be >= 1"),
    ("--model.expansion", "0", "model.expansion=0.0 must be > 0"),
    ("--model.halt-exploration-prob", "2", r"model.halt_exploration_prob=2.0 must be in \[0, 1\]"),
    ("--model.puzzle-emb-len", "-1", "model.puzzle_emb_len=-1 must be >= 0"),
    ("--data.path", "foo://x", r"data.path=foo://x: unknown URL scheme foo://; use gs://BUCKET/PATH .* or a local"),
    ("--data.path", "gs://", "data.path=gs:// names no bucket"),
    ("--run.dir", "gs:///runs/x", "run.dir=gs:///runs/x names no bucket"),
    ("--run.dir", "gs:/bucket/run", "run.dir=gs:/bucket/run has one slash after its scheme; write gs://bucket/run"),
    ("--data.cache-dir", "gs://bucket/cache", "data.cache_dir=gs://bucket/cache must be a local directory"),
    ("--run.init-from", "bar://m.safetensors", "run.init_from=bar://m.safetensors: unknown URL scheme bar://"),
])
def test_bad_flag_is_named_with_its_value_and_flag(flag, value, message):
    with pytest.raises(SystemExit) as raised:
        cli(flag, value)
    text = str(raised.value.code)
    assert text.startswith("error: ") and "\n" not in text, text
    assert re.search(message, text), text
    assert f"(set it with {flag})" in text or f"; set it with {flag})" in text, text


def test_model_sizes_that_do_not_fit_together():
    with pytest.raises(SystemExit, match=r"error: model.num_heads=3 gives heads of width .* = 21, odd"):
        cli("--model.no-mlp-t", "--model.pos-encodings", "rope", "--model.num-heads", "3")
    with pytest.raises(SystemExit, match=r"error: model.puzzle_emb_ndim=200 does not fit in puzzle_emb_len=1"):
        cli("--model.puzzle-emb-ndim", "200")


def test_every_problem_is_listed_one_per_line():
    with pytest.raises(SystemExit) as raised:
        cli("--optim.global-batch-size", "0", "--run.ckpt-every", "0", "--data.path", "foo://x")
    lines = str(raised.value.code).splitlines()
    assert [line.split("=")[0] for line in lines] == \
        ["error: optim.global_batch_size", "error: run.ckpt_every", "error: data.path"]


def test_boundary_values_pass():
    config = cli("--run.seed", "0", "--run.profile-steps", "0", "--optim.lr-warmup-steps", "0",
                 "--optim.ema-rate", "0", "--optim.lr-min-ratio", "0", "--optim.weight-decay", "0",
                 "--optim.beta1", "0", "--optim.max-steps", "0", "--eval.max-examples", "1",
                 "--model.puzzle-emb-ndim", "0", "--data.path", "gs://bucket/data/x", "--run.dir", "memory://runs/x")
    assert (config.run.seed, config.optim.ema_rate, config.optim.max_steps) == (0, 0.0, 0)
    for _, preset in PRESETS.values():  # every preset as shipped
        check_config(preset)


def test_start_checks_before_opening_the_dataset():
    """main(config) and eval reach start() without cli(): the flags are checked there first,
    so the error is about the flag, not about the dataset that does not exist."""
    config = PRESETS["demo"][1]
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, path=MISSING),
                                 run=dataclasses.replace(config.run, keep_checkpoints=0))
    with pytest.raises(SystemExit, match="^error: run.keep_checkpoints=0 must be >= 1"):
        start(config)


def test_eval_and_export_check_their_urls(tmp_path):
    with pytest.raises(SystemExit, match="^error: --init-from=foo://run: unknown URL scheme foo://"):
        evaluate_command(["--init-from", "foo://run", "--data.path", MISSING])
    with pytest.raises(SystemExit, match="^error: --out=gs:///m.safetensors names no bucket"):
        export(str(tmp_path), out="gs:///m.safetensors")


def test_bad_flags_exit_1_without_traceback_before_the_runtime_starts():
    proc = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "train.py"), "demo",
                           "--optim.global-batch-size", "0", "--run.keep-checkpoints", "0", "--optim.max-steps", "-1",
                           "--data.path", "foo://x"], capture_output=True, text=True, timeout=300, cwd=PROJECT_DIR,
                          env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "TRM on" not in proc.stdout
    assert [line.split("=")[0] for line in proc.stderr.splitlines()] == \
        ["error: optim.global_batch_size", "error: optim.max_steps", "error: run.keep_checkpoints",
         "error: data.path"], proc.stderr


def test_resume_may_change_where_and_how_but_not_what():
    """A copied run directory, a profile, the captured step and the compile cache are allowed to
    differ on resume (declared resumable); the learning rate is not."""
    saved = dataclasses.asdict(PRESETS["demo"][1])
    current = dataclasses.asdict(PRESETS["demo"][1])
    current["run"].update(dir="gs://bucket/runs/copied", profile_steps=5, capture_step=False,
                          compile_cache_dir="/tmp/other-xla-cache", ckpt_every=7)
    assert config_differences(saved, current) == []
    current["optim"]["lr"] = 3e-3
    current["model"]["H_cycles"] = 3
    assert config_differences(saved, current) == [
        "model.H_cycles: 2 in the run directory, 3 now", "optim.lr: 0.001 in the run directory, 0.003 now"]
    assert {"run.dir", "run.profile_steps", "run.capture_step", "run.compile_cache_dir", "run.compile_cache_url",
            "run.ckpt_every", "optim.max_steps", "eval.every_epochs"} <= resumable_fields()
    assert not {"optim.lr", "optim.global_batch_size", "run.seed"} & resumable_fields()


@pytest.mark.parametrize("argv, flags", [
    (["--help"], ["eval [PRESET] --init-from URL", "export SOURCE --out URL", "sudoku-mlp", "arc2", "demo"]),
    (["arc1", "--help"], ["--data.path", "--optim.puzzle-emb-lr", "--run.shard-puzzle-table", "(default: 0.01)"]),
    (["eval", "--help"], ["--init-from", "--data.path", "--eval.arc-aggregate", "train.py eval [PRESET]"]),
    (["eval", "arc1", "-h"], ["--init-from", "--model.seq-len", "(default: 900)"]),
    (["export", "--help"], ["--out", "train.py export"]),
])
def test_every_command_prints_its_flags_with_help(argv, flags, capsys):
    with pytest.raises(SystemExit) as stopped:
        sys.exit(train.command_line(argv))
    assert stopped.value.code == 0
    printed = capsys.readouterr().out
    assert [f for f in flags if f not in printed] == []


def test_eval_flags_are_checked_before_anything_runs(capsys):
    with pytest.raises(SystemExit, match="eval needs --init-from URL"):
        train.command_line(["eval", "--data.path", MISSING])
    with pytest.raises(SystemExit) as stopped:
        train.command_line(["eval", "--init-from=x", "--optim.no-such-flag", "1"])
    assert stopped.value.code == 2 and "--optim.no-such-flag" in capsys.readouterr().err


def test_a_run_saved_before_a_field_existed_resumes_with_its_default():
    # Run directories made before optim.optimizer and optim.lr_schedule existed trained with
    # AdamATan2 and the cosine schedule: the defaults, so no configuration change.
    from commands.restore import refuse_changed_config

    config = cli("--run.dir", "/tmp/never-written")
    saved = dataclasses.asdict(config)
    del saved["optim"]["optimizer"], saved["optim"]["lr_schedule"]
    refuse_changed_config(config, {"config": saved}, None)  # no error
    changed = dataclasses.replace(config, optim=dataclasses.replace(config.optim, optimizer="adamw"))
    with pytest.raises(ValueError, match="optim.optimizer: 'adam_atan2' in the run directory, 'adamw' now"):
        refuse_changed_config(changed, {"config": saved}, None)
