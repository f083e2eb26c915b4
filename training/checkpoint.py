"""Distributed safetensors checkpoints on any fsspec URL (gs:// first), and model export.

A checkpoint is a directory `{run_dir}/checkpoints/step_{N:08d}/`:

    host_{p:03d}-{attempt}.safetensors  the tensors host p owns: its share of the replicated
                               tensors and its rows of the batch-sharded ones (the ACT carry)
    host_{p:03d}-{attempt}.json  host p's index: the save attempt, and per tensor its file, dtype,
                               global shape, rows; written after the safetensors file
    state.json                 what is not a tensor: step, config, hosts, attempt (process 0)
    COMMITTED                  written last by process 0 (with the attempt), once every host's
                               index of this attempt exists

Both of a host's files carry the save attempt in their name, so no write of another attempt
(an interrupted earlier save, or a deposed host of an old launch writing late) can replace a
file of this one: the commit waits for exactly this attempt's index names, and a reader takes
the attempt from COMMITTED and reads those names. Checkpoints written before the index's name
carried the attempt have `host_{p:03d}.json` (with the attempt inside, or none at all in the
oldest); readers fall back to it. Once committed, process 0 removes the step directory's files
of other attempts (data files and indexes; a late write after that is litter, never read).

Hosts write in parallel from a background thread; nothing crosses hosts but files, so a
host that dies before finishing leaves no COMMITTED marker, and discovery skips the
directory. Every launch of a run saves under an attempt id of its own (the same on every host),
so a save never commits, nor a reader accepts, files that an interrupted earlier save left in
the same step directory. Every read and write goes through rundir/storage.py (fsspec, with retries).
This file imports torch, safetensors and rundir/storage.py, never torch_xla: exported models load
anywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from rundir.storage import StorageError, exists, filesystem, join_url, read_bytes, with_retries, write_bytes

COMMIT_MARKER = "COMMITTED"
STEP_DIR = re.compile(r"step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint's contents are unreadable or not committed (a failing read or write of
    storage raises storage.StorageError)."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint reads fine but its tensors are not the state's: some are missing, extra or
    of another shape or dtype (the message lists them)."""


def new_attempt_id() -> str:
    """A fresh id for the saves of one launch (process 0 makes it, every host uses it)."""
    return uuid.uuid4().hex[:12]


def step_dir(run_dir: str, step: int) -> str:
    return join_url(run_dir, "checkpoints", f"step_{step:08d}")


def host_file(p: int) -> str:
    return f"host_{p:03d}"


def index_file(p: int, attempt: str | None) -> str:
    """The name of host p's index of save `attempt` (None: the name before attempts were in it)."""
    return f"{host_file(p)}.json" if attempt is None else f"{host_file(p)}-{attempt}.json"


