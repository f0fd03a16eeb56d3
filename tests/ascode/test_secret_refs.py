"""Secret references (dispatch.security.secretrefs): confined by the site's settings,
read with bounds, named but never shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.test import override_settings

from dispatch.checks import check_apply_secret_settings
from dispatch.models import Datasource
from dispatch.security import limits, paths
from dispatch.security.secretrefs import NEVER_INSIDE, RefError, dir_problem, parse, resolve
from tests.support.ascode import apply_text, plan_text

WAREHOUSE = """
datasources:
  warehouse:
    kind: postgresql
    config: {{host: db.example.com, dbname: w, password: "{ref}"}}
"""


@pytest.fixture
def secrets_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "secrets"
    folder.mkdir()
    (folder / "wh").write_text("from-a-file\n")
    with override_settings(DISPATCH_APPLY_SECRET_DIRS=[str(folder)]):
        yield folder


def resolve_text(value: str) -> str:
    return resolve(parse(value))


@pytest.mark.django_db
def test_file_ref__read_inside_an_allowed_directory_without_its_line_break(
    secrets_dir: Path,
) -> None:
    apply_text(WAREHOUSE.format(ref=f"file:{secrets_dir}/wh"))

    warehouse = Datasource.objects.get()
    assert warehouse.config["password"] == "from-a-file"
    assert warehouse.secret_refs == {"password": f"file:{secrets_dir}/wh"}


def test_file_ref__off_without_allowed_directories(tmp_path: Path) -> None:
    (tmp_path / "wh").write_text("x")
    with pytest.raises(RefError, match="file: references are off"):
        resolve_text(f"file:{tmp_path}/wh")


def test_file_ref__outside_the_directories_or_through_a_link_is_refused(
    secrets_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "elsewhere").write_text("not a secret of ours")
    os.symlink(tmp_path / "elsewhere", secrets_dir / "link")

    for path in (f"{tmp_path}/elsewhere", f"{secrets_dir}/../elsewhere", f"{secrets_dir}/link"):
        with pytest.raises(RefError, match="is not inside a directory the site allows"):
            resolve_text(f"file:{path}")


def test_file_ref__a_fifo_a_directory_or_a_large_file_is_refused_at_once(
    secrets_dir: Path,
) -> None:
    os.mkfifo(secrets_dir / "fifo")  # opening it for reading would block without a writer
    (secrets_dir / "dir").mkdir()
    (secrets_dir / "big").write_bytes(b"x" * (limits.MAX_SECRET_FILE_BYTES + 1))
    (secrets_dir / "empty").write_text("\n")

    for name, message in [
        ("fifo", "is not a regular file"),
        ("dir", "is not a regular file"),
        ("big", "is larger than"),
        ("empty", "is empty"),
        ("missing", "does not exist"),
    ]:
        with pytest.raises(RefError, match=message):
            resolve_text(f"file:{secrets_dir}/{name}")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("file:relative/path", "needs an absolute path"),
        ("env:NOT-A-NAME", "does not name an environment variable"),
        ("env:DATABASE_URL", "holds a secret of the site itself"),
        ("plain", "must be a reference"),
    ],
)
def test_ref__malformed_or_site_references_are_refused(value: str, message: str) -> None:
    with pytest.raises(RefError, match=message):
        resolve_text(value)


def test_env_ref__follows_the_configured_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINES_WH", "v1")
    with override_settings(DISPATCH_APPLY_ENV_PREFIX="PIPELINES_"):
        assert resolve_text("env:PIPELINES_WH") == "v1"
        with pytest.raises(RefError, match="must start with PIPELINES_"):
            resolve_text("env:DISPATCH_SECRET_WH")
    with (
        override_settings(DISPATCH_APPLY_ENV_PREFIX=""),
        pytest.raises(RefError, match="env: references are off"),
    ):
        resolve_text("env:PIPELINES_WH")
    with (
        override_settings(DISPATCH_APPLY_ENV_PREFIX="DISPATCH_"),  # it covers the keys
        pytest.raises(RefError, match="DISPATCH_APPLY_ENV_PREFIX cannot be used"),
    ):
        resolve_text("env:DISPATCH_ENCRYPTION_KEYS")


@pytest.mark.django_db
def test_file_ref__problems_name_file_line_and_field_never_the_value(
    secrets_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "outside").write_text("outside-value")
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is checked below
        plan_text(WAREHOUSE.format(ref=f"file:{tmp_path}/outside"), source="d.yaml")

    (problem,) = caught.value.problems  # type: ignore[attr-defined]
    assert (problem.file, problem.line, problem.path) == (
        "d.yaml",
        4,
        "datasources.warehouse.config.password",
    )
    assert "outside-value" not in str(problem)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"DISPATCH_APPLY_ENV_PREFIX": "DISPATCH_"}, "read the site's own secrets"),
        ({"DISPATCH_APPLY_ENV_PREFIX": "SECRET"}, "SECRET_KEY"),
        ({"DISPATCH_APPLY_ENV_PREFIX": "MY-SECRETS"}, "not the start of an environment"),
        ({"DISPATCH_APPLY_SECRET_DIRS": ["/etc"]}, "'/etc' is (or is inside) /etc"),
        ({"DISPATCH_APPLY_SECRET_DIRS": ["/"]}, "'/' is (or is inside) /"),
        ({"DISPATCH_APPLY_SECRET_DIRS": ["/proc/self"]}, "'/proc/self' is (or is inside) /proc"),
        ({"DISPATCH_APPLY_SECRET_DIRS": ["/var/lib"]}, "'/var/lib' is a system directory"),
        ({"DISPATCH_APPLY_SECRET_DIRS": ["secrets"]}, "'secrets' is not an absolute path"),
    ],
)
def test_check__unsafe_secret_settings_are_reported_as_E018(
    settings: dict[str, object], message: str
) -> None:
    with override_settings(**settings):
        found = check_apply_secret_settings()

    assert len(found) == 1 and message in found[0].msg
    assert found[0].id == "dispatch.E018"


def test_check__the_defaults_pass() -> None:
    assert check_apply_secret_settings() == []


def test_secret_dirs__never_a_place_paths_protects_but_a_directory_inside_one_is_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The protected places are dispatch.security.paths' own: a directory put on PATH
    now is one at once."""
    on_path = tmp_path / "bin"
    on_path.mkdir()
    monkeypatch.setenv("PATH", f"{on_path}{os.pathsep}{os.environ.get('PATH', '')}")

    problem = dir_problem(str(on_path))
    assert problem is not None and f"is a directory on PATH ({on_path.resolve()})" in problem
    assert dir_problem(str(on_path / "secrets")) is None
    assert dir_problem("/run/secrets/dispatch") is None  # inside /run, a system tree
    assert set(NEVER_INSIDE) <= set(paths.SYSTEM_TREES)
