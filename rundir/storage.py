"""Files at any fsspec URL (local or gs://): reads and writes with retries, errors that say what to do.

    filesystem(url) -> (fs, path)     join_url(url, *parts) -> url     is_local(fs) -> bool
    check_url(url, what, local_only=False)   StorageError unless the URL can be opened: a local
                                      path or a scheme fsspec knows, with a bucket where needed
    read_bytes(url) -> bytes          write_bytes(url, payload)        exists(url) -> bool
    write_file(url, write)            write(f) fills the file's binary handle (e.g. np.save)
    upload_dir(local_dir, url)        copy every file under a local directory, whole files
    list_files(url) -> {name: size}   every file under a URL, by relative path ({} if none)
    download_dir(url, local_dir)      copy every file under a URL (missing ones only) to a local
                                      directory, each whole (renamed into place when complete)
    with_retries(what, url, fn)       fn() with retries; what the functions above use (they take its
                                      attempts= and budget_s= too: attempts=1 for best effort)
    read_json(url, what, error)       one attempt: FileNotFoundError passes, for the caller to
                                      explain what is missing
    access_errors(url, error)         context manager: credential, permission and network
                                      failures become ``error("Cannot access URL: ...")``
    cloud_problem(exc) -> str | None  the sentence behind those messages

Writes create missing local parent directories (object stores have none). Retried operations
retry everything but permanent errors (missing files, permissions, bad values) with exponential
backoff and raise StorageError naming the operation, the URL and the cause.

Every failure takes bounded time, so that a lasting outage stops a run instead of hanging it:
- one request to GCS gives up when connecting or waiting for an answer takes REQUEST_TIMEOUT_S
  (gcsfs sets no timeout: a server that accepts connections and never answers would hang a read
  or write forever); gcsfs itself tries each request 6 times with 1-17 s pauses, so one attempt
  of ours fails within minutes, refused or silent (docs/measurements.md);
- with_retries starts no new attempt RETRY_BUDGET_S after its first: a lasting outage fails in
  2-3 minutes, a shorter one (a 45 s blip) is ridden out.
Not bounded: a large upload stuck mid-body (the peer's TCP window stays closed) waits on TCP.

Writes into a fenced directory (fleet/fencing.py: a study's trainer, whose lease may run out) first
ask the fence: `set_fence(check)` installs `check(url)`, called before every attempt of a write,
create, removal or move (every one goes through with_retries). Two switches for tests, read from
the environment: TRM_STORAGE_AUDIT=FILE appends a line (process, operation, URL, time) per write
and removal to a local file; TRM_STORAGE_FAULTS=FILE injects failures into retried operations
(`_inject`).

An emulator named by STORAGE_EMULATOR_HOST is reached anonymously; real GCS uses the default
credentials. This module imports fsspec and the standard library only (and aiohttp, which gcsfs
needs anyway, when it opens a gs:// URL).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator

import fsspec


class StorageError(OSError):
    """Reading or writing a URL failed; the message names the operation, the URL and the cause."""


# Errors that another attempt cannot fix.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError)

REQUEST_TIMEOUT_S = 20.0
"""A GCS request fails (and gcsfs retries it) when connecting, or waiting for the next bytes of
the answer, takes longer: a healthy GCS answers in well under a second. Whole-object downloads
are not limited in total (datasets can be large), only in silence."""


def _seconds_from_env(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SystemExit(f"error: {name}={text!r} is not a number of seconds above 0; unset it for {default:g} s")
    return value


RETRY_BUDGET_S = _seconds_from_env("TRM_STORAGE_RETRY_BUDGET_S", 120.0)
"""with_retries starts no new attempt this many seconds after its first (environment variable
TRM_STORAGE_RETRY_BUDGET_S: longer where storage outages last longer)."""
RETRY_MAX_DELAY_S = 15.0
"""with_retries' pause between attempts doubles from first_delay up to this."""

# What with_retries waits with and measures time by (tests replace them).
_sleep, _clock = time.sleep, time.monotonic

