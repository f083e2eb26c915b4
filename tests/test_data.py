"""Tests of data.py and build_data.py: reading (local and a GCS emulator), batches, builders, errors,
the command line."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types

import fsspec
import fsspec.implementations.memory
import numpy as np
import pytest

import build_data
import data
from data import DatasetError, EvalBatches, TrainBatches, total_train_steps
from puzzles import arc, builders
from puzzles.build_arc import build_arc
from tests.data_fixtures import (
    ARC_EVALUATION,
    ARC_EVALUATION_SOLUTIONS,
    ARC_TRAINING,
    arc_files,
    example_index,
    is_solved_sudoku,
    maze_csv,
    sudoku_csv,
    write_synthetic,
)

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A synthetic dataset with puzzles of 1..4 examples (12 groups of 3 puzzles)."""
    root = str(tmp_path_factory.mktemp("synthetic"))
    write_synthetic(root)
    return data.open_dataset(root, "train")


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("demo"))
    builders.build_demo(root, train_puzzles=40, num_aug=7, test_puzzles=50, seed=3)
    return root


def _group_of(dataset, puzzles):
    return np.searchsorted(dataset.group_indices, puzzles, side="right") - 1


# ----------------------------------------------------------------------------- reading

def test_local_dataset_is_memory_mapped_in_place(demo_root):
    train, test = data.open_train_test(demo_root)
    assert isinstance(train.inputs, np.memmap)
    assert os.path.dirname(train.inputs.filename) == os.path.join(demo_root, "train")
    assert train.downloaded_bytes == 0
    assert (train.num_groups, train.num_puzzles, test.num_examples) == (40, 320, 50)
    assert train.metadata.seq_len == 16 and train.metadata.vocab_size == 6


def test_gcs_read_caches_once_and_matches_local(gcs_url, demo_root, tmp_path):
    builders.build_demo(gcs_url, train_puzzles=40, num_aug=7, test_puzzles=50, seed=3)
    cache = str(tmp_path / "cache")
    first = data.open_dataset(gcs_url, "train", cache_dir=cache)
    assert first.downloaded_bytes > 0
    assert os.path.dirname(first.inputs.filename) == os.path.join(cache, "train")
    again = data.open_dataset(gcs_url, "train", cache_dir=cache)
    assert again.downloaded_bytes == 0
    local = data.open_dataset(demo_root, "train")
    for name in data.ARRAY_NAMES:
        np.testing.assert_array_equal(getattr(again, name), getattr(local, name))
    # A replaced object (new generation, same size) is fetched again.
    fs = fsspec.filesystem("gs", token="anon")
    fs.pipe(f"{gcs_url}/train/all__labels.npy", fs.cat(f"{gcs_url}/train/all__labels.npy"))
    assert 0 < data.open_dataset(gcs_url, "train", cache_dir=cache).downloaded_bytes < \
        first.downloaded_bytes
    assert len([f for f in os.listdir(os.path.join(cache, "train")) if "labels" in f]) == 1
    assert data.read_identifiers(gcs_url) == ["<blank>"]


def _same_arrays(dataset, reference):
    for name in data.ARRAY_NAMES:
        np.testing.assert_array_equal(getattr(dataset, name), getattr(reference, name), err_msg=name)
    assert dataset.metadata == reference.metadata


def test_gcs_dataset_rebuilt_at_the_same_url_is_served_whole(gcs_url, tmp_path):
    cache = str(tmp_path / "cache")
    builders.build_demo(gcs_url, train_puzzles=20, num_aug=3, test_puzzles=10, seed=3)
    first = data.open_train_test(gcs_url, cache_dir=cache)
    builders.build_demo(gcs_url, train_puzzles=20, num_aug=3, test_puzzles=10, seed=4)  # same sizes
    builders.build_demo(str(tmp_path / "rebuilt"), train_puzzles=20, num_aug=3, test_puzzles=10, seed=4)
    for old, new, split in zip(first, data.open_train_test(gcs_url, cache_dir=cache), data.SPLITS):
        assert not np.array_equal(old.inputs, new.inputs)
        _same_arrays(new, data.open_dataset(str(tmp_path / "rebuilt"), split))
        assert new.downloaded_bytes == old.downloaded_bytes  # every file is a new object


