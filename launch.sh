#!/usr/bin/env bash
# launch.sh: train TRM on a Cloud TPU slice (a v4-8 up to a v4-64 pod) from your laptop, with gcloud.
#
# The laptop's side: one command per stage (create, setup, deploy, check, smoke, train, study, status,
# logs, stop, tensorboard, delete), each safe to run twice; --dry-run prints the gcloud calls
# instead of making them. With --queued (TRM_QUEUED=1), create and train/study --retry request the
# slice as a queued resource and wait until it is ACTIVE; delete removes a queued resource of the
# TPU's name too. On the workers, each step runs worker.sh, which this script sends with every ssh
# call (see the top of worker.sh) and which answers in lines TRM|WORKER|KEY|VALUE read here. Its
# parts: launch_help.sh (each command's usage), launch_run.sh (train, study, --retry),
# launch_smoke.sh (smoke) and launch_fleet.sh (--count N, --fleet: every command on several VMs).
#
# How to use it, from nothing to a running v4-64 job: README.md; what each command does:
# docs/pod.md; studies: docs/studies.md. `bash launch.sh COMMAND --help` lists a command's flags.
#
#   bash launch.sh create --accelerator v4-64 --spot && bash launch.sh setup && bash launch.sh deploy
#   bash launch.sh train --retry sudoku-1 sudoku-mlp --data.path gs://BUCKET/data/sudoku-extreme-1k-aug-1000
#   bash launch.sh study --retry sudoku-scaling studies/sudoku-scaling.txt   # runs claimed one at a time
#   bash launch.sh status; bash launch.sh logs 0; bash launch.sh stop; bash launch.sh delete
#
# Exit status: 0 success, 1 failure (explained on stderr), 2 usage error.
set -euo pipefail

readonly PROG=launch.sh
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
readonly REPO
readonly WORKER_SCRIPT=$REPO/pod/worker.sh   # what runs on the workers; sent with every ssh call

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
# The other parts: each command's usage (launch_help.sh); train and study, their launch on every
# worker and --retry's watch (launch_run.sh). Functions only; main() at the end runs a command.

# shellcheck source=pod/launch_help.sh
source "$REPO/pod/launch_help.sh"
# shellcheck source=pod/launch_run.sh
source "$REPO/pod/launch_run.sh"
# shellcheck source=pod/launch_smoke.sh
source "$REPO/pod/launch_smoke.sh"
# shellcheck source=pod/launch_fleet.sh
source "$REPO/pod/launch_fleet.sh"

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
  [ -f "$WORKER_SCRIPT" ] || die "no pod/worker.sh beside launch.sh (it runs on the workers)"
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
      --tpu|--zone|--project|--bucket|--accelerator|--runtime-version|--data|--poll|--max-restarts|--wait|--lines|-n|--port|--run|--study|--steps|--count|--fleet)
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
          --steps) SMOKE_STEPS=$val ;;
          --count) COUNT=$val ;;
          --fleet) FLEET_SPEC=$val ;;
        esac
        shift ;;
      --spot|--queued|--retry|--dry-run|--kill|--no-follow|--from-bucket|--start|-h|--help)
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
        elif [ "$CMD" = train ] || [ "$CMD" = smoke ]; then
          POS+=("$@")   # RUN_NAME (train) or PRESET (smoke), then train.py's arguments, untouched
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
  if [ -n "${TRM_FLEET_VM:-}" ]; then   # one VM of a fleet (launch_fleet.sh): its name and zone
    TPU=$TRM_FLEET_VM FLEET_SPEC="" COUNT=""
    [ -z "${TRM_FLEET_ZONE:-}" ] || ZONE=$TRM_FLEET_ZONE
  fi
  case $CMD in
    create|delete|setup|deploy|check|smoke|train|study|status|logs|stop|tensorboard)
      if [ "$HELP" = 1 ]; then "usage_$CMD"; exit 0; fi
      fleet_members
      if [ ${#FLEET[@]} -gt 0 ]; then fleet_run "$@"; return; fi
      case $CMD in setup|deploy|check|smoke|train|study|status|logs|stop) load_worker_script ;; esac
      "cmd_$CMD" ;;
    help) usage_main ;;
    *) usage_error "unknown command '$CMD' (create, delete, setup, deploy, check, smoke, train, study, status, logs, stop, tensorboard)" ;;
  esac
}

main "$@"
