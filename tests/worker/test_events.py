"""The attempt's event log in SQL: written only under the lease token's guard, capped,
counted when dropped, and what the settlement adds."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from dispatch.connectors.builtin import GenerateConnector
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.core.db import db_now
from dispatch.core.states import Status
from dispatch.models import Attempt, AttemptEvent
from dispatch.worker import claims
from dispatch.worker.events import EventBuffer
from dispatch.worker.runner import Context, ExecutionControl, Runner
from tests.support.connectors import Ctx, ScratchDB, connect, run_transfer, scratch_db
from tests.support.factories import BindingFactory, trigger
from tests.support.helpers import attempts_of, claim_one, expire
from tests.support.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _events(*kinds: str) -> claims.Events:
    buffer = EventBuffer(cap=1000)
    for kind in kinds:
        buffer.record(kind, f"{kind} happened", n=1)
    events, lost = buffer.take()
    return EventBuffer.as_json(events), lost


def _kinds(attempt_id: object) -> list[str]:
    return list(
        AttemptEvent.objects.filter(attempt_id=attempt_id)
        .order_by("seq")
        .values_list("kind", flat=True)
    )


def test_events__written_with_the_heartbeat_under_the_lease_token():
    trigger(BindingFactory())
    c = claim_one()
    beats = claims.heartbeat(
        "w1", [(c.attempt_id, c.lease_token, 5, 4, _events("claimed", "connected"))], {}
    )
    assert c.attempt_id in beats
    logged = list(AttemptEvent.objects.filter(attempt_id=c.attempt_id).order_by("seq"))
    assert [(e.seq, e.kind, e.message, e.data) for e in logged] == [
        (1, "claimed", "claimed happened", {"n": 1}),
        (2, "connected", "connected happened", {"n": 1}),
    ]
    a = Attempt.objects.get(pk=c.attempt_id)
    assert (a.events_seen, a.events_dropped, a.rows_read) == (2, 0, 5)
    # Times are the database's clock at the write, minus how long before it the worker
    # saw them (after the claim here: the buffer was filled after it).
    assert all(a.claimed_at <= e.at <= db_now() for e in logged)


def test_events__a_stale_worker_writes_nothing_into_its_successor_s_log():
    run = trigger(BindingFactory())
    old = claim_one("old")
    expire(Attempt.objects.get(pk=old.attempt_id))
    claims.recover()
    new = claim_one("new")
    assert new.run_id == run.id and new.lease_token > old.lease_token
    claims.heartbeat("new", [(new.attempt_id, new.lease_token, 0, 0, _events("claimed"))], {})
    before_new = _kinds(new.attempt_id)
    before_old = _kinds(old.attempt_id)
    # The stale worker, with its own token: against the successor's attempt, and against
    # its own (expired) one; and the settlement it would try. The SQL refuses each.
    for attempt_id in (new.attempt_id, old.attempt_id):
        beats = claims.heartbeat(
            "old", [(attempt_id, old.lease_token, 9, 9, _events("committed", "error"))], {}
        )
        assert beats == {}
    assert claims.settle(old.attempt_id, old.lease_token, "ERROR", events=_events("error")) is None
    # The successor's worker name with the stale token: refused too (the token decides).
    assert (
        claims.heartbeat("new", [(new.attempt_id, old.lease_token, 0, 0, _events("x"))], {}) == {}
    )
    assert _kinds(new.attempt_id) == before_new == ["claimed"]
    assert _kinds(old.attempt_id) == before_old == ["settled"]
    assert Attempt.objects.get(pk=new.attempt_id).events_seen == 1


def test_events__the_cap_counts_what_it_drops_in_sql():
    trigger(BindingFactory())
    c = claim_one()
    with override_settings(DISPATCH_EVENTS_PER_ATTEMPT=3):
        claims.heartbeat("w1", [(c.attempt_id, c.lease_token, 0, 0, _events("a", "b"))], {})
        claims.heartbeat("w1", [(c.attempt_id, c.lease_token, 0, 0, _events("c", "d", "e"))], {})
        # Two more the worker's own full buffer dropped: counted, never stored.
        claims.heartbeat("w1", [(c.attempt_id, c.lease_token, 0, 0, ("[]", 2))], {})
        status = claims.settle(c.attempt_id, c.lease_token, "SUCCEEDED", events=_events("f"))
    assert status == Status.SUCCEEDED
    # Three of the worker's events, then the settlement's own (outside the cap).
    assert _kinds(c.attempt_id) == ["a", "b", "c", "settled"]
    a = Attempt.objects.get(pk=c.attempt_id)
    assert (a.events_seen, a.events_dropped) == (8, 5)
    settled = AttemptEvent.objects.get(attempt_id=c.attempt_id, kind="settled")
    assert settled.data["status"] == "SUCCEEDED" and settled.seq == 9


def test_events__the_worker_buffer_keeps_at_most_the_cap_and_counts_the_rest():
    buffer = EventBuffer(cap=2)
    for kind in ("a", "b", "c", "d"):
        buffer.record(kind, kind)
    events, lost = buffer.take(in_flight=True)
    assert [e[1] for e in events] == ["a", "b"] and lost == 2
    buffer.record("e", "e")
    buffer.put_back(events, lost)  # a failed heartbeat gives them back, first
    events, lost = buffer.take()
    assert [e[1] for e in events] == ["a", "b"] and lost == 3


def test_events__a_secret_in_an_error_never_reaches_the_log():
    trigger(BindingFactory())
    c = claim_one()
    control = ExecutionControl(c)
    runner = Runner(c, control)
    runner.secrets = ["hunter2-secret"]
    status = runner.settle(
        "ERROR",
        "ERROR",
        'connection to server failed: password authentication failed for "app" '
        "(password=hunter2-secret) postgres://app:hunter2-secret@db/x",
    )
    assert status == Status.RETRY_SCHEDULED
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT kind, message, data::text FROM dispatch_attemptevent WHERE attempt_id = %s"
            " ORDER BY seq",
            [c.attempt_id],
        )
        rows = cursor.fetchall()
    assert [r[0] for r in rows] == ["error", "settled"]
    assert "hunter2" not in json.dumps(rows)
    assert "********" in rows[0][1]
    assert attempts_of(Attempt.objects.get(pk=c.attempt_id).run)[1].status == Status.PENDING


def test_events__what_a_server_says_in_an_events_data_is_sanitized_and_cut():
    """An event's data carries text from connectors and servers (a version string that a
    hostile server chooses): secrets stripped as in messages, and cut to its bound."""
    from dispatch.worker.runner import MAX_EVENT_VALUE_CHARS, Context

    trigger(BindingFactory())
    control = ExecutionControl(claim_one())
    ctx = Context(control, ["hunter2-secret"])
    ctx.event(
        "connected",
        "",
        side="source",
        server_version="16.4 hunter2-secret " + "x" * 5000,
        rows=3,
    )
    events, _ = control.events.take()
    (_, kind, message, data) = events[0]
    assert kind == "connected" and "hunter2" not in message
    assert "hunter2" not in data["server_version"] and "********" in data["server_version"]
    assert len(data["server_version"]) == MAX_EVENT_VALUE_CHARS and data["rows"] == 3


@dataclass
class EventCtx(Ctx):
    """A connector context that keeps the events a connector notes, as the runner's does."""

    events: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.events.append((kind, message, data))


