"""docs/config.md, generated from the config's field descriptions by ``python -m coba_tasks.pipeline.config_docs``
(tests/pipeline/test_config.py checks that the committed page is up to date).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from coba_tasks.pipeline.config import PROJECT_ROOT
from coba_tasks.pipeline.config_fields import SECTIONS, bounds_text, expected_words, plain


def config_reference() -> str:
    """docs/config.md: every section and key with its default, what it takes and what it means."""
    lines = [
        "# Config reference",
        "",
        "<!-- Generated from the field descriptions of coba_tasks/pipeline/config_sections.py by",
        "     `python -m coba_tasks.pipeline.config_docs`; edit the descriptions there, not this file. -->",
        "",
        "A config file is a YAML mapping of these sections, each a mapping of keys to values; a key left out",
        "takes the default below, so a file lists only where its recipe departs from them (configs/demo.yaml).",
        "`coba run --set section.key=value` sets one key. Every value is checked on load; a wrong one is one",
        "line naming the key and what it must be.",
    ]
    for name, cls in SECTIONS.items():
        lines += [
            "",
            f"## {name}",
            "",
            str(cls.__doc__),
            "",
            "| key | default | takes | meaning |",
            "|---|---|---|---|",
        ]
        for key, field in cls.model_fields.items():
            default = yaml.safe_dump(plain(field.default), default_flow_style=True).strip().removesuffix("...").strip()
            takes, meaning = (
                t.replace("|", "\\|").replace("<", "&lt;") for t in (_takes(field), str(field.description))
            )
            lines.append(f"| `{key}` | `{default}` | {takes} | {meaning} |")
    return "\n".join(lines) + "\n"


def _takes(field: Any) -> str:
    hint = field.annotation
    if get_origin(hint) is Literal:
        return " or ".join(f"`{a}`" for a in get_args(hint))
    registry = next((m.func.registry for m in field.metadata if hasattr(getattr(m, "func", None), "registry")), None)
    if registry is not None:
        return "a registered name: " + ", ".join(f"`{n}`" for n in registry())
    words = expected_words(hint)
    bounds = bounds_text(field).removeprefix("must be ")
    return f"{words}, {bounds}" if bounds else words


if __name__ == "__main__":  # python -m coba_tasks.pipeline.config_docs [PATH]: write the reference (docs/config.md)
    import sys

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROJECT_ROOT / "docs" / "config.md"
    out.write_text(config_reference(), encoding="utf-8")
    print(f"wrote {out}")
