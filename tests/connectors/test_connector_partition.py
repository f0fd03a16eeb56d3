"""A source or sink database behind a silent partition: a proxy the test owns keeps the
connection open and answers nothing (tools/blackhole.py). A connector waiting on it
must not wait for ever: its watcher asks the server, on a connection of its own, what the
session is doing and drops the connection when nothing answers; a stop reaches it even
when the cancel request cannot; and nothing half-written stays in the sink."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connection

from dispatch.connectors.base import TransientError
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.connectors.postgresql.cancel import _Canceller
from tests.support.connectors import Ctx, ScratchDB, run_transfer, scratch_db
from tests.support.processes import wait_until
from tools.blackhole import BlackholeProxy

pytestmark = pytest.mark.django_db

ROWS = 2000


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_cpart_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_cpart_dst")


@dataclass
class CutOnFirstBlock(Ctx):
    """Blackholes the proxy when the first block has been read: the sink's writes and
    its commit then go nowhere."""

    proxy: Any = None

    def progress(self, *, rows_read: int = 0, rows_written: int = 0) -> None:
        if self.proxy is not None and not self.proxy._blackhole.is_set():
            self.proxy.blackhole()
        super().progress(rows_read=rows_read, rows_written=rows_written)


def _source(db: ScratchDB) -> None:
    db.execute("CREATE TABLE items (id integer PRIMARY KEY, label text)")
    db.execute(f"INSERT INTO items SELECT g, 'row ' || g FROM generate_series(1, {ROWS}) g")


def _through(proxy: BlackholeProxy, db: ScratchDB) -> dict[str, Any]:
    return {**db.config, "host": "127.0.0.1", "port": proxy.port}


def _no_sessions(db: ScratchDB) -> bool:
    """No connector session of ours is left on the server (a cut one ends when the proxy
    closes its side, and its transaction rolls back)."""
    return not db.execute(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND application_name = 'dispatch'"
    )


def _transfer_in_thread(
    src_db: ScratchDB, dst_db: ScratchDB, proxy: BlackholeProxy, ctx: Ctx
) -> tuple[threading.Thread, list[BaseException]]:
    """items -> target through the proxy, on a thread; the list receives its error."""
    outcome: list[BaseException] = []

    def transfer() -> None:
        try:
            run_transfer(
                PG, src_db.config, {"table": "items"}, PG, _through(proxy, dst_db),
                {"table": "target", "mode": "append"}, ctx,
            )  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)
        finally:
            connection.close()  # the site-database check's, of this thread

    thread = threading.Thread(target=transfer, daemon=True)
    thread.start()
    return thread, outcome


def _count(db: ScratchDB) -> int:
    return int(db.execute("SELECT count(*) FROM target")[0][0])


def test_connector_partition__a_silent_sink_is_dropped_by_its_probe_and_nothing_stays_half_written(
    src_db: ScratchDB, dst_db: ScratchDB, settings: Any
) -> None:
    settings.DISPATCH_CONNECTOR_PROBE_SECONDS = 1
    _source(src_db)
    dst_db.execute("CREATE TABLE target (id integer PRIMARY KEY, label text)")
    with BlackholeProxy("127.0.0.1", int(dst_db.config["port"])) as proxy:
        sink = _through(proxy, dst_db)
        ctx = CutOnFirstBlock(proxy=proxy)
        with pytest.raises(TransientError) as caught:
            run_transfer(
                PG, src_db.config, {"table": "items"}, PG, sink,
                {"table": "target", "mode": "append"}, ctx,
            )  # fmt: skip
        # The probe went through the same silent path and got nothing either.
        assert "sink" in str(caught.value)
        assert "no answer from the server" in str(caught.value), caught.value
        assert proxy.dropped_bytes > 0
        proxy.heal()
        # The dropped client closed its side; the proxy closes the server's, whose
        # transaction rolls back: nothing of the cut attempt is in the sink.
        wait_until(lambda: _no_sessions(dst_db), message="the cut sink session gone")
        assert _count(dst_db) == 0
        # After the heal the same path works again: every row once.
        result = run_transfer(
            PG, src_db.config, {"table": "items"}, PG, sink, {"table": "target", "mode": "append"}
        )
        assert result.rows_written == ROWS
        assert _count(dst_db) == ROWS


def test_connector_partition__a_silent_source_is_dropped_by_its_probe(
    src_db: ScratchDB, dst_db: ScratchDB, settings: Any
) -> None:
    settings.DISPATCH_CONNECTOR_PROBE_SECONDS = 1
    _source(src_db)
    dst_db.execute("CREATE TABLE target (id integer PRIMARY KEY, label text)")
    with BlackholeProxy("127.0.0.1", int(src_db.config["port"])) as proxy:
        # Silent before the COPY's first row arrives: the reader waits on the server.
        ctx = Ctx()
        reader = PG.open_reader(_through(proxy, src_db), {"table": "items"}, ctx)
        with reader as r, pytest.raises(TransientError) as caught:
            proxy.blackhole()
            list(r.copy_chunks("binary"))
        assert "source read" in str(caught.value)
        assert "no answer from the server" in str(caught.value), caught.value


def test_connector_partition__a_stop_reaches_a_sink_that_answers_nothing(
    src_db: ScratchDB, dst_db: ScratchDB, settings: Any
) -> None:
    # No probe: only the stop (a timeout, a cancel, a lost lease) can end the wait, and
    # its cancel request goes through the same silent path.
    settings.DISPATCH_CONNECTOR_PROBE_SECONDS = 0
    _source(src_db)
    dst_db.execute("CREATE TABLE target (id integer PRIMARY KEY, label text)")
    with BlackholeProxy("127.0.0.1", int(dst_db.config["port"])) as proxy:
        ctx = CutOnFirstBlock(proxy=proxy)
        thread, outcome = _transfer_in_thread(src_db, dst_db, proxy, ctx)
        # The commit was sent into the black hole: the transfer waits for its answer.
        wait_until(lambda: proxy.dropped_bytes > 0, message="bytes swallowed")
        assert thread.is_alive()
        ctx.stop = True
        for interrupt in list(ctx.interrupts):
            interrupt()  # as the runner does on a stop: the cancel request gets no answer
        thread.join(60)
        assert not thread.is_alive(), "the stopped transfer still waits on the silent sink"
        assert len(outcome) == 1 and isinstance(outcome[0], TransientError), outcome
        assert "the server did not answer a cancel request" in str(outcome[0])
        proxy.heal()
        wait_until(lambda: _no_sessions(dst_db), message="the cut sink session gone")
        assert _count(dst_db) == 0


def test_connector_partition__a_slow_statement_the_server_reports_running_is_left_alone(
    src_db: ScratchDB, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.DISPATCH_CONNECTOR_PROBE_SECONDS = 1
    seen: list[str | None] = []
    probe = _Canceller._probe

    def recorded(self: Any, timeout: float, pid: int | None) -> tuple[str | None, str]:
        state, stamp = probe(self, timeout, pid)
        seen.append(state)
        return state, stamp

    monkeypatch.setattr(_Canceller, "_probe", recorded)
    src_db.execute("CREATE TABLE items (id integer PRIMARY KEY, label text)")
    src_db.execute("INSERT INTO items VALUES (1, 'one')")
    ctx = Ctx()
    # A query that keeps the server busy for several probe intervals before its first
    # row: the probe sees it "active" and never drops it.
    spec = {"query": "SELECT id, label FROM items, pg_sleep(4)"}
    PG.validate_source_spec(spec)
    with PG.open_reader(src_db.config, spec, ctx) as reader:
        chunks = list(reader.copy_chunks("binary"))
    assert sum(rows for _, rows in chunks) == 1
    # The watcher did ask, and the server said its session was running.
    assert seen.count("working") >= 2, seen


def test_connector_partition__a_request_lost_in_a_short_partition_is_found_after_the_heal(
    src_db: ScratchDB, dst_db: ScratchDB, settings: Any
) -> None:
    settings.DISPATCH_CONNECTOR_PROBE_SECONDS = 1
    _source(src_db)
    dst_db.execute("CREATE TABLE target (id integer PRIMARY KEY, label text)")
    with BlackholeProxy("127.0.0.1", int(dst_db.config["port"])) as proxy:
        ctx = CutOnFirstBlock(proxy=proxy)
        thread, outcome = _transfer_in_thread(src_db, dst_db, proxy, ctx)
        # The sink's request vanished; the path heals before any probe ran. The server
        # answers now, and says it waits for the client: the request is lost.
        wait_until(lambda: proxy.dropped_bytes > 0, message="bytes swallowed")
        proxy.heal()
        thread.join(60)
        assert not thread.is_alive(), "the transfer still waits for an answer that never comes"
        assert len(outcome) == 1 and isinstance(outcome[0], TransientError), outcome
        assert "the server waits for the client" in str(outcome[0]), outcome[0]
        wait_until(lambda: _no_sessions(dst_db), message="the cut sink session gone")
        assert _count(dst_db) == 0