def test_gcs_cache_removes_leftovers_of_killed_downloads(gcs_url, tmp_path):
    write_synthetic(gcs_url)
    cache = tmp_path / "cache"
    data.open_dataset(gcs_url, "train", cache_dir=str(cache))
    leftovers = [cache / "train" / ".all__inputs.npy.k1ll3d.part",  # a download killed with SIGKILL
                 cache / "train" / "all__labels.0123456789ab.npy"]  # an older cache layout's copy
    for path in leftovers:
        path.write_bytes(b"partial")
    again = data.open_dataset(gcs_url, "train", cache_dir=str(cache))
    assert again.downloaded_bytes == 0 and not any(path.exists() for path in leftovers)
    assert sorted(os.listdir(cache / "train")) == [".lock", "all__group_indices.npy", "all__inputs.npy",
                                                   "all__labels.npy", "all__puzzle_identifiers.npy",
                                                   "all__puzzle_indices.npy", "dataset.json", "manifest.json"]


def test_gcs_cached_file_written_to_is_fetched_again(gcs_url, tmp_path):
    """Bytes of a cached copy changed in place (same size) are noticed by the changed modification
    time: no checksum of the local copy is computed at open (a change that also restores the
    modification time would go unnoticed)."""
    write_synthetic(gcs_url)
    cache = str(tmp_path / "cache")
    first = data.open_dataset(gcs_url, "train", cache_dir=cache)
    expected = np.array(first.inputs)
    with open(first.inputs.filename, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x07\x07\x07")
    again = data.open_dataset(gcs_url, "train", cache_dir=cache)
    assert 0 < again.downloaded_bytes == os.path.getsize(first.inputs.filename)
    np.testing.assert_array_equal(again.inputs, expected)


def test_gcs_values_are_checked_once_per_cached_version(gcs_url, tmp_path, monkeypatch):
    checked = []
    real_check = data._check_values
    monkeypatch.setattr(data, "_check_values", lambda arrays, metadata, url: checked.append(url) or
                        real_check(arrays, metadata, url))
    cache = str(tmp_path / "cache")
    for seed in (0, 1):  # a second version at the same URL is checked again, once
        write_synthetic(gcs_url, seed=seed)  # (write_split checks the values it writes)
        checked.clear()
        for _ in range(3):
            data.open_dataset(gcs_url, "train", cache_dir=cache)
        assert checked == [f"{gcs_url}/train"]


class _RebuiltDuringCopy(fsspec.implementations.memory.MemoryFileSystem):
    """fsspec's in-memory file system, with a dataset rebuild landing right after the copy of
    one file: the race of a reader and a builder made deterministic."""

    protocol = "rebuilt-during-copy"
    rebuild = None

    def get_file(self, rpath, lpath, *args, **kwargs):
        super().get_file(rpath, lpath, *args, **kwargs)
        if rpath.endswith("all__labels.npy") and type(self).rebuild:
            rebuild, type(self).rebuild = type(self).rebuild, None
            rebuild()


def test_split_rebuilt_while_being_copied_is_not_served(tmp_path):
    fsspec.register_implementation(_RebuiltDuringCopy.protocol, _RebuiltDuringCopy, clobber=True)
    url = f"{_RebuiltDuringCopy.protocol}://{tmp_path.name}/dataset"
    cache = str(tmp_path / "cache")
    sizes = dict(train_puzzles=20, num_aug=3, test_puzzles=10)  # two builds with the same shapes
    builders.build_demo(url, seed=3, **sizes)
    _RebuiltDuringCopy.rebuild = lambda: builders.build_demo(url, seed=4, **sizes)
    with pytest.raises(DatasetError, match=r"train changed while it was being copied to .*cache/train "
                                           r"\(rebuilt or re-uploaded meanwhile\?\)"):
        data.open_dataset(url, "train", cache_dir=cache)
    builders.build_demo(str(tmp_path / "local"), seed=4, **sizes)
    _same_arrays(data.open_dataset(url, "train", cache_dir=cache), data.open_dataset(str(tmp_path / "local"), "train"))


# ----------------------------------------------------------------------------- training batches

@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_host_slices_concatenate_to_the_global_batch(synthetic, process_count):
    batch_size = 16
    full = TrainBatches(synthetic, batch_size, seed=5)
    hosts = [TrainBatches(synthetic, batch_size, seed=5, process_index=p,
                               process_count=process_count) for p in range(process_count)]
    for step in (0, 1, 7, 30):
        expected = full.batch(step)
        parts = [host.batch(step) for host in hosts]
        assert all(len(part["inputs"]) == batch_size // process_count for part in parts)
        for key in ("inputs", "labels", "puzzle_identifiers"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), expected[key])


def test_batch_contents_follow_the_plan(synthetic):
    batches = TrainBatches(synthetic, 16, seed=1)
    examples, puzzles = batches.global_plan(4)
    batch = batches.batch(4)
    np.testing.assert_array_equal(example_index(batch["inputs"]), examples)
    np.testing.assert_array_equal(batch["puzzle_identifiers"],
                                  synthetic.puzzle_identifiers[puzzles])
    raw = synthetic.labels[examples].astype(np.int32)
    assert (raw == 0).any()
    np.testing.assert_array_equal(batch["labels"], np.where(raw == 0, -100, raw))
    assert batch["inputs"].dtype == batch["labels"].dtype == np.int32


def test_same_seed_same_batches_any_access_order(synthetic):
    sequential = TrainBatches(synthetic, 16, seed=9)
    walked = [sequential.batch(step)["inputs"] for step in range(600)]
    resumed = TrainBatches(synthetic, 16, seed=9)  # a resumed run asks for step 555 first
    for step in (555, 300, 599, 0, 256):
        np.testing.assert_array_equal(resumed.batch(step)["inputs"], walked[step])
    other = TrainBatches(synthetic, 16, seed=10)
    assert not np.array_equal(other.batch(0)["inputs"], walked[0])


def test_reference_packing(synthetic):
    """Each batch is whole puzzles of consecutive draws, the last cut short; a puzzle's rows are
    distinct examples of that puzzle; every draw of the first epoch is a different group."""
    batches = TrainBatches(synthetic, 16, seed=2)
    sizes = np.diff(synthetic.puzzle_indices)
    draws = []
    for step in range(3):  # 3 * 16 rows cover the first epoch's 12 draws (at most 48 rows)
        examples, puzzles = batches.global_plan(step)
        runs = np.split(np.arange(16), np.flatnonzero(np.diff(puzzles)) + 1)
        for i, run in enumerate(runs):
            puzzle = puzzles[run[0]]
            assert len(run) == sizes[puzzle] or (i == len(runs) - 1 and len(run) < sizes[puzzle])
            start = synthetic.puzzle_indices[puzzle]
            assert sorted(examples[run] - start) == sorted(set(examples[run] - start))
            assert all(0 <= e - start < sizes[puzzle] for e in examples[run])
            draws.append(puzzle)
    first_epoch = _group_of(synthetic, np.array(draws[:12]))
    assert sorted(first_epoch) == list(range(12))


def test_every_group_once_per_epoch(demo_root):
    train = data.open_dataset(demo_root, "train")  # 40 groups of 8 one-example puzzles
    batches = TrainBatches(train, 8, seed=4)
    groups = [_group_of(train, batches.global_plan(step)[1]) for step in range(15)]
    for epoch in range(3):
        assert sorted(np.concatenate(groups[5 * epoch:5 * epoch + 5])) == list(range(40))
    assert not np.array_equal(np.concatenate(groups[:5]), np.concatenate(groups[5:10]))


def test_uniform_puzzle_sizes_shortcut_matches_replay(tmp_path):
    write_synthetic(str(tmp_path), sizes=(3, 3))
    dataset = data.open_dataset(str(tmp_path), "train")
    fast = TrainBatches(dataset, 16, seed=0)
    slow = TrainBatches(dataset, 16, seed=0)
    slow._draws_per_batch = None  # force the general replay of batch boundaries
    assert fast._draws_per_batch == 6
    for step in (0, 1, 2, 9, 40):
        np.testing.assert_array_equal(fast.global_plan(step)[0], slow.global_plan(step)[0])


def test_total_train_steps(demo_root):
    metadata = data.open_dataset(demo_root, "train").metadata
    assert total_train_steps(metadata, epochs=100, global_batch_size=16) == 250


# ----------------------------------------------------------------------------- evaluation batches

@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_eval_batches_in_order_padded(demo_root, process_count):
    test = data.open_dataset(demo_root, "test")  # 50 examples
    hosts = [EvalBatches(test, 16, p, process_count) for p in range(process_count)]
    assert len(hosts[0]) == 4
    rows = {key: np.concatenate([h.batch(i)[key] for i in range(4) for h in hosts])
            for key in ("inputs", "labels", "puzzle_identifiers")}
    valid = np.concatenate([h.valid(i) for i in range(4) for h in hosts])
    assert valid.sum() == 50 and valid[:50].all()
    np.testing.assert_array_equal(rows["inputs"][:50], test.inputs)
    assert (rows["inputs"][50:] == test.metadata.pad_id).all()
    assert (rows["labels"][50:] == -100).all()
    assert (rows["puzzle_identifiers"][50:] == test.metadata.blank_identifier_id).all()


def test_eval_cap_is_a_fixed_sorted_subset(synthetic):
    capped = EvalBatches(synthetic, 8, max_examples=20, seed=1)
    again = EvalBatches(synthetic, 8, max_examples=20, seed=1)
    assert capped.num_examples == 20 and len(capped) == 3
    np.testing.assert_array_equal(capped.examples, again.examples)
    assert np.all(np.diff(capped.examples) > 0)
    rows = np.concatenate([example_index(capped.batch(i)["inputs"]) for i in range(3)])
    np.testing.assert_array_equal(rows[:20], capped.examples)
    ids = np.concatenate([capped.batch(i)["puzzle_identifiers"] for i in range(3)])[:20]
    expected = np.searchsorted(synthetic.puzzle_indices, capped.examples, side="right")
    np.testing.assert_array_equal(ids, expected)  # identifiers are puzzle index + 1
    assert EvalBatches(synthetic, 8, max_examples=10**6).num_examples == synthetic.num_examples


# ----------------------------------------------------------------------------- builders

def test_demo_labels_are_the_unique_solutions(demo_root):
    solutions = builders.all_sudoku_4x4()
    assert len(solutions) == 288
    for split in data.SPLITS:
        dataset = data.open_dataset(demo_root, split)
        puzzles, labels = dataset.inputs.astype(int) - 1, dataset.labels.astype(int) - 1
        for puzzle, label in zip(puzzles, labels):
            assert is_solved_sudoku(label)
            givens = puzzle > 0
            assert np.array_equal(puzzle[givens], label[givens])
            assert np.sum(np.all(solutions[:, givens] == puzzle[givens], axis=1)) == 1
    train = {row.tobytes() for row in data.open_dataset(demo_root, "train").inputs}
    assert not train & {row.tobytes() for row in data.open_dataset(demo_root, "test").inputs}


def test_builders_are_reproducible(tmp_path, demo_root):
    builders.build_demo(str(tmp_path), train_puzzles=40, num_aug=7, test_puzzles=50, seed=3)
    for split in data.SPLITS:
        for name in data.ARRAY_NAMES:
            file = f"{split}/all__{name}.npy"
            with open(os.path.join(demo_root, file), "rb") as f:
                assert (tmp_path / file).read_bytes() == f.read()


def test_build_sudoku(tmp_path):
    train_csv = sudoku_csv(str(tmp_path / "train.csv"), 6, seed=0)
    test_csv = sudoku_csv(str(tmp_path / "test.csv"), 5, seed=1)
    out = str(tmp_path / "sudoku")
    builders.build_sudoku(out, train_csv, test_csv, subsample_size=3, min_difficulty=1, num_aug=4,
                            seed=0)
    train, test = data.open_train_test(out)
    assert (train.num_groups, train.num_puzzles, test.num_examples) == (3, 15, 4)
    assert train.metadata.vocab_size == 11 and train.metadata.seq_len == 81
    originals = train.inputs[train.puzzle_indices[train.group_indices[:-1]]]
    for puzzle, label in zip(train.inputs.astype(int) - 1, train.labels.astype(int) - 1):
        assert is_solved_sudoku(label)
        givens = puzzle > 0
        assert np.array_equal(puzzle[givens], label[givens]) and givens.sum() == 36
    assert len({row.tobytes() for row in train.inputs}) == 15  # the variants differ
    assert len({row.tobytes() for row in originals}) == 3


def test_build_maze(tmp_path):
    out = str(tmp_path / "maze")
    builders.build_maze(out, maze_csv(str(tmp_path / "tr.csv"), 3),
                          maze_csv(str(tmp_path / "te.csv"), 2),
                          aug=True)
    train, test = data.open_train_test(out)
    assert (train.num_groups, train.num_puzzles, test.num_puzzles) == (3, 24, 2)
    assert train.metadata.vocab_size == 6 and train.metadata.seq_len == 16
    first = train.inputs[0].reshape(4, 4)
    assert first[0, 0] == 1 + "# SGo".index("S")
    variants = {train.inputs[i].tobytes() for i in range(8)}
    assert variants == {arc.dihedral_transform(first, t).tobytes() for t in range(8)}


@pytest.mark.parametrize("transform_id", range(8))
def test_arc_augmentation_inverts(transform_id):
    rng = np.random.default_rng(transform_id)
    grid = rng.integers(0, 10, size=(3, 5)).astype(np.uint8)
    colour_map = np.concatenate([[0], rng.permutation(9) + 1])
    augmented = arc.augment_arc_grid(grid, transform_id, colour_map)
    name = arc.arc_identifier("abc", transform_id, colour_map)
    task, parsed_transform, parsed_colours = arc.parse_arc_identifier(name)
    assert (task, parsed_transform) == ("abc", transform_id)
    np.testing.assert_array_equal(
        arc.invert_arc_augmentation(augmented, parsed_transform, parsed_colours), grid)
    if transform_id == 1:  # numbering as the reference: 1 is a 90-degree rotation
        np.testing.assert_array_equal(augmented, np.rot90(colour_map[grid]))


def test_build_arc(tmp_path):
    out = str(tmp_path / "arc")
    build_arc(out, arc_files(str(tmp_path)), subsets=["training", "evaluation"],
                         test_sets=["evaluation"], num_aug=6, seed=0)
    train, test = data.open_train_test(out)
    names = data.read_identifiers(out)
    # task_blank keeps no augmentation (all are duplicates); the others keep 6 each.
    assert train.num_groups == 3 and train.num_puzzles == 1 + 7 + 7
    assert test.num_groups == 1 and test.num_puzzles == 7 and test.num_examples == 14
    assert len(names) == 1 + 15 and train.metadata.num_puzzle_identifiers == 16
    assert train.metadata.seq_len == 900 and train.metadata.vocab_size == 12
    # Test inputs decode and invert back to the original grids, in every variant.
    originals = [np.array(t["input"]) for t in ARC_EVALUATION["task_e"]["test"]]
    for puzzle in range(test.num_puzzles):
        task, transform_id, colours = arc.parse_arc_identifier(
            names[test.puzzle_identifiers[puzzle]])
        assert task == "task_e"
        for k, example in enumerate(range(test.puzzle_indices[puzzle],
                                          test.puzzle_indices[puzzle + 1])):
            grid = arc.decode_arc_grid(test.inputs[example])
            np.testing.assert_array_equal(
                arc.invert_arc_augmentation(grid, transform_id, colours), originals[k])
            label = arc.invert_arc_augmentation(arc.decode_arc_grid(test.labels[example]),
                                                transform_id, colours)
            np.testing.assert_array_equal(label, ARC_EVALUATION_SOLUTIONS["task_e"][k])
    # Train examples may be shifted on the canvas; their colour cells still invert.
    task_a = ARC_TRAINING["task_a"]
    pairs = task_a["train"] + [{"input": task_a["test"][0]["input"]}]
    task_a_ids = [i for i, name in enumerate(names) if name.startswith("task_a")]
    assert len(task_a_ids) == 7
    for identifier in task_a_ids:
        puzzle = int(np.flatnonzero(train.puzzle_identifiers == identifier)[0])
        _, transform_id, colours = arc.parse_arc_identifier(names[identifier])
        start = train.puzzle_indices[puzzle]
        assert train.puzzle_indices[puzzle + 1] - start == 3  # 2 train pairs + the test pair
        for example, pair in zip(range(start, start + 3), pairs):
            canvas = train.inputs[example].reshape(30, 30)
            rows, cols = np.nonzero(canvas >= 2)
            grid = canvas[rows.min():rows.max() + 1, cols.min():cols.max() + 1] - 2
            np.testing.assert_array_equal(
                arc.invert_arc_augmentation(grid, transform_id, colours), pair["input"])
    with open(os.path.join(out, "test_puzzles.json")) as f:
        assert list(json.load(f)) == ["task_e"]


# ----------------------------------------------------------------------------- errors

def test_error_root_and_split_missing(tmp_path, demo_root, gcs_url):
    with pytest.raises(DatasetError, match="does not exist"):
        data.open_dataset(str(tmp_path / "nowhere"), "train")
    with pytest.raises(DatasetError, match="does not exist"):
        data.open_dataset(gcs_url, "train")
    with pytest.raises(DatasetError, match="does not exist"):
        data.open_dataset("gs://no-such-bucket/x", "train")
    root = shutil.copytree(demo_root, tmp_path / "d")
    shutil.rmtree(root / "test")
    with pytest.raises(DatasetError, match=r"split .*/test is missing"):
        data.open_dataset(str(root), "test")


def test_error_dataset_json(tmp_path, demo_root):
    root = shutil.copytree(demo_root, tmp_path / "d")
    description = root / "train" / "dataset.json"
    good = json.loads(description.read_text())
    description.write_text("{not json")
    with pytest.raises(DatasetError, match=r"dataset.json is not valid JSON"):
        data.open_dataset(str(root), "train")
    description.write_text(json.dumps({k: v for k, v in good.items() if k != "seq_len"}))
    with pytest.raises(DatasetError, match=r"lacks the field\(s\) \['seq_len'\]"):
        data.open_dataset(str(root), "train")
    description.write_text(json.dumps({**good, "vocab_size": "six"}))
    with pytest.raises(DatasetError, match="'vocab_size' has the invalid value 'six'"):
        data.open_dataset(str(root), "train")
    description.unlink()
    with pytest.raises(DatasetError, match=r"train/dataset.json is missing"):
        data.open_dataset(str(root), "train")


def test_error_arrays(tmp_path, demo_root):
    root = shutil.copytree(demo_root, tmp_path / "d")
    labels = root / "train" / "all__labels.npy"
    original = np.load(labels)
    np.save(labels, original[:-1])
    with pytest.raises(DatasetError, match=r"all__labels.npy has shape \(319, 16\), expected"):
        data.open_dataset(str(root), "train")
    np.save(labels, original.astype(np.float32))
    with pytest.raises(DatasetError, match="all__labels.npy has dtype float32"):
        data.open_dataset(str(root), "train")
    labels.write_bytes(b"garbage")
    with pytest.raises(DatasetError, match="all__labels.npy is not a readable .npy"):
        data.open_dataset(str(root), "train")
    labels.unlink()
    with pytest.raises(DatasetError, match="all__labels.npy is missing"):
        data.open_dataset(str(root), "train")
    np.save(root / "test" / "all__puzzle_indices.npy", np.arange(52))
    with pytest.raises(DatasetError, match="puzzle_indices.npy must rise strictly from 0 to 50"):
        data.open_dataset(str(root), "test")


def _set(path, index, value):
    """Write ``value`` at ``index`` of the .npy file at ``path`` (in place, dtype kept)."""
    array = np.load(path)
    array[index] = value
    np.save(path, array)


def _edit_json(path, **fields):
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **fields)))


