"""coba setup-server on a Prefect server (the session's test server): the global concurrency limit coba-gpu and the
automations that notify a block when a training run fails or a coba-rl flow run crashes, made again in place."""

from __future__ import annotations

import pytest


def test_setup_server_sets_one_run_per_gpu_and_the_notifications_and_again_replaces_them(prefect_harness):
    from prefect.blocks.notifications import SlackWebhook
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from coba_tasks.commands.server_setup import (
        AUTOMATION_NAME,
        NOTIFY_CRASHED,
        NOTIFY_FAILED,
        setup_server,
    )
    from flows.gpu import GPU_LIMIT

    url = PREFECT_API_URL.value()
    block_id = SlackWebhook(url="http://127.0.0.1:9/hook").save("rl-team", overwrite=True)
    try:
        done = setup_server(url, gpus=2, notify="slack-webhook/rl-team")
        assert done["gpu_limit"] in ("created", "updated") and done["gpus"] == 2 and len(done["notify"]) == 2
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 2
            (failed,) = client.read_automations_by_name(name=NOTIFY_FAILED)
            (crashed,) = client.read_automations_by_name(name=NOTIFY_CRASHED)
        assert failed.trigger.expect == {"coba.run.failed"} and crashed.trigger.expect == {"prefect.flow-run.Crashed"}
        assert failed.actions[0].block_document_id == block_id == crashed.actions[0].block_document_id
        assert "{{ event.payload.error }}" in failed.actions[0].body
        again = setup_server(url, gpus=1, notify="slack-webhook/rl-team")  # in place: one of each, the new limit
        assert again["gpu_limit"] == "updated"
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit == 1
            assert [str(a.id) for a in client.read_automations_by_name(name=NOTIFY_FAILED)] == again["notify"][:1]
        with pytest.raises(ValueError, match=r"no such block; make it with `prefect block create slack-webhook`"):
            setup_server(url, notify="slack-webhook/nobody")
        with pytest.raises(ValueError, match=r"give a notification block as TYPE/NAME"):
            setup_server(url, notify="rl-team")
        with pytest.raises(ValueError, match=r"--gpus must be at least 1"):
            setup_server(url, gpus=0)
    finally:
        with get_client(sync_client=True) as client:
            for name in (AUTOMATION_NAME, NOTIFY_FAILED, NOTIFY_CRASHED):
                for automation in client.read_automations_by_name(name=name):
                    client.delete_automation(automation.id)
            client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
