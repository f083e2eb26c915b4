"""Distributed safetensors checkpoints on any fsspec URL (gs:// first), and model export.

A checkpoint is a directory `{run_dir}/checkpoints/step_{N:08d}/`:

    host_{p:03d}.safetensors   the tensors host p owns: its share of the replicated tensors
                               and its rows of the batch-sharded ones (the ACT carry)
    host_{p:03d}.json          host p's index: tensor name -> key, dtype, global shape, rows;
                               written after its safetensors file, so its presence means done
    state.json                 what is not a tensor: step, config, hosts (process 0)
    COMMITTED                  written last by process 0, once every host's index exists

Hosts write in parallel from a background thread; nothing crosses hosts but files, so a
host that dies before finishing leaves no COMMITTED marker, and discovery skips the
directory. Every read and write goes through storage.py (fsspec, with retries). This file
imports torch, safetensors and storage.py, never torch_xla: exported models load anywhere.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from storage import exists, filesystem, join_url, read_bytes, with_retries, write_bytes

COMMIT_MARKER = "COMMITTED"
STEP_DIR = re.compile(r"step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, unreadable or not committed (a failing read or write of
    storage raises storage.StorageError)."""


def step_dir(run_dir: str, step: int) -> str:
    return join_url(run_dir, "checkpoints", f"step_{step:08d}")


def host_file(p: int) -> str:
    return f"host_{p:03d}"


# -- ownership ------------------------------------------------------------------------------------


def assign_owners(sizes: dict[str, int], process_count: int) -> dict[str, int]:
    """Spread whole replicated tensors over the hosts, largest first onto the least-loaded
    host. A pure function of names and sizes: every host computes the same assignment."""
    load = [0] * process_count
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        host = min(range(process_count), key=lambda h: (load[h], h))
        owners[name] = host
        load[host] += sizes[name]
    return owners


@dataclass
class Shard:
    """A tensor, or rows [row_start, row_start + len) of a batch-sharded tensor, held by one host."""

    tensor: torch.Tensor  # on the CPU
    global_shape: tuple
    row_start: int | None = None  # None: the whole tensor


# -- writing --------------------------------------------------------------------------------------


class CheckpointWriter:
    """Writes this host's part of each checkpoint in a background thread; process 0 commits.

    `save` returns once the background write has started; the next `save` (or `wait`) first
    waits for the previous one and raises if it failed.
    """

    def __init__(self, run_dir: str, process_index: int, process_count: int, keep: int = 3,
                 commit_timeout_s: float = 1800.0):
        if keep < 1:
            raise ValueError(f"run.keep_checkpoints must be >= 1, got {keep}")
        self.run_dir, self.process_index, self.process_count = run_dir, process_index, process_count
        self.keep, self.commit_timeout_s = keep, commit_timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, shards: dict[str, Shard], state: dict) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(step, shards, state), daemon=True,
                                        name=f"checkpoint-{step}")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, step: int, shards: dict[str, Shard], state: dict) -> None:
        try:
            self._write_host_part(step, shards)
            if self.process_index == 0:
                self._commit(step, state)
                self._delete_old(step)
        except BaseException as e:  # reported to the training loop by wait()
            self._error = e

    def _write_host_part(self, step: int, shards: dict[str, Shard]) -> None:
        directory = step_dir(self.run_dir, step)
        name = host_file(self.process_index)
        tensors = {key: shard.tensor.contiguous() for key, shard in shards.items()}
        index = {key: {"file": f"{name}.safetensors", "dtype": str(shard.tensor.dtype).removeprefix("torch."),
                       "global_shape": list(shard.global_shape), "row_start": shard.row_start,
                       "rows": None if shard.row_start is None else shard.tensor.shape[0]}
                 for key, shard in shards.items()}
        write_bytes(join_url(directory, f"{name}.safetensors"),
                    safetensors_bytes(tensors) if tensors else b"")
        write_bytes(join_url(directory, f"{name}.json"), json.dumps(index).encode())

    def _commit(self, step: int, state: dict) -> None:
        directory = step_dir(self.run_dir, step)
        expected = {f"{host_file(p)}.json" for p in range(self.process_count)}
        deadline = time.time() + self.commit_timeout_s
        fs, path = filesystem(directory)
        while True:
            fs.invalidate_cache(path)
            listed = with_retries("listing", directory, lambda: fs.ls(path, detail=False))
            present = {os.path.basename(p) for p in listed}
            if expected <= present:
                break
            if time.time() > deadline:
                missing = sorted(expected - present)
                raise CheckpointError(f"checkpoint {directory} not committed: no index from {missing} "
                                      f"after {self.commit_timeout_s:.0f}s (a host died or cannot write)")
            time.sleep(0.2)
        write_bytes(join_url(directory, "state.json"),
                    json.dumps(dict(state, hosts=self.process_count)).encode())
        write_bytes(join_url(directory, COMMIT_MARKER),
                    json.dumps({"step": step, "time": time.time()}).encode())

    def _delete_old(self, newest: int) -> None:
        committed = [s for s, _ in list_checkpoints(self.run_dir, committed_only=True)]
        doomed = [s for s in committed if s < newest][self.keep - 1:] if newest in committed else []
        # Uncommitted directories older than the newest commit are dead writes: remove them too.
        doomed += [s for s, _ in list_checkpoints(self.run_dir, committed_only=False)
                   if s < newest and s not in committed]
        for s in doomed:
            fs, path = filesystem(step_dir(self.run_dir, s))
            try:
                fs.rm(path, recursive=True)
            except Exception as e:  # a leftover directory costs storage, not correctness
                print(f"warning: could not delete old checkpoint {step_dir(self.run_dir, s)}: {e}",
                      flush=True)


