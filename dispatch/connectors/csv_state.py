"""A CSV file's committed state: its committed size and each incremental binding's cursor.

An append to a CSV file cannot commit with a cursor the way a database transaction does,
so the file gets a state file beside it (`.NAME.dispatch-state.json`, replaced atomically
by rename) and a lock file (`.NAME.dispatch-lock`, never replaced: `flock` on a file that
is renamed over would let two writers hold "the" lock). A commit, under the lock:

1. reads the state; a binding's cursor version other than the one the attempt started
   from means another run (or an operator) moved it: the commit is refused (transient;
   the retry starts from the new cursor);
2. finds the file as the state says: its size is the committed size. A larger file with
   an *intent* recorded (step 3) is the tail of a writer that died between its append and
   step 5, which is cut off; any other difference is a change made outside dispatch, and
   nothing is written (permanent, until the cursor is reset or set again);
3. records the intent (the size before and after this append) in the state;
4. appends the spooled rows and fsyncs the file;
5. records the new size and cursor (and no intent) in the state: this rename is the
   commit point.

So the rows and the cursor commit together: a writer that dies before step 5 leaves rows
that the next commit cuts off, and the cursor where it was, so its successor reads those
rows again; one that dies after step 5 has committed both. A reader of the file that must
never see rows that may still be cut off reads up to the state's `size`.

The state is read up to `limits.MAX_CSV_STATE_BYTES`, and a commit that would write a
larger one is refused before it appends. A state that cannot be used (too large, not
JSON, not a state of this format) fails every commit to the file; an operator's reset
or set of a binding's cursor replaces it (`set_cursor`).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from datetime import UTC, datetime
from typing import Any

from dispatch.connectors import files
from dispatch.connectors.base import PermanentError, TransientError
from dispatch.connectors.incremental import CommittedCursor
from dispatch.security import limits

FORMAT = 1


def state_path(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.dispatch-state.json")


def lock_path(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.dispatch-lock")


class StateUnreadable(PermanentError):
    """The state file is there but cannot be used: larger than its reader takes, not
    JSON, or not a dispatch state. An operator's reset or set replaces it."""

    def __init__(self, what: str, problem: str) -> None:
        super().__init__(f"{what} {problem}; reset or set the binding's cursor")
        self.problem = problem


def read(path: str, name: str) -> dict[str, Any]:
    """The state of the file at `path` (empty when it has none); `name` is the spec's
    path, for messages. Raises StateUnreadable for a state that cannot be used."""
    what = f"the state file of {name!r}"
    try:
        fd = files.open_no_follow(state_path(path), os.O_RDONLY, what)
    except PermanentError:
        if not os.path.lexists(state_path(path)):
            return {}
        raise
    with open(fd, "rb") as handle:
        data = handle.read(limits.MAX_CSV_STATE_BYTES + 1)
    if len(data) > limits.MAX_CSV_STATE_BYTES:
        raise StateUnreadable(what, f"is more than {limits.MAX_CSV_STATE_BYTES} bytes")
    try:
        state = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise StateUnreadable(what, "is not valid JSON") from None
    problem = _shape_problem(state)
    if problem is not None:
        detail = "" if problem == "format" else f" (its {problem})"
        raise StateUnreadable(what, f"is not a dispatch state of format {FORMAT}{detail}")
    return state  # type: ignore[no-any-return]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _uuid_text(value: Any) -> bool:
    if value is None:
        return True
    try:
        uuid.UUID(value)
    except (TypeError, ValueError, AttributeError):
        return False
    return True


def _shape_problem(state: Any) -> str | None:
    """What makes `state` other than a state this module wrote (None: nothing): every
    field the commit and the cursor read is checked, so neither fails on a hand edit."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return "format"
    if "size" in state and not _count(state["size"]):
        return "size"
    intent = state.get("intent")
    if intent is not None and not (
        isinstance(intent, dict)
        and _count(intent.get("before"))
        and (intent.get("after") is None or _count(intent.get("after")))
    ):
        return "intent"
    cursors = state.get("cursors", {})
    if not isinstance(cursors, dict):
        return "cursors"
    for key, entry in cursors.items():
        if not (
            _uuid_text(key)
            and isinstance(entry, dict)
            and _strings(entry.get("columns", []))
            and (entry.get("cursor") is None or _strings(entry["cursor"]))
            and _count(entry.get("version", 0))
            and _uuid_text(entry.get("run_id"))
            and _uuid_text(entry.get("attempt_id"))
            and (entry.get("committed_at") is None or isinstance(entry["committed_at"], str))
        ):
            return "a binding's cursor"
    return None


def cursor_of(state: dict[str, Any], binding_id: uuid.UUID) -> CommittedCursor:
    entry = (state.get("cursors") or {}).get(str(binding_id))
    if not isinstance(entry, dict):
        return CommittedCursor(binding_id, None, None, 0)

    def as_uuid(value: Any) -> uuid.UUID | None:
        return uuid.UUID(value) if isinstance(value, str) else None

    columns = entry.get("columns")
    return CommittedCursor(
        binding_id,
        tuple(columns) if isinstance(columns, list) else None,
        entry.get("cursor"),
        int(entry.get("version", 0)),
        as_uuid(entry.get("run_id")),
        as_uuid(entry.get("attempt_id")),
        entry.get("committed_at"),
    )


def _encoded(state: dict[str, Any]) -> bytes:
    return json.dumps({**state, "format": FORMAT}, sort_keys=True).encode("utf-8")


def _fits(state: dict[str, Any], name: str) -> None:
    """Refuse a state its reader would refuse (larger than it takes), before writing it."""
    size = len(_encoded(state))
    if size > limits.MAX_CSV_STATE_BYTES:
        raise PermanentError(
            f"the state file of {name!r} would be {size} bytes, more than the "
            f"{limits.MAX_CSV_STATE_BYTES} its reader takes (too many bindings append to it)"
        )


def _write(path: str, state: dict[str, Any]) -> None:
    """Replace the state file atomically."""
    _fits(state, os.path.basename(path))
    files.replace_atomically(
        state_path(path), _encoded(state), prefix=f".{os.path.basename(path)}.", suffix=".st"
    )


def locked(path: str, name: str) -> contextlib.AbstractContextManager[None]:
    """The file's commit lock (files.commit_lock: a bounded wait)."""
    return files.commit_lock(lock_path(path), f"the lock file of {name!r}", name)