MUTATING = ("writing", "creating", "removing", "deleting", "moving")
"""with_retries' operations that change storage: each attempt first asks the fence."""
_fence: Callable[[str], None] | None = None
REMOVALS = ("removing", "deleting")
"""with_retries' removals: "not found" on a retry (an earlier attempt's answer lost) is done, not
an error; on the first attempt it stays one."""


def set_fence(check: Callable[[str], None] | None) -> None:
    """Install `check(url)`, called before every change to storage this process makes (it ends
    the process, or raises, when the change must not happen); None removes it."""
    global _fence
    _fence = check


_fence_passed = threading.local()  # .time: when this thread's last write passed the fence


def _check_fence(url: str, op: str) -> None:
    """Ask the fence (if any) before changing `url`; recorded in the audit file (if any)."""
    if _fence is not None:
        _fence(url)
    if op == "writing":  # writes are recorded once they landed (write_file), with this time
        _fence_passed.time = time.time()
    else:
        _audit(op, url)


def _audit(op: str, url: str, checked: float | None = None) -> None:
    """One line in the audit file (TRM_STORAGE_AUDIT, for tests): who changed what, when; for a
    write, `checked`: when its last attempt passed the fence (a process stopped between the
    landing and this line records a later time than the landing's)."""
    path = os.environ.get("TRM_STORAGE_AUDIT")
    if path:
        record = {"pid": os.getpid(), "op": op, "url": url, "time": time.time()}
        if checked is not None:
            record["checked"] = checked
        line = json.dumps(record) + "\n"
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, line.encode())  # one write with O_APPEND: lines never interleave
        finally:
            os.close(descriptor)


class InjectedFault(ConnectionError):
    """A failure injected by TRM_STORAGE_FAULTS (tests): retried like any network error."""


_injected: dict[int, int] = {}  # rule index -> how many times this process applied it


def _inject(what: str, url: str, fn: Callable) -> Callable:
    """fn, or fn with a fault, as the rules of the file TRM_STORAGE_FAULTS say (for tests; read at
    every attempt, so a test switches faults on and off while processes run). One JSON rule a
    line: {"what": OPERATION or "*", "match": a substring of the URL, "mode": "fail" (raise before
    fn), "lose" (run fn, then raise: its answer lost) or "hold" (touch the file GATE.held, wait
    until the file GATE (the rule's "gate") exists, then run fn: a request held after the fence's
    check, so that a test orders it against other processes' writes), "from": and "until":
    wall-clock times (optional), "count": at most this many times per process (optional)}."""
    path = os.environ.get("TRM_STORAGE_FAULTS")
    if not path:
        return fn
    try:
        with open(path) as f:
            rules = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return fn
    now = time.time()
    for index, rule in enumerate(rules):
        if rule.get("what", "*") not in ("*", what) or rule.get("match", "") not in url:
            continue
        if not rule.get("from", 0) <= now < rule.get("until", float("inf")):
            continue
        if _injected.get(index, 0) >= rule.get("count", float("inf")):
            continue
        _injected[index] = _injected.get(index, 0) + 1
        if rule.get("mode") == "hold":
            def held(gate=rule["gate"]):
                with open(f"{gate}.held", "a"):
                    pass
                while not os.path.exists(gate):
                    time.sleep(0.05)
                return fn()
            return held
        if rule.get("mode", "fail") == "lose":
            def lost():
                fn()
                raise InjectedFault(f"injected: the answer to {what} {url} was lost")
            return lost
        def failed():
            raise InjectedFault(f"injected: {what} {url} failed (503)")
        return failed
    return fn


def filesystem(url: str):
    """(fsspec file system, path inside it) for a URL or local path."""
    options = {}
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("gs", "gcs"):
        import aiohttp  # gcsfs's HTTP client

        # Passed to every aiohttp request gcsfs makes (its default, None, waits forever).
        options["requests_timeout"] = aiohttp.ClientTimeout(
            total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=REQUEST_TIMEOUT_S)
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            # The emulator accepts no real credentials; real GCS uses the default credentials.
            options["token"] = "anon"
    return fsspec.core.url_to_fs(url, **options)


