#!/usr/bin/env bash
# launch.sh: train TRM on a Cloud TPU slice (a v4-8 up to a v4-64 pod) from your laptop, with gcloud.
#
# The laptop's side: one command per stage (create, setup, deploy, check, train, status, logs, stop,
# tensorboard, delete), each safe to run twice; --dry-run prints the gcloud calls instead of making
# them. With --queued (TRM_QUEUED=1), create and train --retry request the slice as a queued
# resource and wait until it is ACTIVE; delete removes a queued resource of the TPU's name too. On the workers, each step runs worker.sh, which this script sends with every ssh call (see
# the top of worker.sh) and which answers in lines TRM|WORKER|KEY|VALUE read here.
#
# How to use it, from nothing to a running v4-64 job: README.md; what each command does:
# docs/pod.md; studies: docs/studies.md. `bash launch.sh COMMAND --help` lists a command's flags.
#
#   bash launch.sh create --accelerator v4-64 --spot && bash launch.sh setup && bash launch.sh deploy
#   bash launch.sh train --retry sudoku-1 sudoku-mlp --data.path gs://BUCKET/data/sudoku-extreme-1k-aug-1000
#   bash launch.sh study --retry sudoku-scaling studies/sudoku-scaling.txt   # one run per host
#   bash launch.sh status; bash launch.sh logs 0; bash launch.sh stop; bash launch.sh delete
#
# Exit status: 0 success, 1 failure (explained on stderr), 2 usage error.
set -euo pipefail

readonly PROG=launch.sh
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly REPO
readonly WORKER_SCRIPT=$REPO/worker.sh   # what runs on the workers; sent with every ssh call

TPU=${TRM_TPU:-}
ZONE=${TRM_ZONE:-}
PROJECT=${TRM_PROJECT:-}
BUCKET=${TRM_BUCKET:-}
ACCELERATOR=${TRM_ACCELERATOR:-v4-64}
RUNTIME_VERSION=${TRM_RUNTIME_VERSION:-}
SPOT=${TRM_SPOT:-0}
QUEUED=${TRM_QUEUED:-0}
DATA=${TRM_DATA:-}
POLL=${TRM_POLL_SECONDS:-60}
STOP_WAIT=${TRM_STOP_WAIT:-120}
MAX_RESTARTS=${TRM_MAX_RESTARTS:-20}
DRY_RUN=0
RETRY=0
KILL=0
FOLLOW=1
START=0
LINES=100
PORT=6006
LOG_RUN=""
STUDY=""          # tensorboard --study
MODE=""           # study: per-host or whole-slice
FROM_BUCKET=0
HELP=0
CMD=""
POS=()

TPU_FLAGS=()      # --zone, --project: set by require
RUN=""            # train's run name and train.py's arguments: set by parse_train_args
TRAIN_ARGS=()
LAUNCH=()         # what every worker starts: worker.sh remote_launch (train) or remote_study (study)
WHAT=train.py     # what it runs, in messages
STUDY_FILE=""     # study's file
WORKER_B64=""     # worker.sh as one line of base64: set by load_worker_script
CODE_HASH=""      # this checkout's code: set by build_code
CODE_TAR=""
CODE_FILES=""
TMPD=""           # scratch directory, removed on exit: set by tmpdir
exec 3>&1   # dry-run commands go to the original stdout, even from inside $(...)

# ----------------------------------------------------------------------------------------------
# Help: usage and flags; docs/pod.md, "What each command does", explains the commands.

usage_main() {
  cat <<'EOF'
usage: bash launch.sh [SETTINGS] COMMAND [OPTIONS] [ARGS]

Run TRM on a Cloud TPU slice from your laptop (gcloud). Commands, in the order of a first run:
  create       create the TPU VM slice (--queued: as a queued resource) and the bucket, if missing
  setup        install the pinned requirements (torch_xla[tpu]) in ~/trm-venv on every worker
  deploy       ship the tracked code to ~/trm on every worker and compare code hashes
  check        preflight on every worker: TPU, versions, device count, bucket, dataset
  train        train RUN_NAME PRESET [train.py flags...]: start train.py on every worker
  study        study STUDY_NAME STUDY_FILE: a study's runs, one per worker (--whole-slice: over the slice)
  status       the TPU's state and each worker's trainer
  logs         logs [WORKER|all]: follow one worker's log (--from-bucket: the copies in the bucket)
  stop         SIGTERM the trainers (they save a checkpoint, then exit)
  tensorboard  print (or --start) the TensorBoard command for a run's tb/ (--study NAME: a study's)
  delete       delete the TPU VM slice and its queued resource (the bucket stays)

Settings (flags before the run name, or environment variables):
  --tpu NAME (TRM_TPU)   --zone ZONE (TRM_ZONE)   --project ID (TRM_PROJECT)
  --bucket NAME (TRM_BUCKET)   --data gs://... (TRM_DATA)
  --dry-run      print every gcloud command instead of running it

`bash launch.sh COMMAND --help` lists a command's flags. README.md walks through a first run,
docs/pod.md says what each command does, docs/studies.md runs a study.
EOF
}

usage_create() {
  cat <<'EOF'
usage: bash launch.sh create [--accelerator TYPE] [--runtime-version V] [--spot] [--queued] [--dry-run]

The bucket gs://BUCKET and the TPU VM slice TPU, each if missing (a preempted TPU is replaced).

  --accelerator TYPE       accelerator type (TRM_ACCELERATOR, default v4-64 = 8 hosts x 4 chips)
  --runtime-version V      TPU software version (TRM_RUNTIME_VERSION; default by accelerator,
                           tpu-ubuntu2204-base for v2/v3/v4)
  --spot                   a spot TPU (TRM_SPOT=1): much cheaper, preempted at any time
  --queued                 request it as a queued resource named TPU (TRM_QUEUED=1) and wait,
                           with a progress line, until it is ACTIVE (Google's recommended way to
                           get spot and reserved capacity); a SUSPENDED or FAILED one is replaced

Needs --tpu, --zone, --project, --bucket (or TRM_TPU, TRM_ZONE, TRM_PROJECT, TRM_BUCKET).
More: docs/pod.md, "What each command does".
EOF
}

usage_delete() {
  cat <<'EOF'
usage: bash launch.sh delete [--queued] [--dry-run]

Deletes the TPU VM slice, and the queued resource of its name if there is one, without a prompt;
the bucket stays. --queued (TRM_QUEUED=1): failing to look for the queued resource is an error.
Needs --tpu, --zone, --project.
More: docs/pod.md, "What each command does".
EOF
}

usage_setup() {
  cat <<'EOF'
usage: bash launch.sh setup [--dry-run]

The venv ~/trm-venv with requirements.txt (torch_xla[tpu]) on every worker; pip's output goes to
~/trm-state/setup.log there. Needs --tpu, --zone, --project.
More: docs/pod.md, "What each command does".
EOF
}

usage_deploy() {
  cat <<'EOF'
usage: bash launch.sh deploy [--dry-run]

The files git tracks in this checkout, as in the working tree, to a fresh ~/trm on every worker;
fails unless every worker then holds your checkout's code hash. Needs --tpu, --zone, --project.
More: docs/pod.md, "What each command does".
EOF
}

