#!/usr/bin/env bash
# worker.sh: the worker side of launch.sh, run on every TPU VM worker (one process per worker).
#
# launch.sh runs it on the workers with `gcloud compute tpus tpu-vm ssh --worker=all` (or a list of
# workers for logs). It never relies on a copy on the workers: setup, check and status also run
# before the first deploy or on workers that hold older code, so each call sends this file's text,
# base64-encoded (one line, no quoting to get wrong), inside the --command itself:
#
#   s="$(printf %s 'BASE64 OF THIS FILE' | base64 -d)" && exec bash -c "$s" worker.sh COMMAND ARGS...
#
# with every argument single-quoted for the worker's login shell. (deploy also ships this file to
# ~/trm with the rest of the code; that copy is not used.) By hand on a worker:
# `bash worker.sh remote_status`.
#
# Commands (one per launch.sh step):
#   remote_setup REQUIREMENT...      venv ~/trm-venv with these requirements; versions report
#   remote_deploy CODE_HASH          ~/trm-code.tar.gz (copied by scp) unpacked into a fresh ~/trm
#   remote_preflight                 code hash, venv, running trainer: what train asks first
#   remote_launch RUN_NAME ARGS...   train.py ARGS in the background, logging to the run's log
#   remote_study STUDY_NAME HOLDER HOSTS BUCKET STUDY_B64
#                                    study.py run: the study file (base64) in ~/trm-state/studies/,
#                                    into gs://BUCKET/studies/STUDY_NAME, claiming runs as HOLDER
#                                    (the VM's name); on a slice of HOSTS > 1, --whole-slice
#   remote_smoke_rates URL MEGABYTES pod/smoke.py rates: the bucket's write and read rates from here
#   remote_smoke_report BUCKET OUT ACCELERATOR WORKERS PRESET STEPS RUN_A RUN_B FACTS_B64
#                                    pod/smoke.py report (worker 0): the smoke table from both runs
#   remote_status                    the run, its trainer's state, code hash, the log's last line,
#                                    and once it ended the last line train.py printed
#   remote_stop WAIT_SECONDS KILL    SIGTERM to train.py, wait, SIGKILL if KILL is 1
#   remote_logs RUN LINES MODE       the run's log (RUN "" = latest): follow, tail or prefix
#   remote_check BUCKET DATA_URL HOST0 PORT WORKERS WAIT
#                                    versions, bucket, dataset, TCP to worker 0's PORT, TPU devices (check)
#
# What they print for launch.sh: lines TRM|WORKER|KEY|VALUE (launch.sh shows KEY ok, note and error
# to the user and reads the others); anything else goes through as it is. On the worker: code in
# ~/trm, venv in ~/trm-venv, trainer state and logs in ~/trm-state (name, pid, exit, signal,
# stopped, args, logs/RUN_NAME.log). Needs bash and Linux (/proc); Python >= 3.10 for setup.
set -u

# ----------------------------------------------------------------------------------------------
# Helpers

r_init() {  # W: this worker's number; C, V, S, PY: code, venv, trainer state, the venv's python
  W=$(curl -sf -m 5 -H 'Metadata-Flavor: Google' \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number 2>/dev/null) || W=""
  case $W in ''|*[!0-9]*) W=$(hostname | sed -n 's/.*-w-\([0-9][0-9]*\)$/\1/p') ;; esac
  [ -n "$W" ] || W=$(hostname)
  C=$HOME/trm            # code
  V=$HOME/trm-venv       # venv
  S=$HOME/trm-state      # trainer state: name, pid, exit, signal, stopped, args, logs/
  PY=$V/bin/python
  mkdir -p "$S/logs"
}

r_say() {  # r_say KEY TEXT...: one line the laptop reads
  local k=$1
  shift
  printf 'TRM|%s|%s|%s\n' "$W" "$k" "$*"
}

