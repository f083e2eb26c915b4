"""The quick start's two commands, demo.sh and test.sh, run for real (bash, in a copy of the
repository) with a stand-in Python that records its calls instead of installing 4 GB: the first run
creates .venv and installs, the next ones reuse it, a change to either requirements file installs
again, a failed pip says why and is redone next time, a Python older than 3.10 is refused, and a
shellcheck that cannot be installed stops the tests with what to install."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

PROJECT_DIR = Path(__file__).resolve().parent.parent
QUICK_START_FILES = ("demo.sh", "test.sh", "venv.sh", "requirements.txt", "requirements-test.txt", ".ci/run")
INSTALL = "-m pip install --disable-pip-version-check -r requirements-test.txt"
# python3 and, copied by `-m venv`, the venv's python: each call recorded, the few the scripts make
# acted out (the version query, venv creation, pip, which fails with $STUB_PIP_ERROR when set).
STAND_IN_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$*" >>"$STUB_CALLS"
case "$1 $2" in
    "-c "*) echo "${STUB_PYTHON_VERSION:-3.11}" ;;
    "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
    "-m pip") if [ -n "${STUB_PIP_ERROR:-}" ]; then echo "$STUB_PIP_ERROR"; exit 1; fi ;;
esac
"""
# What the scripts (and the stand-ins' shebangs) need on the PATH, when the PATH is only these.
SCRIPT_TOOLS = ("bash", "cat", "cp", "cut", "dirname", "grep", "id", "mkdir", "rm", "sha256sum", "tee", "uname")


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


class StandInClone:
    """A copy of the quick start's files in DIR/clone, run with DIR/bin (python3, shellcheck
    stand-ins) first on the PATH."""

    def __init__(self, tmp: Path):
        self.dir = tmp / "clone"
        for name in QUICK_START_FILES:
            (self.dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT_DIR / name, self.dir / name)
        self.bin = tmp / "bin"
        self.bin.mkdir()
        executable(self.bin / "python3", STAND_IN_PYTHON)
        executable(self.bin / "shellcheck", "#!/usr/bin/env bash\n")
        self.calls_file = tmp / "calls"
        self.calls_file.touch()
        env = {k: v for k, v in os.environ.items() if k not in ("VENV", "PYTHON")}
        self.env = {**env, "PATH": f"{self.bin}:{os.environ['PATH']}", "STUB_CALLS": str(self.calls_file)}

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", script, *args], cwd=self.dir, env={**self.env, **env}, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=60)

    def calls(self) -> list[str]:
        """The stand-in Python's calls since the last look, without the version queries."""
        calls = [c for c in self.calls_file.read_text().splitlines() if not c.startswith("-c ")]
        self.calls_file.write_text("")
        return calls


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_first_run_installs_the_next_reuse_and_a_changed_requirements_file_installs_again(tmp_path):
    clone = StandInClone(tmp_path)
    out = ok(clone.run("demo.sh"))
    assert clone.calls() == ["-m venv .venv", INSTALL, "train.py demo"]
    assert "demo.sh: creating .venv with python3 (Python 3.11)\n" in out
    assert out.endswith("demo.sh: training the demo: .venv/bin/python train.py demo (2-5 minutes on 2 cores)\n")
    assert "demo.sh: installing requirements-test.txt into .venv (about 4 GB" in out

    out = ok(clone.run("test.sh"))
    assert clone.calls() == ["-m ruff check .", "-m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests"]
    assert "test.sh: reusing .venv (requirements unchanged since its last install)\n" in out
    ok(clone.run("demo.sh", "--help"))
    assert clone.calls() == ["train.py demo --help"]

    for changed in ("requirements-test.txt", "requirements.txt"):  # the lead adds to either
        with open(clone.dir / changed, "a") as f:
            f.write("jax==0.4.0\n")
        out = ok(clone.run("test.sh", "tests/test_docs.py", "-k", "quick start"))
        assert clone.calls() == [INSTALL, "-m ruff check .", "-m pytest -q tests/test_docs.py -k quick start"], changed
        assert "(requirements*.txt changed since its last install)" in out
        ok(clone.run("test.sh"))
        assert INSTALL not in clone.calls()


