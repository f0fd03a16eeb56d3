"""Helpers shared by the tests: waiting on database state with a deadline, the test
database's URL and environment for subprocesses, and `manage.py` processes killed at the end
of each test (the `processes` fixture in tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from django.db import connection

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
    message: str = "condition",
) -> T:
    """Poll `predicate` until it returns something truthy; fail after `timeout` seconds.
    This waits for an observable state, never for a guessed duration."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def test_database_url() -> str:
    s = connection.settings_dict
    password = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    port = f":{s['PORT']}" if s.get("PORT") else ""
    return f"postgres://{s['USER']}{password}@{s['HOST'] or '127.0.0.1'}{port}/{s['NAME']}"


test_database_url.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


def worker_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


class Processes:
    """Start `manage.py` subprocesses against the test database; all are killed at the
    end of the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp_path = tmp_path
        # Applied over every process's environment (e.g. the working connections through
        # PgBouncer: tests/test_pgbouncer.py).
        self.env_overrides: dict[str, str] = {}

    def manage(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"proc-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), *args],
            env={**(env or worker_env()), **self.env_overrides},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def worker(self, *args: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        return self.manage("runworker", *args, **kwargs)

    @staticmethod
    def output(proc: subprocess.Popen[bytes]) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)
