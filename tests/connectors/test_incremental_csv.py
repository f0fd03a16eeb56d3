"""Incremental reads into a CSV file (append): the rows and the cursor commit together
through the file's state (dispatch/connectors/csv_state.py). Real files, a real source
database, driven as the runner drives a transfer."""

from __future__ import annotations

import csv
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dispatch.connectors import csv_state
from dispatch.connectors.base import PermanentError, TransientError
from dispatch.connectors.csv import CSVConnector as CSV
from dispatch.connectors.postgresql import PostgreSQLConnector as PG
from tests.support.connectors import Ctx, Fence, ScratchDB, run_transfer, scratch_db

pytestmark = pytest.mark.django_db

SPEC = {"table": "items", "incremental": {"cursor": ["updated_at", "id"]}}


@pytest.fixture
def src_db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_inccsv_src")


def _source(src: ScratchDB, rows: int) -> None:
    src.execute(
        "CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz NOT NULL, payload text)"
    )
    _insert(src, 1, rows)


def _insert(src: ScratchDB, first: int, last: int) -> None:
    # Equal timestamps in pairs: the cursor's second column keeps them apart.
    src.execute(
        "INSERT INTO items SELECT i, '2024-01-01'::timestamptz + (i / 2) * interval '1 s',"
        " 'v' || i FROM generate_series(%s::int, %s::int) i",
        [first, last],
    )


def _run(src: ScratchDB, base: Path, binding: uuid.UUID, **sink: Any) -> Any:
    return run_transfer(
        PG,
        src.config,
        SPEC,
        CSV,
        {"base_dir": str(base)},
        {"path": "out.csv", "mode": "append", **sink},
        Ctx(Fence(binding_id=binding)),
    )


def _ids(base: Path) -> list[int]:
    with (base / "out.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["id", "updated_at", "payload"]  # one header, at the top
    return [int(r[0]) for r in rows[1:]]


def _state(base: Path) -> dict[str, Any]:
    return json.loads((base / ".out.csv.dispatch-state.json").read_text())


def test_incremental_csv__appends_each_row_once_with_the_cursor(
    src_db: ScratchDB, tmp_path: Path
) -> None:
    _source(src_db, 9)
    binding = uuid.uuid4()
    assert _run(src_db, tmp_path, binding).rows_written == 9
    _insert(src_db, 10, 15)
    assert _run(src_db, tmp_path, binding).rows_written == 6
    assert _run(src_db, tmp_path, binding).rows_written == 0
    assert _ids(tmp_path) == list(range(1, 16))
    state = _state(tmp_path)
    # 15 // 2 = 7 seconds past the start: the last row's cursor.
    assert state["cursors"][str(binding)]["cursor"] == ["2024-01-01 00:00:07+00", "15"]
    assert state["cursors"][str(binding)]["version"] == 3
    assert state["size"] == (tmp_path / "out.csv").stat().st_size
    assert "intent" not in state


def test_incremental_csv__a_writer_that_died_after_appending_is_cut_off(
    src_db: ScratchDB, tmp_path: Path
) -> None:
    """A writer that appended its rows and died before recording them (the state holds
    its intent, the file its tail): the next commit cuts the tail off and appends again
    from the committed cursor, so every row is there once."""
    _source(src_db, 4)
    binding = uuid.uuid4()
    _run(src_db, tmp_path, binding)
    committed = _state(tmp_path)
    _insert(src_db, 5, 8)
    real_write = csv_state._write
    calls = []

    def die_at_the_commit_point(path: str, state: dict[str, Any]) -> None:
        calls.append(dict(state))
        if "intent" not in state:  # step 5, after the append: the process dies here
            raise SystemExit("killed")
        real_write(path, state)

    csv_state._write = die_at_the_commit_point  # type: ignore[assignment]
    try:
        with pytest.raises(SystemExit):
            _run(src_db, tmp_path, binding)
    finally:
        csv_state._write = real_write  # type: ignore[assignment]
    assert len(calls) == 2  # the intent was recorded, the commit was not
    assert _ids(tmp_path) == [1, 2, 3, 4, 5, 6, 7, 8]  # the tail is in the file ...
    assert _state(tmp_path)["cursors"] == committed["cursors"]  # ... the cursor is not
    assert _run(src_db, tmp_path, binding).rows_written == 4
    assert _ids(tmp_path) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _state(tmp_path)["size"] == (tmp_path / "out.csv").stat().st_size


def test_incremental_csv__a_concurrent_commit_or_reset_refuses_the_stale_one(
    src_db: ScratchDB, tmp_path: Path
) -> None:
    _source(src_db, 4)
    binding = uuid.uuid4()
    _run(src_db, tmp_path, binding)
    # An operator's set between this attempt's read of the state and its commit.
    ctx = Ctx(Fence(binding_id=binding))
    cfg, sink_spec = {"base_dir": str(tmp_path)}, {"path": "out.csv", "mode": "append"}
    from dispatch.connectors import incremental

    with (
        PG.open_reader(src_db.config, SPEC, ctx) as reader,
        CSV.open_writer(cfg, sink_spec, ctx, reader.columns) as writer,
    ):
        incremental.prepare(reader, writer)
        CSV.set_cursor(cfg, sink_spec, binding, ("updated_at", "id"), None)
        with pytest.raises(TransientError, match="committed cursor moved"):
            writer.commit()
    assert _ids(tmp_path) == [1, 2, 3, 4]
    # After the reset, the next run reads everything again (a full refresh, appended).
    assert _run(src_db, tmp_path, binding).rows_written == 4
    assert _ids(tmp_path) == [1, 2, 3, 4, 1, 2, 3, 4]


def test_incremental_csv__a_file_changed_outside_dispatch_is_not_appended_to(
    src_db: ScratchDB, tmp_path: Path
) -> None:
    _source(src_db, 2)
    binding = uuid.uuid4()
    _run(src_db, tmp_path, binding)
    with (tmp_path / "out.csv").open("a") as f:
        f.write("99,2024-01-01 00:00:00+00,foreign\n")
    _insert(src_db, 3, 3)
    with pytest.raises(PermanentError, match="changed outside dispatch"):
        _run(src_db, tmp_path, binding)
    assert _ids(tmp_path) == [1, 2, 99]  # nothing cut, nothing added
    # Setting the cursor again takes the file as it is.
    CSV.set_cursor(
        {"base_dir": str(tmp_path)},
        {"path": "out.csv", "mode": "append"},
        binding,
        ("updated_at", "id"),
        ["2024-01-01 00:00:01+00", "2"],
    )
    assert _run(src_db, tmp_path, binding).rows_written == 1
    assert _ids(tmp_path) == [1, 2, 99, 3]


def test_incremental_csv__replace_mode_and_lookback_are_refused(
    src_db: ScratchDB, tmp_path: Path
) -> None:
    _source(src_db, 2)
    with pytest.raises(PermanentError, match="need mode append"):
        _run(src_db, tmp_path, uuid.uuid4(), mode="replace")
    spec = {**SPEC, "incremental": {**SPEC["incremental"], "lookback_seconds": 60}}  # type: ignore[dict-item]
    with pytest.raises(PermanentError, match="needs an upsert sink"):
        run_transfer(
            PG,
            src_db.config,
            spec,
            CSV,
            {"base_dir": str(tmp_path)},
            {"path": "out.csv", "mode": "append"},
            Ctx(Fence(binding_id=uuid.uuid4())),
        )
    assert not (tmp_path / "out.csv").exists()
