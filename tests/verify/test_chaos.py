"""A short fault-injection campaign with a fixed seed: real workers, reconcilers and faults
against the campaign's own embedded PostgreSQL, then the invariant checker. It must
report 0 violations (the full campaign is `make chaos`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT
from tools.chaos import FAULT_KINDS

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_chaos__short_campaign_reports_no_violation() -> None:
    out = ROOT / ".data" / "chaos-test"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONUNBUFFERED": "1",
    }
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "chaos",
            # Seed 11's plan: 16 faults, every kind's first by 22.5 s (a kind that found
            # nothing to hit is tried again a second later while the phase lasts).
            "--duration",
            "28",
            "--workers",
            "3",
            "--seed",
            "11",
            "--fault-interval",
            "1.5",
            # Its own server on a free port: a `make chaos` run, or another checkout's
            # tests, may be going on at the same time.
            "--data-dir",
            str(ROOT / ".data" / "chaos-test-pg"),
            "--port",
            str(free_port()),
            "--out",
            str(out),
            "--quiesce-timeout",
            "40",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "violations: 0" in output, output[-6000:]
    summary = json.loads(Path(out / "summary.json").read_text())
    # The first round of the plan injects every kind of fault once.
    missing = set(FAULT_KINDS) - set(summary["faults"])
    assert not missing, f"faults never injected: {missing}\n{output[-3000:]}"
    assert summary["runs_created"] > 20
    assert "unexpected process exits: 0" in output, output[-6000:]
    # The incremental bindings ran over a source that changed meanwhile, and were checked.
    assert sorted(summary["incremental"]) == ["chaos-inc-append", "chaos-inc-upsert"]
    assert summary["source_inserts"] > 0 and summary["source_updates"] > 0
    assert "incremental_bindings=2" in summary["invariants"]