r_say_each() {  # KEY<TAB>VALUE lines on stdin, each said with r_say
  local k v
  while IFS=$'\t' read -r k v; do r_say "$k" "$v"; done
}

r_active_pid() {  # the pid of our running train.py (or study.py, which runs train.py), if any
  local p
  p=$(cat "$S/pid" 2>/dev/null) || return 1
  [ -n "$p" ] && [ -r "/proc/$p/cmdline" ] || return 1
  tr '\0' ' ' 2>/dev/null < "/proc/$p/cmdline" | grep -qF -e "$C/train.py" -e "$C/study.py" || return 1
  echo "$p"
}

r_code_hash() {  # r_code_hash DIR: the code hash if every file matches the manifest; none; modified
  local d=${1:-$C}
  [ -f "$d/.trm-code-sha256sums" ] || { echo none; return 0; }
  (cd "$d" && sha256sum --quiet --strict -c .trm-code-sha256sums >/dev/null 2>&1) || { echo modified; return 0; }
  sha256sum < "$d/.trm-code-sha256sums" | cut -c1-64
}

# The worker's Python checks, the only Python here: give it to the venv's python on stdin
# (`r_checks_py | "$PY" - versions`). Prints KEY<TAB>VALUE lines (for r_say_each).
r_checks_py() {
  cat <<'PY'
"""versions: Python, torch, torch_xla and libtpu versions (setup).
check WORKER BUCKET DATA DEVICES: the versions; then bucket: a probe object written to and removed from
gs://BUCKET/runs/.trm-check/; data: DATA's train and test dataset.json read (if DATA); devices,
local_devices, processes: the TPU runtime's counts (if DEVICES is 1). A failure is ERROR Type: text.
port WORKER HOST0 PORT WORKERS WAIT: master_port: TCP between the workers on the port where the
trainers' host group meets (gloo's rendezvous on worker 0, torch's MASTER_PORT): worker 0 listens,
every other worker connects to HOST0 (ok ... or ERROR ..., within WAIT seconds)."""
import importlib.metadata as md, json, platform, socket, sys, time


def say(k, v):
    print(f"{k}\t{v}", flush=True)


def error(e):
    return f"ERROR {type(e).__name__}: {e}".replace("\n", " ")[:300]


def port_check(worker, host0, port, workers, wait):
    deadline = time.time() + wait
    if worker == 0:
        try:
            with socket.create_server(("", port)) as server:
                connected = 0
                while connected < workers - 1 and time.time() < deadline:
                    server.settimeout(max(0.1, deadline - time.time()))
                    try:
                        conn = server.accept()[0]
                        connected += 1
                        with conn:   # the worker closes first: TIME_WAIT lands on its port, not on this one
                            conn.settimeout(2)
                            try:
                                conn.recv(1)
                            except OSError:
                                pass
                    except socket.timeout:
                        break
            state = "ok" if connected == workers - 1 else "ERROR"
            say("master_port", f"{state} {connected} of {workers - 1} workers reached port {port} here in {wait} s")
        except OSError as e:
            say("master_port", f"ERROR cannot listen on port {port}: {e}")
        return
    while True:
        try:
            socket.create_connection((host0, port), timeout=5).close()
            return say("master_port", f"ok {host0}:{port} reached")
        except OSError as e:
            if time.time() > deadline:
                return say("master_port", f"ERROR no TCP connection to worker 0 at {host0}:{port} in {wait} s: {e}")
            time.sleep(0.5)


if sys.argv[1] == "port":
    port_check(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    sys.exit(0)
say("python", platform.python_version())
for name in ("torch", "torch_xla", "libtpu"):
    try:
        say(name, md.version(name))
    except md.PackageNotFoundError:
        say(name, "missing")
if sys.argv[1] == "check":
    worker, bucket, data, devices = sys.argv[2:6]
    try:
        import fsspec
        fs = fsspec.filesystem("gs")
        probe = f"{bucket}/runs/.trm-check/worker-{worker}"
        with fs.open(probe, "wb") as f:
            f.write(b"ok")
        fs.rm(probe)
        say("bucket", "ok")
    except Exception as e:
        say("bucket", error(e))
    if data:
        try:
            import fsspec
            for split in ("train", "test"):
                with fsspec.open(f"{data}/{split}/dataset.json", "r") as f:
                    json.load(f)
            say("data", "ok")
        except Exception as e:
            say("data", error(e))
    if devices == "1":
        try:
            import torch_xla.runtime as xr
            say("devices", xr.global_runtime_device_count())
            say("local_devices", xr.addressable_runtime_device_count())
            say("processes", xr.process_count())
        except Exception as e:
            say("devices", error(e))
PY
}

# ----------------------------------------------------------------------------------------------
# Commands

remote_setup() {  # remote_setup REQUIREMENT...
  local log=$S/setup.log want=$V/trm-requirements.txt new
  new=$want.new
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    r_say error "python3 >= 3.10 needed, found: $(python3 --version 2>&1)"; return 1
  fi
  if [ ! -x "$V/bin/pip" ]; then
    rm -rf "$V"
    if ! python3 -m venv "$V" >>"$log" 2>&1; then
      rm -rf "$V"
      r_say note "installing python3-venv with apt"
      # shellcheck disable=SC2024  # the log is ours, apt-get needs root
      if ! { sudo -n apt-get -o DPkg::Lock::Timeout=600 -qq update && sudo -n apt-get -o DPkg::Lock::Timeout=600 -qq -y install python3-venv; } >>"$log" 2>&1 \
         || ! python3 -m venv "$V" >>"$log" 2>&1; then
        r_say error "could not create $V (see $log)"; tail -n 5 "$log" >&2; return 1
      fi
    fi
    r_say note "created $V"
  fi
  printf '%s\n' "$@" > "$new"
  if cmp -s "$new" "$want"; then
    rm -f "$new"
    r_say note "requirements already installed"
  else
    r_say note "installing $(tr '\n' ' ' < "$new")"
    if ! "$V/bin/pip" install --no-input --disable-pip-version-check -r "$new" >>"$log" 2>&1; then
      r_say error "pip install failed; the end of $log:"
      tail -n 15 "$log" | sed "s/^/  [worker $W] /" >&2
      return 1
    fi
    mv "$new" "$want"
  fi
  r_checks_py | "$PY" - versions | r_say_each
  r_say ok "venv ready"
}

remote_deploy() {  # remote_deploy EXPECTED_HASH
  local want=$1 got p tar=$HOME/trm-code.tar.gz
  if p=$(r_active_pid); then
    r_say error "run $(cat "$S/name") is running (pid $p): stop it before deploying"; return 10
  fi
  rm -rf "$C.new" "$C.old"
  mkdir -p "$C.new"
  if ! tar --warning=no-unknown-keyword -xzf "$tar" -C "$C.new" --strip-components=1; then
    r_say error "could not unpack $tar"; rm -rf "$C.new"; return 1
  fi
  got=$(r_code_hash "$C.new")
  if [ "$got" != "$want" ]; then
    r_say error "unpacked code is $got, expected $want"; rm -rf "$C.new"; return 1
  fi
  if [ -e "$C" ]; then mv "$C" "$C.old"; fi
  mv "$C.new" "$C"
  rm -rf "$C.old" "$tar"
  got=$(r_code_hash "$C")
  r_say code "$got"
  r_say ok "code ${got:0:12} in ~/trm"
}

remote_preflight() {  # remote_preflight: what train needs to know before starting anything
  local p
  r_say code "$(r_code_hash "$C")"
  if [ -x "$PY" ]; then r_say venv ok; else r_say venv missing; fi
  if p=$(r_active_pid); then r_say active "$(cat "$S/name" 2>/dev/null)"; r_say pid "$p"; fi
  return 0
}

remote_launch() {  # remote_launch RUN_NAME TRAIN_ARGS...
  local run=$1
  shift
  rm -f "$S/study.txt"   # not a study
  r_start "$run" train.py "$@"
}

remote_study() {  # remote_study STUDY_NAME HOLDER HOSTS BUCKET STUDY_B64
  local run=$1 holder=$2 hosts=$3 bucket=$4 file args
  mkdir -p "$S/studies"
  file=$S/studies/$run.txt
  printf %s "$5" | base64 -d > "$file" || { r_say error "could not write the study file $file"; return 1; }
  args=(run "$file" --out "gs://$bucket/studies/$run" --holder "$holder")
  if [ "$hosts" -gt 1 ]; then   # a multi-host slice: worker 0 claims, the slice trains each run whole
    case $W in
      ''|*[!0-9]*) r_say error "study on a multi-host slice: this worker's number is unknown ($W)"; return 1 ;;
    esac
    args+=(--whole-slice --worker "$W")
  fi
  export TRM_BUCKET=$bucket TRM_STUDY_STATE=$S/study.txt   # $TRM_BUCKET in the study file
  rm -f "$S/study.txt"
  r_start "$run" study.py "${args[@]}" -- --run.device tpu
}

