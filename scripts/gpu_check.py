"""The one-GPU check: a 3-step `coba run` with vLLM on CUDA and sleep during the update, then checks.

Run it through scripts/gpu_check.sh on a machine with one NVIDIA GPU, after `make setup-gpu`;
nothing is downloaded (the model is built here with random weights, the data is the shipped
arithmetic task).

    python scripts/gpu_check.py --out runs/gpu-check            # build, run, check (exit 1 on a failure)
    python scripts/gpu_check.py --out runs/gpu-check --skip-reload-check
    python scripts/gpu_check.py --check-only runs/gpu-check/run  # only the checks, on a finished run

Phases:
1. build a small model in Hugging Face layout: a Qwen2-architecture causal LM with *tied*
   input/output embeddings, as Qwen2.5-0.5B has (``--arch llama`` builds the untied tiny Llama of
   ``coba_tasks.engines.model`` instead), with the character tokenizer;
2. write a config (CUDA, vllm backend, bfloat16, ``rollout.sleep_during_update: true``, 3 steps,
   M = 16, G = 8) and run ``coba run`` on it;
3. check the run directory (``check_run``): every step's tables are recorded in its manifest
   (budget, rollouts, rewards, capability, update) with matching row counts; the rollouts of
   step s carry weight version s (the engine reloaded the weights after each update); each
   step's ``engine_sleep.json`` shows the engine gave back device memory while the update ran
   and took it back after (``torch.cuda.mem_get_info``: all processes, as nvidia-smi shows);
4. reload check (``check_reload``): vLLM started on model A, greedy output, weights of model B
   loaded in place, greedy output again, compared with transformers' greedy output of A and B on
   prompts long enough to fill KV-cache blocks (a stale prefix cache or a stale tied output
   head would show here); then B's tensors handed over from GPU memory (``set_weights``, vLLM's CUDA
   IPC weight transfer to the engine's process) must give the reload's sequences.

Every check prints one line ``ok`` / ``FAIL``; a report is written to ``<out>/gpu_check.json``;
the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from coba_tasks.engines.fileio import OutputDirError, fresh_marked_dir  # noqa: E402
from coba_tasks.pipeline.store import STAGES  # noqa: E402

STEPS = 3
MARKER = ".gpu-check"  # marks an output folder this script made (and may replace)
GPU_MEMORY_UTILIZATION = 0.3
# Share of the engine's memory budget (gpu_memory_utilization x total) that sleeping must free,
# and waking must take back: vLLM's weights and KV cache are nearly all of it.
MIN_FREED_SHARE = 0.5
# Prompts of 40+ characters (one token each): two or more full 16-token KV blocks on CUDA.
LONG_PROMPTS = [
    "12+34+56+78+90+12+34+56+78+90+11+22+33+44=",
    "(4-7)*3+(8-2)*5-(9+1)*2+(6*7)-(3*3)+100-42=",
    "99*9+88*8+77*7+66*6+55*5+44*4+33*3+22*2+1=",
    "1000-999+998-997+996-995+994-993+992-991+9=",
    "7*7*7-6*6*6+5*5*5-4*4*4+3*3*3-2*2*2+1*1*1-0=",
    "314+159+265+358+979+323+846+264+338+327+95=",
    "(1+2)*(3+4)*(5+6)-(7+8)*(9+10)+(11+12)*13-1=",
    "271828-182845+904523-536028+747135-266249=",
]


@dataclass
class Check:
    """One check's outcome: a line of the report."""

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


# ---------------------------------------------------------------------------------------------
# Checks of a finished run directory (no GPU needed to read them)
# ---------------------------------------------------------------------------------------------


