"""One trainer per run (fleet/fencing.py, fleet/claims.py, fleet/runner.py): real study.py processes train a real
run on the GCS emulator while a fault hits one holder, and every test watches, the whole time,
which train.py processes of the run are alive (/proc) and which of them wrote what into the run
directory (storage's audit file, TRM_STORAGE_AUDIT). Each asserts that no two trainers of the run
ever both wrote (the writers follow one another), that every checkpoint step was committed once,
and that the run ends with the metrics of the same run trained without interruption. The faults:
a holder's whole process group stopped for twice the lease while another holder takes the run
over; the study process alone SIGKILLed; claim writes failing for longer than the lease; claim
writes whose answer was lost; two holders of one name; a 2-host slice stopped and taken over by
another 2-host slice, its worker 1 continued mid-save of the new holder, and a deposed host's
late index. Each prints its takeover time and what the old trainer did (docs/study-runs.md
quotes them)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import sharding
from fleet import claims, fencing
from rundir import storage
from tests.ports import free_port
from tests.study_fixtures import PROJECT_DIR, study, wait_for
from training import checkpoint
from training.checkpoint import CheckpointWriter, Shard

LEASE_S = 10.0
"""A short lease: this machine, shared and loaded, missed renewals of a 4 s lease (half of it left
for three renewals, each through the emulator, which handles one request at a time)."""
RUN_FLAGS = ("--model.hidden-size 32 --model.puzzle-emb-ndim 32 --optim.global-batch-size 32 --optim.max-steps 40 "
             "--run.ckpt-every 4 --run.log-every 2 --eval.every-epochs 1000")


@pytest.fixture(scope="module")
def straight(demo_path, tmp_path_factory):
    """The run's final metrics trained without interruption (train.py alone, a local directory)."""
    run_dir = tmp_path_factory.mktemp("straight") / "r"
    done = subprocess.run([sys.executable, os.path.join(PROJECT_DIR, "train.py"), "demo", "--data.path", demo_path,
                           *RUN_FLAGS.split(), "--run.dir", str(run_dir)], capture_output=True, text=True,
                          timeout=600, cwd=PROJECT_DIR)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((run_dir / "final.json").read_text())["metrics"]


class Watch:
    """Samples every 20 ms the train.py processes of a run directory (their pids, by time)."""

    def __init__(self, run_dir: str):
        self.run_dir, self.samples, self.stop = run_dir, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def alive(self) -> set[int]:
        pids = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and any(a.endswith(b"train.py") for a in argv) and self.run_dir.encode() in argv:
                pids.add(int(entry))
        return pids

    def _run(self):
        while not self.stop.wait(0.02):
            self.samples.append((time.time(), self.alive()))

    def close(self):
        self.stop.set()
        self.thread.join()

    def last_alive(self, pid: int) -> float:
        return max((t for t, pids in self.samples if pid in pids), default=0.0)

    def most_alive(self) -> int:
        return max((len(pids) for _, pids in self.samples), default=0)


class Study:
    """A one-run study on the emulator, its holders started by `holder`, its writes audited."""

    def __init__(self, gcs_url, demo_path, tmp_path, lease_s=LEASE_S):
        self.out, self.tmp, self.lease_s = gcs_url, tmp_path, lease_s
        self.file = tmp_path / "study.txt"
        self.file.write_text(f"r demo --data.path {demo_path} {RUN_FLAGS}\n")
        self.audit, self.faults = tmp_path / "audit.jsonl", tmp_path / "faults.jsonl"
        self.run_dir = storage.join_url(gcs_url, "r")
        self.watch = Watch(self.run_dir)
        self.lines: dict[str, list] = {}

    def holder(self, label, name=None, wrap=(), **popen):
        self.lines[label] = []
        env = {"TRM_STORAGE_AUDIT": str(self.audit), "TRM_STORAGE_FAULTS": str(self.faults)}
        return study("run", str(self.file), "--out", self.out, "--holder", name or label, "--lease-s",
                     str(self.lease_s), env=env, wrap=wrap, **popen)

    def inject(self, **rule):
        with open(self.faults, "a") as f:
            f.write(json.dumps(rule) + "\n")

    def writes(self) -> list[dict]:
        """The audit's changes to the run directory, oldest first."""
        records = [json.loads(line) for line in self.audit.read_text().splitlines() if line.strip()]
        return sorted((r for r in records if r["url"].startswith(self.run_dir + "/")), key=lambda r: r["time"])

    def check(self, straight) -> dict:
        """The guarantee, from what was sampled and audited; returns each writer's first and last write."""
        self.watch.close()
        writes = self.writes()
        spans = {}
        for w in writes:  # each write at the time it passed the fence (storage._audit's "checked")
            first, _ = spans.get(w["pid"], (decided(w), 0))
            spans[w["pid"]] = (first, decided(w))
        ordered = sorted(spans.items(), key=lambda item: item[1][0])
        for (p, (_, last)), (q, (first, _)) in zip(ordered, ordered[1:]):
            assert last < first, f"trainers {p} and {q} of the run both wrote: {p} until {last}, {q} from {first}"
        commits = [w["url"] for w in writes if w["url"].endswith("/COMMITTED")]
        assert commits and len(commits) == len(set(commits)), commits  # every step committed once
        final = json.loads(storage.read_bytes(self.run_dir + "/final.json"))
        assert final["step"] == 40 and final["metrics"] == straight
        return dict(ordered)


def decided(write: dict) -> float:
    """When an audited write passed its fence check: the time a trainer decided to make it. Its
    landing is recorded after the request returns, so a process stopped in between records a
    landing long after the fact (the write of a checkpoint's COMMITTED that landed before a freeze,
    recorded at the thaw)."""
    return write.get("checked", write["time"])


def _step_reached(lines, holder_proc, at_least):
    return wait_for(holder_proc, rf"^step ({'|'.join(str(s) for s in range(at_least, 41))})/40", lines)