def test_error_tokens_labels_identifiers_out_of_range(tmp_path, demo_root, monkeypatch):
    """Values the model's tables have no row for are refused when the split is opened, naming the
    array, the value and its first position; the scan is chunked (here 5 rows per chunk)."""
    monkeypatch.setattr(data, "_CHECK_CHUNK_BYTES", 5 * 16)
    root = shutil.copytree(demo_root, tmp_path / "d")
    split = root / "train"
    _set(split / "all__inputs.npy", (13, 5), 200)
    _set(split / "all__inputs.npy", (17, 0), 201)
    with pytest.raises(DatasetError, match=r"d/train/all__inputs.npy holds the value 200 \(first at row 13, "
                                           r"position 5\), outside 0..5 \(vocab_size 6 in .*d/train/dataset.json\). "
                                           r"Rebuild the dataset, or correct vocab_size in dataset.json"):
        data.open_dataset(str(root), "train")
    shutil.copy(os.path.join(demo_root, "train", "all__inputs.npy"), split / "all__inputs.npy")
    _set(split / "all__labels.npy", (301, 15), 99)
    with pytest.raises(DatasetError, match=r"all__labels.npy holds the value 99 \(first at row 301, position 15\), "
                                           r"outside 0..5 \(vocab_size 6 in .*; ignore_label_id 0 is allowed too\)"):
        data.open_dataset(str(root), "train")
    # An ignore label outside the vocabulary is allowed in labels (and only there).
    _edit_json(split / "dataset.json", ignore_label_id=99)
    assert data.open_dataset(str(root), "train").labels[301, 15] == 99
    _set(split / "all__labels.npy", (302, 0), 98)
    with pytest.raises(DatasetError, match=r"all__labels.npy holds the value 98 \(first at row 302, position 0\)"):
        data.open_dataset(str(root), "train")
    shutil.copy(os.path.join(demo_root, "train", "all__labels.npy"), split / "all__labels.npy")
    _set(split / "all__puzzle_identifiers.npy", 7, 5000)
    with pytest.raises(DatasetError, match=r"all__puzzle_identifiers.npy holds the value 5000 \(first at index 7\), "
                                           r"outside 0..0 \(num_puzzle_identifiers 1 in "):
        data.open_dataset(str(root), "train")