remote_smoke_rates() {  # remote_smoke_rates URL MEGABYTES
  if [ ! -x "$PY" ] || [ ! -f "$C/pod/smoke.py" ]; then
    r_say rates "ERROR no venv or no pod/smoke.py in ~/trm: run setup and deploy"; return 0
  fi
  (cd "$C" && "$PY" "$C/pod/smoke.py" rates "$1" --worker "$W" --megabytes "$2") | r_say_each
}

# remote_smoke_report BUCKET OUT ACCELERATOR WORKERS PRESET STEPS RUN_A RUN_B FACTS_B64: pod/smoke.py
# report over runs A and B (their records in the bucket, their logs here) and the laptop's facts.
remote_smoke_report() {
  local bucket=$1 facts=$S/smoke-facts.txt
  printf %s "$9" | base64 -d > "$facts" || { r_say error "could not write $facts"; return 1; }
  cd "$C" && "$PY" "$C/pod/smoke.py" report --out "$2" --accelerator "$3" --workers "$4" --preset "$5" --steps "$6" \
    --run-a "gs://$bucket/runs/$7" --log-a "$S/logs/$7.log" --run-b "gs://$bucket/runs/$8" --log-b "$S/logs/$8.log" \
    --facts "$facts"
}

r_start() {  # r_start RUN_NAME SCRIPT ARGS...: SCRIPT (train.py, study.py) ARGS in the background
  local run=$1 script=$2 p stale i log what=train.py
  shift 2
  if p=$(r_active_pid); then
    r_say error "run $(cat "$S/name") is already running (pid $p)"; return 10
  fi
  # Stale trainers of ours (left by a crash or started by hand): they would hold the TPU.
  stale=""
  for p in $(pgrep -u "$(id -u)" -f '(train|study)\.py' || true); do
    if tr '\0' ' ' 2>/dev/null < "/proc/$p/cmdline" | grep -qF -e "$C/train.py" -e "$C/study.py" \
       || [ "$(readlink "/proc/$p/cwd" 2>/dev/null)" = "$C" ]; then
      stale="$stale $p"
      ! tr '\0' ' ' 2>/dev/null < "/proc/$p/cmdline" | grep -qF "study.py" || what="train.py and study.py"
    fi
  done
  if [ -n "$stale" ]; then
    r_say note "ending stale $what processes:$stale"
    # shellcheck disable=SC2086
    kill -TERM $stale 2>/dev/null || true
    for i in $(seq 50); do
      # shellcheck disable=SC2086
      ps -o stat= -p "$(echo $stale | tr ' ' ',')" 2>/dev/null | grep -qv '^Z' || break
      sleep 0.2
    done
    # shellcheck disable=SC2086
    kill -KILL $stale 2>/dev/null || true
  fi
  sudo -n rm -f /tmp/libtpu_lockfile || r_say note "could not remove /tmp/libtpu_lockfile"
  printf '%s\n' "$run" > "$S/name"
  printf '%q ' "$@" > "$S/args"
  rm -f "$S/pid" "$S/exit" "$S/signal" "$S/stopped"
  log=$S/logs/$run.log
  cd "$C" || return 1
  (
    trap '' HUP
    trap 'echo TERM >> "$S/signal"' TERM
    echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) worker $W: run $run: $script $(cat "$S/args")"
    PJRT_DEVICE=TPU PYTHONUNBUFFERED=1 TRM_RUN_NAME=$run "$PY" "$C/$script" "$@" &
    child=$!
    echo "$child" > "$S/pid"
    while :; do
      wait "$child" 2>/dev/null; rc=$?   # (bash's "Killed" notice: the line below says it)
      kill -0 "$child" 2>/dev/null || break
    done
    echo "$rc" > "$S/exit"
    how=""
    [ "$rc" -le 128 ] || how=" (killed by SIG$(kill -l "$((rc - 128))" 2>/dev/null || echo "NAL $((rc - 128))"))"
    echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) worker $W: $script exited with status $rc$how"
  ) < /dev/null >> "$log" 2>&1 &
  for i in $(seq 100); do [ -s "$S/pid" ] && break; sleep 0.1; done
  r_say started "$(cat "$S/pid" 2>/dev/null)"
  r_say ok "started run $run (pid $(cat "$S/pid" 2>/dev/null)), log ~/trm-state/logs/$run.log"
}

