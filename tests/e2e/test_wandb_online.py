"""wandb.mode=online without a W&B server that answers logs offline instead, saying so in one
line, within seconds, through train.py (issue 50.4: before, a 95 s stall at 'setting up run',
then one warning and no W&B record at all). Read back from W&B's own offline files."""

import http.server
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT, SMALL
from tests.launch import free_port
from tests.wandb_offline import runs_under

ARGS = [*(a for a in SMALL if not a.startswith("wandb.mode")), "train.max_steps=2", "wandb.mode=online"]
KEY = "k" * 40  # a key of the right length: W&B checks it against the server, which never answers


def _train(run_dir, args, **env) -> tuple[subprocess.CompletedProcess, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    full = {**clean, "OMP_NUM_THREADS": "1", "MINDDP_RUN_DIR": str(run_dir), "WANDB_SILENT": "true",
            "HOME": str(run_dir.parent), **env}  # HOME: no ~/.netrc credentials of this machine's
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                       env=full, cwd=ROOT, timeout=150)
    return p, time.monotonic() - t0


def _offline_with_both_steps(p, run_dir, says: str) -> None:
    assert p.returncode == 0, p.stderr[-3000:]
    said = [line for line in (p.stdout + p.stderr).splitlines() if "logging offline instead" in line]
    assert len(said) == 1 and says in said[0] and "wandb sync" in said[0], p.stdout[-3000:] + p.stderr[-3000:]
    (w,) = runs_under(run_dir)
    assert [h["_step"] for h in w["history"]] == [1, 2]
    assert "W&B (offline):" in p.stdout + p.stderr and "upload it: wandb sync" in p.stdout + p.stderr


@pytest.mark.slow
def test_online_with_no_server_listening_logs_offline_within_seconds(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    p, took = _train(tmp_path / "run", ARGS, WANDB_API_KEY=KEY, WANDB_BASE_URL=url)
    _offline_with_both_steps(p, tmp_path / "run", f"{url} did not answer within 3 s")
    assert "(wandb.mode=online)" in p.stdout + p.stderr
    print(f"online, no server: {took:.1f} s for the whole 2-step run")
    assert took < 60, took


class _Stalls(http.server.BaseHTTPRequestHandler):
    """A server that is there (it answers HEAD) but never answers W&B's API."""

    def do_HEAD(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        time.sleep(120)

    do_GET = do_POST

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_online_with_a_server_that_does_not_answer_in_time_logs_offline_after_init_timeout(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stalls)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        p, took = _train(tmp_path / "run", [*ARGS, "wandb.init_timeout=4"], WANDB_API_KEY=KEY,
                         WANDB_BASE_URL=f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    _offline_with_both_steps(p, tmp_path / "run", "no online run within wandb.init_timeout=4 s")
    print(f"online, a server that stalls, init_timeout 4 s: {took:.1f} s for the whole 2-step run")
    assert took < 60, took


@pytest.mark.slow
def test_online_without_credentials_logs_offline(tmp_path):
    p, _ = _train(tmp_path / "run", ARGS)
    _offline_with_both_steps(p, tmp_path / "run", "no W&B credentials")