class _DropReraised(logging.Filter):
    """gcsfs logs a full traceback for every request it gives up on, then raises the error to us,
    which report it once (with_retries): drop those log records, keep the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not ("out of retries on exception" in message or "non-retriable exception" in message)


logging.getLogger("gcsfs").addFilter(_DropReraised())


# Object stores whose URLs start with a bucket (or container) name.
_BUCKET_SCHEMES = ("gs", "gcs", "s3", "s3a", "az", "abfs", "abfss", "oss")
_USE = "use gs://BUCKET/PATH (Google Cloud Storage) or a local path"


def check_url(url: str, what: str, local_only: bool = False) -> None:
    """Raise StorageError unless ``url`` names something this project can open: a local path, or
    a URL whose scheme fsspec knows (with its package installed) and, for object stores such as
    gs://, a bucket. ``what`` names the setting in the message (e.g. "data.path"). With
    ``local_only`` only local paths pass. Checks the spelling only: nothing is accessed."""
    if not isinstance(url, str) or not url.strip():
        raise StorageError(f"{what}={url!r} is empty: {_USE}")
    if "://" not in url:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:/(?!/)", url):  # gs:/bucket: a local directory "gs:"
            raise StorageError(f"{what}={url} has one slash after its scheme; write "
                               f"{url.split(':', 1)[0]}://{url.split(':/', 1)[1]} for a URL, or ./{url} "
                               "for a local path")
        return
    chain = url.split("://", 1)[0]
    if local_only and chain not in ("file", "local"):
        raise StorageError(f"{what}={url} must be a local directory (each host keeps its own copy), "
                           "not a URL; give a local path")
    for scheme in chain.split("::"):  # fsspec chains protocols: simplecache::gs://bucket/path
        try:
            fsspec.get_filesystem_class(scheme)
        except ValueError:
            raise StorageError(f"{what}={url}: unknown URL scheme {scheme}://; {_USE}") from None
        except ImportError as exc:
            raise StorageError(f"{what}={url}: the {scheme}:// scheme needs a package that is not "
                               f"installed ({exc}); {_USE}") from None
    if chain.split("::")[-1] in _BUCKET_SCHEMES and not url.split("://", 1)[1].split("/", 1)[0]:
        raise StorageError(f"{what}={url} names no bucket: {_USE}")


def is_local(fs) -> bool:
    """Whether an fsspec file system is the local disk."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def join_url(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


# --------------------------------------------------------------------------------------------
# What went wrong
# --------------------------------------------------------------------------------------------

def _diagnosis(exc: BaseException) -> tuple[str, str] | None:
    """(what went wrong, what to do) for a credential, permission or connection failure of
    remote storage, or None if ``exc`` is not one.

    Recognised by class names and attributes so that this module needs neither google-auth
    nor aiohttp.
    """
    modules = [cls.__module__ for cls in type(exc).__mro__]
    if any(m.startswith("google.auth") for m in modules) or getattr(exc, "code", None) == 401:
        return ("no valid Google Cloud credentials",
                "Authenticate with `gcloud auth application-default login`, or on a TPU VM give "
                "its service account read access (roles/storage.objectViewer) to the bucket")
    if str(exc).startswith("Forbidden") or getattr(exc, "code", None) == 403:
        return ("access denied",
                "Give the account you run as roles/storage.objectViewer on the bucket "
                "(objectAdmin to write), or check the bucket name")
    if any(m.startswith(("aiohttp", "fsspec.exceptions")) for m in modules) \
            or isinstance(exc, (ConnectionError, TimeoutError)):
        return ("the storage service cannot be reached",
                "Check the network, the bucket name, and STORAGE_EMULATOR_HOST if you use an "
                "emulator")
    return None


