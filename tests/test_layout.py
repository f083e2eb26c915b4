"""The shape of the project a newcomer relies on: the card's scripts and the entry points at the
top, the library in packages by family, families importing downward only, no import circles,
torch_xla only where it belongs."""
import ast
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent.parent
TOP = ("train", "model", "data", "sharding", "study", "build_data", "bench", "tpu_compile")
"""What stays at the top: the design card's files and the entry points users run."""
PACKAGES = ("rundir", "modeling", "puzzles", "testtime", "training", "reference", "commands", "tpu_costs",
            "fleet", "pod")
FLOORS = {
    "rundir": 0,                                   # files at any URL, a run directory's contract
    "modeling": 1, "data": 1,                      # the model's internals; the dataset and its batches
    "model": 2, "puzzles": 2, "sharding": 2,       # TRM; ARC's grids; the only torch_xla SPMD speaker
    "testtime": 3,                                 # test-time compute: settings, K trajectories, curve
    "training": 4,                                 # the loop's parts: config, trainer, checkpoints, ...
    "reference": 5,                                # the reference's formats
    "commands": 6,                                 # restore, eval, export, predict
    "tpu_costs": 7,                                # the TPU cost model
    "fleet": 8, "pod": 8,                          # studies over a fleet; the pod's shell helpers
    "train": 9, "study": 9, "build_data": 9, "bench": 9, "tpu_compile": 9,   # entry points
}
"""Each family's floor: a module imports modules of its own family or of a lower floor, never a
higher one or another family of its own floor."""


def _modules() -> dict[str, Path]:
    found = {p.stem: p for p in PROJECT_DIR.glob("*.py")}
    for package in PACKAGES:
        found.update({f"{package}.{p.stem}": p for p in (PROJECT_DIR / package).glob("*.py") if p.stem != "__init__"})
    return found


MODULE_FILES = _modules()
MODULES = sorted(MODULE_FILES)


def family(module: str) -> str:
    return module.split(".")[0]


def imports_of(name: str) -> set[str]:
    """Every module that module `name` imports anywhere in its text (top level or inside functions),
    `from package import module` read as the module."""
    tree = ast.parse(MODULE_FILES[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULE_FILES)
    return found


def project_imports(name: str) -> set[str]:
    return {m for m in imports_of(name) if m in MODULE_FILES and m != name}


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
    """Every project module that `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for dep in project_imports(todo.pop()) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_the_top_holds_the_card_and_the_entry_points_and_every_module_has_a_family():
    assert sorted(p.stem for p in PROJECT_DIR.glob("*.py")) == sorted(TOP)
    assert len(TOP) <= 16
    packages = sorted(p.parent.name for p in PROJECT_DIR.glob("*/__init__.py") if p.parent.name != "tests")
    assert packages == sorted(PACKAGES), "a new package needs its floor in FLOORS"
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((PROJECT_DIR / package / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"{package}/__init__.py says what its family does"
    assert {family(m) for m in MODULES} <= set(FLOORS)


def test_the_import_graph_has_no_circle():
    graph = {name: project_imports(name) for name in MODULES}
    assert cycle(graph) is None, " -> ".join(cycle(graph))
    # The check finds a circle where there is one (predict importing train, as it once did).
    assert cycle(dict(graph, **{"commands.predict": graph["commands.predict"] | {"train"}})) == [
        "commands.predict", "train", "commands.predict"]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a higher floor, or of another family on the same floor."""
    bad = []
    for name, deps in graph.items():
        for dep in sorted(deps):
            if family(dep) != family(name) and FLOORS[family(dep)] >= FLOORS[family(name)]:
                bad.append(f"{name} imports {dep} ({family(dep)} is on floor {FLOORS[family(dep)]}, "
                           f"{family(name)} on {FLOORS[family(name)]})")
    return bad


def test_families_import_downward_only():
    graph = {name: project_imports(name) for name in MODULES}
    assert upward_imports(graph) == []
    # The check finds what it is for: the model reaching the fleet, a run's log reaching the cost model.
    assert upward_imports(dict(graph, model=graph["model"] | {"fleet.claims"})) == [
        "model imports fleet.claims (fleet is on floor 8, model on 2)"]
    assert len(upward_imports(dict(graph, **{"training.run_log": {"tpu_costs.run_costs"}}))) == 1


def test_model_imports_torch_and_its_own_package_only():
    assert {family(m) for m in project_imports("model")} <= {"modeling"}
    outside = {i.split(".")[0] for i in imports_of("model")} - {"modeling", "torch", "__future__", "dataclasses",
                                                               "math", "typing", "collections"}
    assert outside == set(), outside


def test_the_label_the_loss_skips_is_the_one_the_batches_write():
    """model.py does not import data.py (the model's package alone): each states the value."""
    import data
    import model

    assert model.IGNORE_LABEL_ID == data.IGNORE_LABEL_ID == -100


def test_the_optimizers_config_accepts_are_the_ones_optim_builds():
    """config.py names the optimizer choices itself (it imports no optim.py for one name)."""
    from training import config, optim

    assert config.DENSE_OPTIMIZERS == optim.DENSE_OPTIMIZERS
    assert "training.optim" not in project_imports("training.config")


def test_model_optim_and_data_never_reach_torch_xla():
    for name in ("model", "training.optim", "data", "modeling.field_ranges", "training.checkpoint", "build_data",
                 "puzzles.build_arc", "rundir.storage"):
        modules = {name} | reachable(name)
        with_xla = sorted(m for m in modules if any(i.startswith("torch_xla") for i in imports_of(m)))
        assert not with_xla, f"{name} reaches torch_xla through {with_xla}"


def test_only_sharding_speaks_spmd():
    speakers = sorted(m for m in MODULES if any(i.startswith("torch_xla.distributed.spmd") for i in imports_of(m)))
    assert speakers == ["sharding"]


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

    modules = [m for m in MODULES if "." not in m] + list(PACKAGES) + ["tests"]
    probe = str(PROJECT_DIR / "layout_probe.py")  # never written: ruff reads the text from stdin

    def sorted_right(text: str) -> bool:
        done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "I", "--no-cache",
                               "--stdin-filename", probe, "-"], input=text, capture_output=True, text=True,
                              cwd=PROJECT_DIR, timeout=60)
        assert done.returncode in (0, 1), done.stderr
        return done.returncode == 0

    first_party = "".join(f"import {m}\n" for m in sorted(modules))
    assert sorted_right(f"import os\n\nimport numpy\n\n{first_party}")
    assert not sorted_right("import os\n\nimport numpy\nimport training\n")  # as a third-party module


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


def test_the_suites_longest_files_first_are_files_of_the_suite():
    """tests/conftest.py's LONGEST_FIRST orders test.sh's workers; a renamed file left in it would
    silently start late."""
    tests_dir = Path(__file__).resolve().parent
    [LONGEST_FIRST] = [ast.literal_eval(node.value) for node in ast.parse((tests_dir / "conftest.py").read_text()).body
                       if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LONGEST_FIRST"]
    assert [name for name in LONGEST_FIRST if not (tests_dir / name).is_file()] == []