usage_check() {
  cat <<'EOF'
usage: bash launch.sh check [--data gs://...] [--dry-run]

Preflight on every worker: TPU, versions, device count, bucket, dataset (--data or TRM_DATA), code,
and TCP from every worker to worker 0's port 12355, where the trainers' host group meets (torch's
MASTER_PORT; TRM_CHECK_PORT checks another, for TRM_CHECK_WAIT seconds, default 60). Skipped while
a trainer runs.
Needs --tpu, --zone, --project, --bucket.
More: docs/pod.md, "What each command does".
EOF
}

usage_train() {
  cat <<'EOF'
usage: bash launch.sh train [--retry] [--queued] [--poll SECONDS] [--max-restarts N] [--dry-run]
                            RUN_NAME PRESET [train.py flags...]

train.py PRESET [flags...] on every worker, run directory gs://BUCKET/runs/RUN_NAME. Everything
after RUN_NAME goes to train.py untouched; launch.sh's own options come before RUN_NAME.
--data.path defaults to --data / TRM_DATA. The same RUN_NAME again resumes the run. The XLA
compilation cache is not kept in the bucket: torch_xla 2.9 cannot load a persistent cache on a TPU
(pytorch/xla#9094), so every launch compiles; --run.compile-cache-url gs://BUCKET/xla-cache opts in.

  --retry              stay on the laptop and watch the run: recreate a preempted TPU, setup,
                       deploy and relaunch; relaunch when train.py exits 75 or a worker's trainer
                       is lost; stop on any other failure (Ctrl-C stops watching)
  --queued             with --retry (TRM_QUEUED=1): the slice is a queued resource; one gone
                       SUSPENDED, FAILED or missing counts as preempted: it is deleted and
                       requested again (as create --queued does)
  --poll SECONDS       how often --retry looks (TRM_POLL_SECONDS, default 60)
  --max-restarts N     give up after N relaunches (TRM_MAX_RESTARTS, default 20)

train.py's exit status, as --retry reads it: 0 finished, or saved and stopped on SIGTERM; 75 a
relaunch may help (no progress within --run.watchdog-minutes, a peer host vanished, storage
unreachable, a SIGTERM shutdown past its deadline); 1, or any other status, a failure a relaunch
would repeat (137, 143: killed, a lost trainer). Other workers' failures next to a 75 or a lost
trainer count as its consequences.

Needs --tpu, --zone, --project, --bucket.
More: docs/pod.md, "What each command does".
EOF
}

usage_study() {
  cat <<'EOF'
usage: bash launch.sh study [--per-host | --whole-slice] [--retry] [--queued] [--poll SECONDS]
                            [--max-restarts N] [--dry-run] STUDY_NAME STUDY_FILE

A study's runs (STUDY_FILE: one run per line, NAME PRESET [train.py flags...]; docs/studies.md)
into gs://BUCKET/studies/STUDY_NAME/NAME, with `study.py run` on every worker. The study file goes
with the command. The same STUDY_NAME again skips finished runs and resumes started ones.

  --per-host           (the default on a slice of several hosts) worker I runs its share of the
                       runs (study.py --host I --hosts N), each on its own 4 chips: its TPU runtime
                       is started as a slice of its own (worker.sh r_single_host_env; unverified
                       on a TPU, docs/studies.md), so the hosts train as many runs at once
  --whole-slice        every worker runs every run, one at a time, over the whole slice
  --retry              watch and relaunch as train --retry does (a preempted slice is created
                       again; finished runs are skipped, started ones resume)
  --queued, --poll, --max-restarts: as for train

Each worker's study.py exits 0 when its share is done (failed runs are recorded, not retried),
75 when a run kept exiting 75, 1 for a study file it cannot run. Progress: bash launch.sh status
(the run each worker is on), logs WORKER; results: python study.py report gs://BUCKET/studies/STUDY_NAME.
Needs --tpu, --zone, --project, --bucket.
More: docs/studies.md.
EOF
}

usage_status() {
  cat <<'EOF'
usage: bash launch.sh status [--dry-run]

The TPU's state, then one line per worker: run, trainer state, code hash, the log's last line.
Needs --tpu, --zone, --project.
More: docs/pod.md, "What each command does".
EOF
}

usage_logs() {
  cat <<'EOF'
usage: bash launch.sh logs [WORKER|all] [--lines N] [--no-follow] [--run RUN_NAME] [--from-bucket] [--dry-run]

Follows the latest run's log on WORKER (default 0); Ctrl-C stops following, not the run. `all`:
the last lines of every worker's log.

  --lines N, -n N      lines of history (default 100)
  --no-follow          print them and return
  --run RUN_NAME       another run's log
  --from-bucket        the last lines of the copies train.py keeps of each host's output in
                       gs://BUCKET/runs/RUN_NAME/logs/ (every launch, oldest first), read with
                       gcloud storage cat; needs --run and --bucket. Done by itself, with --run,
                       when the TPU is gone (deleted or preempted).

Needs --tpu, --zone, --project (--bucket, not the TPU, with --from-bucket).
More: docs/pod.md, "What each command does".
EOF
}

usage_stop() {
  cat <<'EOF'
usage: bash launch.sh stop [--wait SECONDS] [--kill] [--dry-run]

SIGTERM to train.py on every worker: the hosts save a checkpoint and exit; `train` with the same
run name resumes.

  --wait SECONDS       how long to wait for them (TRM_STOP_WAIT, default 120)
  --kill               then end what still runs with SIGKILL

Needs --tpu, --zone, --project.
More: docs/pod.md, "What each command does".
EOF
}

usage_tensorboard() {
  cat <<'EOF'
usage: bash launch.sh tensorboard [RUN_NAME | --study STUDY_NAME] [--start] [--port N]

Prints the TensorBoard command for gs://BUCKET/runs/RUN_NAME/tb (every run without RUN_NAME),
or with --study for the whole study gs://BUCKET/studies/STUDY_NAME (its runs, and their
hyperparameters in the HParams dashboard once `study.py report` wrote them).

  --start              run it here (needs tensorboard and gcsfs, both in requirements.txt)
  --port N             its port (default 6006)

Needs --bucket.
More: docs/pod.md, "What each command does".
EOF
}

# ----------------------------------------------------------------------------------------------
# Small helpers (laptop)

info() { printf '%s\n' "$*" >&2; }
die() { printf '%s: %s\n' "$PROG" "$*" >&2; exit 1; }
usage_error() { printf '%s: %s\n' "$PROG" "$*" >&2; printf "Run 'bash %s %s--help' for help.\n" "$PROG" "${CMD:+$CMD }" >&2; exit 2; }
dry() { [ "$DRY_RUN" = 1 ]; }

tmpdir() {
  if [ -z "$TMPD" ]; then
    TMPD=$(mktemp -d "${TMPDIR:-/tmp}/trm-launch.XXXXXX")
    trap 'rm -rf "$TMPD" ${CODE_TAR:+"$CODE_TAR"}' EXIT
  fi
}

quote_one() {  # an argument as bash reads it back: bare, 'quoted', or $'escaped'
  case $1 in
    '') printf "''" ;;
    *[!A-Za-z0-9_./=:@,+%^-]*)
      case $1 in
        *"'"*|*[[:cntrl:]]*) printf '%q' "$1" ;;
        *) printf "'%s'" "$1" ;;
      esac ;;
    *) printf '%s' "$1" ;;
  esac
}

quote_cmd() {  # the arguments as one line that bash reads back into the same arguments
  local out="" a
  for a in "$@"; do out+="${out:+ }$(quote_one "$a")"; done
  printf '%s\n' "$out"
}

# gcloud, or its command line under --dry-run.
gc() {
  if dry; then quote_cmd gcloud "$@" >&3; return 0; fi
  gcloud "$@"
}


sha256_file() { if command -v sha256sum >/dev/null 2>&1; then sha256sum -- "$1"; else shasum -a 256 -- "$1"; fi; }
sha256_stdin() { if command -v sha256sum >/dev/null 2>&1; then sha256sum; else shasum -a 256; fi; }

single_quote() {  # 'text' for any POSIX shell
  printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"
}

# The --command that runs `worker.sh FN ARGS...` on a worker. The script's text goes inside it,
# base64-encoded, so a worker never needs (or uses) a deployed copy; every argument is single-quoted
# for the worker's login shell, whatever it is.
worker_cmd() {
  local fn=$1 a cmd
  shift
  cmd="s=\"\$(printf %s '$WORKER_B64' | base64 -d)\" && exec bash -c \"\$s\" worker.sh $fn"
  for a in "$@"; do cmd+=" $(single_quote "$a")"; done
  printf '%s' "$cmd"
}

load_worker_script() {  # sets WORKER_B64, worker.sh as one line of base64 (commands that use ssh)
  [ -f "$WORKER_SCRIPT" ] || die "no worker.sh next to launch.sh (it runs on the workers)"
  WORKER_B64=$(base64 < "$WORKER_SCRIPT" | tr -d '\n')
}

# ssh WORKERS FN ARGS...: run `worker.sh FN ARGS...` on the workers (all, or a list such as 0 or 1,3).
ssh_run() {
  local workers=$1 fn=$2
  shift 2
  gc compute tpus tpu-vm ssh "$TPU" "${TPU_FLAGS[@]}" --worker="$workers" --command="$(worker_cmd "$fn" "$@")"
}

# Lines TRM|worker|key|value from the workers, shown as "  worker N: value" for keys ok/note/error.
pretty() {
  local line w k v
  while IFS= read -r line; do
    case $line in
      TRM\|*)
        line=${line#TRM|}; w=${line%%|*}; line=${line#*|}; k=${line%%|*}; v=${line#*|}
        case $k in
          ok) printf '  worker %s: %s\n' "$w" "$v" ;;
          note) printf '  worker %s: %s\n' "$w" "$v" ;;
          error) printf '  worker %s: ERROR: %s\n' "$w" "$v" ;;
        esac ;;
      *) printf '%s\n' "$line" ;;
    esac
  done
}

# ssh_capture OUT WORKERS FN ARGS...: ssh_run, its output kept in OUT and shown as it comes.
ssh_capture() {
  local out=$1
  shift
  ssh_run "$@" | tee "$out" | pretty >&2
}

workers_in() { awk -F'|' '$1 == "TRM" { print $2 }' "$1" | sort -un; }
field() {  # field FILE WORKER KEY: the worker's last value for KEY
  awk -F'|' -v w="$2" -v k="$3" '$1 == "TRM" && $2 == w && $3 == k { v = substr($0, length($1 $2 $3) + 4) } END { print v }' "$1"
}
join_by() { local IFS=$1; shift; printf '%s' "$*"; }

# ----------------------------------------------------------------------------------------------
# Settings

