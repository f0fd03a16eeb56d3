"""What a worker's log line quotes of an error can neither forge a line nor give away a
connection's identity: a connector's error text is escaped (`dispatch.core.db.one_line`), and
a database error is logged as its class, SQLSTATE and message without the hosts, users,
databases and passwords of the worker's connections (`dispatch.worker.log.db_error`)
(docs/security.md, "Log lines")."""

from __future__ import annotations

import logging
import signal
from typing import Any

import psycopg
import pytest

from dispatch.connectors.base import FenceRejected, LeaseLost
from dispatch.connectors.builtin import GenerateConnector
from dispatch.core.db import one_line
from dispatch.worker import listen
from dispatch.worker.log import db_error
from dispatch.worker.runner import ExecutionControl, Runner
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import claim_one
from tests.support.processes import Processes, test_database_url, wait_until, worker_env

FORGED = "refused\nERROR dispatch.runner attempt settled status=SUCCEEDED\x1b[2J"
ESCAPED = "refused\\nERROR dispatch.runner attempt settled status=SUCCEEDED\\x1b[2J"

# Who the failing connections say they are: none of it may reach a log line.
USER, PASSWORD, DBNAME = "leaky_role", "leaky-Pw-4417", "leaky_db"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("error", "line"),
    [
        (FenceRejected, "stale commit refused by the sink fence: "),
        (LeaseLost, "attempt stopped without recording cause=lease_lost detail="),
    ],
)
def test_runner__a_connector_error_is_quoted_escaped_on_one_line(
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    error: type[Exception],
    line: str,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise error(FORGED)

    monkeypatch.setattr(GenerateConnector, "open_reader", classmethod(refuse))
    trigger(BindingFactory())
    claimed = claim_one()
    with caplog.at_level(logging.WARNING, logger="dispatch.runner"):
        Runner(claimed, ExecutionControl(claimed)).execute()

    (message,) = [r.getMessage() for r in caplog.records if line in r.getMessage()]
    assert f"{line}{ESCAPED} run={claimed.run_id}" in message
    assert "\n" not in message and "\x1b" not in message


def test_one_line__escapes_every_line_break_and_control_character() -> None:
    text = "a\nb\r\nc\td\u2028e\u2029f\x85g\x1b[31mh\x00"
    assert one_line(ValueError(f"  {text}\n")) == (
        "a\\nb\\x0d\\nc\\td\\u2028e\\u2029f\\x85g\\x1b[31mh\\x00"
    )
    assert one_line(ValueError("")) == "ValueError"


def _listen_url(port: str = "") -> str:
    from django.db import connection

    port = port or str(connection.settings_dict["PORT"] or 5432)
    return f"postgres://{USER}:{PASSWORD}@localhost:{port}/{DBNAME}"


def _assert_anonymous(line: str) -> None:
    # localhost resolves to a loopback address, which libpq names in its message.
    for word in (USER, PASSWORD, DBNAME, "localhost", "127.0.0.1", "::1"):
        assert word not in line, (word, line)


@pytest.mark.django_db
def test_db_error__a_real_failed_connection_is_logged_without_its_identity(
    settings: Any,
) -> None:
    settings.DISPATCH_LISTEN_URL = _listen_url()
    with pytest.raises(psycopg.OperationalError) as failed:
        listen.connect("dispatch-listen log-test")
    assert USER in str(failed.value)  # libpq names the role (and the server)

    logged = db_error(failed.value)

    assert logged.startswith("OperationalError: connection failed: connection to server at")
    assert "does not exist" in logged
    _assert_anonymous(logged)
    # A connection string libpq cannot parse: its message quotes the piece it stopped at.
    with pytest.raises(psycopg.ProgrammingError) as failed:
        psycopg.connect(f"host=localhost user={USER} password={PASSWORD[:5]} {PASSWORD[5:]}")
    assert PASSWORD[5:] in str(failed.value)
    logged = db_error(failed.value)
    assert logged.startswith("ProgrammingError: missing")
    assert PASSWORD[5:] not in logged


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.parametrize("connection", ["listen", "site"])
def test_worker__reconnect_lines_name_no_user_host_or_password(
    processes: Processes, connection: str
) -> None:
    if connection == "listen":
        # The working connections are fine; the LISTEN URL names a role the server lacks.
        env = worker_env(DISPATCH_LISTEN_URL=_listen_url())
        marker = "LISTEN connection lost, reconnecting in"
    else:
        # Nothing listens on port 9 (discard): the site's database is down.
        url = _listen_url(port="9")
        assert test_database_url() != url
        env = worker_env(DATABASE_URL=url)
        marker = "database unavailable, retrying in"
    proc = processes.worker("--worker-id", "w-leaky", env=env)

    def logged() -> list[str] | None:
        found = [ln for ln in processes.output(proc).splitlines() if marker in ln]
        return found if len(found) >= 2 else None

    lines = wait_until(
        logged,
        timeout=30,
        message=f"two '{marker}' lines",
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    for line in lines:
        _assert_anonymous(line)
        assert "error=OperationalError" in line, line
    assert PASSWORD not in processes.output(proc)