@pytest.mark.parametrize("pip_error,said", [
    ("WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(': Failed to establish "
     "a new connection: [Errno -3] Temporary failure in name resolution')'",
     "pip could not reach the package index (pip's messages are above and in .venv/pip-install.log): check the "
     "network, a proxy (HTTPS_PROXY) or PIP_INDEX_URL, then run bash demo.sh again"),
    ("ERROR: No matching distribution found for torch_xla==2.9.0",
     "pip found no version of a pinned package for Python 3.11 on"),
    ("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device",
     "the disk is full (pip's messages are above and in .venv/pip-install.log): the environment takes about 9 GB"),
])
def test_a_failed_install_says_why_and_is_redone_next_time(tmp_path, pip_error, said):
    clone = StandInClone(tmp_path)
    result = clone.run("demo.sh", STUB_PIP_ERROR=pip_error)
    assert result.returncode == 1 and f"demo.sh: {said}" in result.stderr, result.stderr
    assert clone.calls() == ["-m venv .venv", INSTALL]   # the demo does not start
    ok(clone.run("demo.sh"))
    assert clone.calls() == [INSTALL, "train.py demo"]


def test_a_python_older_than_3_10_is_refused(tmp_path):
    clone = StandInClone(tmp_path)
    result = clone.run("test.sh", STUB_PYTHON_VERSION="3.9")
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith("test.sh: python3 is Python 3.9; the project needs 3.10 or newer: install "), \
        result.stderr
    assert "run PYTHON=python3.11 bash test.sh" in result.stderr
    assert clone.calls() == [] and not (clone.dir / ".venv").exists()
    result = clone.run("demo.sh", PYTHON="python3.42")
    assert result.returncode == 1 and "demo.sh: python3.42 was not found or does not run: install" in result.stderr

    ok(clone.run("demo.sh", PYTHON=str(clone.bin / "python3"), STUB_PYTHON_VERSION="3.10"))
    assert clone.calls() == ["-m venv .venv", INSTALL, "train.py demo"]
    result = clone.run("demo.sh", STUB_PYTHON_VERSION="3.9")   # a venv made by an old Python since
    assert result.returncode == 1 and "demo.sh: .venv has Python 3.9; the project needs 3.10" in result.stderr


def test_a_missing_shellcheck_that_apt_get_cannot_install_stops_the_tests(tmp_path):
    clone = StandInClone(tmp_path)
    ok(clone.run("demo.sh"))
    (clone.bin / "shellcheck").unlink()
    for tool in SCRIPT_TOOLS:
        (clone.bin / tool).symlink_to(shutil.which(tool))
    executable(clone.bin / "apt-get", '#!/usr/bin/env bash\necho "apt-get $*" >>"$STUB_CALLS"\n'
               'echo "E: Unable to locate package shellcheck" >&2; exit 100\n')
    clone.calls()
    result = clone.run("test.sh", PATH=str(clone.bin))
    assert result.returncode == 1, result.stdout
    assert "install shellcheck (tests/test_launch.py checks the shell scripts with it; Debian/Ubuntu: apt-get " \
           "install shellcheck, macOS: brew install shellcheck) and run bash test.sh again" in result.stderr
    if os.geteuid() == 0:   # CI's case: apt-get tried first
        assert "test.sh: apt-get could not install shellcheck" in result.stderr
        assert clone.calls() == ["apt-get update -qq"]
    else:
        assert "test.sh: shellcheck is missing" in result.stderr
        assert clone.calls() == []


def test_shellcheck_quick_start_scripts():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; test.sh installs it)")
    result = subprocess.run(["shellcheck", "-x", "demo.sh", "test.sh", "venv.sh", ".ci/run"],
                            capture_output=True, text=True, cwd=PROJECT_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