remote_status() {
  local run p rc state last
  run=$(cat "$S/name" 2>/dev/null || true)
  r_say code "$(r_code_hash "$C")"
  if [ -z "$run" ]; then r_say state NONE; return 0; fi
  r_say run "$run"
  if p=$(r_active_pid); then
    state=RUNNING; r_say pid "$p"
  elif [ -f "$S/exit" ]; then
    rc=$(cat "$S/exit"); r_say exit "$rc"
    if [ -f "$S/stopped" ]; then state=STOPPED
    elif [ -s "$S/signal" ]; then state=INTERRUPTED
    else state=EXITED; fi
  else
    state=LOST   # the trainer is gone without an exit status: the host restarted or it was killed
  fi
  r_say state "$state"
  last=$(grep -v '^[[:space:]]*$' "$S/logs/$run.log" 2>/dev/null | tail -n 1 | cut -c1-160)
  r_say last "$last"
  # A study: the run it is on and how many are done (study.py keeps this line up to date).
  [ ! -s "$S/study.txt" ] || r_say study "$(head -n 1 "$S/study.txt" | cut -c1-200)"
  # said: the last line the latest train.py printed (its reason for an exit, by the exit-code
  # contract; launch.sh train --retry quotes it): skips worker.sh's own "=== " lines.
  if [ "$state" != RUNNING ]; then
    last=$(tail -n 200 "$S/logs/$run.log" 2>/dev/null \
      | awk '/^=== .* worker .*: run .*: (train|study)\.py/ { s = ""; next } /^=== / { next } NF { s = $0 } END { print s }' \
      | cut -c1-160)
    r_say said "$last"
  fi
  return 0
}

