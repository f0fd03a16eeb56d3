"""What the `parquet` kind's connector (parquet.py) and its reader and writer
(parquet_io.py, pyarrow) share: the spec's constants, the base directories, paths, the
incremental spec."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError

from dispatch.connectors import csv, incremental
from dispatch.connectors.base import check_unknown
from dispatch.core import conf

BATCH_ROWS = 5000
# Rows buffered before a row group is written: the writer's memory bound.
ROW_GROUP_ROWS = 65_536
MAX_ROW_GROUP_ROWS = 1_000_000
SINK_MODES = ("replace", "append")
COMPRESSIONS = ("zstd", "snappy", "gzip", "none")
# The cursor "column" of an incremental read by file: the file's path relative to the
# source path (not a column name: it holds parentheses).
BY_FILE = "(file)"
DISABLED = (
    "Parquet datasources are disabled on this site: set DISPATCH_PARQUET_BASE_DIRS to the "
    "directories Parquet files may live in (docs/security.md)"
)
PARQUET_DIRS = csv.BaseDirs(
    "DISPATCH_PARQUET_BASE_DIRS", "Parquet files", lambda: conf.parquet_base_dirs(), DISABLED
)


def resolve(base_dir: str, path: str) -> str:
    return csv.resolve(base_dir, path, PARQUET_DIRS)


def _os_error(message: str, exc: OSError) -> Exception:
    return csv._os_error(message, exc)


def parse_incremental(spec: dict[str, Any]) -> incremental.IncrementalSpec | None:
    """The source's `incremental`: `{by: "file"}` (new files since the committed cursor)
    or a column cursor `{cursor: [...], start: [...]}` (no lookback)."""
    block = spec.get("incremental")
    if isinstance(block, dict) and "by" in block:
        check_unknown(block, {"by", "start"})
        if block["by"] != "file":
            raise ValidationError('incremental.by: must be "file" (or give incremental.cursor)')
        start = block.get("start")
        if start is not None and not isinstance(start, str):
            raise ValidationError("incremental.start: must be a file path (a string)")
        return incremental.IncrementalSpec((BY_FILE,), (start,) if start else None)
    inc = incremental.parse(spec)
    if inc is not None and inc.lookback_seconds is not None:
        raise ValidationError("incremental.lookback_seconds: a parquet source has no lookback")
    return inc
