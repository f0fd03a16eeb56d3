"""The `csv` connector: confinement to base_dir, round trips, atomic publication."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from dispatch.connectors.base import Column, LeaseLost, PermanentError, TransientError
from dispatch.connectors.builtin import GenerateConnector
from dispatch.connectors.csv import CSVConnector as CSV
from tests.support.connectors import Ctx, run_transfer

TRICKY = (
    "id,text,note\n"
    '1,"comma, inside","quote "" inside"\n'
    '2,"line one\nline two","carriage\r\nreturn"\n'
    '3,"é ü ß 日本 ✓ 🚀",\n'
    '4,"",plain\n'
)


def _copy(tmp_path: Path, source_spec: dict, sink_spec: dict, ctx: Ctx | None = None) -> int:
    cfg = {"base_dir": str(tmp_path)}
    return run_transfer(CSV, cfg, source_spec, CSV, cfg, sink_spec, ctx).rows_written


def test_roundtrip__quoting_newlines_utf8(tmp_path: Path) -> None:
    (tmp_path / "in.csv").write_text(TRICKY, encoding="utf-8", newline="")
    assert _copy(tmp_path, {"path": "in.csv"}, {"path": "out.csv"}) == 4
    rows = _read_back(tmp_path, "out.csv")
    assert rows == _read_back(tmp_path, "in.csv")
    assert rows[1] == ["2", "line one\nline two", "carriage\r\nreturn"]
    assert rows[2][1] == "é ü ß 日本 ✓ 🚀"
    # And again through a semicolon file without a header.
    assert (
        _copy(
            tmp_path, {"path": "out.csv"}, {"path": "semi.csv", "delimiter": ";", "header": False}
        )
        == 4
    )
    assert (
        _copy(
            tmp_path,
            {"path": "semi.csv", "delimiter": ";", "header": False},
            {"path": "back.csv", "header": False},
        )
        == 4
    )
    assert _read_back(tmp_path, "back.csv", header=False) == rows


def _read_back(tmp_path: Path, name: str, header: bool = True) -> list[list[str]]:
    with CSV.open_reader({"base_dir": str(tmp_path)}, {"path": name, "header": header}, Ctx()) as r:
        return [list(row) for batch in r.batches() for row in batch]


def test_roundtrip__empty_files(tmp_path: Path) -> None:
    (tmp_path / "empty.csv").write_bytes(b"")
    assert _copy(tmp_path, {"path": "empty.csv"}, {"path": "out.csv"}) == 0
    assert (tmp_path / "out.csv").read_bytes() == b""
    (tmp_path / "header-only.csv").write_text("a,b\n")
    assert _copy(tmp_path, {"path": "header-only.csv"}, {"path": "out2.csv"}) == 0
    assert (tmp_path / "out2.csv").read_text() == "a,b\n"


def test_null_marker__maps_fields_to_null_and_back(tmp_path: Path) -> None:
    (tmp_path / "in.csv").write_text("a,b\n1,\\N\n2,x\n")
    with CSV.open_reader(
        {"base_dir": str(tmp_path)}, {"path": "in.csv", "null": "\\N"}, Ctx()
    ) as r:
        assert [list(x) for b in r.batches() for x in b] == [["1", None], ["2", "x"]]
    _copy(tmp_path, {"path": "in.csv", "null": "\\N"}, {"path": "out.csv", "null": "NULL"})
    assert (tmp_path / "out.csv").read_text() == "a,b\n1,NULL\n2,x\n"


def test_null__unquoted_empty_is_null_and_quoted_empty_is_data_by_default(tmp_path: Path) -> None:
    # PostgreSQL's CSV convention (and what the sink writes): NULL is the unquoted marker,
    # a quoted field is always data, also when it equals the marker.
    (tmp_path / "in.csv").write_text(
        'a,b,c\n,"",x\n"",,\n"a""b",,"line\none"\n', encoding="utf-8", newline=""
    )
    (tmp_path / "m.csv").write_text('a,b\n\\N,"\\N"\n"x,\\N",\\N\n', newline="")
    cfg = {"base_dir": str(tmp_path)}

    def read(spec: dict) -> list[list]:
        with CSV.open_reader(cfg, spec, Ctx()) as r:
            return [list(row) for batch in r.batches() for row in batch]

    assert read({"path": "in.csv"}) == [
        [None, "", "x"],
        ["", None, None],
        ['a"b', None, "line\none"],
    ]
    assert read({"path": "m.csv", "null": "\\N"}) == [[None, "\\N"], ["x,\\N", None]]
    # No marker: every field is a string.
    assert read({"path": "in.csv", "null": None})[1] == ["", "", ""]
    with pytest.raises(ValidationError, match="null: must be a string"):
        CSV.validate_sink_spec({"path": "out.csv", "null": None})


@pytest.mark.parametrize("null", ["", "\\N", "NULL"])
def test_null__rows_written_read_back_exactly(tmp_path: Path, null: str) -> None:
    # Rows (not PostgreSQL's COPY): NULL, '', the marker itself as data, and the values
    # PostgreSQL's CSV treats specially must all come back as they were.
    values = [None, "", null or "x", "\\.", 'q"uote', "a,b", "two\nlines", " pad "]
    rows = [(i, v) for i, v in enumerate(values)]
    cfg = {"base_dir": str(tmp_path)}
    with CSV.open_writer(
        cfg, {"path": "out.csv", "null": null}, Ctx(), [Column("i"), Column("v")]
    ) as w:
        w.write(rows)
        w.commit()
    with CSV.open_reader(cfg, {"path": "out.csv", "null": null}, Ctx()) as r:
        back = [list(row) for batch in r.batches() for row in batch]
    assert back == [[str(i), v] for i, v in rows]


@pytest.mark.parametrize("path", ["../x.csv", "a/../../x.csv", "/etc/passwd", "..", ""])
def test_path__traversal_rejected_at_validation(path: str) -> None:
    with pytest.raises(ValidationError, match="path"):
        CSV.validate_source_spec({"path": path})
    with pytest.raises(ValidationError, match="path"):
        CSV.validate_sink_spec({"path": path})


def test_path__symlinks_leaving_base_dir_rejected(tmp_path: Path) -> None:
    base, outside = tmp_path / "base", tmp_path / "outside"
    base.mkdir()
    outside.mkdir()
    (outside / "secret.csv").write_text("a\n1\n")
    (base / "link.csv").symlink_to(outside / "secret.csv")
    (base / "dir").symlink_to(outside)
    (base / "inside.csv").write_text("a\n2\n")
    (base / "ok-link.csv").symlink_to(base / "inside.csv")
    cfg = {"base_dir": str(base)}
    for path in ["link.csv", "dir/secret.csv", "dir/new.csv"]:
        with (
            pytest.raises(PermanentError, match="leaves base_dir"),
            CSV.open_reader(cfg, {"path": path}, Ctx()),
        ):
            pass
        with pytest.raises(PermanentError, match="leaves base_dir"):
            run_transfer(GenerateConnector, {}, {"rows": 1}, CSV, cfg, {"path": path})
    # Also when the validation-time check is bypassed (a spec written around it).
    with (
        pytest.raises(PermanentError, match="'..'"),
        CSV.open_reader(cfg, {"path": "../outside/secret.csv"}, Ctx()),
    ):
        pass
    assert (outside / "secret.csv").read_text() == "a\n1\n"
    assert not (outside / "new.csv").exists()
    # A symlink that stays inside base_dir is fine.
    assert _read_back(base, "ok-link.csv") == [["2"]]


def test_config__base_dir_absolute_and_existing(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as exc:
        CSV.validate_config({"base_dir": "relative/dir"})
    assert "base_dir" in exc.value.message_dict
    with pytest.raises(ValidationError, match="not an existing directory"):
        CSV.validate_config({"base_dir": str(tmp_path / "nope")})
    with pytest.raises(ValidationError, match="base_dir"):
        CSV.validate_config({})
    CSV.validate_config({"base_dir": str(tmp_path)})


def test_replace__fence_lost_before_rename_leaves_old_file(tmp_path: Path) -> None:
    (tmp_path / "out.csv").write_text("old\n")
    ctx = Ctx()
    ctx.fence.lost = True
    with pytest.raises(LeaseLost):
        run_transfer(
            GenerateConnector,
            {},
            {"rows": 100},
            CSV,
            {"base_dir": str(tmp_path)},
            {"path": "out.csv"},
            ctx,
        )
    assert ctx.fence.checks == 1
    assert (tmp_path / "out.csv").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]  # no temp file left


def test_replace__failure_mid_write_leaves_old_file(tmp_path: Path) -> None:
    (tmp_path / "out.csv").write_text("old\n")
    with pytest.raises(TransientError):
        run_transfer(
            GenerateConnector,
            {},
            {"rows": 100, "batch": 10, "fail_after": 50},
            CSV,
            {"base_dir": str(tmp_path)},
            {"path": "out.csv"},
        )
    assert (tmp_path / "out.csv").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_append__adds_rows_with_one_header(tmp_path: Path) -> None:
    cfg = {"base_dir": str(tmp_path)}
    for _ in range(2):
        ctx = Ctx()
        run_transfer(
            GenerateConnector, {}, {"rows": 3}, CSV, cfg, {"path": "log.csv", "mode": "append"}, ctx
        )
        assert ctx.fence.checks == 1
    rows = _read_back(tmp_path, "log.csv")
    assert [r[0] for r in rows] == ["1", "2", "3", "1", "2", "3"]
    assert (tmp_path / "log.csv").read_text().count("id,customer,amount,created_at") == 1
    assert oct(os.stat(tmp_path / "log.csv").st_mode & 0o777) == "0o644"


def test_source__bad_input_named(tmp_path: Path) -> None:
    (tmp_path / "ragged.csv").write_text("a,b\n1,2\n3\n")
    (tmp_path / "latin1.csv").write_bytes("a\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "dup.csv").write_text("a,a\n1,2\n")
    cfg = {"base_dir": str(tmp_path)}
    for path, message in [
        ("ragged.csv", "line 3: 1 fields, expected 2"),
        ("latin1.csv", "not UTF-8"),
        ("dup.csv", "distinct"),
        ("missing.csv", "does not exist"),
    ]:
        with pytest.raises(PermanentError, match=message):
            run_transfer(CSV, cfg, {"path": path}, CSV, cfg, {"path": "out.csv"})