remote_stop() {  # remote_stop WAIT_SECONDS KILL(0/1)
  local wait=$1 kill=$2 p i
  if ! p=$(r_active_pid); then r_say ok "no trainer running"; return 0; fi
  : > "$S/stopped"
  kill -TERM "$p"
  r_say note "SIGTERM sent to train.py (pid $p), waiting up to ${wait}s while it saves"
  i=0
  while r_active_pid >/dev/null && [ "$i" -lt $((wait * 5)) ]; do sleep 0.2; i=$((i + 1)); done
  if r_active_pid >/dev/null; then
    if [ "$kill" = 1 ]; then
      kill -KILL "$p" 2>/dev/null || true
      r_say ok "train.py (pid $p) still running after ${wait}s: killed (SIGKILL)"
      return 0
    fi
    r_say error "train.py (pid $p) still running after ${wait}s (bash launch.sh stop --kill ends it)"
    return 3
  fi
  for i in $(seq 20); do [ -f "$S/exit" ] && break; sleep 0.1; done
  r_say ok "train.py exited with status $(cat "$S/exit" 2>/dev/null || echo '?')"
}

remote_logs() {  # remote_logs RUN_NAME("" = latest) LINES MODE(follow/tail/prefix)
  local run=$1 n=$2 mode=$3 f
  [ -n "$run" ] || run=$(cat "$S/name" 2>/dev/null || true)
  if [ -z "$run" ]; then echo "[worker $W] no run yet" >&2; return 1; fi
  f=$S/logs/$run.log
  if [ ! -f "$f" ]; then echo "[worker $W] no log $f" >&2; return 1; fi
  case $mode in
    follow) exec tail -n "$n" -F "$f" ;;
    tail) tail -n "$n" "$f" ;;
    *) tail -n "$n" "$f" | sed "s/^/[worker $W] /" ;;
  esac
}