@pytest.fixture
def sink_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_events_sink")


def test_events__the_postgresql_sink_notes_its_wait_for_the_fence_row(sink_db: ScratchDB):
    """A rival's data transaction holds the run's fence row: the writer notes how long it
    waited for it (the runner keeps it over DISPATCH_EVENT_LOCK_WAIT_SECONDS), then the
    fence it raised."""
    ctx = EventCtx()
    spec = {"table": "t", "create": True}
    run_transfer(GenerateConnector, {}, {"rows": 1}, PG, sink_db.config, spec, EventCtx())
    done: list[Any] = []
    with connect(sink_db.name) as rival:
        rival.autocommit = False
        rival.execute(
            "INSERT INTO dispatch_fence (run_id, binding_id, token) VALUES (%s, %s, 0)",
            [ctx.fence.run_id, ctx.fence.binding_id],
        )

        def transfer() -> None:
            try:
                done.append(
                    run_transfer(GenerateConnector, {}, {"rows": 2}, PG, sink_db.config, spec, ctx)
                )
            except BaseException as exc:  # noqa: BLE001 - reported below
                done.append(exc)

        thread = threading.Thread(target=transfer)
        thread.start()
        wait_until(
            lambda: sink_db.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND wait_event = 'transactionid'"
            )[0][0],
            message="the writer waits on the rival's fence row",
        )
        rival.commit()
        thread.join(timeout=60)
    assert len(done) == 1 and not isinstance(done[0], BaseException), done
    kinds = [k for k, _, _ in ctx.events]
    assert kinds == ["connected", "lock_wait", "fence_raised", "read_started"]
    assert ctx.events[0][2]["side"] == "sink" and ctx.events[0][2]["server_version"]
    waited = ctx.events[1][2]["seconds"]
    assert waited > 0 and ctx.events[1][1] == "the sink's fence row"
    # The runner's context keeps a wait only over the threshold.
    trigger(BindingFactory())
    c = claim_one()
    with override_settings(DISPATCH_EVENT_LOCK_WAIT_SECONDS=waited / 2):
        runner_ctx = Context(ExecutionControl(c))
    with override_settings(DISPATCH_EVENT_LOCK_WAIT_SECONDS=waited + 1):
        quiet = Context(ExecutionControl(c))
    quiet.event("lock_wait", "the sink's fence row", seconds=waited)
    runner_ctx.event("lock_wait", "the sink's fence row", seconds=waited)
    assert quiet.control.events.take()[0] == []
    [(_, kind, message, data)] = runner_ctx.control.events.take()[0]
    assert kind == "lock_wait" and message.startswith("waited ") and data["seconds"] > 0
