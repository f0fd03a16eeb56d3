"""Schema changes through a real worker: the DDL a policy applies commits with the rows or
not at all (docs/connectors.md, "Schema changes").

The sink's rows reference a gate row; a session holding that row FOR UPDATE stops the
worker's COPY, which comes after the ALTER TABLE in the same transaction. The worker is
SIGKILLed there: neither the column nor a row may be left in the sink, and the retry adds
both and records the change on its attempt."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dispatch.core.states import Reason, Status
from dispatch.models import Attempt
from tests.support import factories
from tests.support.connectors import ScratchDB, scratch_db
from tests.support.gates import (
    Holders,
    crash_binding,
    gate_table,
    kill_while_held,
    succeed,
    waiting_on,
)
from tests.support.processes import Processes, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROWS = 2000


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_schema_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_schema_dst")


def _sink_columns(dst: ScratchDB) -> list[str]:
    return [
        r[0]
        for r in dst.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'copy'::regclass"
            " AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        )
    ]


def test_schema_change__killed_between_the_ddl_and_the_commit_leaves_neither(
    src_db: ScratchDB, dst_db: ScratchDB, processes: Processes, holders: Holders
) -> None:
    src_db.execute("CREATE TABLE items (id bigint PRIMARY KEY, gate text, extra numeric(8,2))")
    src_db.execute(
        "INSERT INTO items SELECT i, CASE WHEN i > 1500 THEN 'b' ELSE 'a' END, i / 4.0"
        " FROM generate_series(1, %s) i",
        [ROWS],
    )
    gate_table(dst_db)
    dst_db.execute("CREATE TABLE copy (id bigint, gate text REFERENCES gate)")
    binding = crash_binding(
        ("postgresql", src_db.config),
        ("postgresql", dst_db.config),
        {"table": "items"},
        {"table": "copy", "mode": "append", "on_new_column": "add"},
    )
    holder = holders.gate(dst_db)
    run = factories.trigger(binding)
    doomed = processes.worker("--worker-id", "doomed")
    wait_until(lambda: waiting_on(dst_db, holder), timeout=60, message="the COPY waits")
    # The ALTER TABLE is done, uncommitted, in the waiting transaction: it holds the
    # table ACCESS EXCLUSIVE.
    [(mode,)] = dst_db.execute(
        "SELECT mode FROM pg_locks WHERE relation = 'copy'::regclass AND pid = %s"
        " AND granted AND mode = 'AccessExclusiveLock'",
        [waiting_on(dst_db, holder)[0]],
    )
    assert mode == "AccessExclusiveLock"
    kill_while_held(dst_db, holder, doomed)
    wait_until(
        lambda: (
            not dst_db.execute(
                "SELECT 1 FROM pg_locks WHERE relation = 'copy'::regclass AND mode ="
                " 'AccessExclusiveLock'"
            )
        ),
        timeout=30,
        message="the killed session's transaction rolled back",
    )
    assert _sink_columns(dst_db) == ["id", "gate"]  # no column added
    assert dst_db.execute("SELECT count(*) FROM copy") == [(0,)]  # no row either
    succeed(processes, run, "successor")
    assert _sink_columns(dst_db) == ["id", "gate", "extra"]
    assert dst_db.execute("SELECT count(*), count(DISTINCT id), sum(extra) FROM copy") == [
        (ROWS, ROWS, src_db.execute("SELECT sum(extra) FROM items")[0][0])
    ]
    attempts = list(Attempt.objects.filter(run=run).order_by("number"))
    first, last = attempts[0], attempts[-1]
    assert first.status == Status.RETRY_SCHEDULED and first.reason == Reason.LEASE_EXPIRED
    assert first.schema_changes is None
    assert last.status == Status.SUCCEEDED
    assert last.schema_changes == [{"column": "extra", "change": "added", "type": "numeric(8,2)"}]