HOST_FILE = re.compile(r"host_\d{3}(-(?P<attempt>[^.]+))?\.(json|safetensors)$")


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

    `save` returns once the background write has started; the next `save`, `wait` or `check`
    reports a failed one. `attempt` (the same on every host of a launch, different for every
    launch) marks this launch's files, so that the commit waits for this launch's index of every
    host even where an interrupted earlier launch left its own in the same step directory.
    """

    def __init__(self, run_dir: str, process_index: int, process_count: int, keep: int = 3,
                 commit_timeout_s: float = 1800.0, attempt: str | None = None):
        if keep < 1:
            raise ValueError(f"run.keep_checkpoints must be >= 1, got {keep}")
        self.run_dir, self.process_index, self.process_count = run_dir, process_index, process_count
        self.keep, self.commit_timeout_s = keep, commit_timeout_s
        self.attempt = attempt or new_attempt_id()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None  # the step of the save under way or last finished

    def save(self, step: int, shards: dict[str, Shard], state: dict) -> None:
        self.wait()
        self.step = step
        # A daemon, so that it never holds the process after the main thread has given up on it:
        # the training loop joins it (Checkpoints.close) however the loop ends.
        self._thread = threading.Thread(target=self._write, args=(step, shards, state), daemon=True,
                                        name=f"checkpoint-{step}")
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait (at most timeout_s) for the save under way; raise if it (or an earlier one)
        failed. False if it is still under way after timeout_s."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        self.check()
        return True

    def busy(self) -> bool:
        """Whether a save is under way."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise at once if a save has failed (without waiting for one under way)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, step: int, shards: dict[str, Shard], state: dict) -> None:
        try:
            if self.process_index == 0:  # a marker of an earlier save of this step no longer holds
                remove_if_present(join_url(step_dir(self.run_dir, step), COMMIT_MARKER))
            self._write_host_part(step, shards)
            if self.process_index == 0:
                self._commit(step, state)
                self._delete_old(step)
        except BaseException as e:  # reported to the training loop by check() / wait()
            self._error = e

    def _write_host_part(self, step: int, shards: dict[str, Shard]) -> None:
        directory = step_dir(self.run_dir, step)
        name = host_file(self.process_index)
        data_file = f"{name}-{self.attempt}.safetensors"
        tensors = {key: shard.tensor.contiguous() for key, shard in shards.items()}
        index = {key: {"file": data_file, "dtype": str(shard.tensor.dtype).removeprefix("torch."),
                       "global_shape": list(shard.global_shape), "row_start": shard.row_start,
                       "rows": None if shard.row_start is None else shard.tensor.shape[0]}
                 for key, shard in shards.items()}
        write_bytes(join_url(directory, data_file), safetensors_bytes(tensors) if tensors else b"")
        write_bytes(join_url(directory, index_file(self.process_index, self.attempt)),
                    json.dumps({"attempt": self.attempt, "tensors": index}).encode())

    def _commit(self, step: int, state: dict) -> None:
        directory = step_dir(self.run_dir, step)
        waiting = set(range(self.process_count))  # hosts whose index of this attempt is not seen yet
        deadline = time.time() + self.commit_timeout_s
        fs, path = filesystem(directory)
        while True:
            fs.invalidate_cache(path)
            listed = {os.path.basename(p) for p in with_retries("listing", directory,
                                                               lambda: fs.ls(path, detail=False))}
            waiting = {p for p in waiting if index_file(p, self.attempt) not in listed}
            if not waiting:
                break
            if time.time() > deadline:
                missing = [index_file(p, self.attempt) for p in sorted(waiting)]
                raise CheckpointError(f"checkpoint {directory} not committed: no index of this save from "
                                      f"{missing} after {self.commit_timeout_s:.0f}s (a host died or cannot write)")
            time.sleep(0.2)
        write_bytes(join_url(directory, "state.json"),
                    json.dumps(dict(state, hosts=self.process_count, attempt=self.attempt)).encode())
        write_bytes(join_url(directory, COMMIT_MARKER),
                    json.dumps({"step": step, "time": time.time(), "attempt": self.attempt}).encode())
        for name in sorted(listed):  # data files and indexes of other saves of this step
            match = HOST_FILE.match(name)
            if match and match.group("attempt") != self.attempt:
                try:  # through with_retries: a deposed trainer stops here (the fence, fleet/fencing.py)
                    with_retries("removing", join_url(directory, name),
                                 lambda name=name: fs.rm(f"{path.rstrip('/')}/{name}"), attempts=1)
                except Exception as e:  # costs storage, not correctness
                    print(f"warning: could not delete {join_url(directory, name)}: {e}", flush=True)

    def _delete_old(self, newest: int) -> None:
        committed = [s for s, _ in list_checkpoints(self.run_dir, committed_only=True)]
        doomed = [s for s in committed if s < newest][self.keep - 1:] if newest in committed else []
        # Uncommitted directories older than the newest commit are dead writes: remove them too.
        doomed += [s for s, _ in list_checkpoints(self.run_dir, committed_only=False)
                   if s < newest and s not in committed]
        for s in doomed:
            url = step_dir(self.run_dir, s)
            fs, path = filesystem(url)
            try:  # through with_retries: the fence, as for every removal
                with_retries("removing", url, lambda fs=fs, path=path: fs.rm(path, recursive=True), attempts=1)
            except Exception as e:  # a leftover directory costs storage, not correctness
                print(f"warning: could not delete old checkpoint {url}: {e}", flush=True)


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


