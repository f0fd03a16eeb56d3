"""A sink whose password is wrong: a permanent failure, no retry, no secret anywhere.

The machine's own server trusts local TCP connections, so a wrong password would be
accepted there; this test runs against an embedded server that requires passwords
(scram-sha-256), and first shows that the right password works."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from dispatch.core.states import Reason, Status
from dispatch.worker import claims
from dispatch.worker.runner import ExecutionControl, Runner
from project.embedded_pg import EmbeddedPostgres
from tests.support.factories import BindingFactory, DatasourceFactory, trigger
from tests.support.helpers import attempts_of
from tests.support.processes import ROOT

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

RIGHT = "Right-Pa55word-7f3a"
WRONG = "Wrong-Pa55word-91c2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(ROOT / ".data" / "test-password-pg", port=free_port(), password=RIGHT)
    pg.remove()  # a fresh server: initdb sets the password
    pg.start()
    pg.create_database("sink")
    try:
        yield pg
    finally:
        pg.remove()


def run_once(server: EmbeddedPostgres, password: str) -> tuple[str | None, list]:
    sink = DatasourceFactory(
        kind="postgresql",
        config={
            "host": "127.0.0.1",
            "port": server.port,
            "dbname": "sink",
            "user": "postgres",
            "password": password,
        },
    )
    binding = BindingFactory(
        sink=sink,
        job__max_attempts=3,
        job__source_spec={"rows": 20, "batch": 10},
        job__sink_spec={"table": "orders", "mode": "append", "create": True},
    )
    run = trigger(binding)
    [claimed] = claims.claim("password-test", run_id=run.id, limit=1, generic=False)
    status = Runner(claimed, ExecutionControl(claimed)).execute()
    return status, attempts_of(run)


def test_sink__right_password_succeeds(server: EmbeddedPostgres) -> None:
    status, attempts = run_once(server, RIGHT)
    assert status == Status.SUCCEEDED
    assert attempts[0].rows_written == 20


def test_sink__wrong_password_fails_permanently_and_no_secret_is_kept(
    server: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    status, attempts = run_once(server, WRONG)
    assert status == Status.FAILED
    assert [(a.status, a.reason) for a in attempts] == [(Status.FAILED, Reason.PERMANENT_ERROR)]
    error = attempts[0].error
    assert "password authentication failed" in error
    for secret in (WRONG, RIGHT):
        assert secret not in error
        assert secret not in caplog.text
    assert attempts[0].sink_snapshot is None  # erased with the outcome


def test_connect__never_uses_the_workers_own_passfile(
    server: EmbeddedPostgres, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dispatch.connectors.base import PermanentError
    from dispatch.connectors.postgresql import connect

    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:{server.port}:*:postgres:{RIGHT}\n")
    passfile.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    config = {"host": "127.0.0.1", "port": server.port, "dbname": "sink", "user": "postgres"}
    with pytest.raises(PermanentError, match="password"):
        connect(config)
    connect({**config, "password": RIGHT}).close()
