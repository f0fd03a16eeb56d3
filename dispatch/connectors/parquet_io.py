"""The `parquet` kind's reader and writer: what needs pyarrow. `ParquetConnector`
(parquet.py) imports this module when a datasource is first read or written, so a
process that lists the kinds or validates a form never imports pyarrow."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from dispatch.connectors import csv, incremental
from dispatch.connectors import parquet_manifest as manifest
from dispatch.connectors import parquet_types as types
from dispatch.connectors.base import (
    Batch,
    Column,
    PermanentError,
    TransferContext,
    TransientError,
    WriteResult,
)
from dispatch.connectors.parquet_spec import (
    BATCH_ROWS,
    BY_FILE,
    PARQUET_DIRS,
    ROW_GROUP_ROWS,
    _os_error,
    parse_incremental,
    resolve,
)


# --- the sink -------------------------------------------------------------------------------
class Writer:
    """Rows stream into `_dispatch/tmp/<name>.parquet.tmp` in row groups of at most
    `row_group_rows` rows; commit publishes the file through the manifest."""

    def __init__(
        self, directory: str, spec: dict[str, Any], ctx: TransferContext, columns: list[Column]
    ) -> None:
        self.directory = directory
        self.spec = spec
        self.ctx = ctx
        self.columns = columns
        self.mode = spec.get("mode", "replace")
        self.row_group_rows = int(spec.get("row_group_rows", ROW_GROUP_ROWS))
        self.compression = spec.get("compression", "zstd")
        self.rows = 0
        self.row_groups = 0
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._converts: list[types.Convert | None] = []
        self._cursor_read: incremental.CommittedCursor | None = None
        self._cursor_new: tuple[tuple[str, ...], list[str] | None] | None = None
        self.cursor_committed: incremental.CommittedCursor | None = None
        self.tmp: str | None = None
        fence = ctx.fence
        current = manifest.read(directory, spec["path"])
        # The run's data is in the dataset already (an earlier attempt committed and then
        # lost its settlement): the runner skips the transfer.
        self.already_committed = str(fence.run_id) in current.runs and int(
            current.runs[str(fence.run_id)]["token"]
        ) <= int(fence.token)
        if self.already_committed:
            return
        try:
            os.makedirs(manifest.tmp_dir(directory), exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(
                dir=manifest.tmp_dir(directory),
                prefix=f"{fence.attempt_id}-",
                suffix=".parquet.tmp",
            )
        except OSError as exc:
            raise _os_error(f"cannot write in the dataset {spec['path']!r}", exc) from None
        os.close(fd)

    # -- the committed cursor of an incremental read (dispatch/connectors/incremental.py) --
    def cursor_state(self, inc: incremental.IncrementalSpec) -> incremental.CommittedCursor:
        if self.mode != "append":
            raise PermanentError(
                "incremental reads into a Parquet dataset need mode append: replace would keep "
                "only the latest increment"
            )
        if inc.lookback_seconds is not None:
            raise PermanentError(
                "incremental.lookback_seconds re-reads rows, so it needs an upsert sink"
            )
        self._cursor_read = manifest.read(self.directory, self.spec["path"]).cursor_of(
            self.ctx.fence.binding_id
        )
        return self._cursor_read

    def stage_cursor(self, columns: tuple[str, ...], cursor: list[str] | None) -> None:
        self._cursor_new = (columns, cursor)

    def _open(self) -> pq.ParquetWriter:
        if self._writer is None:
            assert self.tmp is not None
            self._schema, self._converts = types.schema(self.columns)
            self._writer = pq.ParquetWriter(
                self.tmp,
                self._schema,
                compression=None if self.compression == "none" else self.compression,
            )
        return self._writer

    def write(self, batch: Batch) -> int:
        if self.already_committed or not batch:
            return 0
        self._open()
        assert self._schema is not None
        self._pending.append(types.record_batch(batch, self._schema, self._converts))
        self._pending_rows += len(batch)
        self.rows += len(batch)
        if self._pending_rows >= self.row_group_rows:
            self._flush()
        return len(batch)

    def _flush(self) -> None:
        """Write the buffered batches as row groups of `row_group_rows` rows (memory stays
        at one row group)."""
        if not self._pending:
            return
        writer = self._open()
        table = pa.Table.from_batches(self._pending)
        writer.write_table(table, row_group_size=self.row_group_rows)
        self.row_groups += -(-table.num_rows // self.row_group_rows)
        self._pending, self._pending_rows = [], 0

    def commit(self) -> WriteResult:
        if self.already_committed:
            return WriteResult(rows_written=0, already_committed=True)
        assert self.tmp is not None
        staged: str | None = None
        if self.rows or self.mode == "replace":
            # A replace with no rows still publishes a file: readers see the columns.
            self._flush()
            writer = self._open()
            writer.close()
            self._writer = None
            with open(self.tmp, "rb") as f:
                os.fsync(f.fileno())
            staged = os.path.relpath(self.tmp, self.directory)
        fence = self.ctx.fence
        cursor = self._cursor_new
        done = manifest.commit(
            self.directory,
            self.spec["path"],
            manifest.Commit(
                staged=staged,
                rows=self.rows,
                replace=self.mode == "replace",
                run_id=fence.run_id,
                attempt_id=fence.attempt_id,
                token=int(fence.token),
                binding_id=fence.binding_id if cursor is not None else None,
                read_version=self._cursor_read.version if self._cursor_read else None,
                columns=cursor[0] if cursor is not None else None,
                cursor=cursor[1] if cursor is not None else None,
            ),
            fence.check,
        )
        if done.already_committed:
            self.discard()
            return WriteResult(rows_written=0, already_committed=True)
        self.tmp = None  # published (or, with no rows in append mode, never written)
        self.cursor_committed = done.cursor
        return WriteResult(rows_written=self.rows)

    def discard(self) -> None:
        """Remove the temporary file unless commit published it."""
        if self._writer is not None:
            with contextlib.suppress(OSError, pa.ArrowException):
                self._writer.close()
            self._writer = None
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.tmp = None


# --- the source -----------------------------------------------------------------------------
def _cursor_text(value: Any) -> str:
    if hasattr(value, "isoformat"):
        return str(value.isoformat())
    return str(value)


class Reader:
    def __init__(self, base_dir: str, spec: dict[str, Any], ctx: TransferContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.name = spec["path"]
        self.incremental = parse_incremental(spec)
        self.by_file = self.incremental is not None and self.incremental.cursor == (BY_FILE,)
        self.root = resolve(base_dir, spec["path"])
        self.base = os.path.realpath(base_dir)
        self.bounds: incremental.Bounds | None = None
        self.files = self._files(base_dir)
        self.dataset = self._dataset(self.files)
        self.columns = [Column(f.name, types.from_arrow(f)) for f in self.dataset.schema]
        if self.incremental is not None and not self.by_file:
            missing = [c for c in self.incremental.cursor if c not in self.dataset.schema.names]
            if missing:
                raise PermanentError(
                    f"incremental.cursor: the source has no column(s) {', '.join(missing)}"
                )

    def _files(self, base_dir: str) -> list[tuple[str, int | None]]:
        """The files to read, as (path relative to the source path, rows if known),
        sorted by path; each resolved inside base_dir."""
        if os.path.isfile(self.root):
            found: list[tuple[str, int | None]] = [("", None)]
            self._single_links(found)
            return found
        if not os.path.isdir(self.root):
            raise PermanentError(f"source path {self.name!r} does not exist")
        if manifest.has_manifest(self.root):
            found = list(manifest.committed_files(self.root, self.name))
        else:
            found = []
            for top, dirs, names in os.walk(self.root):
                # Hidden and `_`-prefixed names are a writer's work in progress or metadata
                # (Spark's _temporary, _SUCCESS; dispatch's _dispatch): never data.
                dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
                for n in names:
                    if n.endswith(".parquet") and not n.startswith(("_", ".")):
                        found.append((os.path.relpath(os.path.join(top, n), self.root), None))
        found.sort()
        self._single_links(found)
        return found

    def _single_links(self, found: list[tuple[str, int | None]]) -> None:
        """Each file resolves inside base_dir and has no other hard link (one may lie
        outside base_dir: a hard link carries no path to check)."""
        for rel, _rows in found:
            real = csv.resolve(self.base, os.path.relpath(self._path(rel), self.base), PARQUET_DIRS)
            if os.stat(real).st_nlink > 1:
                raise PermanentError(
                    f"{os.path.join(self.name, rel)!r} has other hard links; a file with other "
                    "names may lie outside base_dir, so it is not read"
                )

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _dataset(self, files: list[tuple[str, int | None]]) -> ds.Dataset:
        paths = [self._path(rel) for rel, _ in files]
        try:
            if not paths:
                return ds.dataset([], schema=pa.schema([]), format="parquet")
            if len(paths) == 1 and not files[0][0]:
                return ds.dataset(paths, format="parquet")
            return ds.dataset(
                paths, format="parquet", partitioning="hive", partition_base_dir=self.root
            )
        except (pa.ArrowInvalid, OSError) as exc:
            raise PermanentError(f"{self.name!r}: cannot read as Parquet: {exc}") from None

    # -- incremental ---------------------------------------------------------------------
    def bound(self, start: list[str] | None) -> incremental.Bounds:
        assert self.incremental is not None
        if self.by_file:
            after = start[0] if start else None
            new = [(rel, rows) for rel, rows in self.files if after is None or rel > after]
            end = [new[-1][0]] if new else None
            self.files = new
            self.dataset = self._dataset(new) if new else self.dataset
            self.bounds = incremental.Bounds(start, end)
            return self.bounds
        names = self.incremental.cursor
        where = self._above(start)
        best: tuple[Any, ...] | None = None
        for batch in self._scan(list(names), where):
            if batch.num_rows == 0:
                continue
            top = pa.Table.from_batches([batch]).sort_by([(n, "descending") for n in names])
            row = tuple(top.column(n)[0].as_py() for n in names)
            if best is None or row > best:
                best = row
        end = [_cursor_text(v) for v in best] if best is not None else None
        self.bounds = incremental.Bounds(start, end)
        return self.bounds

    def _above(self, start: list[str] | None) -> ds.Expression:
        """Rows whose cursor tuple is not null and, with a start, greater than it."""
        assert self.incremental is not None
        names = self.incremental.cursor
        expr = ds.field(names[0]).is_valid()
        for n in names[1:]:
            expr = expr & ds.field(n).is_valid()
        if start is not None:
            expr = expr & self._compare(start, ">")
        return expr

    def _value(self, name: str, text: str) -> pa.Scalar:
        t = self.dataset.schema.field(name).type
        try:
            return pc.cast(pa.scalar(text), t)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise PermanentError(
                f"incremental: the cursor value for {name!r} is not a {t}; reset the cursor"
            ) from None

    def _compare(self, values: list[str], op: str) -> ds.Expression:
        """The tuple comparison (cursor) > values, or <= values, as a filter."""
        assert self.incremental is not None
        names = self.incremental.cursor
        scalars = [self._value(n, v) for n, v in zip(names, values, strict=True)]
        result: ds.Expression | None = None
        # Lexicographic: the first differing column decides; `<=` adds equality at the end.
        for i in reversed(range(len(names))):
            f, s = ds.field(names[i]), scalars[i]
            here = (f > s) if op == ">" else (f < s)
            if result is None:
                result = here if op == ">" else (here | (f == s))
            else:
                result = here | ((f == s) & result)
        assert result is not None
        return result

    def _scan(self, columns: list[str] | None, where: ds.Expression | None) -> Iterator[Any]:
        try:
            yield from self.dataset.to_batches(
                columns=columns,
                filter=where,
                batch_size=BATCH_ROWS,
                batch_readahead=2,
                fragment_readahead=1,
            )
        except FileNotFoundError:
            raise TransientError(
                f"{self.name!r}: a file went away while it was read (the dataset was replaced)"
            ) from None
        except pa.ArrowInvalid as exc:
            raise PermanentError(f"{self.name!r}: {exc}") from None

    # -- rows ------------------------------------------------------------------------------
    def batches(self) -> Iterator[Batch]:
        where = None
        if self.incremental is not None and not self.by_file:
            if self.bounds is None:
                raise PermanentError("incremental read started without its cursor bounds")
            if self.bounds.end is None:
                return
            where = self._above(self.bounds.start) & self._compare(self.bounds.end, "<=")
        elif self.by_file and self.bounds is not None and self.bounds.end is None:
            return
        if where is None:
            self._estimate()
        for batch in self._scan(None, where):
            if batch.num_rows == 0:
                continue
            values = [types.python_values(col) for col in batch.columns]
            yield list(zip(*values, strict=True))

    def _estimate(self) -> None:
        """The exact row count, from the files' footers."""
        total = 0
        for fragment in self.dataset.get_fragments():
            total += fragment.metadata.num_rows if fragment.metadata is not None else 0
        self.ctx.estimate(total)
