#!/usr/bin/env bash
# launch.sh: train TRM on a Cloud TPU slice (a v4-8 up to a v4-64 pod) from your laptop, with gcloud.
#
# From nothing to a running v4-64 job. Every step can be run twice; --dry-run prints the gcloud
# commands instead of running them.
#
#   export TRM_TPU=trm-pod TRM_ZONE=us-central2-b TRM_PROJECT=my-project TRM_BUCKET=my-trm-bucket
#   bash launch.sh create --accelerator v4-64 --spot   # the TPU VM slice and the bucket, if missing
#   python build_data.py build-sudoku --out gs://$TRM_BUCKET/data/sudoku-extreme-1k-aug-1000
#   export TRM_DATA=gs://$TRM_BUCKET/data/sudoku-extreme-1k-aug-1000
#   bash launch.sh setup                 # venv ~/trm-venv with torch_xla[tpu] on every worker
#   bash launch.sh deploy                # tracked files -> ~/trm on every worker, code hashes compared
#   bash launch.sh check                 # TPU, versions, device count, bucket, dataset, per worker
#   bash launch.sh train --retry sudoku-1 sudoku-mlp   # train.py on every worker, relaunched after
#                                        # preemptions (without --retry: start and return)
#   bash launch.sh status                # TPU state and each worker's trainer
#   bash launch.sh logs 0                # follow worker 0's log (Ctrl-C stops following, not the run)
#   bash launch.sh tensorboard sudoku-1  # the command that watches gs://$TRM_BUCKET/runs/sudoku-1/tb
#   bash launch.sh stop                  # SIGTERM: every host saves a checkpoint, then exits
#   bash launch.sh train sudoku-1 sudoku-mlp           # the same command again resumes the run
#   bash launch.sh delete                # the TPU VMs (the bucket, data and runs stay)
#
# Settings, as flags (anywhere before the run name) or environment variables:
#   --tpu NAME           TRM_TPU              TPU VM (slice) name
#   --zone ZONE          TRM_ZONE             e.g. us-central2-b (v4)
#   --project PROJECT    TRM_PROJECT          Google Cloud project id
#   --bucket BUCKET      TRM_BUCKET           GCS bucket for data and runs (name or gs://name)
#   --accelerator TYPE   TRM_ACCELERATOR      create: accelerator type (default v4-64)
#   --runtime-version V  TRM_RUNTIME_VERSION  create: TPU software version (default by accelerator)
#   --spot               TRM_SPOT=1           create: a spot TPU (cheap, preemptible)
#   --data URL           TRM_DATA             dataset for check, and train's default --data.path
#
# The run directory is gs://BUCKET/runs/RUN_NAME; the run name is chosen here, once, and given to
# every host. On the workers: code in ~/trm (replaced whole by deploy), venv in ~/trm-venv, trainer
# state and logs in ~/trm-state (logs/RUN_NAME.log). Needs bash, git, tar and gcloud on the laptop.
#
# Exit status: 0 success, 1 failure (explained on stderr), 2 usage error.
set -euo pipefail

# Functions named remote_* and r_* run on the TPU workers: they are sent, with `declare -f`, inside
# the --command of `gcloud compute tpus tpu-vm ssh`; shellcheck checks them here.
# shellcheck disable=SC2329

readonly PROG=launch.sh
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly REPO
readonly REMOTE_HELPERS="r_init r_say r_active_pid r_code_hash"

TPU=${TRM_TPU:-}
ZONE=${TRM_ZONE:-}
PROJECT=${TRM_PROJECT:-}
BUCKET=${TRM_BUCKET:-}
ACCELERATOR=${TRM_ACCELERATOR:-v4-64}
RUNTIME_VERSION=${TRM_RUNTIME_VERSION:-}
SPOT=${TRM_SPOT:-0}
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
HELP=0
CMD=""
POS=()

CODE_HASH=""
CODE_TAR=""
TMPD=""
exec 3>&1   # dry-run commands go to the original stdout, even from inside $(...)

# ----------------------------------------------------------------------------------------------
# Help

