"""TRM datasets: the reference format via fsspec (local or gs://) and its local cache (data.py
plans and reads the batches).

A dataset root (a local path or any fsspec URL such as ``gs://bucket/data/sudoku``) holds the
format of the reference implementation (SamsungSAILMontreal/TinyRecursiveModels):

    {root}/identifiers.json                 list: puzzle identifier -> name, 0 is "<blank>"
    {root}/{train,test}/dataset.json        Metadata below
    {root}/{train,test}/all__inputs.npy     integer [examples, seq_len] (uint8 in practice)
    {root}/{train,test}/all__labels.npy     integer [examples, seq_len]
    {root}/{train,test}/all__puzzle_identifiers.npy  int32 [puzzles]
    {root}/{train,test}/all__puzzle_indices.npy      int32 [puzzles + 1], example offsets
    {root}/{train,test}/all__group_indices.npy       int32 [groups + 1], puzzle offsets
    {root}/test_puzzles.json                ARC only: the raw test tasks, for the evaluator

A puzzle is one or more examples sharing a puzzle identifier; a group is a puzzle and its
augmentations.

Reading
    open_dataset(url, split, cache_dir=None) -> Dataset
    open_train_test(url, cache_dir=None) -> (Dataset, Dataset)   # also checks they agree
    read_metadata(url, split) -> Metadata
    read_identifiers(url) -> list[str]; identifiers_fingerprint(url) -> str | None
Remote arrays are copied once to ``cache_dir`` (default ``~/.cache/trm-data/<hash of url>``) and
memory-mapped; a local root is memory-mapped in place. The cache holds one version of each split:
a file is fetched again when its remote version (GCS generation, etag, md5) or the cached copy
(size, modification time) changed, and never served with files of another build. Token, label
and identifier values are checked once per cached version (at every open of a local split).
Every problem raises DatasetError.

Writing (the builders in build_data.py and puzzles/build_arc.py use these; storage problems raise
storage.StorageError)
    SplitAccumulator(seq_len, workdir, split).add_group(...).write(url, split, ...)
    write_split(url, split, metadata, arrays), write_identifiers(url, names)

This module imports numpy, fsspec (through rundir/storage.py) and the standard library only (never
torch or torch_xla).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from rundir.storage import access_errors, filesystem, is_local, join_url, read_json, write_bytes, write_file

IGNORE_LABEL_ID = -100
"""The label of a position without a target: what labels equal to metadata.ignore_label_id become
in batches (the reference's models/losses.py value). The loss, the metrics and the halting
histogram skip it: model.py states the same value (it imports no data.py; tests/test_layout.py
checks the two agree)."""
SET_NAME = "all"  # the only set name the reference builders write
SPLITS = ("train", "test")
ARRAY_NAMES = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")
DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "trm-data")


class DatasetError(ValueError):
    """A dataset cannot be read or built; the message names the path and what to do."""



# --------------------------------------------------------------------------------------------
# Metadata and reading
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Metadata:
    """The contents of a split's dataset.json (same fields as the reference)."""

    pad_id: int
    """Token that fills unused input positions."""
    ignore_label_id: int | None
    """Label value that carries no loss (becomes -100 in batches); None if every label counts."""
    blank_identifier_id: int
    """Puzzle identifier of padding rows."""
    vocab_size: int
    """Number of token values, pad included."""
    seq_len: int
    """Tokens per example."""
    num_puzzle_identifiers: int
    """Rows of the puzzle-embedding table (identifiers are 0 .. num_puzzle_identifiers-1)."""
    total_groups: int
    """Number of groups (a puzzle and its augmentations)."""
    mean_puzzle_examples: float
    """Mean examples per puzzle; sets the number of training steps per epoch."""
    total_puzzles: int
    """Puzzles as recorded by the builder (the reference's Sudoku/Maze builders write the group
    count here, so readers do not rely on it)."""
    sets: tuple
    """Names of the array sets in the split; the reference always writes ("all",)."""

    @classmethod
    def from_dict(cls, data, url: str) -> Metadata:
        if not isinstance(data, dict):
            raise DatasetError(f"{url} must hold a JSON object, found {type(data).__name__}; "
                               "rebuild the dataset.")
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing == ["total_puzzles"] and "total_samples" in data:
            raise DatasetError(f"{url} names its example count total_samples, as EqR's builders write it, "
                               "where this format has total_puzzles. Add \"total_puzzles\" with the same "
                               "value to each split's dataset.json (the arrays are this format's), or build "
                               "EqR's Maze-Unique here with `python build_data.py build-maze-unique`.")
        if missing:
            raise DatasetError(f"{url} lacks the field(s) {missing}; it is not a TRM dataset "
                               "description. Rebuild the dataset with `python build_data.py build-...`.")
        values = {}
        for f in fields(cls):
            value = data[f.name]
            if f.name == "sets":
                ok = isinstance(value, list) and len(value) > 0 \
                    and all(isinstance(s, str) for s in value)
                value = tuple(value) if ok else value
            elif f.name == "mean_puzzle_examples":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            elif f.name == "ignore_label_id":
                ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise DatasetError(f"{url}: field {f.name!r} has the invalid value {value!r}; "
                                   "rebuild the dataset.")
            values[f.name] = value
        if values["seq_len"] < 1 or values["vocab_size"] < 1 or values["total_groups"] < 1:
            raise DatasetError(f"{url}: seq_len, vocab_size and total_groups must be positive, "
                               f"found {values['seq_len']}, {values['vocab_size']}, "
                               f"{values['total_groups']}; rebuild the dataset.")
        # Batches fill padding rows with these: they must be valid token and table rows.
        for name, limit in (("pad_id", "vocab_size"), ("blank_identifier_id", "num_puzzle_identifiers")):
            if values[name] >= values[limit]:
                raise DatasetError(f"{url}: {name} {values[name]} is outside 0..{values[limit] - 1} "
                                   f"({limit} {values[limit]}); rebuild the dataset, or correct "
                                   f"{name} or {limit} in this file if the arrays are right.")
        return cls(**values)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["sets"] = list(self.sets)
        return data


@dataclass
class Dataset:
    """One split of a dataset: metadata plus arrays (inputs/labels memory-mapped)."""

    url: str
    """Root URL the split was opened from."""
    split: str
    """"train" or "test"."""
    metadata: Metadata
    """The split's dataset.json."""
    inputs: np.ndarray = field(repr=False)
    """[examples, seq_len] token ids, memory-mapped."""
    labels: np.ndarray = field(repr=False)
    """[examples, seq_len] target ids, memory-mapped."""
    puzzle_identifiers: np.ndarray = field(repr=False)
    """[puzzles] puzzle-embedding row of each puzzle."""
    puzzle_indices: np.ndarray = field(repr=False)
    """[puzzles + 1] first example of each puzzle (int64, in memory)."""
    group_indices: np.ndarray = field(repr=False)
    """[groups + 1] first puzzle of each group (int64, in memory)."""
    downloaded_bytes: int
    """Bytes copied from remote storage when opening (0 when cached or local)."""

    @property
    def num_examples(self) -> int:
        return len(self.inputs)

    @property
    def num_puzzles(self) -> int:
        return len(self.puzzle_indices) - 1

    @property
    def num_groups(self) -> int:
        return len(self.group_indices) - 1


def _default_cache_dir(url: str) -> str:
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser(DEFAULT_CACHE_ROOT), digest)


