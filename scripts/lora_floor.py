"""How far LoRA can speed up the update on this machine: four updates of one step, alternated.

    .venv/bin/python scripts/lora_floor.py --run-dir runs/probe --step 0 --repeats 4
    .venv/bin/python scripts/lora_floor.py --repeats 4          # synthetic groups of 2-20, as coba bench update

On the same rollouts and from the same weights (SmolLM2-135M-Instruct by default): the full update,
LoRA rank 16 with peft's own layer, LoRA rank 16 with the update's one-product layer
(``coba_tasks.engines.lora.MergedLoraLinear``), and the floor: every weight frozen and no adapter at
all (one norm weight of the first layer trainable, so the backward still runs through every layer),
what LoRA would cost if its adapters cost nothing. One untimed round, then ``--repeats`` timed rounds;
prints the medians and each one's speed-up over the full update as JSON (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from peft.tuners.lora.layer import Linear as PeftLoraLinear
from transformers import AutoConfig

from coba_tasks.bench.update_bench import DEFAULT_GROUPS, DEFAULT_MODEL, run_batch, synthetic_batch
from coba_tasks.engines.lora import MergedLoraLinear
from coba_tasks.engines.update import PolicyTrainer
from coba_tasks.pipeline.run import update_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--run-dir", default=None, help="a run's step instead of synthetic groups")
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.run_dir:
        prompts, completions, adv = run_batch(args.run_dir, args.step)
    else:
        vocab = AutoConfig.from_pretrained(args.model).vocab_size
        prompts, completions, adv = synthetic_batch(DEFAULT_GROUPS, 46, 32, vocab)
    full = update_settings(lr=1e-6, micro_batch_size=16, threads=args.threads)
    lora = dataclasses.replace(full, lora_rank=16, lr=1e-5)
    kinds = {
        "full": PolicyTrainer(args.model, full, seed=0),
        "lora_peft_layer": PolicyTrainer(args.model, lora, seed=0),
        "lora_one_product": PolicyTrainer(args.model, lora, seed=0),
        "frozen_floor": PolicyTrainer(args.model, full, seed=0),
    }
    for module in kinds["lora_peft_layer"].model.modules():
        if isinstance(module, MergedLoraLinear):
            module.forward = PeftLoraLinear.forward.__get__(module)  # peft's own forward on this one
    floor = kinds["frozen_floor"].model
    keep = floor.model.layers[0].input_layernorm.weight
    for p in floor.parameters():
        p.requires_grad_(p is keep)
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    for round_ in range(args.repeats + 1):
        for name, trainer in kinds.items():
            t0 = time.perf_counter()
            trainer.update(prompts, completions, adv)
            if round_:
                seconds[name].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    print(
        json.dumps(
            {
                "rows": len(adv),
                "rows_with_advantage": int((adv != 0).sum()),
                "median_s": median,
                "speedup_vs_full": {k: median["full"] / v for k, v in median.items()},
                "runs_s": seconds,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
