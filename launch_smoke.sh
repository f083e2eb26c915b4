# launch_smoke.sh: the first hour on a slice, sourced by launch.sh: what a CPU could not check.
# The per-host probe (check --per-host, and before a study commits to --per-host): does each
# worker's TPU runtime start as a slice of its own (worker.sh r_single_host_env, probe.py)? And
# smoke: minutes on the user's slice that set what was assumed beside what this slice shows.
# It uses launch.sh's settings and helpers (gc, ssh_run, field, describe_tpu, hosts_of, ...).
# shellcheck shell=bash

PROBE_WAIT=${TRM_PROBE_WAIT:-240}   # seconds each worker's probe may take (its runtime's start)
PROBE_OUT=""       # the workers' answers: set by probe_workers
PROBE_FAILED=()    # "worker W: what failed", one per failing worker
STUDY_MODE=""      # per-host or whole-slice, once the first launch of a study decided it

# probe_workers ACCELERATOR: probe.py under the single-host runtime on every worker at once (each
# ends its own after PROBE_WAIT seconds). Returns 0 when every worker of the slice answered ok;
# else PROBE_FAILED says which and how. Under --dry-run: the call, taken as passed.
probe_workers() {
  local acc=$1 hosts w v n=0
  tmpdir
  PROBE_OUT=$TMPD/probe.out
  PROBE_FAILED=()
  info "probe: each worker's TPU runtime alone (the per-host study mode), on every worker of $TPU at once, at most ${PROBE_WAIT}s"
  ssh_capture "$PROBE_OUT" all remote_probe "$acc" "$PROBE_WAIT" || true
  dry && return 0
  hosts=$(hosts_of "$acc")
  for w in $(workers_in "$PROBE_OUT"); do
    n=$((n + 1))
    v=$(field "$PROBE_OUT" "$w" probe)
    case $v in
      ok) ;;
      '') PROBE_FAILED+=("worker $w: no probe answer (its output is above)") ;;
      *) PROBE_FAILED+=("worker $w: ${v#ERROR }") ;;
    esac
  done
  [ "$n" -ge "$hosts" ] || PROBE_FAILED+=("only $n of the $hosts workers of $acc answered")
  [ ${#PROBE_FAILED[@]} -eq 0 ]
}

# probe_table: the probe's answers, a column per worker.
probe_table() {
  local ws w key label row
  ws=$(workers_in "$PROBE_OUT")
  row=$(printf '%-12s' "")
  for w in $ws; do row+=$(printf ' %-22s' "worker $w"); done
  printf '%s\n' "$row"
  for key in probe:probe kind:kind devices:devices local_devices:local processes:processes device_ids:ids \
             all_reduce:all-reduce seconds:seconds; do
    label=${key#*:} key=${key%%:*}
    row=$(printf '%-12s' "$label")
    for w in $ws; do row+=$(printf ' %-22s' "$(field "$PROBE_OUT" "$w" "$key" | cut -c1-22)"); done
    printf '%s\n' "$row"
  done
}

probe_failures() { local f; for f in "${PROBE_FAILED[@]}"; do info "  - $f"; done; }

# check --per-host: the probe alone.
cmd_check_per_host() {
  require tpu zone project
  describe_tpu READY || die "could not read TPU $TPU"
  [ "$T_STATE" = READY ] || die "TPU $TPU is $T_STATE, not READY${T_STATE:+ (bash $PROG create, or status)}"
  local ok=1
  probe_workers "$T_ACC" || ok=0
  dry && return 0
  probe_table
  if [ "$ok" = 0 ]; then
    info "the per-host probe failed:"
    probe_failures
    die "a study on $TPU runs --whole-slice (the default falls back to it by itself; docs/studies.md)"
  fi
  info "check --per-host: all $(workers_in "$PROBE_OUT" | wc -l | tr -d ' ') workers of $T_ACC start their TPU runtime alone: a study may run per-host"
}

# study_mode: STUDY_MODE for the study about to start on the slice just described (T_ACC;
# --accelerator under --dry-run), decided once: per-host by default on a slice of several hosts,
# when the probe passes on every worker; otherwise --whole-slice, said. An explicit --per-host
# whose probe fails stops with the failure and the command to run instead.
study_mode() {
  local acc=${T_ACC:-$ACCELERATOR} mode=$MODE again
  [ -z "$STUDY_MODE" ] || return 0
  if [ -z "$mode" ]; then
    if [ "$(hosts_of "$acc")" -gt 1 ]; then mode=per-host; else mode=whole-slice; fi
  fi
  if [ "$mode" = per-host ] && ! probe_workers "$acc"; then
    probe_table >&2
    info "the per-host probe failed on $TPU ($acc):"
    probe_failures
    if [ "$MODE" = per-host ]; then
      again="bash $PROG study --whole-slice"
      [ "$RETRY" = 0 ] || again+=" --retry"
      again+=" $(quote_cmd "$RUN" "$STUDY_FILE")"
      die "--per-host was asked for, so the study stops here. Run it over the whole slice instead: $again"
    fi
    info "the study runs --whole-slice instead: every run over the whole slice, one after another"
    mode=whole-slice
  elif [ "$mode" = per-host ] && ! dry; then
    info "probe: all $(workers_in "$PROBE_OUT" | wc -l | tr -d ' ') workers start their TPU runtime alone: the study runs per-host"
  fi
  STUDY_MODE=$mode
}
