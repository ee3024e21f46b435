"""``coba setup-server``: make a Prefect server ready for coba-rl's workers.

    coba setup-server --api-url http://127.0.0.1:4200/api
    coba setup-server --api-url http://127.0.0.1:4200/api --crash-after 120
    coba setup-server --api-url http://127.0.0.1:4200/api --gpus 2 --notify slack-webhook/rl-team

Idempotent; run it once per server (again after changing ``--crash-after``). It creates

- the ``process`` work pools the deployments of ``prefect.yaml`` use (``coba-process``, and ``coba-gpu`` for the
  GPU host's training runs), unless they exist (``prefect deploy --all`` refuses a deployment whose pool is missing);
- the automation ``coba: crash unresponsive flow runs``: a flow run that has sent a heartbeat and then
  sends neither another heartbeat nor a final state for ``--crash-after`` seconds is set to Crashed;
- the global concurrency limit ``coba-gpu`` at ``--gpus`` slots (1 by default): a training run on a GPU holds
  one for its whole span and ``coba-eval-watch`` one for an evaluation (``flows.gpu``), so two of them never
  share one GPU's memory;
- with ``--notify BLOCK`` (a notification block of the server, ``type-slug/name``, e.g. ``slack-webhook/rl-team``:
  ``prefect block create slack-webhook`` makes one), the automations ``coba: notify failed runs`` (the event
  ``coba.run.failed`` a training run emits as it fails: its error and the command that continues it) and
  ``coba: notify crashed runs`` (a coba-rl flow run set Crashed: its process died without a word).

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
from flows.gpu import GPU_LIMIT

AUTOMATION_NAME = "coba: crash unresponsive flow runs"
NOTIFY_FAILED = "coba: notify failed runs"
NOTIFY_CRASHED = "coba: notify crashed runs"
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


def notify_automations(block_id: Any, block: str) -> list[Any]:
    """The automations that send the notification block ``block`` (its id ``block_id``) a message when a training
    run fails (``coba.run.failed``: the run, its error, the command that continues it) or a coba-rl flow run is
    set Crashed."""
    from prefect.automations import Automation
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    def notify(name: str, what: str, expect: str, resources: list[str], subject: str, body: str, **related: Any):
        """An automation that sends ``block`` ``subject`` and ``body`` on each ``expect`` event of ``resources``."""
        return Automation(
            name=name,
            description=f"coba setup-server: {what}, sent to {block}",
            trigger=EventTrigger(
                expect={expect},
                match=ResourceSpecification({"prefect.resource.id": resources}),
                posture=Posture.Reactive,
                threshold=1,
                within=timedelta(0),
                **related,
            ),
            actions=[SendNotification(block_document_id=block_id, subject=subject, body=body)],
        )

    failed = notify(
        NOTIFY_FAILED,
        "a training run's coba.run.failed event",
        "coba.run.failed",
        ["coba.run.*"],
        "coba-rl: {{ event.resource.name }} failed",
        "{{ event.resource.name }} failed: {{ event.payload.error }}\nContinue it with: {{ event.payload.resume }}",
    )
    crashed = notify(
        NOTIFY_CRASHED,
        "a coba-rl flow run set Crashed",
        "prefect.flow-run.Crashed",
        ["prefect.flow-run.*"],
        "coba-rl: flow run {{ flow_run.name }} crashed",
        "Flow run {{ flow_run.name }} crashed: {{ flow_run.state.message }}. A new run of the same run_name "
        "continues it.",
        match_related=ResourceSpecification(
            {"prefect.resource.role": "tag", "prefect.resource.id": ["prefect.tag.coba-rl"]}
        ),
    )
    return [failed, crashed]


def setup_server(
    api_url: str,
    pool: str = DEFAULT_POOL,
    crash_after_s: int = 3 * HEARTBEAT_DEFAULT_S,
    gpu_pool: str = GPU_POOL,
    gpus: int = 1,
    notify: str | None = None,
) -> dict[str, Any]:
    """Create the work pools (if missing), create or replace the zombie automation, set the global concurrency
    limit ``coba-gpu`` to ``gpus`` and, with ``notify`` (a notification block, ``type-slug/name``), create or
    replace the automations that notify it, on the server at ``api_url``.

    Returns what was done: ``{"pool": "created" | "exists"`` (``pool``'s), ``"gpu_pool": ...``, ``"automation":
    "created" | "replaced", "gpu_limit": "created" | "updated", "notify": [automation ids] (with notify), ...}``.
    """
    if gpus < 1:
        raise ValueError(f"--gpus must be at least 1 (the GPUs a host's runs share), got {gpus}")
    if crash_after_s <= MIN_HEARTBEAT_S:
        raise ValueError(
            f"--crash-after must be longer than a heartbeat interval (at least {MIN_HEARTBEAT_S} s), "
            f"got {crash_after_s}"
        )
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
        WorkPoolCreate,
    )
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
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
            try:
                client.read_global_concurrency_limit_by_name(GPU_LIMIT)
                client.update_global_concurrency_limit(GPU_LIMIT, GlobalConcurrencyLimitUpdate(limit=gpus))
                done["gpu_limit"] = "updated"
            except ObjectNotFound:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=gpus))
                done["gpu_limit"] = "created"
            block_id = _block_id(client, notify) if notify else None
            if notify:
                for name in (NOTIFY_FAILED, NOTIFY_CRASHED):
                    for automation in client.read_automations_by_name(name=name):
                        client.delete_automation(automation.id)
        created = zombie_automation(crash_after_s).create()
        done["automation"] = "replaced" if old else "created"
        done["automation_id"] = str(created.id)
        if notify:
            done["notify"] = [str(a.create().id) for a in notify_automations(block_id, notify)]
    done["gpus"] = gpus
    return done


def _block_id(client: Any, block: str) -> Any:
    """The id of the notification block ``type-slug/name`` on the server; ValueError (one line) naming how to make
    one when it is not there."""
    from prefect.exceptions import ObjectNotFound

    kind, _, name = block.partition("/")
    if not kind or not name:
        raise ValueError(f"--notify {block!r}: give a notification block as TYPE/NAME, e.g. slack-webhook/rl-team")
    try:
        return client.read_block_document_by_name(name=name, block_type_slug=kind).id
    except ObjectNotFound:
        raise ValueError(
            f"--notify {block!r}: the server has no such block; make it with `prefect block create {kind}` (or in "
            "the UI, Blocks), then run this again"
        ) from None


def _cmd_setup_server(args: argparse.Namespace) -> int:
    url = args.api_url or os.environ.get("PREFECT_API_URL")
    if not url:
        raise ValueError("no Prefect server: pass --api-url http://HOST:4200/api or export PREFECT_API_URL")
    done = setup_server(
        url, pool=args.pool, crash_after_s=args.crash_after, gpu_pool=args.gpu_pool, gpus=args.gpus, notify=args.notify
    )
    print(f"work pool {done['pool_name']!r}: {done['pool']}")
    print(f"work pool {args.gpu_pool!r}: {done['gpu_pool']}")
    print(
        f"automation {AUTOMATION_NAME!r}: {done['automation']} (a flow run silent for {done['crash_after_s']} s "
        "after a heartbeat is set to Crashed)"
    )
    print(f"global concurrency limit {GPU_LIMIT!r}: {done['gpu_limit']}, {done['gpus']} slot(s) (one GPU, one run)")
    if args.notify:
        print(f"automations {NOTIFY_FAILED!r}, {NOTIFY_CRASHED!r}: created, sending to {args.notify}")
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
    help="prepare a Prefect server for workers: the work pools, crash detection, one run per GPU, notifications",
    description="Create the process work pools of prefect.yaml's deployments, an automation that sets a flow "
    "run Crashed when its process stops sending heartbeats (a killed worker, a lost machine), the global "
    "concurrency limit coba-gpu (a training run and coba-eval-watch never share a GPU) and, with --notify, "
    "automations that tell a notification block when a run fails or crashes. Idempotent.",
    examples=[
        "coba setup-server --api-url http://127.0.0.1:4200/api",
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 prefect worker start --pool coba-process   # then, per worker",
        "coba setup-server --api-url http://127.0.0.1:4200/api --crash-after 120          # with 30 s heartbeats",
        "coba setup-server --api-url http://127.0.0.1:4200/api --gpus 2 --notify slack-webhook/rl-team",
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
        option(
            "--gpus",
            type=int,
            default=1,
            help="slots of the global concurrency limit coba-gpu: the GPUs the runs of a GPU host share (default 1)",
        ),
        option(
            "--notify",
            default=None,
            metavar="BLOCK",
            help="a notification block of the server as TYPE/NAME (e.g. slack-webhook/rl-team): told when a "
            "training run fails or a coba-rl flow run crashes",
        ),
    ],
    func=_cmd_setup_server,
)
