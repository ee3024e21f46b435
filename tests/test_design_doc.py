"""docs/design.md's module table names every module of the package, so a newcomer finds each one there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _listed() -> set[str]:
    """The modules the table's first column names: ``pipeline/run.py``, and a bare ``compare_fork.py`` after a
    path in the same cell (the same folder)."""
    rows = [
        line for line in (ROOT / "docs/design.md").read_text(encoding="utf-8").splitlines() if line.startswith("| `")
    ]
    listed: set[str] = set()
    for row in rows:
        folder = None
        for name in re.findall(r"`([^`]+\.py)`", row.split("|")[1]):
            if "/" in name:
                folder = name.rsplit("/", 1)[0]
                listed.add(name)
            elif folder:
                listed.add(f"{folder}/{name}")
    return listed


def test_the_module_table_lists_every_module():
    modules = {
        str(p.relative_to(ROOT / "coba_tasks")) for p in (ROOT / "coba_tasks").rglob("*.py") if p.name != "__init__.py"
    }
    modules |= {str(p.relative_to(ROOT)) for p in (ROOT / "flows").rglob("*.py") if p.name != "__init__.py"}
    listed = _listed()
    assert len(modules) > 80
    assert sorted(modules - listed) == []
    assert (
        sorted(
            m
            for m in listed
            if m.split("/")[0] in ("core", "engines", "pipeline", "readers", "bench", "commands", "flows")
            and m not in modules
        )
        == []
    )


def test_only_the_policy_asks_how_updates_run():
    """Where the policy's weights come from is decided in pipeline/policy.py alone: no other module of the
    pipeline, the flows or the commands branches on FSDP (the config's own checks aside)."""
    places = [*(ROOT / "coba_tasks/pipeline").glob("*.py"), *(ROOT / "coba_tasks/commands").glob("*.py")]
    places += list((ROOT / "flows").glob("*.py"))
    asking = sorted(
        str(p.relative_to(ROOT))
        for p in places
        if p.name not in ("policy.py", "config.py", "config_sections.py", "config_fields.py", "config_docs.py")
        and re.search(r"fsdp_processes|trainer is (not )?None", p.read_text(encoding="utf-8"))
    )
    assert len(places) > 30
    assert asking == []


def _pipeline_imports() -> dict[str, set[str]]:
    """Each module of coba_tasks/pipeline and the pipeline modules it imports, at the top or inside a function
    (a lazy import is still a dependency), read from the source."""
    import ast

    folder = ROOT / "coba_tasks/pipeline"
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "coba_tasks.pipeline":
                found |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("coba_tasks.pipeline."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("coba_tasks.pipeline.")}
        graph[name] = found - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each strongly connected set of two or more modules, sorted."""
    import itertools

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {m: reach(m) for m in graph}
    circles = {frozenset([m, *(n for n in reached[m] if m in reached[n])]) for m in graph if m in reached[m]}
    return sorted(sorted(c) for c in circles if len(c) > 1 and not any(c < d for d in itertools.chain(circles)))


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_pipelines_modules_import_each_other_in_one_direction():
    """No import circle among the pipeline's modules (the policy builds on the store and the progress of a run;
    the run's resources build on the policy, never both ways)."""
    graph = _pipeline_imports()
    assert len(graph) > 20 and "run" in graph["stages"] and "policy" in graph["run"]
    assert _circles(graph) == []
