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
