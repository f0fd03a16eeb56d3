"""Receipts: every delivery into a PostgreSQL sink commits its rows and their digest with
the rows; `check_invariants --receipts` recomputes them on the sink and catches a row
changed behind dispatch's back."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from psycopg import sql

from dispatch.connectors import receipt
from dispatch.connectors.csv import CSVConnector as CSV
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.core.states import Status
from dispatch.models import Attempt, Run
from dispatch.verify import invariants
from dispatch.verify.invariants import Scope
from dispatch.worker import claims
from dispatch.worker.runner import ExecutionControl, Runner
from tests.support.connectors import Ctx, ScratchDB, run_transfer, scratch_db
from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory, trigger
from tools import typesample

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def src() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_receipt_src")


@pytest.fixture
def dst() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_receipt_dst")


def _typed_source(db: ScratchDB, sink: ScratchDB) -> list[str]:
    """The typed sample (500 rows) in `db`, its enum and domain in `sink` too."""
    sink.execute(typesample.TYPES.split("CREATE TABLE")[0])
    db.execute(typesample.TYPES.format(table="source"))
    db.execute(typesample.ROWS)
    db.execute(
        "INSERT INTO source (id, c_text) SELECT g, 'row ' || g FROM generate_series(4, 500) g"
    )
    return [
        r[0]
        for r in db.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'source'::regclass"
            " AND attnum > 0 ORDER BY attnum"
        )
    ]


def _sql_digest(db: ScratchDB, table: str, columns: list[str]) -> tuple[int, str]:
    from tests.support.connectors import connect

    with connect(db.name) as conn:
        conn.execute(receipt.OUTPUT_SETTINGS_SQL)
        row = conn.execute(receipt.digest_sql(sql.Identifier(table), columns)).fetchone()
    assert row is not None
    return int(row[1]), str(row[2])


def _receipts(db: ScratchDB) -> list[tuple[Any, ...]]:
    return db.execute(
        "SELECT run_id, attempt_id, mode, rows, digest FROM dispatch_receipt ORDER BY committed_at"
    )


def test_digest__the_worker_and_sql_agree_on_every_type(src: ScratchDB, dst: ScratchDB) -> None:
    """The 35-type table (awkward values: tabs, newlines, backslashes, NaN, BC dates, json
    as written) copied as text: the digest the writer computed while the rows streamed is
    the one SQL computes on the source and on the sink."""
    columns = _typed_source(src, dst)
    ctx = Ctx()
    run_transfer(
        PG,
        src.config,
        {"table": "source"},
        PG,
        dst.config,
        {"table": "copy", "create": True, "receipt": True},
        ctx,
    )
    ((run_id, attempt_id, mode, rows, digest),) = _receipts(dst)
    assert (run_id, attempt_id, mode) == (ctx.fence.run_id, ctx.fence.attempt_id, "append")
    assert (
        (rows, digest) == _sql_digest(src, "source", columns) == _sql_digest(dst, "copy", columns)
    )
    assert rows == 500
    # One changed value changes the digest, not the count.
    dst.execute("UPDATE copy SET c_boolean = NOT c_boolean WHERE id = 1")
    assert _sql_digest(dst, "copy", columns) == (500, _sql_digest(dst, "copy", columns)[1])
    assert _sql_digest(dst, "copy", columns)[1] != digest


def test_digest__order_independent_and_combines() -> None:
    a, b = receipt.Digest(), receipt.Digest()
    a.add_text_block(b"1\tx\n2\ty\n")
    a.add_text_block(b"3\t\\N\n")
    b.add_text_block(b"3\t\\N\n2\ty\n1\tx\n")
    assert (a.rows, a.hex()) == (b.rows, b.hex()) == (3, a.hex())
    one, two = receipt.Digest(), receipt.Digest()
    one.add_text_block(b"1\tx\n")
    two.add_text_block(b"2\ty\n3\t\\N\n")
    assert receipt.combine([one.hex(), two.hex()]) == a.hex()
    changed = receipt.Digest()
    changed.add_text_block(b"1\tx\n2\tz\n3\t\\N\n")
    assert changed.hex() != a.hex()


def test_receipt__by_default_keeps_the_count_and_lets_binary_through(
    src: ScratchDB, dst: ScratchDB
) -> None:
    _typed_source(src, dst)
    run_transfer(
        PG,
        src.config,
        {"table": "source"},
        PG,
        dst.config,
        {"table": "copy", "create": True},
    )
    assert [(r[3], r[4]) for r in _receipts(dst)] == [(500, None)]


def test_receipt__a_csv_file_passed_through_gets_its_count(tmp_path: Path, dst: ScratchDB) -> None:
    (tmp_path / "in.csv").write_text("id,name\n1,a\n2,b\n3,c\n")
    dst.execute("CREATE TABLE t (id int, name text)")
    run_transfer(
        CSV, {"base_dir": str(tmp_path)}, {"path": "in.csv"}, PG, dst.config, {"table": "t"}
    )
    assert [(r[3], r[4]) for r in _receipts(dst)] == [(3, None)]


def test_sink_spec__receipt_flags_are_booleans() -> None:
    from django.core.exceptions import ValidationError

    for flag in ("receipt", "attempt_column"):
        with pytest.raises(ValidationError, match=f"{flag}: must be true or false"):
            PG.validate_sink_spec({"table": "t", flag: "yes"})


# --- end to end: real runs, then the checker ---------------------------------------------
def _binding(src: ScratchDB, dst: ScratchDB, sink_spec: dict[str, Any]) -> Any:
    job = JobFactory(source_spec={"table": "public.source"}, sink_spec=sink_spec)
    return BindingFactory(
        job=job,
        source=DatasourceFactory(kind="postgresql", config=src.config),
        sink=DatasourceFactory(kind="postgresql", config=dst.config),
    )


def _run(binding: Any) -> Run:
    run = trigger(binding)
    (claimed,) = claims.claim("w-receipt", run_id=run.id, limit=1, generic=False)
    assert Runner(claimed, ExecutionControl(claimed)).execute() == Status.SUCCEEDED
    return run


def _attempt(run: Run) -> Attempt:
    return Attempt.objects.get(run=run, status=Status.SUCCEEDED)


def _check(*runs: Run) -> invariants.Report:
    return invariants.check(Scope(run_ids=frozenset(r.id for r in runs)), receipts=True)


def test_receipts__replace_verified_then_a_row_changed_in_the_sink_is_caught(
    src: ScratchDB, dst: ScratchDB, admin_client: Client
) -> None:
    _typed_source(src, dst)
    binding = _binding(
        src, dst, {"table": "public.copy", "mode": "replace", "create": True, "receipt": True}
    )
    first, second = _run(binding), _run(binding)
    attempt = _attempt(second)
    (sink_rows, sink_digest) = dst.execute(
        "SELECT rows, digest FROM dispatch_receipt WHERE run_id = %s", [second.id]
    )[0]
    assert (
        (attempt.receipt_rows, attempt.receipt_digest)
        == (sink_rows, sink_digest)
        == (
            500,
            sink_digest,
        )
    )
    assert sink_digest is not None and len(sink_digest) == 16
    report = _check(first, second)
    assert report.ok, report.render()
    # The table is the latest delivery's: the first run's receipt is superseded.
    assert (report.counts["receipts_verified"], report.counts["receipts_superseded"]) == (1, 1)
    attempt.refresh_from_db()
    assert attempt.receipt_verification == "match" and attempt.receipt_verified_at is not None
    page = admin_client.get(reverse("admin:dispatch_run_change", args=[second.pk]))
    assert f"500 rows, digest {sink_digest}; verified " in page.content.decode()
    assert ": match" in page.content.decode()

    dst.execute("UPDATE copy SET c_text = 'changed behind its back' WHERE id = 42")
    report = _check(second)
    assert {v.check for v in report.violations} == {"receipt"}
    assert f"the receipt's digest is {sink_digest}" in report.render()
    attempt.refresh_from_db()
    assert attempt.receipt_verification is not None
    assert attempt.receipt_verification.startswith(f"the receipt's digest is {sink_digest}")

    dst.execute("DELETE FROM copy WHERE id = 43")
    assert "the receipt says 500 rows, the sink holds 499" in _check(second).render()


def test_receipts__append_verified_by_the_attempt_column(src: ScratchDB, dst: ScratchDB) -> None:
    _typed_source(src, dst)
    binding = _binding(
        src,
        dst,
        {
            "table": "public.copy",
            "mode": "append",
            "create": True,
            "attempt_column": True,
            "receipt": True,
        },
    )
    first, second = _run(binding), _run(binding)
    held = dst.execute(
        "SELECT _dispatch_attempt, count(*) FROM copy GROUP BY 1 ORDER BY 2, 1::text"
    )
    assert sorted(r[0] for r in held) == sorted([_attempt(first).id, _attempt(second).id])
    assert [r[1] for r in held] == [500, 500]
    report = _check(first, second)
    assert report.ok, report.render()
    assert report.counts["receipts_verified"] == 2
    # A row of the second delivery changed: only its receipt differs.
    dst.execute(
        "UPDATE copy SET c_integer = -1 WHERE id = 7 AND _dispatch_attempt = %s",
        [_attempt(second).id],
    )
    report = _check(first, second)
    assert [v.subject.split(" ")[0] for v in report.violations] == [str(second.id)]
    assert _attempt(first).receipt_verification == "match"
    # Rows written by something else hold no attempt: no receipt counts them.
    dst.execute("INSERT INTO copy (id) VALUES (100000)")
    assert dst.execute("SELECT _dispatch_attempt FROM copy WHERE id = 100000") == [(None,)]


def test_receipts__append_without_the_column_is_unverifiable_not_a_match(
    src: ScratchDB, dst: ScratchDB
) -> None:
    _typed_source(src, dst)
    run = _run(_binding(src, dst, {"table": "public.copy", "mode": "append", "create": True}))
    report = _check(run)
    assert report.ok, report.render()
    assert (report.counts["receipts_verified"], report.counts["receipts_unverifiable"]) == (0, 1)
    assert _attempt(run).receipt_verification is None


def test_command__receipts_flag(src: ScratchDB, dst: ScratchDB, tmp_path: Path) -> None:
    _typed_source(src, dst)
    run = _run(
        _binding(
            src, dst, {"table": "public.copy", "mode": "replace", "create": True, "receipt": True}
        )
    )
    ids = tmp_path / "ids"
    ids.write_text(f"{run.id}\n")
    out = io.StringIO()
    call_command("check_invariants", "--run-ids", str(ids), "--receipts", stdout=out)
    assert "receipts_verified=1" in out.getvalue()
    dst.execute("UPDATE copy SET c_text = 'x' WHERE id = 1")
    with pytest.raises(SystemExit):
        call_command("check_invariants", "--run-ids", str(ids), "--receipts", stdout=io.StringIO())
    assert uuid.UUID(str(run.id))
