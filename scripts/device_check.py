"""The device check: coba-rl's first figures on a GPU machine as it is (no vLLM, no package index).

What an engineer porting a trainer to a new GPU wants to see first: that the numbers agree with the CPU
reference, how fast, and how much memory. Every check runs in a process of its own under a time cap (a
hang costs its cap, not the machine's minutes), prints one line (``ok`` / ``FAIL``) and leaves its figures
in ``<out>/<check>.json``; ``<out>/device_check.json`` gathers them. The checks, in the order they run:

- ``env``: the GPU, the packages, ``pip check``; the random model of the size's shape, saved once for the
  checks below (``--size full``: Qwen2.5-0.5B's shape, hidden 896, 24 layers, vocabulary 151,936, tied).
- ``update``: the project's GRPO update on ragged groups (some all-equal, so their advantage is 0) in eight
  settings against the float32 full-sequence update with nothing skipped: the zero-advantage skip, the
  shared-prefix pass, bf16 autocast over float32 master weights, gradient checkpointing, LoRA; the
  gradient's agreement (relative L2 difference, cosine) and the entropy's, tokens per second, peak memory,
  and model FLOP/s against a bf16 matrix product timed in the same process.
- ``rollout``: the transformers backend at that shape: a batch of groups, tokens per second and peak memory
  beside the backend's own estimate (``rows_that_fit``); its log-probs against the trainer's, float32 and bf16.
- ``train``: ``coba run`` of ``configs/demo-tiny.yaml`` (Prefect, the five stages, the transformers backend) on
  the tiny arithmetic model, 6 steps at size full: held-out avg@16 before and after, and the gain it must
  reach (``--min-gain``, 0.02 at size full).
- ``checkpoint``: save and load a trainer after one update: weights and AdamW state identical after the
  reload; seconds and GB/s; and the next update from the reloaded trainer repeats the straight one bit for bit
  (loss, grad norm), which a resume's replay of the updates since a checkpoint needs.
- ``tests``: ``tests/core`` and ``tests/engines`` under pytest on this machine: which pass, which fail and the
  first line of why; those that need a package that is not here are counted apart.
- ``fsdp``: one FSDP rank (NCCL on CUDA, gloo on CPU) against the single-process update, float32.

On the lent GPU machine (one H100 or H200, Python 3.12 with torch, transformers, peft, safetensors, pandas,
pyarrow, scipy, pytest; no vLLM, Prefect, pydantic or math-verify, no package index, at most 64 MiB travels;
it stays warm only 30 s after a call, so plan one call):

1. here, once (after ``make setup``): ``.venv/bin/python scripts/device_check.py --wheels .whl``: into ``.whl/``
   (ignored by git) the wheels of Prefect, pydantic, math-verify and what they need that the machine lacks, or
   needs at another version than the machine may have (about 100 wheels, under 52 MiB), and the train check's
   model ``models/arith-tiny`` when it is missing (``coba bootstrap``, about 7 minutes; 0.5 MB, it travels);
2. the device tool's ``run`` with ``carry: [".whl", "models/arith-tiny"]``, ``timeout_s: 590`` and the command
   ``bash scripts/device_check.sh`` (it installs the wheels beside the machine's packages, then runs this
   script with ``--budget 540``: 9 minutes, the checks' caps scaled to fit, so that the machine's start and
   this fit in its 15); the tests that need vLLM are skipped there, a package the machine lacks is counted
   apart, never as a failure;
3. ``$OUT/device_check.json`` (every check's line and figures) and ``$OUT/device_check.tar.gz`` (the logs)
   come back; put the figures, the date and the machine in docs/real_models.md.

Here, on CPU (the test suite runs this at ``--size tiny``, so it cannot rot)::

    python scripts/device_check.py --size tiny --out runs/device-check --tiny-model models/arith-tiny
    python scripts/device_check.py --only update,rollout --size tiny --out runs/device-check
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from coba_tasks.engines.fileio import (  # noqa: E402
    OutputDirError,
    check_output_dir,
    files_of,
    fresh_marked_dir,
    new_temporary_dir,
    publish_dir,
)

MARKER = ".device-check"  # marks an output folder this script made (and may replace)
REPORT = "device_check.json"


@dataclass(frozen=True)
class Size:
    """The random model's shape and the work each check does at one size."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    group_sizes: tuple[int, ...]  # the update's ragged groups
    prompt_len: tuple[int, int]  # low, high (uniform)
    completion_len: tuple[int, int]
    micro_batch: int
    matmul: int  # the square bf16 (CUDA) / float32 (CPU) matrix product timed beside the update
    rollout_groups: int  # the rollout check's batch: groups x samples, prompt tokens, new tokens
    rollout_n: int
    rollout_prompt: int
    rollout_tokens: int
    train: tuple[str, ...]  # the train check: configs/demo-tiny.yaml with these overrides (coba run --set)
    caps: dict[str, float]  # each check's time cap, seconds


FULL = Size(
    name="full",
    hidden=896,
    intermediate=4864,
    layers=24,
    heads=14,
    kv_heads=2,
    vocab=151936,
    group_sizes=(16, 12, 8, 8, 4, 16, 6, 2),
    prompt_len=(64, 256),
    completion_len=(16, 512),
    micro_batch=8,
    matmul=8192,
    rollout_groups=16,
    rollout_n=16,
    rollout_prompt=128,
    rollout_tokens=256,
    train=("run.steps=6", "run.eval_every=0"),  # make demo-tiny's first 6 steps: 128 x 16 rollouts, avg@16 of 500
    # 480 s of the 540 s budget: a margin for the checks' own start-up and the report
    caps={"env": 35, "update": 90, "rollout": 55, "train": 100, "checkpoint": 55, "tests": 85, "fsdp": 60},
)
TINY = Size(
    name="tiny",
    hidden=64,
    intermediate=128,
    layers=2,
    heads=4,
    kv_heads=2,
    vocab=512,
    group_sizes=(4, 3, 2, 4),
    prompt_len=(4, 12),
    completion_len=(1, 16),
    micro_batch=4,
    matmul=256,
    rollout_groups=3,
    rollout_n=4,
    rollout_prompt=8,
    rollout_tokens=16,
    train=(
        "run.steps=2",
        "run.eval_every=0",
        "run.eval_samples=2",
        "data.prompts_per_step=8",
        "data.train_prompts=64",
        "data.eval_prompts=16",
        "allocation.group_size=4",
        "allocation.max_budget=8",
    ),
    caps={"env": 60, "update": 120, "rollout": 60, "train": 240, "checkpoint": 60, "tests": 120, "fsdp": 120},
)
SIZES = {s.name: s for s in (FULL, TINY)}
# the most informative first: the machine and the model, the update and the rollouts on this GPU, a training run
# end to end, the checkpoints a resume needs, the tests' verdicts, then one FSDP rank
CHECKS = ("env", "update", "rollout", "train", "checkpoint", "tests", "fsdp")
MIN_CAP_S = 15.0  # a check that would get less than this of the budget is skipped
DEFAULT_BUDGET_S = 540.0  # the device tool's run: timeout_s 590, the machine's start and return inside 15 minutes