def _held_at_start(s, start_b, hold_s=0.0):
    """Holder a's trainer (its run claimed), stopped (SIGSTOP) the moment it appears, while it
    is still starting up, until holder b (started by start_b) says it waits for the run, and
    `hold_s` longer; then continued. Returns both. b's start-up cannot race a's 40 steps to their
    end (it lost that race in a full suite)."""
    deadline = time.time() + 300
    while not s.watch.alive() and time.time() < deadline:
        time.sleep(0.005)
    [old] = s.watch.alive()
    os.kill(old, signal.SIGSTOP)
    try:
        b = start_b()
        assert wait_for(b, r"study: waiting: 1 run", s.lines["b"]), "".join(s.lines["b"])
        time.sleep(hold_s)
    finally:
        os.kill(old, signal.SIGCONT)
    return old, b


def _takeover_line(proc, lines):
    return wait_for(proc, r"study: r: taking over from", lines)


def test_a_frozen_holder_is_taken_over_and_its_thawed_trainer_stops_before_writing(gcs_url, demo_path, tmp_path,
                                                                                 straight):
    s = Study(gcs_url, demo_path, tmp_path)
    # Both holders have one name: the waiting one must not take the run at once as its own.
    a = s.holder("a", "vm", start_new_session=True)
    old, b = _held_at_start(s, lambda: s.holder("b", "vm"))
    assert _step_reached(s.lines["a"], a, 9), "".join(s.lines["a"])
    os.killpg(a.pid, signal.SIGSTOP)
    frozen = time.time()
    assert _takeover_line(b, s.lines["b"]), "".join(s.lines["b"])
    took = time.time() - frozen
    time.sleep(max(0.0, frozen + 2 * s.lease_s - time.time()))
    assert old in s.watch.alive()  # frozen, not dead
    os.killpg(a.pid, signal.SIGCONT)
    thawed = time.time()
    said_b = "".join(s.lines["b"]) + b.communicate(timeout=600)[0]
    said_a = "".join(s.lines["a"]) + a.communicate(timeout=120)[0]
    assert a.returncode == 0 and b.returncode == 0, (said_a, said_b)
    spans = s.check(straight)
    dead_after = max(0.0, s.watch.last_alive(old) - thawed)  # 0: no sample after the thaw saw it
    print(f"frozen holder: taken over {took:.1f} s after the freeze (lease {s.lease_s:g} s); its trainer died "
          f"{dead_after:.2f} s after the thaw (sampled every 20 ms); its last write "
          f"{thawed - spans[old][1]:.1f} s before the thaw")
    assert spans[old][1] < frozen and took >= s.lease_s * (1 - fencing.RENEW_FRACTION)
    assert re.search(r"study: r: lease lost|this trainer stops at once", said_a), said_a
    assert dead_after < 2.0


def test_a_killed_study_process_takes_its_trainer_with_it(gcs_url, demo_path, tmp_path, straight):
    """With the default lease (120 s): nothing here waits for it."""
    s = Study(gcs_url, demo_path, tmp_path, lease_s=120.0)
    a = s.holder("a")
    old, b = _held_at_start(s, lambda: s.holder("b"))
    assert _step_reached(s.lines["a"], a, 9), "".join(s.lines["a"])
    a.kill()  # the study process alone (an OOM killer's choice)
    killed = time.time()
    assert _takeover_line(b, s.lines["b"]), "".join(s.lines["b"])
    took = time.time() - killed
    said_b = "".join(s.lines["b"]) + b.communicate(timeout=600)[0]
    assert b.returncode == 0, said_b
    spans = s.check(straight)
    dead_after = max(0.0, s.watch.last_alive(old) - killed)  # 0: no sample after the kill saw it
    print(f"killed study process: its trainer died {dead_after:.2f} s after; taken over {took:.1f} s after the kill "
          f"(lease {s.lease_s:g} s: a process of this machine that ended)")
    assert dead_after < 1.0 and spans[old][1] < killed + 0.5
    assert "was held by a process of this machine that ended" in said_b


UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
"""A PID namespace of its own, as a container has: the study process is its PID 1 and numbers its
trainer's process ids from 2 (the other container's ids name processes of this one, or none)."""


def _unshare_works() -> bool:
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="unshare --pid needs root (or user namespaces) on Linux")
def test_holders_in_two_containers_of_one_machine_wait_a_lease_and_take_over_a_dead_one(gcs_url, demo_path, tmp_path,
                                                                                     straight):
    """Two study processes, each in a PID namespace of its own (`unshare --pid`, as two containers
    or pods of one machine are: one boot id, process ids numbered per namespace). While a's holder
    lives, b waits however long (before: each took the other's live run at its first look, reading
    the other's PID in its own /proc as "a process of this machine that ended"); when a's whole
    container is killed, b takes the run over a lease after a's last renewal."""
    s = Study(gcs_url, demo_path, tmp_path)
    a = s.holder("a", wrap=UNSHARE, start_new_session=True)
    # a's trainer held at its start for 1.5 leases past b's first look: b looks every lease/4
    old, b = _held_at_start(s, lambda: s.holder("b", wrap=UNSHARE), hold_s=1.5 * s.lease_s)
    assert s.watch.alive() == {old}, "b started a trainer of a's live run"
    assert _step_reached(s.lines["a"], a, 9), "".join(s.lines["a"])
    os.killpg(a.pid, signal.SIGKILL)  # the whole container: its study process, its trainer
    killed = time.time()
    assert _takeover_line(b, s.lines["b"]), "".join(s.lines["b"])
    took = time.time() - killed
    said_b = "".join(s.lines["b"]) + b.communicate(timeout=600)[0]
    assert b.returncode == 0, said_b
    s.check(straight)
    print(f"holders in two PID namespaces: b waited {1.5 * s.lease_s:g} s and more beside a's live run; "
          f"took it over {took:.1f} s after a's container was killed (lease {s.lease_s:g} s)")
    assert "was held by a process of this machine that ended" not in said_b and "went stale" in said_b, said_b
    assert took >= s.lease_s * (1 - fencing.RENEW_FRACTION) - 1.0