remote_check() {  # remote_check BUCKET DATA_URL HOST0 PORT WORKERS WAIT
  local bucket=$1 data=$2 host0=${3:-} port=${4:-12355} workers=${5:-1} wait=${6:-60} p devices=1 rc
  r_say code "$(r_code_hash "$C")"
  if [ ! -x "$PY" ]; then r_say error "no venv ~/trm-venv: run setup"; return 1; fi
  if p=$(r_active_pid); then
    devices=0; r_say note "trainer running (pid $p): TPU busy, device test skipped"
  elif [ -e /tmp/libtpu_lockfile ]; then
    r_say note "/tmp/libtpu_lockfile exists (another process may hold the TPU; train removes it)"
  fi
  if [ "$workers" -gt 1 ] && [ "$devices" = 0 ]; then
    r_say master_port "skipped: a trainer runs (it holds the port)"
  elif [ "$workers" -gt 1 ]; then
    r_checks_py | timeout $((wait + 30)) "$PY" - port "$W" "$host0" "$port" "$workers" "$wait" | r_say_each
  fi
  r_checks_py | PJRT_DEVICE=TPU timeout 300 "$PY" - check "$W" "$bucket" "$data" "$devices" | r_say_each
  rc=${PIPESTATUS[1]}
  if [ "$rc" = 124 ]; then
    r_say devices "ERROR: no answer in 300 s (every host must start the TPU runtime at once; does another process hold the TPU?)"
  elif [ "$rc" != 0 ]; then
    r_say error "the check script failed with status $rc"
  fi
  return 0
}

# ----------------------------------------------------------------------------------------------

main() {
  local cmd=${1:-}
  [ $# -eq 0 ] || shift
  r_init
  case $cmd in
    remote_setup) remote_setup "$@" ;;
    remote_deploy) remote_deploy "$@" ;;
    remote_preflight) remote_preflight "$@" ;;
    remote_launch) remote_launch "$@" ;;
    remote_study) remote_study "$@" ;;
    remote_status) remote_status "$@" ;;
    remote_stop) remote_stop "$@" ;;
    remote_logs) remote_logs "$@" ;;
    remote_check) remote_check "$@" ;;
    remote_smoke_rates) remote_smoke_rates "$@" ;;
    remote_smoke_report) remote_smoke_report "$@" ;;
    *) echo "worker.sh: unknown command '$cmd' (see the top of worker.sh)" >&2; return 2 ;;
  esac
}

main "$@"
