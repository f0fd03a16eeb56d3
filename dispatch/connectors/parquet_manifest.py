"""A Parquet dataset directory's manifest: which files are committed, by which run and
attempt (the fence), and each incremental binding's cursor.

Layout of a dataset directory D (docs/connectors.md, "Parquet"):

    D/part-<sequence>-<attempt>.parquet     the committed data files
    D/_dispatch/manifest-<generation>.json  the manifests, the highest one current
    D/_dispatch/tmp/*.parquet.tmp           files being written (never read)
    D/_dispatch/lock                        flock'ed by a commit, never replaced

A writer streams its rows into a file under `_dispatch/tmp/`, a name no Parquet reader
globbing `D/*.parquet` (nor pyarrow, Spark or DuckDB's hive reading, which skip names
starting with `_` or `.`) ever reads. A commit, under the lock:

1. completes what a writer that died after its commit point left undone (renames the
   files the current manifest lists from their staged names, and deletes `part-*`
   files it no longer lists: those a `replace` superseded);
2. refuses a stale attempt: one whose run was committed by an attempt with a newer token
   (`FenceRejected`), and re-checks the attempt itself (`fence.check()`, which raises
   `LeaseLost`); a run already committed by an earlier attempt commits nothing again;
3. compares the binding's cursor version with the one the attempt read (a concurrent run
   or an operator moved it: transient, the retry starts from the new cursor);
4. writes the next generation's manifest (a temporary name, fsync, `os.replace`, fsync of
   the directory): this rename is the commit point;
5. renames the data file to its published name, and for `replace` deletes the files of
   the previous generation.

So a stale attempt's file is deleted with its temporary directory entry and never
renamed; a reader of the manifest sees exactly one generation; a reader globbing the
directory sees only committed files (during a `replace`, the new file and, until step 5
ends, the previous generation's files beside it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dispatch.connectors import files
from dispatch.connectors.base import FenceRejected, PermanentError, TransientError
from dispatch.connectors.incremental import CommittedCursor

FORMAT = 1
STATE_DIR = "_dispatch"
TMP_DIR = "tmp"
# The manifests read are bounded (a dataset of about 100,000 files).
MAX_MANIFEST_BYTES = 32 << 20
# The runs a manifest remembers (for the fence and "already committed"): the latest ones.
MAX_RUNS = 1000
# Older manifest generations kept for readers that opened one a moment ago.
KEEP_GENERATIONS = 5
_MANIFEST = re.compile(r"manifest-(\d{10})\.json")
PART = re.compile(r"part-\d{10}-[0-9a-f]{8}\.parquet")


@dataclass
class Manifest:
    generation: int = 0
    sequence: int = 0
    files: list[dict[str, Any]] = field(default_factory=list)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    cursors: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "generation": self.generation,
            "sequence": self.sequence,
            "committed_at": datetime.now(UTC).isoformat(),
            "files": self.files,
            "runs": self.runs,
            "cursors": self.cursors,
        }

    def cursor_of(self, binding_id: Any) -> CommittedCursor:
        row = self.cursors.get(str(binding_id))
        if row is None:
            return CommittedCursor(_uuid(binding_id), None, None, 0)
        return CommittedCursor(
            _uuid(binding_id),
            tuple(row["columns"]) if row.get("columns") is not None else None,
            list(row["cursor"]) if row.get("cursor") is not None else None,
            int(row.get("version", 0)),
            _uuid(row["run_id"]) if row.get("run_id") else None,
            _uuid(row["attempt_id"]) if row.get("attempt_id") else None,
            row.get("committed_at"),
        )


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def state_dir(directory: str) -> str:
    return os.path.join(directory, STATE_DIR)


def tmp_dir(directory: str) -> str:
    return os.path.join(directory, STATE_DIR, TMP_DIR)


def manifest_path(directory: str, generation: int) -> str:
    return os.path.join(state_dir(directory), f"manifest-{generation:010d}.json")


def generations(directory: str) -> list[int]:
    try:
        names = os.listdir(state_dir(directory))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _MANIFEST.fullmatch(n)))


def has_manifest(directory: str) -> bool:
    return bool(generations(directory))


def read(directory: str, name: str) -> Manifest:
    """The current manifest of the dataset (generation 0, empty, when there is none)."""
    found = generations(directory)
    if not found:
        return Manifest()
    path = manifest_path(directory, found[-1])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        # A commit replaced it and deleted an old generation meanwhile: read again.
        return read(directory, name) if generations(directory) != found else Manifest()
    except OSError as exc:
        raise PermanentError(f"cannot read the manifest of {name!r}: {exc.strerror}") from None
    with open(fd, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise PermanentError(
            f"the manifest of {name!r} is larger than {MAX_MANIFEST_BYTES} bytes; start a new "
            "dataset directory (or replace this one)"
        )
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise PermanentError(f"the manifest of {name!r} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PermanentError(f"the manifest of {name!r} is not a dispatch manifest (format 1)")
    try:
        return Manifest(
            int(doc["generation"]),
            int(doc["sequence"]),
            list(doc["files"]),
            dict(doc["runs"]),
            dict(doc["cursors"]),
        )
    except (KeyError, TypeError, ValueError):
        raise PermanentError(f"the manifest of {name!r} is not a dispatch manifest") from None


def locked(directory: str, name: str) -> contextlib.AbstractContextManager[None]:
    """The dataset's commit lock (files.commit_lock: a bounded wait)."""
    os.makedirs(tmp_dir(directory), exist_ok=True)
    path = os.path.join(state_dir(directory), "lock")
    return files.commit_lock(path, f"the lock of {name!r}", name)