# -- discovery and reading ----------------------------------------------------------------------------


def list_checkpoints(run_dir: str, committed_only: bool = True) -> list[tuple[int, str]]:
    """(step, url) of the checkpoints under run_dir, newest first."""
    root = join_url(run_dir, "checkpoints")
    fs, path = filesystem(root)
    if not with_retries("checking", root, lambda: fs.exists(path)):
        return []
    fs.invalidate_cache(path)
    found = []
    for entry in with_retries("listing", root, lambda: fs.ls(path, detail=False)):
        match = STEP_DIR.search(entry.rstrip("/"))
        if match:
            url = step_dir(run_dir, int(match.group(1)))
            if not committed_only or exists(join_url(url, COMMIT_MARKER)):
                found.append((int(match.group(1)), url))
    return sorted(found, reverse=True)


def read_checkpoint(url: str, row_range: Callable[[tuple], tuple[int, int]] | None = None,
                    names: Callable[[str], bool] = lambda name: True) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a committed checkpoint: (tensors, state).

    Whole tensors are read in full; for a batch-sharded tensor, `row_range(global_shape)` gives
    the rows this host needs (default: all), assembled from whichever hosts wrote them, so a
    run can resume on a different number of hosts. `names` filters the tensors to read.
    """
    if not exists(join_url(url, COMMIT_MARKER)):
        raise CheckpointError(f"{url} has no {COMMIT_MARKER} marker (an interrupted save)")
    state = json.loads(read_bytes(join_url(url, "state.json")))
    index = {}
    for p in range(state["hosts"]):
        for key, entry in json.loads(read_bytes(join_url(url, f"{host_file(p)}.json"))).items():
            index.setdefault(key, []).append(entry)
    needed_files = sorted({e["file"] for key, entries in index.items() if names(key) for e in entries})
    tensors: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="trm-ckpt-") as tmp:
        local = {}
        for file in needed_files:
            local[file] = os.path.join(tmp, file)
            with open(local[file], "wb") as f:
                f.write(read_bytes(join_url(url, file)))
        handles = {}
        try:
            for file, path in local.items():
                try:
                    handles[file] = safe_open(path, framework="pt")
                except Exception as e:
                    raise CheckpointError(f"{join_url(url, file)} is not a readable safetensors file: "
                                          f"{e}") from e
            for key, entries in index.items():
                if not names(key):
                    continue
                if entries[0]["row_start"] is None:
                    tensors[key] = handles[entries[0]["file"]].get_tensor(key)
                    continue
                shape = tuple(entries[0]["global_shape"])
                start, stop = row_range(shape) if row_range else (0, shape[0])
                parts = []
                for e in sorted(entries, key=lambda e: e["row_start"]):
                    lo, hi = max(start, e["row_start"]), min(stop, e["row_start"] + e["rows"])
                    if lo < hi:
                        block = handles[e["file"]].get_slice(key)
                        parts.append(block[lo - e["row_start"]:hi - e["row_start"]])
                if sum(p.shape[0] for p in parts) != stop - start:
                    raise CheckpointError(f"{url}: rows {start}..{stop} of {key} are not all present")
                tensors[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
        finally:
            handles.clear()
    return tensors, state


def latest_checkpoint(run_dir: str, read: Callable[[str], tuple]) -> tuple[int, str, tuple] | None:
    """The newest checkpoint that `read(url)` accepts, skipping (with a warning naming it)
    directories without a commit marker and unreadable ones."""
    committed = {step for step, _ in list_checkpoints(run_dir, committed_only=True)}
    for step, url in list_checkpoints(run_dir, committed_only=False):
        if step not in committed:
            print(f"warning: skipping {url}: no {COMMIT_MARKER} marker (a save that did not finish)",
                  flush=True)
            continue
        try:
            return step, url, read(url)
        except (CheckpointError, KeyError, ValueError, OSError) as e:
            print(f"warning: skipping unreadable checkpoint {url}: {e}", flush=True)
    return None


# -- export ------------------------------------------------------------------------------------------


def resolve_checkpoint(source: str) -> str | None:
    """The checkpoint a URL names: itself when it is a committed checkpoint directory, else the
    latest committed checkpoint of the run directory it is; None when there is none."""
    if exists(join_url(source, COMMIT_MARKER)):
        return source
    found = list_checkpoints(source)
    return found[0][1] if found else None


def read_ema_weights(checkpoint_url: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(the model's state dict with the EMA's average in place of each averaged tensor, under
    our names without the `model/` prefix; the checkpoint's state.json) of a checkpoint."""
    tensors, state = read_checkpoint(checkpoint_url, names=lambda n: n.startswith(("model/", "ema/")))
    weights = {}
    for key, value in tensors.items():
        if key.startswith("model/"):
            name = key.removeprefix("model/")
            weights[name] = tensors.get(f"ema/{name}", value)
    return weights, state