def read_index(url: str, p: int, attempt: str | None) -> tuple[str, str | None, dict]:
    """(file name, save attempt, tensor name -> entry) of host p's index of save `attempt` (the
    commit's) in checkpoint directory `url`: `host_{p:03d}-{attempt}.json`, or where there is none
    (a checkpoint written before index names carried the attempt) `host_{p:03d}.json`, whose
    attempt the caller compares with the commit's; the attempt is None in checkpoints written
    before attempts existed. A missing index raises storage.StorageError naming the new name."""
    names = [index_file(p, None)] if attempt is None else [index_file(p, attempt), index_file(p, None)]
    first_error = None
    for name in names:
        try:
            payload = read_bytes(join_url(url, name))
        except StorageError as e:
            if not isinstance(e.__cause__, FileNotFoundError):
                raise
            first_error = first_error or e
            continue
        index = _parse_json(payload, join_url(url, name))
        if "tensors" in index and "attempt" in index:
            return name, index["attempt"], index["tensors"]
        return name, None, index
    raise first_error


def remove_if_present(url: str) -> None:
    fs, path = filesystem(url)
    if with_retries("checking", url, lambda: fs.exists(path)):
        with_retries("deleting", url, lambda: fs.rm(path))


def read_checkpoint(url: str, row_range: Callable[[str, tuple], tuple[int, int]] | None = None,
                    names: Callable[[str], bool] = lambda name: True) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a committed checkpoint: (tensors, state).

    Whole tensors are read in full; for a tensor saved by rows (the carry, the puzzle table),
    `row_range(name, global_shape)` gives the rows this host needs (default: all), assembled
    from whichever hosts wrote them, so a run can resume on a different number of hosts.
    `names` filters the tensors to read.
    Raises CheckpointError for contents that cannot be what was saved (no marker, indexes of
    another save attempt, unreadable files, missing rows) and storage.StorageError when storage
    fails.
    """
    marker_url = join_url(url, COMMIT_MARKER)
    if not exists(marker_url):
        raise CheckpointError(f"{url} has no {COMMIT_MARKER} marker (an interrupted save)")
    attempt = _parse_json(read_bytes(marker_url), marker_url).get("attempt")
    state = _parse_json(read_bytes(join_url(url, "state.json")), join_url(url, "state.json"))
    if not isinstance(state.get("hosts"), int):
        raise CheckpointError(f"{join_url(url, 'state.json')} does not say how many hosts wrote the checkpoint")
    if state.get("attempt") != attempt:  # a deposed process 0's late state.json or marker
        raise CheckpointError(f"{url}: state.json belongs to save attempt {state.get('attempt')}, the commit to "
                              f"{attempt} (files of two saves of this step are mixed)")
    index = {}
    for p in range(state["hosts"]):
        name, host_attempt, entries = read_index(url, p, attempt)
        if host_attempt != attempt:
            raise CheckpointError(f"{url}: {name} belongs to save attempt {host_attempt}, the "
                                  f"commit to {attempt} (files of two saves of this step are mixed)")
        for key, entry in entries.items():
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
                try:
                    tensors[key] = _assemble(key, entries, handles, row_range)
                except CheckpointError as e:
                    raise CheckpointError(f"{url}: {e}") from e
                except Exception as e:  # safetensors: a truncated or overwritten file
                    raise CheckpointError(f"{url}: {key} cannot be read: {e}") from e
        finally:
            handles.clear()
    return tensors, state


def _parse_json(payload: bytes, url: str) -> dict:
    try:
        return json.loads(payload)
    except ValueError as e:
        raise CheckpointError(f"{url} is not valid JSON: {e}") from e


def _assemble(key: str, entries: list[dict], handles: dict, row_range) -> torch.Tensor:
    """A whole tensor from its file, or the rows `row_range` asks for of a batch-sharded one,
    from every host's file that holds some of them."""
    if entries[0]["row_start"] is None:
        return handles[entries[0]["file"]].get_tensor(key)
    shape = tuple(entries[0]["global_shape"])
    start, stop = row_range(key, shape) if row_range else (0, shape[0])
    parts = []
    for e in sorted(entries, key=lambda e: e["row_start"]):
        lo, hi = max(start, e["row_start"]), min(stop, e["row_start"] + e["rows"])
        if lo < hi:
            block = handles[e["file"]].get_slice(key)
            parts.append(block[lo - e["row_start"]:hi - e["row_start"]])
    if sum(p.shape[0] for p in parts) != stop - start:
        raise CheckpointError(f"rows {start}..{stop} of {key} are not all present")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def state_differences(expected: dict[str, tuple[tuple, torch.dtype]], found: dict[str, torch.Tensor]) -> list[str]:
    """How the tensors `found` differ from the `expected` (name -> (shape, dtype)): missing,
    unexpected, or of another shape or dtype; empty when they match."""
    out = [f"missing: {name} {list(shape)} {str(dtype).removeprefix('torch.')}"
           for name, (shape, dtype) in expected.items() if name not in found]
    out += [f"not in the training state: {name}" for name in found if name not in expected]
    for name, (shape, dtype) in expected.items():
        if name in found and (tuple(found[name].shape) != tuple(shape) or found[name].dtype != dtype):
            out.append(f"{name}: {list(found[name].shape)} {str(found[name].dtype).removeprefix('torch.')} "
                       f"in the checkpoint, {list(shape)} {str(dtype).removeprefix('torch.')} in the state")
    return out


