"""The tests' own MariaDB server (tools/mariadb.py), one per test session, and scratch
databases on it. Skipped loudly when MariaDB is not installed; failed under CI."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools.mariadb import MariaDB, find


def start_server(directory: Path) -> Iterator[MariaDB]:
    """The body of the session fixture: the server, started, then stopped."""
    if find() is None:
        message = (
            "NO MARIADB FOUND: the mysql connector tests did not run "
            "(install it with `apt-get install -y mariadb-server`)"
        )
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run them")
        pytest.skip(message)
    server = MariaDB(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class MyDB:
    server: MariaDB
    name: str

    @property
    def config(self) -> dict[str, Any]:
        return self.server.config(self.name)

    def execute(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        conn = self.server.root(database=self.name, charset="utf8mb4")
        try:
            with conn.cursor() as cur:
                cur.execute(query, params)
                return list(cur.fetchall()) if cur.description else []
        finally:
            conn.close()


def scratch(server: MariaDB, prefix: str = "t") -> Iterator[MyDB]:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    conn = server.root()
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    conn.close()
    yield MyDB(server, name)
    conn = server.root()
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    conn.close()