def test_error_pad_and_blank_ids_out_of_range(tmp_path, demo_root):
    root = shutil.copytree(demo_root, tmp_path / "d")
    description = root / "test" / "dataset.json"
    _edit_json(description, pad_id=6)
    with pytest.raises(DatasetError, match=r"test/dataset.json: pad_id 6 is outside 0..5 \(vocab_size 6\); rebuild"):
        data.open_dataset(str(root), "test")
    _edit_json(description, pad_id=0, blank_identifier_id=1)
    with pytest.raises(DatasetError, match=r"blank_identifier_id 1 is outside 0..0 \(num_puzzle_identifiers 1\)"):
        data.open_dataset(str(root), "test")
    metadata = data.read_metadata(demo_root, "test")
    bad = dataclasses.replace(metadata, pad_id=6)
    with pytest.raises(DatasetError, match="pad_id 6 is outside"):  # builders are held to the same rules
        data.write_split(str(tmp_path / "new"), "test", bad, {
            name: getattr(data.open_dataset(demo_root, "test"), name) for name in data.ARRAY_NAMES})


def test_train_refuses_a_bad_dataset_before_the_runtime_starts(tmp_path, demo_root):
    root = shutil.copytree(demo_root, tmp_path / "d")
    _set(root / "test" / "all__inputs.npy", (2, 3), 200)
    proc = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "train.py"), "demo", "--data.path", str(root),
                           "--run.dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "TRM on" not in proc.stdout
    assert proc.stderr.startswith(f"error: {root}/test/all__inputs.npy holds the value 200 (first at row 2, "
                                  "position 3)"), proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "run")


