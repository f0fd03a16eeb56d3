"""Shared fixtures: real PostgreSQL (pytest-django's test database) and worker processes.
The helpers they use live in tests/support/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from tests.support import flush
from tests.support.connectors import drop_scratch_databases, no_commit_wait
from tests.support.gates import Holders
from tests.support.mariadb import MyDB, scratch, start_server
from tests.support.processes import Processes
from tools.mariadb import MariaDB

# After each transactional test, truncate only the tables it wrote (tests/support/flush.py).
flush.install()


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> None:
    """pytest-django's test database, whose commits do not wait for the WAL flush
    (`no_commit_wait`)."""
    with django_db_blocker.unblock():
        no_commit_wait(connection.settings_dict["NAME"])
        connection.close()  # the next connection takes the database's setting


def pytest_sessionfinish(session: pytest.Session) -> None:
    drop_scratch_databases()  # the scratch databases tests reused (tests/support/connectors.py)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture
def holders() -> Iterator[Holders]:
    """Sessions that hold the locks a worker process waits on (tests/support/gates.py),
    closed at the end of the test."""
    held = Holders()
    try:
        yield held
    finally:
        held.close_all()


@pytest.fixture(scope="session")
def mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MariaDB]:
    """The tests' own MariaDB server (never the system's), for the session."""
    yield from start_server(tmp_path_factory.mktemp("mariadb"))


@pytest.fixture
def mydb(mariadb: MariaDB) -> Iterator[MyDB]:
    """A fresh database on it, dropped afterwards."""
    yield from scratch(mariadb)