# The cache of a remote split: {cache_dir}/{split}/ holds dataset.json and the arrays under their
# own names, and manifest.json, which records for each file the remote version it was copied from
# and the local file's size and modification time. Files are used only when both still match.
MANIFEST_NAME = "manifest.json"


def _remote_version(info: dict) -> dict:
    """What identifies one version of a remote object, as the store reports it: the size and
    whichever of generation (GCS), etag, checksums (md5Hash, crc32c) and modification time."""
    keys = ("size", "generation", "md5Hash", "crc32c", "etag", "ETag", "LastModified", "mtime", "created")
    return {key: str(info[key]) for key in keys if info.get(key) is not None}


def _remote_versions(fs, split_url: str, split_path: str, names: list[str]) -> dict[str, dict]:
    fs.invalidate_cache(split_path)  # a listing this process cached must not hide a rebuild
    versions = {}
    for name in names:
        url = join_url(split_url, name)
        try:
            with access_errors(url, DatasetError):
                versions[name] = _remote_version(fs.info(join_url(split_path, name)))
        except FileNotFoundError:
            raise DatasetError(f"{url} is missing; the dataset upload may be incomplete. Copy it "
                               "again or rebuild the dataset.") from None
    return versions


def _local_stamp(path: str) -> dict | None:
    """Size and modification time of a cached file (None if absent): any write changes them."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


@contextlib.contextmanager
def _locked(directory: str):
    """Hold an exclusive lock on a cache directory (released when the holder exits or dies), so
    processes of one machine copy into it one at a time."""
    import fcntl  # POSIX only, like the TPU VMs

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"data: waiting for another process copying into {directory}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (some NFS mounts): one process per host copies
            pass
        yield


def _read_manifest(directory: str) -> dict:
    try:
        with open(os.path.join(directory, MANIFEST_NAME)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else {}


def _write_manifest(directory: str, manifest: dict) -> None:
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".manifest.", suffix=".part")
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp_path, os.path.join(directory, MANIFEST_NAME))


def _md5_base64(path: str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


def _download(fs, remote_path: str, url: str, local_path: str, version: dict) -> int:
    """Copy one remote file to ``local_path`` through a temporary .part file that is renamed into
    place once its size, and its MD5 when the store reports one (GCS's md5Hash), match the
    remote object's. Returns its size."""
    directory, name = os.path.split(local_path)
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".part")
    os.close(fd)
    start = time.time()
    try:
        with access_errors(url, DatasetError):
            fs.get_file(remote_path, tmp_path)
        size = os.path.getsize(tmp_path)
        if "size" in version and size != int(version["size"]):
            raise DatasetError(f"Downloaded {size} bytes of {url} but the storage reports "
                               f"{version['size']}; the object changed during the download. Retry.")
        if "md5Hash" in version and _md5_base64(tmp_path) != version["md5Hash"]:
            raise DatasetError(f"The copy of {url} does not have the MD5 the storage reports "
                               f"({version['md5Hash']}): the download was corrupted or the object "
                               "changed during it. Retry.")
        os.replace(tmp_path, local_path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    print(f"data: copied {url} ({size / 1e6:.1f} MB, {time.time() - start:.1f} s) to {local_path}",
          file=sys.stderr, flush=True)
    return size


def _cached_split(fs, split_url: str, split_path: str, names: list[str],
                  cache_split_dir: str) -> tuple[dict[str, str], int, dict]:
    """Local copies of the files ``names`` of a remote split, all of one version of the split:
    ({name: local path}, bytes downloaded, the manifest describing them).

    Under the cache directory's lock: leftovers of killed downloads (*.part) and files that are
    not the split's are removed; a file is copied again when the remote object's version
    (generation, etag, md5, size) or the local file's size or modification time differ from the
    manifest's record of it (so a rebuilt dataset, a re-uploaded file or a cached file written to
    since are fetched again). Files whose recorded remote version is unchanged are the same
    bytes and stay. After copying, the remote versions are read again: if any changed meanwhile
    (a rebuild under way), DatasetError, and the manifest is not updated, so a mix of two builds
    is never served.
    """
    with _locked(cache_split_dir):
        for leftover in os.listdir(cache_split_dir):
            if leftover.endswith(".part") or (leftover.endswith(".npy") and leftover not in names):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(cache_split_dir, leftover))
        remote = _remote_versions(fs, split_url, split_path, names)
        manifest = _read_manifest(cache_split_dir)
        recorded = manifest["files"] if manifest.get("url") == split_url else {}
        files, downloaded = {}, 0
        for name in names:
            local_path = os.path.join(cache_split_dir, name)
            record = recorded.get(name) if isinstance(recorded.get(name), dict) else {}
            if record.get("remote") != remote[name] or record.get("local") != _local_stamp(local_path):
                downloaded += _download(fs, join_url(split_path, name), join_url(split_url, name), local_path,
                                        remote[name])
            files[name] = {"remote": remote[name], "local": _local_stamp(local_path)}
        if files != recorded:
            if _remote_versions(fs, split_url, split_path, names) != remote:
                raise DatasetError(f"{split_url} changed while it was being copied to {cache_split_dir} "
                                   "(rebuilt or re-uploaded meanwhile?). Run again once the dataset is "
                                   "complete; the cache is not used until one version was copied whole.")
            manifest = {"url": split_url, "files": files}
            _write_manifest(cache_split_dir, manifest)
    return {name: os.path.join(cache_split_dir, name) for name in names}, downloaded, manifest