def test_claim_writes_failing_longer_than_the_lease_stop_the_trainer_in_time(gcs_url, demo_path, tmp_path, straight):
    s = Study(gcs_url, demo_path, tmp_path)
    a = s.holder("a")
    # From the trainer's start (a run started, by its first step, takes longer than half a lease
    # even on an idle machine: its trainer is surely stopped mid-run), 503 on every claim write.
    assert wait_for(a, r"study: r: starting", s.lines["a"]), "".join(s.lines["a"])
    began = time.time()
    s.inject(what="creating", match="/claims/", mode="fail", until=began + 2.5 * s.lease_s)
    b = s.holder("b")
    while not s.watch.alive():
        time.sleep(0.02)
    [old] = s.watch.alive()
    assert wait_for(a, r"study: r: (stopped, its )?lease lost", s.lines["a"]), "".join(s.lines["a"])
    said_a = "".join(s.lines["a"]) + a.communicate(timeout=600)[0]
    said_b = "".join(s.lines["b"]) + b.communicate(timeout=600)[0]
    assert a.returncode == 0 and b.returncode == 0, (said_a, said_b)
    spans = s.check(straight)
    dead_after = s.watch.last_alive(old) - began
    resumed = min((t for t, pids in s.watch.samples if pids - {old}), default=float("nan")) - began
    print(f"claim writes failing for {2.5 * s.lease_s:g} s: the trainer died {dead_after:.1f} s into the outage "
          f"(lease {s.lease_s:g} s); the run's next trainer started {resumed:.1f} s into it")
    assert dead_after < fencing.LEASE_FRACTION * s.lease_s + 1.0  # its deadline: half a lease after the claim
    assert spans.get(old, (0, 0))[1] < began + dead_after
    assert "renewing its lease failed" in said_a


def test_a_claim_write_whose_answer_was_lost_is_found_as_its_own(gcs_url, demo_path, tmp_path, straight):
    s = Study(gcs_url, demo_path, tmp_path)
    # The first claim write's answer lost; then the listing after a renewal's create fails (both
    # its attempts): the renewal fails after its create landed, and is tried again with the same record.
    s.inject(what="creating", match="/claims/", mode="lose", count=1)
    a = s.holder("a")
    assert _step_reached(s.lines["a"], a, 5), "".join(s.lines["a"])
    s.inject(what="listing", match="/claims/", mode="fail", count=2)
    said = "".join(s.lines["a"]) + a.communicate(timeout=600)[0]
    assert a.returncode == 0, said
    spans = s.check(straight)
    assert len(spans) == 1 and "lease lost" not in said and "the answer to creating" in said, said
    assert "renewing its lease failed (1 in a row" in said  # after its create landed; the next one went on