usage_main() {
  cat <<'EOF'
usage: bash launch.sh [SETTINGS] COMMAND [OPTIONS] [ARGS]

Run TRM on a Cloud TPU slice from your laptop (gcloud). Commands, in the order of a first run:
  create       create the TPU VM slice and the bucket, if missing
  setup        install the pinned requirements (torch_xla[tpu]) in ~/trm-venv on every worker
  deploy       ship the tracked code to ~/trm on every worker and compare code hashes
  check        preflight on every worker: TPU, versions, device count, bucket, dataset
  train        train RUN_NAME PRESET [train.py flags...]: start train.py on every worker
  status       the TPU's state and each worker's trainer
  logs         logs [WORKER|all]: follow one worker's log
  stop         SIGTERM the trainers (they save a checkpoint, then exit)
  tensorboard  print (or --start) the TensorBoard command for gs://BUCKET/runs/RUN_NAME/tb
  delete       delete the TPU VM slice (the bucket stays)

Settings (flags, or environment variables):
  --tpu NAME (TRM_TPU)   --zone ZONE (TRM_ZONE)   --project ID (TRM_PROJECT)
  --bucket NAME (TRM_BUCKET)   --data gs://... (TRM_DATA)
  --dry-run      print every gcloud command instead of running it

`bash launch.sh COMMAND --help` explains a command. The top of launch.sh lists every step.
EOF
}

usage_create() {
  cat <<'EOF'
usage: bash launch.sh create [--accelerator TYPE] [--runtime-version V] [--spot] [--dry-run]

Creates the bucket gs://BUCKET (in the zone's region, uniform access) and the TPU VM slice TPU, each
only if missing. A TPU left PREEMPTED or TERMINATED is deleted and created again (a spot TPU does
not come back by itself). A TPU that exists with another accelerator type is an error.

  --accelerator TYPE       accelerator type (TRM_ACCELERATOR, default v4-64 = 8 hosts x 4 chips)
  --runtime-version V      TPU software version (TRM_RUNTIME_VERSION; default tpu-ubuntu2204-base
                           for v2/v3/v4, v2-alpha-tpuv5-lite for v5e, v2-alpha-tpuv5 for v5p,
                           v2-alpha-tpuv6e for v6e)
  --spot                   a spot TPU (TRM_SPOT=1): much cheaper, preempted at any time

Needs --tpu, --zone, --project, --bucket (or TRM_TPU, TRM_ZONE, TRM_PROJECT, TRM_BUCKET).
EOF
}

usage_delete() {
  cat <<'EOF'
usage: bash launch.sh delete [--dry-run]

Deletes the TPU VM slice (without a prompt). The bucket and everything in it (datasets,
checkpoints, TensorBoard logs) stays: remove it yourself with `gcloud storage rm -r gs://BUCKET`.
Nothing to delete is not an error. Needs --tpu, --zone, --project.
EOF
}

usage_setup() {
  cat <<'EOF'
usage: bash launch.sh setup [--dry-run]

On every worker, in parallel: creates the venv ~/trm-venv (installing python3-venv with apt if the
image lacks it) and installs requirements.txt with torch_xla[tpu] in place of torch_xla (libtpu
comes with it). A worker whose venv already holds exactly these requirements is left alone, so a
second run is quick. pip's output goes to ~/trm-state/setup.log on each worker; each worker reports
its Python, torch, torch_xla and libtpu versions. Needs --tpu, --zone, --project.
EOF
}

usage_deploy() {
  cat <<'EOF'
usage: bash launch.sh deploy [--dry-run]

Packs the files git tracks in this checkout, as they are in the working tree (never data/, runs/,
.venv/, nor untracked files or caches), with a manifest of their sha256 sums; copies the tarball to
every worker (gcloud ... scp --worker=all); unpacks it into a fresh ~/trm (replacing the old one
whole); then every worker checks each file against the manifest and reports its code hash, and
deploy fails unless every worker holds the hash of your checkout. Refused on a worker whose
trainer is running. Needs --tpu, --zone, --project.
EOF
}

