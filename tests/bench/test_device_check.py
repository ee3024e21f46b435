"""scripts/device_check.py, the check that runs first on a lent GPU machine, run here at its tiny size so that
it cannot rot: every check passes on the CPU, each in its own process under its cap, and its figures are the
ones the GPU run reports; its pieces (token counts, the pytest report's reading, the wheel set) checked alone."""

from __future__ import annotations

import argparse
import json

import pytest
from scripts_loader import load_script

device_check = load_script("scripts/device_check.py")


@pytest.mark.slow
def test_every_check_passes_at_the_tiny_size_on_cpu(random_checkpoints, tmp_path, capsys):
    """The whole check as the GPU machine runs it, at the tiny size: seven checks, one line each, the report
    with each check's figures; the agreements it asserts hold here (float32 paths within 1e-3 of the reference
    gradient, the sampler's log-probs within 1e-3 of the trainer's, a checkpoint reloaded bit for bit, one FSDP
    rank giving the single-process weights)."""
    model, _ = random_checkpoints
    out = tmp_path / "check"
    args = ["--size", "tiny", "--out", str(out), "--tiny-model", str(model), "--tests", "tests/core/test_passk.py"]
    assert device_check.main([*args, "--budget", "900"]) == 0, capsys.readouterr().out
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[1].rstrip(":") for line in lines[:-1]] == list(device_check.CHECKS)
    assert all(line.startswith("ok") for line in lines[:-1]) and lines[-1].startswith("7/7 checks passed")
    report = json.loads((out / device_check.REPORT).read_text())
    figures = {c["name"]: c["figures"] for c in report["checks"]}
    variants = figures["update"]["variants"]
    assert set(variants) == set(device_check.UPDATE_VARIANTS)
    assert variants["fp32-full-skip"]["grad_rel_diff"] < 1e-3 and variants["fp32-shared-skip"]["grad_rel_diff"] < 1e-3
    assert variants["fp32-full-skip"]["skipped_rows"] == figures["update"]["zero_advantage_rows"] > 0
    assert all(v["tokens_per_s"] > 0 and v["peak_gib"] > 0 for v in variants.values())
    assert figures["rollout"]["logprob_gap_float32"]["max"] < 1e-3
    assert figures["checkpoint"]["tensors_that_differ"] == [] and figures["checkpoint"]["updates_after_load"] == 1
    ck = figures["checkpoint"]  # the replay's question: the same weights digest (the CPU: free kernels repeat too)
    assert ck["replay_repeats_the_update"] and ck["free_kernels_repeat_the_weights"]
    assert ck["ops_without_deterministic_kernel"] == []
    assert ck["update_deterministic_s"] > 0 and ck["update_free_kernels_s"] > 0
    assert figures["fsdp"]["largest_weight_difference"] <= 1e-3 * figures["fsdp"]["largest_update"]
    assert figures["train"]["weight_versions"] == [[0], [2]] and 0 <= figures["train"]["avg_after"] <= 1
    assert len(figures["tests"]["passed"]) > 0 and figures["tests"]["failed"] == {}
    # a second run replaces the folder it made; a folder it did not make is refused
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert device_check.main(["--size", "tiny", "--out", str(tmp_path / "other"), "--only", "env"]) == 2
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_a_check_past_its_cap_or_the_budget_fails_with_the_reason(tmp_path, capsys):
    out = tmp_path / "check"
    out.mkdir()
    args = argparse.Namespace(size="tiny", tiny_model="models/arith-tiny", tests="tests/core", min_gain=None, site="/x")
    result = device_check._run_child("env", args, 0.5, out)  # importing torch alone takes longer
    assert not result["ok"] and result["detail"].startswith("no result within its cap of 0 s")
    assert device_check.main(["--size", "tiny", "--out", str(tmp_path / "b"), "--budget", "5"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "the checks' caps (780 s) scaled to the budget (5 s)"  # each under MIN_CAP_S: skipped
    assert lines[1] == "FAIL  env: skipped: 5 s of the budget left" and lines[-1].startswith("0/7 checks passed")
    # the caps of the full size fit its default budget with a margin: no check is left with the budget's leftovers
    assert sum(device_check.FULL.caps.values()) <= 0.9 * device_check.DEFAULT_BUDGET_S
    with pytest.raises(SystemExit):
        device_check.main(["--only", "env,nothing"])
    assert "unknown check(s) nothing" in capsys.readouterr().err


def test_update_token_counts_follow_each_path():
    """Two groups: prompt A (3 tokens) with completions of 2 and 4 tokens and advantages +1 and -1; prompt B
    (5 tokens) with one completion of 1 token at advantage 0."""
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5, 6, 7, 8]]
    completions = [[9, 9], [9, 9, 9, 9], [9]]
    adv, groups = [1.0, -1.0, 0.0], [0, 0, 1]
    assert device_check.update_tokens(prompts, completions, adv, groups, shared=False, skip=False) == (18, 18)
    assert device_check.update_tokens(prompts, completions, adv, groups, shared=False, skip=True) == (12, 12)
    assert device_check.update_tokens(prompts, completions, adv, groups, shared=True, skip=False) == (3 + 5 + 7, 0)
    assert device_check.update_tokens(prompts, completions, adv, groups, shared=True, skip=True) == (3 + 6, 0)


