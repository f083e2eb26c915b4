"""Real slices list their devices in other orders than the CPU mesh: on a v5litepod-16, host 0
owns device ids 0, 1, 4, 5, and a host's slice of each batch lands on its own devices in its
runtime's order, wherever the mesh puts them. These tests play such layouts
(sharding.DeviceLayout; SIMULATED_DEVICES_ENV for the simulated slices) and show that batches,
checkpoint shares of the carry and the split puzzle table, a resume on another layout and the
final evaluation are the contiguous layout's, and that the start-up self-check stops a run whose
mesh is not in host order."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import sharding
from tests.data_fixtures import write_synthetic
from tests.ports import free_port
from training import checkpoint

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTIGUOUS, INTERLEAVED, REVERSED = "0,1,2,3|4,5,6,7", "0,1,4,5|2,3,6,7", "4,5,6,7|0,1,2,3"

# One process with 16 virtual devices plays every host of a v4-32 (4 hosts, ids in host order), of
# a v5litepod-16 (ids follow chip coordinates) and of a v4-32 whose hosts come in reverse order.
LAYOUTS_16 = {"v4-32": "0,1,2,3|4,5,6,7|8,9,10,11|12,13,14,15",
              "v5litepod-16": "0,1,4,5|2,3,6,7|8,9,12,13|10,11,14,15",
              "v4-32 reversed": "12,13,14,15|8,9,10,11|4,5,6,7|0,1,2,3"}
PLACEMENT_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {project!r})
    import torch, torch_xla
    import sharding
    sharding.init_spmd()
    out = {{}}
    rows = torch.arange(48, dtype=torch.int32)[:, None] * 10  # 3 rows per device; row r holds 10 r
    table = torch.arange(37 * 2, dtype=torch.float32).reshape(37, 2)  # uneven: 3 rows per device, 1 on the last
    # The emulated upload of one host's rows equals the runtime's own minibatch upload (a host
    # that owns every device, under a mesh in another order than its devices: chunk i goes to
    # device i wherever the mesh puts it, so the rows leave their places).
    permuted = sharding.DeviceLayout.parse({interleaved!r})
    mesh = sharding.data_mesh(permuted)
    spec = sharding._input_spec(mesh, 2).xla_spec(rows)
    runtime = torch_xla._XLAC._xla_tensors_from_aten([rows], [str(sharding.device())], [spec])[0].cpu()
    one_host = sharding.DeviceLayout((tuple(range(16)),))
    out["emulation equals the runtime"] = sharding._place_like_the_runtime(rows, mesh, one_host).cpu().equal(runtime)
    out["runtime upload under a mesh not in host order moves rows"] = not runtime.equal(rows)
    for name, text in {layouts!r}.items():
        layout = sharding.DeviceLayout.parse(text)
        for mesh_name, mesh in (("host order", sharding.data_mesh(layout)),
                                ("arange", sharding.data_mesh(sharding.DeviceLayout.contiguous(16, 1)))):
            placed = sharding._place_like_the_runtime(rows, mesh, layout)
            split_table = sharding.rows_to_device(table, mesh)
            record = {{"in place": placed.cpu().equal(rows), "hosts": []}}
            for host in range(4):
                try:
                    start, got = sharding.host_rows(placed, host, layout)
                    table_start, table_rows = sharding.host_rows(split_table, host, layout)
                    lo, hi = layout.row_block(37, host)
                    record["hosts"].append([start, got[:, 0].tolist(), table_start, table_rows.equal(table[lo:hi])])
                except RuntimeError as e:
                    record["hosts"].append(str(e))
            out[name + " / " + mesh_name] = record
    print("RESULT" + json.dumps(out))
""")


def test_device_order_of_real_slices_places_and_reads_every_hosts_rows():
    script = PLACEMENT_SCRIPT.format(project=PROJECT_DIR, interleaved=LAYOUTS_16["v5litepod-16"], layouts=LAYOUTS_16)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="16"))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("RESULT")[1])
    assert out["emulation equals the runtime"] and out["runtime upload under a mesh not in host order moves rows"]
    for name in LAYOUTS_16:
        # In host order every host's 12 rows land on its own devices, at their own global rows;
        # its devices hold its block of the puzzle table (37 rows: blocks of 12, 12, 12, 1).
        record = out[f"{name} / host order"]
        assert record["in place"], name
        assert record["hosts"] == [[12 * h, [10 * r for r in range(12 * h, 12 * h + 12)], min(37, 12 * h), True]
                                   for h in range(4)], name
    # With today's arange mesh the rows of a host land elsewhere: non-consecutive rows on the
    # v5litepod-16, another host's rows with reversed hosts; host_rows says so instead of saving them.
    assert not out["v5litepod-16 / arange"]["in place"]
    assert "are not consecutive" in out["v5litepod-16 / arange"]["hosts"][0]
    assert not out["v4-32 reversed / arange"]["in place"]
    assert "not its block [0, 12)" in out["v4-32 reversed / arange"]["hosts"][0]
    assert out["v4-32 / arange"]["in place"]  # contiguous ids: arange is host order