usage_check() {
  cat <<'EOF'
usage: bash launch.sh check [--data gs://...] [--dry-run]

Preflight on every worker at once: the TPU is READY and healthy; Python, torch, torch_xla and
libtpu versions are the same everywhere and torch/torch_xla match requirements.txt; the TPU runtime
starts and sees the expected device count (v4-64: 32 devices, 4 per host, 8 processes); the bucket
is writable from the worker (a probe object under gs://BUCKET/runs/.trm-check/ is written and
removed); the dataset (--data or TRM_DATA) is readable; the code matches your checkout. The device
test is skipped while a trainer runs (the TPU is busy). Needs --tpu, --zone, --project, --bucket.
EOF
}

usage_train() {
  cat <<'EOF'
usage: bash launch.sh train [--retry] [--poll SECONDS] [--max-restarts N] [--dry-run]
                            RUN_NAME PRESET [train.py flags...]

Starts `python train.py PRESET [flags...] --run.dir gs://BUCKET/runs/RUN_NAME --run.device tpu` on
every worker, in the background, with PJRT_DEVICE=TPU, the same arguments and run name
(TRM_RUN_NAME) everywhere, each worker logging to its own ~/trm-state/logs/RUN_NAME.log.
Everything after RUN_NAME goes to train.py untouched (spaces and quotes included); launch.sh's own
options come before RUN_NAME. --data.path defaults to --data / TRM_DATA. Relaunching with the
same RUN_NAME resumes from the run's last checkpoint.

Before starting, every worker is asked first: train is refused if a trainer is running on any
worker (stop it, or wait), if a worker has no venv (setup) or other code than this checkout
(deploy). Then each worker ends stale train.py processes of ours and removes the TPU lock file
(/tmp/libtpu_lockfile).

  --retry              stay on the laptop and watch the run (every --poll seconds, TRM_POLL_SECONDS,
                       default 60): if the TPU is preempted (PREEMPTED, TERMINATED or gone), delete
                       and create it again with the same accelerator, runtime and spot setting, then
                       setup, deploy and relaunch the same command (it resumes from the last
                       checkpoint); if a host's trainer was killed on a READY TPU, relaunch. Stops
                       with an error when train.py exits non-zero on a READY TPU (a real failure:
                       the other workers are stopped and the failing log's end is printed), and
                       with success when every worker exits 0 or after `launch.sh stop`. Run again
                       with the same RUN_NAME to watch a run that is already going.
  --max-restarts N     give up after N relaunches (TRM_MAX_RESTARTS, default 20)
EOF
}

usage_status() {
  cat <<'EOF'
usage: bash launch.sh status [--dry-run]

Prints the TPU's state and health, then one line per worker: the run, its trainer's state
(RUNNING, EXITED n, STOPPED, INTERRUPTED, LOST, NONE), the code hash and the log's last line.
Needs --tpu, --zone, --project.
EOF
}

usage_logs() {
  cat <<'EOF'
usage: bash launch.sh logs [WORKER|all] [--lines N] [--no-follow] [--run RUN_NAME] [--dry-run]

Follows (tail -F) the log of the latest run on WORKER (default 0); Ctrl-C stops following, not the
run. `logs all` prints the last lines of every worker's log. --lines N: lines of history (default
100). --run: another run's log. Needs --tpu, --zone, --project.
EOF
}

usage_stop() {
  cat <<'EOF'
usage: bash launch.sh stop [--wait SECONDS] [--kill] [--dry-run]

Sends SIGTERM to train.py on every worker: the hosts agree on a step, save a checkpoint and exit 0.
Waits up to --wait seconds (TRM_STOP_WAIT, default 120) for them; --kill then ends what is still
running with SIGKILL (e.g. hosts stuck because another host died). `train` with the same run name
resumes. Needs --tpu, --zone, --project.
EOF
}

usage_tensorboard() {
  cat <<'EOF'
usage: bash launch.sh tensorboard [RUN_NAME] [--start] [--port N]

Prints the command that shows gs://BUCKET/runs/RUN_NAME/tb in TensorBoard on your laptop (every
run under gs://BUCKET/runs without RUN_NAME); --start runs it. TensorBoard reads the bucket
directly with your own credentials (gcloud auth application-default login) and needs gcsfs (both
are in requirements.txt). Needs --bucket.
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

# The --command that runs remote function FN with ARGS on a worker: bash -c '<functions>; FN ARGS'.
remote_cmd() {
  local fn=$1 body a
  shift
  # shellcheck disable=SC2086  # REMOTE_HELPERS is a list of names
  body="$(declare -f $REMOTE_HELPERS "$fn")"$'\n'"$fn"
  for a in "$@"; do body+=" $(printf '%q' "$a")"; done
  printf 'bash -c %s' "$(single_quote "$body")"
}

# ssh WORKERS FN ARGS...: run remote function FN on the workers (all, or a list such as 0 or 1,3).
ssh_run() {
  local workers=$1 fn=$2
  shift 2
  gc compute tpus tpu-vm ssh "$TPU" "${TPU_FLAGS[@]}" --worker="$workers" --command="$(remote_cmd "$fn" "$@")"
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
  BUCKET=${BUCKET#gs://}
  BUCKET=${BUCKET%/}
  case $BUCKET in
    *[!a-z0-9._-]*) usage_error "bucket '$BUCKET': a bucket name has only lowercase letters, digits, '-', '_' and '.'" ;;
  esac
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
# Remote side: these functions run on every TPU worker (bash, Linux), one process per worker.

r_init() {
  set -u
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

r_active_pid() {  # the pid of our running train.py, if any
  local p
  p=$(cat "$S/pid" 2>/dev/null) || return 1
  [ -n "$p" ] && [ -r "/proc/$p/cmdline" ] || return 1
  tr '\0' ' ' 2>/dev/null < "/proc/$p/cmdline" | grep -qF -- "$C/train.py" || return 1
  echo "$p"
}

r_code_hash() {  # r_code_hash DIR: the code hash if every file matches the manifest; none; modified
  local d=${1:-$C}
  [ -f "$d/.trm-code-sha256sums" ] || { echo none; return 0; }
  (cd "$d" && sha256sum --quiet --strict -c .trm-code-sha256sums >/dev/null 2>&1) || { echo modified; return 0; }
  sha256sum < "$d/.trm-code-sha256sums" | cut -c1-64
}

remote_setup() {  # remote_setup REQUIREMENT...
  r_init
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
  "$PY" - <<'PY' | while IFS=$'\t' read -r k v; do r_say "$k" "$v"; done
import importlib.metadata as md, platform
print(f"python\t{platform.python_version()}")
for name in ("torch", "torch_xla", "libtpu"):
    try:
        print(f"{name}\t{md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}\tmissing")
PY
  r_say ok "venv ready"
}

remote_deploy() {  # remote_deploy EXPECTED_HASH
  r_init
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
  r_init
  local p
  r_say code "$(r_code_hash "$C")"
  if [ -x "$PY" ]; then r_say venv ok; else r_say venv missing; fi
  if p=$(r_active_pid); then r_say active "$(cat "$S/name" 2>/dev/null)"; r_say pid "$p"; fi
  return 0
}

remote_launch() {  # remote_launch RUN_NAME TRAIN_ARGS...
  r_init
  local run=$1 p stale i log
  shift
  if p=$(r_active_pid); then
    r_say error "run $(cat "$S/name") is already running (pid $p)"; return 10
  fi
  # Stale trainers of ours (left by a crash or started by hand): they would hold the TPU.
  stale=""
  for p in $(pgrep -u "$(id -u)" -f 'train\.py' || true); do
    if tr '\0' ' ' 2>/dev/null < "/proc/$p/cmdline" | grep -qF -- "$C/train.py" \
       || [ "$(readlink "/proc/$p/cwd" 2>/dev/null)" = "$C" ]; then stale="$stale $p"; fi
  done
  if [ -n "$stale" ]; then
    r_say note "ending stale train.py processes:$stale"
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
    echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) worker $W: run $run: train.py $(cat "$S/args")"
    PJRT_DEVICE=TPU PYTHONUNBUFFERED=1 TRM_RUN_NAME=$run "$PY" "$C/train.py" "$@" &
    child=$!
    echo "$child" > "$S/pid"
    while :; do
      wait "$child"; rc=$?
      kill -0 "$child" 2>/dev/null || break
    done
    echo "$rc" > "$S/exit"
    echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) worker $W: train.py exited with status $rc"
  ) < /dev/null >> "$log" 2>&1 &
  for i in $(seq 100); do [ -s "$S/pid" ] && break; sleep 0.1; done
  r_say started "$(cat "$S/pid" 2>/dev/null)"
  r_say ok "started run $run (pid $(cat "$S/pid" 2>/dev/null)), log ~/trm-state/logs/$run.log"
}

remote_status() {
  r_init
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
  return 0
}

remote_stop() {  # remote_stop WAIT_SECONDS KILL(0/1)
  r_init
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
  r_init
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

remote_check() {  # remote_check BUCKET DATA_URL
  r_init
  local bucket=$1 data=$2 p devices=1 rc
  r_say code "$(r_code_hash "$C")"
  if [ ! -x "$PY" ]; then r_say error "no venv ~/trm-venv: run setup"; return 1; fi
  if p=$(r_active_pid); then
    devices=0; r_say note "trainer running (pid $p): TPU busy, device test skipped"
  elif [ -e /tmp/libtpu_lockfile ]; then
    r_say note "/tmp/libtpu_lockfile exists (another process may hold the TPU; train removes it)"
  fi
  TRM_CHECK_WORKER=$W TRM_CHECK_DEVICES=$devices PJRT_DEVICE=TPU timeout 300 "$PY" - "$bucket" "$data" <<'PY' | while IFS=$'\t' read -r k v; do r_say "$k" "$v"; done
import importlib.metadata as md, json, os, platform, sys
def say(k, v):
    print(f"{k}\t{v}", flush=True)
say("python", platform.python_version())
for name in ("torch", "torch_xla", "libtpu"):
    try:
        say(name, md.version(name))
    except md.PackageNotFoundError:
        say(name, "missing")
bucket, data = sys.argv[1], sys.argv[2]
try:
    import fsspec
    fs = fsspec.filesystem("gs")
    probe = f"{bucket}/runs/.trm-check/worker-{os.environ['TRM_CHECK_WORKER']}"
    with fs.open(probe, "wb") as f:
        f.write(b"ok")
    fs.rm(probe)
    say("bucket", "ok")
except Exception as e:
    say("bucket", f"ERROR {type(e).__name__}: {e}".replace("\n", " ")[:300])
if data:
    try:
        import fsspec
        for split in ("train", "test"):
            with fsspec.open(f"{data}/{split}/dataset.json", "r") as f:
                json.load(f)
        say("data", "ok")
    except Exception as e:
        say("data", f"ERROR {type(e).__name__}: {e}".replace("\n", " ")[:300])
if os.environ["TRM_CHECK_DEVICES"] == "1":
    try:
        import torch_xla.runtime as xr
        say("devices", xr.global_runtime_device_count())
        say("local_devices", xr.addressable_runtime_device_count())
        say("processes", xr.process_count())
    except Exception as e:
        say("devices", f"ERROR {type(e).__name__}: {e}".replace("\n", " ")[:300])
PY
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ]; then
    r_say devices "ERROR: no answer in 300 s (every host must start the TPU runtime at once; does another process hold the TPU?)"
  elif [ "$rc" != 0 ]; then
    r_say error "the check script failed with status $rc"
  fi
  return 0
}

# ----------------------------------------------------------------------------------------------
# Commands

cmd_create() {
  require tpu zone project bucket
  local version=${RUNTIME_VERSION:-$(runtime_version_for "$ACCELERATOR")} spot=""
  [ "$SPOT" = 1 ] && spot=True
  ensure_bucket
  describe_tpu NOT_FOUND || die "could not read TPU $TPU (see the gcloud error above)"
  case $T_STATE in
    NOT_FOUND) ;;
    PREEMPTED|TERMINATED)
      info "TPU $TPU is $T_STATE: it does not come back by itself, so it is deleted and created again"
      delete_tpu || die "could not delete TPU $TPU" ;;
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
  create_tpu "$ACCELERATOR" "$version" "$spot" "" || die "could not create TPU $TPU (quota, capacity, zone? see above)"
  info "TPU $TPU is ready. Next: bash $PROG setup"
}

