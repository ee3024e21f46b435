"""``coba setup-server``: make a Prefect server ready for coba-rl's workers.

    coba setup-server --api-url http://127.0.0.1:4200/api
    coba setup-server --api-url http://127.0.0.1:4200/api --crash-after 120

Idempotent; run it once per server (again after changing ``--crash-after``). It creates

- the ``process`` work pools the deployments of ``prefect.yaml`` use (``coba-process``, and ``coba-gpu`` for the
  GPU host's training runs), unless they exist (``prefect deploy --all`` refuses a deployment whose pool is missing);
- the automation ``coba: crash unresponsive flow runs``: a flow run that has sent a heartbeat and then
  sends neither another heartbeat nor a final state for ``--crash-after`` seconds is set to Crashed.

Why the automation: a self-hosted Prefect server (3.7.7) has no other way to notice a flow run whose
process died without a word (its worker SIGKILLed, its machine gone). Such a flow run stays Running for
good, and ``prefect flow-run retry`` refuses a Running flow run. Flow runs started by a worker send a
heartbeat every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (180 by default, 30 at the least), so
``--crash-after`` must be longer than that (the default is three heartbeats). The automation follows
Prefect's guide "How to detect and respond to zombie flows".
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

from coba_tasks.commands.args import Command, option

AUTOMATION_NAME = "coba: crash unresponsive flow runs"
DEFAULT_POOL = "coba-process"
GPU_POOL = "coba-gpu"  # prefect.yaml's coba-train-gpu deployment (one training run at a time)
HEARTBEAT_DEFAULT_S = 180  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY's default in Prefect 3.7.7
MIN_HEARTBEAT_S = 30


def zombie_automation(crash_after_s: int):
    """The automation that sets a silent flow run Crashed ``crash_after_s`` seconds after its last heartbeat."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name=AUTOMATION_NAME,
        description=f"coba setup-server: Crashed when a flow run is silent for {crash_after_s} s after a heartbeat",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=crash_after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {crash_after_s} s: the flow run's process is gone (coba setup-server)",
            )
        ],
    )


def setup_server(
    api_url: str, pool: str = DEFAULT_POOL, crash_after_s: int = 3 * HEARTBEAT_DEFAULT_S, gpu_pool: str = GPU_POOL
) -> dict[str, Any]:
    """Create the work pools (if missing) and create or replace the zombie automation on the server at ``api_url``.

    Returns what was done: ``{"pool": "created" | "exists"`` (``pool``'s), ``"gpu_pool": ...``, ``"automation":
    "created" | "replaced", ...}``.
    """
    if crash_after_s <= MIN_HEARTBEAT_S:
        raise ValueError(
            f"--crash-after must be longer than a heartbeat interval (at least {MIN_HEARTBEAT_S} s), "
            f"got {crash_after_s}"
        )
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings

    done: dict[str, Any] = {"api_url": api_url, "pool_name": pool, "crash_after_s": crash_after_s}
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            for key, name in (("pool", pool), ("gpu_pool", gpu_pool)):
                try:
                    client.create_work_pool(WorkPoolCreate(name=name, type="process"))
                    done[key] = "created"
                except ObjectAlreadyExists:
                    done[key] = "exists"
            old = client.read_automations_by_name(name=AUTOMATION_NAME)
            for automation in old:
                client.delete_automation(automation.id)
        created = zombie_automation(crash_after_s).create()
        done["automation"] = "replaced" if old else "created"
        done["automation_id"] = str(created.id)
    return done


def _cmd_setup_server(args: argparse.Namespace) -> int:
    url = args.api_url or os.environ.get("PREFECT_API_URL")
    if not url:
        raise ValueError("no Prefect server: pass --api-url http://HOST:4200/api or export PREFECT_API_URL")
    done = setup_server(url, pool=args.pool, crash_after_s=args.crash_after, gpu_pool=args.gpu_pool)
    print(f"work pool {done['pool_name']!r}: {done['pool']}")
    print(f"work pool {args.gpu_pool!r}: {done['gpu_pool']}")
    print(
        f"automation {AUTOMATION_NAME!r}: {done['automation']} (a flow run silent for {done['crash_after_s']} s "
        "after a heartbeat is set to Crashed)"
    )
    heartbeat = os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
    every = int(heartbeat) if heartbeat and heartbeat.isdigit() else HEARTBEAT_DEFAULT_S
    if every >= done["crash_after_s"]:
        print(
            f"warning: flow runs send a heartbeat every {every} s (PREFECT_FLOWS_HEARTBEAT_FREQUENCY); with "
            f"--crash-after {done['crash_after_s']} live runs would be set to Crashed: start the workers with a "
            "shorter heartbeat or choose a longer --crash-after"
        )
    return 0


COMMAND = Command(
    "setup-server",
    help="prepare a Prefect server for workers: the work pool and crash detection",
    description="Create the process work pools of prefect.yaml's deployments and an automation that sets a flow "
    "run Crashed when its process stops sending heartbeats (a killed worker, a lost machine). Idempotent.",
    examples=[
        "coba setup-server --api-url http://127.0.0.1:4200/api",
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 prefect worker start --pool coba-process   # then, per worker",
        "coba setup-server --api-url http://127.0.0.1:4200/api --crash-after 120          # with 30 s heartbeats",
    ],
    options=[
        option("--api-url", default=None, help="the server's API URL (default: $PREFECT_API_URL)"),
        option("--pool", default=DEFAULT_POOL, help=f"process work pool to create (default {DEFAULT_POOL})"),
        option(
            "--gpu-pool",
            default=GPU_POOL,
            help=f"the GPU host's process work pool to create (default {GPU_POOL}: prefect.yaml's coba-train-gpu)",
        ),
        option(
            "--crash-after",
            type=int,
            default=3 * HEARTBEAT_DEFAULT_S,
            help="seconds without a heartbeat before a running flow run is set to Crashed "
            f"(default {3 * HEARTBEAT_DEFAULT_S}: three of Prefect's default {HEARTBEAT_DEFAULT_S} s heartbeats)",
        ),
    ],
    func=_cmd_setup_server,
)
