"""``coba bench``'s parsers: the group's benchmarks, ``stages``' options and ``update``'s group sizes."""

from __future__ import annotations

import argparse

import pytest

from coba_tasks.commands.bench_cmd import add_bench_parser, group_sizes


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``coba`` parser with only the ``bench`` group registered, and the group's parser."""
    parser = argparse.ArgumentParser(prog="coba")
    bench = add_bench_parser(parser.add_subparsers(dest="command"))
    return parser, bench


def test_bench_group_lists_its_benchmarks():
    _, bench = _parser()
    (group,) = [a for a in bench._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(group.choices) == ["allocate", "rollout", "verify", "update", "stages", "weights"]


def test_bench_weights_parser():
    parser, _ = _parser()
    args = parser.parse_args(["bench", "weights"])
    assert (args.smollm2, args.skip_05b, args.repeats, args.json) == ("models/smollm2-135m-instruct", False, 3, False)
    args = parser.parse_args(["bench", "weights", "--skip-0.5b", "--repeats", "1", "--json"])
    assert (args.skip_05b, args.repeats, args.json, args.func.__name__) == (True, 1, True, "cmd_bench_weights")


def test_bench_stages_parser(capsys):
    parser, _ = _parser()
    args = parser.parse_args(["bench", "stages"])
    assert (args.config, args.set, args.steps, args.json) == ("configs/demo-tiny.yaml", [], 3, False)
    args = parser.parse_args(["bench", "stages", "--steps", "2", "--set", "a.b=1", "--set", "c.d=2", "--json"])
    assert (args.steps, args.set, args.json) == (2, ["a.b=1", "c.d=2"], True)
    assert args.func.__name__ == "cmd_bench_stages"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "stages", "--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "coba bench stages" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "stages", "--steps", "0"])


def test_bench_update_group_sizes():
    assert group_sizes("2,4,8") == [2, 4, 8]
    with pytest.raises(argparse.ArgumentTypeError, match="group sizes must be >= 1"):
        group_sizes("2,0")
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated group sizes"):
        group_sizes("2;4")