def check_memory(record: dict[str, Any], min_freed_mib: float) -> Check:
    """One step's engine_sleep.json: sleeping freed at least ``min_freed_mib``, waking took it back."""
    before, asleep = record.get("before_sleep"), record.get("asleep")
    after, awake = record.get("after_update"), record.get("awake")
    if not (before and asleep and after and awake):
        return Check("memory", False, "no CUDA memory figures in engine_sleep.json (was CUDA available?)")
    freed = before["used"] - asleep["used"]
    taken = awake["used"] - after["used"]
    detail = (
        f"used {before['used']:.0f} MiB -> asleep {asleep['used']:.0f} (freed {freed:.0f}, need >= {min_freed_mib:.0f})"
        f" -> update peak allocated {after.get('peak_allocated', float('nan')):.0f}"
        f" -> awake {awake['used']:.0f} (taken back {taken:.0f}); sleep {record.get('sleep_s', float('nan')):.2f} s,"
        f" wake {record.get('wake_s', float('nan')):.2f} s"
    )
    return Check("memory", freed >= min_freed_mib and taken >= min_freed_mib, detail)


def check_run(
    run_dir: str | Path,
    steps: int,
    require_memory: bool = True,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
) -> list[Check]:
    """The checks of a finished run: stage tables, weight versions, sleep records; one Check each."""
    from coba_tasks.pipeline.store import RunStore

    run_dir = Path(run_dir)
    out: list[Check] = []
    try:
        store = RunStore.open(run_dir)
    except Exception as exc:  # no run there: one failure says why
        return [Check("run directory", False, f"{run_dir}: {exc}")]
    for step in range(steps):
        missing, mismatched = [], []
        for name in STAGES:
            if not store.is_done(step, name):
                missing.append(name)
                continue
            rows = store.manifest(step)[name]["rows"]
            if rows != len(store.read_table(step, name)) or rows == 0:
                mismatched.append(f"{name} ({rows} rows in the manifest)")
        ok = not missing and not mismatched
        detail = f"{', '.join(STAGES)} recorded" if ok else ""
        detail += f"missing {', '.join(missing)} " if missing else ""
        detail += f"row counts differ: {', '.join(mismatched)}" if mismatched else ""
        out.append(Check(f"step {step} tables", ok, detail.strip()))
        if "rollouts" not in missing:
            versions = sorted(set(store.read_table(step, "rollouts")["weight_version"].tolist()))
            out.append(
                Check(
                    f"step {step} weight version",
                    versions == [step],
                    f"rollouts made with weight version(s) {versions}, expected [{step}]",
                )
            )
        if require_memory:
            path = run_dir / f"steps/{step:06d}/engine_sleep.json"
            if not path.is_file():
                out.append(Check(f"step {step} memory", False, f"{path} missing (rollout.sleep_during_update off?)"))
                continue
            record = json.loads(path.read_text())
            total = (record.get("before_sleep") or {}).get("total", 0.0)
            check = check_memory(record, MIN_FREED_SHARE * gpu_memory_utilization * total)
            out.append(Check(f"step {step} memory", check.ok, check.detail))
    for step in (0, steps):  # held-out evaluation before and after training
        if store.is_done(step, "eval"):
            versions = sorted(set(store.read_table(step, "eval")["weight_version"].tolist()))
            out.append(Check(f"eval at step {step}", versions == [step], f"weight version(s) {versions}"))
        else:
            out.append(Check(f"eval at step {step}", False, "eval table missing"))
    return out


# ---------------------------------------------------------------------------------------------
# Building the model and the config, running, the reload check (GPU)
# ---------------------------------------------------------------------------------------------


def build_model(out: Path, seed: int, arch: str = "qwen2-tied", sharpen: float = 0.0) -> Path:
    """A small causal LM in HF layout with the character tokenizer; ``sharpen`` > 0 draws every
    weight from N(0, sharpen) so greedy decoding has clear winners (for output comparisons)."""
    import torch

    from coba_tasks.engines.model import (
        TinyLlamaSpec,
        build_char_tokenizer,
        build_tiny_llama,
        save_hf,
        seeded_model,
        tiny_config_kwargs,
    )

    tok = build_char_tokenizer()
    spec = TinyLlamaSpec(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    if arch == "llama":
        model = build_tiny_llama(tok, spec, seed=seed)
    elif arch == "qwen2-tied":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        tied = tiny_config_kwargs(tok, replace(spec, tie_word_embeddings=True))  # tied, as Qwen2.5-0.5B
        model = seeded_model(Qwen2ForCausalLM, Qwen2Config(**{**tied, "num_key_value_heads": 2}), tok, seed)
    else:
        raise ValueError(f"unknown --arch {arch!r}: qwen2-tied or llama")
    if sharpen > 0:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed + 1000)
            for p in model.parameters():
                if p.ndim >= 2:
                    p.normal_(0.0, sharpen)
    return save_hf(model, tok, out)