def newest_readable(run_dir: str, read: Callable[[str], tuple], say=print) -> tuple[int, str, tuple] | None:
    """(step, url, read(url)) of the newest committed checkpoint whose contents `read` accepts,
    saying which newer ones it passes over and why; None when the run has no committed
    checkpoint. A storage failure (storage.StorageError) is raised, never passed over: an
    outage must not make a run go back to an older step. Raises CheckpointError naming them
    when committed checkpoints exist but none can be read."""
    committed = list_checkpoints(run_dir, committed_only=True)
    newest = committed[0][0] if committed else -1
    for step, url in list_checkpoints(run_dir, committed_only=False):
        if step > newest:
            say(f"note: passing over {url}: no {COMMIT_MARKER} marker (a save that did not finish)")
    unreadable = []
    for step, url in committed:
        try:
            return step, url, read(url)
        except IncompleteCheckpointError:
            raise
        except CheckpointError as e:
            say(f"warning: passing over unreadable checkpoint {url}: {e}")
            unreadable.append(url)
    if unreadable:
        raise CheckpointError(f"no committed checkpoint of {run_dir} can be read: {', '.join(unreadable)}")
    return None


# -- export ------------------------------------------------------------------------------------------


def is_directory(url: str) -> bool:
    fs, path = filesystem(url)
    return with_retries("checking", url, lambda: fs.isdir(path))


def weights_of(source: str, say=print) -> tuple[dict[str, torch.Tensor], dict, str] | None:
    """(EMA weights, state.json, checkpoint url) of the checkpoint `source` names: itself when
    it is a committed checkpoint directory, else the newest readable committed checkpoint of
    the run directory it is (saying which newer ones are passed over). None when `source` is
    not a directory (a file: an exported or reference model). Raises CheckpointError for a
    directory without a readable committed checkpoint."""
    if exists(join_url(source, COMMIT_MARKER)):
        return (*read_ema_weights(source), source)
    if not is_directory(source):
        return None
    found = newest_readable(source, read_ema_weights, say)
    if found is None:
        unfinished = [url for _, url in list_checkpoints(source, committed_only=False)]
        raise CheckpointError(
            f"no committed checkpoint in {source} (looked in {join_url(source, 'checkpoints')}"
            + (f"; {len(unfinished)} save(s) there did not finish: {', '.join(unfinished)}" if unfinished else "")
            + ")")
    step, url, (weights, state) = found
    return weights, state, url


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


def export_model(weights: dict[str, torch.Tensor], state: dict, out_url: str) -> dict:
    """EMA weights (and the buffers, which have no average) and their checkpoint's state as one
    model.safetensors whose metadata holds the model config; returns that config."""
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


# -- the training loop's periodic save -----------------------------------------------------------


