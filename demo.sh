#!/usr/bin/env bash
# demo.sh: the README's first command on a fresh clone: .venv created or reused (venv.sh), then
# `train.py demo`, a tiny TRM on 4x4 Sudoku on a virtual 8-device CPU mesh. Arguments go to
# train.py demo (bash demo.sh --help lists its settings).
#
# Two small bash scripts rather than a Makefile: bash is on every Linux machine and make is not
# (minimal images lack it), arguments pass straight through (bash test.sh tests/test_docs.py),
# and the project's other commands are bash scripts too (launch.sh, worker.sh).
set -euo pipefail
PROG=demo.sh
cd "$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=venv.sh
source ./venv.sh

ensure_venv
say "training the demo: $VENV/bin/python train.py demo${*:+ $*} (2-5 minutes on 2 cores)"
exec "$VENV/bin/python" train.py demo "$@"