def write_config(path: Path, model_dir: Path, dtype: str = "bfloat16") -> Path:
    """The check's run config: every key not written takes its default (coba_tasks/pipeline/config_sections.py)."""
    import yaml

    config = {
        "run": {
            "name": "gpu-check",
            "steps": STEPS,
            "eval_every": 0,
            "eval_samples": 4,
            "eval_temperature": 1.0,
            "eval_top_p": 0.9,
            "eval_greedy": True,
        },
        "data": {
            "train": str(ROOT / "data/arith_train.parquet"),
            "test": str(ROOT / "data/arith_test.parquet"),
            "prompts_per_step": 16,
            "eval_prompts": 32,
            "train_prompts": 64,
        },
        "model": {"path": str(model_dir), "dtype": dtype, "gradient_checkpointing": True},
        "rollout": {
            "backend": "vllm",
            "max_tokens": 16,
            "max_model_len": 128,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "sleep_during_update": True,
        },
        "allocation": {"group_size": 8, "max_budget": 16},
        "optim": {"lr": 1.0e-5, "micro_batch_size": 64},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_training(config: Path, run_dir: Path, log: Path, timeout_s: float) -> Check:
    """``coba run`` on the config, output to ``log``; a Check of its exit status."""
    coba = Path(sys.executable).with_name("coba")
    cmd = [str(coba)] if coba.exists() else [sys.executable, "-m", "coba_tasks.commands.cli"]
    cmd += ["run", "--config", str(config), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return Check("coba run", False, f"no result within {timeout_s:.0f} s (log: {log})")
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if rc else []
    detail = f"exit status {rc} after {time.perf_counter() - t0:.0f} s (log: {log})"
    return Check("coba run", rc == 0, detail + (f"; last line: {tail[0][:300]}" if tail else ""))


def _agreement(xs: list[Any], ys: list[Any]) -> float:
    return sum(a == b for a, b in zip(xs, ys, strict=True)) / len(xs)


def check_reload(model_a: Path, model_b: Path, dtype: str = "float32") -> Check:
    """vLLM on A; greedy; reload B in place; greedy again; both compared with transformers' greedy."""
    from transformers import AutoTokenizer

    from coba_tasks.engines.rollout import RolloutRequest, SamplingConfig, make_backend

    tok = AutoTokenizer.from_pretrained(model_a)
    requests = [RolloutRequest(f"p{i}", tuple(tok(p).input_ids), 1, 0, prompt=p) for i, p in enumerate(LONG_PROMPTS)]
    greedy = SamplingConfig(temperature=0.0, max_tokens=12)

    def tokens(rows: list[Any]) -> list[tuple[int, ...]]:
        return [r.token_ids for r in rows]

    engine = make_backend(
        "vllm", model_a, dtype=dtype, max_model_len=128, seed=0, gpu_memory_utilization=0.2, enforce_eager=True
    )
    try:
        before = tokens(engine.generate(requests, greedy))
        engine.load_weights(model_b, version=1)
        after = tokens(engine.generate(requests, greedy))
        # the path of every update: model B's tensors from this process's GPU memory (CUDA IPC by default)
        engine.load_weights(model_a, version=0)
        from safetensors.torch import load_file

        b_tensors = load_file(str(model_b / "model.safetensors"), device="cuda")
        engine.set_weights(lambda: b_tensors.items(), version=1)
        from_memory = tokens(engine.generate(requests, greedy))
        transport = engine.weight_transport
    finally:
        engine.close()
    hf_a = tokens(make_backend("transformers", model_a, dtype=dtype).generate(requests, greedy))
    hf_b = tokens(make_backend("transformers", model_b, dtype=dtype).generate(requests, greedy))
    a_before, b_after, a_after = _agreement(before, hf_a), _agreement(after, hf_b), _agreement(after, hf_a)
    ok = a_before >= 0.75 and b_after >= 0.75 and a_after < b_after and from_memory == after
    detail = (
        f"greedy sequences equal to transformers': model A before the reload {a_before:.0%},"
        f" model B after reloading B {b_after:.0%} (still A: {a_after:.0%}); {len(requests)} prompts of 40+ tokens;"
        f" B from GPU memory ({transport}) gives the reload's sequences: {from_memory == after}"
    )
    return Check("reload in place (tied embeddings, prefix cache)", ok, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="One-GPU check: a 3-step coba run with vLLM on CUDA and sleep during the update, then checks.",
        epilog="examples:\n"
        "  python scripts/gpu_check.py --out runs/gpu-check\n"
        "  python scripts/gpu_check.py --check-only runs/gpu-check/run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/gpu-check", help="output folder (model, config, run, logs, report)")
    parser.add_argument("--arch", default="qwen2-tied", choices=("qwen2-tied", "llama"), help="model architecture")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model.dtype of the run")
    parser.add_argument("--timeout", type=float, default=360.0, help="seconds allowed to `coba run` (default 360)")
    parser.add_argument("--skip-reload-check", action="store_true", help="skip phase 4 (a second vLLM engine)")
    parser.add_argument(
        "--reload-dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of phase 4 (default float32)"
    )
    parser.add_argument("--check-only", metavar="RUN_DIR", help="only check a finished run directory")
    args = parser.parse_args(argv)

    checks: list[Check] = []
    if args.check_only:
        checks += check_run(args.check_only, STEPS)
        return _report(checks, None)  # printed only
    out = Path(args.out).resolve()
    try:  # never deletes a folder this script did not make
        fresh_marked_dir(out, MARKER, "scripts/gpu_check.py")
    except OutputDirError as exc:
        print(exc, file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        checks.append(Check("cuda", False, "torch.cuda.is_available() is false: run `make setup-gpu` on a GPU machine"))
        return _report(checks, out / "gpu_check.json")
    checks.append(Check("cuda", True, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"))
    t0 = time.perf_counter()
    model = build_model(out / "model", seed=0, arch=args.arch)
    config = write_config(out / "config.yaml", model, dtype=args.dtype)
    checks.append(Check("build", True, f"{args.arch} model and config in {time.perf_counter() - t0:.1f} s"))
    run = run_training(config, out / "run", out / "coba_run.log", args.timeout)
    checks.append(run)
    if run.ok or (out / "run").exists():
        checks += check_run(out / "run", STEPS)
    if not args.skip_reload_check:
        t0 = time.perf_counter()
        try:
            a = build_model(out / "reload_a", seed=0, arch=args.arch, sharpen=0.5)
            b = build_model(out / "reload_b", seed=1, arch=args.arch, sharpen=0.5)
            reload = check_reload(a, b, dtype=args.reload_dtype)
            reload.detail += f"; {time.perf_counter() - t0:.0f} s"
        except Exception as exc:  # reported as a failed check, the report still gets written
            reload = Check("reload in place (tied embeddings, prefix cache)", False, f"{type(exc).__name__}: {exc}")
        checks.append(reload)
    return _report(checks, out / "gpu_check.json")


def _report(checks: list[Check], path: Path | None) -> int:
    """Print one line per check (and write them as JSON to ``path``); the exit status: 1 if any failed."""
    for c in checks:
        print(c.line(), flush=True)
    failed = [c for c in checks if not c.ok]
    if path is not None:
        path.write_text(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; report: {path}" if path else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    sys.exit(main())