def test_the_pytest_report_is_read_as_passed_failed_skipped_and_missing_packages(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        """<?xml version="1.0"?><testsuites><testsuite>
        <testcase classname="tests.engines.test_a" name="test_ok"/>
        <testcase classname="tests.engines.test_a" name="test_far">
        <failure message="assert 0.2 &lt; 1e-4&#10;second line">trace</failure></testcase>
        <testcase classname="tests.engines.test_b" name="test_vllm"><error message="ModuleNotFoundError: No module
        named 'vllm'"/></testcase>
        <testcase classname="tests.core.test_c" name="test_later"><skipped message="needs a GPU"/></testcase>
        <testcase classname="" name="tests.engines.test_nucleus"><error message="collection failure">ImportError
        while importing test module 'tests/engines/test_nucleus.py'.
        E   ModuleNotFoundError: No module named 'vllm'</error></testcase>
        <testcase classname="" name="tests.engines.test_other"><error message="collection failure">E   NameError:
        name 'x' is not defined</error></testcase>
        </testsuite></testsuites>"""
    )
    outcome = device_check.junit_outcomes(xml)
    assert outcome["passed"] == ["engines.test_a::test_ok"]
    # a collection error: its message says only "collection failure", its body why (a package missing, or not)
    assert outcome["failed"] == {
        "engines.test_a::test_far": "assert 0.2 < 1e-4",
        "::tests.engines.test_other": "collection failure",
    }
    assert outcome["missing_package"] == {
        "engines.test_b::test_vllm": "ModuleNotFoundError: No module         named 'vllm'",
        "::tests.engines.test_nucleus": "E   ModuleNotFoundError: No module named 'vllm'",
    }
    assert outcome["skipped"] == {"core.test_c::test_later": "needs a GPU"}


def test_the_wheels_are_what_the_gpu_machine_lacks():
    """Prefect, pydantic and math-verify with what they need (sqlalchemy's asyncio extra: greenlet), at the
    versions installed here, and nothing the GPU machine's image has (torch, transformers, numpy, ...)."""
    from importlib.metadata import version

    wheels = device_check.wheel_set()
    assert {"prefect", "pydantic", "pydantic-core", "math-verify", "sqlalchemy", "greenlet"} <= set(wheels)
    assert wheels["prefect"] == version("prefect") and wheels["pydantic"] == version("pydantic")
    assert not {"torch", "transformers", "numpy", "pandas", "vllm"} & set(wheels)
    # of the image's packages, only those a carried package requires at a version, at the version here
    image = set(wheels) & device_check.GPU_IMAGE_PACKAGES
    assert {"typing-extensions", "packaging"} <= image and wheels["packaging"] == version("packaging")
    constrained = {
        device_check._norm(r.name) for n in set(wheels) - image for r in device_check._requirements(n) if r.specifier
    }
    assert image <= constrained


def _site_with(tmp_path, name: str, requires: list[str]):
    """A folder holding one installed distribution ``name`` 1.0 with ``requires``, as pip --target leaves it."""
    info = tmp_path / "site" / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    return tmp_path / "site"


