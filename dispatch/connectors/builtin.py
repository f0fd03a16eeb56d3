"""The built-in kinds that need no external system: `generate` and `null`."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from dispatch.connectors.base import (
    Batch,
    Column,
    Connector,
    SpecField,
    TransferContext,
    TransientError,
    WriteResult,
    check_unknown,
    int_field,
    require_object,
)

_EPOCH = datetime(2024, 1, 1, tzinfo=UTC)


class GenerateConnector(Connector):
    """Synthetic, deterministic rows for demos, tests and benchmarks."""

    kind = "generate"
    label = "Generated rows"
    roles = frozenset({"source"})
    COLUMNS = [
        Column("id", "bigint"),
        Column("customer", "text"),
        Column("amount", "numeric(12,2)"),
        Column("created_at", "timestamp with time zone"),
    ]
    source_fields = (
        SpecField("rows", "how many rows (default 0)"),
        SpecField("batch", "rows per batch (default 1000)"),
        SpecField("delay_ms", "a pause after each batch, in milliseconds"),
        SpecField("fail_after", "fail (transiently) once this many rows are read"),
        SpecField("seed", "the values' seed (default 0): the same seed, the same rows"),
    )

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, cls.spec_field_names("source"))
        int_field(spec, "rows", default=0)
        int_field(spec, "batch", default=1000, minimum=1)
        int_field(spec, "delay_ms", default=0)
        int_field(spec, "fail_after", default=None)
        int_field(spec, "seed", default=0)
        return spec

    @classmethod
    def rows(cls, spec: dict[str, Any], start: int = 0) -> Iterator[tuple[Any, ...]]:
        """Row i is a function of (seed, i) alone, so any slice can be regenerated."""
        seed = int(spec.get("seed", 0))
        for i in range(start, int(spec.get("rows", 0))):
            rnd = random.Random(seed * 1_000_003 + i)
            yield (
                i + 1,
                f"customer-{rnd.randrange(1000):04d}",
                Decimal(rnd.randrange(100, 1_000_000)) / 100,
                _EPOCH + timedelta(seconds=rnd.randrange(365 * 86400)),
            )

    @classmethod
    @contextlib.contextmanager
    def open_reader(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext
    ) -> Iterator[Any]:
        yield _GenerateReader(cls, spec, ctx)


class _GenerateReader:
    def __init__(
        self, connector: type[GenerateConnector], spec: dict[str, Any], ctx: TransferContext
    ):
        self.columns = list(connector.COLUMNS)
        self.connector = connector
        self.spec = spec
        self.ctx = ctx

    def batches(self) -> Iterator[Batch]:
        batch_size = int(self.spec.get("batch", 1000))
        delay = int(self.spec.get("delay_ms", 0)) / 1000
        fail_after = self.spec.get("fail_after")
        self.ctx.estimate(int(self.spec.get("rows", 0)))  # exact: the spec says how many
        batch: Batch = []
        produced = 0
        for row in self.connector.rows(self.spec):
            if fail_after is not None and produced >= fail_after:
                raise TransientError(f"generate: fail_after={fail_after} rows reached")
            batch.append(row)
            produced += 1
            if len(batch) >= batch_size:
                yield batch
                batch = []
                if delay:
                    self.ctx.wait(delay)
        if batch:
            yield batch
        if fail_after is not None and produced >= fail_after:
            raise TransientError(f"generate: fail_after={fail_after} rows reached")
        if delay and not produced:
            self.ctx.wait(delay)


class NullConnector(Connector):
    """Counts and discards rows."""

    kind = "null"
    label = "Discard (count only)"
    roles = frozenset({"sink"})
    sliced_writes = True  # it keeps nothing
    sink_fields = ()

    @classmethod
    def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "sink_spec")
        check_unknown(spec, cls.spec_field_names("sink"))
        return spec

    @classmethod
    @contextlib.contextmanager
    def open_writer(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> Iterator[Any]:
        yield _NullWriter()


class _NullWriter:
    def __init__(self) -> None:
        self.count = 0

    def write(self, batch: Batch) -> int:
        self.count += len(batch)
        return len(batch)

    def commit(self) -> WriteResult:
        return WriteResult(rows_written=self.count)