require() {
  local missing=() s
  for s in "$@"; do
    case $s in
      tpu) [ -n "$TPU" ] || missing+=("the TPU name: pass --tpu NAME or export TRM_TPU=NAME") ;;
      zone) [ -n "$ZONE" ] || missing+=("the zone: pass --zone ZONE or export TRM_ZONE=ZONE (e.g. us-central2-b for v4)") ;;
      project) [ -n "$PROJECT" ] || missing+=("the project: pass --project ID or export TRM_PROJECT=ID (gcloud config get-value project shows your default)") ;;
      bucket) [ -n "$BUCKET" ] || missing+=("the bucket: pass --bucket NAME or export TRM_BUCKET=NAME (create makes it if missing)") ;;
    esac
  done
  if [ ${#missing[@]} -gt 0 ]; then
    for s in "${missing[@]}"; do printf '%s: %s needs %s\n' "$PROG" "$CMD" "$s" >&2; done
    exit 2
  fi
  TPU_FLAGS=(--zone="$ZONE" --project="$PROJECT")
  bucket_name
}

# BUCKET (--bucket, TRM_BUCKET) as a bare bucket name: given as NAME or gs://NAME (a trailing /
# allowed), NAME following Cloud Storage's rules. Anything else (gs://, gs:///x, gs://b/path,
# My_Bucket) is refused before any gcloud call: it would make run directories like gs:///runs/RUN.
bucket_name() {
  local given=$BUCKET name part ok=1
  [ -n "$given" ] || return 0
  name=${given#gs://}
  name=${name%/}
  # Letters spelled out: [a-z] is not ASCII-only in every locale of an older bash (macOS's 3.2).
  case $name in
    *[!abcdefghijklmnopqrstuvwxyz0123456789._-]*|[!abcdefghijklmnopqrstuvwxyz0123456789]*) ok=0 ;;
    *[!abcdefghijklmnopqrstuvwxyz0123456789]) ok=0 ;;
  esac
  if [ ${#name} -lt 3 ] || [ ${#name} -gt 222 ]; then
    ok=0
  elif [ "$ok" = 1 ]; then   # over 63 characters only with dots, each dot-separated part at most 63
    for part in ${name//./ }; do [ ${#part} -le 63 ] || ok=0; done
  fi
  [ "$ok" = 1 ] || usage_error "bucket '$given': expected --bucket NAME or --bucket gs://NAME (TRM_BUCKET likewise), NAME a bucket name: 3-63 characters (up to 222 with dots) of lowercase letters, digits, '-', '_' and '.', starting and ending with a letter or digit"
  BUCKET=$name
}

runtime_version_for() {
  case $1 in
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) echo tpu-ubuntu2204-base ;;
  esac
}

expected_devices() {  # devices torch_xla sees on the whole slice: one per chip (v4/v5p chips have 2 cores)
  local n=${1##*-}
  case $n in ''|*[!0-9]*) return 0 ;; esac
  case $1 in
    v4-*|v5p-*) echo $((n / 2)) ;;
    v2-*|v3-*|v5litepod-*|v5e-*|v6e-*) echo "$n" ;;
  esac
}

pinned() {  # pinned PACKAGE: its ==version in requirements.txt
  sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$REPO/requirements.txt" | head -n 1
}

# requirements.txt for a TPU VM: comments dropped, torch_xla with the [tpu] extra (brings libtpu).
tpu_requirements() {
  [ -f "$REPO/requirements.txt" ] || die "no requirements.txt next to launch.sh"
  sed -e 's/[[:space:]]*#.*//' -e '/^[[:space:]]*$/d' \
      -e 's/^torch_xla\([=~<>!]\)/torch_xla[tpu]\1/' "$REPO/requirements.txt"
}

# ----------------------------------------------------------------------------------------------
# The TPU (describe, create, delete)

# describe: sets T_STATE (READY, PREEMPTED, ..., NOT_FOUND), T_ACC, T_VERSION, T_SPOT, T_PREEMPTIBLE,
# T_HEALTH. Returns 1 if gcloud failed for another reason. Under --dry-run: state $1.
describe_tpu() {
  local out err rc=0
  T_STATE="" T_ACC="" T_VERSION="" T_SPOT="" T_PREEMPTIBLE="" T_HEALTH=""
  if dry; then
    gc compute tpus tpu-vm describe "$TPU" "${TPU_FLAGS[@]}" \
      '--format=value[separator="|"](state,acceleratorType,runtimeVersion,schedulingConfig.spot,schedulingConfig.preemptible,health)'
    T_STATE=$1 T_ACC=$ACCELERATOR T_VERSION=${RUNTIME_VERSION:-$(runtime_version_for "$ACCELERATOR")}
    [ "$SPOT" = 1 ] && T_SPOT=True
    return 0
  fi
  tmpdir
  err=$TMPD/describe.err
  out=$(gcloud compute tpus tpu-vm describe "$TPU" "${TPU_FLAGS[@]}" \
    '--format=value[separator="|"](state,acceleratorType,runtimeVersion,schedulingConfig.spot,schedulingConfig.preemptible,health)' \
    2>"$err") || rc=$?
  if [ "$rc" = 0 ]; then
    IFS='|' read -r T_STATE T_ACC T_VERSION T_SPOT T_PREEMPTIBLE T_HEALTH <<<"$out" || true
    T_STATE=${T_STATE:-UNKNOWN}
    return 0
  fi
  if grep -q -e NOT_FOUND -e 'not found' "$err"; then T_STATE=NOT_FOUND; return 0; fi
  cat "$err" >&2
  return 1
}

# create_tpu ACCELERATOR VERSION SPOT(True/"") PREEMPTIBLE(True/""): gcloud waits until it is READY.
create_tpu() {
  local kind=on-demand args
  args=(compute tpus tpu-vm create "$TPU" "${TPU_FLAGS[@]}" --accelerator-type="$1" --version="$2")
  if [ "$3" = True ]; then args+=(--spot); kind=spot
  elif [ "$4" = True ]; then args+=(--preemptible); kind=preemptible; fi
  info "creating TPU $TPU ($1, $kind, runtime $2) in $ZONE: this takes a few minutes"
  gc "${args[@]}"
}

delete_tpu() {
  info "deleting TPU $TPU in $ZONE"
  gc compute tpus tpu-vm delete "$TPU" "${TPU_FLAGS[@]}" --quiet
}

# ----------------------------------------------------------------------------------------------
# The queued resource (--queued): a request for the slice that Cloud TPU fills when capacity is
# free, Google's recommended way to get spot and reserved TPUs. It is named as the TPU, which is
# its node. Its states: ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, CREATING, then ACTIVE (the
# TPU exists); SUSPENDING and SUSPENDED (its capacity was taken back: the TPU is gone), FAILED,
# DELETING.

# describe_qr: sets Q_STATE (ACTIVE, ..., NOT_FOUND). Returns 1 if gcloud failed for another
# reason. Under --dry-run: state $1.
describe_qr() {
  local out err rc=0
  Q_STATE=""
  if dry; then
    gc compute tpus queued-resources describe "$TPU" "${TPU_FLAGS[@]}" '--format=value(state.state)'
    Q_STATE=$1
    return 0
  fi
  tmpdir
  err=$TMPD/describe-qr.err
  out=$(gcloud compute tpus queued-resources describe "$TPU" "${TPU_FLAGS[@]}" '--format=value(state.state)' \
    2>"$err") || rc=$?
  if [ "$rc" = 0 ]; then Q_STATE=${out:-UNKNOWN}; return 0; fi
  if grep -q -e NOT_FOUND -e 'not found' "$err"; then Q_STATE=NOT_FOUND; return 0; fi
  cat "$err" >&2
  return 1
}

# create_qr ACCELERATOR VERSION SPOT(True/"") PREEMPTIBLE(True/""): request the slice (create_tpu's
# arguments; a queued resource has no preemptible kind: spot replaces it). gcloud returns once the
# request is accepted; wait_active waits for the TPU.
create_qr() {
  local kind=on-demand args
  args=(compute tpus queued-resources create "$TPU" --node-id="$TPU" "${TPU_FLAGS[@]}"
        --accelerator-type="$1" --runtime-version="$2")
  if [ "$3" = True ] || [ "$4" = True ]; then args+=(--spot); kind=spot; fi
  info "requesting TPU $TPU ($1, $kind, runtime $2) in $ZONE as a queued resource: created when capacity is free"
  gc "${args[@]}"
}

delete_qr() {  # the queued resource and its TPU
  info "deleting queued resource $TPU and its TPU in $ZONE"
  gc compute tpus queued-resources delete "$TPU" "${TPU_FLAGS[@]}" --force --quiet
}

minutes() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# wait_active: describe the queued resource every POLL seconds, with a progress line, until it is
# ACTIVE (0); FAILED, SUSPENDING, SUSPENDED or missing: says so and returns 1 (no time limit:
# Ctrl-C stops waiting, the request stays queued, and create --queued again waits again).
wait_active() {
  local started=$SECONDS
  while :; do
    describe_qr ACTIVE || return 1
    case $Q_STATE in
      ACTIVE)
        info "queued resource $TPU is ACTIVE after $(minutes $((SECONDS - started))): TPU $TPU exists"
        if dry; then printf '# (that describe again every %ss until the state is ACTIVE)\n' "$POLL" >&3; fi
        return 0 ;;
      FAILED)
        info "queued resource $TPU FAILED (quota, zone or accelerator type?): gcloud compute tpus queued-resources describe $TPU --zone=$ZONE --project=$PROJECT says why; bash $PROG delete removes it"
        return 1 ;;
      SUSPENDING|SUSPENDED) info "queued resource $TPU is $Q_STATE: its capacity was taken back (preempted)"; return 1 ;;
      NOT_FOUND) info "queued resource $TPU is gone (deleted?)"; return 1 ;;
      *) info "  queued resource $TPU: $Q_STATE, waiting for ACTIVE ($(minutes $((SECONDS - started))) so far; again in ${POLL}s)" ;;
    esac
    sleep "$POLL"
  done
}

# request_again ACCELERATOR VERSION SPOT PREEMPTIBLE: delete what is left of the queued resource
# and its TPU, request the slice again, wait until it is ACTIVE.
request_again() {
  describe_qr SUSPENDED || return 1
  if [ "$Q_STATE" != NOT_FOUND ]; then delete_qr || return 1; fi
  describe_tpu NOT_FOUND || return 1
  if [ "$T_STATE" != NOT_FOUND ]; then delete_tpu || return 1; fi
  create_qr "$@" && wait_active
}