def test_device_layout_parses_checks_and_maps_rows():
    layout = sharding.DeviceLayout.parse(INTERLEAVED)
    assert layout.hosts == ((0, 1, 4, 5), (2, 3, 6, 7)) and str(layout) == "0,1,4,5 | 2,3,6,7"
    assert layout.mesh_order() == [0, 1, 4, 5, 2, 3, 6, 7] and layout.positions(1) == (4, 8)
    assert [layout.row_block(37, h) for h in (0, 1)] == [(0, 20), (20, 37)]  # 5 rows per device
    assert layout.problems(8) == []
    assert "not each of the ids 0..7 once" in sharding.DeviceLayout.parse("0,1,2,3|3,4,5,6").problems(8)[0]
    assert "different numbers of devices" in sharding.DeviceLayout.parse("0,1,2|3,4,5,6,7").problems(8)[0]
    with pytest.raises(ValueError, match="expected ids per host"):
        sharding.DeviceLayout.parse("0,1;2,3")


# -- whole runs on simulated two-host slices whose hosts own devices in other orders -------------


def run_args(data_path, run_dir, *extra):
    return ["demo", "--data.path", str(data_path), "--run.dir", str(run_dir), "--model.seq-len", "8",
            "--model.vocab-size", "256", "--model.hidden-size", "32", "--model.puzzle-emb-ndim", "32",
            "--optim.global-batch-size", "32", "--eval.every-epochs", "1000", "--run.log-every", "1",
            "--optim.max-steps", "4", "--run.ckpt-every", "2", "--model.forward-dtype", "float32", *extra]