# Agreement a check requires (the update's gradient: relative L2 difference from the float32 reference)
FP32_GRAD_TOL = 1e-3  # float32 paths that compute the same sum in another order
BF16_GRAD_TOL = 0.1  # bf16 autocast against float32
BF16_MIN_COSINE = 0.99
FP32_LOGPROB_TOL = 1e-3  # sampler against trainer log-prob, float32 (largest over every token)
BF16_LOGPROB_MEAN_TOL = 0.05  # bf16: the mean |difference| over the tokens


# What the checks import that the lent GPU machine lacks: these and what they need, less what is there
WHEEL_ROOTS = ("prefect", "pydantic", "math-verify")
WHEELS_MAX_MIB = 52  # of the 64 MiB that travel: the working tree takes about 6
WHEELS_RECORD = "wheels.json"  # in a --wheels folder: the files the last run wrote (all a rerun replaces)
# The Python packages of the lent GPU machine's image ('cuda', as listed on 2026-11-17): not carried.
_GPU_IMAGE = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
    cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
    fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize hypothesis idna
    imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
    lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
    matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
    pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
    pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
    setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
    typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
GPU_IMAGE_PACKAGES = frozenset(_GPU_IMAGE.split())
# the GPU machine's interpreter, for the markers of the packages' requirements and the wheels' tags
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
MANYLINUX = ("manylinux1", "manylinux2014", *(f"manylinux_2_{n}" for n in (5, 17, 24, 27, 28, 31, 34, 35)))


