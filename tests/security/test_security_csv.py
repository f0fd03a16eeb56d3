"""CSV confinement: off by default, the allowed base directories, the protected locations
(system trees, Python's directories, PATH, the home directory) even when listed, hard
links, names too long to write."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings

from dispatch import checks
from dispatch.connectors.base import PermanentError
from dispatch.connectors.csv import CSVConnector as CSV
from dispatch.core.states import Reason, Status
from dispatch.models import Attempt, Datasource, Run
from tests.support import factories
from tests.support.connectors import Ctx, run_transfer
from tests.support.processes import Processes, wait_until, worker_env

DISABLED = "CSV datasources are disabled on this site: set DISPATCH_CSV_BASE_DIRS"


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


# --- off by default -------------------------------------------------------------------------
def test_unset_setting__a_csv_datasource_is_refused_saying_how_to_allow_one(tmp_path: Path):
    (tmp_path / "in.csv").write_text("a\n1\n")
    cfg = {"base_dir": str(tmp_path)}
    with override_settings(DISPATCH_CSV_BASE_DIRS=[]):
        with pytest.raises(ValidationError) as exc:
            CSV.validate_config(cfg)
        assert DISABLED in " ".join(exc.value.messages)
        assert "docs/security.md" in " ".join(exc.value.messages)
        # A datasource saved while the setting allowed it: refused when it runs, and by
        # the console's connection test.
        with pytest.raises(PermanentError, match=DISABLED):
            run_transfer(CSV, cfg, {"path": "in.csv"}, CSV, cfg, {"path": "out.csv"})
        with pytest.raises(PermanentError, match=DISABLED):
            CSV.test_connection(cfg)
    assert not (tmp_path / "out.csv").exists()


# A run long after the datasource was saved: the lease is far longer than the wait, so a
# settlement in time proves the worker recorded the outcome itself.
LEASE_SECONDS = 120


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_worker__a_datasource_saved_before_the_setting_was_unset_fails_permanently(
    processes: Processes, tmp_path: Path
) -> None:
    (tmp_path / "in.csv").write_text("a\n1\n")
    with override_settings(DISPATCH_CSV_BASE_DIRS=[str(tmp_path)]):
        source = Datasource(name="csv-before", kind="csv", config={"base_dir": str(tmp_path)})
        source.full_clean()
        source.save()
        sink = Datasource(name="csv-before-out", kind="csv", config={"base_dir": str(tmp_path)})
        sink.save()
    job = factories.JobFactory(
        source_spec={"path": "in.csv"},
        sink_spec={"path": "out.csv"},
        max_attempts=3,
        lease_seconds=LEASE_SECONDS,
    )
    run = factories.trigger(factories.BindingFactory(job=job, source=source, sink=sink))
    processes.worker(
        "--burst", "--worker-id", "w-csv-off", env=worker_env(DISPATCH_CSV_BASE_DIRS="")
    )
    wait_until(
        lambda: Run.objects.get(pk=run.pk).status in (Status.SUCCEEDED, Status.FAILED),
        timeout=LEASE_SECONDS / 4,
        message=f"run {run.id} to settle",
    )
    (attempt,) = Attempt.objects.filter(run=run)  # permanent: no retry
    assert (attempt.status, attempt.reason) == (Status.FAILED, Reason.PERMANENT_ERROR)
    assert DISABLED in attempt.error
    assert not (tmp_path / "out.csv").exists()


# --- protected locations, refused even when listed ----------------------------------------
def _site_packages() -> str:
    """A real sys.path entry: the site-packages directory tests run from."""
    return next(os.path.realpath(p) for p in sys.path if p.endswith("site-packages"))


HOME = os.path.expanduser("~")
# root's home, /root, is a system directory as well.
HOME_WHY = "system directory" if os.path.realpath(HOME) == "/root" else "home directory"


@pytest.mark.parametrize(
    ("base_dir", "why"),
    [
        # "is" or "lies in": a virtualenv inside the checkout lies in the checkout, which
        # is on sys.path too.
        (_site_packages(), "a directory Python imports code from"),
        (os.path.join(_site_packages(), "django"), "lies in a directory Python imports code from"),
        ("/usr/local/bin", "lies in a system directory (/usr)"),
        ("/var/lib/postgresql", "lies in a system directory (/var/lib)"),
        ("/var/spool/cron", "lies in a system directory (/var/spool)"),
        ("/opt", "is a system directory (/opt)"),
        (HOME, HOME_WHY),
        (os.path.join(HOME, ".ssh"), HOME_WHY),
        (os.path.dirname(HOME), "contains"),
    ],
)
def test_protected__refused_even_when_listed(base_dir: str, why: str):
    with override_settings(DISPATCH_CSV_BASE_DIRS=[base_dir]):
        with pytest.raises(ValidationError) as exc:
            CSV.validate_config({"base_dir": base_dir})
        assert why in " ".join(exc.value.message_dict["base_dir"])
        # The operator learns it at start-up: the listed entry allows nothing.
        (error,) = checks.check_csv_base_dirs()
        assert error.id == "dispatch.E016" and repr(base_dir) in error.msg


def test_protected__a_directory_containing_a_sys_path_entry_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "lib" / "site").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "lib" / "site"))
    with override_settings(DISPATCH_CSV_BASE_DIRS=[str(tmp_path / "data")]):
        for refused in (tmp_path, tmp_path / "lib", tmp_path / "lib" / "site" / "pkg"):
            with pytest.raises(ValidationError, match="Python imports code from"):
                CSV.validate_config({"base_dir": str(refused)})
        CSV.validate_config({"base_dir": str(tmp_path / "data")})  # a sibling is fine


def test_protected__the_home_and_path_directories_even_when_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    for name in ("home/.ssh", "tools/bin", "data"):
        (tmp_path / name).mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", f"{tmp_path / 'tools' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with override_settings(DISPATCH_CSV_BASE_DIRS=[str(tmp_path / "data")]):
        for refused, why in [
            ("home/.ssh", "lies in the home directory"),
            ("home", "is the home directory"),
            (".", "contains"),
            ("tools", "contains a directory on PATH"),
            ("tools/bin", "is a directory on PATH"),
        ]:
            with pytest.raises(ValidationError, match=why):
                CSV.validate_config({"base_dir": str(tmp_path / refused)})
        CSV.validate_config({"base_dir": str(tmp_path / "data")})


def test_protected__a_symlink_to_a_protected_directory_is_refused(tmp_path: Path):
    (tmp_path / "sp").symlink_to(_site_packages())
    with override_settings(DISPATCH_CSV_BASE_DIRS=[str(tmp_path)]):
        with pytest.raises(ValidationError, match="a directory Python imports code from"):
            CSV.validate_config({"base_dir": str(tmp_path / "sp")})
        with (
            pytest.raises(PermanentError, match="a directory Python imports code from"),
            CSV.open_reader({"base_dir": str(tmp_path / "sp")}, {"path": "x.pth"}, Ctx()),
        ):
            pass


def test_allowed__a_listed_directory_and_the_check_accept_it(tmp_path: Path):
    (tmp_path / "exports" / "team").mkdir(parents=True)
    with override_settings(DISPATCH_CSV_BASE_DIRS=[str(tmp_path / "exports")]):
        assert checks.check_csv_base_dirs() == []
        cfg = CSV.validate_config({"base_dir": str(tmp_path / "exports" / "team")})
        (tmp_path / "exports" / "team" / "in.csv").write_text("a\n1\n")
        run_transfer(CSV, cfg, {"path": "in.csv"}, CSV, cfg, {"path": "out.csv"})
    assert (tmp_path / "exports" / "team" / "out.csv").read_text() == "a\n1\n"


def test_check__entries_refused_themselves_allow_nothing(tmp_path: Path):
    listed = ["exports", "/usr/local/bin", os.path.dirname(_site_packages())]
    with override_settings(DISPATCH_CSV_BASE_DIRS=listed):
        errors = checks.check_csv_base_dirs()
        assert [e.id for e in errors] == ["dispatch.E016"] * 3
        assert "'exports' is not an absolute path" in errors[0].msg
        assert all(e.hint and "/srv/dispatch/csv" in e.hint for e in errors)


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


# --- the demo site (`make run`) ---------------------------------------------------------------
def test_make_run__the_demo_csv_directory_is_private_and_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from dispatch.connectors.csv import check_base_dir
    from project import dev

    monkeypatch.setattr(dev.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(dev, "ENV_FILE", tmp_path / ".env")  # none: the default applies
    env = dev.csv_env({})
    root = tmp_path / f"dispatch-{os.getuid()}"
    assert env["DISPATCH_CSV_BASE_DIRS"] == str(root / "csv")
    assert root.stat().st_mode & 0o077 == 0
    with override_settings(DISPATCH_CSV_BASE_DIRS=env["DISPATCH_CSV_BASE_DIRS"]):
        assert check_base_dir(str(root / "csv" / "demo")) is None
        # The checkout (Python imports from it) is refused, as the old demo directory was.
        assert "Python imports code from" in str(
            check_base_dir(str(dev.ROOT / ".data" / "demo-csv"))
        )
    # A site's own setting wins, in the environment or in .env.
    assert dev.csv_env({"DISPATCH_CSV_BASE_DIRS": "/srv/csv"}) == {
        "DISPATCH_CSV_BASE_DIRS": "/srv/csv"
    }
    (tmp_path / ".env").write_text("DISPATCH_CSV_BASE_DIRS=/srv/csv\n")
    assert dev.csv_env({}) == {}


def test_make_run__a_temp_directory_another_user_could_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from project import dev

    monkeypatch.setattr(dev.tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"dispatch-{os.getuid()}"
    root.mkdir(mode=0o700)
    root.chmod(0o777)
    with pytest.raises(SystemExit, match="not a private directory"):
        dev.private_temp_dir("csv")
    root.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SystemExit, match="not a private directory"):
        dev.private_temp_dir("csv")
    assert not (tmp_path / "elsewhere" / "csv").exists()
