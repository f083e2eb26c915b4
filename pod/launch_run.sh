# launch_run.sh: the long-running commands of launch.sh, sourced by it: train and study (their
# arguments, their launch on every worker through worker.sh) and --retry's watch of them
# (relaunch after a preemption, a lost host or exit 75; stop on a failure a relaunch would repeat).
# It uses launch.sh's settings and helpers (gc, ssh_run, describe_slice, recreate's create_tpu, ...).
# shellcheck shell=bash

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
    info "study: $RUN on every worker of $TPU (${LAUNCH[3]} host(s), claiming as ${LAUNCH[2]}): study.py run $STUDY_FILE --out gs://$BUCKET/studies/$RUN"
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
  [ ${#POS[@]} -eq 2 ] || usage_error "study needs STUDY_NAME and STUDY_FILE: study [--retry] STUDY_NAME STUDY_FILE"
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
# --dry-run): worker.sh writes the study file and runs study.py run FILE --out
# gs://BUCKET/studies/RUN --holder TPU@ZONE [--whole-slice --worker W on a multi-host slice] -- --run.device tpu:
# the VM claims the study's runs one at a time (fleet/claims.py), its name and zone the holder of its
# claims (one TPU name may exist in two zones: their holders differ).
study_launch() {
  local acc=${T_ACC:-$ACCELERATOR}
  LAUNCH=(remote_study "$RUN" "$TPU@$ZONE" "$(hosts_of "$acc")" "$BUCKET" "$(base64 < "$STUDY_FILE" | tr -d '\n')")
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

# retry_record EVENT WHY: a study's record of --retry's preemptions (EVENT preempted) and relaunches
# (relaunched), for its report's time down (fleet/goodput.py): gs://BUCKET/studies/RUN/study/retry/
# EVENT-TIME.json, {"event", "time" (epoch s), "why"}; best effort, never under --dry-run.
retry_record() {
  { [ "$WHAT" = study.py ] && ! dry; } || return 0
  local now
  now=$(date +%s)
  printf '{"event": "%s", "time": %s, "why": "%s"}\n' "$1" "$now" "${2//\"/\'}" |
    gcloud storage cp - "gs://$BUCKET/studies/$RUN/study/retry/$1-$now.json" --project="$PROJECT" \
      >/dev/null 2>&1 || true
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
        retry_record preempted "$(slice_is)"
        recreate "${as[@]}"
        launch || true
        retry_record relaunched "the slice was preempted"
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
      retry_record preempted "$why"
      stop_all "$STOP_WAIT" 1 >/dev/null 2>&1 || true
      launch || true
      retry_record relaunched "$why"
      continue
    fi
    if [ -z "$(in_class "$classes" running)" ] && [ -n "$(in_class "$classes" finished)" ]; then
      info "run $RUN finished: train.py exited 0 on all $(grep -c ' finished ' "$classes") workers"
      return 0
    fi
  done
}