def _publish(directory: str, manifest: Manifest) -> None:
    """Write `manifest` as its generation's file: the commit point."""
    data = json.dumps(manifest.as_json(), separators=(",", ":")).encode("utf-8")
    files.replace_atomically(
        manifest_path(directory, manifest.generation), data, prefix=".manifest-", suffix=".tmp"
    )


def settle(directory: str, manifest: Manifest) -> None:
    """Make the directory what `manifest` says (under the lock): listed files renamed from
    their staged names if a writer died before it did so, unlisted `part-*` files (a
    superseded generation's) deleted, and old generations beyond those kept removed."""
    listed = {f["path"] for f in manifest.files}
    for entry in manifest.files:
        final = os.path.join(directory, entry["path"])
        staged = os.path.join(directory, entry["staged"])
        if not os.path.lexists(final) and os.path.lexists(staged):
            os.replace(staged, final)
    for name in os.listdir(directory):
        if PART.fullmatch(name) and name not in listed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
    files.fsync_dir(directory)
    for generation in generations(directory)[:-KEEP_GENERATIONS]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(manifest_path(directory, generation))


@dataclass
class Commit:
    """What one attempt commits to the dataset."""

    staged: str | None  # the temporary file (relative to the directory), None: no file
    rows: int
    replace: bool
    run_id: Any
    attempt_id: Any
    token: int
    binding_id: Any = None
    read_version: int | None = None  # the cursor version the attempt started from
    columns: tuple[str, ...] | None = None
    cursor: list[str] | None = None


@dataclass
class Committed:
    already_committed: bool = False
    path: str | None = None
    cursor: CommittedCursor | None = None


def commit(directory: str, name: str, c: Commit, check: Callable[[], None]) -> Committed:
    """Publish an attempt's file (the module's protocol, steps 1-5)."""
    with locked(directory, name):
        current = read(directory, name)
        settle(directory, current)
        run = current.runs.get(str(c.run_id))
        if run is not None:
            if int(run["token"]) > c.token:
                raise FenceRejected(
                    f"{name!r}: run {c.run_id} was committed by a newer attempt (token "
                    f"{run['token']} > {c.token})"
                )
            return Committed(already_committed=True)
        if c.binding_id is not None:
            held = current.cursor_of(c.binding_id)
            if c.read_version is not None and held.version != c.read_version:
                raise TransientError(
                    "the binding's committed cursor moved while this attempt ran (a "
                    "concurrent run or an operator's reset); the retry starts from the new cursor"
                )
        # The last moment before the commit point: an attempt that is no longer this
        # worker's (or that missed heartbeats for longer than its lease) stops here.
        check()
        new = Manifest(
            current.generation + 1,
            current.sequence,
            [] if c.replace else list(current.files),
            dict(current.runs),
            dict(current.cursors),
        )
        path = None
        if c.staged is not None:
            new.sequence += 1
            path = f"part-{new.sequence:010d}-{_uuid(c.attempt_id).hex[:8]}.parquet"
            new.files.append(
                {
                    "path": path,
                    "staged": c.staged,
                    "rows": c.rows,
                    "run_id": str(c.run_id),
                    "attempt_id": str(c.attempt_id),
                    "token": c.token,
                }
            )
        now = datetime.now(UTC).isoformat()
        new.runs[str(c.run_id)] = {
            "attempt_id": str(c.attempt_id),
            "token": c.token,
            "generation": new.generation,
            "rows": c.rows,
        }
        if len(new.runs) > MAX_RUNS:
            oldest = sorted(new.runs, key=lambda r: new.runs[r]["generation"])
            for r in oldest[: len(new.runs) - MAX_RUNS]:
                del new.runs[r]
        cursor = None
        if c.binding_id is not None and c.columns is not None:
            version = current.cursor_of(c.binding_id).version + 1
            new.cursors[str(c.binding_id)] = {
                "columns": list(c.columns),
                "cursor": c.cursor,
                "version": version,
                "run_id": str(c.run_id),
                "attempt_id": str(c.attempt_id),
                "committed_at": now,
            }
            cursor = new.cursor_of(c.binding_id)
        _publish(directory, new)
        settle(directory, new)
        return Committed(path=path, cursor=cursor)


def set_cursor(
    directory: str,
    name: str,
    binding_id: Any,
    columns: tuple[str, ...] | None,
    cursor: list[str] | None,
    *,
    after_version: int = 0,
) -> CommittedCursor:
    """An operator's reset (None) or set of a binding's cursor: a new generation with the
    same files, the cursor's version above both the manifest's and `after_version`."""
    with locked(directory, name):
        current = read(directory, name)
        settle(directory, current)
        held = current.cursor_of(binding_id)
        current.generation += 1
        current.cursors[str(binding_id)] = {
            "columns": list(columns) if columns is not None else None,
            "cursor": cursor,
            "version": max(held.version, after_version) + 1,
            "run_id": None,
            "attempt_id": None,
            "committed_at": datetime.now(UTC).isoformat(),
        }
        _publish(directory, current)
        return current.cursor_of(binding_id)


def committed_files(directory: str, name: str) -> list[tuple[str, int]]:
    """The files the current manifest lists (relative paths, in commit order), each with
    its row count, as readers should open them: the published name, or the staged one
    when the writer has not renamed it yet."""
    manifest = read(directory, name)
    out = []
    for entry in manifest.files:
        path = entry["path"]
        if not os.path.lexists(os.path.join(directory, path)):
            path = entry["staged"]
        out.append((path, int(entry.get("rows", 0))))
    return out
