# venv.sh: the Python environment of demo.sh and test.sh (sourced by both, from the repository's
# root, after `set -euo pipefail` and setting PROG to their name).
# shellcheck shell=bash
#
# ensure_venv creates $VENV (default .venv) with $PYTHON (default python3; Python 3.10 or newer)
# when it is missing, then installs requirements-test.txt into it (it includes requirements.txt),
# unless the stamp in $VENV holds the hash of both files as they were at the last install that
# succeeded: quick when nothing changed, a new `pip install -r` when either file did. The stamp is
# removed before pip runs and written only after pip succeeds, so an interrupted or failed install
# is redone next time. Each phase prints one line; each failure says what to do and exits 1.
#
#   VENV=~/venvs/trm bash test.sh        # another place (a path relative to the repository, or absolute)
#   PYTHON=python3.11 bash demo.sh       # another interpreter (used only to create $VENV)

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
readonly MIN_PYTHON_MINOR=10              # Python 3.10: the TPU VM images' Python (ruff.toml's target)
readonly REQUIREMENTS=(requirements.txt requirements-test.txt)   # every file requirements-test.txt reads
readonly STAMP=$VENV/.trm-requirements.sha256
readonly PIP_LOG=$VENV/pip-install.log

say() { printf '%s: %s\n' "$PROG" "$*"; }
die() { printf '%s: %s\n' "$PROG" "$*" >&2; exit 1; }

# python_version INTERPRETER: its "major.minor" in PYTHON_VERSION; fails if it does not run or is
# older than 3.10.
python_version() {
    local major minor
    PYTHON_VERSION=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || return 1
    IFS=. read -r major minor <<<"$PYTHON_VERSION"
    [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge "$MIN_PYTHON_MINOR" ]; }
}

readonly INSTALL_PYTHON="install Python 3.$MIN_PYTHON_MINOR or newer (e.g. apt-get install python3.11 python3.11-venv, or pyenv)"

requirements_hash() { cat "${REQUIREMENTS[@]}" | sha256sum | cut -d' ' -f1; }

# pip_failed: the reason pip failed, from its log, and what to do about it.
pip_failed() {
    local shown="pip's messages are above and in $PIP_LOG"
    if grep -qE 'NewConnectionError|ProxyError|SSLError|ConnectTimeoutError|ReadTimeoutError|Max retries exceeded|Temporary failure in name resolution|Network is unreachable|Connection refused' "$PIP_LOG"; then
        die "pip could not reach the package index ($shown): check the network, a proxy (HTTPS_PROXY) or PIP_INDEX_URL, then run bash $PROG again"
    elif grep -q 'No space left on device' "$PIP_LOG"; then
        die "the disk is full ($shown): the environment takes about 9 GB; free some space and run bash $PROG again"
    elif grep -qE 'No matching distribution|Could not find a version' "$PIP_LOG"; then
        die "pip found no version of a pinned package for Python $PYTHON_VERSION on $(uname -m) ($shown); if the index was unreachable, check the network, a proxy (HTTPS_PROXY) or PIP_INDEX_URL, then run bash $PROG again"
    fi
    die "pip install -r requirements-test.txt failed ($shown); fix what it names and run bash $PROG again"
}

ensure_venv() {
    if [ -e "$VENV" ]; then
        if ! python_version "$VENV/bin/python"; then
            [ -n "$PYTHON_VERSION" ] || die "$VENV exists but $VENV/bin/python does not run (its Python was removed?): rm -rf $VENV and run bash $PROG again"
            die "$VENV has Python $PYTHON_VERSION; the project needs 3.$MIN_PYTHON_MINOR or newer: rm -rf $VENV, $INSTALL_PYTHON and run PYTHON=python3.11 bash $PROG"
        fi
    else
        if ! python_version "$PYTHON"; then
            [ -n "$PYTHON_VERSION" ] || die "$PYTHON was not found or does not run: $INSTALL_PYTHON, or name one with PYTHON=python3.11 bash $PROG"
            die "$PYTHON is Python $PYTHON_VERSION; the project needs 3.$MIN_PYTHON_MINOR or newer: $INSTALL_PYTHON and run PYTHON=python3.11 bash $PROG"
        fi
        say "creating $VENV with $PYTHON (Python $PYTHON_VERSION)"
        if ! "$PYTHON" -m venv "$VENV"; then
            rm -rf -- "$VENV"   # made by this call only: a half-made venv would pass for a real one next time
            die "$PYTHON -m venv $VENV failed (above): on Debian/Ubuntu install the venv module (apt-get install python3-venv, or python3.11-venv for PYTHON=python3.11) and run bash $PROG again"
        fi
    fi
    local wanted
    wanted=$(requirements_hash)
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ]; then
        say "reusing $VENV (requirements unchanged since its last install)"
        return 0
    fi
    if [ -f "$STAMP" ]; then
        say "installing requirements-test.txt into $VENV (requirements*.txt changed since its last install)"
    else
        say "installing requirements-test.txt into $VENV (about 4 GB of downloads the first time; minutes)"
    fi
    rm -f -- "$STAMP"
    if ! "$VENV/bin/python" -m pip install --disable-pip-version-check -r requirements-test.txt 2>&1 | tee "$PIP_LOG"; then
        pip_failed
    fi
    printf '%s\n' "$wanted" >"$STAMP"
    say "installed; $VENV is reused until requirements*.txt change"
}