cmd_delete() {
  require tpu zone project
  describe_tpu READY || die "could not read TPU $TPU (see the gcloud error above)"
  if [ "$T_STATE" = NOT_FOUND ]; then info "TPU $TPU does not exist: nothing to delete"; return 0; fi
  delete_tpu || die "could not delete TPU $TPU"
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
  local out problems=() w ws n v first expected want_torch want_xla procs
  describe_tpu READY || die "could not read TPU $TPU"
  [ "$T_STATE" = READY ] || die "TPU $TPU is $T_STATE, not READY${T_STATE:+ (bash $PROG create, or status)}"
  case ${T_HEALTH:-HEALTHY} in HEALTHY) ;; *) problems+=("TPU health is $T_HEALTH") ;; esac
  build_code
  tmpdir
  out=$TMPD/check.out
  info "check: every worker of $TPU ($T_ACC)"
  ssh_capture "$out" all remote_check "gs://$BUCKET" "$DATA" || problems+=("the check command failed on some workers")
  dry && return 0
  ws=$(workers_in "$out")
  n=$(printf '%s\n' "$ws" | grep -c . || true)
  [ "$n" -gt 0 ] || die "no worker answered"
  printf '%-6s %-8s %-7s %-9s %-8s %-7s %-6s %-6s %-6s %s\n' worker python torch torch_xla libtpu devices local procs code bucket/data
  for w in $ws; do
    printf '%-6s %-8s %-7s %-9s %-8s %-7s %-6s %-6s %-6s %s\n' "$w" "$(field "$out" "$w" python)" \
      "$(field "$out" "$w" torch)" "$(field "$out" "$w" torch_xla)" "$(field "$out" "$w" libtpu)" \
      "$(field "$out" "$w" devices | cut -c1-7)" "$(field "$out" "$w" local_devices)" "$(field "$out" "$w" processes)" \
      "$(field "$out" "$w" code | cut -c1-6)" "$(field "$out" "$w" bucket | cut -c1-20)/$(field "$out" "$w" data | cut -c1-20)"
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

