"""The `csv` kind: files under one configured base directory, read and written as UTF-8.

CSV datasources are off unless the site lists the directories CSV files may live in
(`DISPATCH_CSV_BASE_DIRS`): a datasource plus a job amount to reading and writing files
as the worker's user. `base_dir` must lie in one of those directories and never is, lies
in or contains a protected location (`dispatch.security.paths`: the system's trees, the
directories Python imports from, PATH, the home directory), whatever the setting lists.
Every path is confined to `base_dir`: absolute paths, `..` and symlinks that lead out of
it are refused, and so are files with more than one hard link (a hard link inside
base_dir may name a file outside it). All of it is checked when the datasource is saved
and again each time the connector opens a file. A CSV file cannot take part in the sink
fence, so the writer re-checks its attempt (`ctx.fence.check()`) immediately before it
publishes the file.

An incremental read appends to a CSV file with its cursor in a state file beside it
(`dispatch/connectors/csv_state.py`): the rows and the cursor commit together, and the
tail of a writer that died between its append and its commit is cut off by the next one.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, time
from pathlib import PurePosixPath
from typing import IO, Any, TextIO

from django.core.exceptions import ValidationError

from dispatch.connectors import csv_state, incremental
from dispatch.connectors.base import (
    Batch,
    Column,
    ConfigField,
    Connector,
    PermanentError,
    SpecField,
    TransferContext,
    TransientError,
    WriteResult,
    check_unknown,
    require_object,
)
from dispatch.core import conf
from dispatch.security import paths

BATCH_ROWS = 5000
SINK_MODES = ("replace", "append")


# --- paths ----------------------------------------------------------------------------------
def check_relative_path(value: Any, field: str = "path") -> str:
    """The spec-time checks (no base directory needed): relative, no `..`, not empty."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field}: must be a file path relative to the base directory")
    if "\x00" in value:
        raise ValidationError(f"{field}: must not contain a NUL character")
    if value.startswith(("/", "\\")) or os.path.isabs(value):
        raise ValidationError(f"{field}: {value!r} is absolute; give a path relative to base_dir")
    parts = PurePosixPath(value.replace("\\", "/")).parts
    if ".." in parts:
        raise ValidationError(f"{field}: {value!r} contains '..'; paths stay inside base_dir")
    if len(value.encode()) > MAX_PATH_BYTES:
        raise ValidationError(f"{field}: is longer than {MAX_PATH_BYTES} bytes")
    if any(len(part.encode()) > MAX_NAME_BYTES for part in parts):
        raise ValidationError(f"{field}: a name in it is longer than {MAX_NAME_BYTES} bytes")
    return value


# File names: the temporary file beside the target adds a prefix and a suffix (about 16
# bytes) to the name, and most file systems allow 255 bytes per name.
MAX_NAME_BYTES = 200
MAX_PATH_BYTES = 1024
DISABLED = (
    "CSV datasources are disabled on this site: set DISPATCH_CSV_BASE_DIRS to the "
    "directories CSV files may live in (docs/security.md)"
)
# OSError numbers that a retry cannot fix.
PERMANENT_ERRNOS = {
    errno.ENAMETOOLONG,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ELOOP,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EINVAL,
}


def _os_error(message: str, exc: OSError) -> Exception:
    text = f"{message}: {exc.strerror}"
    if exc.errno in PERMANENT_ERRNOS:
        return PermanentError(text)
    return TransientError(text)


def root_problem(root: str, places: list[paths.Protected] | None = None) -> str | None:
    """Why the base-directory setting's entry `root` allows nothing, or None."""
    if not os.path.isabs(root):
        return "is not an absolute path"
    return paths.conflict(root, places=places)


@dataclass(frozen=True)
class BaseDirs:
    """A file kind's base-directory rules: the setting that lists where its files may
    live (empty: the kind is disabled) and the words its refusals use. The CSV and
    Parquet kinds share the rules and the resolution below, each with its own setting."""

    setting: str
    files: str  # "CSV files", in messages
    allowed: Callable[[], list[str]]
    disabled: str


# Looked up at each call (override_settings, monkeypatched conf functions).
CSV_DIRS = BaseDirs("DISPATCH_CSV_BASE_DIRS", "CSV files", lambda: conf.csv_base_dirs(), DISABLED)


