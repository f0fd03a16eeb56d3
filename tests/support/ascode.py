"""Helpers of the definition-file tests (tests/ascode/): run the commands, plan and apply
YAML text, read row versions."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection

from dispatch import ascode

SECRET = "pw-7f3a9c-never-shown"


class Ran:
    def __init__(self, out: str, err: str, error: str | None) -> None:
        self.out = out
        self.err = err
        self.error = error

    @property
    def text(self) -> str:
        return "\n".join([self.out, self.err, self.error or ""])


def run_command(name: str, *args: str) -> Ran:
    """Run a management command; its CommandError is returned, not raised."""
    from django.core.management.base import CommandError

    out, err = StringIO(), StringIO()
    try:
        call_command(name, *args, stdout=out, stderr=err)
    except CommandError as exc:
        return Ran(out.getvalue(), err.getvalue(), str(exc))
    return Ran(out.getvalue(), err.getvalue(), None)


@pytest.fixture
def write(tmp_path: Path) -> Callable[..., str]:
    """write(text, name="defs.yaml") -> the file's path (text is dedented)."""

    def _write(text: str, name: str = "defs.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return str(path)

    return _write


@pytest.fixture
def secret_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DISPATCH_SECRET_WH_PASSWORD", SECRET)
    return SECRET


def plan_text(text: str, *, prune: bool = False, source: str = "defs.yaml") -> ascode.Plan:
    text = textwrap.dedent(text).lstrip("\n")
    return ascode.plan(ascode.load_text(text, source=source), prune=prune)


def apply_text(text: str, *, prune: bool = False) -> ascode.Result:
    return ascode.apply(plan_text(text, prune=prune))


def row_versions(*tables: str) -> dict[str, list[tuple[Any, str]]]:
    """Each table's (id, xmin): xmin changes with every write of a row, by anyone."""
    found = {}
    with connection.cursor() as cursor:
        for table in tables:
            # Table names come from the test itself, never from input.
            cursor.execute(f"SELECT id, xmin::text FROM {table} ORDER BY id")  # noqa: S608
            found[table] = cursor.fetchall()
    return found


DEFINITION_TABLES = (
    "dispatch_datasource",
    "dispatch_job",
    "dispatch_jobbinding",
    "scheduling_schedule",
)