RUN=""
TRAIN_ARGS=()
TPU_FLAGS=()

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
  info "train: run $RUN on every worker of $TPU: train.py $(quote_cmd "${TRAIN_ARGS[@]}")"
  out=$TMPD/launch.out
  ssh_capture "$out" all remote_launch "$RUN" "${TRAIN_ARGS[@]}" || die "train.py did not start on every worker (above)"
  dry && return 0
  for w in $(workers_in "$out"); do
    [ -n "$(field "$out" "$w" started)" ] && started=$((started + 1))
  done
  [ "$started" -gt 0 ] || die "train.py did not start"
  info "run $RUN started on $started workers; run dir gs://$BUCKET/runs/$RUN"
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
  if [ "$RETRY" = 1 ]; then retry_loop; return; fi
  ensure_ready_for_launch
  launch || true
  dry && return 0
  info "  bash $PROG status | logs 0 | stop;  $(tensorboard_cmd "$RUN")"
}

# Stop what is left of the run on every worker (SIGTERM, then SIGKILL after STOP_WAIT seconds).
stop_all() {
  local kill=$1
  tmpdir
  ssh_capture "$TMPD/stop.out" all remote_stop "$STOP_WAIT" "$kill"
}

# --retry --------------------------------------------------------------------------------------------

# Classifies the workers from a status file: sets R_RUNNING R_DONE R_FAILED R_STOPPED R_INTERRUPTED.
classify() {
  local out=$1 w state rc run
  R_RUNNING=() R_DONE=() R_FAILED=() R_STOPPED=() R_INTERRUPTED=()
  for w in $(workers_in "$out"); do
    state=$(field "$out" "$w" state)
    rc=$(field "$out" "$w" exit)
    run=$(field "$out" "$w" run)
    if [ "$run" != "$RUN" ]; then R_INTERRUPTED+=("$w"); continue; fi
    case $state in
      RUNNING) R_RUNNING+=("$w") ;;
      EXITED) if [ "$rc" = 0 ]; then R_DONE+=("$w"); else R_FAILED+=("$w"); fi ;;
      STOPPED) R_STOPPED+=("$w") ;;
      *) R_INTERRUPTED+=("$w") ;;   # INTERRUPTED (SIGTERM from a shutdown), LOST, NONE
    esac
  done
}