def check_base_dir(base_dir: str, dirs: BaseDirs = CSV_DIRS) -> str | None:
    """Why `base_dir` is not allowed as a base directory (a sentence), or None."""
    allowed = dirs.allowed()
    if not allowed:
        return dirs.disabled
    if not os.path.isabs(base_dir):
        return f"base_dir {base_dir!r} must be an absolute path"
    real = os.path.realpath(base_dir)
    places = paths.protected()
    # Refused even inside a listed directory: listing /usr or the home by mistake must
    # not open them.
    clash = paths.conflict(real, places=places)
    if clash:
        return (
            f"base_dir {base_dir!r} {clash}; {dirs.files} need a directory of their own "
            "(docs/security.md)"
        )
    for root in allowed:
        # An entry that is itself refused (dispatch.E016, E020) allows nothing.
        if root_problem(root, places):
            continue
        if paths.within(real, os.path.realpath(root)):
            return None
    return (
        f"base_dir {base_dir!r} is not inside a directory the site allows for {dirs.files} "
        f"({dirs.setting}: {', '.join(allowed)})"
    )


def resolve(base_dir: str, path: str, dirs: BaseDirs = CSV_DIRS) -> str:
    """The real path of `path` under `base_dir`; refuses anything that leaves it."""
    try:
        check_relative_path(path)
    except ValidationError as exc:
        raise PermanentError(exc.messages[0]) from None
    refused = check_base_dir(base_dir, dirs)
    if refused:
        raise PermanentError(refused)
    base = os.path.realpath(base_dir)
    if not os.path.isdir(base):
        raise PermanentError(f"base_dir {base_dir!r} is not an existing directory")
    # realpath follows every symlink on the way, the last component included, so a link
    # anywhere in the path that points outside base_dir is caught here.
    real = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([base, real]) != base or real == base:
        raise PermanentError(f"path {path!r} leaves base_dir (through a symbolic link)")
    # Defence in depth: inside an accepted base_dir this cannot happen, unless base_dir
    # changed under the check (a directory on the way replaced by a link).
    clash = paths.conflict(real, contains=False)
    if clash:
        raise PermanentError(f"path {path!r} {clash}")
    return real