def _norm(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_set(roots: Sequence[str] = WHEEL_ROOTS) -> dict[str, str]:
    """The packages ``roots`` need on the GPU machine (name: the version installed here), every requirement
    followed as the GPU machine's Python evaluates its markers, less the packages its image has, but those a
    carried package requires at a version (pydantic: typing-extensions>=4.16; prefect: packaging<26.3): the
    image's version is not known to satisfy it, the version installed here does (``carried_conflicts`` checks
    the result on the machine)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    done: set[tuple[str, str]] = set()  # (package, extra) followed
    todo: list[tuple[str, str]] = [(root, "") for root in roots]
    while todo:
        name, extra = todo.pop()
        name = _norm(name)
        if (name, extra) in done:
            continue
        done.add((name, extra))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: run `make setup` first, then this again") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**GPU_PYTHON, "extra": extra}):
                todo += [(req.name, "")] + [(req.name, e) for e in req.extras]  # sqlalchemy[asyncio]: greenlet
    carried = {name for name in found if name not in GPU_IMAGE_PACKAGES}
    constrained = {_norm(req.name) for name in carried for req in _requirements(name) if str(req.specifier)}
    keep = carried | (constrained & set(found))
    return {name: version for name, version in sorted(found.items()) if name in keep}


def _requirements(name: str) -> list[Any]:
    """The requirements of the installed package ``name`` that apply on the GPU machine's Python (no extra)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    reqs = [Requirement(line) for line in md.distribution(name).requires or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(dict(GPU_PYTHON))]


def carried_conflicts(site: Path) -> list[str]:
    """What the packages installed in ``site`` (the carried wheels) require that this interpreter does not
    give, one line each ("prefect 3.7.7 needs packaging<26.3, finds 26.4"): the wheels' versions checked
    against the machine's, not only ``pip check``'s word. Empty: every requirement met."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    problems = []
    for dist in md.distributions(path=[str(site)]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(dict(GPU_PYTHON) | {"extra": ""}):
                continue
            try:
                found = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} {dist.version} needs {req}, finds none")
                continue
            if req.specifier and not req.specifier.contains(found, prereleases=True):
                problems.append(f"{dist.metadata['Name']} {dist.version} needs {req}, finds {found}")
    return sorted(set(problems))


def make_wheels(folder: Path) -> int:
    """Download the wheels of ``wheel_set`` for the GPU machine (CPython 3.12, x86-64 Linux) into ``folder``: a new
    or empty folder, or one an earlier run filled, whose wheels (those its record ``WHEELS_RECORD`` lists) the new
    set replaces. A folder holding anything else is refused before any download, nothing in it removed."""
    try:
        check_output_dir(folder, WHEELS_RECORD, "device_check.py --wheels folder")
    except OutputDirError as exc:
        raise SystemExit(f"--wheels: {exc}") from None
    packages = wheel_set()
    tmp = new_temporary_dir(folder)  # filled, checked, then put in place: a failed run leaves the folder as it was
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        cmd += ["--dest", str(tmp), "--python-version", "3.12", "--implementation", "cp"]
        cmd += [a for tag in MANYLINUX for a in ("--platform", f"{tag}_x86_64")]
        cmd += [f"{name}=={version}" for name, version in packages.items()]
        if subprocess.run(cmd).returncode != 0:
            return 1
        wheels = sorted(tmp.glob("*.whl"))
        mib = sum(w.stat().st_size for w in wheels) / 2**20
        print(f"{len(wheels)} wheels ({', '.join(sorted(packages)[:6])}, ...) in {folder}: {mib:.1f} MiB")
        if len(wheels) != len(packages) or mib > WHEELS_MAX_MIB:
            print(f"expected {len(packages)} wheels of at most {WHEELS_MAX_MIB} MiB together", file=sys.stderr)
            return 1
        (tmp / WHEELS_RECORD).write_text(json.dumps({"files": files_of(tmp)}, indent=1) + "\n")
        for left in publish_dir(tmp, folder, WHEELS_RECORD):
            print(f"kept {left}: written into {folder} after the check, not by this script", file=sys.stderr)
        return 0
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


# ---------------------------------------------------------------------------------------------
# The parent: one process per check, each under its cap; the report
# ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The device check: coba-rl's update, rollouts, checkpoints, FSDP, a short training run and "
        "the core and engine tests on this machine (CUDA when it has a GPU), one line per check.",
        epilog="examples:\n"
        "  python scripts/device_check.py --out runs/device-check                  # full size (a GPU)\n"
        "  python scripts/device_check.py --size tiny --out runs/device-check      # CPU, seconds a check\n"
        "  python scripts/device_check.py --only update,rollout --out runs/device-check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/device-check", help="output folder (model, runs, figures)")
    parser.add_argument("--size", default="full", choices=sorted(SIZES), help="full: Qwen2.5-0.5B's shape (default)")
    parser.add_argument("--only", default="", help=f"comma-separated checks to run (default all: {','.join(CHECKS)})")
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        help=f"seconds for all checks together (default {DEFAULT_BUDGET_S:.0f}); their caps are scaled down to fit",
    )
    parser.add_argument(
        "--site",
        default="/tmp/site",
        help="where scripts/device_check.sh installed the carried wheels: the env check checks their requirements",
    )
    parser.add_argument("--tiny-model", default="models/arith-tiny", help="the train check's model (coba bootstrap)")
    parser.add_argument(
        "--min-gain",
        type=float,
        default=None,
        help="held-out avg@k gain the train check must reach (default: none at size tiny, 0.02 at size full)",
    )
    parser.add_argument("--tests", default="tests/core tests/engines", help="the tests check's pytest paths")
    parser.add_argument(
        "--wheels",
        metavar="DIR",
        help="only prepare the GPU machine's run: download the wheels it lacks into DIR (new, empty or an earlier "
        "--wheels DIR) and build the train check's model (--tiny-model) when it is missing",
    )
    parser.add_argument("--run-check", help=argparse.SUPPRESS)  # a child: run this one check
    args = parser.parse_args(argv)
    if args.wheels:
        return make_wheels(Path(args.wheels)) or build_tiny_model(args.tiny_model)
    size = SIZES[args.size]
    out = Path(args.out).resolve()
    if args.run_check:
        return _child(args.run_check, size, out, args)
    only = [c for c in args.only.split(",") if c] or list(CHECKS)
    unknown = sorted(set(only) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; the checks are {', '.join(CHECKS)}")
    try:  # never deletes a folder this script did not make
        fresh_marked_dir(out, MARKER, "scripts/device_check.py")
    except OutputDirError as exc:
        print(exc, file=sys.stderr)
        return 2
    started = time.monotonic()
    results = []
    names = [c for c in CHECKS if c in only]
    caps = fitted_caps({n: size.caps[n] for n in names}, args.budget)
    if caps != {n: size.caps[n] for n in names}:
        print(f"the checks' caps ({sum(size.caps[n] for n in names):.0f} s) scaled to the budget ({args.budget:.0f} s)")
    for name in names:
        left = args.budget - (time.monotonic() - started)
        cap = min(caps[name], left)
        if cap < MIN_CAP_S:
            result = {"name": name, "ok": False, "detail": f"skipped: {left:.0f} s of the budget left", "figures": {}}
        else:
            result = _run_child(name, args, cap, out)
        results.append(result)
        print(_line(result), flush=True)
    failed = [r["name"] for r in results if not r["ok"]]
    report = {
        "ok": not failed,
        "size": size.name,
        "seconds": round(time.monotonic() - started, 1),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "checks": results,
    }
    (out / REPORT).write_text(json.dumps(report, indent=2))
    print(f"{len(results) - len(failed)}/{len(results)} checks passed in {report['seconds']:.0f} s; {out / REPORT}")
    return 1 if failed else 0


def fitted_caps(caps: dict[str, float], budget: float) -> dict[str, float]:
    """Each check's cap, scaled down together so that they add up to ``budget`` at most: the last check gets
    its share instead of the budget's leftovers.

    >>> fitted_caps({"env": 40, "update": 100}, 70), fitted_caps({"env": 40}, 480)
    ({'env': 20.0, 'update': 50.0}, {'env': 40})
    """
    total = sum(caps.values())
    if total <= budget:
        return caps
    return {name: cap * budget / total for name, cap in caps.items()}


def build_tiny_model(path: str) -> int:
    """The train check's model, built here (``coba bootstrap``, about 7 minutes on 2 cores) when ``path`` holds
    none: the one model the GPU run needs that it cannot make in its budget."""
    model = Path(path) if Path(path).is_absolute() else ROOT / path
    if (model / "config.json").is_file():
        print(f"the train check's model is at {model}")
        return 0
    print(f"building the train check's model at {model} (coba bootstrap, about 7 minutes on 2 cores)", flush=True)
    cmd = [sys.executable, "-m", "coba_tasks.commands.cli", "bootstrap", "--out", str(model)]
    return subprocess.run(cmd, cwd=ROOT).returncode


def _line(result: dict[str, Any]) -> str:
    return f"{'ok  ' if result['ok'] else 'FAIL'}  {result['name']}: {result['detail']}"


def _run_child(name: str, args: argparse.Namespace, cap: float, out: Path) -> dict[str, Any]:
    """Run check ``name`` in its own process, killed after ``cap`` seconds; its result (or why there is none)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-check", name, "--size", args.size, "--out", str(out)]
    cmd += ["--tiny-model", args.tiny_model, "--tests", args.tests, "--site", args.site]
    cmd += ["--min-gain", str(args.min_gain)] if args.min_gain is not None else []
    log = out / f"{name}.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        # a session of its own: past the cap the whole group goes (torchrun's ranks, Prefect's server, pytest's
        # workers), so that nothing of a hung check keeps the GPU from the next
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = child.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            rc = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # also what a finished check left running
        child.wait()
    seconds = time.monotonic() - t0
    path = out / f"{name}.json"
    if path.is_file():
        result = json.loads(path.read_text())
        result["seconds"] = round(seconds, 1)
        result["detail"] += f" [{seconds:.0f} s]"
        return result
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
    why = f"no result within its cap of {cap:.0f} s" if rc is None else f"exit status {rc}"
    return {
        "name": name,
        "ok": False,
        "detail": f"{why}; last line: {tail[0][:300]} (log: {log})",
        "figures": {},
        "seconds": round(seconds, 1),
    }


def _child(name: str, size: Size, out: Path, args: argparse.Namespace) -> int:
    """One check in this process: its result is written to ``<out>/<name>.json`` (a crash writes none)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    ok, detail, figures = CHECK_FUNCTIONS[name](size, out, args)
    result = {"name": name, "ok": bool(ok), "detail": detail, "figures": figures}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=float))
    return 0


# ---------------------------------------------------------------------------------------------
# Shared pieces: the device, the model, the batch, timing
# ---------------------------------------------------------------------------------------------


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    """Free what earlier work left (a trainer's reference cycles included) and start the peak anew."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    """Peak GPU memory allocated since ``_reset_peak`` (GiB); on CPU, the process's peak resident memory."""
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def model_dir(out: Path) -> Path:
    return out / "model"


def build_model(size: Size, out: Path) -> Path:
    """A randomly initialised Qwen2 causal LM of ``size``'s shape (tied embeddings) with the character
    tokenizer, saved in Hugging Face layout (bf16 on CUDA, float32 on CPU); built on the device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coba_tasks.engines.model import build_char_tokenizer

    tok = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=4096,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(_device()):
        model = Qwen2ForCausalLM(config)
    if _device() == "cuda":
        model = model.to(torch.bfloat16)
    path = model_dir(out)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def ragged_batch(size: Size, seed: int = 0):
    """A step's rollouts: one random prompt per group (``size.group_sizes``), completions of random lengths,
    rewards with variance in most groups and none in two (all 1, all 0: advantage 0, skipped by the update).
    Returns (prompt ids, completion ids, advantages, group ids)."""
    import numpy as np
    import torch

    from coba_tasks.core.grpo import group_advantages

    rng = np.random.default_rng(seed)
    prompts, completions, rewards, groups = [], [], [], []
    for g, n in enumerate(size.group_sizes):
        prompt = rng.integers(4, size.vocab, size=int(rng.integers(*size.prompt_len))).tolist()
        for j in range(n):
            prompts.append(prompt)
            completions.append(rng.integers(4, size.vocab, size=int(rng.integers(*size.completion_len))).tolist())
            groups.append(g)
            if g == 1:
                rewards.append(1.0)
            elif g == 3:
                rewards.append(0.0)
            else:
                rewards.append(float(j % 2 == 0) if n > 1 else 1.0)
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups)).numpy()
    return prompts, completions, adv, np.array(groups)


