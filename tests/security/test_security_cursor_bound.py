"""An incremental cursor's values are bounded (`limits.MAX_CURSOR_VALUE_BYTES` of their
text form): a source row with a larger one fails the run for good before anything is
written, the spec and an operator cannot set one, the binding's page shows a cursor cut
and escaped, and a CSV sink's state that cannot be read is replaced by Reset or Set
cursor instead of blocking the binding until someone edits the file (docs/security.md,
"Cursor values")."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse

from dispatch.connectors import csv_state, incremental
from dispatch.connectors.base import PermanentError
from dispatch.connectors.csv import CSVConnector as CSV
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from dispatch.console.badges import OUTCOME_TEXT
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, BindingCursor, Datasource, JobBinding, Run
from dispatch.security import limits
from dispatch.worker.runner import ExecutionControl, Runner
from tests.support import factories
from tests.support.connectors import Ctx, Fence, ScratchDB, connect, run_transfer, scratch_db
from tests.support.helpers import claim_one

MARK = "do-not-quote-me"  # the start of the oversize value: never in an error or a page
OVERSIZE = MARK + "z" * limits.MAX_CURSOR_VALUE_BYTES
SOURCE_SPEC = {"table": "items", "incremental": {"cursor": ["k"]}}


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_curbound_src")


@pytest.fixture
def dst_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_curbound_dst")


@pytest.fixture
def csv_dir(tmp_path: Path, settings: Any) -> Path:
    settings.DISPATCH_CSV_BASE_DIRS = [str(tmp_path)]
    return tmp_path


def _items(src: ScratchDB, rows: int = 5) -> None:
    src.execute("CREATE TABLE items (id bigint PRIMARY KEY, k text NOT NULL)")
    src.execute(
        "INSERT INTO items SELECT i, lpad(i::text, 4, '0') FROM generate_series(1, %s) i",
        [rows],
    )


def _binding(src: ScratchDB, sink_kind: str, sink_config: dict[str, Any]) -> JobBinding:
    source = Datasource(name=f"src-{uuid.uuid4().hex[:8]}", kind="postgresql", config=src.config)
    source.save()
    sink = Datasource(name=f"dst-{uuid.uuid4().hex[:8]}", kind=sink_kind, config=sink_config)
    sink.save()
    sink_spec: dict[str, Any] = (
        {"path": "out.csv", "mode": "append"}
        if sink_kind == "csv"
        else {"table": "copy", "mode": "append", "create": True}
    )
    job = factories.JobFactory(
        source_spec=SOURCE_SPEC, sink_spec=sink_spec, max_attempts=3, backoff_seconds=0
    )
    return factories.BindingFactory(job=job, source=source, sink=sink)


def _run(binding: JobBinding) -> Attempt:
    """One run of `binding` through the real trigger, claim and an in-process execution."""
    run = factories.trigger(binding)
    claimed = claim_one()
    Runner(claimed, ExecutionControl(claimed)).execute()
    return Attempt.objects.get(pk=claimed.attempt_id, run=run)


def _rows_in(db: ScratchDB, table: str) -> int:
    """The rows of `table` (none when the sink never made it)."""
    if db.execute("SELECT to_regclass(%s) IS NULL", [f"public.{table}"]) == [(True,)]:
        return 0
    return int(db.execute(f"SELECT count(*) FROM public.{table}")[0][0])


def _csv_rows(base: Path) -> list[str]:
    lines = (base / "out.csv").read_text().splitlines()
    assert lines[0] == "id,k"
    return [line.split(",")[0] for line in lines[1:]]


# --- the reader: a new cursor over the bound -------------------------------------------------
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("sink_kind", ["postgresql", "csv"])
def test_runner__a_cursor_value_over_the_bound_fails_the_run_for_good_before_any_write(
    src_db: ScratchDB, dst_db: ScratchDB, csv_dir: Path, sink_kind: str
) -> None:
    _items(src_db)
    src_db.execute("INSERT INTO items VALUES (6, %s)", [OVERSIZE])  # the greatest k
    config = {"base_dir": str(csv_dir)} if sink_kind == "csv" else dst_db.config
    binding = _binding(src_db, sink_kind, config)

    attempt = _run(binding)

    # Permanent: the next attempt would read the same row again.
    assert (attempt.status, attempt.reason) == (Status.FAILED, Reason.PERMANENT_ERROR)
    assert Attempt.objects.filter(run=attempt.run_id).count() == 1
    assert Run.objects.get(pk=attempt.run_id).status == Status.FAILED
    assert attempt.error == (
        f"cursor column 'k': value is {len(OVERSIZE)} bytes, more than the 4096 allowed"
    )
    assert MARK not in (attempt.error or "")
    assert attempt.cursor_to is None and attempt.rows_written == 0
    # Nothing reached the sink: no row, no committed cursor.
    if sink_kind == "csv":
        assert sorted(p.name for p in csv_dir.iterdir()) == []
    else:
        assert _rows_in(dst_db, "copy") == 0
        assert _rows_in(dst_db, "dispatch_cursor") == 0
    assert not BindingCursor.objects.filter(binding=binding).exists()


@pytest.mark.django_db
def test_transfer__a_committed_cursor_over_the_bound_asks_for_a_reset(
    src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    """A cursor committed before the bound existed (or written into the sink by hand) is
    never read from, stored on an attempt or committed again."""
    _items(src_db)
    binding = uuid.uuid4()
    with connect(dst_db.name) as conn:
        incremental.set_committed(conn, "public", binding, columns=("k",), cursor=[OVERSIZE])
    with pytest.raises(PermanentError) as failed:
        run_transfer(
            PG,
            src_db.config,
            SOURCE_SPEC,
            PG,
            dst_db.config,
            {"table": "copy", "mode": "append", "create": True},
            Ctx(Fence(binding_id=binding)),
        )
    assert str(failed.value) == (
        f"the sink's committed cursor: cursor column 'k': value is {len(OVERSIZE)} bytes, "
        "more than the 4096 allowed; reset or set the binding's cursor"
    )
    assert _rows_in(dst_db, "copy") == 0


# --- the spec and the operator -----------------------------------------------------------------
def test_spec__start_values_and_cursor_columns_are_bounded() -> None:
    # Bytes of the text, not characters: 2,048 two-byte characters fit, 2,049 do not.
    assert incremental.parse({"incremental": {"cursor": ["k"], "start": ["é" * 2048]}})
    with pytest.raises(ValidationError) as err:
        incremental.parse({"incremental": {"cursor": ["k"], "start": ["é" * 2049]}})
    assert err.value.messages == [
        "incremental.start: cursor column 'k': value is 4098 bytes, more than the 4096 allowed"
    ]
    columns = [f"c{i}" for i in range(limits.MAX_CURSOR_COLUMNS + 1)]
    with pytest.raises(ValidationError, match="incremental.cursor: at most 8 columns, not 9"):
        incremental.parse({"incremental": {"cursor": columns}})


@pytest.mark.django_db
def test_set_cursor__a_value_over_the_bound_is_refused_in_the_form(
    admin_client: Client, src_db: ScratchDB, dst_db: ScratchDB
) -> None:
    binding = _binding(src_db, "postgresql", dst_db.config)
    url = reverse("admin:dispatch_jobbinding_object_action", args=[binding.pk, "set_cursor"])

    response = admin_client.post(url, {"post": "yes", "value": json.dumps([OVERSIZE])}, follow=True)

    assert response.status_code == 200
    page = response.content.decode()
    assert (
        f"cursor column &#x27;k&#x27;: value is {len(OVERSIZE)} bytes, more than the 4096 "
        "allowed" in page
    )
    assert MARK not in page
    entry = LogEntry.objects.get(object_id=str(binding.pk))
    assert "refused (BAD_CURSOR)" in entry.get_change_message()
    assert MARK not in entry.get_change_message()
    # The sink was never asked.
    assert dst_db.execute("SELECT count(*) FROM pg_tables WHERE tablename = 'dispatch_cursor'") == [
        (0,)
    ]
    assert not BindingCursor.objects.exists()


@pytest.mark.django_db
def test_binding_page__shows_a_long_cursor_cut_and_escaped(admin_client: Client) -> None:
    job = factories.JobFactory(source_spec={"rows": 1, "incremental": {"cursor": ["k"]}})
    binding = factories.BindingFactory(job=job)
    # A copy written before the bound, as large as a value may be and markup in it.
    value = "<script>alert(1)</script>" + "x" * limits.MAX_CURSOR_VALUE_BYTES
    BindingCursor.objects.create(binding=binding, columns=["k"], cursor=[value], version=1)

    page = admin_client.get(
        reverse("admin:dispatch_jobbinding_change", args=[binding.pk])
    ).content.decode()

    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>alert(1)" not in page
    assert "x" * 300 not in page
    assert f"({len(json.dumps([value]))} characters in all)" in page


# --- a CSV sink's state that cannot be read ----------------------------------------------------
UNREADABLE = {
    # Valid JSON, but more than its reader takes.
    "too large": json.dumps({"format": 1, "pad": "x" * limits.MAX_CSV_STATE_BYTES}).encode(),
    "not JSON": b"\xff\xfe{ not json",
    "wrong shape": json.dumps({"format": 1, "size": "many", "cursors": {"x": []}}).encode(),
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("action", ["reset_cursor", "set_cursor"])
@pytest.mark.parametrize("damage", sorted(UNREADABLE))
def test_csv_state__unreadable_is_replaced_by_reset_and_set_cursor(
    admin_client: Client,
    src_db: ScratchDB,
    csv_dir: Path,
    damage: str,
    action: str,
) -> None:
    _items(src_db)
    binding = _run_once_then_damage(src_db, csv_dir, damage)
    failed = _run(binding)
    assert failed.status == Status.FAILED  # for good, until an operator acts
    assert "the state file of 'out.csv'" in (failed.error or "")
    url = reverse("admin:dispatch_jobbinding_object_action", args=[binding.pk, action])
    data = {"post": "yes"}
    if action == "set_cursor":
        data["value"] = json.dumps(["0003"])

    response = admin_client.post(url, data, follow=True)

    assert response.status_code == 200
    page = response.content.decode()
    assert OUTCOME_TEXT["CURSOR_RESET" if action == "reset_cursor" else "CURSOR_SET"] in page
    assert "it was replaced; any other binding appending to the file starts again" in page
    entry = LogEntry.objects.filter(object_id=str(binding.pk)).latest("action_time")
    assert "it was replaced" in entry.get_change_message()
    state = json.loads((csv_dir / ".out.csv.dispatch-state.json").read_text())
    # Above the console's copy (version 1, from the first run), so the copy moves too.
    assert state["cursors"][str(binding.pk)]["version"] == 2
    assert BindingCursor.objects.get(binding=binding).version == 2
    # The next run reads from the start (reset) or from the point set, and appends.
    attempt = _run(binding)
    assert attempt.status == Status.SUCCEEDED, attempt.error
    expected = ["1", "2", "3", "4", "5"] if action == "reset_cursor" else ["4", "5"]
    assert _csv_rows(csv_dir) == ["1", "2", "3", "4", "5", *expected]
    assert attempt.cursor_from == (None if action == "reset_cursor" else ["0003"])
    assert attempt.cursor_to == ["0005"]


def _run_once_then_damage(src: ScratchDB, base: Path, damage: str) -> JobBinding:
    binding = _binding(src, "csv", {"base_dir": str(base)})
    first = _run(binding)
    assert first.status == Status.SUCCEEDED, first.error
    assert _csv_rows(base) == ["1", "2", "3", "4", "5"]
    (base / ".out.csv.dispatch-state.json").write_bytes(UNREADABLE[damage])
    return binding


def test_csv_state__a_commit_that_would_outgrow_the_reader_is_refused_before_appending(
    csv_dir: Path,
) -> None:
    """Cursors are bounded, but a file many bindings append to could still grow a state
    its reader refuses: that commit fails before it writes, and the state stays readable."""
    tmp_path = csv_dir
    (tmp_path / "out.csv").write_text("")
    other = {
        "columns": ["k"],
        "cursor": ["x" * (limits.MAX_CSV_STATE_BYTES - 300)],
        "version": 1,
    }
    state = {"format": 1, "size": 0, "cursors": {str(uuid.uuid4()): other}}
    state_file = tmp_path / ".out.csv.dispatch-state.json"
    state_file.write_text(json.dumps(state))
    appended: list[int] = []

    with pytest.raises(PermanentError, match=r"state file of 'out.csv' would be \d+ bytes"):
        csv_state.commit(
            str(tmp_path / "out.csv"),
            "out.csv",
            append=lambda before, intend: appended.append(before) or before,
            binding_id=uuid.uuid4(),
            read_version=0,
            columns=("k",),
            cursor=["0" * limits.MAX_CURSOR_VALUE_BYTES],
            run_id=uuid.uuid4(),
            attempt_id=uuid.uuid4(),
            check=lambda: None,
        )
    assert appended == []
    assert json.loads(state_file.read_text()) == state
    assert csv_state.read(str(tmp_path / "out.csv"), "out.csv") == state
    # An operator's set of this binding's cursor is refused the same way, and says so.
    with pytest.raises(PermanentError, match="would be"):
        CSV.set_cursor(
            {"base_dir": str(tmp_path)},
            {"path": "out.csv", "mode": "append"},
            uuid.uuid4(),
            ("k",),
            ["0" * limits.MAX_CURSOR_VALUE_BYTES],
        )
