"""Shared fixtures: real PostgreSQL (pytest-django's test database) and worker processes.
The helpers they use live in tests/support/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gates import Holders
from tests.support.mariadb import MyDB, scratch, start_server
from tests.support.processes import Processes
from tools.mariadb import MariaDB


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