class Checkpoints:
    """Saves every run.ckpt_every steps (and when asked: SIGTERM, the end), asynchronously: the
    loop pauses only for the device-to-host copy. A save first waits for the metric windows
    read so far and stops the run, without saving, if one was not finite. A failed background
    save stops the loop at the next step; `close` (in the loop's `finally`) lets a save under
    way commit, or reports it, however the loop ends. `config` is config.Config, `trainer` a
    trainer.Trainer (its checkpoint_shards), `log` the run's run_log.RunLog (drained before a
    save: all hosts stop together on a non-finite window), `launch` the launch_records.Launch that
    counts the loop's pauses to save."""

    def __init__(self, config, trainer, log, identifiers: str | None, total_steps: int, saved_step: int | None,
                 launch=None):
        self.config, self.trainer, self.log, self.total_steps = config, trainer, log, total_steps
        self.identifiers, self.sharding = identifiers, trainer.sharding
        self.host, self.num_hosts = self.sharding.process_index(), self.sharding.process_count()
        # One attempt id for this launch's saves, the same on every host (training/checkpoint.py).
        attempt = self.sharding.broadcast_object(new_attempt_id())
        self.writer = CheckpointWriter(config.run.dir, self.host, self.num_hosts, keep=config.run.keep_checkpoints,
                                       attempt=attempt)
        self.saved_step = saved_step  # the step whose checkpoint exists or is being written
        self.transfers = 0  # device-to-host transfers of the saves (counted apart from the loop's)
        self.launch = launch

    def _pause(self, count: bool = True):
        return self.launch.pause("checkpoint", count) if self.launch else contextlib.nullcontext()

    def due(self, step: int) -> bool:
        return step % self.config.run.ckpt_every == 0 or step == self.total_steps

    def after_step(self, step: int) -> None:
        self.writer.check()  # a background save that failed stops the run now, not at the next save
        if self.due(step) and step != self.total_steps:  # the last step's save comes after the loop
            self.save(step)

    def save(self, step: int, wait: bool = False) -> None:
        """Save this step (unless its checkpoint exists or is being written already)."""
        if step != self.saved_step:
            with self._pause():
                self.log.drain()  # every host has now read the same windows, so all stop here together
                self._stop_if_not_finite()
                before = self.sharding.xla_counters()["transfers"]
                shards = self.trainer.checkpoint_shards(self.host)  # the loop's pause
                self.transfers += self.sharding.xla_counters()["transfers"] - before
                self.writer.save(step, shards, {"step": step, "config": dataclasses.asdict(self.config),
                                                "dataset_identifiers": self.identifiers})
            self.saved_step = step
        if wait:
            self.wait()

    def wait(self) -> None:
        with self._pause(count=False):
            self.writer.wait()

    def close(self, error_wait_s: float = 120.0) -> None:
        """Wait for a save under way. With an exception already on its way out, wait at most
        `error_wait_s` (process 0 may be waiting for a host that is gone) and print a failed
        save rather than raise it, so that neither error hides the other."""
        leaving_on_error = sys.exc_info()[1] is not None
        if self.writer.busy():
            self.log.say(f"waiting for the checkpoint of step {self.writer.step} to be written")
        try:
            if not self.writer.wait(error_wait_s if leaving_on_error else None):
                print(f"error: the checkpoint of step {self.writer.step} is still not written after "
                      f"{error_wait_s:.0f}s (another host's part missing?): exiting without it",
                      file=sys.stderr, flush=True)
        except BaseException as e:
            if not leaving_on_error:
                raise
            print(f"error: the checkpoint of step {self.writer.step} was not saved either: {e!r}",
                  file=sys.stderr, flush=True)

    def _stop_if_not_finite(self) -> None:
        """A NaN state must never replace the last good checkpoint."""
        if self.log.nonfinite is None:
            return
        self.writer.wait()  # a save already under way holds checked steps: let it commit
        committed = list_checkpoints(self.config.run.dir)
        last = f"{committed[0][1]} (step {committed[0][0]})" if committed else "none yet"
        optim, dtype = self.config.optim, self.config.model.forward_dtype
        self.log.close()  # the non-finite window's record reaches metrics/ and tb/ before the exit
        raise SystemExit(
            f"error: the training loss or metrics are not finite ({self.log.nonfinite}); stopped without "
            f"saving. Last committed checkpoint: {last}; relaunching resumes from it and will likely "
            f"diverge again. Try a lower --optim.lr (now {optim.lr:g}), a longer --optim.lr-warmup-steps "
            f"(now {optim.lr_warmup_steps})"
            + ("" if dtype == "float32" else f", or --model.forward-dtype float32 (now {dtype})")
            + ", with --run.allow-config-change to continue this run directory.")
