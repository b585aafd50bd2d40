"""`pnmix dashboard` serves optuna-dashboard on the campaigns' storage; a study reads back over HTTP."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import optuna

from pnmix.storage import Database, upgrade

PNMIX = [sys.executable, "-P", "-m", "pnmix.api.cli"]  # the CLI, without the checkout on sys.path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dashboard_serves_a_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'pnmix.db'}"
    upgrade(Database(url))
    study = optuna.create_study(study_name="pnmix:1:2.25", storage=url, directions=["maximize", "minimize"])
    study.set_metric_names(["accuracy", "key_bits"])
    study.add_trial(optuna.trial.create_trial(values=[0.9, 2.2], params={}, distributions={}))
    port = free_port()
    proc = subprocess.Popen([*PNMIX, "dashboard", "--storage", url, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        body = None
        deadline = time.time() + 60
        while time.time() < deadline and body is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2) as r:
                    body = json.loads(r.read())
            except OSError:
                time.sleep(0.5)
        assert body is not None, "dashboard did not answer"
        names = [s["study_name"] for s in body["study_summaries"]]
        assert names == ["pnmix:1:2.25"]
        assert body["study_summaries"][0]["directions"] == ["maximize", "minimize"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
