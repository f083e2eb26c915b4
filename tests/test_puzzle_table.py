"""The puzzle-embedding table split by rows over the mesh (run.shard_puzzle_table): the same
training, evaluation, checkpoints and exports as the replicated table, 1/N of it per device,
and checkpoints that resume on another number of devices."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch_xla
from safetensors.torch import load_file

import data
import sharding
import train
from commands.export import export
from commands.restore import load_initial_weights
from puzzles.build_arc import build_arc
from tests.data_fixtures import arc_files
from tests.test_train import run_in_fresh_process
from training import checkpoint
from training.config import check_against_dataset, parse_config
from training.trainer import TABLE, Trainer

# An ARC dataset of 10 identifiers: more rows than the 8 devices, not a multiple of them (XLA
# gives each device 2 rows, the last device none).
TINY = ["--model.hidden-size", "32", "--model.num-heads", "2", "--model.puzzle-emb-ndim", "32",
        "--model.H-cycles", "1", "--model.L-cycles", "1", "--model.L-layers", "1", "--model.halt-max-steps", "2",
        "--optim.global-batch-size", "16", "--optim.lr-warmup-steps", "1", "--eval.every-epochs", "100000",
        "--run.log-every", "1"]
FLOAT32 = ["--model.forward-dtype", "float32"]  # for comparisons across device counts


@pytest.fixture(scope="module")
def arc_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("arc_table")
    path = str(root / "arc")
    build_arc(path, arc_files(str(root)), subsets=("training", "evaluation"),
                         test_sets=("evaluation",), num_aug=3, seed=0)
    return path


def run_args(arc_path, run_dir, *extra):
    return ["arc1", "--data.path", arc_path, "--data.cache-dir", str(run_dir.parent / "cache"),
            "--run.dir", str(run_dir), *TINY, *extra]


@pytest.fixture(scope="module")
def split_run(arc_path, tmp_path_factory):
    """4 steps on 8 devices with the table split (the default), checkpoints at steps 2 and 4;
    float32, so that runs on other device counts can be compared closely."""
    run_dir = tmp_path_factory.mktemp("split") / "run"
    result = train.main(parse_config(run_args(arc_path, run_dir, "--optim.max-steps", "4", "--run.ckpt-every", "2",
                                           *FLOAT32)))
    return run_dir, result


def checkpoint_dir(run_dir) -> Path:
    """The newest committed checkpoint of a local run."""
    return Path(checkpoint.list_checkpoints(str(run_dir))[0][1])


def test_split_table_trains_evaluates_and_saves_like_the_replicated_table(arc_path, tmp_path):
    """In the preset's bfloat16, bitwise: every logged loss, the final evaluation (with ARC
    pass@k), every tensor of the final checkpoint and the exported model; the split table is
    saved as rows."""
    split_dir, replicated_dir = tmp_path / "split", tmp_path / "replicated"
    split = train.main(parse_config(run_args(arc_path, split_dir, "--optim.max-steps", "3")))
    replicated = train.main(parse_config(run_args(arc_path, replicated_dir, "--optim.max-steps", "3",
                                               "--run.no-shard-puzzle-table")))
    assert [h["loss"] for h in split["history"]] == [h["loss"] for h in replicated["history"]]
    assert split["final"] == replicated["final"] and split["final"]["count"] == 8
    split_state, _ = checkpoint.read_checkpoint(str(checkpoint_dir(split_dir)))
    replicated_state, _ = checkpoint.read_checkpoint(str(checkpoint_dir(replicated_dir)))
    assert split_state.keys() == replicated_state.keys()
    assert [k for k in split_state if not torch.equal(split_state[k], replicated_state[k])] == []
    table = split_state[TABLE]
    assert table.shape == (10, 32) and table.abs().sum() > 0  # SignSGD moved the rows of the batches' ids

    def table_entry(run_dir):
        [index_file] = checkpoint_dir(run_dir).glob("host_000-*.json")
        return json.loads(index_file.read_text())["tensors"][TABLE]
    assert table_entry(split_dir)["row_start"] == 0 and table_entry(split_dir)["rows"] == 10
    assert table_entry(replicated_dir)["row_start"] is None
    for run_dir in (split_dir, replicated_dir):
        export(str(run_dir), str(run_dir) + ".safetensors")
    exported = [load_file(str(d) + ".safetensors") for d in (split_dir, replicated_dir)]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])


def test_a_table_loaded_from_an_export_is_split_by_rows_on_the_devices(arc_path, split_run):
    """--run.init-from (an export, or the reference's checkpoint after conversion) puts the
    table on the devices split by rows: 2 rows per device, the whole table on the host again."""
    split_dir, _ = split_run
    exported = str(split_dir.parent / "init.safetensors")
    export(str(split_dir), exported)
    weights = load_file(exported)
    config = check_against_dataset(parse_config(run_args(arc_path, split_dir.parent / "unused", *FLOAT32)),
                                         data.open_dataset(arc_path, "train").metadata)
    trainer = Trainer(config, sharding, sharding.data_mesh(), load_initial_weights(exported, config.model))
    table = trainer.model.puzzle_embedding.weight
    assert torch_xla._XLAC._get_xla_sharding_spec(table).startswith("{devices=[8,1]")
    assert torch.equal(table.cpu(), weights["puzzle_embedding.weight"])
    _, rows = sharding.local_rows(table)
    assert torch.equal(rows, weights["puzzle_embedding.weight"])


@pytest.mark.parametrize("devices", [2, 1])
def test_a_checkpoint_saved_on_8_devices_resumes_on_fewer(arc_path, split_run, tmp_path, devices):
    """From the 8-device run's step-2 checkpoint, 2 devices and 1 device continue with the
    losses and final evaluation of the uninterrupted run (float32 here: a different device count
    adds in another order)."""
    split_dir, split = split_run
    run_dir = tmp_path / "run"
    shutil.copytree(split_dir, run_dir)
    shutil.rmtree(checkpoint_dir(run_dir))  # step 4: resume from step 2
    resumed, stdout = run_in_fresh_process(run_args(arc_path, run_dir, "--optim.max-steps", "4", *FLOAT32,
                                                    "--run.cpu-devices", str(devices)), cpu_devices=devices)
    assert "(step 2)" in stdout and f"{devices} devices on 1 host" in stdout
    expected = {h["step"]: h["loss"] for h in split["history"]}
    assert [h["step"] for h in resumed["history"]] == [3, 4]
    for h in resumed["history"]:
        assert h["loss"] == pytest.approx(expected[h["step"]], rel=1e-5)
    for key in ("lm_loss", "accuracy", "exact_accuracy", "q_halt_accuracy", "steps"):
        assert resumed["final"][key] == pytest.approx(split["final"][key], rel=1e-5, abs=1e-6), key