# describe_slice DRY_STATE: sets T_STATE as describe_tpu does; with --queued the queued resource
# first: unless it is ACTIVE, T_STATE is QR_ and its state (QR_SUSPENDED, QR_NOT_FOUND, ...).
describe_slice() {
  if [ "$QUEUED" = 1 ]; then
    describe_qr ACTIVE || return 1
    if [ "$Q_STATE" != ACTIVE ]; then
      T_STATE=QR_$Q_STATE T_ACC="" T_VERSION="" T_SPOT="" T_PREEMPTIBLE="" T_HEALTH=""
      return 0
    fi
  fi
  describe_tpu "$1"
}

slice_is() {  # "TPU NAME is STATE" or "queued resource NAME is STATE", from T_STATE
  case $T_STATE in
    QR_*) printf 'queued resource %s is %s' "$TPU" "${T_STATE#QR_}" ;;
    *) printf 'TPU %s is %s' "$TPU" "$T_STATE" ;;
  esac
}

ensure_bucket() {
  local region=${ZONE%-*} out rc=0 loc
  if dry; then
    gc storage buckets describe "gs://$BUCKET" --project="$PROJECT" '--format=value(location)'
  else
    out=$(gcloud storage buckets describe "gs://$BUCKET" --project="$PROJECT" '--format=value(location)' 2>/dev/null) || rc=$?
    if [ "$rc" = 0 ]; then
      loc=$(printf '%s' "$out" | tr '[:upper:]' '[:lower:]')
      info "bucket gs://$BUCKET exists (location ${loc:-?})"
      case $loc in
        "$region"|us|eu|asia|'') ;;
        *) info "  note: the bucket is in $loc, the TPU in $region: reads and checkpoints cross regions" ;;
      esac
      return 0
    fi
  fi
  info "creating bucket gs://$BUCKET in $region"
  gc storage buckets create "gs://$BUCKET" --project="$PROJECT" --location="$region" --uniform-bucket-level-access \
    || die "could not create gs://$BUCKET (bucket names are global: if another project owns it, pick another name)"
}

# ----------------------------------------------------------------------------------------------
# Code (deploy)

