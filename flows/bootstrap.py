"""The bootstrap flow: build the default tiny model and warm it up on the arithmetic task.

    coba bootstrap                         # -> models/arith-tiny (skipped if it exists)
    coba bootstrap --out models/x --seed 1 --force   # replaces an earlier bootstrap there, nothing else

Three tasks in stage order, passing paths: build the random model, supervised warm-up, held-out
greedy evaluation. The figures land in ``<out>/bootstrap.json`` and in a Prefect artifact.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from coba_tasks.engines.bootstrap import BootstrapConfig, build_area, publish, write_metrics
from coba_tasks.pipeline import deployment
from coba_tasks.pipeline.tasks import build_model_task, sft_eval_task, warm_up_task
from coba_tasks.readers.text import figure_table, markdown_text


@flow(name="coba-bootstrap", log_prints=True)
def bootstrap_flow(
    out_dir: str = "models/arith-tiny",
    train_path: str = "data/arith_train.parquet",
    test_path: str = "data/arith_test.parquet",
    cfg: BootstrapConfig | None = None,
    force: bool = False,
) -> dict:
    """Build and warm up the default model at ``out_dir``; returns its figures.

    ``out_dir`` must be missing or empty, or hold an earlier bootstrap (replaced only with ``force``);
    a directory holding anything else is refused before any work, ``force`` included.

    Args:
        out_dir: Where to write the model (missing, empty, or an earlier bootstrap).
        train_path: The training problems (Parquet) the model warms up on.
        test_path: The held-out problems (Parquet) its figures are measured on.
        cfg: The warm-up's settings: the model's shape, steps, batch size, learning rate (defaults when left out).
        force: Replace an earlier bootstrap at out_dir.
    """
    if deployment.started_by_deployment():  # parameters from the API: their paths stay inside the project
        deployment.check_deployment_paths({"out_dir": out_dir, "train_path": train_path, "test_path": test_path})
    cfg = cfg or BootstrapConfig()
    log = get_run_logger()
    out = Path(out_dir)
    with build_area(out, force) as work:  # checks out_dir first; the temporary goes away whatever happens
        init_dir = build_model_task(str(work), cfg)
        model_dir, train_figures = warm_up_task(init_dir, train_path, str(work), cfg)
        eval_figures = sft_eval_task(model_dir, test_path, cfg)
        figures = {**train_figures, **eval_figures}
        write_metrics(model_dir, cfg, figures)
        kept = publish(model_dir, out)  # the model appears only when complete
    for path in kept:
        log.warning(f"kept {path}: written beside the earlier bootstrap while this one ran, not removed")
    by_level = " | ".join(f"{k}: {v:.2f}" for k, v in figures["accuracy_by_difficulty"].items())
    log.info(f"bootstrap done: held-out greedy accuracy {figures['accuracy']:.3f} ({by_level}) -> {out}")
    create_markdown_artifact(
        key="coba-bootstrap",
        markdown=figure_table(
            f"# Bootstrap of {markdown_text(out)}",
            [
                ("held-out greedy accuracy", f"{figures['accuracy']:.3f}"),
                *((f"accuracy, level {k}", f"{v:.2f}") for k, v in figures["accuracy_by_difficulty"].items()),
                ("training time", f"{figures['train_seconds']:.0f} s"),
                ("final loss", f"{figures['final_loss']:.3f}"),
            ],
        ),
        description="held-out accuracy of the warmed-up default model",
    )
    return figures
