"""The package's import graph: no circles, and no room imports a room to its right in the flow
config <- data <- models <- train <- evaluate <- bench <- scaling <- analysis <- study <-
decoder_only <- cli, nor, inside study/, a sub-room one to its right in
plan <- record <- report <- run;
and what makes code hard to read: no function over 60 lines, no formatter escape packing lines,
no private name used from another module.

Every import counts, including those inside functions (a deferred import is still a
dependency, and deferring one is how a circle hides), `if TYPE_CHECKING:` ones too.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "scalestudy"
# The flow of rooms, left to right; a module may import only its own room and rooms to its left.
# A room is a package under scalestudy/; the package's own __init__ counts as config.
ROOMS = (
    "config",
    "data",
    "models",
    "train",
    "evaluate",
    "bench",
    "scaling",
    "analysis",
    "study",
    "decoder_only",
    "cli",
)
ROOM_OF = {
    "__init__": "config",
}
# Rooms placed in the flow by what they serve.
EXTRA_RANK: dict[str, int] = {}
# Circles known and still to be opened: allowed until they are gone; then delete the entry.
KNOWN_CIRCLES: list[set[str]] = []


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Names of scalestudy modules `path` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "scalestudy"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            if module.split(".")[0] != "scalestudy":
                continue
            found.add(module)
            # `from scalestudy.scaling import laws` imports the module scalestudy.scaling.laws.
            found |= {f"{module}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in _imports(path, name) if m in files and m != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    return ROOM_OF.get(first, first)


def _rank(room: str) -> int:
    if room in ROOMS:
        return ROOMS.index(room)
    if room in EXTRA_RANK:
        return EXTRA_RANK[room]
    pytest.fail(
        f"room {room!r} has no place in the flow; add it to ROOMS or EXTRA_RANK in "
        "tests/test_layout.py, where the modules it serves and uses put it"
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component larger than a module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_finds_the_package_and_its_imports():
    graph = _graph()
    assert "scalestudy.cli.main" in graph and "scalestudy.scaling.laws" in graph
    assert "scalestudy.cli.commands" in graph["scalestudy.cli.main"]
    assert any(m.startswith("scalestudy.study") for m in graph["scalestudy.cli.commands"])


def test_cycles_are_found_when_present():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    cycles = [c for c in _cycles(_graph()) if set(c) not in KNOWN_CIRCLES]
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_room_imports_a_room_to_its_right():
    upward = []
    for module, deps in sorted(_graph().items()):
        for dep in sorted(deps):
            if _rank(_room(dep)) > _rank(_room(module)):
                upward.append(f"{module} imports {dep}")
    assert not upward, "imports against the flow " + " <- ".join(ROOMS) + ":\n" + "\n".join(upward)


# Inside study/, its own rooms in a flow of their own, left to right: the spec and what follows
# from it alone, what is recorded and read back, the report, and the main job that runs it all
# (and so imports the report). The study package's own __init__ counts as plan.
STUDY_ROOMS = ("plan", "record", "report", "run")


def _study_room(module: str) -> str | None:
    """The study room of `module`; None outside study/."""
    parts = module.split(".")
    if parts[:2] != ["scalestudy", "study"]:
        return None
    room = parts[2] if len(parts) > 2 else "plan"
    if room not in STUDY_ROOMS:
        pytest.fail(
            f"{module} is in no room of study/ ({', '.join(STUDY_ROOMS)}); put it in the room "
            "whose flow it follows, or add the room to STUDY_ROOMS in tests/test_layout.py"
        )
    return room


def _against_study_flow(graph: dict[str, set[str]]) -> list[str]:
    """ "A imports B" for each module A of study/ importing a module B of a study room to A's
    room's right."""
    found = []
    for module, deps in sorted(graph.items()):
        room = _study_room(module)
        if room is None:
            continue
        for dep in sorted(deps):
            other = _study_room(dep)
            if other is not None and STUDY_ROOMS.index(other) > STUDY_ROOMS.index(room):
                found.append(f"{module} imports {dep}")
    return found