def export_model(checkpoint_url: str, out_url: str) -> dict:
    """The EMA weights (and the buffers, which have no average) of a checkpoint as one
    model.safetensors whose metadata holds the model config; returns that config."""
    weights, state = read_ema_weights(checkpoint_url)
    model_config = state["config"]["model"]
    metadata = {"trm_config": json.dumps(model_config), "step": str(state["step"])}
    if state.get("dataset_identifiers"):
        metadata["dataset_identifiers"] = state["dataset_identifiers"]
    write_bytes(out_url, safetensors_bytes(weights, metadata=metadata))
    return model_config


def read_exported(url: str) -> tuple[dict[str, torch.Tensor], dict, str | None]:
    """(state_dict in our names, model config dict, fingerprint of the dataset identifiers it
    was trained on or None) of an exported model.safetensors."""
    with tempfile.TemporaryDirectory(prefix="trm-model-") as tmp:
        path = os.path.join(tmp, "model.safetensors")
        with open(path, "wb") as f:
            f.write(read_bytes(url))
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            if "trm_config" not in metadata:
                raise CheckpointError(f"{url} has no trm_config metadata: not a model exported by "
                                      "train.py export")
            return ({k: handle.get_tensor(k) for k in handle.keys()}, json.loads(metadata["trm_config"]),
                    metadata.get("dataset_identifiers"))
