"""Claims on a study's runs, kept in the study directory, so that any number of `study.py run`
processes (one per VM of a fleet, started at any time) share a study without a split in advance:

    OUT/study/claims/NAME/GGGGGGGG.json   generation G of run NAME's claim: its holder, its state
                                          (running, released, done, failed), the time it was written

Generation 1 is the claim on a free run. Every later write (the holder's lease renewal, a takeover
of a stale lease, the holder's release or its done/failed) is generation G+1, created only if it
does not exist: locally an O_EXCL open, on GCS an object insert with the precondition
ifGenerationMatch=0 (gcsfs's mode "create"). So a write is a precondition on the generation it
follows: of two processes that saw generation G, exactly one creates G+1 and the other learns it
lost. The holder keeps the newest two generations and deletes the older ones; since a deleted
generation could be created again by a process that saw it as the newest long ago, a write counts
as won only if, listed after it, it is the newest.

A lease is stale when an observer has seen the same generation for `lease_s` seconds of its own
clock (no clock is compared across VMs). The holder renews every lease_s/8 and its trainer may
write only until half a lease after the start of its last good renewal (fleet/fencing.py); a holder
whose renewal finds a generation it did not write has lost the run and stops training it.

A claim names its holder (a name, e.g. the VM's) and the process instance that wrote it (a
random id per process, with the machine's boot id and the process's id and start): a claim is
this process's own only if the instance is, so two live processes given one name never take
each other's runs at once. A claim left by a process of this machine that no longer runs (nor
its trainer) is taken at once; any other claim waits for its lease to go stale.

Every operation on the claims has a retry budget of a small part of the lease (`retry`), so that
one renewal cannot block for longer than the lease; a write retried after a failure (its answer
lost, or the listing after it failed) sends the same record again, and finds it as its own.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid

from rundir import storage

_clock = time.monotonic  # this machine's monotonic clock (tests replace it)

CRASHED = {"state": "running", "holder": None, "crashed": True}
"""What current() reads an empty or unreadable newest generation as: a running claim of an unknown
holder, whose lease an observer waits out before it takes the run over."""

STATES = ("running", "released", "done", "failed")
"""A claim's states: held under a lease; handed back (stopped, or a relaunch may help: anyone may
take it at once); finished; failed (tried again by a process started after the failure)."""


def create_exclusive(url: str, payload: bytes, **retry) -> bool:
    """Create the file at `url` with `payload` if nothing is there: True if this call (or an
    earlier call with the same payload) created it. Retried on transient failures (`retry`:
    with_retries' attempts= and budget_s=); finding the object holding our own payload (an
    earlier attempt's write, its answer lost) counts as created. `payload` must be unique."""
    def attempt():
        fs, path = storage.filesystem(url)
        try:
            if storage.is_local(fs):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(descriptor, payload)
                    os.fsync(descriptor)
                finally:
                    os.close(descriptor)
            else:
                fs.pipe_file(path, payload, mode="create")  # ifGenerationMatch=0: 412 if it exists
            return True
        except FileExistsError:
            return False
    if storage.with_retries("creating", url, attempt, **retry):
        return True
    try:  # (read_bytes raises every failure as a StorageError, its cause attached)
        return storage.read_bytes(url, **retry) == payload  # a local file half written by another process: not ours
    except storage.StorageError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return False  # deleted since: not ours to count
        raise  # unknown: the caller tries the same write again


def boot_id() -> str:
    """This machine's boot (Linux: a random id per boot), else its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def pid_namespace() -> int | None:
    """This process's PID namespace (the inode of /proc/self/ns/pid), None where it cannot be read:
    two containers on one machine share its boot id, and each numbers its processes its own way."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_identity(pid: int) -> str | None:
    """'PID:START' for a running process of this machine (START: its start in clock ticks since
    boot, so that a reused process id reads as another process), None if none runs as `pid`."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else f"{pid}:{fields[19]}"  # a zombie runs no more


class Claims:
    """This process's view of the claims on a study's runs, as `holder`."""

    def __init__(self, out: str, holder: str, lease_s: float):
        self.out, self.holder, self.lease_s = out, holder, lease_s
        self.seen: dict[str, tuple[int, float]] = {}  # run -> (generation, when this process first saw it)
        self.instance = uuid.uuid4().hex  # this process, whatever its holder name
        self.boot, self.process, self.pidns = boot_id(), process_identity(os.getpid()), pid_namespace()
        self.retry = {"budget_s": max(0.5, lease_s / 8), "attempts": 10}
        """Every claim operation's retries: at most an eighth of the lease (at least half a second)."""
        self.reported: set[tuple[str, int]] = set()  # (run, generation) of unreadable claims said
        self.pending: dict[str, tuple[tuple, bytes, float]] = {}  # run -> (what, payload, first try) of a failed write
        self.started: dict[str, float] = {}
        """run -> when (time.monotonic) the last write that won was first tried: its lease counts from there."""

    def mine(self, record: dict) -> bool:
        """Whether a claim's record was written by this process."""
        return record.get("instance") == self.instance

    def gone(self, record: dict) -> bool:
        """Whether a claim's record was written by a process of this machine and of this PID
        namespace that no longer runs, nor does the trainer it named: its lease can be taken at
        once. A process of another namespace (another container on this machine: the same boot
        id, its own process ids) or of an unknown one is never judged by /proc: its lease is waited."""
        if record.get("boot") != self.boot or not record.get("process"):
            return False
        if self.pidns is None or record.get("pidns") != self.pidns:
            return False
        for identity in (record.get("process"), record.get("trainer")):
            if identity and process_identity(int(identity.split(":")[0])) == identity:
                return False
        return True

    def _dir(self, name: str) -> str:
        return storage.join_url(self.out, "study", "claims", name)

    def _url(self, name: str, generation: int) -> str:
        return storage.join_url(self._dir(name), f"{generation:08d}.json")

    def generations(self, name: str) -> list[int]:
        """The generations of run `name`'s claim present now, oldest first (a fresh listing)."""
        fs, path = storage.filesystem(self._dir(name))
        def listing():
            try:
                return fs.ls(path, detail=False, refresh=True) if not storage.is_local(fs) else os.listdir(path)
            except FileNotFoundError:
                return []
        names = [os.path.basename(p.rstrip("/"))
                 for p in storage.with_retries("listing", self._dir(name), listing, **self.retry)]
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def current(self, name: str) -> tuple[int, dict] | None:
        """(generation, record) of run `name`'s newest claim, or None if it was never claimed. A
        newest generation that stays empty or unreadable (a local write that crashed between its
        exclusive create and its write) is a running claim of an unknown holder (CRASHED): taken
        over once its lease goes stale, like any holder's, and reported once."""
        unreadable = 0
        for _ in range(5):
            generations = self.generations(name)
            if not generations:
                return None
            url = self._url(name, generations[-1])
            try:
                record = json.loads(storage.read_bytes(url, attempts=2, budget_s=self.retry["budget_s"]))
                if not isinstance(record, dict) or "state" not in record:
                    raise ValueError(f"not a claim's record: {record!r:.80}")
            except ValueError as e:  # empty, cut short, or not a record: a write still under way, or crashed
                unreadable += 1
                if unreadable < 3:
                    time.sleep(0.05)
                    continue
                if (name, generations[-1]) not in self.reported:
                    self.reported.add((name, generations[-1]))
                    print(f"claims: {url} is empty or unreadable ({e or type(e).__name__}): a claim write that "
                          "crashed midway; read as a running claim of an unknown holder, taken over once its "
                          f"lease ({self.lease_s:g} s) goes stale", flush=True)
                record = dict(CRASHED, generation=generations[-1])
            except (storage.StorageError, OSError):
                continue  # deleted since the listing: list again
            self.seen.setdefault(name, (generations[-1], _clock()))
            if self.seen[name][0] != generations[-1]:
                self.seen[name] = (generations[-1], _clock())
            return generations[-1], record
        raise storage.StorageError(f"cannot read the newest claim of run {name} in {self._dir(name)}")

    def stale(self, name: str, generation: int) -> bool:
        """Whether this process has seen `generation` of `name`'s claim unchanged for lease_s."""
        seen = self.seen.get(name)
        return seen is not None and seen[0] == generation and _clock() - seen[1] >= self.lease_s

    def own(self, name: str, generation: int) -> bool:
        """Whether generation `generation` of `name`'s claim is there and was written by this
        process (its instance): one read; False if it cannot be read."""
        try:
            record = json.loads(storage.read_bytes(self._url(name, generation), attempts=2,
                                                   budget_s=self.retry["budget_s"]))
        except (storage.StorageError, OSError, ValueError):
            return False
        return isinstance(record, dict) and self.mine(record)

    def write(self, name: str, after: int, state: str, **fields) -> int | None:
        """Write generation after+1 of `name`'s claim as this holder, in `state`: the generation
        written if it was created (the claim was at generation `after`), None if another process
        wrote it first. Created once, even when an earlier call of the same write failed
        (StorageError) after its record landed: that call's record is sent again, and found as
        this process's own. An earlier call of another write whose record landed (a renewal
        retried after a relaunch names a new trainer; a release follows a renewal whose answer was
        lost) is found too, by its instance: the claim is this process's at after+1, and this
        write goes after it (the generation returned is then after+2, or later).
        `time` is for people reading the claims; no rule compares it across VMs."""
        assert state in STATES, state
        for _ in range(4):  # at most a few earlier writes of ours can have landed unanswered
            won = self._write_once(name, after, state, fields)
            if won or not self.own(name, after + 1):
                return after + 1 if won else None
            after += 1
        return None

    def _write_once(self, name: str, after: int, state: str, fields: dict) -> bool:
        what = (after, state, json.dumps(fields, sort_keys=True))
        if name in self.pending and self.pending[name][0] == what:
            _, payload, first = self.pending[name]  # the same write again: the same token
        else:
            first = _clock()
            record = {"holder": self.holder, "state": state, "time": time.time(), "generation": after + 1,
                      "token": uuid.uuid4().hex, "lease_s": self.lease_s, "instance": self.instance,
                      "boot": self.boot, "pidns": self.pidns, "process": self.process, **fields}
            payload = json.dumps(record, indent=1).encode()
        self.pending[name] = (what, payload, first)  # until this call returns
        won = create_exclusive(self._url(name, after + 1), payload, **self.retry)
        listed = self.generations(name) if won else []
        if won and listed[-1:] != [after + 1]:
            # Generation after+1 had been written and then deleted (the holder keeps only its
            # newest two) while this process still saw `after`: a later one exists, so the claim
            # moved on without us. Our file is below the newest and never read as the claim.
            won = False
        self.pending.pop(name, None)  # answered: a later write is a new one
        if won:
            self.seen[name] = (after + 1, _clock())
            self.started[name] = first
            for old in (g for g in listed if g < after):  # keep the newest two; the listing names the rest
                try:
                    fs, path = storage.filesystem(self._url(name, old))
                    fs.rm(path)
                except Exception:  # noqa: BLE001 - a leftover generation costs storage, never the claim
                    pass
        return won