def _size(path: str) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0


def settle_file(path: str, name: str, state: dict[str, Any]) -> int:
    """Under the lock: the file's committed size, after cutting off the tail of a writer
    that died between its append and its commit. Refuses a file changed outside dispatch."""
    committed = int(state.get("size", 0))
    size = _size(path)
    intent = state.get("intent")
    if isinstance(intent, dict) and committed <= size <= int(intent.get("after", -1)):
        if size > committed:
            fd = files.open_no_follow(path, os.O_WRONLY, repr(name))
            try:
                os.ftruncate(fd, committed)
                os.fsync(fd)
            finally:
                os.close(fd)
        return committed
    if size != committed:
        raise PermanentError(
            f"{name!r} holds {size:,} bytes where its last commit left {committed:,}: it was "
            "changed outside dispatch, so nothing is appended (reset or set the binding's "
            "cursor to start again from the file as it is)"
        )
    return committed


def commit(
    path: str,
    name: str,
    *,
    append: Any,
    binding_id: uuid.UUID | None,
    read_version: int | None,
    columns: tuple[str, ...] | None,
    cursor: list[str] | None,
    run_id: Any,
    attempt_id: Any,
    check: Any,
) -> CommittedCursor | None:
    """Steps 1-5 of the module's doc. `append(expected_size)` appends the rows and
    returns the new size; `check()` is the attempt's fence check, made under the lock
    just before anything is written. Without a binding (`binding_id` None) the append
    only keeps the recorded size true."""
    with locked(path, name):
        state = read(path, name)
        state.setdefault("cursors", {})
        if binding_id is not None:
            current = cursor_of(state, binding_id)
            if current.version != read_version:
                raise TransientError(
                    "the binding's committed cursor moved while this attempt ran (a "
                    "concurrent run or an operator's reset); the retry starts from the new "
                    "cursor"
                )
        before = settle_file(path, name, state) if state else _size(path)
        entries: dict[str, Any] = {}  # this binding's entry, committed at step 5
        result = None
        if binding_id is not None:
            now = datetime.now(UTC).isoformat()
            version = (read_version or 0) + 1
            entries[str(binding_id)] = {
                "columns": list(columns or ()),
                "cursor": cursor,
                "version": version,
                "run_id": str(run_id) if run_id else None,
                "attempt_id": str(attempt_id) if attempt_id else None,
                "committed_at": now,
            }
            result = CommittedCursor(
                binding_id, tuple(columns or ()), cursor, version, run_id, attempt_id, now
            )
        # Before anything is written: neither the intent (step 3) nor the commit (step 5)
        # may make a state its reader refuses. Sizes at their widest bound both.
        widest = 2**63
        _fits(
            {
                **state,
                "cursors": {**state["cursors"], **entries},
                "size": widest,
                "intent": {"before": widest, "after": widest},
            },
            name,
        )
        check()
        state["size"] = before
        state["intent"] = {"before": before, "after": None}
        after = append(before, lambda total: _intend(path, state, before, total))
        state.pop("intent", None)
        state["size"] = after
        state["cursors"].update(entries)
        _write(path, state)
        return result


def _intend(path: str, state: dict[str, Any], before: int, after: int) -> None:
    """Step 3: the intent, recorded before the first byte is appended."""
    state["intent"] = {"before": before, "after": after}
    _write(path, state)


def set_cursor(
    path: str,
    name: str,
    binding_id: uuid.UUID,
    columns: tuple[str, ...],
    cursor: list[str] | None,
    *,
    after_version: int = 0,
) -> CommittedCursor:
    """An operator's reset (None) or set of the binding's cursor; the version moves above
    both the state's and `after_version` (the highest the caller has seen), and the file's
    size as it is now becomes the committed size.

    A state that cannot be read (StateUnreadable) is replaced by one holding this
    binding's cursor alone, under the same lock and by the same atomic rename: otherwise
    nothing could ever repair it but a hand edit. The other bindings' cursors in it are
    lost (their next runs start from their spec's start), which `replaced` says."""
    replaced = ""
    with locked(path, name):
        try:
            state = read(path, name)
        except StateUnreadable as exc:
            state = {}
            replaced = (
                f"the state file of {name!r} {exc.problem}: it was replaced; any other "
                "binding appending to the file starts again from its spec's start"
            )
        state.setdefault("cursors", {})
        version = max(cursor_of(state, binding_id).version, after_version) + 1
        now = datetime.now(UTC).isoformat()
        state["cursors"][str(binding_id)] = {
            "columns": list(columns),
            "cursor": cursor,
            "version": version,
            "run_id": None,
            "attempt_id": None,
            "committed_at": now,
        }
        state.pop("intent", None)
        state["size"] = _size(path)
        _write(path, state)
    return CommittedCursor(
        binding_id, tuple(columns), cursor, version, None, None, now, replaced=replaced
    )
