#!/usr/bin/env bash
# test.sh: the README's test command, and what CI runs (.ci/run): .venv created or reused
# (venv.sh), the system tools the tests need (shellcheck) installed with apt-get when missing and
# running as root, then `ruff check .` and `python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests` (three
# processes: see below). Arguments go to pytest in place of `-n 3 --dist loadfile ... tests`, in one
# process: bash test.sh tests/test_docs.py, or bash test.sh tests/test_launch.py -k dry.
# Why bash scripts and not a Makefile: see demo.sh.
set -euo pipefail
PROG=test.sh
cd "$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=venv.sh
source ./venv.sh

# ensure_tool TOOL WHY: TOOL on the PATH, else Debian's package of that name installed (as root).
ensure_tool() {
    if command -v "$1" >/dev/null; then
        return 0
    fi
    local install="install $1 ($2; Debian/Ubuntu: apt-get install $1, macOS: brew install $1) and run bash $PROG again"
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        die "$1 is missing: $install"
    fi
    say "installing $1 with apt-get ($2)"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1"; } </dev/null >/dev/null \
        || die "apt-get could not install $1 (its messages are above): $install"
    command -v "$1" >/dev/null || die "apt-get installed $1 but it is not on the PATH: $install"
}

ensure_venv
ensure_tool shellcheck "tests/test_launch.py checks the shell scripts with it"
say "ruff check ."
"$VENV/bin/python" -m ruff check .
if [ $# -eq 0 ]; then
    # The whole suite in TRM_TEST_WORKERS (default 3) pytest-xdist processes, each taking whole files
    # (a file's module fixtures, e.g. test_tpu_compile's compiles, run once): much of the suite waits
    # on subprocesses, sleeps, leases and timeouts, so three workers keep 2 cores busy where two left
    # them idle (measured 2026-11-28 on 2 cores: 31 minutes at -n 3, 1.84 cores busy on average;
    # 48 at -n 2 with the machine shared for its first half; docs/measurements.md). TRM_TEST_WORKERS=0
    # runs it in this process.
    set -- -n "${TRM_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder tests
fi
say "python -m pytest -q $*"
exec "$VENV/bin/python" -m pytest -q "$@"
