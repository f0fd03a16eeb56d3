"""The `parquet` kind: Parquet datasets (a directory of files) under one base directory.

Parquet datasources are off unless the site lists the directories their files may live
in (`DISPATCH_PARQUET_BASE_DIRS`), with the CSV kind's rules and path resolution
(`dispatch.connectors.csv.resolve`: no absolute path, no `..`, no symlink out of
base_dir, no protected location, no file with other hard links).

A sink writes one file per attempt into `<path>/_dispatch/tmp/`, streaming row groups,
and publishes it through the dataset's manifest (`parquet_manifest`): the fence and the
cursor commit with the file, a stale attempt's file is never published, and readers see
only committed files. A source reads one file, or a directory of files (the committed
files of a dispatch dataset; else every `*.parquet` file under it, `key=value`
directories read as columns), in full, by new files, or by a column cursor.

The reader and writer (pyarrow) are in parquet_io.py, imported when a datasource is
first read or written: listing the kind and validating its forms import no pyarrow.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from django.core.exceptions import ValidationError

from dispatch.connectors import csv, incremental
from dispatch.connectors import parquet_manifest as manifest
from dispatch.connectors.base import (
    Column,
    ConfigField,
    Connector,
    PermanentError,
    SpecField,
    TransferContext,
    check_unknown,
    int_field,
    require_object,
)
from dispatch.connectors.parquet_spec import (
    COMPRESSIONS,
    DISABLED,
    MAX_ROW_GROUP_ROWS,
    PARQUET_DIRS,
    ROW_GROUP_ROWS,
    SINK_MODES,
    _os_error,
    parse_incremental,
    resolve,
)
from dispatch.core import conf


class ParquetConnector(Connector):
    kind = "parquet"
    label = "Parquet files"
    roles = frozenset({"source", "sink"})
    config_fields = (
        ConfigField(
            "base_dir", required=True, help="Absolute directory; every path stays inside it."
        ),
    )
    source_fields = (
        SpecField(
            "path",
            "a .parquet file or a directory of them, relative to base_dir (required); "
            "key=value directories become columns",
        ),
        SpecField(
            "incremental",
            '{"by": "file"}: only files whose path sorts after the last one read; or '
            '{"cursor": [column, ...]}: only rows above the committed cursor',
        ),
    )
    sink_fields = (
        SpecField("path", "the dataset directory, relative to base_dir (required; created)"),
        SpecField("mode", f"{', '.join(SINK_MODES)} (default {SINK_MODES[0]})"),
        SpecField("compression", f"{', '.join(COMPRESSIONS)} (default {COMPRESSIONS[0]})"),
        SpecField("row_group_rows", f"rows per row group (default {ROW_GROUP_ROWS:,})"),
    )

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        if not conf.parquet_base_dirs():
            raise ValidationError(DISABLED)
        config = super().validate_config(config)
        base = config["base_dir"]
        if not os.path.isabs(base):
            raise ValidationError({"base_dir": ["must be an absolute path"]})
        refused = csv.check_base_dir(base, PARQUET_DIRS)
        if refused:
            raise ValidationError({"base_dir": [refused]})
        if not os.path.isdir(base):
            raise ValidationError({"base_dir": [f"{base!r} is not an existing directory"]})
        return config

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "source_spec")
        check_unknown(spec, cls.spec_field_names("source"))
        if "path" not in spec:
            raise ValidationError("path: this field is required")
        csv.check_relative_path(spec["path"])
        parse_incremental(spec)
        return spec

    @classmethod
    def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        spec = require_object(spec, "sink_spec")
        check_unknown(spec, cls.spec_field_names("sink"))
        if "path" not in spec:
            raise ValidationError("path: this field is required")
        csv.check_relative_path(spec["path"])
        if spec.get("mode", "replace") not in SINK_MODES:
            raise ValidationError(f"mode: must be one of {', '.join(SINK_MODES)}")
        if spec.get("compression", "zstd") not in COMPRESSIONS:
            raise ValidationError(f"compression: must be one of {', '.join(COMPRESSIONS)}")
        int_field(
            spec, "row_group_rows", default=ROW_GROUP_ROWS, minimum=1, maximum=MAX_ROW_GROUP_ROWS
        )
        return spec

    @classmethod
    def test_connection(cls, config: dict[str, Any]) -> None:
        base = config.get("base_dir", "")
        refused = csv.check_base_dir(base, PARQUET_DIRS)
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
        from dispatch.connectors.parquet_io import Reader

        yield Reader(config["base_dir"], spec, ctx)

    @classmethod
    @contextlib.contextmanager
    def open_writer(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> Iterator[Any]:
        from dispatch.connectors.parquet_io import Writer

        directory = _dataset_dir(config["base_dir"], spec["path"])
        writer = Writer(directory, spec, ctx, columns)
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
        """An operator's reset (None) or set of a binding's cursor, in the dataset's
        manifest (a new generation with the same files)."""
        if spec.get("mode", "replace") != "append":
            raise PermanentError("a Parquet sink keeps a cursor in append mode only")
        directory = _dataset_dir(config["base_dir"], spec["path"])
        return manifest.set_cursor(
            directory, spec["path"], binding_id, columns, cursor, after_version=after_version
        )


def _dataset_dir(base_dir: str, path: str) -> str:
    """The sink's dataset directory (made if missing, inside base_dir)."""
    real = resolve(base_dir, path)
    if os.path.lexists(real) and not os.path.isdir(real):
        raise PermanentError(f"sink path {path!r} is not a directory (a dataset is one)")
    try:
        os.makedirs(real, exist_ok=True)
    except OSError as exc:
        raise _os_error(f"cannot make the dataset directory {path!r}", exc) from None
    # Made through a path just resolved: re-resolve, a link put in its place meanwhile is
    # caught like any other.
    if resolve(base_dir, path) != real:
        raise PermanentError(f"sink path {path!r} changed while it was made")
    return real
