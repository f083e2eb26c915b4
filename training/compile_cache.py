"""XLA's persistent compilation cache: whether it is on, the line that says what it did, and its
files kept in a bucket so that a new VM (a spot slice created again after a preemption) could
start stepping without compiling from scratch.

**torch_xla 2.9 cannot load its persistent cache on a TPU**: loading a cached program calls
PJRT's DeserializeExecutable, which the TPU client answers UNIMPLEMENTED, so the entry is
dropped and the program compiled again on every launch (pytorch/xla#9094, open at 2.9.0; the fix
proposed in pytorch/xla#9759 is unreleased; the CPU client fails the same way). So on 2.9 the
cache is off by default (`local_dir`): writing it would only cost serialization and disk. A
directory given with --run.compile-cache-dir turns it on anyway, and a torch_xla without this
flaw turns it on by default. After the first steps of a launch process 0 prints one line
(`CompileCache`): hits, misses and failed loads from torch_xla's PersistentCacheHit /
PersistentCacheMiss / PersistentCacheDeserializeFailure counters, and the graphs compiled with
their seconds, so a run shows whether the cache did anything.

With --run.compile-cache-url (off by default, also in `launch.sh train`) the local cache's files
also live under {url}/{key}/, the key naming what a compiled program depends on: the accelerator
type, the torch_xla and libtpu versions and the code hash (launch.sh's, see code_hash). Then

    key_for(device) -> key           this host's key (cache_key of sharding.accelerator_type)
    restore(url, local_dir, key)     before the runtime starts, on every host: the key's files
                                     that the local cache lacks are copied into it
    CompileCache(url, local_dir, key, main_host, first_step, counters)
        .after_step(step)            after the first steps of a launch have compiled: process 0
                                     prints the cache's line and (a background thread) copies
                                     the local files that the bucket lacks
        .close()                     at the end of the run or on exit: the upload, once more
    restore_run(run), CompileCache.for_run(run, ...): the same for a RunConfig

Everything here is best effort: a failure prints a warning and the run goes on (compiling).
The files are copied through rundir/storage.py. The CPU backend is not given the cache (it could not
load it either), so no files appear there; the tests check the copies through the GCS emulator.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import threading
import time

from rundir import storage

MANIFEST = ".trm-code-sha256sums"
"""The sha256 sums of every deployed file, written by launch.sh deploy next to train.py; the
sha256 of this file is the code hash that deploy, check and status show."""
UPLOAD_AFTER_STEPS = 2
"""The first upload follows this many training steps of a launch: the training step's programs
are compiled by then (the evaluation's are uploaded at the end of the run)."""
RETRY = dict(attempts=2, budget_s=20.0)
"""Retries of each listing and file: a cache that cannot be reached costs little time."""
JOIN_TIMEOUT_S = 120.0
"""How long close() waits for an upload under way before it gives up on the last one."""

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: train.py and the packages
DEFAULT_DIR = "~/.cache/trm-xla"
"""The local cache's directory when it is on without --run.compile-cache-dir."""
CANNOT_LOAD = {"2.9": "pytorch/xla#9094"}
"""torch_xla releases (major.minor) whose TPU client cannot load a persisted program, and why."""


def load_problem(torch_xla_version: str | None = None) -> str | None:
    """Why this torch_xla cannot load its persistent cache on a TPU (its issue), or None."""
    version = torch_xla_version or _version("torch_xla")
    return CANNOT_LOAD.get(".".join(version.split(".")[:2]))


def local_dir(run, device_kind: str = "TPU") -> str | None:
    """The persistent cache's local directory for a RunConfig, or None (off): a TPU only; the
    given run.compile_cache_dir, else DEFAULT_DIR where torch_xla can load the cache or where
    run.compile_cache_url asks to keep its files."""
    if device_kind != "TPU":
        return None
    if run.compile_cache_dir:
        return run.compile_cache_dir
    return DEFAULT_DIR if run.compile_cache_url or not load_problem() else None


def state_line(counters: dict, cache_dir: str | None, device_kind: str) -> str:
    """One line of what the cache did so far: `counters` from sharding.xla_counters()."""
    compiled = f"{counters['compiles']} graphs compiled in {counters['compile_seconds']:.1f}s"
    if cache_dir is None:
        why = (f"the {device_kind} runtime is not given the cache" if device_kind != "TPU" else
               f"torch_xla {_version('torch_xla')} cannot load it on a TPU ({load_problem()}): "
               "--run.compile-cache-dir turns it on anyway")
        return f"compile cache: off ({why}); {compiled}"
    return (f"compile cache ({cache_dir}): {counters['cache_hits']} hits, {counters['cache_misses']} misses, "
            f"{counters['cache_load_failures']} failed loads; {compiled}")


def code_hash(project_dir: str = PROJECT_DIR) -> str:
    """The code hash of deployed code (the sha256 of launch.sh deploy's manifest, as launch.sh
    and worker.sh compute it); elsewhere the sha256 of the checkout's .py files: train.py and the
    other files at the top, and those of its packages (each folder with an __init__.py)."""
    manifest = os.path.join(project_dir, MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    digest = hashlib.sha256()
    packages = [d for d in os.listdir(project_dir) if os.path.isfile(os.path.join(project_dir, d, "__init__.py"))]
    names = [n for n in os.listdir(project_dir) if n.endswith(".py")]
    names += [f"{d}/{n}" for d in packages if d != "tests" for n in os.listdir(os.path.join(project_dir, d))
              if n.endswith(".py")]
    for name in sorted(names):
        with open(os.path.join(project_dir, name), "rb") as f:
            digest.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def _version(*packages: str) -> str:
    for package in packages:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "none"


def cache_key(accelerator: str, project_dir: str = PROJECT_DIR) -> str:
    """One directory name per (accelerator type, torch_xla version, libtpu version, code hash),
    e.g. v4-64_torch_xla-2.9.0_libtpu-0.0.21_code-0123456789abcdef."""
    key = (f"{accelerator}_torch_xla-{_version('torch_xla')}_libtpu-{_version('libtpu', 'libtpu-nightly')}"
           f"_code-{code_hash(project_dir)[:16]}")
    return re.sub(r"[^A-Za-z0-9._+-]", "-", key)


@functools.cache
def key_for(device: str) -> str:
    """The cache key of this host for run.device (auto, tpu or cpu), before the runtime starts."""
    import sharding

    return cache_key(sharding.accelerator_type(device))


def restore_run(run) -> tuple[int, int] | None:
    """restore() for a RunConfig (run.compile_cache_url, run.compile_cache_dir, run.device), with
    a warning when this torch_xla cannot load what it restores."""
    if not run.compile_cache_url:
        return None
    if load_problem():
        print(f"warning: compile cache: torch_xla {_version('torch_xla')} cannot load a persistent cache on a TPU "
              f"({load_problem()}): restoring {run.compile_cache_url} as --run.compile-cache-url asks, but the "
              "programs will compile again", flush=True)
    return restore(run.compile_cache_url, run.compile_cache_dir or DEFAULT_DIR, key_for(run.device))


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _local_files(local_dir: str) -> dict[str, int]:
    """{relative path, '/' separated: size} of the complete files of the local cache."""
    out = {}
    for root, _, files in os.walk(local_dir):
        for name in files:
            if name.startswith(".") or ".partial-" in name:
                continue  # temporary files (ours, or being written)
            path = os.path.join(root, name)
            try:
                out[os.path.relpath(path, local_dir).replace(os.sep, "/")] = os.path.getsize(path)
            except OSError:
                pass
    return out


def restore(url: str | None, local_dir: str, key: str) -> tuple[int, int] | None:
    """Copy the files of {url}/{key}/ that `local_dir` lacks into it; one line says how many
    from where. Returns (files, bytes), or None when off (no url) or on failure (a warning)."""
    if not url:
        return None
    remote, local_dir = storage.join_url(url, key), os.path.expanduser(local_dir)
    started = time.time()
    try:
        storage.check_url(url, "run.compile_cache_url")
        files, size = storage.download_dir(remote, local_dir, skip_existing=True, **RETRY)
    except Exception as e:  # noqa: BLE001 - best effort: the run compiles instead
        print(f"warning: compile cache: could not restore from {remote} ({type(e).__name__}: {e}); "
              "compiling from scratch", flush=True)
        return None
    print(f"compile cache: restored {files} files ({_megabytes(size)}) from {remote} into {local_dir} "
          f"in {time.time() - started:.1f}s", flush=True)
    return files, size


def upload(url: str, local_dir: str, key: str, names: dict[str, int] | None = None) -> tuple[int, int] | None:
    """Copy the files of the local cache (or just `names`, {relative path: size}) that
    {url}/{key}/ lacks; one line says how many to where. Returns (files, bytes), or None on
    failure (a warning)."""
    remote, local_dir = storage.join_url(url, key), os.path.expanduser(local_dir)
    started = time.time()
    try:
        local = _local_files(local_dir) if names is None else names
        there = storage.list_files(remote, **RETRY) if local else {}
        new = {name: size for name, size in local.items() if name not in there}
        files = storage.upload_dir(local_dir, remote, only=set(new), **RETRY) if new else 0
    except Exception as e:  # noqa: BLE001 - best effort: never fails the run
        print(f"warning: compile cache: could not upload to {remote} ({type(e).__name__}: {e}); "
              "the run goes on", flush=True)
        return None
    size = sum(new.values())
    print(f"compile cache: uploaded {files} new files ({_megabytes(size)}) to {remote} "
          f"in {time.time() - started:.1f}s", flush=True)
    return files, size


class CompileCache:
    """The cache's part in a training launch, on process 0: after its first UPLOAD_AFTER_STEPS
    steps the line of what the cache did (`state_line`), and with a url the upload of new files,
    in the background and again at close(). Other hosts do nothing."""

    def __init__(self, url: str | None, local_dir: str, key: str, main_host: bool, first_step: int,
                 counters=None, device_kind: str = "TPU", runtime_dir: str | None = None):
        self.url, self.local_dir, self.key = url, local_dir, key  # local_dir: the files synced with url
        self.main_host, self.counters, self.device_kind = main_host, counters, device_kind
        self.runtime_dir = runtime_dir  # the cache the runtime was given (None: off)
        self.enabled = bool(url) and main_host
        self.upload_step = first_step + UPLOAD_AFTER_STEPS
        self.thread: threading.Thread | None = None
        self.results: list[tuple[int, int] | None] = []
        self.said = False

    @classmethod
    def for_run(cls, run, main_host: bool, first_step: int, counters=None, device_kind: str = "TPU") -> CompileCache:
        """The cache of a RunConfig's launch (run.compile_cache_url, .compile_cache_dir, .device);
        `counters`: sharding.xla_counters, read for the line."""
        key = key_for(run.device) if run.compile_cache_url and main_host else ""
        return cls(run.compile_cache_url, run.compile_cache_dir or DEFAULT_DIR, key, main_host, first_step, counters,
                   device_kind, local_dir(run, device_kind))

    def _upload(self, names: dict[str, int] | None) -> None:
        self.results.append(upload(self.url, self.local_dir, self.key, names))

    def _say(self) -> None:
        if self.main_host and self.counters is not None and not self.said:
            self.said = True
            print(state_line(self.counters(), self.runtime_dir, self.device_kind), flush=True)

    def after_step(self, step: int) -> None:
        if step != self.upload_step or not self.main_host:
            return
        self._say()
        if self.enabled and self.thread is None:
            # The files listed now are complete (their programs ran); later ones wait for close().
            names = _local_files(os.path.expanduser(self.local_dir))
            self.thread = threading.Thread(target=self._upload, args=(names,), daemon=True,
                                           name="trm-compile-cache")
            self.thread.start()

    def close(self) -> None:
        """The line, if a launch shorter than UPLOAD_AFTER_STEPS has not said it, and the last
        upload (the files compiled since, e.g. the evaluation's); never raises."""
        self._say()
        if not self.enabled:
            return
        if self.thread is not None:
            self.thread.join(JOIN_TIMEOUT_S)
            if self.thread.is_alive():
                print("warning: compile cache: the upload under way did not finish; not uploading again",
                      flush=True)
                return
        self._upload(None)
