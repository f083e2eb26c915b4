"""The shape of the project a newcomer relies on: one job per file, no file too long to read, no
import circles, torch_xla only where it belongs, a short README."""
import ast
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in PROJECT_DIR.glob("*.py"))


def imports_of(name: str) -> set[str]:
    """Every module that `name`.py imports anywhere in its text (top level or inside functions)."""
    tree = ast.parse((PROJECT_DIR / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def project_imports(name: str) -> set[str]:
    return {m for m in imports_of(name) if m in MODULES}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of a graph {module: the modules it imports}, or None."""
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[name] = "done"
        stack.pop()
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for dep in project_imports(todo.pop()) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_the_import_graph_has_no_circle():
    graph = {name: project_imports(name) for name in MODULES}
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    # The check finds a circle where there is one (predict.py importing train.py, as it once did).
    assert cycle(dict(graph, predict=graph["predict"] | {"train"})) == ["predict", "train", "predict"]


def test_model_optim_and_data_never_reach_torch_xla():
    for name in ("model", "optim", "data", "batches", "ranges", "checkpoint", "build_data", "build_arc"):
        modules = {name} | reachable(name)
        with_xla = sorted(m for m in modules if any(i.startswith("torch_xla") for i in imports_of(m)))
        assert not with_xla, f"{name}.py reaches torch_xla through {with_xla}"


def test_only_sharding_speaks_spmd():
    speakers = sorted(m for m in MODULES if any(i.startswith("torch_xla.distributed.spmd") for i in imports_of(m)))
    assert speakers == ["sharding"]


def test_no_file_is_too_long_to_read():
    lines = {p.name: len(p.read_text().splitlines()) for p in PROJECT_DIR.glob("*.py")}
    assert lines["train.py"] <= 400, lines["train.py"]
    assert {name: n for name, n in lines.items() if n > 700} == {}
    assert len((PROJECT_DIR / "README.md").read_text().splitlines()) <= 150


def test_every_doc_the_readme_links_exists_and_every_doc_is_linked():
    readme = (PROJECT_DIR / "README.md").read_text()
    docs = sorted(p.name for p in (PROJECT_DIR / "docs").glob("*.md"))
    assert docs and all(f"(docs/{name}" in readme for name in docs), docs


def test_ruff_counts_every_project_module_as_first_party():
    """ruff.toml's isort finds first-party modules in the project's root (src = ["."]) instead of
    a list that each new file had to join: every module sorts in the first-party block, after the
    third-party one, and ruff says so where one is put among the third-party imports."""
    import subprocess
    import sys

    modules = [m for m in MODULES if m.isidentifier()] + ["tests"]
    probe = str(PROJECT_DIR / "layout_probe.py")  # never written: ruff reads the text from stdin

    def sorted_right(text: str) -> bool:
        done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "I", "--no-cache",
                               "--stdin-filename", probe, "-"], input=text, capture_output=True, text=True,
                              cwd=PROJECT_DIR, timeout=60)
        assert done.returncode in (0, 1), done.stderr
        return done.returncode == 0

    first_party = "".join(f"import {m}\n" for m in sorted(modules))
    assert sorted_right(f"import os\n\nimport numpy\n\n{first_party}")
    assert not sorted_right("import os\n\nimport numpy\nimport wandb_mirror\n")  # as a third-party module


def test_the_product_cites_only_what_it_ships():
    """No shipped file points its reader at the design notes kept beside the project (a clone has
    no such file): each fact is stated where it is used, or in docs/."""
    import subprocess

    notes = "DESIGN" + ".md"  # spelled apart so that this file does not cite it either
    listed = subprocess.run(["git", "ls-files"], cwd=PROJECT_DIR, capture_output=True, text=True)
    files = listed.stdout.split() if listed.returncode == 0 else [  # not a git checkout: every file but data
        str(p.relative_to(PROJECT_DIR)) for p in PROJECT_DIR.rglob("*")
        if p.is_file() and not set(p.relative_to(PROJECT_DIR).parts) & {".git", "data", "runs", "__pycache__"}]
    assert "README.md" in files, files[:20]
    citing = []
    for name in files:
        path = PROJECT_DIR / name
        if name.startswith("tests/reference/") or not path.is_file() or path.suffix in (".png", ".gz", ".npy"):
            continue
        text = path.read_bytes().decode(errors="replace")
        citing += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if notes in line]
    assert citing == [], citing
