"""coba-rl and TRL's GRPOTrainer on the same work, alternated: SmolLM2-135M-Instruct, chat arithmetic.

Both train SmolLM2-135M-Instruct from the same weights on the same 64-prompt pool (levels 0-2 of the
chat arithmetic task, sampled with seed 0), 16 prompts x G = 8 completions a step, at most 48
completion tokens, temperature 1.0, AdamW lr 1e-5, no KL, token-mean clipped loss [0.8, 1.28], one
optimizer step per step, uniform budgets (TRL has no other), for ``--steps`` steps. The runs
alternate (coba-rl, TRL, coba-rl, TRL, ... for ``--rounds`` rounds), so both meet the same machine.
coba-rl generates with vLLM; TRL with transformers ``generate`` (its vLLM mode does not run on the
CPU build of vLLM here: docs/trl_peer.md). Both final models are evaluated by coba-rl's own held-out
evaluation (``evaluation.evaluate``: the same 120 prompts, avg@4 at temperature 1.0 and top-p 0.9, plus
greedy, with vLLM), so the accuracies compare like with like.

Run from the repository root with coba-rl's venv; TRL lives in its own (docs/trl_peer.md):

    .venv/bin/python scripts/peer_smollm2.py --train /tmp/l02/train.parquet --test /tmp/l02/test.parquet

Prints a table and writes ``--out``/peer.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "smollm2-135m-instruct"


def coba_run(args: argparse.Namespace, run_dir: Path) -> dict:
    sets = {
        "data.train": args.train,
        "data.test": args.test,
        "data.train_prompts": 64,
        "data.prompts_per_step": 16,
        "allocation.group_size": 8,
        "allocation.strategy": "uniform",
        "rollout.max_tokens": 48,
        "optim.lr": 1e-5,
        "run.steps": args.steps,
        "run.eval_every": 0,
        "data.eval_prompts": 120,
        "run.keep_checkpoints": 1,
        "model.path": MODEL,
    }
    cmd = [str(ROOT / ".venv/bin/coba"), "run", "--config", "configs/smollm2-arith.yaml", "--run-dir", str(run_dir)]
    cmd += [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    from coba_tasks.pipeline.store import RunStore, Table

    store = RunStore.open(run_dir)
    timing = [json.loads((run_dir / f"steps/{s:06d}/timing.json").read_text()) for s in range(args.steps)]
    zero = [float(store.read_table(s, Table.UPDATE)["zero_variance_groups"].iloc[0]) for s in range(args.steps)]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": wall,
        "step_s": [sum(t.values()) for t in timing],
        "generation_s": [t["rollouts"] for t in timing],
        "update_s": [t["update"] for t in timing],
        "zero_variance_group_share": zero,
        "heldout_before": {k: summary[f"heldout_{k}_before"] for k in ("accuracy", "greedy")},
        "heldout_after": {k: summary[f"heldout_{k}_after"] for k in ("accuracy", "greedy")},
    }


def trl_run(args: argparse.Namespace, out: Path) -> dict:
    cmd = [args.trl_python, str(ROOT / "scripts" / "trl_peer.py"), "--chat", "--model", str(MODEL)]
    cmd += ["--train", args.train, "--test", args.test, "--out", str(out), "--steps", str(args.steps)]
    cmd += ["--prompts-per-step", "16", "--group-size", "8", "--micro-batch", "16", "--train-prompts", "64"]
    cmd += ["--lr", "1e-5", "--max-new-tokens", "48", "--threads", str(args.threads), "--seed", "0"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["heldout_after"] = evaluate(out, args)
    return result


def evaluate(model_dir: Path, args: argparse.Namespace) -> dict:
    """coba-rl's held-out evaluation of a model directory: what a run's evaluation after training measures."""
    from coba_tasks.engines.rollout import make_backend
    from coba_tasks.engines.verify_pool import VerifierPool
    from coba_tasks.pipeline import evaluation
    from coba_tasks.pipeline.config import load_config
    from coba_tasks.pipeline.data_run import load_run_datasets

    cfg = load_config(ROOT / "configs/smollm2-arith.yaml", [f"model.path={model_dir}", f"data.test={args.test}"])
    test = load_run_datasets(cfg, train=False).test.sample(120, random_state=0).reset_index(drop=True)
    engine = make_backend("vllm", str(model_dir), dtype="float32", max_model_len=192, seed=0)
    try:
        with VerifierPool(workers=2, timeout_s=5.0) as pool:
            table = evaluation.evaluate(test, engine, pool, 4, 1.0, 48, 0, greedy=True, top_p=0.9)
    finally:
        engine.close()
    return {"accuracy": float(table["accuracy"].mean()), "greedy": float(table["accuracy_greedy"].mean())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="TRL's torch threads (coba-rl's engine binds every core)")
    p.add_argument("--trl-python", default="/tmp/venv-trl/bin/python")
    p.add_argument("--out", default="/tmp/peer-smollm2")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    results: dict[str, list] = {"coba": [], "trl": []}
    for k in range(args.rounds):
        print(f"round {k + 1}: coba-rl", file=sys.stderr, flush=True)
        results["coba"].append(coba_run(args, out / f"coba-r{k}"))
        print(f"round {k + 1}: TRL", file=sys.stderr, flush=True)
        results["trl"].append(trl_run(args, out / f"trl-r{k}"))
        (out / "peer.json").write_text(json.dumps(results, indent=2))
    for k in range(args.rounds):
        c, t = results["coba"][k], results["trl"][k]

        def steady(xs: list[float]) -> float:  # the first step warms up
            return sum(xs[1:]) / max(1, len(xs) - 1)

        cs = steady(c["step_s"])
        print(
            f"round {k + 1}: coba-rl {cs:.1f} s a step (generation {steady(c['generation_s']):.1f}, update "
            f"{steady(c['update_s']):.1f}); TRL {t['seconds_per_step']:.1f} s a step (generation "
            f"{t['generation_seconds_per_step']:.1f}); coba-rl / TRL {cs / t['seconds_per_step']:.2f}; held-out after: "
            f"coba-rl {c['heldout_after']}, TRL {t['heldout_after']}"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