def test_the_carried_wheels_requirements_are_checked_against_the_machines_versions(tmp_path):
    """What the env check fails on: a carried package that needs a version the machine does not give (the
    machine's packaging, a missing package), named with both versions; met requirements and those of another
    Python or an extra are not listed."""
    from importlib.metadata import version

    here = version("packaging")
    site = _site_with(
        tmp_path,
        "carried",
        [
            f"packaging<{here}",
            f"packaging>={here}",
            "no-such-package-anywhere>=1",
            'packaging<1; python_version < "3.8"',
            'packaging<1; extra == "docs"',
        ],
    )
    assert device_check.carried_conflicts(site) == [
        "carried 1.0 needs no-such-package-anywhere>=1, finds none",
        f"carried 1.0 needs packaging<{here}, finds {here}",
    ]
    assert device_check.carried_conflicts(_site_with(tmp_path / "b", "fine", [f"packaging=={here}"])) == []


def test_the_tests_check_passes_where_vllm_cannot_be_imported(tmp_path, monkeypatch):
    """The lent machine has no vLLM: a test module that imports it is skipped, not a collection error that stops
    pytest, and the check passes on the tests that ran (here with vLLM blocked, on this machine's CPUs)."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class _Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'vllm':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(block))
    out = tmp_path / "out"
    out.mkdir()
    args = argparse.Namespace(tests="tests/engines/test_nucleus.py tests/core/test_passk.py")
    ok, detail, figures = device_check.check_tests(device_check.TINY, out, args)
    assert ok, detail
    assert figures["failed"] == {} and figures["missing_package"] == {} and len(figures["passed"]) > 0
    assert any("test_nucleus" in name and "vLLM is not installed" in why for name, why in figures["skipped"].items())


def _fake_pip(calls: list[list[str]]):
    """``pip download`` without the network: one empty wheel per ``name==version`` into ``--dest``."""
    import subprocess
    from pathlib import Path

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        for spec in (a for a in cmd if "==" in a):
            name, version = spec.split("==")
            (dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"wheel")
        return subprocess.CompletedProcess(cmd, 0)

    return run


def test_the_wheels_folder_holding_other_files_is_refused_and_kept(tmp_path, monkeypatch):
    """``--wheels DIR`` never deletes what it did not write: a folder holding other wheels (or anything else)
    is refused in one line naming it and the fix, before any download, and every file in it stays."""
    calls: list[list[str]] = []
    monkeypatch.setattr(device_check, "wheel_set", lambda: {"prefect": "3.0.0", "pydantic": "2.9.0"})
    monkeypatch.setattr(device_check.subprocess, "run", _fake_pip(calls))
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / "mine-1.0-py3-none-any.whl").write_bytes(b"somebody's wheel")
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as err:
        device_check.make_wheels(folder)
    message = str(err.value)
    assert "\n" not in message and str(folder) in message and "nothing was removed" in message
    assert calls == []
    assert sorted(p.name for p in folder.iterdir()) == ["mine-1.0-py3-none-any.whl", "notes.txt"]


def test_the_wheels_rerun_replaces_only_what_the_last_run_wrote(tmp_path, monkeypatch, capsys):
    """A new folder gets the set and a record of what was written; a rerun (a package upgraded since) replaces
    the folder's wheels by the new set: the old version's wheel goes, so the folder holds the set exactly. A file
    put there since is not the script's: the next run is refused and the file stays."""
    calls: list[list[str]] = []
    versions = {"prefect": "3.0.0", "pydantic": "2.9.0"}
    monkeypatch.setattr(device_check, "wheel_set", lambda: dict(versions))
    monkeypatch.setattr(device_check.subprocess, "run", _fake_pip(calls))
    folder = tmp_path / "wheels"

    def wheels() -> list[str]:
        return sorted(p.name.split("-py3")[0] for p in folder.glob("*.whl"))

    assert device_check.make_wheels(folder) == 0
    assert wheels() == ["prefect-3.0.0", "pydantic-2.9.0"]
    versions["prefect"] = "3.1.0"
    assert device_check.make_wheels(folder) == 0, capsys.readouterr().err
    assert wheels() == ["prefect-3.1.0", "pydantic-2.9.0"]
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]  # no temporary left
    (folder / "extra-1.0-py3-none-any.whl").write_bytes(b"added by hand")
    with pytest.raises(SystemExit, match=r"extra-1\.0-py3-none-any\.whl"):
        device_check.make_wheels(folder)
    assert wheels() == ["extra-1.0", "prefect-3.1.0", "pydantic-2.9.0"] and len(calls) == 2