code_files() {  # tracked files, as in the working tree, without data/, runs/, .venv/
  git -C "$REPO" ls-files -z | while IFS= read -r -d '' f; do
    case $f in data/*|runs/*|.venv/*) continue ;; esac
    case $f in *$'\n'*|*\\*) info "deploy: skipping '$f' (newline or backslash in its name)"; continue ;; esac
    [ -f "$REPO/$f" ] || continue   # deleted in the working tree, or a submodule
    printf '%s\n' "$f"
  done | LC_ALL=C sort
}

# Sets CODE_HASH (sha256 of the manifest of every shipped file); `build_code tar` also CODE_TAR,
# the tarball (named by the hash, so that --dry-run prints the same path; removed on exit).
build_code() {
  local stage n
  if [ -n "$CODE_HASH" ] && { [ "${1:-}" != tar ] || [ -n "$CODE_TAR" ]; }; then return 0; fi
  git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1 \
    || die "$REPO is not a git checkout: deploy ships the files git tracks"
  tmpdir
  stage=$TMPD/code
  rm -rf "$stage"
  mkdir -p "$stage/trm"
  code_files > "$stage/files"
  n=$(wc -l < "$stage/files" | tr -d ' ')
  [ "$n" -gt 0 ] || die "git tracks no files in $REPO"
  (cd "$REPO" && tr '\n' '\0' < "$stage/files" | COPYFILE_DISABLE=1 tar --null -T - -cf -) | (cd "$stage/trm" && tar -xf -)
  (cd "$stage/trm" && while IFS= read -r f; do sha256_file "$f"; done < "$stage/files" > .trm-code-sha256sums)
  CODE_HASH=$(sha256_stdin < "$stage/trm/.trm-code-sha256sums" | cut -c1-64)
  if [ "${1:-}" = tar ]; then
    CODE_TAR="${TMPDIR:-/tmp}/trm-code-${CODE_HASH:0:16}.tar.gz"
    (cd "$stage" && COPYFILE_DISABLE=1 tar -czf "$CODE_TAR" trm)
    if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
      info "note: your checkout has uncommitted changes; they are part of code ${CODE_HASH:0:12}"
    fi
  fi
  rm -rf "$stage"
  CODE_FILES=$n
}

# ----------------------------------------------------------------------------------------------
# Commands

cmd_create() {
  require tpu zone project bucket
  local version=${RUNTIME_VERSION:-$(runtime_version_for "$ACCELERATOR")} spot=""
  [ "$SPOT" = 1 ] && spot=True
  ensure_bucket
  Q_STATE=NOT_FOUND
  if [ "$QUEUED" = 1 ]; then
    describe_qr NOT_FOUND || die "could not read queued resource $TPU (see the gcloud error above)"
    case $Q_STATE in
      NOT_FOUND|ACTIVE) ;;   # ACTIVE: its TPU is looked at below
      SUSPENDING|SUSPENDED|FAILED)
        info "queued resource $TPU is $Q_STATE: it is deleted and requested again"
        delete_qr || die "could not delete queued resource $TPU"
        Q_STATE=NOT_FOUND ;;
      DELETING) die "queued resource $TPU is being deleted: run create again in a minute" ;;
      *)
        info "queued resource $TPU is $Q_STATE: waiting until it is ACTIVE"
        wait_active || die "queued resource $TPU did not become ACTIVE (above)"
        info "TPU $TPU is ready. Next: bash $PROG setup"
        return 0 ;;
    esac
  fi
  describe_tpu NOT_FOUND || die "could not read TPU $TPU (see the gcloud error above)"
  case $T_STATE in
    NOT_FOUND)
      if [ "$Q_STATE" != NOT_FOUND ]; then   # ACTIVE without its TPU
        info "queued resource $TPU is $Q_STATE without its TPU: it is deleted and requested again"
        delete_qr || die "could not delete queued resource $TPU"
      fi ;;
    PREEMPTED|TERMINATED)
      info "TPU $TPU is $T_STATE: it does not come back by itself, so it is deleted and created again"
      if [ "$Q_STATE" != NOT_FOUND ]; then
        delete_qr || die "could not delete queued resource $TPU"
      else
        delete_tpu || die "could not delete TPU $TPU"
      fi ;;
    *)
      if [ "$T_ACC" != "$ACCELERATOR" ] && [ -n "$T_ACC" ]; then
        die "TPU $TPU exists as $T_ACC, not $ACCELERATOR: pick another --tpu name, or delete it first"
      fi
      info "TPU $TPU exists: $T_ACC, $T_STATE${T_HEALTH:+, $T_HEALTH}"
      case $T_STATE in
        READY) ;;
        STOPPED) info "  it is stopped: gcloud compute tpus tpu-vm start $TPU --zone=$ZONE --project=$PROJECT" ;;
        *) info "  not READY yet: bash $PROG status shows when it is" ;;
      esac
      return 0 ;;
  esac
  if [ "$QUEUED" = 1 ]; then
    create_qr "$ACCELERATOR" "$version" "$spot" "" || die "could not request TPU $TPU as a queued resource (quota, zone? see above)"
    wait_active || die "queued resource $TPU did not become ACTIVE (above)"
  else
    create_tpu "$ACCELERATOR" "$version" "$spot" "" || die "could not create TPU $TPU (quota, capacity, zone? see above)"
  fi
  info "TPU $TPU is ready. Next: bash $PROG setup"
}

# delete: the queued resource named as the TPU, if any (with --force: its TPU too), then the TPU.
cmd_delete() {
  require tpu zone project
  local qr=NOT_FOUND tpu=READY deleted=0
  if [ "$QUEUED" = 1 ]; then qr=ACTIVE tpu=NOT_FOUND; fi   # what --dry-run shows
  if describe_qr "$qr"; then
    if [ "$Q_STATE" != NOT_FOUND ]; then
      delete_qr || die "could not delete queued resource $TPU"
      deleted=1
    fi
  elif [ "$QUEUED" = 1 ]; then
    die "could not read queued resource $TPU (see the gcloud error above)"
  else
    info "(could not look for a queued resource $TPU, above: deleting the TPU only)"
  fi
  describe_tpu "$tpu" || die "could not read TPU $TPU (see the gcloud error above)"
  if [ "$T_STATE" != NOT_FOUND ]; then
    delete_tpu || die "could not delete TPU $TPU"
    deleted=1
  fi
  if [ "$deleted" = 0 ]; then info "TPU $TPU does not exist: nothing to delete"; return 0; fi
  info "TPU $TPU deleted; gs://${BUCKET:-BUCKET} keeps the data and runs"
}

do_setup() {
  local out reqs=() line w bad=0
  tmpdir
  out=$TMPD/setup.out
  [ -f "$REPO/requirements.txt" ] || die "no requirements.txt next to launch.sh"
  while IFS= read -r line; do reqs+=("$line"); done < <(tpu_requirements)
  [ ${#reqs[@]} -gt 0 ] || die "requirements.txt lists nothing to install"
  info "setup: venv ~/trm-venv on every worker of $TPU (a few minutes the first time)"
  ssh_capture "$out" all remote_setup "${reqs[@]}" || bad=1
  dry && return 0
  for w in $(workers_in "$out"); do
    info "  worker $w: python $(field "$out" "$w" python), torch $(field "$out" "$w" torch), torch_xla $(field "$out" "$w" torch_xla), libtpu $(field "$out" "$w" libtpu)"
  done
  [ "$bad" = 0 ] || die "setup failed on some workers (above); pip's full output is in ~/trm-state/setup.log there"
  info "setup done on $(workers_in "$out" | wc -l | tr -d ' ') workers"
}

cmd_setup() { require tpu zone project; do_setup; }

do_deploy() {
  local out bad=0 w got mismatch=()
  build_code tar
  tmpdir
  out=$TMPD/deploy.out
  info "deploy: code ${CODE_HASH:0:12} ($CODE_FILES files) to ~/trm on every worker of $TPU"
  gc compute tpus tpu-vm scp "$CODE_TAR" "$TPU:trm-code.tar.gz" "${TPU_FLAGS[@]}" --worker=all \
    || die "could not copy the code to the workers"
  ssh_capture "$out" all remote_deploy "$CODE_HASH" || bad=1
  dry && return 0
  for w in $(workers_in "$out"); do
    got=$(field "$out" "$w" code)
    [ "$got" = "$CODE_HASH" ] || mismatch+=("worker $w: ${got:-no code}")
  done
  if [ "$bad" = 1 ] || [ ${#mismatch[@]} -gt 0 ] || [ -z "$(workers_in "$out")" ]; then
    die "deploy failed${mismatch[0]+: $(join_by ';' "${mismatch[@]}")}"
  fi
  info "all $(workers_in "$out" | wc -l | tr -d ' ') workers hold code ${CODE_HASH:0:12}"
}

cmd_deploy() { require tpu zone project; do_deploy; }

cmd_check() {
  require tpu zone project bucket
  local out problems=() w ws n v first expected want_torch want_xla procs ips host0 port=${TRM_CHECK_PORT:-12355}
  describe_tpu READY || die "could not read TPU $TPU"
  [ "$T_STATE" = READY ] || die "TPU $TPU is $T_STATE, not READY${T_STATE:+ (bash $PROG create, or status)}"
  case ${T_HEALTH:-HEALTHY} in HEALTHY) ;; *) problems+=("TPU health is $T_HEALTH") ;; esac
  # The workers' internal addresses (worker 0's first), for the TCP check of the host group's port.
  ips=$(gc compute tpus tpu-vm describe "$TPU" "${TPU_FLAGS[@]}" '--format=value(networkEndpoints[].ipAddress)') \
    || die "could not read the addresses of TPU $TPU"
  host0=${ips%%;*}
  build_code
  tmpdir
  out=$TMPD/check.out
  info "check: every worker of $TPU ($T_ACC)"
  ssh_capture "$out" all remote_check "gs://$BUCKET" "$DATA" "$host0" "$port" \
    "$(printf '%s' "$ips" | tr ';' '\n' | grep -c .)" "${TRM_CHECK_WAIT:-60}" \
    || problems+=("the check command failed on some workers")
  dry && return 0
  ws=$(workers_in "$out")
  n=$(printf '%s\n' "$ws" | grep -c . || true)
  [ "$n" -gt 0 ] || die "no worker answered"
  printf '%-6s %-8s %-7s %-9s %-8s %-7s %-6s %-6s %-6s %-6s %s\n' worker python torch torch_xla libtpu devices local procs \
    code port bucket/data
  for w in $ws; do
    v=$(field "$out" "$w" master_port)
    printf '%-6s %-8s %-7s %-9s %-8s %-7s %-6s %-6s %-6s %-6s %s\n' "$w" "$(field "$out" "$w" python)" \
      "$(field "$out" "$w" torch)" "$(field "$out" "$w" torch_xla)" "$(field "$out" "$w" libtpu)" \
      "$(field "$out" "$w" devices | cut -c1-7)" "$(field "$out" "$w" local_devices)" "$(field "$out" "$w" processes)" \
      "$(field "$out" "$w" code | cut -c1-6)" "${v%% *}" \
      "$(field "$out" "$w" bucket | cut -c1-20)/$(field "$out" "$w" data | cut -c1-20)"
  done
  want_torch=$(pinned torch)
  want_xla=$(pinned torch_xla)
  for v in python torch torch_xla libtpu devices local_devices processes; do
    first=$(field "$out" "$(printf '%s\n' "$ws" | head -n 1)" "$v")
    for w in $ws; do
      [ "$(field "$out" "$w" "$v")" = "$first" ] || { problems+=("$v differs between workers"); break; }
    done
  done
  for w in $ws; do
    [ -z "$want_torch" ] || [ "$(field "$out" "$w" torch)" = "$want_torch" ] \
      || problems+=("worker $w: torch $(field "$out" "$w" torch), requirements.txt pins $want_torch (setup)")
    [ -z "$want_xla" ] || [ "$(field "$out" "$w" torch_xla)" = "$want_xla" ] \
      || problems+=("worker $w: torch_xla $(field "$out" "$w" torch_xla), requirements.txt pins $want_xla (setup)")
    [ "$(field "$out" "$w" libtpu)" != missing ] || problems+=("worker $w: libtpu missing (setup installs torch_xla[tpu])")
    [ "$(field "$out" "$w" bucket)" = ok ] || problems+=("worker $w: bucket gs://$BUCKET: $(field "$out" "$w" bucket)")
    v=$(field "$out" "$w" master_port)
    case $v in
      ok*|skipped*) ;;
      ERROR*) problems+=("worker $w: ${v#ERROR } (the trainers' host group needs TCP between the workers: docs/pod.md)") ;;
      *) [ "$n" -le 1 ] || problems+=("worker $w: no answer from the check of port $port (see its output above)") ;;
    esac
    if [ -n "$DATA" ] && [ "$(field "$out" "$w" data)" != ok ]; then
      problems+=("worker $w: dataset $DATA: $(field "$out" "$w" data)")
    fi
    [ "$(field "$out" "$w" code)" = "$CODE_HASH" ] \
      || problems+=("worker $w: code $(field "$out" "$w" code | cut -c1-12) is not your checkout's ${CODE_HASH:0:12} (deploy)")
    v=$(field "$out" "$w" devices)
    case $v in
      ERROR*) problems+=("worker $w: the TPU runtime did not start: $v") ;;
      '') ;;
      *)
        expected=$(expected_devices "$T_ACC")
        [ -z "$expected" ] || [ "$v" = "$expected" ] || problems+=("worker $w: $v devices, $T_ACC has $expected")
        procs=$(field "$out" "$w" processes)
        [ "$procs" = "$n" ] || problems+=("worker $w: $procs processes in the runtime, $n workers answered") ;;
    esac
  done
  [ -n "$DATA" ] || info "note: no dataset given (--data or TRM_DATA): dataset not checked"
  if [ ${#problems[@]} -gt 0 ]; then
    info "check found problems:"
    for v in "${problems[@]}"; do info "  - $v"; done
    exit 1
  fi
  info "check: all $n workers OK ($T_ACC, torch $want_torch, torch_xla $want_xla)"
}

# train --------------------------------------------------------------------------------------------

parse_train_args() {
  [ ${#POS[@]} -ge 1 ] || usage_error "train needs RUN_NAME and PRESET: train RUN_NAME PRESET [train.py flags...]"
  RUN=${POS[0]}
  case $RUN in
    -*|'') usage_error "the run name comes first: train [--retry] RUN_NAME PRESET [train.py flags...]" ;;
    *[!A-Za-z0-9._-]*|.*) usage_error "run name '$RUN': use letters, digits, '.', '_' and '-' (it names gs://BUCKET/runs/RUN_NAME)" ;;
  esac
  TRAIN_ARGS=("${POS[@]:1}")
  [ ${#TRAIN_ARGS[@]} -ge 1 ] || usage_error "train needs a preset after the run name (sudoku-mlp, sudoku-att, maze, arc1, arc2, demo)"
  case ${TRAIN_ARGS[0]} in
    -*) usage_error "train.py's preset comes right after the run name, before its flags: train $RUN PRESET ${TRAIN_ARGS[*]}" ;;
  esac
  local a has_data=0 has_device=0
  for a in "${TRAIN_ARGS[@]}"; do
    case $a in
      --run.dir|--run.dir=*|--run-dir|--run-dir=*)
        usage_error "launch.sh sets --run.dir to gs://$BUCKET/runs/$RUN itself: choose the run with RUN_NAME" ;;
      --data.path|--data.path=*|--data-path|--data-path=*) has_data=1 ;;
      --run.device|--run.device=*) has_device=1 ;;
    esac
  done
  if [ "$has_data" = 0 ]; then
    if [ -n "$DATA" ]; then
      TRAIN_ARGS+=(--data.path "$DATA")
    else
      info "warning: no --data.path (nor --data / TRM_DATA): train.py reads the preset's local default path on each host; hosts do not share a disk, so put the dataset on gs://$BUCKET"
    fi
  fi
  TRAIN_ARGS+=(--run.dir "gs://$BUCKET/runs/$RUN")
  [ "$has_device" = 1 ] || TRAIN_ARGS+=(--run.device tpu)
}

# Ask every worker, then start. Returns 0 when started, 3 when RUN is already running (--retry
# attaches to it); refuses (exit 1) otherwise.
launch() {
  local out w active=() novenv=() stale=() got started=0
  build_code
  tmpdir
  out=$TMPD/preflight.out
  ssh_run all remote_preflight > "$out" || die "could not reach every worker of $TPU (see above)"
  if ! dry; then
    [ -n "$(workers_in "$out")" ] || die "no worker of $TPU answered"
    for w in $(workers_in "$out"); do
      got=$(field "$out" "$w" active)
      [ -z "$got" ] || active+=("worker $w: run $got, pid $(field "$out" "$w" pid)")
      [ "$(field "$out" "$w" venv)" = ok ] || novenv+=("$w")
      [ "$(field "$out" "$w" code)" = "$CODE_HASH" ] || stale+=("worker $w: $(field "$out" "$w" code | cut -c1-12)")
    done
    if [ ${#active[@]} -gt 0 ]; then
      if [ "$RETRY" = 1 ] && ! grep "^TRM|[^|]*|active|" "$out" | grep -qv "|active|$RUN\$"; then
        info "run $RUN is already running on $TPU: watching it"
        return 3
      fi
      info "refused: a trainer is already running (one run at a time on a TPU):"
      for w in "${active[@]}"; do info "  $w"; done
      die "wait for it to finish, or stop it: bash $PROG stop"
    fi
    [ ${#novenv[@]} -eq 0 ] || die "no venv on worker(s) $(join_by , "${novenv[@]}"): run bash $PROG setup"
    if [ ${#stale[@]} -gt 0 ]; then
      if [ "$RETRY" = 1 ]; then
        info "the workers' code is not your checkout's ${CODE_HASH:0:12}: deploying"
        do_deploy
      else
        info "refused: the code on the workers is not your checkout (${CODE_HASH:0:12}):"
        for w in "${stale[@]}"; do info "  $w"; done
        die "run bash $PROG deploy first"
      fi
    fi
  fi
  if [ "$WHAT" = train.py ]; then
    info "train: run $RUN on every worker of $TPU: train.py $(quote_cmd "${TRAIN_ARGS[@]}")"
  else
    study_launch
    info "study: $RUN on every worker of $TPU (${LAUNCH[2]}, ${LAUNCH[3]} hosts): study.py run $STUDY_FILE --out gs://$BUCKET/studies/$RUN"
  fi
  out=$TMPD/launch.out
  ssh_capture "$out" all "${LAUNCH[@]}" || die "$WHAT did not start on every worker (above)"
  dry && return 0
  for w in $(workers_in "$out"); do
    [ -n "$(field "$out" "$w" started)" ] && started=$((started + 1))
  done
  [ "$started" -gt 0 ] || die "$WHAT did not start"
  if [ "$WHAT" = train.py ]; then
    info "run $RUN started on $started workers; run dir gs://$BUCKET/runs/$RUN"
  else
    info "study $RUN started on $started workers; study dir gs://$BUCKET/studies/$RUN"
  fi
  return 0
}

ensure_ready_for_launch() {
  describe_tpu READY || die "could not read TPU $TPU"
  [ "$T_STATE" = READY ] && return 0
  case $T_STATE in
    PREEMPTED|TERMINATED) die "TPU $TPU is $T_STATE: bash $PROG create recreates it (or use train --retry)" ;;
    NOT_FOUND) die "TPU $TPU does not exist: bash $PROG create" ;;
    *) die "TPU $TPU is $T_STATE, not READY: wait, then check with bash $PROG status" ;;
  esac
}

cmd_train() {
  require tpu zone project bucket
  parse_train_args
  LAUNCH=(remote_launch "$RUN" "${TRAIN_ARGS[@]}")
  if [ "$RETRY" = 1 ]; then retry_loop; return; fi
  ensure_ready_for_launch
  launch || true
  dry && return 0
  info "  bash $PROG status | logs 0 | stop;  $(tensorboard_cmd "$RUN")"
}

hosts_of() {  # hosts of an accelerator type: 4 chips a host (v2, v3, v4 and v5p count 2 cores a chip)
  local n=${1##*-} chips
  case $n in ''|*[!0-9]*) echo 1; return 0 ;; esac
  case $1 in
    v2-*|v3-*|v4-*|v5p-*) chips=$((n / 2)) ;;
    *) chips=$n ;;   # v5e and v6e: a slice of up to 8 chips is one host
  esac
  case $1 in
    v5litepod-*|v5e-*|v6e-*) [ "$chips" -gt 8 ] || { echo 1; return 0; } ;;
  esac
  if [ "$chips" -le 4 ]; then echo 1; else echo $((chips / 4)); fi
}

cmd_study() {
  require tpu zone project bucket
  [ ${#POS[@]} -eq 2 ] || usage_error "study needs STUDY_NAME and STUDY_FILE: study [--per-host|--whole-slice] [--retry] STUDY_NAME STUDY_FILE"
  RUN=${POS[0]} STUDY_FILE=${POS[1]}
  case $RUN in
    -*|''|.*|*[!A-Za-z0-9._-]*) usage_error "study name '$RUN': use letters, digits, '.', '_' and '-' (it names gs://BUCKET/studies/STUDY_NAME)" ;;
  esac
  [ -f "$STUDY_FILE" ] || usage_error "no study file $STUDY_FILE (one run per line: NAME PRESET [train.py flags...])"
  WHAT=study.py   # launch() builds the command once the slice's accelerator type is known (study_launch)
  if [ "$RETRY" = 1 ]; then retry_loop; return; fi
  ensure_ready_for_launch
  launch || true
  dry && return 0
  info "  bash $PROG status | logs 0 | stop;  python study.py report gs://$BUCKET/studies/$RUN"
  info "  $(tensorboard_cmd "" "studies/$RUN")"
}

# study_launch: LAUNCH for the study on the slice just described (T_ACC; --accelerator under
# --dry-run): worker.sh writes the study file, starts each worker's runtime alone (per-host), and
# runs study.py run FILE --out gs://BUCKET/studies/RUN [--host W --hosts N | --whole-slice] -- --run.device tpu.
study_launch() {
  local hosts mode=$MODE
  hosts=$(hosts_of "${T_ACC:-$ACCELERATOR}")
  [ -n "$mode" ] || { if [ "$hosts" -gt 1 ]; then mode=per-host; else mode=whole-slice; fi; }
  LAUNCH=(remote_study "$RUN" "$mode" "$hosts" "$BUCKET" "$(base64 < "$STUDY_FILE" | tr -d '\n')")
}

# stop_all WAIT KILL(0/1): stop what is left of the run on every worker (SIGTERM; with KILL=1,
# SIGKILL after WAIT seconds).
stop_all() {
  tmpdir
  ssh_capture "$TMPD/stop.out" all remote_stop "$1" "$2"
}

# --retry --------------------------------------------------------------------------------------------
#
# train.py's exit status tells --retry what to do (docs/pod.md, "What each command does"): 0 it
# finished, or saved and stopped on SIGTERM; 75 (EX_TEMPFAIL) a relaunch may help (its progress
# watchdog saw no training step complete in --run.watchdog-minutes, a peer host vanished, storage
# stayed unreachable beyond the retries, or a SIGTERM shutdown missed its deadline); any other
# non-zero status (1: bad config or data, a NaN loss, a code error) is a failure a relaunch would
# repeat, except 137 and 143 (killed by SIGKILL or SIGTERM: read as a lost trainer). Its last line
# of output says why; worker.sh reports it as `said`.

# worker_classes STATUS_FILE: one line "WORKER CLASS WHAT" per worker of a remote_status answer,
# WHAT saying CLASS in words. CLASS is one of
#   running    train.py runs
#   finished   it exited 0
#   stopped    by launch.sh stop, whatever its exit status
#   retry      it exited 75: a relaunch may help
#   lost       it or its host went away: INTERRUPTED (SIGTERM to its whole session, as a host that
#              shuts down sends), LOST (gone without an exit status: its host restarted), killed by
#              SIGKILL or SIGTERM (exit 137 or 143), or no trainer of this run on the worker
#   failed     any other exit status: a failure a relaunch would repeat
worker_classes() {
  local out=$1 w state rc run class what
  for w in $(workers_in "$out"); do
    state=$(field "$out" "$w" state)
    rc=$(field "$out" "$w" exit)
    run=$(field "$out" "$w" run)
    if [ "$run" != "$RUN" ]; then
      class=lost what="no trainer of run $RUN${run:+ (its last run is $run)}: a new VM?"
    else
      case $state in
        RUNNING) class=running what=running ;;
        STOPPED) class=stopped what="stopped by launch.sh stop (exit $rc)" ;;
        INTERRUPTED) class=lost what="interrupted: SIGTERM to its whole session, as when its host shuts down (exit $rc)" ;;
        LOST) class=lost what="gone without an exit status: its host restarted, or it was killed with its watcher" ;;
        EXITED)
          case $rc in
            0) class=finished what="exit 0" ;;
            75) class=retry what="exit 75" ;;
            137) class=lost what="killed by SIGKILL (exit 137: its host going away, the OOM killer, kill -9)" ;;
            143) class=lost what="killed by SIGTERM (exit 143)" ;;
            *) class=failed what="exit $rc" ;;
          esac ;;
        *) class=lost what="state ${state:-unknown}" ;;
      esac
    fi
    printf '%s %s %s\n' "$w" "$class" "$what"
  done
}

in_class() {  # in_class CLASSES_FILE CLASS: its workers, comma-separated
  awk -v c="$2" '$2 == c { printf "%s%s", sep, $1; sep = "," }' "$1"
}

# explain CLASSES_FILE STATUS_FILE CLASS...: for each worker of these classes, a line
# "  worker W: WHAT; last line: the last line its train.py printed".
explain() {
  local classes=$1 out=$2 w class what said
  shift 2
  while read -r w class what; do
    case " $* " in *" $class "*) ;; *) continue ;; esac
    said=$(field "$out" "$w" said)
    info "  worker $w: $what${said:+; last line: $said}"
  done < "$classes"
}

# recreate ACCELERATOR VERSION SPOT PREEMPTIBLE: delete the preempted TPU (T_STATE, from the last
# describe_tpu), create it again as it was, setup, deploy. With --queued: delete the queued
# resource and its TPU, request it again and wait until it is ACTIVE (request_again).
recreate() {
  local delay=$POLL
  if [ "$QUEUED" = 1 ]; then
    until request_again "$@"; do
      info "the slice was not granted; requesting it again in ${delay}s"
      sleep "$delay"
      delay=$(awk -v d="$delay" 'BEGIN { d = d * 2; if (d > 600) d = 600; print d }')
    done
    do_setup
    do_deploy
    return 0
  fi
  if [ "$T_STATE" != NOT_FOUND ]; then
    delete_tpu || info "delete failed; trying create anyway"
  fi
  until create_tpu "$@"; do
    info "create failed (often: no spot capacity right now); again in ${delay}s"
    sleep "$delay"
    delay=$(awk -v d="$delay" 'BEGIN { d = d * 2; if (d > 600) d = 600; print d }')
    describe_tpu NOT_FOUND || true
    if [ "$T_STATE" != NOT_FOUND ] && [ "$T_STATE" != READY ] && [ "$T_STATE" != CREATING ]; then
      delete_tpu || true
    fi
    [ "$T_STATE" = READY ] && break
  done
  do_setup
  do_deploy
}

# count_relaunch N WHY: announce the Nth relaunch; past --max-restarts, say so and return 1.
count_relaunch() {
  if [ "$1" -gt "$MAX_RESTARTS" ]; then
    printf '%s: %s; already relaunched %s times (--max-restarts): giving up\n' "$PROG" "$2" "$MAX_RESTARTS" >&2
    return 1
  fi
  info "$2: relaunch $1 of at most $MAX_RESTARTS"
}

# dry_later FN ARGS...: under --dry-run, the gcloud calls of FN ARGS as comments "#   gcloud ...".
dry_later() {
  "$@" 3>&1 >/dev/null | sed 's/^/#   /' >&3
}

# train --retry: launch, then watch the TPU and the workers every POLL seconds until the run ends.
# Its state is local: the relaunch count and what a preempted TPU is created again as (`as`:
# accelerator, runtime version, spot, preemptible, in create_tpu's order).
retry_loop() {
  local out classes rc=0 restarts=0 as=() failed retry lost why tail_out
  trap 'info ""; info "stopped watching; the run goes on on the TPU (bash $PROG status / stop)"; exit 130' INT
  describe_slice READY || die "could not read TPU $TPU"
  # What a preempted TPU is created again as: itself if it exists, else the create settings.
  as=("$ACCELERATOR" "${RUNTIME_VERSION:-$(runtime_version_for "$ACCELERATOR")}" "" "")
  [ "$SPOT" = 1 ] && as[2]=True
  if [ "$T_STATE" != NOT_FOUND ] && [ -n "$T_ACC" ]; then
    as=("$T_ACC" "${T_VERSION:-${as[1]}}" "$T_SPOT" "$T_PREEMPTIBLE")
  fi
  case $T_STATE in
    READY) ;;
    PREEMPTED|TERMINATED|NOT_FOUND|QR_SUSPENDING|QR_SUSPENDED|QR_FAILED|QR_NOT_FOUND)
      restarts=$((restarts + 1))
      count_relaunch "$restarts" "$(slice_is)" || exit 1
      recreate "${as[@]}" ;;
    QR_*)   # on its way to ACTIVE
      info "$(slice_is): waiting until it is ACTIVE, then setup and deploy"
      if wait_active; then
        do_setup
        do_deploy
      else
        restarts=$((restarts + 1))
        count_relaunch "$restarts" "queued resource $TPU is $Q_STATE" || exit 1
        recreate "${as[@]}"
      fi ;;
    *) die "TPU $TPU is $T_STATE, not READY: wait, then run train --retry again" ;;
  esac
  launch || rc=$?
  if dry; then
    printf '# --retry then watches the run; every %ss:\n' "$POLL" >&3
    dry_later describe_slice READY
    dry_later ssh_run all remote_status
    printf '# When a worker exited 75 or was lost: the describe again, then\n' >&3
    dry_later ssh_run all remote_stop "$STOP_WAIT" 1
    printf '#   and the two ssh calls of the launch above; a TPU gone PREEMPTED, TERMINATED or missing\n' >&3
    if [ "$QUEUED" = 1 ]; then
      printf '#   (or its queued resource SUSPENDED, FAILED or missing) is deleted and requested again:\n' >&3
      dry_later request_again "${as[@]}" 2>/dev/null
      printf '#   then setup, deploy and the launch.\n' >&3
    else
      printf '#   is deleted and created again (as create does), then setup, deploy and the launch.\n' >&3
    fi
    printf '# On any other non-zero exit: the describe again, then\n' >&3
    dry_later ssh_run all remote_stop "$(( STOP_WAIT < 60 ? STOP_WAIT : 60 ))" 1
    printf '#   and the end of the failing workers'"'"' logs (remote_logs on --worker=THEIR NUMBERS).\n' >&3
    return 0
  fi
  tmpdir
  out=$TMPD/status.out
  classes=$TMPD/classes
  while :; do
    sleep "$POLL"
    if ! describe_slice READY; then info "could not read the TPU's state; trying again"; continue; fi
    case $T_STATE in
      READY) ;;
      PREEMPTED|TERMINATED|NOT_FOUND|QR_SUSPENDING|QR_SUSPENDED|QR_FAILED|QR_NOT_FOUND)
        restarts=$((restarts + 1))
        count_relaunch "$restarts" "$(slice_is) (preempted)" || exit 1
        recreate "${as[@]}"
        launch || true
        continue ;;
      STOPPED|STOPPING) die "TPU $TPU is $T_STATE (stopped by someone): not relaunching" ;;
      *) info "$(slice_is); waiting"; continue ;;
    esac
    if ! ssh_run all remote_status > "$out" 2>"$out.err"; then
      info "could not reach every worker; trying again ($(tail -n 1 "$out.err"))"
      continue
    fi
    worker_classes "$out" > "$classes"
    failed=$(in_class "$classes" failed)
    retry=$(in_class "$classes" retry)
    lost=$(in_class "$classes" lost)
    if [ -n "$failed" ] && [ -z "$retry$lost" ]; then
      describe_slice READY || true
      [ "$T_STATE" = READY ] || continue   # the next look sees a preempted TPU and recreates it
      info "train.py failed on worker(s) $failed (exit $(field "$out" "${failed%%,*}" exit)) on a READY TPU: a failure a relaunch would repeat, not relaunching"
      explain "$classes" "$out" failed
      info "stopping the other workers"
      stop_all "$(( STOP_WAIT < 60 ? STOP_WAIT : 60 ))" 1 || true
      tail_out=$TMPD/tail.out
      ssh_run "$failed" remote_logs "$RUN" 30 prefix > "$tail_out" 2>&1 || true
      info "the end of the failing log(s):"
      cat "$tail_out" >&2
      exit 1
    fi
    if [ -n "$(in_class "$classes" stopped)" ]; then
      info "run $RUN was stopped (bash $PROG stop): not relaunching"
      return 0
    fi
    if [ -n "$retry$lost" ]; then
      # A worker that exited 75 or went away explains the others' failures (their peer vanished).
      describe_slice READY || true
      [ "$T_STATE" = READY ] || continue   # the next look sees a preempted TPU and recreates it
      why=""
      [ -z "$retry" ] || why="train.py on worker(s) $retry exited 75 (a relaunch may help)"
      [ -z "$lost" ] || why="${why:+$why; }the trainer on worker(s) $lost was lost (killed, or its host shut down or restarted)"
      [ -z "$failed" ] || why="$why; worker(s) $failed failed as well, taken as a consequence"
      restarts=$((restarts + 1))
      if ! count_relaunch "$restarts" "$why"; then
        explain "$classes" "$out" retry lost failed
        info "stopping the other workers"
        stop_all "$(( STOP_WAIT < 60 ? STOP_WAIT : 60 ))" 1 || true
        exit 1
      fi
      explain "$classes" "$out" retry lost failed
      stop_all "$STOP_WAIT" 1 >/dev/null 2>&1 || true
      launch || true
      continue
    fi
    if [ -z "$(in_class "$classes" running)" ] && [ -n "$(in_class "$classes" finished)" ]; then
      info "run $RUN finished: train.py exited 0 on all $(grep -c ' finished ' "$classes") workers"
      return 0
    fi
  done
}

# status, logs, stop, tensorboard ------------------------------------------------------------------

cmd_status() {
  require tpu zone project
  local out w kind=on-demand
  describe_tpu READY || die "could not read TPU $TPU"
  dry || {
    if [ "$T_STATE" = NOT_FOUND ]; then echo "TPU $TPU: does not exist in $ZONE"; return 0; fi
    [ "$T_SPOT" = True ] && kind=spot
    [ "$T_PREEMPTIBLE" = True ] && kind=preemptible
    echo "TPU $TPU ($T_ACC, $kind, $ZONE): $T_STATE${T_HEALTH:+, $T_HEALTH}"
    [ "$T_STATE" = READY ] || return 0
  }
  tmpdir
  out=$TMPD/status.out
  ssh_run all remote_status > "$out" || info "(some workers did not answer)"
  dry && return 0
  build_code
  printf '%-6s %-20s %-13s %-13s %s\n' worker run trainer code "last log line"
  for w in $(workers_in "$out"); do
    local state rc code
    state=$(field "$out" "$w" state); rc=$(field "$out" "$w" exit)
    case $state in EXITED|STOPPED|INTERRUPTED) state="$state $rc" ;; esac
    code=$(field "$out" "$w" code | cut -c1-12)
    [ "$(field "$out" "$w" code)" = "$CODE_HASH" ] || code="$code*"
    printf '%-6s %-20s %-13s %-13s %s\n' "$w" "$(field "$out" "$w" run)" "$state" "$code" "$(field "$out" "$w" last)"
    [ -z "$(field "$out" "$w" study)" ] || printf '%-6s study: %s\n' "" "$(field "$out" "$w" study)"
  done
  if awk -F'|' -v h="$CODE_HASH" '$1 == "TRM" && $3 == "code" && $4 != h { bad = 1 } END { exit !bad }' "$out"; then
    echo "(code*: not your checkout's ${CODE_HASH:0:12}: bash $PROG deploy)"
  fi
}

cmd_logs() {
  local worker=${POS[0]:-0} mode=follow rc=0
  [ ${#POS[@]} -le 1 ] || usage_error "logs takes one worker (a number, or all)"
  case $worker in
    all) mode=prefix ;;
    *[!0-9]*|'') usage_error "worker '$worker': a number (0 is the first host) or all" ;;
    *) [ "$FOLLOW" = 1 ] || mode="tail" ;;
  esac
  if [ "$FROM_BUCKET" = 1 ]; then bucket_logs "$worker"; return; fi
  require tpu zone project
  ssh_run "$worker" remote_logs "$LOG_RUN" "$LINES" "$mode" || rc=$?
  [ "$rc" != 0 ] || return 0
  # No worker answered: when the TPU is gone, what train.py copied to the bucket.
  if [ -n "$LOG_RUN" ] && [ -n "$BUCKET" ] && describe_tpu READY && [ "$T_STATE" != READY ]; then
    info "TPU $TPU is ${T_STATE}: the logs train.py copied to the bucket"
    bucket_logs "$worker"
    return
  fi
  info "(when the TPU is gone: bash $PROG logs $worker --run RUN_NAME --from-bucket)"
  return "$rc"
}

# bucket_logs WORKER|all: the last lines of each host's logs in gs://BUCKET/runs/RUN/logs/
# (train.py writes host_I.launch-TIME.log there, one per launch: their names sort in launch order).
bucket_logs() {
  require bucket
  [ -n "$LOG_RUN" ] || usage_error "the logs in the bucket need the run's name: --run RUN_NAME"
  local dir="gs://$BUCKET/runs/$LOG_RUN/logs" hosts h
  tmpdir
  if [ "$1" = all ]; then
    gc storage ls "$dir/" > "$TMPD/logs.ls" || die "no logs in $dir (does the run exist?)"
    hosts=$(sed -n 's|.*/host_\([0-9][0-9]*\)\.launch-[^/]*\.log$|\1|p' "$TMPD/logs.ls" | sort -un)
  else
    hosts=$1
  fi
  for h in $hosts; do
    gc storage cat "$dir/host_$h.launch-*.log" > "$TMPD/host.log" || die "no log of host $h in $dir"
    if [ "$1" = all ]; then tail -n "$LINES" "$TMPD/host.log" | sed "s/^/[host $h] /"
    else tail -n "$LINES" "$TMPD/host.log"; fi
  done
}

