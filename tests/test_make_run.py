"""`make run` on a fresh checkout: what it installs, the ports it names when they are busy,
and, as root, the embedded PostgreSQL started without widening any folder it did not create."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from project import embedded_pg
from project.embedded_pg import EmbeddedPostgres
from tests.support.processes import ROOT


def make_dry_run(target: str, tmp_path: Path) -> str:
    """The commands `make TARGET` would run on a checkout with no virtualenv yet."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return subprocess.run(
        ["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout


def installed_extras(commands: str) -> set[str]:
    groups = re.findall(r"pip install .*-e '\.\[([^\]]*)\]'", commands)
    assert groups, f"no editable install of the checkout in:\n{commands}"
    return {extra for group in groups for extra in group.split(",")}


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_run__installs_only_what_the_demo_runs(tmp_path: Path) -> None:
    assert installed_extras(make_dry_run("run", tmp_path)) == {"site", "embedded"}
    # The demo's driver brings its own libpq: no system client library needed.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("psycopg[binary]") for r in extras["site"])


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_test__installs_the_development_tools_too(tmp_path: Path) -> None:
    assert installed_extras(make_dry_run("test", tmp_path)) == {"site", "dev", "embedded"}


# --- busy ports ---------------------------------------------------------------------------------
@pytest.fixture
def occupied() -> Iterator[int]:
    """A port something listens on, as another server (or checkout) would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_make_run__a_busy_site_port_names_PORT(occupied: int) -> None:
    env = {
        **os.environ,
        "PORT": str(occupied),
        # Nothing may start before the check: no server answers here.
        "DATABASE_URL": "postgres://postgres@127.0.0.1:1/none",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "project.dev", "run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"the admin site: port {occupied} on 127.0.0.1 is already in use" in proc.stderr
    assert "set PORT to a free port (e.g. PORT=" in proc.stderr


def test_embedded_postgres__a_busy_port_names_DISPATCH_DEV_PG_PORT(
    occupied: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPATCH_DEV_PG_PORT", str(occupied))
    server = EmbeddedPostgres(tmp_path / "pg")
    with pytest.raises(SystemExit) as stopped:
        server.start()
    message = str(stopped.value)
    assert f"the embedded PostgreSQL: port {occupied} on 127.0.0.1 is already in use" in message
    assert "set DISPATCH_DEV_PG_PORT to a free port" in message
    assert not server.data_dir.exists() and not (tmp_path / "pg").exists()  # nothing created


def test_embedded_postgres__a_malformed_port_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DISPATCH_DEV_PG_PORT", "54329x")
    with pytest.raises(SystemExit, match=r"DISPATCH_DEV_PG_PORT must be a port number .*54329x"):
        EmbeddedPostgres(tmp_path / "pg")


# --- as root: no folder we did not create changes ---------------------------------------------
root_only = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="the embedded PostgreSQL runs as another user only when started as root",
)


def directory_modes(top: Path) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.lstat().st_mode) for p in [top, *top.rglob("*")] if p.is_dir()}


@pytest.fixture
def servers() -> Iterator[list[EmbeddedPostgres]]:
    """Embedded servers a test starts, stopped and deleted after it."""
    started: list[EmbeddedPostgres] = []
    yield started
    for server in started:
        server.remove()


@root_only
@pytest.mark.slow
def test_embedded_postgres_as_root__a_0700_parent_keeps_its_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, servers: list[EmbeddedPostgres]
) -> None:
    # A checkout under a closed home (like /root), its virtualenv's embedded-postgres inside.
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o700)
    source = embedded_pg.bin_dir().parent.parent
    site = home / "checkout" / ".venv" / "site-packages"
    shutil.copytree(
        source / "pginstall",
        site / source.name / "pginstall",
        ignore=shutil.ignore_patterns("include"),
    )
    libs = source.parent / f"{source.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name)
    monkeypatch.setattr(embedded_pg, "bin_dir", lambda: site / source.name / "pginstall" / "bin")
    before = directory_modes(tmp_path)
    server = EmbeddedPostgres(home / "checkout" / ".data" / "pg", port=free_port())
    servers.append(server)
    server.start()
    with psycopg.connect(server.url("postgres"), connect_timeout=5) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
    assert Path(f"/proc/{pid}").stat().st_uid == pwd.getpwnam(embedded_pg.USER).pw_uid
    after = directory_modes(tmp_path)
    changed = {str(p): (oct(m), oct(after[p])) for p, m in before.items() if after[p] != m}
    assert not changed, f"modes changed (before, after): {changed}"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700


@root_only
def test_embedded_postgres_as_root__the_system_user_is_created_with_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"dsptest{os.getpid() % 100000}"
    monkeypatch.setattr(embedded_pg, "USER", name)
    try:
        info = embedded_pg.server_user()
        assert info.pw_name == name and info.pw_uid != 0
        assert f"creating the system user {name!r}" in capsys.readouterr().err
        embedded_pg.server_user()  # it exists now: nothing said
        assert capsys.readouterr().err == ""
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)