class Output:
    """A process's output, read line by line in a thread of its own (four processes write at once:
    none may block on a full pipe while the test waits on another)."""

    def __init__(self, proc):
        self.proc, self.lines = proc, []
        threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True).start()

    def wait_for(self, pattern, timeout=300.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = [line for line in list(self.lines) if re.search(pattern, line)]
            if found:
                return found[0]
            time.sleep(0.05)
        return None

    def text(self):
        return "".join(self.lines)


def test_a_frozen_worker_1_of_a_taken_over_slice_writes_nothing_and_a_late_index_breaks_no_commit(
        gcs_url, demo_path, tmp_path):
    """Two simulated 2-host slices (sharding.SIMULATED_SLICE_ENV; holders vmA and vmB, `--whole-slice
    --worker 0|1` each) on one run. vmA trains past a committed checkpoint, then both its hosts'
    process groups are stopped (the slice paused) and vmB takes the run over after the lease and
    resumes it on its two hosts. While vmB saves its first checkpoint (worker 0's part held by an
    injected "hold" until the test lets it go; worker 1's index written), vmA's worker 1 is
    continued: its trainer dies without writing. Then the write a fence cannot stop (a request
    sent by a host stopped right after its deadline check) is made for it: vmA's attempt's host 1
    part of that step, index last, as the real writer of this checkout names it. The new save
    commits at once (before, the late `host_001.json` replaced vmB's index and the commit waited
    for commit_timeout_s, 1800 s) and the run ends on vmB; every committed checkpoint reads back
    (what a resume reads), each written by one attempt. Not covered: the late write coming from
    the frozen process itself (at its thaw its fence kills it first, so that write cannot be timed
    from outside), and the final metrics against an uninterrupted run (a third 2-host run)."""
    lease_s, max_steps = LEASE_S, 16
    study_file, audit = tmp_path / "study.txt", tmp_path / "audit.jsonl"
    study_file.write_text(f"r demo --data.path {demo_path} --model.hidden-size 32 --model.puzzle-emb-ndim 32 "
                          f"--optim.global-batch-size 32 --optim.max-steps {max_steps} --run.ckpt-every 4 "
                          "--run.log-every 2 --eval.every-epochs 1000 --run.keep-checkpoints 10\n")
    run_dir = storage.join_url(gcs_url, "r")
    watch = Watch(run_dir)

    def slice_of(holder):
        address = f"tcp://127.0.0.1:{free_port()}"
        workers = []
        for w in (0, 1):
            faults = tmp_path / f"faults-{holder}-{w}.jsonl"  # each worker's own rules
            faults.touch()
            env = {"TRM_STORAGE_AUDIT": str(audit), "TRM_STORAGE_FAULTS": str(faults), "CPU_NUM_DEVICES": "4",
                   sharding.SIMULATED_SLICE_ENV: f"{w}/2@{address}"}
            workers.append(Output(study("run", str(study_file), "--out", gcs_url, "--holder", holder, "--lease-s",
                                        str(lease_s), "--whole-slice", "--worker", str(w), env=env,
                                        start_new_session=True)))
        return workers

    def committed():
        fs, path = storage.filesystem(run_dir + "/checkpoints")
        fs.invalidate_cache()
        return sorted(int(m.split("/")[-2].split("_")[1]) for m in fs.glob(path + "/step_*/COMMITTED"))

    def audited():
        return [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]

    workers = slice_of("vmA")
    a0, a1 = workers
    try:
        assert a0.wait_for(r"study: r: starting"), a0.text()
        workers += slice_of("vmB")
        b0, b1 = workers[2:]
        assert b0.wait_for(r"study: waiting: 1 run") and b1.wait_for(r"following worker 0's claims"), b0.text()
        # Stop slice vmA (both hosts' process groups) once a checkpoint of step 4 or later is committed.
        assert a0.wait_for(rf"^step ([5-9]|1[0-9])/{max_steps}", timeout=600), a0.text()
        deadline = time.time() + 120
        while True:
            for w in (a0, a1):
                os.killpg(w.proc.pid, signal.SIGSTOP)
            frozen = time.time()
            time.sleep(0.2)  # a request already sent lands
            steps = committed()
            if steps or time.time() > deadline:
                break
            for w in (a0, a1):
                os.killpg(w.proc.pid, signal.SIGCONT)
            time.sleep(0.2)
        assert steps and steps[-1] + 4 <= max_steps, (steps, a0.text())
        resumed_from, target = steps[-1], steps[-1] + 4
        marker = f"{checkpoint.step_dir(run_dir, resumed_from)}/COMMITTED"
        old_attempt = json.loads(storage.read_bytes(marker))["attempt"]
        old_trainers = watch.alive()
        assert len(old_trainers) == 2, old_trainers
        [old_1] = [p for p in old_trainers if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
                   == a1.proc.pid]
        gate = tmp_path / "vmB-worker-0-saves"
        (tmp_path / "faults-vmB-0.jsonl").write_text(json.dumps(
            {"what": "writing", "match": f"step_{target:08d}/host_000", "mode": "hold", "gate": str(gate),
             "count": 1}) + "\n")

        assert b0.wait_for(r"study: r: taking over from vmA", timeout=120), b0.text()
        taken = time.time()
        took = taken - frozen
        # vmB's save of `target`: worker 1's index written, worker 0's part held.
        until = time.time() + 300
        while not (os.path.exists(f"{gate}.held") and any(
                f"step_{target:08d}/host_001" in r["url"] and r["url"].endswith(".json") for r in audited())):
            assert time.time() < until, b0.text() + b1.text()
            time.sleep(0.1)
        os.killpg(a1.proc.pid, signal.SIGCONT)  # vmA's worker 1 wakes
        thawed = time.time()
        while old_1 in watch.alive() and time.time() < thawed + 30:
            time.sleep(0.05)
        dead_after = max(0.0, watch.last_alive(old_1) - thawed)  # 0: no sample after the thaw saw it
        assert dead_after < 2.0, a1.text()
        # The request a fence cannot stop: vmA's host 1 part of this step, landing now.
        late = CheckpointWriter(run_dir, 1, 2, attempt=old_attempt)
        late.save(target, {"model/late": Shard(torch.zeros(2), (2,))}, {"step": target, "config": {}})
        late.wait()
        gate.touch()
        released = time.time()
        while target not in committed() and time.time() < released + 60:
            time.sleep(0.2)
        commit_s = time.time() - released
        assert target in committed(), f"vmB's checkpoint of step {target} not committed {commit_s:.0f} s after " \
                                      "the late index"
        os.killpg(a0.proc.pid, signal.SIGCONT)
        for w in (b0, b1, a0, a1):
            w.proc.wait(timeout=600)
    finally:
        watch.close()
        for w in workers:
            if w.proc.poll() is None:
                os.killpg(w.proc.pid, signal.SIGCONT)
                os.killpg(w.proc.pid, signal.SIGKILL)
    said = {name: w.text() for name, w in (("a0", a0), ("a1", a1), ("b0", b0), ("b1", b1))}
    assert [w.proc.returncode for w in (a0, a1, b0, b1)] == [0, 0, 0, 0], said
    assert re.search(r"study: r: (stopped, its )?lease lost", said["a1"]), said["a1"]

    # No write of vmA's trainers passed the fence after the takeover (one in flight at the freeze may
    # land later: the late index above is that case); vmB's commits each once, by its attempt.
    writes = sorted((r for r in audited() if r["url"].startswith(run_dir + "/")), key=lambda r: r["time"])
    old_writes = [r for r in writes if r["pid"] in old_trainers]
    assert old_writes and max(decided(r) for r in old_writes) < taken, old_writes[-3:]
    commits = [r["url"] for r in writes if r["url"].endswith("/COMMITTED")]
    assert len(commits) == len(set(commits)), commits
    final = json.loads(storage.read_bytes(run_dir + "/final.json"))
    assert final["step"] == max_steps
    steps = committed()
    assert steps == list(range(4, max_steps + 1, 4)), steps
    new_attempt = json.loads(storage.read_bytes(checkpoint.step_dir(run_dir, target) + "/COMMITTED"))["attempt"]
    assert new_attempt != old_attempt
    for step in steps:  # what a resume reads, every one of them
        tensors, state = checkpoint.read_checkpoint(checkpoint.step_dir(run_dir, step))
        assert state["attempt"] == (old_attempt if step <= resumed_from else new_attempt), step
        assert "model/late" not in tensors and state["hosts"] == 2
    fs, path = storage.filesystem(checkpoint.step_dir(run_dir, target))
    fs.invalidate_cache()
    assert not [f for f in fs.ls(path, detail=False) if old_attempt in f], "the late files were left behind"
    assert checkpoint.newest_readable(run_dir, checkpoint.read_checkpoint)[0] == max_steps
    print(f"2-host slices: vmA stopped at committed step {resumed_from}, taken over by vmB {took:.1f} s later "
          f"(lease {lease_s:g} s); vmA's worker 1's trainer died {dead_after:.2f} s after its thaw (sampled every "
          f"20 ms), its last write {thawed - max(decided(r) for r in old_writes if r['pid'] == old_1):.1f} s before "
          f"the thaw; vmB's step {target} committed {commit_s:.1f} s after the late index")


def test_holders_of_one_name_do_not_take_each_others_runs(tmp_path):
    """The protocol alone: a second process of the same holder name sees the first's claim as
    another's (waits for its lease), and takes at once only what a process of this machine that
    ended left."""
    out = str(tmp_path / "study")
    first, second = claims.Claims(out, "vm", 60.0), claims.Claims(out, "vm", 60.0)
    assert first.write("r", 0, "running")
    generation, record = second.current("r")
    assert not second.mine(record) and not second.gone(record) and first.mine(record)
    ended = subprocess.run([sys.executable, "-c", "from fleet import claims; import sys; "
                            "claims.Claims(sys.argv[1], 'vm', 60.0).write('q', 0, 'running')", out],
                           cwd=PROJECT_DIR, check=True)
    assert ended.returncode == 0
    assert second.gone(second.current("q")[1])  # its process ended: taken at once


def test_with_the_default_lease_a_takeover_comes_half_a_lease_after_the_last_deadline(tmp_path, monkeypatch):
    """The protocol with the default lease (120 s) on a clock the test moves: the deadline a claim
    write gives its trainer, the earliest takeover an observer that saw the write at once can
    make, and a renewal whose create landed but whose listing failed, tried again later: found as
    its own, its deadline counted from its first try."""
    now = [1000.0]
    monkeypatch.setattr(claims, "_clock", lambda: now[0])
    out, lease = str(tmp_path / "study"), 120.0
    holder, observer = claims.Claims(out, "vm", lease), claims.Claims(out, "vm", lease)
    assert holder.retry["budget_s"] == lease / 8  # one claim operation's retries: 15 s
    assert holder.write("r", 0, "running") and observer.current("r")[0] == 1
    deadline = holder.started["r"] + fencing.LEASE_FRACTION * lease
    assert deadline == 1060.0
    now[0] = deadline + 0.5 * lease - 0.01
    assert not observer.stale("r", 1)
    now[0] = deadline + 0.5 * lease
    assert observer.stale("r", 1)  # the earliest takeover: half a lease after the trainer's deadline
    faults = tmp_path / "faults.jsonl"
    faults.write_text(json.dumps({"what": "listing", "match": "/claims/", "mode": "fail"}) + "\n")
    monkeypatch.setenv("TRM_STORAGE_FAULTS", str(faults))
    monkeypatch.setattr(storage, "_sleep", lambda s: None)
    now[0], first_try = 2000.0, 2000.0
    with pytest.raises(storage.StorageError, match="injected"):
        holder.write("r", 1, "running", since=1)  # generation 2 landed; the listing after it failed
    faults.write_text("")
    now[0] = 2010.0
    assert holder.write("r", 1, "running", since=1)  # the same write again: found as its own
    assert holder.started["r"] == first_try and holder.current("r")[1]["instance"] == holder.instance
    assert not observer.write("r", 1, "running", took_from="vm")  # the observer's takeover loses


def test_a_fenced_process_stops_when_its_holder_goes_and_never_writes_past_its_deadline(tmp_path, monkeypatch):
    """fleet/fencing.py alone: the trainer's side ends its process (exit 76) at the pipe's end of file,
    and its check refuses a change to the run directory past the deadline (other paths pass)."""
    lease = fencing.Lease(time.monotonic() + 60.0, str(tmp_path / "run"))
    child = subprocess.Popen([sys.executable, "-c", "import time; from fleet import fencing; "
                              "fencing.start_from_environment(); print('fenced', flush=True); time.sleep(60)"],
                             cwd=PROJECT_DIR, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(lease.read_fd,),
                             env={**os.environ, **lease.child_env()})
    lease.started()
    assert child.stdout.readline() == "fenced\n"
    lease.extend(time.monotonic() + 120.0)
    closed = time.monotonic()
    lease.close()  # the holder's end goes, as when it is killed
    assert child.wait(timeout=30) == fencing.EXIT_FENCED and time.monotonic() - closed < 5.0
    assert "its study process ended" in child.stderr.read()
    read_end, write_end = os.pipe()
    fence = fencing.Fence(read_end, time.monotonic() + 60.0, str(tmp_path / "run"))

    class Stopped(PermissionError):  # (the real stop ends the process; this one, a permanent error)
        pass

    def stopped(why):
        raise Stopped(why)
    monkeypatch.setattr(fence, "stop", stopped)
    monkeypatch.setattr(storage, "_fence", fence.check)
    storage.write_bytes(str(tmp_path / "run" / "a"), b"1")  # before the deadline
    os.write(write_end, b"lost\n")
    with pytest.raises(storage.StorageError, match="lost the run's claim"):
        storage.write_bytes(str(tmp_path / "run" / "b"), b"2")
    fence.deadline = time.monotonic() - 1.0
    with pytest.raises(storage.StorageError, match="lease ran out"):
        storage.write_bytes(str(tmp_path / "run" / "c"), b"3")
    storage.write_bytes(str(tmp_path / "elsewhere"), b"4")  # outside the run directory
    assert sorted(os.listdir(tmp_path / "run")) == ["a"]
    os.close(read_end)
    os.close(write_end)


# -- one owner of a claim's state at a time: a renewal stalled in storage past its run's end ----------

class StalledCreates:
    """Claim writes (fleet/claims.py's create_exclusive) that stall, for the threads a test names,
    until it releases them: a storage request hanging mid-write."""

    def __init__(self, monkeypatch):
        self.gates: dict[str, tuple[threading.Event, threading.Event]] = {}
        real = claims.create_exclusive

        def create(url, payload, **retry):
            gate = self.gates.pop(threading.current_thread().name, None)
            if gate:
                gate[0].set()
                gate[1].wait(300)
            return real(url, payload, **retry)
        monkeypatch.setattr(claims, "create_exclusive", create)

    def arm(self, thread: str) -> tuple[threading.Event, threading.Event]:
        """(set when the thread's next claim write stalls, set it to let the write go on)"""
        self.gates[thread] = (threading.Event(), threading.Event())
        return self.gates[thread]


class WatchedLock:
    """A lock that says which threads had to wait for it."""

    def __init__(self):
        self.lock, self.waited = threading.Lock(), {}

    def waiting(self, thread: str) -> threading.Event:
        return self.waited.setdefault(thread, threading.Event())

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.waiting(threading.current_thread().name).set()
            self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


def until(condition, timeout=120.0, what="the condition"):
    """Poll `condition` (a state, not a time) every 20 ms, up to a generous `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout:g} s"
        time.sleep(0.02)


def in_thread(name, fn):
    """fn() in a thread named `name`; (the thread, its result: {"value": ...} or {"error": ...})."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            result["error"] = e
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread, result


@pytest.fixture
def stalled_runner(tmp_path, monkeypatch):
    """A StudyRunner (runs a and b, an 8 s lease) whose trainers are shell scripts that sleep until
    SIGTERMed, then exit 76 (a trainer that saw its own deadline pass), and a run a whose renewal
    stalls inside its claim write, begun after its trainer exited and before the study noticed (the
    study's main thread held there until the renewal is in its write, as a loaded machine can
    hold it): (runner, the stalls, the watched claim lock, the renewal's release, the renewal
    thread, the trainers)."""
    from fleet.plan import StudyRun
    from fleet.runner import StudyRunner

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ntrap 'kill $!; exit 76' TERM\nsleep 300 &\ntouch \"$TRM_TEST_READY/$$\"\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TRM_TEST_READY", str(tmp_path))  # each trainer's pid, once it handles SIGTERM
    a, b = StudyRun("a", "demo", (), 1), StudyRun("b", "demo", (), 2)
    runner = StudyRunner([a, b], str(tmp_path / "out"), "", holder="h", lease_s=8.0, python=str(fake))
    runner.claim_lock = lock = WatchedLock()
    stalls = StalledCreates(monkeypatch)
    trainers, gate = [], {}
    launch = runner.launch

    def launched(run):
        status, last = launch(run)
        if run is a:  # the renewal's next write starts now, and stalls
            gate["entered"], gate["release"] = stalls.arm("trm-renew")
            assert gate["entered"].wait(120), "a's renewal never wrote"
        return status, last
    monkeypatch.setattr(runner, "launch", launched)
    try:
        assert runner.claim_next([a]) == (a, 1)
        first, result = in_thread("runner-a", lambda: runner.run_one(a))
        until(lambda: runner.child is not None and runner.lease is not None, what="a's trainer starting")
        trainers.append(runner.child)
        until(lambda: (tmp_path / str(trainers[0].pid)).exists(), what="a's trainer ready")
        [renewal] = [t for t in threading.enumerate() if t.name == "trm-renew" and t.is_alive()]
        trainers[0].send_signal(signal.SIGTERM)
        first.join(120)
        assert not first.is_alive() and result == {"value": None} and trainers[0].returncode == fencing.EXIT_FENCED
        assert renewal.is_alive() and not gate["release"].is_set()  # still inside its write
        yield runner, stalls, lock, gate["release"], renewal, trainers
    finally:
        for stall in stalls.gates.values():
            stall[1].set()
        if gate:
            gate["release"].set()
        for trainer in trainers + [runner.child]:
            if trainer and trainer.poll() is None:
                trainer.kill()


