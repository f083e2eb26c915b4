"""Tests of rundir/storage.py: local writes, upload_dir, list_files and download_dir, the messages of failing
operations, URL spelling."""
import os
import socket
import threading
from urllib.parse import urlparse

import pytest

from rundir import storage


def test_write_bytes_creates_local_parents_and_reads_back(tmp_path):
    url = str(tmp_path / "a" / "b" / "file.bin")
    storage.write_bytes(url, b"payload")
    assert storage.exists(url) and storage.read_bytes(url) == b"payload"
    assert not storage.exists(str(tmp_path / "a" / "missing"))


def test_a_local_write_is_whole_or_absent_and_synced(tmp_path, monkeypatch):
    url = str(tmp_path / "run" / "COMMITTED")
    storage.write_bytes(url, b"old")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
                        or real_fsync(fd))

    def write_then_fail(f):
        f.write(b"half of the new")
        raise ValueError("the writer crashed")  # permanent: not retried

    with pytest.raises(storage.StorageError, match="the writer crashed"):
        storage.write_file(url, write_then_fail)
    assert storage.read_bytes(url) == b"old" and os.listdir(tmp_path / "run") == ["COMMITTED"]
    assert synced == []
    storage.write_bytes(url, b"new")
    assert storage.read_bytes(url) == b"new" and os.listdir(tmp_path / "run") == ["COMMITTED"]
    # The file's data before the rename, then the directory entry after it.
    assert [os.path.basename(p).split(".partial-")[0] for p in synced] == ["COMMITTED", "run"]


def test_upload_dir_copies_every_file_with_its_relative_path(tmp_path, gcs_url):
    local = tmp_path / "profile"
    (local / "plugins" / "profile" / "run").mkdir(parents=True)
    (local / "events.out").write_bytes(b"1")
    (local / "plugins" / "profile" / "run" / "host.xplane.pb").write_bytes(b"2")
    for target in (str(tmp_path / "copy"), gcs_url):
        assert storage.upload_dir(str(local), target) == 2
        assert storage.read_bytes(storage.join_url(target, "events.out")) == b"1"
        nested = storage.join_url(target, "plugins", "profile", "run", "host.xplane.pb")
        assert storage.read_bytes(nested) == b"2"
    assert sorted(os.listdir(tmp_path / "copy")) == ["events.out", "plugins"]


def test_a_client_stopped_halfway_through_a_request_holds_up_no_other(gcs_url):
    """A frozen process (SIGSTOP) stops mid-request; GCS goes on serving everyone else, and so must
    the tests' emulator (tests/gcs_emulator.py), or a fault test measures the emulator's stall."""
    emulator = urlparse(os.environ["STORAGE_EMULATOR_HOST"])
    stuck = socket.create_connection((emulator.hostname, emulator.port), timeout=10)
    try:
        bucket, prefix = gcs_url[len("gs://"):].split("/", 1)
        stuck.sendall(f"POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name={prefix}/stuck HTTP/1.1\r\n"
                      f"Host: {emulator.netloc}\r\nContent-Length: 1000\r\n\r\n".encode() + b"x" * 10)
        done = threading.Event()

        def write_and_read():
            storage.write_bytes(storage.join_url(gcs_url, "other"), b"served")
            done.set()

        threading.Thread(target=write_and_read, daemon=True).start()
        assert done.wait(30), "the emulator waited on the stopped client's request"
        assert storage.read_bytes(storage.join_url(gcs_url, "other")) == b"served"
        assert not storage.exists(storage.join_url(gcs_url, "stuck"))
    finally:
        stuck.close()


def test_list_files_and_download_dir_keep_relative_paths_and_local_files(tmp_path, gcs_url):
    local = tmp_path / "src"
    (local / "sub").mkdir(parents=True)
    (local / "a").write_bytes(b"aa")
    (local / "sub" / "b").write_bytes(b"bbb")
    for target in (str(tmp_path / "copy"), gcs_url):
        assert storage.list_files(target) == {}
        assert storage.upload_dir(str(local), target, only={"sub/b"}) == 1
        assert storage.upload_dir(str(local), target) == 2
        assert storage.list_files(target) == {"a": 2, "sub/b": 3}
        into = tmp_path / f"into-{len(target)}"
        into.mkdir()
        (into / "a").write_bytes(b"mine")
        assert storage.download_dir(target, str(into)) == (1, 3)   # missing files only
        assert (into / "a").read_bytes() == b"mine" and (into / "sub" / "b").read_bytes() == b"bbb"
        assert storage.download_dir(target, str(into), skip_existing=False) == (2, 5)
        assert (into / "a").read_bytes() == b"aa"


def test_failures_name_the_url_and_what_to_do():
    def forbidden():
        raise OSError("Forbidden: b/x\nno storage.objects.create access")

    with pytest.raises(storage.StorageError, match=r"(?s)writing gs://b/x failed after 2 attempts: OSError: "
                                                   r"Forbidden.*access denied.*roles/storage.objectViewer"):
        storage.with_retries("writing", "gs://b/x", forbidden, attempts=2, first_delay=0.01)
    with pytest.raises(storage.StorageError, match=r"(?s)Cannot access gs://b/x: access denied \(Forbidden"):
        with storage.access_errors("gs://b/x"):
            forbidden()
    with pytest.raises(FileNotFoundError):  # the caller explains what is missing
        with storage.access_errors("gs://b/x"):
            raise FileNotFoundError("b/x")


def test_check_url_names_what_cannot_be_opened():
    for url in ("data/demo", "/abs/path", "gs://bucket/x", "gs://bucket", "memory://x", "simplecache::gs://b/x"):
        storage.check_url(url, "data.path")
    for url, message in (("foo://x", "unknown URL scheme foo://"), ("gs://", "names no bucket"),
                         ("gs:///x", "names no bucket"), ("", "is empty"), ("gcs:/b/x", "one slash"),
                         ("simplecache::nope://b", "unknown URL scheme nope://")):
        with pytest.raises(storage.StorageError, match=message):
            storage.check_url(url, "data.path")
    with pytest.raises(storage.StorageError, match="must be a local directory"):
        storage.check_url("gs://b/cache", "data.cache_dir", local_only=True)


def test_a_removal_whose_answer_was_lost_is_done_when_its_retry_finds_nothing(tmp_path, monkeypatch):
    """The first attempt removes the file and its answer is lost (TRM_STORAGE_FAULTS, mode "lose"):
    the retry finds nothing there, which is the removal done, not a permanent error (a checkpoint's
    save and MetricsFile.continue_from exited 75 on it). Removing what was never there still fails."""
    monkeypatch.setattr(storage, "_sleep", lambda s: None)
    faults = tmp_path / "faults.jsonl"
    faults.write_text('{"what": "*", "match": "/doomed", "mode": "lose", "count": 2}\n')
    monkeypatch.setenv("TRM_STORAGE_FAULTS", str(faults))
    for what in ("removing", "deleting"):
        doomed = tmp_path / "doomed"
        doomed.write_bytes(b"x")
        fs, path = storage.filesystem(str(doomed))
        storage.with_retries(what, str(doomed), lambda fs=fs, path=path: fs.rm(path))
        assert not doomed.exists()
    with pytest.raises(storage.StorageError, match="FileNotFoundError"):
        storage.with_retries("removing", str(tmp_path / "never"), lambda: fs.rm(str(tmp_path / "never")))