# --- values ---------------------------------------------------------------------------------
def _array_literal(values: list[Any]) -> str:
    """A PostgreSQL array literal, so an array column read back into PostgreSQL parses."""
    items = []
    for v in values:
        if v is None:
            items.append("NULL")
        elif isinstance(v, list):
            items.append(_array_literal(v))
        else:
            text = _text(v, "")
            items.append('"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return "{" + ",".join(items) + "}"


def _text(value: Any, column_type: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return "\\x" + bytes(value).hex()
    if isinstance(value, list) and column_type.endswith("]"):
        return _array_literal(value)
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


# --- the connector --------------------------------------------------------------------------
class CSVConnector(Connector):
    kind = "csv"
    label = "CSV files"
    roles = frozenset({"source", "sink"})
    config_fields = (
        ConfigField(
            "base_dir", required=True, help="Absolute directory; every path stays inside it."
        ),
    )
    source_fields = (
        SpecField("path", "the file, relative to base_dir (required)"),
        SpecField("delimiter", "one character (default ,)"),
        SpecField("header", "true (default): the first line names the columns"),
        SpecField("null", "the text that stands for NULL (default empty); null for none"),
    )
    sink_fields = (
        SpecField("path", "the file, relative to base_dir (required)"),
        SpecField("mode", f"{', '.join(SINK_MODES)} (default {SINK_MODES[0]})"),
        SpecField("delimiter", "one character (default ,)"),
        SpecField("header", "true (default): write a first line with the column names"),
        SpecField("null", "the text written for NULL (default empty)"),
    )

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        if not conf.csv_base_dirs():
            raise ValidationError(DISABLED)
        config = super().validate_config(config)
        base = config["base_dir"]
        if not os.path.isabs(base):
            raise ValidationError({"base_dir": ["must be an absolute path"]})
        refused = check_base_dir(base)
        if refused:
            raise ValidationError({"base_dir": [refused]})
        if not os.path.isdir(base):
            raise ValidationError({"base_dir": [f"{base!r} is not an existing directory"]})
        return config

    @classmethod
    def _common(cls, spec: dict[str, Any], role: str) -> None:
        if "path" not in spec:
            raise ValidationError("path: this field is required")
        check_relative_path(spec["path"])
        delimiter = spec.get("delimiter", ",")
        if (
            not isinstance(delimiter, str)
            or len(delimiter) != 1
            or not delimiter.isascii()
            or delimiter in '\r\n"'
        ):
            raise ValidationError("delimiter: must be one ASCII character (not a quote or newline)")
        if not isinstance(spec.get("header", True), bool):
            raise ValidationError("header: must be true or false")
        null = spec.get("null", "")
        if null is None and role == "source":
            return  # no marker: every field is a string
        if not isinstance(null, str):
            raise ValidationError(
                "null: must be a string (the text that stands for NULL)"
                + (", or null for none" if role == "source" else "")
            )
        # PostgreSQL's CSV (which a PostgreSQL source writes) refuses these, and a null
        # string holding them could not be told apart from data anyway.
        if any(c in null for c in (delimiter, '"', "\r", "\n")):
            raise ValidationError("null: must not contain the delimiter, a quote or a newline")

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, cls.spec_field_names("source"))
        cls._common(spec, "source")
        return spec

    @classmethod
    def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "sink_spec")
        check_unknown(spec, cls.spec_field_names("sink"))
        cls._common(spec, "sink")
        if spec.get("mode", "replace") not in SINK_MODES:
            raise ValidationError(f"mode: must be one of {', '.join(SINK_MODES)}")
        return spec

    @classmethod
    def test_connection(cls, config: dict[str, Any]) -> None:
        base = config.get("base_dir", "")
        refused = check_base_dir(base)
        if refused:
            raise PermanentError(refused)
        if not os.path.isdir(base):
            raise PermanentError(f"base_dir {base!r} is not an existing directory")
        if not os.access(base, os.R_OK | os.X_OK):
            raise PermanentError(f"base_dir {base!r} is not readable")

    @classmethod
    @contextlib.contextmanager
    def open_reader(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext
    ) -> Iterator[Any]:
        path = resolve(config["base_dir"], spec["path"])
        try:
            handle = open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise PermanentError(f"source file {spec['path']!r} does not exist") from None
        except IsADirectoryError:
            raise PermanentError(f"source path {spec['path']!r} is a directory") from None
        except OSError as exc:
            raise _os_error(f"cannot open {spec['path']!r}", exc) from None
        try:
            _single_link(handle.fileno(), spec["path"])
            yield _Reader(handle, spec)
        finally:
            handle.close()

    @classmethod
    @contextlib.contextmanager
    def open_writer(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> Iterator[Any]:
        writer = _Writer(resolve(config["base_dir"], spec["path"]), spec, ctx, columns)
        try:
            yield writer
        finally:
            writer.discard()

    @classmethod
    def set_cursor(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        binding_id: Any,
        columns: tuple[str, ...],
        cursor: list[str] | None,
        *,
        after_version: int = 0,
    ) -> incremental.CommittedCursor:
        """An operator's reset (None) or set of a binding's cursor, in the file's state
        (the file's size as it is now becomes its committed size; a state that cannot be
        read is replaced, see csv_state.set_cursor)."""
        if spec.get("mode", "replace") != "append":
            raise PermanentError("a CSV sink keeps a cursor in append mode only")
        return csv_state.set_cursor(
            resolve(config["base_dir"], spec["path"]),
            spec["path"],
            binding_id,
            columns,
            cursor,
            after_version=after_version,
        )


def _single_link(fd: int, name: str) -> None:
    """Refuse an open file that has other hard links: one of them may be outside base_dir
    (a hard link carries no path to check), so reading or appending through it would
    reach that file."""
    st = os.fstat(fd)
    if st.st_nlink > 1:
        raise PermanentError(
            f"{name!r} has {st.st_nlink} hard links; a file with other names may lie outside "
            "base_dir, so it is neither read nor appended to"
        )


# The CSV pass-through reads the file in blocks of this size (see `_Reader.copy_chunks`).
COPY_BLOCK_BYTES = 1 << 20
_BOM = b"\xef\xbb\xbf"
# A line holding only `\.` (unquoted): PostgreSQL's COPY FROM STDIN reads it as the end
# of the data in CSV too (up to version 17), so a file with one is not passed through.
_END_MARKER = re.compile(rb"\n\\\.(?:\r|\n)")


class _Reader:
    def __init__(self, handle: TextIO, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._handle = handle
        # True once the file went to the sink as raw CSV: the rows are then the sink's
        # count (a block's newlines are only an estimate: a quoted field may hold one).
        self.rows_counted_by_sink = False
        self.null: str | None = spec.get("null", "")
        self.delimiter: str = spec.get("delimiter", ",")
        self._lines = _Lines(handle)
        self._rows = csv.reader(self._lines, delimiter=self.delimiter)
        self._first: list[str] | None = None
        first = self._next()
        if first is None:  # an empty file: no columns, no rows
            self.columns: list[Column] = []
        elif spec.get("header", True):
            if any(not name for name in first) or len(set(first)) != len(first):
                raise PermanentError(
                    f"{spec['path']!r}: the header needs distinct, non-empty column names"
                )
            self.columns = [Column(name) for name in first]
        else:
            self.columns = [Column(f"column{i + 1}") for i in range(len(first))]
            self._first = first

    def _next(self) -> list[str] | None:
        self._lines.raw.clear()
        try:
            return next(self._rows)
        except StopIteration:
            return None
        except UnicodeDecodeError as exc:
            raise PermanentError(
                f"{self.spec['path']!r} is not UTF-8 near line {self._rows.line_num + 1}: "
                f"{exc.reason}"
            ) from None
        except csv.Error as exc:
            raise PermanentError(
                f"{self.spec['path']!r} line {self._rows.line_num}: {exc}"
            ) from None

    def batches(self) -> Iterator[Batch]:
        width = len(self.columns)
        batch: Batch = []
        row = self._first
        self._first = None
        if row is None:
            row = self._next()
        while row is not None:
            if len(row) != width:
                raise PermanentError(
                    f"{self.spec['path']!r} line {self._rows.line_num}: {len(row)} fields, "
                    f"expected {width}"
                )
            batch.append(row if self.null is None else self._nulls(row))
            if len(batch) >= BATCH_ROWS:
                yield batch
                batch = []
            row = self._next()
        if batch:
            yield batch

    @property
    def copy_source(self) -> tuple[str, dict[str, Any]] | None:
        """The one COPY format this reader sends, the file itself: CSV with the file's
        delimiter, null marker and header (None: no columns, nothing to pass through)."""
        if not self.columns:
            return None
        return "csv", {
            "delimiter": self.delimiter,
            "null": self.null,
            "header": bool(self.spec.get("header", True)),
        }

    def copy_chunks(
        self, fmt: str, options: dict[str, Any] | None = None
    ) -> Iterator[tuple[bytes, int]]:
        """The file's bytes in blocks, for a sink that parses the CSV itself (PostgreSQL's
        `COPY ... (FORMAT csv)` with this file's options, `copy_source`): no row is
        touched in Python. The byte-order mark is skipped; the header line goes along
        and the sink skips it. Each block's rows are its newlines (an estimate)."""
        if fmt != "csv":
            raise PermanentError(f"a CSV source sends csv, not {fmt}")
        self.rows_counted_by_sink = True
        raw = self._handle.buffer
        start = os.pread(raw.fileno(), len(_BOM), 0) == _BOM
        raw.seek(len(_BOM) if start else 0)
        tail = b"\n"  # the file's start counts as a line start
        while True:
            block = raw.read(COPY_BLOCK_BYTES)
            if not block:
                break
            window = tail + block
            if _END_MARKER.search(window):
                self._end_marker()
            tail = window[-3:]
            yield block, block.count(b"\n")
        if tail.endswith(b"\n\\."):  # the last line, without a newline after it
            self._end_marker()

    def _end_marker(self) -> None:
        raise PermanentError(
            f"{self.spec['path']!r} has a line holding only \\. (unquoted), which "
            "PostgreSQL's COPY reads as the end of the data: quote it"
        )

    def _nulls(self, row: list[str]) -> list[str | None]:
        """NULL for each unquoted field equal to the null marker; a quoted one is data."""
        null = self.null
        if null not in row:
            return row  # type: ignore[return-value]
        raw = "".join(self._lines.raw)
        if '"' not in raw:
            return [None if v == null else v for v in row]
        quoted = _quoted_fields(raw, self.delimiter)
        return [None if v == null and not q else v for v, q in zip(row, quoted, strict=True)]


class _Lines:
    """The file's lines, keeping those of the record being parsed: `csv` does not say
    which fields were quoted, and only the raw text tells `""` (data) from an empty
    field (NULL with the default marker)."""

    def __init__(self, handle: IO[str]) -> None:
        self._handle = handle
        self.raw: list[str] = []

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = next(self._handle)
        self.raw.append(line)
        return line


def _quoted_fields(record: str, delimiter: str) -> list[bool]:
    """Whether each field of one CSV record (as `csv`'s default dialect parses it) begins
    with a quote."""
    flags: list[bool] = []
    i, n = 0, len(record)
    while True:
        quoted = i < n and record[i] == '"'
        flags.append(quoted)
        if quoted:  # up to the closing quote; "" inside is one quote
            i += 1
            while i < n:
                if record[i] == '"':
                    if record.startswith('""', i):
                        i += 2
                        continue
                    i += 1
                    break
                i += 1
        # The rest of the field (csv keeps text after a closing quote), to a delimiter or
        # the record's end.
        while i < n and record[i] != delimiter:
            if record[i] in "\r\n":
                return flags
            i += 1
        if i >= n:
            return flags
        i += 1


def _field(value: str, delimiter: str, null: str) -> str:
    """One value as a CSV field, quoted when it must be, and whenever it could be read
    back as NULL (equal to the marker, or empty) or as PostgreSQL's end-of-data `\\.`."""
    if (
        value == null
        or not value
        or value == "\\."
        or '"' in value
        or delimiter in value
        or "\n" in value
        or "\r" in value
    ):
        return '"' + value.replace('"', '""') + '"'
    return value


class _Writer:
    """Rows go to a temporary file beside the target; commit publishes it: `replace`
    renames it over the target (atomic), `append` appends it to the target."""

    def __init__(
        self, path: str, spec: dict[str, Any], ctx: TransferContext, columns: list[Column]
    ) -> None:
        self.path = path
        self.spec = spec
        self.ctx = ctx
        self.columns = columns
        self.mode = spec.get("mode", "replace")
        self.null = spec.get("null", "")
        self.header = bool(spec.get("header", True))
        self.rows = 0
        self.types = [c.type for c in columns]
        # An incremental read's cursors: what the file's state held when the attempt
        # started, and what commits with the rows (csv_state.commit).
        self._cursor_read: incremental.CommittedCursor | None = None
        self._cursor_new: tuple[tuple[str, ...], list[str] | None] | None = None
        self.cursor_committed: incremental.CommittedCursor | None = None
        directory = os.path.dirname(path)
        if self.mode == "append" and os.path.isfile(path) and os.stat(path).st_nlink > 1:
            raise PermanentError(
                f"{spec['path']!r} has {os.stat(path).st_nlink} hard links; a file with other "
                "names may lie outside base_dir, so it is not appended to"
            )
        if not os.path.isdir(directory):
            raise PermanentError(f"the directory of {spec['path']!r} does not exist")
        try:
            fd, self.tmp = tempfile.mkstemp(
                dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
            )
        except OSError as exc:
            raise _os_error(f"cannot write in the directory of {spec['path']!r}", exc) from None
        self.handle: IO[str] | None = open(fd, "w", encoding="utf-8", newline="")  # noqa: SIM115
        self.delimiter: str = spec.get("delimiter", ",")
        if self.header and self.mode == "replace" and columns:
            self._write_header()

    # -- the committed cursor of an incremental read (dispatch/connectors/incremental.py) --
    def cursor_state(self, inc: incremental.IncrementalSpec) -> incremental.CommittedCursor:
        """The binding's committed cursor, as the file's state holds it (the truth)."""
        if self.mode != "append":
            raise PermanentError(
                "incremental reads into a CSV file need mode append: replace would keep only "
                "the latest increment"
            )
        if inc.lookback_seconds is not None:
            raise PermanentError(
                "incremental.lookback_seconds re-reads rows, so it needs an upsert sink"
            )
        state = csv_state.read(self.path, self.spec["path"])
        self._cursor_read = csv_state.cursor_of(state, self.ctx.fence.binding_id)
        return self._cursor_read

    def stage_cursor(self, columns: tuple[str, ...], cursor: list[str] | None) -> None:
        """The cursor to commit with the rows (in the same state write as the size)."""
        self._cursor_new = (columns, cursor)

    def _header_line(self) -> str:
        line = io.StringIO()
        csv.writer(line, delimiter=self.delimiter, lineterminator="\n").writerow(
            [c.name for c in self.columns]
        )
        return line.getvalue()

    def _write_header(self) -> None:
        assert self.handle is not None
        self.handle.write(self._header_line())

    # From a PostgreSQL source, the rows arrive as PostgreSQL's own CSV (COPY ... FORMAT
    # CSV): every value exactly as PostgreSQL writes it, never through a Python object
    # (an interval stays `1 year 2 mons`, json keeps its key order and its numbers'
    # spelling, a range, `infinity` or a BC date passes as it is). NULL is the unquoted
    # null string, an empty string is quoted: the two stay apart.
    def copy_format(self, columns: list[Column]) -> str | None:
        return "csv"

    @property
    def copy_options(self) -> dict[str, str]:
        return {"delimiter": self.spec.get("delimiter", ","), "null": self.null}

    def write_copy(self, data: bytes, rows: int) -> int:
        assert self.handle is not None
        self.handle.write(data.decode("utf-8"))
        self.rows += rows
        return rows

    def write(self, batch: Batch) -> int:
        # By hand, not csv.writer: it writes "" as an empty field and the null marker
        # unquoted, so either would read back as NULL.
        assert self.handle is not None
        null, types, delimiter = self.null, self.types, self.delimiter
        self.handle.write(
            "".join(
                delimiter.join(
                    null if v is None else _field(_text(v, t), delimiter, null)
                    for v, t in zip(row, types, strict=False)
                )
                + "\n"
                for row in batch
            )
        )
        self.rows += len(batch)
        return len(batch)

    def commit(self) -> WriteResult:
        assert self.handle is not None
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.handle = None
        # The last moment before the data becomes visible: a worker that lost its attempt
        # (or missed heartbeats for longer than the lease) stops at its fence check.
        if self.mode == "replace":
            self.ctx.fence.check()
            mode = os.stat(self.path).st_mode & 0o777 if os.path.exists(self.path) else 0o644
            os.chmod(self.tmp, mode)
            os.replace(self.tmp, self.path)  # atomic on POSIX: readers see old or new
        elif self._cursor_new is not None or os.path.lexists(csv_state.state_path(self.path)):
            # The rows with the cursor (or, for a full read into a file that has a state,
            # with its committed size): csv_state's protocol, under the file's lock.
            fence = self.ctx.fence
            columns, cursor = self._cursor_new or (None, None)
            self.cursor_committed = csv_state.commit(
                self.path,
                self.spec["path"],
                append=self._append,
                binding_id=fence.binding_id if self._cursor_new is not None else None,
                read_version=self._cursor_read.version if self._cursor_read else None,
                columns=columns,
                cursor=cursor,
                run_id=fence.run_id,
                attempt_id=fence.attempt_id,
                check=fence.check,
            )
        else:
            self.ctx.fence.check()
            self._append(None, None)
        self._sync_dir()
        return WriteResult(rows_written=self.rows)

    def _append(self, before: int | None, intend: Any) -> int:
        """Append the spooled rows (and the header to an empty file); with `intend`, first
        record the size the file will have (csv_state's intent). Returns that size."""
        # O_NOFOLLOW: the target must not have become a symlink since it was resolved.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            _single_link(fd, self.spec["path"])
        except PermanentError:
            os.close(fd)
            raise
        with open(fd, "w", encoding="utf-8", newline="") as out:
            size = os.fstat(fd).st_size
            header = self._header_line() if self.header and self.columns and size == 0 else ""
            total = size + len(header.encode("utf-8")) + os.path.getsize(self.tmp)
            if intend is not None:
                intend(total)
            out.write(header)
            with open(self.tmp, encoding="utf-8", newline="") as spool:
                while chunk := spool.read(1 << 20):
                    out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.unlink(self.tmp)
        return total

    def _sync_dir(self) -> None:
        fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def discard(self) -> None:
        """Remove the temporary file unless commit published it."""
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)