def test_a_renewal_stalled_past_its_runs_end_leaves_the_next_claim_of_that_run_alone(stalled_runner):
    """The study claims its own run again while the old renewal is still inside its claim write
    (the issue's KeyError: both writes shared Claims.pending unlocked, and the study exited 1): the
    claim waits for the renewal, and the study process claims the run with its state whole."""
    runner, stalls, lock, release, renewal, _ = stalled_runner
    a = runner.runs[0]
    claimed, stall = stalls.arm("claimer")
    claimer, result = in_thread("claimer", lambda: runner._patiently("claiming a run", lambda: runner.claim_next([a])))
    until(lambda: claimed.is_set() or lock.waiting("claimer").is_set(), what="the claim's write")
    release.set()  # the stalled renewal's record lands
    renewal.join(120)
    stall.set()
    claimer.join(120)
    assert not claimer.is_alive() and "error" not in result, result
    if result["value"][0] is None:  # its claim lost to the renewal's record: its own, taken at its next look
        result["value"] = runner.claim_next([a])
    assert result["value"][0] is a
    generation, record = runner.claims.current("a")
    assert result["value"][1] == generation == runner.generation and runner.claims.mine(record)


def test_a_renewal_that_loses_after_its_runs_end_does_not_touch_the_next_run(stalled_runner):
    """Another holder takes run a while a's renewal is stalled; the study claims run b and trains
    it; the stalled renewal then returns, lost: b's trainer lives and b's lease is renewed (before,
    the old thread's _lose marked the lease lost, b's renewals stopped, or b's trainer was killed)."""
    runner, stalls, lock, release, renewal, trainers = stalled_runner
    a, b = runner.runs
    other = claims.Claims(runner.out, "other", 8.0)
    generation = other.current("a")[0]
    assert other.write("a", generation, "running", took_from="h")  # the stalled renewal's generation
    claimer, result = in_thread("claimer", lambda: runner.claim_next([b]))
    until(lambda: not claimer.is_alive() or lock.waiting("claimer").is_set(), what="the claim of b")
    second = None
    if not claimer.is_alive():  # (the old code: the claim did not wait for the renewal)
        second, _ = in_thread("runner-b", lambda: runner.run_one(b))
        until(lambda: lock.waiting("runner-b").is_set() or runner.child not in (None, trainers[0]),
              what="b's launch")
    release.set()
    renewal.join(120)
    claimer.join(120)
    assert result == {"value": (b, 1)}, result
    if second is None:
        second, _ = in_thread("runner-b", lambda: runner.run_one(b))
    until(lambda: runner.child not in (None, trainers[0]) and runner.lease is not None, what="b's trainer")
    trainers.append(runner.child)
    until(lambda: os.path.exists(os.path.join(os.environ["TRM_TEST_READY"], str(trainers[1].pid))),
          what="b's trainer ready")
    until(lambda: runner.claims.current("b")[0] >= 2 or runner.lost.is_set() or trainers[1].poll() is not None,
          what="b's first renewal")
    assert trainers[1].poll() is None and not runner.lost.is_set()
    assert runner.claims.current("b")[0] >= 2 and runner.claims.current("a")[1]["holder"] == "other"
    trainers[1].send_signal(signal.SIGTERM)  # b's trainer ends (76: as if fenced)
    second.join(120)
    assert not second.is_alive()