def test_error_missing_array_on_gcs(gcs_url, tmp_path):
    write_synthetic(gcs_url)
    fsspec.filesystem("gs", token="anon").rm(f"{gcs_url}/train/all__group_indices.npy")
    with pytest.raises(DatasetError, match=r"gs://.*/train/all__group_indices.npy is missing"):
        data.open_dataset(gcs_url, "train", cache_dir=str(tmp_path))


def test_error_splits_disagree(tmp_path):
    write_synthetic(str(tmp_path), split_seq_len={"test": 9})
    with pytest.raises(DatasetError, match="disagree on seq_len: train has 8, test has 9"):
        data.open_train_test(str(tmp_path))


def test_error_bad_batch_arguments(synthetic):
    with pytest.raises(DatasetError, match="global_batch_size 10 must be a positive multiple of "
                                           "process_count 4"):
        TrainBatches(synthetic, 10, seed=0, process_index=0, process_count=4)
    with pytest.raises(DatasetError, match="process_index 4 must lie in 0..3"):
        EvalBatches(synthetic, 8, process_index=4, process_count=4)


def test_error_unreachable_storage(monkeypatch, gcs_server):
    import gcsfs.retry

    async def no_wait(_seconds):
        return None

    # gcsfs retries with exponential backoff (about 30 s); skip the waiting.
    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=no_wait))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(DatasetError, match=r"Cannot access gs://.*cannot be reached.*"
                                           "STORAGE_EMULATOR_HOST"):
        data.open_dataset(f"gs://{gcs_server}/anything", "train")


