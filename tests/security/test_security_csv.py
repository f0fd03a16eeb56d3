"""CSV confinement: hard links, the allowed base directories, names too long to write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings

from dispatch.connectors.base import PermanentError
from dispatch.connectors.csv import CSVConnector as CSV
from tests.support.connectors import Ctx, run_transfer


def _base_with_outside(tmp_path: Path) -> tuple[Path, Path]:
    base = tmp_path / "base"
    base.mkdir()
    outside = tmp_path / "outside.csv"
    outside.write_text("a\nsecret\n")
    os.link(outside, base / "inside.csv")  # a hard link carries no path to check
    return base, outside


def test_append__through_a_hard_link_to_a_file_outside_base_dir_is_refused(tmp_path: Path):
    base, outside = _base_with_outside(tmp_path)
    (base / "in.csv").write_text("a\n1\n")
    cfg = {"base_dir": str(base)}
    with pytest.raises(PermanentError, match="hard links"):
        run_transfer(
            CSV, cfg, {"path": "in.csv"}, CSV, cfg, {"path": "inside.csv", "mode": "append"}
        )
    assert outside.read_text() == "a\nsecret\n"
    assert sorted(p.name for p in base.iterdir()) == ["in.csv", "inside.csv"]  # no temp left


def test_read__through_a_hard_link_is_refused_replace_unlinks_it(tmp_path: Path):
    base, outside = _base_with_outside(tmp_path)
    cfg = {"base_dir": str(base)}
    with (
        pytest.raises(PermanentError, match="hard links"),
        CSV.open_reader(cfg, {"path": "inside.csv"}, Ctx()),
    ):
        pass
    # `replace` renames a new file over the name: the file outside is not written.
    (base / "in.csv").write_text("a\n1\n")
    run_transfer(CSV, cfg, {"path": "in.csv"}, CSV, cfg, {"path": "inside.csv"})
    assert outside.read_text() == "a\nsecret\n"
    assert (base / "inside.csv").read_text() == "a\n1\n"


@pytest.mark.parametrize("base_dir", ["/", "/etc", "/proc/self", "/usr"])
def test_config__root_and_system_directories_are_refused(base_dir: str):
    with pytest.raises(ValidationError) as exc:
        CSV.validate_config({"base_dir": base_dir})
    assert "system directory" in " ".join(exc.value.message_dict["base_dir"])


def test_config__base_dir_must_lie_in_the_sites_allowed_directories(tmp_path: Path):
    allowed = tmp_path / "exports"
    (allowed / "team").mkdir(parents=True)
    other = tmp_path / "other"
    other.mkdir()
    with override_settings(DISPATCH_CSV_BASE_DIRS=[str(allowed)]):
        CSV.validate_config({"base_dir": str(allowed / "team")})
        with pytest.raises(ValidationError, match="DISPATCH_CSV_BASE_DIRS"):
            CSV.validate_config({"base_dir": str(other)})
        # Checked again when the connector runs (the setting may change after saving).
        (other / "in.csv").write_text("a\n1\n")
        with (
            pytest.raises(PermanentError, match="DISPATCH_CSV_BASE_DIRS"),
            CSV.open_reader({"base_dir": str(other)}, {"path": "in.csv"}, Ctx()),
        ):
            pass


def test_too_long_name__a_spec_error_and_permanent_at_run_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    with pytest.raises(ValidationError, match="longer than 200 bytes"):
        CSV.validate_sink_spec({"path": "x" * 250 + ".csv"})
    # A spec stored before this check existed: the writer's ENAMETOOLONG is permanent.
    from dispatch.connectors import csv as csv_module

    monkeypatch.setattr(csv_module, "check_relative_path", lambda value, field="path": value)
    (tmp_path / "in.csv").write_text("a\n1\n")
    cfg = {"base_dir": str(tmp_path)}
    with pytest.raises(PermanentError, match="too long"):
        run_transfer(CSV, cfg, {"path": "in.csv"}, CSV, cfg, {"path": "y" * 250})