def test_a_renewal_or_release_retried_after_a_relaunch_finds_its_own_record(tmp_path, monkeypatch):
    """A renewal whose record landed but whose call failed (the listing after it failed), then the
    run relaunched after exit 75: the next renewal names the new trainer, another record than the
    one that landed. It finds the landed one as this process's own (its instance) and writes after
    it, instead of reading it as another holder's (the holder killed its new trainer). A release
    after such a renewal does the same (it returned False and left the claim running)."""
    monkeypatch.setattr(storage, "_sleep", lambda s: None)
    faults = tmp_path / "faults.jsonl"
    monkeypatch.setenv("TRM_STORAGE_FAULTS", str(faults))
    out = str(tmp_path / "study")
    holder, observer = claims.Claims(out, "vm", 60.0), claims.Claims(out, "other", 60.0)
    assert holder.write("r", 0, "running", since=1) == 1

    def unanswered(after, **fields):  # the record lands; the listing after it fails: the call raises
        faults.write_text(json.dumps({"what": "listing", "match": "/claims/", "mode": "fail"}) + "\n")
        with pytest.raises(storage.StorageError, match="injected"):
            holder.write("r", after, "running", since=1, **fields)
        faults.write_text("")

    unanswered(1, trainer="100:1")
    assert holder.write("r", 1, "running", since=1, trainer="200:2") == 3  # the relaunched trainer's renewal
    generation, record = observer.current("r")
    assert generation == 3 and record["trainer"] == "200:2" and holder.mine(record)
    unanswered(3, trainer="200:2")
    assert holder.write("r", 3, "released") == 5  # the release after it
    assert observer.current("r")[1]["state"] == "released"
    assert observer.write("r", 5, "running", took_from="vm") == 6  # anyone may take it at once
    assert holder.write("r", 5, "running") is None  # another's record is no one's own but its writer's