def test_study_rooms_against_their_flow_are_found_when_present():
    graph = {
        "scalestudy.study": {"scalestudy.study.record.registry"},
        "scalestudy.study.plan.recipe": set(),
        "scalestudy.study.plan.spec": {"scalestudy.study.run.stages"},
        "scalestudy.study.record.registry": {"scalestudy.study.plan.recipe"},
        "scalestudy.study.report.page": {"scalestudy.study.record.registry"},
        "scalestudy.study.run.stages": {"scalestudy.study.plan.spec", "scalestudy.config.base"},
        "scalestudy.cli.main": {"scalestudy.study.run.stages"},
    }
    assert _against_study_flow(graph) == [
        "scalestudy.study imports scalestudy.study.record.registry",
        "scalestudy.study.plan.spec imports scalestudy.study.run.stages",
    ]


def test_study_rooms_import_only_rooms_to_their_left():
    graph = _graph()
    assert "scalestudy.study.record.registry" in graph["scalestudy.study.report.page"]
    upward = _against_study_flow(graph)
    assert not upward, (
        "imports against study/'s flow " + " <- ".join(STUDY_ROOMS) + ":\n" + "\n".join(upward)
    )


# What makes code hard to read, checked instead of a module line cap: a module is as long as its
# one concern needs (docs/layout.md says what each room owns).
MAX_FUNCTION_LINES = 60


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path, node


def test_no_function_over_60_lines():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.name} ({node.end_lineno - node.lineno + 1})"
        for path, node in _functions()
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (docstring included): {', '.join(long)}; "
        "split each into helpers that do one thing"
    )


def test_no_formatter_escape_packs_lines():
    packed = [
        f"{path.relative_to(PACKAGE.parent)}:{i}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert not packed, "formatter escapes (let the formatter lay the code out): " + ", ".join(
        packed
    )


def _private_reaches(path: Path) -> list[str]:
    """`from scalestudy.x import _name` and `module._name` on an imported scalestudy module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scalestudy"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"from {node.module} import {a.name}")
                modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):  # `import scalestudy.x.y as y`
            modules |= {
                a.asname for a in node.names if a.name.startswith("scalestudy.") and a.asname
            }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_private_reaches_are_found_when_present(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "import os\nfrom scalestudy.study import executors\nfrom scalestudy.x import _y, z\n"
        "executors._unfinished()\nz.public()\nos._exit(0)\n"
    )
    assert _private_reaches(sample) == ["from scalestudy.x import _y", "executors._unfinished"]


def test_no_private_name_is_used_from_another_module():
    reaches = [
        f"{path.relative_to(PACKAGE.parent)}: {r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for r in _private_reaches(path)
    ]
    assert not reaches, (
        "private names used from another module (make the name public where it is defined, "
        "or move the code that needs it): " + "; ".join(reaches)
    )


# A Markdown table's separator row (`|---|`, `---|`, `|:---:|`) at the start of a string literal.
SEPARATOR = r"^\|?\s*:?-{3,}:?\s*\|"
# Modules that may write one: the renderer, and a module in a room left of scaling/ that
# cannot import it (evaluate/blimp.py's reference table).
SEPARATOR_WRITERS = {"scaling/render.py", "evaluate/blimp.py"}


def test_separator_literals_are_found_when_present(tmp_path):
    (tmp_path / "m.py").write_text(
        'A = ["| a |", "|---|---|"]\nB = "|" + "---|" * 2\nC = "--- x"\n'
    )
    found = _separator_literals_in(tmp_path / "m.py", tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == ["m.py:1", "m.py:2"]


def _separator_literals_in(path: Path, root: Path) -> list[str]:
    import re

    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(root)}:{node.lineno}: {node.value[:40]!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and any(re.match(SEPARATOR, line.strip()) for line in node.value.splitlines())
    ]


def test_only_the_renderer_writes_table_separators():
    """Report tables are written by `scaling/render.table`, not by hand."""
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() not in SEPARATOR_WRITERS
        for hit in _separator_literals_in(path, PACKAGE)
    ]
    assert not found, "Markdown table separators written by hand:\n" + "\n".join(found)
