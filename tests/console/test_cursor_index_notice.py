"""Saving an incremental binding checks that its source table has an index on the cursor
(docs/connectors.md, "Incremental reads"): a warning naming the index, never a refusal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dispatch.console.admin import cursor_index_notice
from tests.support.connectors import ScratchDB, scratch_db, server_config
from tests.support.factories import BindingFactory, DatasourceFactory, JobFactory

pytestmark = pytest.mark.django_db

INCREMENTAL = {"table": "items", "incremental": {"cursor": ["updated_at", "id"]}}


@pytest.fixture
def db() -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_floor_notice")


def binding(config: dict, source_spec: dict) -> object:
    source = DatasourceFactory(kind="postgresql", config=config)
    return BindingFactory(job=JobFactory(source_spec=source_spec), source=source)


def test_notice__names_the_index_a_table_without_one_needs(db: ScratchDB) -> None:
    db.execute("CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz)")
    notice = cursor_index_notice(binding(db.config, INCREMENTAL))  # type: ignore[arg-type]
    assert notice is not None
    assert "items has no index on the incremental cursor" in notice
    assert notice.endswith("CREATE INDEX ON public.items (updated_at, id)")


def test_notice__none_when_the_index_exists_or_the_read_is_full(db: ScratchDB) -> None:
    db.execute("CREATE TABLE items (id bigint PRIMARY KEY, updated_at timestamptz)")
    db.execute("CREATE INDEX ON items (updated_at, id)")
    assert cursor_index_notice(binding(db.config, INCREMENTAL)) is None  # type: ignore[arg-type]
    db.execute("DROP INDEX items_updated_at_id_idx")
    assert cursor_index_notice(binding(db.config, {"table": "items"})) is None  # type: ignore[arg-type]


def test_notice__a_source_that_cannot_be_reached_is_said_and_does_not_block() -> None:
    config = server_config("absent", port=1)
    notice = cursor_index_notice(binding(config, INCREMENTAL))  # type: ignore[arg-type]
    assert notice is not None
    assert notice.startswith("The source's cursor index was not checked (")
    assert "the binding is saved" in notice