def model_params(size: Size) -> tuple[float, float]:
    """(parameters, parameters a token's forward multiplies by: every matrix but the embedding lookup, the
    tied output projection counted once as the head)."""
    attn = size.hidden * size.hidden * 2 + 2 * size.hidden * (size.hidden // size.heads) * size.kv_heads
    mlp = 3 * size.hidden * size.intermediate
    body = size.layers * (attn + mlp)
    return body + size.vocab * size.hidden, body + size.vocab * size.hidden


def matmul_flops(n: int, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matrix product (bf16 on CUDA, float32 on CPU), the mean of ``repeats`` after
    three warm-ups."""
    import torch

    dtype = torch.bfloat16 if _device() == "cuda" else torch.float32
    a = torch.randn(n, n, device=_device(), dtype=dtype)
    b = torch.randn(n, n, device=_device(), dtype=dtype)
    for _ in range(3):
        a @ b
    _sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync()
    return 2 * n**3 * repeats / (time.perf_counter() - t0)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ---------------------------------------------------------------------------------------------
# env
# ---------------------------------------------------------------------------------------------


def check_env(size: Size, out: Path, args: argparse.Namespace) -> tuple[bool, str, dict[str, Any]]:
    """The machine, the packages and the random model every later check reads."""
    import importlib.metadata as md

    import torch

    figures: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    for pkg in ("transformers", "peft", "safetensors", "pandas", "pyarrow", "prefect", "pydantic", "math-verify"):
        try:
            figures[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            figures[pkg] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        figures |= {
            "device": p.name,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}",
            "multiprocessors": p.multi_processor_count,
            "cuda": torch.version.cuda,
        }
    else:
        figures |= {"device": "cpu", "threads": torch.get_num_threads()}
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=60)
        problems = [line for line in done.stdout.splitlines() if line.strip() and "No broken" not in line]
    except (OSError, subprocess.TimeoutExpired) as exc:
        problems = [f"pip check did not run: {exc}"]
    ours = ("prefect", "pydantic", "math-verify", "coba-rl", "pip check")
    figures["pip_check"] = [line for line in problems if line.lower().startswith(ours)][:20]
    site = Path(args.site)
    figures["carried_site"] = str(site) if site.is_dir() else None
    figures["carried_conflicts"] = carried_conflicts(site)[:20] if site.is_dir() else []
    t0 = time.perf_counter()
    path = build_model(size, out)
    figures["model_build_s"] = round(time.perf_counter() - t0, 1)
    figures["model_params"], _ = model_params(size)
    missing = [k for k in ("prefect", "pydantic") if figures[k] is None]
    detail = (
        f"{figures['device']}, torch {figures['torch']}, transformers {figures['transformers']}, "
        f"prefect {figures['prefect']}; random {size.name} model ({figures['model_params'] / 1e6:.0f} M parameters) "
        f"built in {figures['model_build_s']} s at {path}"
    )
    if missing:
        detail += f"; missing: {', '.join(missing)} (here: python scripts/device_check.py --wheels .whl; carry .whl)"
    if figures["carried_conflicts"]:
        first = figures["carried_conflicts"][0]
        detail += (
            f"; {len(figures['carried_conflicts'])} requirement(s) of the carried wheels unmet, the first: {first}"
        )
    if figures["pip_check"]:
        detail += f"; pip check: {len(figures['pip_check'])} conflict(s) of the carried packages"
    return not missing and not figures["carried_conflicts"], detail, figures


# ---------------------------------------------------------------------------------------------
# update
# ---------------------------------------------------------------------------------------------

# name: (dtype, shared prefix, skip zero advantages, gradient checkpointing, LoRA rank)
UPDATE_VARIANTS: dict[str, tuple[str, bool, bool, bool, int]] = {
    "fp32-full": ("float32", False, False, False, 0),  # the reference: every row, padded full sequences
    "fp32-full-skip": ("float32", False, True, False, 0),
    "fp32-shared-skip": ("float32", True, True, False, 0),
    "bf16-full": ("bfloat16", False, False, False, 0),
    "bf16-shared-skip": ("bfloat16", True, True, False, 0),  # the GPU default
    "bf16-shared-skip-ckpt": ("bfloat16", True, True, True, 0),
    "bf16-lora": ("bfloat16", True, True, False, 16),
    "bf16-lora-ckpt": ("bfloat16", True, True, True, 16),
}
# each variant's comparison: (against, gradient tolerance, minimal cosine); None = none (LoRA's gradient is
# of the adapters: its entropy is compared, and its loss)
UPDATE_COMPARISONS: dict[str, tuple[str, float, float] | None] = {
    "fp32-full-skip": ("fp32-full", FP32_GRAD_TOL, 0.9999),
    "fp32-shared-skip": ("fp32-full", FP32_GRAD_TOL, 0.9999),
    "bf16-full": ("fp32-full", BF16_GRAD_TOL, BF16_MIN_COSINE),
    "bf16-shared-skip": ("fp32-full", BF16_GRAD_TOL, BF16_MIN_COSINE),
    "bf16-shared-skip-ckpt": ("bf16-shared-skip", BF16_GRAD_TOL, BF16_MIN_COSINE),
    "bf16-lora": None,
    "bf16-lora-ckpt": None,
}


def update_tokens(prompts, completions, adv, groups, shared: bool, skip: bool) -> tuple[int, int]:
    """(tokens through forward and backward, tokens through a forward without gradients) of one update of one
    optimizer step: the full-sequence path runs every trained row's prompt and completion twice (logp_old,
    then the pass with gradients); the shared-prefix path runs each trained group's prompt once and each
    trained row's completion, once."""
    trained = [i for i in range(len(prompts)) if not (skip and adv[i] == 0)]
    if shared:
        first = {int(groups[i]): i for i in reversed(trained)}
        return sum(len(prompts[i]) for i in first.values()) + sum(len(completions[i]) for i in trained), 0
    tokens = sum(len(prompts[i]) + len(completions[i]) for i in trained)
    return tokens, tokens


def run_update(path: Path, size: Size, variant: str, batch) -> dict[str, Any]:
    """One update of ``variant`` from the saved model: its metrics, seconds, peak memory, and the gradient
    at its optimizer step (flattened, float32; LoRA: the adapters')."""
    import torch

    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    dtype, shared, skip, ckpt, rank = UPDATE_VARIANTS[variant]
    settings = update_settings(
        lr=1e-6,
        max_grad_norm=1e9,  # the raw gradient is compared: no clipping
        micro_batch_size=size.micro_batch,
        dtype=dtype,
        shared_prefix=shared,
        skip_zero_advantage=skip,
        gradient_checkpointing=ckpt,
        lora_rank=rank,
        lora_alpha=32.0,
        threads=torch.get_num_threads(),
    )
    _reset_peak()  # the last variant's trainer gone before this one loads
    trainer = PolicyTrainer(path, settings, seed=0)
    grads: list[torch.Tensor] = []
    real_step = trainer.optimizer.step

    def step(*a, **k):
        grads.append(torch.cat([_grad(p).detach().float().flatten() for p in trained_params]))
        return real_step(*a, **k)

    trained_params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.optimizer.step = step
    prompts, completions, adv, groups = batch
    _reset_peak()
    _sync()
    t0 = time.perf_counter()
    try:
        metrics = trainer.update(prompts, completions, adv, None, groups)
        _sync()
    finally:
        del trainer.optimizer.step  # the optimizer's own step again: no reference cycle keeps the trainer alive
    seconds = time.perf_counter() - t0
    peak = _peak_gib()
    del trainer
    return {"metrics": metrics, "seconds": seconds, "peak_gib": peak, "grad": grads[0]}


def _grad(p):
    import torch

    return p.grad if p.grad is not None else torch.zeros_like(p)


def check_update(size: Size, out: Path, args: argparse.Namespace) -> tuple[bool, str, dict[str, Any]]:
    import torch

    path = model_dir(out)
    batch = ragged_batch(size)
    prompts, completions, adv, groups = batch
    matmul = matmul_flops(size.matmul)
    _, per_token = model_params(size)
    figures: dict[str, Any] = {
        "matmul_tflops": matmul / 1e12,
        "rows": len(prompts),
        "zero_advantage_rows": int((adv == 0).sum()),
        "completion_tokens": sum(map(len, completions)),
        "variants": {},
    }
    runs: dict[str, dict[str, Any]] = {}
    failures = []
    for variant in UPDATE_VARIANTS:
        try:
            run = run_update(path, size, variant, batch)
        except Exception as exc:  # one variant's failure is a finding, not the end of the check
            figures["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            failures.append(f"{variant} failed ({type(exc).__name__})")
            continue
        _, shared, skip, _, _ = UPDATE_VARIANTS[variant]
        grad_tokens, nograd_tokens = update_tokens(prompts, completions, adv, groups, shared, skip)
        flops = 6 * per_token * grad_tokens + 2 * per_token * nograd_tokens
        m = run["metrics"]
        row = {
            "seconds": round(run["seconds"], 3),
            "peak_gib": round(run["peak_gib"], 2),
            "tokens_per_s": round((grad_tokens + nograd_tokens) / run["seconds"], 1),
            "model_tflops": flops / run["seconds"] / 1e12,
            "share_of_matmul": flops / run["seconds"] / matmul,
            "loss": m["loss"],
            "entropy": m["entropy"],
            "grad_norm": float(run["grad"].norm()),
            "skipped_rows": m["skipped_rows"],
        }
        runs[variant] = run
        against = UPDATE_COMPARISONS.get(variant)
        if against is not None and against[0] in runs:
            ref, tol, min_cos = runs[against[0]], against[1], against[2]
            g, r = run["grad"], ref["grad"]
            rel = float((g - r).norm() / r.norm())
            cos = float(torch.nn.functional.cosine_similarity(g, r, dim=0))
            row |= {
                "against": against[0],
                "grad_rel_diff": rel,
                "grad_cosine": cos,
                "entropy_rel_diff": _rel(m["entropy"], ref["metrics"]["entropy"]),
                "loss_diff": abs(m["loss"] - ref["metrics"]["loss"]),
            }
            if not (rel <= tol and cos >= min_cos):
                failures.append(f"{variant}: gradient off {against[0]}'s by {rel:.2e} (cosine {cos:.5f}; tol {tol:g})")
        elif variant.startswith("bf16-lora"):  # LoRA's B starts at 0: the same forward as the model without it
            ref = runs.get("bf16-shared-skip")
            if ref is not None:
                row["entropy_rel_diff"] = _rel(m["entropy"], ref["metrics"]["entropy"])
                if row["entropy_rel_diff"] > 1e-2 or not math.isfinite(row["grad_norm"]) or row["grad_norm"] == 0:
                    failures.append(f"{variant}: entropy off by {row['entropy_rel_diff']:.2e} or no gradient")
        figures["variants"][variant] = row
        for r in runs.values():  # keep only the references' gradients
            if r is not run and r is not runs.get("fp32-full") and r is not runs.get("bf16-shared-skip"):
                r["grad"] = None
        if _device() == "cuda":
            torch.cuda.empty_cache()
    v = figures["variants"]
    best = v.get("bf16-shared-skip", {})
    detail = (
        f"{len(prompts)} rows ({figures['zero_advantage_rows']} at advantage 0), {len(UPDATE_VARIANTS)} settings; "
        f"bf16 shared-prefix: {best.get('tokens_per_s', float('nan')):.0f} tokens/s, "
        f"{best.get('peak_gib', float('nan')):.1f} GiB, {best.get('share_of_matmul', float('nan')):.0%} of a "
        f"{size.matmul}^3 matmul's {matmul / 1e12:.1f} TFLOP/s; gradient vs float32: "
        f"{best.get('grad_rel_diff', float('nan')):.1e}"
    )
    if failures:
        detail += "; " + "; ".join(failures)
    return not failures, detail, figures


# ---------------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------------


def _rollout_requests(size: Size, groups: int, n: int, prompt_len: int, seed: int = 0):
    import numpy as np

    from coba_tasks.engines.rollout import RolloutRequest

    rng = np.random.default_rng(seed)
    return [
        RolloutRequest(f"p{g}", tuple(rng.integers(4, size.vocab, size=prompt_len).tolist()), n=n, seed=1000 + g)
        for g in range(groups)
    ]


def _sampler_gap(path: Path, size: Size, dtype: str, requests, rows) -> dict[str, float]:
    """The trainer's own log-probs of ``rows``' tokens against the sampler's (``logprob_diff_*`` of an
    update with zero advantages and nothing skipped)."""
    import numpy as np

    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    by_id = {r.prompt_id: r.prompt_token_ids for r in requests}
    settings = update_settings(lr=1e-6, micro_batch_size=size.micro_batch, dtype=dtype, skip_zero_advantage=False)
    trainer = PolicyTrainer(path, settings, seed=0)
    metrics = trainer.update(
        [by_id[r.prompt_id] for r in rows], [r.token_ids for r in rows], np.zeros(len(rows)), [r.logprobs for r in rows]
    )
    return {"mean": metrics["logprob_diff_mean"], "max": metrics["logprob_diff_max"]}


def check_rollout(size: Size, out: Path, args: argparse.Namespace) -> tuple[bool, str, dict[str, Any]]:
    import torch

    from coba_tasks.engines.rollout import SamplingConfig, make_backend

    path = model_dir(out)
    failures = []
    figures: dict[str, Any] = {}
    engine_dtype = "bfloat16" if _device() == "cuda" else "float32"
    _reset_peak()
    engine = make_backend("transformers", path, dtype=engine_dtype, gpu_memory_utilization=0.5)
    weights_gib = _peak_gib()
    requests = _rollout_requests(size, size.rollout_groups, size.rollout_n, size.rollout_prompt)
    sampling = SamplingConfig(temperature=1.0, max_tokens=size.rollout_tokens)
    engine.generate(requests[:1], SamplingConfig(temperature=1.0, max_tokens=4))  # warm-up
    _reset_peak()
    _sync()
    t0 = time.perf_counter()
    rows = engine.generate(requests, sampling)
    _sync()
    seconds = time.perf_counter() - t0
    tokens = sum(r.n_tokens for r in rows)
    figures["throughput"] = {
        "dtype": engine_dtype,
        "sequences": len(rows),
        "rows_per_batch": engine.max_rows(size.rollout_prompt, size.rollout_tokens),
        "new_tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_gib": round(_peak_gib(), 2),
        "weights_gib": round(weights_gib, 2),
    }
    engine.close()
    del engine
    # log-probs against the trainer's: a smaller batch, float32 and the engine's dtype
    small = _rollout_requests(size, 4, 4, min(size.rollout_prompt, 64), seed=1)
    short = SamplingConfig(temperature=1.0, max_tokens=min(size.rollout_tokens, 64))
    for dtype in dict.fromkeys(("float32", engine_dtype)):
        engine = make_backend("transformers", path, dtype=dtype)
        got = engine.generate(small, short)
        engine.close()
        del engine
        gap = _sampler_gap(path, size, dtype, small, got)
        figures[f"logprob_gap_{dtype}"] = gap
        bad = gap["max"] > FP32_LOGPROB_TOL if dtype == "float32" else gap["mean"] > BF16_LOGPROB_MEAN_TOL
        if bad or not math.isfinite(gap["mean"]):
            failures.append(f"{dtype} sampler log-probs off the trainer's by {gap['mean']:.2e} (max {gap['max']:.2e})")
        if _device() == "cuda":
            torch.cuda.empty_cache()
    t = figures["throughput"]
    gaps = ", ".join(
        f"{k.removeprefix('logprob_gap_')} mean {v['mean']:.1e} max {v['max']:.1e}"
        for k, v in figures.items()
        if k.startswith("logprob_gap_")
    )
    detail = (
        f"{t['sequences']} sequences ({t['rows_per_batch']} a batch) of {size.rollout_prompt} + up to "
        f"{size.rollout_tokens} tokens, {engine_dtype}: {t['tokens_per_s']:.0f} new tokens/s, peak "
        f"{t['peak_gib']:.1f} GiB (weights {t['weights_gib']:.1f}); sampler vs trainer log-prob: {gaps}"
    )
    if failures:
        detail += "; " + "; ".join(failures)
    return not failures, detail, figures


# ---------------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------------


def _trainer_state(trainer) -> dict[str, Any]:
    """Every weight and every AdamW tensor of a trainer, on the CPU."""
    from coba_tasks.engines.checkpoint import optimizer_to_tensors

    weights = {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
    tensors, _ = optimizer_to_tensors(trainer.optimizer)
    return {"weights": weights, "optimizer": {k: v.detach().cpu().clone() for k, v in tensors.items()}}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    out = []
    for part in ("weights", "optimizer"):
        if set(a[part]) != set(b[part]):
            out.append(f"{part}: other tensors")
            continue
        out += [f"{part}:{k}" for k in a[part] if not torch.equal(a[part][k], b[part][k])]
    return out


def check_checkpoint(size: Size, out: Path, args: argparse.Namespace) -> tuple[bool, str, dict[str, Any]]:
    import torch

    from coba_tasks.engines.checkpoint import verify_checkpoint
    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    path = model_dir(out)
    dtype = "bfloat16" if _device() == "cuda" else "float32"
    settings = update_settings(lr=1e-6, micro_batch_size=size.micro_batch, dtype=dtype)
    prompts, completions, adv, groups = ragged_batch(size)
    trainer = PolicyTrainer(path, settings, seed=0)
    trainer.update(prompts, completions, adv, None, groups)
    before = _trainer_state(trainer)
    ckpt = out / "checkpoint"
    _sync()
    t0 = time.perf_counter()
    trainer.save_checkpoint(ckpt, extra_state={"step": 0})
    save_s = time.perf_counter() - t0
    size_gb = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 1e9
    t0 = time.perf_counter()
    verify_checkpoint(ckpt)
    verify_s = time.perf_counter() - t0
    # the next update, here and (below) from the reloaded checkpoint: a resume replays updates from the tables
    # and needs them to repeat bit for bit, weights included (docs/operations.md, "Checkpoints and replay"); on
    # CUDA the trainer's updates run with torch's deterministic kernels: their cost is measured against one without
    straight = trainer.update(prompts, completions, adv, None, groups)
    _sync()
    t0 = time.perf_counter()
    straight_digest = trainer.params_digest()
    _sync()
    digest_s = time.perf_counter() - t0
    del trainer
    if _device() == "cuda":
        torch.cuda.empty_cache()
    fresh = PolicyTrainer(path, settings, seed=1)
    _sync()
    t0 = time.perf_counter()
    state = fresh.load_checkpoint(ckpt)
    _sync()
    load_s = time.perf_counter() - t0
    differ = _differences(before, _trainer_state(fresh))
    # and the next update from the reloaded trainer runs (its optimizer state on the device), as it ran straight on
    replayed, deterministic_s = _timed_update(fresh, (prompts, completions, adv, None, groups))
    ops = list(fresh.not_repeatable)
    same_figures = all(straight[k] == replayed[k] for k in ("loss", "grad_norm"))
    repeats = same_figures and fresh.params_digest() == straight_digest
    del fresh
    free = PolicyTrainer(path, settings, seed=1)  # the same update from the same checkpoint, kernels left free
    free.load_checkpoint(ckpt)
    import coba_tasks.engines.update as update_module

    real = update_module.deterministic_kernels
    update_module.deterministic_kernels = lambda enabled: real(False)
    try:
        _, free_s = _timed_update(free, (prompts, completions, adv, None, groups))
    finally:
        update_module.deterministic_kernels = real
    free_repeats = free.params_digest() == straight_digest
    del free
    figures = {
        "dtype": dtype,
        "size_gb": round(size_gb, 3),
        "save_s": round(save_s, 2),
        "save_gb_per_s": round(size_gb / save_s, 2),
        "verify_s": round(verify_s, 2),
        "load_s": round(load_s, 2),
        "updates_after_load": int(state["updates"]),
        "tensors_that_differ": differ[:20],
        "replay_repeats_the_update": repeats,
        "straight_vs_replayed": [[straight[k], replayed[k]] for k in ("loss", "grad_norm")],
        "digest_s": round(digest_s, 4),
        "update_deterministic_s": round(deterministic_s, 3),
        "update_free_kernels_s": round(free_s, 3),
        "deterministic_cost": round(deterministic_s / free_s, 3),
        "free_kernels_repeat_the_weights": free_repeats,
        "ops_without_deterministic_kernel": ops[:5],
    }
    ok = not differ and state["updates"] == 1 and repeats
    detail = (
        f"{size_gb:.2f} GB written in {save_s:.1f} s ({figures['save_gb_per_s']:.2f} GB/s, hashes included), "
        f"verified in {verify_s:.1f} s, loaded in {load_s:.1f} s; "
        + ("weights and AdamW state identical after the reload" if not differ else f"{len(differ)} tensors differ")
        + (
            "; the next update from it repeats the straight one bit for bit (weights digest, loss, grad norm)"
            if repeats
            else "; the next update from it does NOT repeat the straight one (loss, grad norm: "
            f"{figures['straight_vs_replayed']}, or the weights): a resume's replay would refuse"
        )
        + f"; weights digest {digest_s * 1000:.0f} ms; update {deterministic_s:.2f} s with the trainer's kernels, "
        f"{free_s:.2f} s with torch's free to choose (x{figures['deterministic_cost']:.2f})"
        + (f"; {len(ops)} operation(s) without a deterministic kernel: {ops[0][:120]}" if ops else "")
    )
    return ok, detail, figures


def _timed_update(trainer, batch) -> tuple[dict[str, Any], float]:
    _sync()
    t0 = time.perf_counter()
    metrics = trainer.update(*batch)
    _sync()
    return metrics, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# fsdp
# ---------------------------------------------------------------------------------------------


def check_fsdp(size: Size, out: Path, args: argparse.Namespace) -> tuple[bool, str, dict[str, Any]]:
    """One FSDP rank against the single-process update, float32: the same metrics and weights (each weight's
    difference measured against how far the update moved it)."""
    import torch

    from coba_tasks.engines.fsdp_update import fsdp_update
    from coba_tasks.engines.update import PolicyTrainer
    from coba_tasks.pipeline.policy import update_settings

    path = model_dir(out)
    # the full-sequence update, as the ranks run it; AdamW's eps 1e-5: its first step, lr * g / (|g| + eps), moves
    # weights whose gradient is near eps by amounts a sum in another order changes (tests/engines/test_fsdp_update.py)
    settings = update_settings(
        lr=1e-4, micro_batch_size=size.micro_batch, dtype="float32", eps=1e-5, shared_prefix=False
    )
    prompts, completions, adv, groups = ragged_batch(size)
    single = PolicyTrainer(path, settings, seed=0)
    start = {k: v.detach().cpu().clone() for k, v in single.model.state_dict().items()}
    expected = single.update(prompts, completions, adv, None, groups)
    after = {k: v.detach().cpu().clone() for k, v in single.model.state_dict().items()}
    del single
    if _device() == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    metrics = fsdp_update(
        path, out / "fsdp-checkpoint", prompts, completions, adv, settings, 1, seed=0, group_ids=groups
    )
    seconds = time.perf_counter() - t0
    reloaded = PolicyTrainer(path, settings, seed=0)
    reloaded.load_checkpoint(out / "fsdp-checkpoint")
    got = {k: v.detach().cpu().clone() for k, v in reloaded.model.state_dict().items()}
    moved = max(float((after[k] - start[k]).abs().max()) for k in after)
    off = max(float((got[k] - after[k]).abs().max()) for k in after)
    figures = {
        "backend": "nccl" if _device() == "cuda" else "gloo",
        "seconds": round(seconds, 1),
        "grad_norm": [metrics["grad_norm"], expected["grad_norm"]],
        "entropy": [metrics["entropy"], expected["entropy"]],
        "largest_update": moved,
        "largest_weight_difference": off,
    }
    ok = (
        off <= 1e-3 * moved
        and _rel(metrics["grad_norm"], expected["grad_norm"]) < 1e-3
        and _rel(metrics["entropy"], expected["entropy"]) < 1e-3
    )
    detail = (
        f"{figures['backend']}, one rank, {seconds:.0f} s (start included): grad norm {metrics['grad_norm']:.6g} vs "
        f"{expected['grad_norm']:.6g}, entropy {metrics['entropy']:.6g} vs {expected['entropy']:.6g}; weights within "
        f"{off / moved if moved else float('nan'):.1e} of the update's largest step"
    )
    return ok, detail, figures


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------


def check_train(size: Size, out: Path, args: argparse.Namespace) -> tuple[bool, str, dict[str, Any]]:
    """``coba run`` of a few steps on the tiny model: the five stages through Prefect, the transformers
    backend on this machine's device; held-out avg@k before and after."""
    model = Path(args.tiny_model)
    model = model if model.is_absolute() else ROOT / model
    if not (model / "config.json").is_file():
        return False, f"no model at {model}: run `coba bootstrap --out {args.tiny_model}` here and carry it", {}
    run_dir = out / "train-run"
    env = {**os.environ, "PREFECT_HOME": str(out / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "coba_tasks.commands.cli", "run", "--config", "configs/demo-tiny.yaml"]
    cmd += ["--run-dir", str(run_dir), "--set", f"model.path={model}", "--set", "rollout.backend=transformers"]
    cmd += [a for kv in size.train for a in ("--set", kv)]
    t0 = time.perf_counter()
    log = out / "train-run.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return False, f"coba run exit status {rc} after {seconds:.0f} s: {tail[0][:300]} (log: {log})", {}
    figures = train_figures(run_dir)
    figures["seconds"] = round(seconds, 1)
    min_gain = args.min_gain if args.min_gain is not None else (0.02 if size.name == "full" else None)
    gain = figures["avg_after"] - figures["avg_before"]
    ok = figures["weight_versions"] == [[0], [figures["steps"]]] and (min_gain is None or gain >= min_gain)
    detail = (
        f"{figures['steps']} steps of {figures['rollouts_per_step']} rollouts on {_device()} in {seconds:.0f} s "
        f"(step median {figures['step_s_median']:.1f} s): held-out avg@{figures['eval_samples']} "
        f"{figures['avg_before']:.3f} -> {figures['avg_after']:.3f} ({gain:+.3f}"
        + (f", needs >= {min_gain:+.3f})" if min_gain is not None else ", gain not judged at this size)")
    )
    return ok, detail, figures


def train_figures(run_dir: Path) -> dict[str, Any]:
    """Held-out accuracy before and after training, and the steps' wall seconds, read from the run directory."""
    import statistics

    from coba_tasks.pipeline.config_sections import MAIN_TEST_SET
    from coba_tasks.pipeline.run import read_run_config
    from coba_tasks.pipeline.store import RunStore, Table

    store = RunStore.open(run_dir)
    cfg = read_run_config(store)
    steps = cfg.run.steps
    before, after = store.read_table(0, Table.EVAL), store.read_table(steps, Table.EVAL)
    walls = []
    for step in range(steps):
        timing = run_dir / f"steps/{step:06d}/timing.json"
        if timing.is_file():
            walls.append(sum(json.loads(timing.read_text()).values()))

    def avg(frame) -> float:  # avg@k of the main held-out set: the mean over its prompts of the share solved
        main = frame[frame["test_set"] == MAIN_TEST_SET] if "test_set" in frame else frame
        return float(main["accuracy"].mean())

    return {
        "steps": steps,
        "rollouts_per_step": cfg.data.prompts_per_step * cfg.allocation.group_size,
        "eval_samples": cfg.run.eval_samples,
        "eval_prompts": int((before["test_set"] == MAIN_TEST_SET).sum()) if "test_set" in before else len(before),
        "avg_before": avg(before),
        "avg_after": avg(after),
        "weight_versions": [sorted(set(before["weight_version"])), sorted(set(after["weight_version"]))],
        "step_s_median": statistics.median(walls) if walls else float("nan"),
    }


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

MISSING_PACKAGE = ("ModuleNotFoundError", "No module named")


def check_tests(size: Size, out: Path, args: argparse.Namespace) -> tuple[bool, str, dict[str, Any]]:
    """pytest on ``--tests`` in this process's environment (CUDA when the machine has it); each failure named
    with the first line of why; failures for a package that is not installed counted apart."""
    xml = out / "tests.xml"
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "--junitxml", str(xml)]
    cmd += ["--continue-on-collection-errors"]  # a module that cannot be imported here must not stop the others
    cmd += ["-n", str(workers)] if workers > 1 and _has("xdist") else []
    cmd += ["--timeout", "90"] if _has("pytest_timeout") else []
    cmd += args.tests.split()
    t0 = time.perf_counter()
    with (out / "tests-pytest.log").open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - t0
    if not xml.is_file():
        return False, f"pytest wrote no report (exit status {rc}; log: {out / 'tests-pytest.log'})", {}
    outcome = junit_outcomes(xml)
    failed = outcome["failed"]
    figures = {k: outcome[k] for k in ("passed", "skipped", "missing_package")} | {
        "failed": failed,
        "seconds": round(seconds, 1),
        "exit_status": rc,
    }
    detail = (
        f"{len(outcome['passed'])} passed, {len(failed)} failed, {len(outcome['missing_package'])} need a package "
        f"not here, {len(outcome['skipped'])} skipped"
    )
    if failed:
        detail += "; failed: " + "; ".join(f"{name}: {why}" for name, why in list(failed.items())[:5])
        detail += " ..." if len(failed) > 5 else ""
    return not failed and bool(outcome["passed"]) and rc in (0, 1), detail, figures


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def junit_outcomes(path: Path) -> dict[str, Any]:
    """A pytest JUnit XML report as passed (names), skipped (name: reason), failed and missing_package
    (name: the first line of why)."""
    passed, skipped, failed, missing = [], {}, {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".removeprefix("tests.")
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if problem is not None:  # a collection error's message is "collection failure", its text says why
            message, body = (problem.get("message") or "").strip(), (problem.text or "").strip()
            text = message or body
            why = text.splitlines()[0][:200] if text else "(no message)"
            lost = [line.strip() for line in body.splitlines() if any(m in line for m in MISSING_PACKAGE)]
            if any(m in message for m in MISSING_PACKAGE) or lost:
                missing[name] = why if any(m in message for m in MISSING_PACKAGE) else lost[-1][:200]
            else:
                failed[name] = why
        elif skip is not None:  # a module skipped at collection: "collection skipped", the reason in its text
            reason = (skip.get("message") or "").strip()
            skipped[name] = ((skip.text or "").strip() if reason in ("", "collection skipped") else reason)[:200]
        else:
            passed.append(name)
    return {"passed": passed, "skipped": skipped, "failed": failed, "missing_package": missing}


CHECK_FUNCTIONS: dict[str, Callable[[Size, Path, argparse.Namespace], tuple[bool, str, dict[str, Any]]]] = {
    "env": check_env,
    "update": check_update,
    "rollout": check_rollout,
    "checkpoint": check_checkpoint,
    "fsdp": check_fsdp,
    "train": check_train,
    "tests": check_tests,
}


if __name__ == "__main__":
    sys.exit(main())
