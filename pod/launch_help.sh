# launch_help.sh: the usage of launch.sh and of each of its commands (`bash launch.sh COMMAND
# --help`), sourced by launch.sh; docs/pod.md, "What each command does", explains the commands.
# shellcheck shell=bash

usage_main() {
  cat <<'EOF'
usage: bash launch.sh [SETTINGS] COMMAND [OPTIONS] [ARGS]

Run TRM on a Cloud TPU slice from your laptop (gcloud). Commands, in the order of a first run:
  create       create the TPU VM slice (--queued: as a queued resource) and the bucket, if missing
  setup        install the pinned requirements (torch_xla[tpu]) in ~/trm-venv on every worker
  deploy       ship the tracked code to ~/trm on every worker and compare code hashes
  check        preflight on every worker: TPU, versions, device count, bucket, dataset
  smoke        smoke [PRESET]: minutes on the slice that check what a CPU could not, one table
  train        train RUN_NAME PRESET [train.py flags...]: start train.py on every worker
  study        study STUDY_NAME STUDY_FILE: claim a study's runs one at a time (several VMs: one study)
  status       the TPU's state and each worker's trainer
  logs         logs [WORKER|all]: follow one worker's log (--from-bucket: the copies in the bucket)
  stop         SIGTERM the trainers (they save a checkpoint, then exit)
  tensorboard  print (or --start) the TensorBoard command for a run's tb/ (--study NAME: a study's)
  delete       delete the TPU VM slice and its queued resource (the bucket stays)

Settings (flags before the run name, or environment variables):
  --tpu NAME (TRM_TPU)   --zone ZONE (TRM_ZONE)   --project ID (TRM_PROJECT)
  --bucket NAME (TRM_BUCKET)   --data gs://... (TRM_DATA)
  --dry-run      print every gcloud command instead of running it
A fleet (any command, each VM in turn, a line per VM; study/train --retry and logs: all at once):
  --count N      the VMs TPU-0 ... TPU-(N-1) (create makes them)
  --fleet NAME[@ZONE],... (TRM_FLEET)   named VMs, in their own zones, of any accelerator type

`bash launch.sh COMMAND --help` lists a command's flags. README.md walks through a first run,
docs/pod.md says what each command does, docs/studies.md runs a study.
EOF
}

usage_create() {
  cat <<'EOF'
usage: bash launch.sh create [--accelerator TYPE] [--runtime-version V] [--spot] [--queued] [--count N] [--dry-run]

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

usage_smoke() {
  cat <<'EOF'
usage: bash launch.sh smoke [--steps N] [--dry-run] [PRESET [train.py flags...]]

Minutes on your slice that check what a CPU could not, once after check and before the first
real run: one table of what was assumed beside what this slice shows, written with the raw
answers to gs://BUCKET/smoke/TIME/smoke.md and smoke.json (attach them to a bug report). PRESET
(default sudoku-mlp) and the flags go to train.py (--data.path defaults to --data / TRM_DATA);
--steps N (TRM_SMOKE_STEPS, default 300) is each run's length. Exit 1 when a check fails. Lines:

  runtime          device kind, device count and each host's device ids (run A's log): FAIL when
                   fewer hosts joined than the slice has
  host group       the hosts met over gloo and agreed on one configuration: FAIL means no TCP
                   between the VMs on port 12355 (check shows it) or differing code or flags
  mesh self-check  each host's rows land on its own devices: FAIL = the host-ordered mesh does not
                   hold on this slice (please report it); nothing can train correctly
  step time        run A's host ms/step (wall time, median) beside the compiler's estimate
                   (tpu_compile.py, when this checkout has it); device ms/step: not measured
                   (a profile shows it); "no TPU" on a CPU. FAIL: run A did not finish
  MFU              measured on a TPU of a known kind; else "no TPU" or unknown
  compile          what the compile cache did and the compile time (train.py's lines)
  stop and resume  run B gets SIGTERM half way (launch.sh stop), saves, resumes: FAIL when no
                   save, no resume, or its next 5 losses differ from run A's (not deterministic)
  bucket           each worker writes, reads and removes TRM_SMOKE_MB MB (default 64) in the
                   bucket at once: MB/s, or FAIL with the error
Needs --tpu, --zone, --project, --bucket, deployed code, no run on the slice.
More: docs/pod.md, "smoke".
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
usage: bash launch.sh study [--retry] [--queued] [--poll SECONDS] [--max-restarts N] [--dry-run]
                            [--count N | --fleet NAME[@ZONE],...] STUDY_NAME STUDY_FILE

A study's runs (STUDY_FILE: one run per line, NAME PRESET [train.py flags...]; docs/studies.md)
into gs://BUCKET/studies/STUDY_NAME/NAME, with `study.py run --holder TPU@ZONE` on every worker: the VM
claims the next unfinished run (longest first) in the study directory, trains it over the whole
slice (on a multi-host slice worker 0 claims), and claims the next. The VMs of a fleet
(--count N, --fleet) running the same STUDY_NAME share its runs; a VM's run whose lease goes
stale (preempted) is taken over by another, and --retry watches each VM on its own. The study file goes with the command. The same STUDY_NAME
again skips finished runs and resumes started ones.

  --retry              watch and relaunch as train --retry does (a preempted slice is created
                       again; finished runs are skipped, started ones resume)
  --queued, --poll, --max-restarts: as for train

Each worker's study.py exits 0 when every run is done or failed (failed runs are recorded),
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
