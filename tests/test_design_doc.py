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
