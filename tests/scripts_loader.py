"""Import a script of the repository that is not in a package (data/*.py, scripts/*.py) from its path.

make_arith = load_script("data/make_arith.py")   # the module, under the name "make_arith"
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """The script at ``ROOT / relative_path`` as a module named by its stem, imported once per process."""
    path = ROOT / relative_path
    if path.stem not in sys.modules:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[path.stem]