def test_an_empty_claim_file_is_a_crashed_write_taken_over_after_a_lease(tmp_path, monkeypatch, capsys):
    """A crash between a local claim's exclusive create and its write leaves its newest generation
    empty (before: current() failed five times, the study exited 75, on every relaunch). It reads
    as a running claim of an unknown holder, said once with the file's name, and the study takes
    the run over once it has seen that generation for a lease, not before."""
    from fleet.plan import StudyRun
    from fleet.runner import StudyRunner

    now = [1000.0]
    monkeypatch.setattr(claims, "_clock", lambda: now[0])
    out = tmp_path / "out"
    empty = out / "study" / "claims" / "a" / "00000001.json"
    empty.parent.mkdir(parents=True)
    empty.write_bytes(b"")
    a = StudyRun("a", "demo", (), 1)
    runner = StudyRunner([a], str(out), "", holder="h", lease_s=60.0)
    assert runner.claim_next([a]) == (None, 1)  # held: its lease has not gone stale
    now[0] += 59.0
    assert runner.claim_next([a]) == (None, 1)
    said = capsys.readouterr().out
    assert said.count(f"claims: {empty} is empty or unreadable") == 1, said
    now[0] += 1.0
    assert runner.claim_next([a]) == (a, 2)
    generation, record = runner.claims.current("a")
    assert generation == 2 and record["state"] == "running" and runner.claims.mine(record)
    assert "a: taking over from an unknown holder (its claim file empty or unreadable: a write that crashed) (its " \
        "lease, generation 1, went stale)" in capsys.readouterr().out


@pytest.mark.parametrize("pid", ["alive", "dead"])
def test_holders_in_two_pid_namespaces_of_one_machine_wait_each_others_lease(pid, tmp_path, monkeypatch):
    """Two study processes in two containers of one machine: one boot id, process ids numbered per
    PID namespace, so the other's PID read in this namespace's /proc names some process, alive or
    not, unrelated to it (before: a dead one read as "held by a process of this machine that
    ended", taken at once; two trainers of a run within 20 s). The namespace is in the identity:
    neither takes the other's live run before a lease; in one namespace a process that ended is
    still taken at once."""
    from fleet.plan import StudyRun
    from fleet.runner import StudyRunner

    now = [1000.0]
    monkeypatch.setattr(claims, "_clock", lambda: now[0])
    out, a = str(tmp_path / "out"), StudyRun("a", "demo", (), 1)
    other = claims.Claims(out, "pod-1", 60.0)
    other.pidns = 4026531836 + 17  # injected: another container's namespace (an inode of /proc/self/ns/pid)
    ended = subprocess.Popen(["true"])
    ended.wait()  # its process id runs nothing here now
    other.process = claims.process_identity(os.getpid()) if pid == "alive" else f"{ended.pid}:1"
    assert other.write("a", 0, "running", since=1) == 1
    runner = StudyRunner([a], out, "", holder="pod-2", lease_s=60.0)
    record = runner.claims.current("a")[1]
    assert record["boot"] == runner.claims.boot and not runner.claims.gone(record)
    assert runner.claim_next([a]) == (None, 1)
    now[0] += 59.0
    assert runner.claim_next([a]) == (None, 1)  # not before its lease
    now[0] += 1.0
    assert runner.claim_next([a]) == (a, 2)
    assert record["pidns"] == other.pidns != runner.claims.pidns  # the namespace in the identity
    if pid == "dead":  # the same namespace: a process that ended is taken at once, as before
        same = claims.Claims(out, "pod-1", 60.0)
        same.process = other.process
        assert same.write("b", 0, "running", since=1) == 1
        assert runner.claims.gone(runner.claims.current("b")[1])