def cloud_problem(exc: BaseException) -> str | None:
    """A sentence saying what went wrong talking to remote storage and what to do, or None if
    ``exc`` is not that kind of failure."""
    diagnosis = _diagnosis(exc)
    return None if diagnosis is None else f"{diagnosis[0]} ({exc}). {diagnosis[1]}"


@contextlib.contextmanager
def access_errors(url: str, error: type[Exception] = StorageError) -> Iterator[None]:
    """Turn credential, permission and connection failures inside the block into
    ``error("Cannot access {url}: {cloud_problem}.")``; other exceptions (FileNotFoundError
    included) pass unchanged. For single attempts whose caller explains missing files itself."""
    try:
        yield
    except (FileNotFoundError, StorageError, error):
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised unless recognised
        problem = cloud_problem(exc)
        if problem is None:
            raise
        raise error(f"Cannot access {url}: {problem}.") from exc


# --------------------------------------------------------------------------------------------
# Retried operations
# --------------------------------------------------------------------------------------------

def with_retries(what: str, url: str, fn: Callable, attempts: int = 10, first_delay: float = 0.5,
                 budget_s: float | None = None):
    """Run fn(); retry transient storage errors with exponential backoff (first_delay doubling up
    to RETRY_MAX_DELAY_S), at most `attempts` times and starting no attempt later than
    `budget_s` (default RETRY_BUDGET_S) after the first. A permanent error, or the last attempt,
    raises StorageError naming the URL and the cause, and for credential, permission and
    connection failures what to do. A removal (REMOVALS) that finds nothing on a retry has
    succeeded: an earlier attempt removed it and its answer was lost. An attempt under way is
    bounded by the request timeouts (REQUEST_TIMEOUT_S and gcsfs's own retries), not by the budget."""
    budget = RETRY_BUDGET_S if budget_s is None else budget_s
    started, delay = _clock(), first_delay
    for attempt in range(1, attempts + 1):
        try:
            if what in MUTATING:
                _check_fence(url, what)
            return _inject(what, url, fn)()
        except FileNotFoundError as e:
            if what in REMOVALS and attempt > 1:
                return None  # an earlier attempt removed it, its answer lost: done
            raise StorageError(_failure(f"{what} {url} failed", e)) from e
        except _PERMANENT as e:
            raise StorageError(_failure(f"{what} {url} failed", e)) from e
        except Exception as e:  # network, 5xx, 429: worth another try
            elapsed = _clock() - started
            if attempt == attempts or elapsed + delay > budget:
                tried = f"{attempt} attempt{'s' if attempt > 1 else ''}"
                raise StorageError(_failure(f"{what} {url} failed after {tried}", e)
                                   + f" (gave up {elapsed:.0f}s after the first attempt)") from e
            print(f"warning: {what} {url} failed ({type(e).__name__}: {_detail(e)}); "
                  f"retrying in {delay:.1f}s", flush=True)
            _sleep(delay)
            delay = min(2 * delay, RETRY_MAX_DELAY_S)


def _detail(exc: BaseException) -> str:
    if not str(exc) and "Timeout" in type(exc).__name__:  # fsspec's and asyncio's say nothing
        return f"no answer within {REQUEST_TIMEOUT_S:.0f}s"
    return str(exc)


def _failure(context: str, exc: BaseException) -> str:
    message = f"{context}: {type(exc).__name__}: {_detail(exc)}"
    diagnosis = _diagnosis(exc)
    return message if diagnosis is None else f"{message}; {diagnosis[0]}. {diagnosis[1]}"


def write_file(url: str, write: Callable, **retry) -> None:
    """Create or replace the file at ``url`` (local parent directories included) and call
    ``write(f)`` with its binary handle; retried from the start on a transient failure
    (``retry``: with_retries' attempts= and budget_s=)."""
    def attempt():
        fs, path = filesystem(url)
        if is_local(fs):
            _write_local(path, write)
            return
        with fs.open(path, "wb") as f:  # an object appears whole when its upload completes
            write(f)
    with_retries("writing", url, attempt, **retry)
    _audit("writing", url, getattr(_fence_passed, "time", None))


