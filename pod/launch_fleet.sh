# launch_fleet.sh: a fleet of TPU VMs named together, sourced by launch.sh. `--count N` names
# TPU-0..TPU-(N-1) (TPU: --tpu or TRM_TPU; create makes them, of --accelerator in --zone);
# `--fleet NAME[@ZONE],NAME[@ZONE],...` (TRM_FLEET) names existing VMs, whose zones and
# accelerator types may differ. Any command then runs launch.sh once per VM, each VM's lines
# prefixed [NAME], and goes on past a VM that fails; the last line names the VMs that failed
# (exit 1 if any did). study and train with --retry, and logs that follow, run on every VM at
# once, each VM watched on its own (a preempted VM is recreated and its study relaunched while
# the others keep training). --queued makes a queued resource per VM (gcloud's --node-count
# provisions nodes together, all or none, and cannot recreate one of them alone).
# shellcheck shell=bash

FLEET_SPEC=${TRM_FLEET:-}   # --fleet NAME[@ZONE],...
COUNT=""                    # --count N
FLEET=()                    # the VMs: NAME or NAME@ZONE

# fleet_members: FLEET from --count or --fleet (none: one VM, as without this file).
fleet_members() {
  local entry entries=() i seen
  FLEET=()
  if [ -n "$COUNT" ]; then
    case $COUNT in ''|*[!0-9]*|0) usage_error "--count takes a number of VMs (1 or more), not '$COUNT'" ;; esac
    [ -z "$FLEET_SPEC" ] || usage_error "--count or --fleet, not both (--count names TPU-0..TPU-(N-1))"
    [ -n "$TPU" ] || usage_error "--count names the VMs TPU-0..TPU-(N-1): set --tpu or TRM_TPU"
    for ((i = 0; i < COUNT; i++)); do FLEET+=("$TPU-$i"); done
  elif [ -n "$FLEET_SPEC" ]; then
    IFS=, read -r -a entries <<< "$FLEET_SPEC"
    for entry in "${entries[@]}"; do
      case ${entry%%@*} in
        ''|-*|*[!a-z0-9-]*) usage_error "--fleet: '$entry' is not NAME or NAME@ZONE (a TPU name: lower-case letters, digits, '-')" ;;
      esac
      for seen in "${FLEET[@]}"; do   # one VM named twice would hold its study claims twice over
        [ "$(fleet_vm "$seen")" != "$(fleet_vm "$entry")" ] || \
          usage_error "--fleet names the VM $(fleet_vm "$entry") twice ('$seen' and '$entry'): name each VM once"
      done
      FLEET+=("$entry")
    done
  fi
}

# fleet_vm ENTRY: NAME@ZONE, the zone --zone's when the entry names none (a VM's holder name in studies).
fleet_vm() {
  case $1 in *@*) printf '%s' "$1" ;; *) printf '%s@%s' "$1" "$ZONE" ;; esac
}

# fleet_prefix NAME: each line of stdin as [NAME] LINE.
fleet_prefix() {
  local line
  while IFS= read -r line || [ -n "$line" ]; do printf '[%s] %s\n' "$1" "$line"; done
}

# fleet_one ENTRY ARGS...: launch.sh ARGS on the one VM ENTRY (NAME or NAME@ZONE); its stderr
# prefixed, its stdout too (under --dry-run as it is, after a `# VM NAME` line: the calls).
fleet_one() {
  local entry=$1 name=${1%%@*} zone=""
  [ "$entry" = "$name" ] || zone=${entry#*@}
  shift
  if dry; then
    printf '# VM %s\n' "$name"
    TRM_FLEET_VM=$name TRM_FLEET_ZONE=$zone bash "$REPO/launch.sh" "$@" 2> >(fleet_prefix "$name" >&2)
  else
    TRM_FLEET_VM=$name TRM_FLEET_ZONE=$zone bash "$REPO/launch.sh" "$@" 2> >(fleet_prefix "$name" >&2) \
      | fleet_prefix "$name"
    return "${PIPESTATUS[0]}"
  fi
}

# fleet_run ARGS...: launch.sh ARGS (as given, less nothing: each VM's launch.sh ignores the fleet
# flags) on every VM of FLEET; a line per VM at the end; exit 1 when a VM failed.
fleet_run() {
  local entry rc at_once=0 failed=() passed=() pids=() names=() i
  [ "$CMD" != tensorboard ] || usage_error "tensorboard reads the bucket, not the VMs: leave out --count/--fleet"
  case $CMD in
    study|train) [ "$RETRY" = 0 ] || at_once=1 ;;
    logs) [ "$FOLLOW" = 0 ] || at_once=1 ;;
  esac
  dry && at_once=0
  info "fleet: $CMD on ${#FLEET[@]} VMs: ${FLEET[*]%%@*}$([ "$at_once" = 1 ] && echo ', each on its own, at once')"
  for entry in "${FLEET[@]}"; do
    if [ "$at_once" = 1 ]; then
      fleet_one "$entry" "$@" &
      pids+=("$!") names+=("${entry%%@*}")
      continue
    fi
    rc=0
    fleet_one "$entry" "$@" || rc=$?
    if [ "$rc" = 0 ]; then passed+=("${entry%%@*}"); else failed+=("${entry%%@*} (exit $rc)"); fi
  done
  for i in "${!pids[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    if [ "$rc" = 0 ]; then passed+=("${names[$i]}"); else failed+=("${names[$i]} (exit $rc)"); fi
  done
  if [ ${#failed[@]} -gt 0 ]; then
    info "fleet: $CMD ok on ${#passed[@]} of ${#FLEET[@]} VMs; failed on: $(join_by , "${failed[@]}")"
    return 1
  fi
  info "fleet: $CMD ok on all ${#FLEET[@]} VMs"
}
