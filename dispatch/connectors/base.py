"""The connector interface. Connectors know nothing of runs, leases or workers.

The runner hands a connector a decrypted config, a spec and a `TransferContext` (the
fence, progress callbacks, and a stop check). A reader yields batches of rows; a writer
takes them and commits once at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from django.core.exceptions import ValidationError

Row = Sequence[Any]
Batch = list[Row]


class ConnectorError(Exception):
    """An error a connector raises with a message that holds no secret.

    `permanent` errors (bad credentials, a missing table, invalid SQL) are not retried.
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class PermanentError(ConnectorError):
    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


class TransientError(ConnectorError):
    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=False)


class Stopped(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised inside a transfer when the runner wants it to stop (see `StopCause`)."""


class LeaseLost(Exception):  # noqa: N818
    """The attempt is no longer this worker's: stop, roll back, record nothing."""


class FenceRejected(LeaseLost):
    """A sink refused this attempt's commit: a newer attempt raised the run's fence, or
    the run's data was already committed. Logged and counted, never recorded."""


@dataclass(frozen=True)
class Column:
    name: str
    # The PostgreSQL type, exactly (e.g. "numeric(12,2)"), or "" when the source has none.
    type: str = ""
    # What a table source declares of it, for a sink that creates its table like the
    # source's (a query's or a file's columns declare nothing): NOT NULL; its place in the
    # primary key (1-based, 0: not in it); and (number, place) in each unique constraint
    # it belongs to. A key or constraint is described only when every one of its columns
    # is delivered.
    not_null: bool = False
    key: int = 0
    unique: tuple[tuple[int, int], ...] = ()


class Fence(Protocol):
    """What a sink needs to take part in fencing: the identity and token of the attempt."""

    run_id: Any
    binding_id: Any
    attempt_id: Any
    token: int

    def check(self) -> None:
        """Raise `LeaseLost` if the attempt is no longer this worker's (status + token),
        or if its last successful heartbeat is older than the lease."""


@dataclass
class WriteResult:
    rows_written: int = 0
    # The run's data was already committed by an earlier attempt: nothing was written.
    already_committed: bool = False


class TransferContext(Protocol):
    fence: Fence

    def progress(self, *, rows_read: int = 0, rows_written: int = 0) -> None:
        """Add to the counters; raises `Stopped` when the transfer must stop."""

    def estimate(self, rows: int) -> None:
        """Report how many rows the read is expected to yield (an estimate or an exact
        count), once, before the first row: the total that progress is shown against.
        A source that cannot tell does not call it."""

    def should_stop(self) -> bool: ...

    def on_stop(self, interrupt: Callable[[], None]) -> Callable[[], None]:
        """Register `interrupt`, called from another thread when the transfer must stop
        (at once if it already must), to break out of a blocking call: a connector
        cancels its running statement. It may be called more than once. Returns the
        function that unregisters it; call that before closing what it interrupts."""

    def wait(self, seconds: float) -> None:
        """Sleep, returning early (with `Stopped`) when the transfer must stop."""


def note_event(ctx: Any, kind: str, message: str, **data: Any) -> None:
    """Tell the runner of an event of the transfer for the attempt's log (`lock_wait` with
    `seconds`: the runner keeps only waits over its threshold; `fence_raised`). Optional
    on both sides: a context without `event` (a test's, a tool's) takes none. The message
    names no secret (the runner sanitizes it too)."""
    event = getattr(ctx, "event", None)
    if event is not None:
        event(kind, message, **data)


class Reader(Protocol):
    columns: list[Column]

    def batches(self) -> Iterator[Batch]: ...


class Writer(Protocol):
    def write(self, batch: Batch) -> int:
        """Write one batch; returns the rows written."""

    def commit(self) -> WriteResult: ...


# --- optional: raw COPY pass-through between two PostgreSQL connectors --------------------
# A reader with `copy_chunks` and a writer with `copy_format` + `write_copy` let the runner
# move PostgreSQL COPY data without decoding rows. A writer may also set
# `already_committed = True` when it opens (the run's data is already in the sink): the
# runner then skips the transfer and calls `commit()` at once.


# A writer with `json_text = True` takes a JSON value as its text: the runner then sets
# `json_text = True` on a reader that has the attribute, which hands json values as their
# text instead of parsed objects (the `postgresql` source; the `mysql` sink sends text
# anyway, so nothing is parsed and dumped again).


# A sink connector with `open_before_columns = True` may be opened (`open_writer`) with the
# columns list still empty: the runner fills that same list once the source is open,
# before the writer's first use, so both sides connect at the same time.


class CopyReader(Protocol):
    columns: list[Column]

    def copy_chunks(
        self, fmt: str, options: dict[str, str] | None = None
    ) -> Iterator[tuple[bytes, int]]:
        """PostgreSQL COPY data in `fmt` ("binary", "text" or "csv", the last with the
        writer's `copy_options`: delimiter and null string), as (block, rows in it)."""


class CopyWriter(Protocol):
    def copy_format(self, columns: list[Column]) -> str | None:
        """The COPY format to receive these source columns in, or None for rows."""

    def write_copy(self, data: bytes, rows: int) -> int:
        """Write one block of COPY data; returns the rows written. A writer that asks for
        "csv" also has `copy_options` (delimiter, null), and gets UTF-8."""


def copy_format(reader: Any, writer: Any) -> str | None:
    """The COPY format both sides agree on, or None (move decoded rows). A reader that
    sends one fixed format (`copy_source`: a CSV file as it is) needs a writer that
    `accept_copy`s it."""
    if not (hasattr(reader, "copy_chunks") and hasattr(writer, "write_copy")):
        return None
    if hasattr(reader, "copy_source"):
        source = reader.copy_source
        accept = getattr(writer, "accept_copy", None)
        if source is None or accept is None or not accept(*source):
            return None
        return str(source[0])
    fmt = writer.copy_format(reader.columns)
    # A reader may hand out only some formats (keyed hashes: text); a sink that asked for
    # binary reads text as well, any other then gets decoded rows.
    only = getattr(reader, "copy_formats", None)
    if only is not None and fmt not in only:
        fmt = "text" if fmt == "binary" and "text" in only else None
        if fmt is not None and hasattr(writer, "use_copy_format"):
            writer.use_copy_format(fmt)
    return fmt if fmt in ("binary", "text", "csv") else None


@dataclass(frozen=True)
class ConfigField:
    name: str
    required: bool = False
    secret: bool = False
    help: str = ""
    kind: type = str
    # Part of where the secrets are sent (host, port, user, ...): a change to it needs the
    # secrets entered again, so a stored secret never follows an edit to another server.
    destination: bool = False
    # The only values it takes (a select in the form; `validate_config` refuses others).
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecField:
    """A top-level field of a source or sink spec, with a line saying what it does."""

    name: str
    help: str = ""


# Keys the runner adds to the specs of a slice run, after their validation (a job's author
# cannot set them): the source's range {"key", "lower", "upper"} (NULL bounds open), and
# the sink's place in the sliced run {"parent", "number", "total"}. docs/connectors.md,
# "Slices".
SLICE_RANGE = "slice_range"
SLICE_OF = "slice_of"


class Connector:
    """A connector kind: subclass, set the class attributes, override what applies."""

    kind: ClassVar[str]
    label: ClassVar[str] = ""
    roles: ClassVar[frozenset[str]] = frozenset()
    config_fields: ClassVar[tuple[ConfigField, ...]] = ()
    # The fields a source (sink) spec accepts: the names its validator allows
    # (`check_unknown(spec, cls.spec_field_names("source"))`), and the job form's help.
    # None: not declared, the validator alone knows; (): none (an empty object).
    source_fields: ClassVar[tuple[SpecField, ...] | None] = None
    sink_fields: ClassVar[tuple[SpecField, ...] | None] = None
    # Whether its writer can take the slices of a sliced run (each slice a run of its own,
    # committing on its own): a sink that cannot fence per run, or that rewrites one whole
    # file, would keep only a slice or duplicate one on a retry.
    sliced_writes: ClassVar[bool] = False

    @classmethod
    def sink_spec_errors_with_source(
        cls, sink_spec: dict[str, Any], source_spec: dict[str, Any]
    ) -> list[str]:
        """What this sink refuses of `sink_spec` given the job's (valid) `source_spec`
        (a mode a sliced or incremental source cannot have); empty when none."""
        return []

    @classmethod
    def secret_fields(cls) -> frozenset[str]:  # type: ignore[override]
        return frozenset(f.name for f in cls.config_fields if f.secret)

    @classmethod
    def spec_fields(cls, role: str) -> tuple[SpecField, ...] | None:
        """The declared fields of a `role` ("source" or "sink") spec."""
        return cls.source_fields if role == "source" else cls.sink_fields

    @classmethod
    def spec_field_names(cls, role: str) -> set[str]:
        return {f.name for f in cls.spec_fields(role) or ()}

    # --- validation (messages name the field) ---------------------------------------
    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        return cls.check_declared_fields(config)

    @classmethod
    def check_declared_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The checks of `config_fields` (unknown fields, required ones, kinds, choices),
        every error under its field; a config that is not an object fails as `config`."""
        if not isinstance(config, dict):
            raise ValidationError({"config": "must be a JSON object"})
        known = {f.name: f for f in cls.config_fields}
        errors: dict[str, str] = {}
        for name in config:
            if name not in known:
                errors[name] = f"unknown field for a {cls.kind} datasource"
        for f in cls.config_fields:
            value = config.get(f.name)
            if value in (None, ""):
                if f.required:
                    errors[f.name] = "this field is required"
                continue
            if f.kind is int and (not isinstance(value, int) or isinstance(value, bool)):
                errors[f.name] = "must be an integer"
            elif f.kind is str and not isinstance(value, str):
                errors[f.name] = "must be a string"
            elif f.choices and value not in f.choices:
                errors[f.name] = f"must be one of {', '.join(f.choices)}"
        if errors:
            raise ValidationError({k: [v] for k, v in errors.items()})
        return dict(config)

    @classmethod
    def validate_source_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        raise ValidationError(f"a {cls.kind} datasource cannot be a source")

    @classmethod
    def validate_sink_spec(cls, spec: dict[str, Any]) -> dict[str, Any]:
        raise ValidationError(f"a {cls.kind} datasource cannot be a sink")

    # --- runtime ------------------------------------------------------------------------
    @classmethod
    def test_connection(cls, config: dict[str, Any]) -> None:
        """Open and close a connection; raise `ConnectorError` (no secret in it)."""

    @classmethod
    def open_reader(
        cls, config: dict[str, Any], spec: dict[str, Any], ctx: TransferContext
    ) -> contextlib.AbstractContextManager[Reader]:
        raise NotImplementedError

    @classmethod
    def open_writer(
        cls,
        config: dict[str, Any],
        spec: dict[str, Any],
        ctx: TransferContext,
        columns: list[Column],
    ) -> contextlib.AbstractContextManager[Writer]:
        raise NotImplementedError


def spec_errors(connector: type[Connector], role: str, spec: Any) -> list[str]:
    """What the connector's validator (the one the job and binding forms use) says of
    `spec` as its `role` ("source" or "sink"), each message prefixed with the spec's name;
    empty when valid."""
    if role not in connector.roles:
        return [f"a {connector.kind} datasource cannot be a {role}"]
    validate = connector.validate_source_spec if role == "source" else connector.validate_sink_spec
    try:
        validate(spec)
    except ValidationError as exc:
        return [f"{role}_spec: {m}" for m in exc.messages]
    return []


def server_config(
    connector: type[Connector],
    config: dict[str, Any],
    *,
    own: Callable[[dict[str, Any], dict[str, list[str]]], None] | None = None,
    policy: Callable[[dict[str, Any]], list[str]],
    policy_field: str = "host",
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The checks a database server's config takes (`postgresql`, `mysql`), every error
    under its field and reported together: the declared fields' (`check_declared_fields`;
    a config that is not an object raises at once), the connector's `own`
    (adding to the errors it is given), `port` in 1..65535, then, only when all of those
    pass, the site's target policy, its problems under `policy_field`. Returns the
    config and the errors; the caller adds its own and raises."""
    try:
        config = connector.check_declared_fields(config)
        errors: dict[str, list[str]] = {}
    except ValidationError as exc:
        if not hasattr(exc, "error_dict") or "config" in exc.error_dict:
            raise
        errors = dict(exc.message_dict)
    if own is not None:
        own(config, errors)
    port = config.get("port")
    if isinstance(port, int) and not 0 < port < 65536:
        errors["port"] = ["must be between 1 and 65535"]
    if not errors and config.get(policy_field):
        problems = policy(config)
        if problems:
            errors[policy_field] = problems
    return config, errors


def require_object(spec: Any, what: str = "spec") -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise ValidationError(f"{what} must be a JSON object")
    return spec


def check_unknown(spec: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValidationError(
            f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def int_field(
    spec: dict[str, Any],
    name: str,
    *,
    default: int | None,
    minimum: int = 0,
    maximum: int | None = None,
) -> int | None:
    """An optional integer field; an explicit null is allowed only where the default is."""
    value = spec.get(name, default)
    if value is None:
        if default is not None:
            raise ValidationError(f"{name}: must be an integer >= {minimum}, not null")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValidationError(f"{name}: must be an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValidationError(f"{name}: must be at most {maximum:,}")
    return value


@dataclass
class SimpleReader:
    columns: list[Column]
    _batches: Iterator[Batch] = field(repr=False, default_factory=lambda: iter(()))

    def batches(self) -> Iterator[Batch]:
        return self._batches