recreate() {  # delete the preempted TPU, create it again as it was, setup, deploy
  local delay=$POLL
  if [ "$T_STATE" != NOT_FOUND ]; then
    delete_tpu || info "delete failed; trying create anyway"
  fi
  until create_tpu "$R_ACC" "$R_VERSION" "$R_SPOT" "$R_PREEMPTIBLE"; do
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

relaunch() {  # relaunch WHY
  RESTARTS=$((RESTARTS + 1))
  if [ "$RESTARTS" -gt "$MAX_RESTARTS" ]; then
    die "$1; already relaunched $MAX_RESTARTS times (--max-restarts): giving up"
  fi
  info "$1: relaunch $RESTARTS of at most $MAX_RESTARTS"
}

retry_loop() {
  local out rc=0 w tail_out
  RESTARTS=0
  trap 'info ""; info "stopped watching; the run goes on on the TPU (bash $PROG status / stop)"; exit 130' INT
  describe_tpu READY || die "could not read TPU $TPU"
  # What a preempted TPU is created again as: itself if it exists, else the create settings.
  R_ACC=$ACCELERATOR R_VERSION=${RUNTIME_VERSION:-$(runtime_version_for "$ACCELERATOR")} R_SPOT="" R_PREEMPTIBLE=""
  [ "$SPOT" = 1 ] && R_SPOT=True
  if [ "$T_STATE" != NOT_FOUND ] && [ -n "$T_ACC" ]; then
    R_ACC=$T_ACC R_VERSION=${T_VERSION:-$R_VERSION} R_SPOT=$T_SPOT R_PREEMPTIBLE=$T_PREEMPTIBLE
  fi
  case $T_STATE in
    READY) ;;
    PREEMPTED|TERMINATED|NOT_FOUND) relaunch "TPU $TPU is $T_STATE"; recreate ;;
    *) die "TPU $TPU is $T_STATE, not READY: wait, then run train --retry again" ;;
  esac
  launch || rc=$?
  if dry; then
    info "# --retry: then, every ${POLL}s: the describe above, and the status command on every worker"
    return 0
  fi
  tmpdir
  out=$TMPD/status.out
  while :; do
    sleep "$POLL"
    if ! describe_tpu READY; then info "could not read the TPU's state; trying again"; continue; fi
    case $T_STATE in
      READY) ;;
      PREEMPTED|TERMINATED|NOT_FOUND)
        relaunch "TPU $TPU is $T_STATE (preempted)"
        recreate
        launch || true
        continue ;;
      STOPPED|STOPPING) die "TPU $TPU is $T_STATE (stopped by someone): not relaunching" ;;
      *) info "TPU $TPU is $T_STATE; waiting"; continue ;;
    esac
    if ! ssh_run all remote_status > "$out" 2>"$out.err"; then
      info "could not reach every worker; trying again ($(tail -n 1 "$out.err"))"
      continue
    fi
    classify "$out"
    if [ ${#R_FAILED[@]} -gt 0 ]; then
      info "train.py failed on worker(s) $(join_by , "${R_FAILED[@]}") (exit $(field "$out" "${R_FAILED[0]}" exit)) on a READY TPU: a real failure, not relaunching"
      info "stopping the other workers"
      STOP_WAIT=$(( STOP_WAIT < 60 ? STOP_WAIT : 60 )) stop_all 1 || true
      tail_out=$TMPD/tail.out
      ssh_run "$(join_by , "${R_FAILED[@]}")" remote_logs "$RUN" 30 prefix > "$tail_out" 2>&1 || true
      info "the end of the failing log(s):"
      cat "$tail_out" >&2
      exit 1
    fi
    if [ ${#R_STOPPED[@]} -gt 0 ]; then
      info "run $RUN was stopped (bash $PROG stop): not relaunching"
      return 0
    fi
    if [ ${#R_INTERRUPTED[@]} -gt 0 ]; then
      describe_tpu READY || true
      if [ "$T_STATE" = READY ]; then
        relaunch "the trainer on worker(s) $(join_by , "${R_INTERRUPTED[@]}") was interrupted (host restarted or killed)"
        stop_all 1 >/dev/null 2>&1 || true
        launch || true
      fi
      continue
    fi
    if [ ${#R_RUNNING[@]} -eq 0 ] && [ ${#R_DONE[@]} -gt 0 ]; then
      info "run $RUN finished: train.py exited 0 on all ${#R_DONE[@]} workers"
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
  done
  if awk -F'|' -v h="$CODE_HASH" '$1 == "TRM" && $3 == "code" && $4 != h { bad = 1 } END { exit !bad }' "$out"; then
    echo "(code*: not your checkout's ${CODE_HASH:0:12}: bash $PROG deploy)"
  fi
}

cmd_logs() {
  require tpu zone project
  local worker=${POS[0]:-0} mode=follow
  [ ${#POS[@]} -le 1 ] || usage_error "logs takes one worker (a number, or all)"
  case $worker in
    all) mode=prefix ;;
    *[!0-9]*|'') usage_error "worker '$worker': a number (0 is the first host) or all" ;;
    *) [ "$FOLLOW" = 1 ] || mode="tail" ;;
  esac
  ssh_run "$worker" remote_logs "$LOG_RUN" "$LINES" "$mode"
}

cmd_stop() {
  require tpu zone project
  tmpdir
  info "stop: SIGTERM to train.py on every worker of $TPU; each saves a checkpoint, then exits"
  stop_all "$KILL" || die "some trainers did not stop (above)"
  dry && return 0
  info "stopped. The same train command resumes from the checkpoint."
}

tensorboard_cmd() {
  local dir="gs://$BUCKET/runs"
  [ -z "${1:-}" ] || dir="$dir/$1/tb"
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
  if [ "$START" = 1 ] && ! dry; then
    command -v tensorboard >/dev/null 2>&1 || die "tensorboard is not installed here: pip install tensorboard gcsfs (or pip install -r requirements.txt)"
    info "TensorBoard on http://localhost:$PORT (Ctrl-C ends it)"
    exec tensorboard --logdir "$dir" --port "$PORT" --load_fast=false
  fi
  tensorboard_cmd "$run"
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
      --tpu|--zone|--project|--bucket|--accelerator|--runtime-version|--data|--poll|--max-restarts|--wait|--lines|-n|--port|--run)
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
        esac
        shift ;;
      --spot|--retry|--dry-run|--kill|--no-follow|--start|-h|--help)
        [ "$has" = 0 ] || usage_error "$opt takes no value"
        case $opt in
          --spot) SPOT=1 ;;
          --retry) RETRY=1 ;;
          --dry-run) DRY_RUN=1 ;;
          --kill) KILL=1 ;;
          --no-follow) FOLLOW=0 ;;
          --start) START=1 ;;
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
  case $POLL$MAX_RESTARTS$STOP_WAIT$LINES$PORT in
    *[!0-9.]*) usage_error "--poll, --max-restarts, --wait, --lines and --port take numbers" ;;
  esac
}

main() {
  parse_args "$@"
  if [ -z "$CMD" ]; then
    usage_main
    [ "$HELP" = 1 ] && exit 0
    exit 2
  fi
  case $CMD in
    create|delete|setup|deploy|check|train|status|logs|stop|tensorboard)
      if [ "$HELP" = 1 ]; then "usage_$CMD"; exit 0; fi
      "cmd_$CMD" ;;
    help) usage_main ;;
    *) usage_error "unknown command '$CMD' (create, delete, setup, deploy, check, train, status, logs, stop, tensorboard)" ;;
  esac
}

main "$@"