cmd_stop() {
  require tpu zone project
  tmpdir
  info "stop: SIGTERM to train.py on every worker of $TPU; each saves a checkpoint, then exits"
  stop_all "$STOP_WAIT" "$KILL" || die "some trainers did not stop (above)"
  dry && return 0
  info "stopped. The same train command resumes from the checkpoint."
}

tensorboard_cmd() {  # tensorboard_cmd RUN_NAME [a study's directory under the bucket]
  local dir="gs://$BUCKET/runs"
  [ -z "${1:-}" ] || dir="$dir/$1/tb"
  [ -z "${2:-}" ] || dir="gs://$BUCKET/$2"
  # --load_fast=false: TensorBoard's Python reader, which reads gs:// through gcsfs with your own
  # application-default credentials.
  quote_cmd tensorboard --logdir "$dir" --port "$PORT" --load_fast=false
}

cmd_tensorboard() {
  require bucket
  [ ${#POS[@]} -le 1 ] || usage_error "tensorboard takes at most one RUN_NAME"
  local run=${POS[0]:-} dir
  dir="gs://$BUCKET/runs"
  [ -z "$run" ] || dir="$dir/$run/tb"
  if [ -n "$STUDY" ]; then
    [ -z "$run" ] || usage_error "tensorboard takes a RUN_NAME or --study STUDY_NAME, not both"
    dir="gs://$BUCKET/studies/$STUDY"
  fi
  if [ "$START" = 1 ] && ! dry; then
    command -v tensorboard >/dev/null 2>&1 || die "tensorboard is not installed here: pip install tensorboard gcsfs (or pip install -r requirements.txt)"
    info "TensorBoard on http://localhost:$PORT (Ctrl-C ends it)"
    exec tensorboard --logdir "$dir" --port "$PORT" --load_fast=false
  fi
  tensorboard_cmd "$run" "${STUDY:+studies/$STUDY}"
}

# ----------------------------------------------------------------------------------------------
# Arguments

parse_args() {
  local opt val has
  while [ $# -gt 0 ]; do
    opt=$1 val="" has=0
    case $opt in
      --*=*) val=${opt#*=}; opt=${opt%%=*}; has=1 ;;
    esac
    case $opt in
      --tpu|--zone|--project|--bucket|--accelerator|--runtime-version|--data|--poll|--max-restarts|--wait|--lines|-n|--port|--run|--study)
        if [ "$has" = 0 ]; then
          [ $# -ge 2 ] || usage_error "$opt needs a value"
          val=$2
          shift
        fi
        case $opt in
          --tpu) TPU=$val ;;
          --zone) ZONE=$val ;;
          --project) PROJECT=$val ;;
          --bucket) BUCKET=$val ;;
          --accelerator) ACCELERATOR=$val ;;
          --runtime-version) RUNTIME_VERSION=$val ;;
          --data) DATA=$val ;;
          --poll) POLL=$val ;;
          --max-restarts) MAX_RESTARTS=$val ;;
          --wait) STOP_WAIT=$val ;;
          --lines|-n) LINES=$val ;;
          --port) PORT=$val ;;
          --run) LOG_RUN=$val ;;
          --study) STUDY=$val ;;
        esac
        shift ;;
      --spot|--queued|--retry|--dry-run|--kill|--no-follow|--from-bucket|--start|--per-host|--whole-slice|-h|--help)
        [ "$has" = 0 ] || usage_error "$opt takes no value"
        case $opt in
          --spot) SPOT=1 ;;
          --queued) QUEUED=1 ;;
          --retry) RETRY=1 ;;
          --dry-run) DRY_RUN=1 ;;
          --kill) KILL=1 ;;
          --no-follow) FOLLOW=0 ;;
          --from-bucket) FROM_BUCKET=1 ;;
          --start) START=1 ;;
          --per-host|--whole-slice)
            [ -z "$MODE" ] || [ "$MODE" = "${opt#--}" ] || usage_error "--per-host or --whole-slice, not both"
            MODE=${opt#--} ;;
          -h|--help) HELP=1 ;;
        esac
        shift ;;
      --)
        shift
        POS+=("$@")
        break ;;
      -*) usage_error "unknown option $1" ;;
      *)
        if [ -z "$CMD" ]; then
          CMD=$1
          shift
        elif [ "$CMD" = train ]; then
          POS+=("$@")   # RUN_NAME, then train.py's arguments, untouched
          break
        else
          POS+=("$1")
          shift
        fi ;;
    esac
  done
  case $POLL in
    ''|.|*[!0-9.]*|*.*.*) usage_error "--poll takes a number of seconds (TRM_POLL_SECONDS), not '$POLL'" ;;
  esac
  # Whole numbers: bash's arithmetic and [ -gt ] take no others (1.5 used to slip through and
  # make --max-restarts never end the relaunches).
  for val in "$MAX_RESTARTS" "$STOP_WAIT" "$LINES" "$PORT"; do
    case $val in
      ''|*[!0-9]*) usage_error "--max-restarts, --wait, --lines and --port (TRM_MAX_RESTARTS, TRM_STOP_WAIT) take whole numbers, not '$val'" ;;
    esac
  done
}

main() {
  parse_args "$@"
  if [ -z "$CMD" ]; then
    usage_main
    [ "$HELP" = 1 ] && exit 0
    exit 2
  fi
  case $CMD in
    create|delete|setup|deploy|check|train|study|status|logs|stop|tensorboard)
      if [ "$HELP" = 1 ]; then "usage_$CMD"; exit 0; fi
      case $CMD in setup|deploy|check|train|study|status|logs|stop) load_worker_script ;; esac
      "cmd_$CMD" ;;
    help) usage_main ;;
    *) usage_error "unknown command '$CMD' (create, delete, setup, deploy, check, train, study, status, logs, stop, tensorboard)" ;;
  esac
}

main "$@"