def _record_values_checked(cache_split_dir: str, manifest: dict, metadata: Metadata) -> None:
    """Note in the manifest that its files passed _check_values for ``metadata``, unless another
    process has replaced them since."""
    with _locked(cache_split_dir):
        current = _read_manifest(cache_split_dir)
        if current.get("url") == manifest["url"] and current.get("files") == manifest["files"]:
            _write_manifest(cache_split_dir, dict(current, values_checked=metadata.to_dict()))


def _load_npy(local_path: str, url: str, memory_map: bool) -> np.ndarray:
    try:
        return np.load(local_path, mmap_mode="r" if memory_map else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DatasetError(f"{url} is not a readable .npy array ({exc}); rebuild or re-upload "
                           "it.") from exc


def _missing_split_error(url: str, split: str, json_url: str) -> DatasetError:
    """The most useful explanation for a missing dataset.json."""
    fs, root_path = filesystem(url)
    with access_errors(url, DatasetError):
        root_exists = fs.exists(root_path)
        split_exists = root_exists and fs.exists(join_url(root_path, split))
    if not root_exists:
        return DatasetError(f"Dataset root {url} does not exist. Check the URL, or build a "
                            "dataset there with `python build_data.py build-demo --out URL` "
                            "(or build-sudoku, build-maze, build-maze-unique, build-arc).")
    if not split_exists:
        return DatasetError(f"Dataset split {join_url(url, split)} is missing: a dataset root "
                            f"needs train/ and test/. Check that {url} is the root (the folder "
                            "that contains train/ and test/), or rebuild the dataset.")
    return DatasetError(f"{json_url} is missing: every split needs its dataset.json. The "
                        "upload may be incomplete; copy it again or rebuild the dataset.")


def read_metadata(url: str, split: str) -> Metadata:
    """The dataset.json of one split ("train" or "test") of the dataset rooted at ``url``."""
    if split not in SPLITS:
        raise DatasetError(f"Unknown split {split!r} for {url}; use one of {SPLITS}.")
    json_url = join_url(url, split, "dataset.json")
    try:
        return _parse_metadata(read_json(json_url, "dataset", DatasetError), json_url)
    except FileNotFoundError:
        raise _missing_split_error(url, split, json_url) from None


def _parse_metadata(content, json_url: str) -> Metadata:
    metadata = Metadata.from_dict(content, json_url)
    if len(metadata.sets) != 1:
        raise DatasetError(f"{json_url} lists the sets {list(metadata.sets)}; only datasets "
                           "with one set per split are supported. Rebuild with one set.")
    return metadata


def open_dataset(url: str, split: str, cache_dir: str | None = None) -> Dataset:
    """Open one split ("train" or "test") of the dataset rooted at ``url``.

    A remote split (dataset.json and its arrays, one version of them: _cached_split) is copied to
    ``cache_dir/<split>/`` once (default ``~/.cache/trm-data/<hash of url>``) and memory-mapped; a
    local root is read in place. The values of the arrays are checked (_check_values) at every
    open of a local split, once per cached version of a remote one.
    """
    metadata = read_metadata(url, split)  # explains a missing or malformed split
    split_url = join_url(url, split)
    fs, split_path = filesystem(split_url)
    file_names = {name: f"{metadata.sets[0]}__{name}.npy" for name in ARRAY_NAMES}
    downloaded, manifest, cache_split_dir = 0, None, None
    if is_local(fs):
        paths = {name: join_url(split_path, file_name) for name, file_name in file_names.items()}
        for name, path in paths.items():
            if not os.path.isfile(path):
                raise DatasetError(f"{join_url(split_url, file_names[name])} is missing; the dataset upload "
                                   "may be incomplete. Copy it again or rebuild the dataset.")
    else:
        cache_split_dir = os.path.join(cache_dir or _default_cache_dir(url), split)
        local, downloaded, manifest = _cached_split(fs, split_url, split_path,
                                                    ["dataset.json", *file_names.values()], cache_split_dir)
        paths = {name: local[file_name] for name, file_name in file_names.items()}
        json_url = join_url(split_url, "dataset.json")
        try:  # the copied arrays' own dataset.json (the one read above may be older)
            with open(local["dataset.json"], "rb") as f:
                content = json.loads(f.read())
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise DatasetError(f"{json_url} is not valid JSON ({exc}); rebuild or re-upload the dataset.") from exc
        metadata = _parse_metadata(content, json_url)
    arrays = {}
    for name in ARRAY_NAMES:
        array_url = join_url(split_url, file_names[name])
        # The example arrays stay on disk; the index arrays are small and used on every batch.
        array = _load_npy(paths[name], array_url, memory_map=name in ("inputs", "labels"))
        if array.dtype.kind not in "iu":
            raise DatasetError(f"{array_url} has dtype {array.dtype}, expected integers "
                               "(uint8 tokens, int32 indices). Rebuild the dataset.")
        arrays[name] = array
    checked = manifest is not None and manifest.get("values_checked") == metadata.to_dict()
    _check_arrays(arrays, metadata, split_url, values=not checked)
    if manifest is not None and not checked:
        _record_values_checked(cache_split_dir, manifest, metadata)
    return Dataset(url=url, split=split, metadata=metadata,
                   inputs=arrays["inputs"], labels=arrays["labels"],
                   puzzle_identifiers=np.asarray(arrays["puzzle_identifiers"], dtype=np.int32),
                   puzzle_indices=np.asarray(arrays["puzzle_indices"], dtype=np.int64),
                   group_indices=np.asarray(arrays["group_indices"], dtype=np.int64),
                   downloaded_bytes=downloaded)


def _check_arrays(arrays: dict, metadata: Metadata, split_url: str, values: bool = True) -> None:
    """Raise DatasetError unless the arrays have the shapes dataset.json and each other imply
    and (``values``) hold only valid tokens, labels and puzzle identifiers (_check_values)."""
    def fail(name, problem):
        raise DatasetError(f"{join_url(split_url, f'{metadata.sets[0]}__{name}.npy')} {problem}. "
                           "The dataset is inconsistent: rebuild or re-upload it.")

    inputs, labels = arrays["inputs"], arrays["labels"]
    if inputs.ndim != 2 or inputs.shape[1] != metadata.seq_len:
        fail("inputs", f"has shape {inputs.shape}, expected [examples, {metadata.seq_len}] "
                       "(seq_len of dataset.json)")
    if labels.shape != inputs.shape:
        fail("labels", f"has shape {labels.shape}, expected {inputs.shape} like the inputs")
    for name in ("puzzle_identifiers", "puzzle_indices", "group_indices"):
        if arrays[name].ndim != 1:
            fail(name, f"has shape {arrays[name].shape}, expected one dimension")
    puzzle_indices, group_indices = arrays["puzzle_indices"], arrays["group_indices"]
    num_puzzles = len(puzzle_indices) - 1
    if num_puzzles < 1 or puzzle_indices[0] != 0 or puzzle_indices[-1] != len(inputs) \
            or np.any(np.diff(puzzle_indices) <= 0):
        fail("puzzle_indices", f"must rise strictly from 0 to {len(inputs)} (the number of "
                               f"examples); it has length {len(puzzle_indices)} and ends at "
                               f"{puzzle_indices[-1] if len(puzzle_indices) else None}")
    if len(group_indices) != metadata.total_groups + 1 or group_indices[0] != 0 \
            or group_indices[-1] != num_puzzles or np.any(np.diff(group_indices) <= 0):
        fail("group_indices", f"must have length {metadata.total_groups + 1} (total_groups + 1) "
                              f"and rise strictly from 0 to {num_puzzles} (the number of "
                              f"puzzles); it has length {len(group_indices)}")
    identifiers = arrays["puzzle_identifiers"]
    if len(identifiers) != num_puzzles:
        fail("puzzle_identifiers", f"has length {len(identifiers)}, expected {num_puzzles} "
                                   "(one per puzzle)")
    if values:
        _check_values(arrays, metadata, split_url)


# Rows per chunk of the value checks: about 64 MB of a [rows, seq_len] array at a time.
_CHECK_CHUNK_BYTES = 64 << 20


def _check_values(arrays: dict, metadata: Metadata, split_url: str) -> None:
    """Raise DatasetError unless every token, label and puzzle identifier is a valid row of the
    model's tables: inputs in [0, vocab_size), labels too or equal to ignore_label_id, puzzle
    identifiers in [0, num_puzzle_identifiers). Reads the memory-mapped arrays in chunks (the
    extremes of each chunk; positions are only searched for in a chunk that fails)."""
    vocab, ignore = metadata.vocab_size, metadata.ignore_label_id
    checks = (("inputs", vocab, None, "vocab_size", ""),
              ("labels", vocab, ignore, "vocab_size",
               f"; ignore_label_id {ignore} is allowed too" if ignore is not None else ""),
              ("puzzle_identifiers", metadata.num_puzzle_identifiers, None, "num_puzzle_identifiers", ""))
    for name, limit, allowed, field_name, also in checks:
        array = arrays[name]
        rows = max(1, _CHECK_CHUNK_BYTES // max(1, array[:1].nbytes))
        for start in range(0, len(array), rows):
            chunk = np.asarray(array[start:start + rows])
            if chunk.size == 0 or (chunk.min() >= 0 and chunk.max() < limit):
                continue
            bad = (chunk < 0) | (chunk >= limit)
            if allowed is not None:
                bad &= chunk != allowed
            if not bad.any():  # only the allowed ignore label lies outside
                continue
            position = np.unravel_index(int(np.argmax(bad)), bad.shape)
            value = int(chunk[position])
            where = (f"row {start + position[0]}, position {position[1]}" if chunk.ndim == 2
                     else f"index {start + position[0]}")
            raise DatasetError(
                f"{join_url(split_url, f'{metadata.sets[0]}__{name}.npy')} holds the value {value} "
                f"(first at {where}), outside 0..{limit - 1} ({field_name} {limit} in "
                f"{join_url(split_url, 'dataset.json')}{also}). Rebuild the dataset, or correct "
                f"{field_name} in dataset.json if the arrays are right.")


def npy_header(fs, path: str) -> tuple[tuple, np.dtype, int]:
    """(shape, dtype, data offset) of a .npy file, reading only its header."""
    with fs.open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _fortran_order, dtype = read_header(f)
        return shape, dtype, f.tell()


def split_examples(url: str, split: str) -> int:
    """Examples in one split of the dataset at `url`, from its inputs array's header (the split's
    dataset.json does not hold the count): what a projection of a run's evaluations needs."""
    metadata = read_metadata(url, split)
    inputs_url = join_url(url, split, f"{metadata.sets[0]}__inputs.npy")
    fs, path = filesystem(inputs_url)
    with access_errors(inputs_url, DatasetError):
        return int(npy_header(fs, path)[0][0])


def open_train_test(url: str, cache_dir: str | None = None) -> tuple[Dataset, Dataset]:
    """Open both splits and check that a model built for the train split can run the test split."""
    train = open_dataset(url, "train", cache_dir)
    test = open_dataset(url, "test", cache_dir)
    for name in ("seq_len", "vocab_size", "pad_id", "ignore_label_id"):
        train_value, test_value = getattr(train.metadata, name), getattr(test.metadata, name)
        if train_value != test_value:
            raise DatasetError(f"The splits of {url} disagree on {name}: train has {train_value}, "
                               f"test has {test_value}. Build both splits with the same builder "
                               "run.")
    if test.metadata.num_puzzle_identifiers > train.metadata.num_puzzle_identifiers:
        raise DatasetError(f"The test split of {url} uses {test.metadata.num_puzzle_identifiers} "
                           "puzzle identifiers but the train split (which sizes the embedding "
                           f"table) only {train.metadata.num_puzzle_identifiers}. Build both "
                           "splits with the same builder run.")
    return train, test


def read_identifiers(url: str) -> list:
    """identifiers.json of the dataset at ``url``: the name of each puzzle identifier."""
    json_url = join_url(url, "identifiers.json")
    try:
        names = read_json(json_url, "identifiers list", DatasetError)
    except FileNotFoundError:
        raise DatasetError(f"{json_url} is missing; rebuild the dataset.") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DatasetError(f"{json_url} must hold a list of names; rebuild the dataset.")
    return names


def identifiers_fingerprint(url: str) -> str | None:
    """A short hash of the dataset's identifier names in order (identifiers.json), or None when
    it has none. Row i of a trained puzzle-embedding table belongs to identifier i: a model may
    only be evaluated or fine-tuned with its table on a dataset with the same fingerprint."""
    try:
        names = read_json(join_url(url, "identifiers.json"), "identifiers list", DatasetError)
    except FileNotFoundError:
        return None
    return hashlib.sha256(json.dumps(names, separators=(",", ":")).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

class SplitAccumulator:
    """Collects one split group by group; example rows go to local temporary files, so a
    large dataset (ARC with 1000 augmentations is several GB) never sits in memory."""

    def __init__(self, seq_len: int, workdir: str, split: str):
        self.seq_len = seq_len
        self._paths = {name: os.path.join(workdir, f"{split}_{name}.bin")
                       for name in ("inputs", "labels")}
        self._files = {name: open(path, "wb") for name, path in self._paths.items()}
        self._puzzle_sizes: list = []
        self._identifiers: list = []
        self._group_sizes: list = []

    def add_group(self, inputs: np.ndarray, labels: np.ndarray, puzzle_sizes: Sequence[int],
                  identifiers: Sequence[int]) -> None:
        """Append a group: ``inputs``/``labels`` [examples, seq_len] of its puzzles, one after
        another, with each puzzle's number of examples and identifier."""
        assert inputs.shape == labels.shape and inputs.shape[1] == self.seq_len
        assert sum(puzzle_sizes) == len(inputs) and len(puzzle_sizes) == len(identifiers)
        self._files["inputs"].write(np.ascontiguousarray(inputs, dtype=np.uint8).tobytes())
        self._files["labels"].write(np.ascontiguousarray(labels, dtype=np.uint8).tobytes())
        self._puzzle_sizes.extend(int(n) for n in puzzle_sizes)
        self._identifiers.extend(int(i) for i in identifiers)
        self._group_sizes.append(len(puzzle_sizes))

    def write(self, url: str, split: str, vocab_size: int, num_puzzle_identifiers: int) -> Metadata:
        """Write the collected split to ``url`` and return its metadata."""
        for f in self._files.values():
            f.close()
        if not self._group_sizes:
            raise DatasetError(f"The {split} split for {url} would be empty; check the source "
                               "data and the filters (subsample size, minimum difficulty).")
        num_examples = sum(self._puzzle_sizes)
        rows = {name: np.memmap(path, dtype=np.uint8, mode="r",
                                shape=(num_examples, self.seq_len))
                for name, path in self._paths.items()}
        metadata = Metadata(
            pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=vocab_size,
            seq_len=self.seq_len, num_puzzle_identifiers=num_puzzle_identifiers,
            total_groups=len(self._group_sizes),
            mean_puzzle_examples=num_examples / len(self._puzzle_sizes),
            total_puzzles=len(self._puzzle_sizes), sets=(SET_NAME,))
        write_split(url, split, metadata, {
            "inputs": rows["inputs"], "labels": rows["labels"],
            "puzzle_identifiers": np.array(self._identifiers, dtype=np.int32),
            "puzzle_indices": np.concatenate(([0], np.cumsum(self._puzzle_sizes))),
            "group_indices": np.concatenate(([0], np.cumsum(self._group_sizes)))})
        return metadata


def write_split(url: str, split: str, metadata: Metadata, arrays: dict) -> None:
    """Write one split of the reference format under the dataset root ``url``.

    ``arrays`` maps each of ARRAY_NAMES to an array (a memmap is fine: it is streamed).
    dataset.json is written last, so a reader never finds a split with missing arrays.
    """
    split_url = join_url(url, split)
    metadata = Metadata.from_dict(metadata.to_dict(), join_url(split_url, "dataset.json"))  # its values
    arrays = {name: np.asarray(arrays[name]) if name not in ("inputs", "labels") else arrays[name]
              for name in ARRAY_NAMES}
    for name in ("puzzle_identifiers", "puzzle_indices", "group_indices"):
        arrays[name] = arrays[name].astype(np.int32)
    _check_arrays(arrays, metadata, split_url)
    for name in ARRAY_NAMES:
        write_file(join_url(split_url, f"{metadata.sets[0]}__{name}.npy"),
                   lambda f, array=arrays[name]: np.save(f, array))
    write_bytes(join_url(split_url, "dataset.json"), json.dumps(metadata.to_dict()).encode())


def write_identifiers(url: str, names: Sequence[str]) -> None:
    """Write identifiers.json (identifier -> name; entry 0 is "<blank>") at the root ``url``."""
    write_bytes(join_url(url, "identifiers.json"), json.dumps(list(names)).encode())


# ----------------------------------------------------------------------------------------------
# The batches of a run
#
# The batches of a run, a pure function of (seed, step): which examples make global batch s and
# which of its rows each host reads, the evaluation's batches in order, and the prefetching that
# uploads the next batch while a step runs. nanochat-style, the dataset format and its cache
# live apart (data.py); this file only plans and reads batches from an open `data.Dataset`.
#
#     TrainBatches(dataset, global_batch_size, seed, process_index=0, process_count=1)
#         .batch(step) -> dict         this host's rows of global batch ``step``
#         .global_plan(step) -> (example_indices, puzzle_indices) of the whole global batch
#     EvalBatches(dataset, global_batch_size, process_index=0, process_count=1,
#                 max_examples=None, seed=0)
#         len(), .batch(i) -> dict, .valid(i) -> bool [rows], .num_examples
#     total_train_steps(metadata, epochs, global_batch_size) -> int
#     train_rows_per_second(dataset, global_batch_size, ...) -> float   # TrainBatches' speed
#     PrefetchedBatches(load, first_step, last_step).get(step)          # the loop's batches
#
# A batch is a dict of numpy arrays: ``inputs`` and ``labels`` int32 [rows, seq_len], labels -100
# where ignored, ``puzzle_identifiers`` int32 [rows]; rows = global_batch_size / process_count.
# This module imports numpy and the standard library only (never torch or torch_xla).


def total_train_steps(metadata: Metadata, epochs: float, global_batch_size: int) -> int:
    """Optimizer steps of a run of ``epochs`` epochs, counted as the reference counts them."""
    return int(epochs * metadata.total_groups * metadata.mean_puzzle_examples / global_batch_size)


def _host_rows(global_batch_size: int, process_index: int, process_count: int) -> slice:
    """The contiguous rows of a global batch that host ``process_index`` materialises."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DatasetError(f"process_index {process_index} must lie in 0..{process_count - 1} "
                           f"(process_count {process_count}).")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise DatasetError(f"global_batch_size {global_batch_size} must be a positive multiple "
                           f"of process_count {process_count}: every host takes an equal share.")
    rows = global_batch_size // process_count
    return slice(process_index * rows, (process_index + 1) * rows)


def _collate(dataset: Dataset, examples: np.ndarray, puzzles: np.ndarray) -> dict:
    """The model's batch dict for the given example and puzzle indices (read from the memmaps)."""
    labels = dataset.labels[examples].astype(np.int32)
    if dataset.metadata.ignore_label_id is not None:
        labels[labels == dataset.metadata.ignore_label_id] = IGNORE_LABEL_ID
    return {"inputs": dataset.inputs[examples].astype(np.int32),
            "labels": labels,
            "puzzle_identifiers": dataset.puzzle_identifiers[puzzles]}


class _EpochPlan:
    """The random choices of one epoch: group order, one puzzle per group, example order.

    The epoch draws every group once, in a random order; each draw is one random puzzle of the
    group and owns that puzzle's examples (its "slots") in a random order.
    """

    def __init__(self, seed: int, epoch: int, dataset: Dataset, puzzle_sizes: np.ndarray):
        self._rng = np.random.default_rng([seed, epoch])
        order = self._rng.permutation(dataset.num_groups)
        starts, ends = dataset.group_indices[:-1], dataset.group_indices[1:]
        self.puzzles = self._rng.integers(starts[order], ends[order])
        # slot_ends[d] = first slot of draw d; slot_ends[-1] = number of slots in the epoch.
        self.slot_ends = np.concatenate(([0], np.cumsum(puzzle_sizes[self.puzzles])))
        self._puzzle_starts = dataset.puzzle_indices[self.puzzles]
        self._slot_examples = None
        self._slot_puzzles = None

    def slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(example index, puzzle index) of every slot of the epoch, in draw order."""
        if self._slot_examples is None:
            sizes = np.diff(self.slot_ends)
            draw_of_slot = np.repeat(np.arange(len(sizes)), sizes)
            # Shuffle each draw's examples: sort slots by (draw, random key).
            keys = self._rng.random(len(draw_of_slot))
            shuffled = np.lexsort((keys, draw_of_slot))
            self._slot_examples = (self._puzzle_starts[draw_of_slot]
                                   + shuffled - self.slot_ends[draw_of_slot])
            self._slot_puzzles = self.puzzles[draw_of_slot]
        return self._slot_examples, self._slot_puzzles


class TrainBatches:
    """Training batches with the reference's sampling, identical on every host.

    The epochs form one endless stream of draws (epoch e draws every group once, shuffled by a
    generator seeded with (seed, e)). A global batch takes consecutive draws, each contributing
    its puzzle's examples in random order, until it holds ``global_batch_size`` rows; the draw
    that overflows is cut short and its remaining examples are skipped, as in the reference.
    The reference drops the partial batch at the end of every block of epochs between
    evaluations; here the stream has no end, so no batch is partial.

    The global batch of ``step`` is a pure function of (seed, step): a resumed run only needs
    the step. Host ``process_index`` of ``process_count`` gets rows
    [p*B/P, (p+1)*B/P) of it and reads only those rows.
    """

    _BOUNDARY_STRIDE = 256  # remember where every 256th batch starts, for random access

    def __init__(self, dataset: Dataset, global_batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.rows = _host_rows(global_batch_size, process_index, process_count)
        if seed < 0:
            raise DatasetError(f"seed {seed} must be non-negative.")
        self._puzzle_sizes = np.diff(dataset.puzzle_indices)
        self._num_groups = dataset.num_groups
        # When every puzzle has n examples each batch takes ceil(B/n) draws, so batch
        # boundaries are known without replaying earlier epochs.
        sizes = np.unique(self._puzzle_sizes)
        self._draws_per_batch = -(-global_batch_size // int(sizes[0])) if len(sizes) == 1 else None
        self._stride_starts = [0]  # first draw of batch k * _BOUNDARY_STRIDE
        self._last_start = (0, 0)  # (step, first draw) of the batch asked for last
        self._plans: dict[int, _EpochPlan] = {}

    def _plan(self, epoch: int) -> _EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:
            if len(self._plans) >= 4:
                del self._plans[min(self._plans)]
            plan = self._plans[epoch] = _EpochPlan(self.seed, epoch, self.dataset,
                                                   self._puzzle_sizes)
        return plan

    def _walk(self, first_draw: int) -> tuple[list, int]:
        """The slot ranges [(epoch, lo, hi)] of the batch starting at ``first_draw``, and the
        first draw of the next batch."""
        ranges, need = [], self.global_batch_size
        epoch, draw = divmod(first_draw, self._num_groups)
        while True:
            slot_ends = self._plan(epoch).slot_ends
            lo = int(slot_ends[draw])
            if slot_ends[-1] - lo >= need:
                ranges.append((epoch, lo, lo + need))
                # The draw holding the batch's last row is finished (cut short if needed).
                next_draw = int(np.searchsorted(slot_ends, lo + need, side="left"))
                return ranges, epoch * self._num_groups + next_draw
            ranges.append((epoch, lo, int(slot_ends[-1])))
            need -= int(slot_ends[-1]) - lo
            epoch, draw = epoch + 1, 0

    def _first_draw(self, step: int) -> int:
        if step < 0:
            raise DatasetError(f"step {step} must be non-negative.")
        if self._draws_per_batch is not None:
            return step * self._draws_per_batch
        # Puzzle sizes differ: replay batch boundaries from the nearest one known.
        stride = self._BOUNDARY_STRIDE
        known = min(step // stride, len(self._stride_starts) - 1)
        k, draw = known * stride, self._stride_starts[known]
        if k <= self._last_start[0] <= step:
            k, draw = self._last_start
        while k < step:
            draw = self._walk(draw)[1]
            k += 1
            if k % stride == 0 and k // stride == len(self._stride_starts):
                self._stride_starts.append(draw)
        self._last_start = (step, draw)
        return draw

    def global_plan(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(example index, puzzle index) of every row of global batch ``step``."""
        ranges, _ = self._walk(self._first_draw(step))
        examples, puzzles = [], []
        for epoch, lo, hi in ranges:
            slot_examples, slot_puzzles = self._plan(epoch).slots()
            examples.append(slot_examples[lo:hi])
            puzzles.append(slot_puzzles[lo:hi])
        return np.concatenate(examples), np.concatenate(puzzles)

    def batch(self, step: int) -> dict:
        """This host's rows of global batch ``step``."""
        examples, puzzles = self.global_plan(step)
        return _collate(self.dataset, examples[self.rows], puzzles[self.rows])


class EvalBatches:
    """All test examples in order (or a fixed seeded subset), split across hosts like training.

    The last global batch is padded with rows whose labels are all -100, whose inputs are
    pad_id and whose puzzle identifier is blank_identifier_id; ``valid(i)`` marks real rows.
    """

    def __init__(self, dataset: Dataset, global_batch_size: int, process_index: int = 0,
                 process_count: int = 1, max_examples: int | None = None, seed: int = 0):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.rows = _host_rows(global_batch_size, process_index, process_count)
        total = dataset.num_examples
        if max_examples is not None and max_examples < 1:
            raise DatasetError(f"max_examples {max_examples} must be positive (or None for all).")
        if max_examples is None or max_examples >= total:
            self.examples = np.arange(total)
        else:
            # A fixed subset, kept in dataset order so puzzles stay together.
            chosen = np.random.default_rng(seed).choice(total, size=max_examples, replace=False)
            self.examples = np.sort(chosen)
        self.puzzles = np.searchsorted(dataset.puzzle_indices, self.examples, side="right") - 1

    @property
    def num_examples(self) -> int:
        """Real (unpadded) examples over all batches."""
        return len(self.examples)

    def __len__(self) -> int:
        return -(-len(self.examples) // self.global_batch_size)

    def _positions(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"evaluation batch {index} out of range 0..{len(self) - 1}")
        return index * self.global_batch_size + np.arange(self.global_batch_size)[self.rows]

    def valid(self, index: int) -> np.ndarray:
        """Bool [rows]: which of this host's rows of batch ``index`` are real examples."""
        return self._positions(index) < len(self.examples)

    def batch(self, index: int) -> dict:
        """This host's rows of evaluation batch ``index``, padded past the last example."""
        positions = self._positions(index)
        real = positions[positions < len(self.examples)]
        batch = _collate(self.dataset, self.examples[real], self.puzzles[real])
        padding = len(positions) - len(real)
        if padding:
            metadata = self.dataset.metadata
            pad_values = {"inputs": metadata.pad_id, "labels": IGNORE_LABEL_ID,
                          "puzzle_identifiers": metadata.blank_identifier_id}
            batch = {key: np.concatenate([value, np.full((padding,) + value.shape[1:],
                                                         pad_values[key], np.int32)])
                     for key, value in batch.items()}
        return batch


def train_rows_per_second(dataset: Dataset, global_batch_size: int, process_count: int = 1,
                          steps: int = 200, runs: int = 1) -> float:
    """Rows per second that host 0 of ``process_count`` gets from TrainBatches: the median of
    ``runs`` timings of ``steps`` consecutive batches each, after one untimed batch."""
    batches = TrainBatches(dataset, global_batch_size, seed=0, process_index=0,
                           process_count=process_count)
    batches.batch(0)
    rows = global_batch_size // process_count
    rates, step = [], 1
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps):
            batches.batch(step)
            step += 1
        rates.append(steps * rows / (time.perf_counter() - start))
    return statistics.median(rates)


class PrefetchedBatches:
    """The global batch of each training step, read and uploaded to the devices on a background
    thread while the step before it runs (as torch_xla's MpDeviceLoader does), so the loop only
    waits for data when reading is slower than a step. Batches depend only on the step, so
    prefetching changes no result."""

    def __init__(self, load, first_step: int, last_step: int):
        self.load, self.last_step = load, last_step
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trm-batches")
        self.pending = {first_step: self.thread.submit(load, first_step)} if first_step <= last_step else {}

    def get(self, step: int) -> dict:
        future = self.pending.pop(step, None) or self.thread.submit(self.load, step)
        batch = future.result()  # raises here if reading or uploading failed
        if step < self.last_step:
            self.pending[step + 1] = self.thread.submit(self.load, step + 1)
        return batch

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)