def simulated_slice(args, layout: str, fault: str = ""):
    """train.py's command line on two processes playing hosts 0 and 1 of a slice whose hosts own
    the devices `layout` says; (exit codes, outputs)."""
    from tests.test_faults import train_process

    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [train_process(args, fault, env={sharding.SIMULATED_SLICE_ENV: f"{rank}/2@{address}",
                                             sharding.SIMULATED_DEVICES_ENV: layout}) for rank in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    return [p.returncode for p in procs], outputs


def results(run_dir):
    """(train records, final evaluation, every tensor of the final checkpoint) of a run."""
    records = [json.loads(line) for part in sorted((run_dir / "metrics").glob("part-*.jsonl"))
               for line in part.read_text().splitlines()]
    train = [{k: r[k] for k in ("step", "loss", "lm_loss", "q_halt_loss", "accuracy", "grad_norm")}
             for r in records if r["kind"] == "train"]
    final = json.loads((run_dir / "eval" / "step_4" / "metrics.json").read_text())
    tensors, _ = checkpoint.read_checkpoint(checkpoint.step_dir(str(run_dir), 4))
    return train, final, tensors


@pytest.fixture(scope="module")
def puzzles(tmp_path_factory):
    """37 puzzle identifiers: more than the 8 devices, so the puzzle table is split by rows."""
    path = tmp_path_factory.mktemp("device-order-data") / "data"
    write_synthetic(str(path), num_groups=12, puzzles_per_group=3, sizes=(2, 3))
    return path


@pytest.fixture(scope="module")
def contiguous_run(puzzles, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("contiguous") / "run"
    codes, outputs = simulated_slice(run_args(puzzles, run_dir), CONTIGUOUS)
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert "device layout (host order): 0,1,2,3 | 4,5,6,7;" in outputs[0][0]
    return run_dir


def assert_same_run(run_dir, reference):
    """The same run up to the order in which devices add across the mesh: another layout puts
    other devices at the mesh's positions, and XLA sums their gradients and losses in another
    order (float32; one layout run twice is bitwise the same). Measured: records within 2e-6,
    tensors within 1.3e-4 of their largest value (the carry, after 21 network applications). A
    row on the wrong host or device changes losses, evaluation and carry rows entirely."""
    train, final, tensors = results(run_dir)
    want_train, want_final, want_tensors = results(reference)
    assert [r["step"] for r in train] == [r["step"] for r in want_train] == [1, 2, 3, 4]
    for got, want in zip(train, want_train):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert {k: v for k, v in final.items() if k != "step"} == pytest.approx(
        {k: v for k, v in want_final.items() if k != "step"}, rel=1e-5, abs=1e-7)
    assert sorted(tensors) == sorted(want_tensors)
    for name, tensor in tensors.items():
        want = want_tensors[name].double()
        assert tensor.shape == want.shape and tensor.dtype == want_tensors[name].dtype, name
        worst = (tensor.double() - want).abs().max().item()
        assert worst <= 1e-3 * want.abs().max().item() + 1e-9, (name, worst)


def test_device_order_interleaved_hosts_train_save_and_evaluate_as_contiguous_ones(puzzles, contiguous_run,
                                                                                   tmp_path):
    run_dir = tmp_path / "run"
    codes, outputs = simulated_slice(run_args(puzzles, run_dir), INTERLEAVED)
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert "device layout (host order): 0,1,4,5 | 2,3,6,7; each host's rows land on its own devices" in outputs[0][0]
    assert_same_run(run_dir, contiguous_run)
    # Each host saved its own rows of the carry and of the split table: host 0 the first half.
    step_dir = run_dir / "checkpoints" / "step_00000004"
    attempt = json.loads((step_dir / "COMMITTED").read_text())["attempt"]
    for host, (carry_rows, table_rows) in enumerate((((0, 16), (0, 20)), ((16, 32), (20, 37)))):
        _, _, tensors = checkpoint.read_index(str(step_dir), host, attempt)
        for name, (start, stop) in (("carry/steps", carry_rows), ("model/puzzle_embedding.weight", table_rows)):
            saved = tensors[name]
            assert (saved["row_start"], saved["row_start"] + saved["rows"]) == (start, stop), (host, name)


def test_device_order_a_checkpoint_resumes_on_a_slice_whose_hosts_come_in_reverse(puzzles, contiguous_run, tmp_path):
    # Saved at step 2 by hosts owning interleaved devices, resumed by hosts in reverse order (a
    # new slice after a preemption may list its devices otherwise): the run of the contiguous slice.
    run_dir = tmp_path / "run"
    codes, outputs = simulated_slice(run_args(puzzles, run_dir, "--optim.max-steps", "2"), INTERLEAVED)
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    shutil.rmtree(run_dir / "eval")
    codes, outputs = simulated_slice(run_args(puzzles, run_dir), REVERSED)
    assert codes == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert "resuming from" in outputs[0][0] and "(step 2)" in outputs[0][0]
    assert "device layout (host order): 4,5,6,7 | 0,1,2,3;" in outputs[0][0]
    assert_same_run(run_dir, contiguous_run)


def test_device_order_self_check_stops_every_host_when_the_mesh_is_not_in_host_order(puzzles, tmp_path):
    # Today's mesh (ids 0..7 in order) on hosts that own interleaved devices.
    fault = """
        import sharding
        sharding.DeviceLayout.mesh_order = lambda self: list(range(8))
    """
    codes, outputs = simulated_slice(run_args(puzzles, tmp_path / "run"), INTERLEAVED, fault)
    assert codes == [1, 1]
    for out, err in outputs:
        assert "error: the rows each host uploads do not land on its own devices" in err
        assert "(device layout 0,1,4,5 | 2,3,6,7; mesh order 0,1,2,3,4,5,6,7)" in err
        assert "host 0 (devices 0,1,4,5): sent rows 0..7" in err and "host 1 (devices 2,3,6,7)" in err
        assert "nothing was trained" in err and "Traceback" not in err
        assert not [line for line in out.splitlines() if line.startswith("step ")]


def test_local_copy_refuses_a_tensor_that_every_host_would_have_to_read(spmd_mesh):
    # .cpu() of a split tensor runs a program on every device of the slice: one host reading it
    # alone (a checkpoint share) would hang there. A replicated tensor is read from a local device.
    rows = torch.arange(16.0).reshape(8, 2)
    split = sharding.shard_batch_dim(rows.to(sharding.device()), spmd_mesh)
    sharding.sync()
    with pytest.raises(ValueError, match=r"local_copy of a tensor sharded as \{devices=\[8,1\]"):
        sharding.local_copy(split)
    replicated = sharding.replicate(rows.to(sharding.device()), spmd_mesh)
    sharding.sync()
    assert torch.equal(sharding.local_copy(replicated), rows)
    assert sharding.local_rows(split)[1].equal(rows)  # a split tensor's rows: local_rows
