"""One GPU, one user at a time (flows.gpu): the slot of Prefect's global concurrency limit coba-gpu that a training
run holds while its models are on the GPU and coba-eval-watch waits for; and the event a failed run emits."""

from __future__ import annotations

import time

import pytest


def test_a_second_holder_waits_for_the_gpu_and_a_machine_without_cuda_takes_no_slot(prefect_harness, monkeypatch):
    """With the limit coba-gpu at 1: while one block holds the slot, a second gives up after its wait
    (TimeoutError) and gets it once the first ends; without CUDA no slot is taken (the limit is not touched);
    where the server has no such limit, nothing waits."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from flows import gpu

    monkeypatch.setattr(gpu, "uses_gpu", lambda: True)
    with gpu.gpu_slot(wait_s=2):  # no limit of that name on the server yet: taken at once
        pass
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=gpu.GPU_LIMIT, limit=1))
    try:
        with gpu.gpu_slot(wait_s=5):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError), gpu.gpu_slot(wait_s=1.5):
                pass
            assert time.monotonic() - t0 >= 1.0  # it waited for the slot, then gave up
            monkeypatch.setattr(gpu, "uses_gpu", lambda: False)
            with gpu.gpu_slot(wait_s=0.5):  # a CPU process takes no slot: never blocked by a GPU run
                pass
            monkeypatch.setattr(gpu, "uses_gpu", lambda: True)
        with gpu.gpu_slot(wait_s=5):  # the first released it
            pass
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(gpu.GPU_LIMIT)


def test_a_failed_run_emits_its_error_and_how_to_continue(prefect_harness, tmp_path):
    """coba.run.failed: the run's resource, the error in one line, the command that continues it."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    from coba_tasks.pipeline.config import Config
    from flows.view import FAILED_EVENT, run_failed, run_scope

    root = tmp_path / "run-x"
    run_failed(root, Config(), ValueError("step 3: the rollouts of prompt p\nsecond line"))
    resource = EventResourceFilter(id=[f"coba.run.{run_scope(root)}"])
    for _ in range(60):  # the server stores events a moment after they arrive
        with get_client(sync_client=True) as client:
            found = EventFilter(event=EventNameFilter(name=[FAILED_EVENT]), resource=resource)
            page = client.read_events(filter=found, limit=10)
        if page.events:
            break
        time.sleep(0.5)
    (event,) = page.events
    assert event.payload == {
        "error": "ValueError: step 3: the rollouts of prompt p",
        "resume": f"coba resume --run-dir {root}",
    }