# -- a multi-host slice's followers (workers 1..N-1 of one holder) ------------------------------------

def follower_of(tmp_path, monkeypatch, trainer: str, lease_s: float):
    """Worker 0's claims (the holder "vm", a Claims the test drives) and a follower, worker 1 of the
    slice vm, whose trainer is the shell script `trainer`, that follows worker 0's claim on run a:
    (worker 0, the follower, run a, what the follower said, the generation it followed)."""
    from fleet.plan import StudyRun
    from fleet.runner import StudyRunner

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + trainer)
    fake.chmod(0o755)
    out, a = str(tmp_path / "out"), StudyRun("a", "demo", (), 1)
    worker0 = claims.Claims(out, "vm", lease_s)
    generation = worker0.write("a", 0, "running", since=1)
    follower = StudyRunner([a], out, "", holder="vm", lease_s=lease_s, whole_slice=True, worker=1, python=str(fake))
    said = []
    monkeypatch.setattr(follower, "say", lambda text: said.append(text) or print(f"study: {text}", flush=True))
    for _ in range(3):  # the follower may wait to see the claim renewed before it follows it
        run, held = follower.claim_next([a])
        if run is a:
            return worker0, follower, a, said, generation
        generation = worker0.write("a", generation, "running", since=1)
    raise AssertionError(f"the follower never followed worker 0's claim: {said}")


def test_a_follower_whose_trainer_ends_before_worker_0s_final_json_waits_and_counts_the_run_done_once(
        tmp_path, monkeypatch):
    """A slice's hosts end a run in no set order: worker 0 writes final.json after its last commit.
    A follower whose own train.py exited 0 first waits for worker 0's record of the run's end (before:
    it read "exit 0, no final.json" as a stop on a signal and ended its study, and worker 0's next
    trainer waited for a host that was gone), then counts the run done, once."""
    worker0, follower, a, said, generation = follower_of(tmp_path, monkeypatch, "exit 0\n", lease_s=60.0)
    waiting = threading.Event()
    monkeypatch.setattr(follower, "say", lambda text: (said.append(text), "waiting for worker 0" in text
                                                       and waiting.set()))

    def worker_0_ends():  # once the follower waits: worker 0's final.json, then its claim's done
        if waiting.wait(120):
            storage.write_bytes(storage.join_url(follower.out, "a", "final.json"),
                                json.dumps({"metrics": {"exact_accuracy": 0.5}}).encode())
            worker0.write("a", generation, "done")
    ender = threading.Thread(target=worker_0_ends, daemon=True)
    ender.start()
    assert follower.run_one(a) is None
    waited = waiting.is_set()
    waiting.set()  # (the old code never waited: the ender ends)
    ender.join(120)
    assert waited and not follower.stopping, said
    assert follower.counts["done"] == 1, said
    assert any(text.startswith("a: done in") and "exact accuracy 50.00%" in text for text in said), said
    assert follower.claim_next([a]) == (None, 0)  # over: not followed again
    assert follower.counts["done"] == 1


def test_a_follower_whose_worker_0_stops_renewing_has_its_trainer_stopped_within_a_lease(tmp_path, monkeypatch):
    """A follower's trainer is fenced like worker 0's: its deadline comes from worker 0's claim,
    read from storage (half a lease after the start of the last look that had not yet seen the
    newest renewal). While worker 0 renews, the trainer trains on past any one deadline; once the
    renewals stop (worker 0 deposed, frozen, cut off), the trainer stops, exit 76 by its own fence
    (or killed by the follower's watcher at the same deadline), within a lease. Before, workers
    1..N-1 got Lease(inf): a deposed follower's trainer wrote on."""
    lease = 8.0
    trainer = (f"exec {sys.executable} -c 'import sys, time; sys.path.insert(0, \"{PROJECT_DIR}\"); "
               "from fleet import fencing; fencing.start_from_environment(); time.sleep(300)'\n")
    worker0, follower, a, said, generation = follower_of(tmp_path, monkeypatch, trainer, lease_s=lease)
    renewing, renewed = threading.Event(), [generation]
    renewing.set()

    def renew():  # worker 0's renewals, every lease/8, while the test lets them go on
        while renewing.is_set():
            renewed[0] = worker0.write("a", renewed[0], "running", since=1) or renewed[0]
            time.sleep(lease * fencing.RENEW_FRACTION)
    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    runner, result = in_thread("follower", lambda: follower.run_one(a))
    try:
        until(lambda: follower.child is not None, what="the follower's trainer starting")
        child = follower.child
        time.sleep(1.5 * lease)  # three deadlines' worth: renewals seen keep it training
        assert child.poll() is None, (child.returncode, said)
        renewing.clear()
        renewer.join(30)
        stopped_renewing = time.monotonic()
        until(lambda: child.poll() is not None, timeout=3 * lease, what="the follower's trainer stopping")
        took = time.monotonic() - stopped_renewing
        print(f"the follower's trainer stopped {took:.1f} s after worker 0's last renewal (lease {lease:g} s), "
              f"exit {child.returncode}")
        assert child.returncode in (fencing.EXIT_FENCED, -signal.SIGKILL) and took <= lease + 2.0, (took, said)
        runner.join(60)
        assert result == {"value": None} and follower.lost.is_set(), (result, said)
        assert any("lease lost" in text for text in said), said
    finally:
        renewing.clear()
        if follower.child and follower.child.poll() is None:
            follower.child.kill()
