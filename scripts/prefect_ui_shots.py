"""Screenshots of one training run in the Prefect UI, taken by headless Chromium (docs/workers.md shows them).

Starts a local Prefect server (a temporary PREFECT_HOME, a free port, the UI on), trains one run of CONFIG
against it with ``coba run``, then opens in headless Chromium the flow run's page, the artifacts page, the
run's step table, its held-out evaluations and its report artifact, and writes each as a PNG into OUT.

    .venv/bin/python scripts/prefect_ui_shots.py                                   # configs/demo-tiny.yaml
    .venv/bin/python scripts/prefect_ui_shots.py --config configs/demo.yaml --out docs/img

Needs ``chromium`` on PATH (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
BIN = PROJECT / ".venv" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the Prefect server exited ({proc.returncode}); see its log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the Prefect server at {url} did not answer in {timeout:.0f} s")


def shoot(chromium: str, url: str, out: Path, height: int = 1100) -> None:
    """``url`` rendered by headless Chromium (the UI is a single-page app: 20 s of virtual time to load)."""
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size=1440,{height}",
            "--virtual-time-budget=20000",
            f"--screenshot={out}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    print(f"{out}  <- {url}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo-tiny.yaml", help="the run's config (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], help="a config override, as `coba run --set`")
    parser.add_argument("--out", default="docs/img", help="where the PNGs go (default: %(default)s)")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not on PATH: install it (Debian: apt-get install chromium)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coba-ui-") as tmp:
        home, port = Path(tmp) / "prefect-home", free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env["PREFECT_UI_API_URL"] = f"{base}/api"  # the UI asks its API here (default: port 4200)
        env.pop("PREFECT_API_URL", None)
        log = open(Path(tmp) / "server.log", "w")  # noqa: SIM115 (open for the server's whole life)
        server = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_healthy(f"{base}/api", server)
            env["PREFECT_API_URL"] = f"{base}/api"
            run_dir = Path(tmp) / "runs" / Path(args.config).stem
            sets = [x for s in args.set for x in ("--set", s)]
            subprocess.run(
                [str(BIN / "coba"), "run", "--config", args.config, "--run-dir", str(run_dir), *sets],
                env=env,
                cwd=PROJECT,
                check=True,
            )
            os.environ["PREFECT_API_URL"] = env["PREFECT_API_URL"]
            from prefect.client.orchestration import get_client
            from prefect.client.schemas.sorting import FlowRunSort

            sys.path.insert(0, str(PROJECT))
            from flows.view import run_scope

            with get_client(sync_client=True) as client:
                flow_run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
                scope = run_scope(run_dir)
                artifacts = {a.key: a for a in client.read_artifacts() if a.key}
            shoot(chromium, f"{base}/runs/flow-run/{flow_run.id}", out / "prefect-flow-run.png")
            shoot(chromium, f"{base}/artifacts", out / "prefect-artifacts.png", 900)
            for name, height in (("steps", 900), ("heldout", 900), ("report", 3200)):
                artifact = artifacts[f"{scope}-{name}"]
                shoot(chromium, f"{base}/artifacts/artifact/{artifact.id}", out / f"prefect-{name}.png", height)
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