class _FailingFileSystem(fsspec.AbstractFileSystem):
    """A file system whose every access raises ``error``, as real GCS does without access."""

    protocol = "failing"
    error = None

    def _open(self, path, mode="rb", **kwargs):
        raise self.error

    def info(self, path, **kwargs):
        raise self.error

    def exists(self, path, **kwargs):
        raise self.error


def _credential_errors():
    import google.auth.exceptions
    from gcsfs.retry import HttpError
    return [
        (google.auth.exceptions.DefaultCredentialsError("Your default credentials were not "
                                                        "found"), "no valid Google Cloud "
                                                                  "credentials.*gcloud auth"),
        (HttpError({"code": 401, "message": "Anonymous caller does not have access"}),
         "no valid Google Cloud credentials"),
        (OSError("Forbidden: bucket/x\nno storage.objects.get access"),
         "access denied.*roles/storage.objectViewer"),
    ]


@pytest.mark.parametrize("case", range(3))
def test_error_credentials(monkeypatch, case):
    error, message = _credential_errors()[case]
    fsspec.register_implementation("failing", _FailingFileSystem, clobber=True)
    monkeypatch.setattr(_FailingFileSystem, "error", error)
    with pytest.raises(DatasetError, match=f"(?s)Cannot access failing://bucket/x.*{message}"):
        data.open_dataset("failing://bucket/x", "train")


# ----------------------------------------------------------------------------- command line

def test_cli_help_and_info(demo_root, capsys):
    result = subprocess.run([sys.executable, build_data.__file__, "--help"], capture_output=True,
                            text=True, check=True)
    for command in ("build-sudoku", "build-maze", "build-arc", "build-demo", "info", "bench"):
        assert command in result.stdout
    build_data.main(["info", demo_root])
    printed = capsys.readouterr().out
    assert '"total_groups": 40' in printed and "(320, 16)" in printed and "label:" in printed
    build_data.main(["bench", demo_root, "--global-batch-size", "16", "--steps", "5"])
    assert "rows/s per host" in capsys.readouterr().out