def _write_local(path: str, write: Callable) -> None:
    """Write a local file whole or not at all, and durably: into a temporary file, fsync'd,
    renamed over the target, and the directory fsync'd, so that a crash or power loss never
    leaves a partial file (or a commit marker pointing at unwritten data) under the real name."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)  # object stores have no directories to create
    partial = f"{path}.partial-{os.getpid()}"
    try:
        with open(partial, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_bytes(url: str, payload: bytes, **retry) -> None:
    write_file(url, lambda f: f.write(payload), **retry)


def read_bytes(url: str, **retry) -> bytes:
    def read():
        fs, path = filesystem(url)
        with fs.open(path, "rb") as f:
            return f.read()
    return with_retries("reading", url, read, **retry)


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return with_retries("checking", url, lambda: fs.exists(path))


def upload_dir(local_dir: str, url: str, only: Collection[str] | None = None, **retry) -> int:
    """Copy every file under ``local_dir`` (subdirectories included) to the same relative path
    under ``url``, whole files, each with write_bytes (``retry``: its attempts= and budget_s=);
    the first file that fails stops the copy. ``only``: copy just these relative paths ('/'
    separated). Returns the number of files copied."""
    copied = 0
    for root, _, files in os.walk(local_dir):
        for name in sorted(files):
            relative = os.path.relpath(os.path.join(root, name), local_dir)
            if only is not None and relative.replace(os.sep, "/") not in only:
                continue
            with open(os.path.join(root, name), "rb") as f:
                write_bytes(join_url(url, *relative.split(os.sep)), f.read(), **retry)
            copied += 1
    return copied


def list_files(url: str, **retry) -> dict[str, int]:
    """Every file under ``url`` (subdirectories included) as {relative path, '/' separated: size
    in bytes}; {} when there is none. One listing, retried (``retry``: with_retries' attempts=
    and budget_s=)."""
    def attempt():
        fs, path = filesystem(url)
        path = path.rstrip("/")
        fs.invalidate_cache(path)  # another host or run may have written since the last listing
        try:
            found = fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        return {name[len(path) + 1:]: int(info.get("size") or 0) for name, info in found.items()
                if name.startswith(path + "/") and info.get("type") != "directory"}
    return with_retries("listing", url, attempt, **retry)


def download_dir(url: str, local_dir: str, skip_existing: bool = True, **retry) -> tuple[int, int]:
    """Copy every file under ``url`` to the same relative path under ``local_dir``; with
    ``skip_existing`` the files already there are left alone. Each file is read whole and
    written to a temporary name, then renamed, so that nothing ever reads part of one
    (``retry``: with_retries' attempts= and budget_s=, for the listing and each file); the first
    file that fails stops the copy. Returns (files copied, bytes copied)."""
    files = bytes_copied = 0
    for relative in sorted(list_files(url, **retry)):
        parts = relative.split("/")
        if any(part in ("", ".", "..") for part in parts):
            continue  # nothing outside local_dir
        target = os.path.join(local_dir, *parts)
        if skip_existing and os.path.exists(target):
            continue
        payload = read_bytes(join_url(url, relative), **retry)
        _write_local(target, lambda f, payload=payload: f.write(payload))
        files, bytes_copied = files + 1, bytes_copied + len(payload)
    return files, bytes_copied


# --------------------------------------------------------------------------------------------
# Single attempts
# --------------------------------------------------------------------------------------------

def read_json(url: str, what: str = "file", error: type[Exception] = StorageError):
    """The parsed JSON file at ``url``, read in one attempt (gcsfs retries transient HTTP errors
    itself). FileNotFoundError if absent; ``error`` if it cannot be accessed (see
    access_errors) or is not valid JSON (naming ``what`` to rebuild or re-upload)."""
    fs, path = filesystem(url)
    with access_errors(url, error):
        with fs.open(path, "rb") as f:
            text = f.read()
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{url} is not valid JSON ({exc}); rebuild or re-upload the {what}.") from exc
