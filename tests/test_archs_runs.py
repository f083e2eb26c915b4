"""Every architecture through the product as TRM goes through it (issue 36): sharded over the
8-device CPU mesh equals one device, a resume equals the uninterrupted run, the exported model
loads without torch_xla into its own architecture and evaluates as the run did, and predict
answers the test puzzles as the evaluation did. TRM's own tests of each are in test_train.py,
test_checkpoint.py and test_predict.py; these run the other five architectures. URM's training
with each of its optimizers, in its presets' bfloat16, is test_recipes_urm.py's (urm-arc1 and
urm-sudoku: AdamATan2; urm-arc2: Muon)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import data
import train
from commands import predict
from tests.test_predict import digits, write_demo_csv
from tests.test_train import run_in_fresh_process, tiny_args
from training.config import parse_config

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


DEMO_DEPTH = {"urm": ["--model.H-cycles", "2", "--model.L-cycles", "2", "--model.L-layers", "2",
                      "--model.halt-max-steps", "4"],
              "transformers_baseline": ["--model.H-layers", "2"]}
"""The archs whose own yaml is deeper than the demo's network, at the demo's depth here (what these
tests run is each arch's code through the product, not its depth): URM's yaml (H 4, L 3, 8
layers, 16 ACT steps) as the demo's cycles, layers and halting (conv_kernel 2, the puzzle
embedding on ceil(32/32) = 1 position); the baseline's 8 layers as 2 (the demo's L_layers)."""


@pytest.mark.parametrize("arch", ["trm_singlez", "trm_hier6", "hrm", "transformers_baseline", "urm"])
def test_each_arch_shards_resumes_exports_and_predicts_like_trm(demo_path, tmp_path, arch):
    # float32 (as test_train's sharded test: bf16 turns the partitioned program's 1e-6 rounding
    # into 1-ulp logit flips); 4 heads: the baseline's 12 would not divide the demo's width of 32.
    def args(name, steps, *extra):
        return tiny_args(demo_path, tmp_path / name, "--model.arch", arch, *DEMO_DEPTH.get(arch, []),
                         "--model.num-heads", "4",
                         "--model.forward-dtype", "float32", "--optim.max-steps", str(steps), "--run.log-every", "1",
                         "--eval.every-epochs", "1000", "--optim.lr-warmup-steps", "1", *extra)

    straight = train.main(parse_config(args("straight", 4)))
    losses = [h["loss"] for h in straight["history"]]
    assert len(losses) == 4 and straight["final"]["count"] == 40

    # Sharded over 8 devices equals one device (a process of its own: one CPU device). HRM over its
    # first step only: at initialisation its recursion is chaotic (a 1e-6 change of its carry grows
    # to 1e-4 after one ACT step, 1e-2 after two, 0.7 after three; TRM's: 5e-6, 3e-5, 2e-4: the
    # reference's HRM does the same, its forward equals ours bitwise, test_archs.py), and after the
    # first update its Q head's q_halt and q_continue are near ties that the partition's rounding flips.
    compared = 1 if arch == "hrm" else 4
    one_device, stdout = run_in_fresh_process(args("one", compared, "--run.cpu-devices", "1"), cpu_devices=1)
    assert "1 devices on 1 host(s)" in stdout
    for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4)):   # measured at most 3.2e-6 and 3.2e-5
        assert [h[key] for h in one_device["history"]] == pytest.approx(
            [h[key] for h in straight["history"][:compared]], rel=rel), key

    # Stopped after 2 steps and relaunched: the same losses and evaluation, bit for bit.
    first = train.main(parse_config(args("resumed", 2)))
    resumed = train.main(parse_config(args("resumed", 4)))
    assert resumed["start_step"] == 2
    assert [h["loss"] for h in first["history"] + resumed["history"]] == losses
    assert resumed["final"] == straight["final"]

    # Exported, loaded in a process without torch_xla into the architecture it names.
    run_dir, exported = tmp_path / "straight" / "run", str(tmp_path / "model.safetensors")
    assert train.command_line(["export", str(run_dir), "--out", exported]) == 0
    loader = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {PROJECT_DIR!r})
        import model
        from training import checkpoint
        weights, config, _ = checkpoint.read_exported({exported!r})
        net = model.TRM(model.TRMConfig(**config)); net.load_state_dict(weights)
        assert "torch_xla" not in sys.modules
        print("LOADED", net.config.arch, type(net.config.scheme).__name__)
    """)
    loaded = subprocess.run([sys.executable, "-c", loader], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split()[:2] == ["LOADED", arch], loaded.stdout

    # Zero steps from the exported (EMA) weights evaluate as the run's final evaluation did.
    fresh = train.main(parse_config(args("from-export", 0, "--run.init-from", exported)))
    for key in ("exact_accuracy", "accuracy", "q_halt_accuracy", "mean_halt_step"):
        assert fresh["final"][key] == pytest.approx(straight["final"][key], abs=1e-6), key

    # predict from the run directory: each test puzzle's answer, cell by cell as the evaluation counted.
    test_set = data.open_dataset(demo_path, "test")
    puzzles = tmp_path / "test.csv"
    write_demo_csv(test_set, puzzles)
    answered = predict.predict_command(["demo", "--init-from", str(run_dir), "--puzzle-file", str(puzzles)])
    assert len(answered["puzzles"]) == 40
    assert answered["exact_accuracy"] == pytest.approx(straight["final"]["exact_accuracy"])
    cells = [np.mean([a == b for a, b in zip(p["answer"], digits(labels))])
             for p, labels in zip(answered["puzzles"], test_set.labels)]
    assert np.mean(cells) == pytest.approx(straight["final"]["accuracy"], rel=1e-5)
