# launch_smoke.sh: the first hour on a slice, sourced by launch.sh: what a CPU could not check.
# smoke: minutes on the user's slice that set what was assumed beside what this slice shows.
# It uses launch.sh's settings and helpers (gc, ssh_run, field, describe_tpu, hosts_of, ...).
# shellcheck shell=bash

# smoke -------------------------------------------------------------------------------------------

SMOKE_STEPS=${TRM_SMOKE_STEPS:-300}   # steps of each smoke run (--steps)

# smoke_estimate PRESET ACCELERATOR: the compiler's estimate of a training step on this slice, as a
# line TRM|laptop|estimate|TEXT, from tpu_compile.py when this checkout has it and it runs.
smoke_estimate() {
  local json=$TMPD/compile.json text
  text="no compiler estimate (tpu_compile.py not available)"
  if [ -f "$REPO/tpu_compile.py" ] && ! dry; then
    info "smoke: the TPU compiler's estimate of $1 on $2 (python tpu_compile.py, a few minutes)"
    if "${TRM_PYTHON:-python3}" "$REPO/tpu_compile.py" "$1" --slice "$2" --json "$json" >"$TMPD/compile.log" 2>&1; then
      text=$("${TRM_PYTHON:-python3}" "$REPO/pod/smoke.py" estimate "$json")
    else
      text="no compiler estimate (tpu_compile.py failed: $(tail -n 1 "$TMPD/compile.log" | cut -c1-120))"
    fi
  fi
  printf 'TRM|laptop|estimate|%s\n' "$text"
}

# smoke_launch RUN PRESET [train.py flags...]: train.py on every worker, as train does.
smoke_launch() {
  POS=("$1" "$2" --optim.max-steps "$SMOKE_STEPS" --run.log-every 1 --eval.max-examples 256 "${@:3}")
  parse_train_args
  WHAT=train.py
  LAUNCH=(remote_launch "$RUN" "${TRAIN_ARGS[@]}")
  launch || die "smoke: run $RUN did not start (above)"
}

# smoke_wait: until RUN's trainers ended on every worker (POLL seconds apart); 0 when all exited 0.
# An end other than exit 0 is taken after 3 looks in a row (a trainer that just exited is LOST
# for the moment before its watcher writes its exit status).
smoke_wait() {
  local out=$TMPD/smoke-status.out classes=$TMPD/smoke-classes looks=0
  if dry; then dry_later ssh_run all remote_status; printf '# (every %ss until the run ends)\n' "$POLL" >&3; return 0; fi
  while :; do
    sleep "$POLL"
    ssh_run all remote_status > "$out" 2>/dev/null || continue
    worker_classes "$out" > "$classes"
    [ -z "$(in_class "$classes" running)" ] || continue
    [ -z "$(awk '$2 != "finished"' "$classes")" ] && return 0
    looks=$((looks + 1))
    [ "$looks" -ge 3 ] || continue
    info "smoke: run $RUN ended badly:"
    explain "$classes" "$out" failed retry lost stopped
    return 1
  done
}

# smoke_wait_step STEP: until worker 0's log of RUN shows a training step >= STEP (or RUN ended).
smoke_wait_step() {
  local out=$TMPD/smoke-log.out got
  if dry; then dry_later ssh_run 0 remote_logs "$RUN" 20 tail; printf '# (until it shows step %s)\n' "$1" >&3; return 0; fi
  while :; do
    sleep "$POLL"
    ssh_run 0 remote_logs "$RUN" 20 tail > "$out" 2>/dev/null || continue
    got=$(sed -n 's/^step \([0-9][0-9]*\)\/.*/\1/p' "$out" | tail -n 1)
    [ -z "$got" ] || [ "$got" -lt "$1" ] || return 0
    ! grep -q '^=== .* exited with status' "$out" || return 1
  done
}

# smoke [PRESET [train.py flags...]]: every check of the first hour on this slice, one table.
cmd_smoke() {
  require tpu zone project bucket
  local preset=${POS[0]:-sudoku-mlp} extra=() acc when out facts base rc=0
  [ ${#POS[@]} -le 1 ] || extra=("${POS[@]:1}")
  case $SMOKE_STEPS in ''|*[!0-9]*) usage_error "--steps takes a whole number of steps (at least 4), not '$SMOKE_STEPS'" ;; esac
  [ "$SMOKE_STEPS" -ge 4 ] || usage_error "--steps takes at least 4 steps (run B stops half way and resumes), not $SMOKE_STEPS"
  ensure_ready_for_launch
  acc=${T_ACC:-$ACCELERATOR}
  when=$(date -u +%Y%m%dT%H%M%SZ)
  base=smoke-$when
  out=gs://$BUCKET/smoke/$when
  tmpdir
  facts=$TMPD/smoke-facts.txt
  info "smoke: $preset on $TPU ($acc), runs of $SMOKE_STEPS steps ($base-a, $base-b); the table goes to $out/"
  smoke_estimate "$preset" "$acc" > "$facts"
  info "smoke: the bucket's write and read rates from every worker at once"
  ssh_capture "$TMPD/rates.out" all remote_smoke_rates "$out" "${TRM_SMOKE_MB:-64}" || true
  dry || cat "$TMPD/rates.out" >> "$facts"
  info "smoke: run A, $SMOKE_STEPS steps uninterrupted"
  smoke_launch "$base-a" "$preset" ${extra[@]+"${extra[@]}"}
  smoke_wait || rc=1
  info "smoke: run B, stopped by SIGTERM at step $((SMOKE_STEPS / 2)) or soon after, then resumed"
  smoke_launch "$base-b" "$preset" ${extra[@]+"${extra[@]}"}
  smoke_wait_step $((SMOKE_STEPS / 2)) || rc=1
  stop_all "$STOP_WAIT" 1 || rc=1
  smoke_launch "$base-b" "$preset" ${extra[@]+"${extra[@]}"}
  smoke_wait || rc=1
  info "smoke: the report, on worker 0"
  ssh_run 0 remote_smoke_report "$BUCKET" "$out" "$acc" "$(hosts_of "$acc")" "$preset" "$SMOKE_STEPS" "$base-a" \
    "$base-b" "$(base64 < "$facts" | tr -d '\n')" || rc=1
  dry && return 0
  [ "$rc" = 0 ] || die "smoke: a check failed (above; bash $PROG smoke --help and docs/pod.md, \"smoke\", say what each means)"
  info "smoke: every check passed on $TPU; the table is in $out/smoke.md"
}
