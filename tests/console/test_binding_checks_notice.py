"""Saving a binding checks what its specs name against the datasources when they answer
(docs/connectors.md, "Columns" and `upsert`): a source table without a column `columns`
names, a sink that does not enforce the upsert key. Warnings, never a refusal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dispatch.console.admin import binding_checks_notices
from tests.support.connectors import ScratchDB, scratch_db, server_config
from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_columns_notice")


def _binding(config: dict[str, Any], source_spec: dict[str, Any], sink_spec: dict[str, Any]) -> Any:
    return BindingFactory(
        job=JobFactory(source_spec=source_spec, sink_spec=sink_spec),
        source=DatasourceFactory(kind="postgresql", config=config),
        sink=DatasourceFactory(kind="postgresql", config=config),
    )


def test_notice__a_column_the_source_lacks_and_an_unenforced_upsert_key(db: ScratchDB) -> None:
    db.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text)")
    db.execute("CREATE TABLE target (id bigint, name text)")
    binding = _binding(
        db.config,
        {"table": "items", "columns": {"select": ["id", "nmae"]}},
        {"table": "target", "mode": "upsert", "key": ["id"]},
    )
    notices = binding_checks_notices(binding)
    assert notices == [
        "The source: columns: the source has no column(s) nmae (it has id, name)",
        "The sink: upsert: public.target has no unique index or constraint on (id); every "
        "run will fail until it has one",
    ]


def test_notice__none_when_the_names_and_the_key_hold(db: ScratchDB) -> None:
    db.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text)")
    db.execute("CREATE TABLE target (id bigint PRIMARY KEY, name text)")
    spec = {"table": "items", "columns": {"select": ["id", "name"]}}
    upsert = {"table": "target", "mode": "upsert", "key": ["id"]}
    assert binding_checks_notices(_binding(db.config, spec, upsert)) == []
    # A missing table that create will make, with key as its primary key.
    created = {"table": "later", "mode": "upsert", "key": ["id"], "create": True}
    assert binding_checks_notices(_binding(db.config, spec, created)) == []


def test_notice__datasources_that_cannot_be_reached_are_said_and_do_not_block() -> None:
    config = server_config("absent", port=1)
    binding = _binding(
        config,
        {"table": "items", "columns": {"exclude": ["x"]}},
        {"table": "target", "mode": "upsert", "key": ["id"]},
    )
    notices = binding_checks_notices(binding)
    assert [n.split(" (")[0] for n in notices] == [
        "The source was not checked",
        "The sink was not checked",
    ]
    assert all("the binding is saved" in n for n in notices)
