"""The virtual CPU mesh runs long sequences of programs without aborting in a collective.

An evaluation at K=16 trajectories on the default 8 CPU devices used to abort about 20 of its 38
batches in (`rendezvous.cc: Termination timeout for all reduce ... Expected 8 threads to join
the rendezvous, but only 6 of them arrived on time`): its host ran 32 programs ahead of the
devices, and the PJRT CPU client's pool of 8 threads then held a blocked dispatch task beside the
running program's tasks (sharding.size_cpu_client_pool says how, and how the pool is sized now).
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from model import TRM
from puzzles import builders
from tests.test_checkpoint import subprocess_env
from training import checkpoint
from training.config import PRESETS, PROJECT_DIR


@pytest.mark.parametrize("beside", ["alone", "beside a CPU-bound process"])
def test_an_evaluation_at_16_trajectories_of_the_whole_demo_test_set_on_8_devices_runs_to_its_end(
        tmp_path, beside):
    # The demo's whole test split (300 puzzles): 38 batches of 8 puzzles x 16 trajectories, 4 ACT
    # steps each, 152 programs with an all-reduce whose steps read no device value, so the host
    # runs ahead. Untrained weights: the abort does not depend on them, and no training is paid for.
    data_dir = tmp_path / "demo"
    builders.build_demo(str(data_dir), seed=0)
    config = dataclasses.replace(PRESETS["demo"][1].model, num_puzzle_identifiers=1)
    model_file = tmp_path / "model.safetensors"
    checkpoint.export_model(TRM(config).state_dict(), {"config": {"model": dataclasses.asdict(config)}, "step": 0},
                            str(model_file))
    busy = None
    if beside != "alone":
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # The runtime's own sizing is under test: no PJRT_NPROC from this session's environment.
        env = {k: v for k, v in subprocess_env().items() if k not in ("PJRT_NPROC", "NPROC")}
        proc = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "train.py"), "eval", "demo",
                               "--init-from", str(model_file), "--data.path", str(data_dir),
                               "--run.dir", str(tmp_path / "eval"), "--eval.trajectories", "16",
                               "--eval.noise", "0.1"],
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    # All 300 puzzles, in 38 batches (the abort exits with SIGABRT, rc -6, before the last).
    assert "on 300 examples" in proc.stdout and "eval batch 36/38" in proc.stdout, proc.stdout[-2000:]
    # The setting's result, written last (RUN/test-time/K16-noise0.1-D<halt_max_steps>/metrics.json).
    saved = list((tmp_path / "eval" / "test-time").glob("K16-noise0.1-D*/metrics.json"))
    assert len(saved) == 1, proc.stdout[-2000:]
    metrics = json.loads(saved[0].read_text())
    assert metrics["trajectories"] == 16 and metrics["num_puzzles"] == 300, metrics
