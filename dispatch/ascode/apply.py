"""Apply a plan: every change in one transaction, or none.

Transaction contract: one transaction. It first locks every stored row the plan relied on
(`Plan.seen`), kind by kind in the order schedules, bindings, jobs, datasources (the
claim's and the reconciler's order), each kind in ascending id: `FOR UPDATE` for rows it
deletes and for datasources (whose `save()` takes that lock), `FOR NO KEY UPDATE`
otherwise, as a console save does. Under those locks it compares each row's fingerprint
with the one the plan recorded; a row that changed or went since the plan (a console edit,
an enable/disable action, an auto-disable, another apply) raises `Conflict` naming it and
rolls everything back. Then it creates and changes objects through their models' own
`save()` (encryption, version bumps, schedule registration), and deletes what the plan
prunes after checking again, under the lock, that it has no live run. A name taken by an
object created meanwhile is a `Conflict` too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction

from dispatch.ascode.errors import Conflict
from dispatch.ascode.kinds import Kind, all_kinds
from dispatch.ascode.plan import CHANGE, CREATE, DELETE, KEEP, UNCHANGED, Change, Plan

log = logging.getLogger("dispatch.ascode")


@dataclass
class Result:
    created: int = 0
    changed: int = 0
    deleted: int = 0
    unchanged: int = 0
    kept: int = 0

    def summary(self) -> str:
        kept = f", {self.kept} kept" if self.kept else ""
        return (
            f"Applied: {self.created} created, {self.changed} changed, {self.deleted} deleted, "
            f"{self.unchanged} unchanged{kept}."
        )


def apply(plan: Plan) -> Result:
    """Write `plan` (see the module docstring for the transaction and lock contract).
    Raises `Conflict` when the database changed since the plan; nothing is written then."""
    result = Result(
        unchanged=sum(1 for c in plan.changes if c.action == UNCHANGED),
        kept=sum(1 for c in plan.changes if c.action == KEEP),
    )
    if not plan.has_changes:
        return result  # nothing to write: not even a lock is taken
    kinds = {k.key: k for k in all_kinds()}
    order = sorted(kinds.values(), key=lambda k: k.order)
    with transaction.atomic():
        locked = _lock(plan, kinds)
        written: dict[tuple[str, str], Any] = {}
        for kind in order:
            for change in plan.changes:
                if change.kind == kind.key and change.action in (CREATE, CHANGE):
                    written[(kind.key, change.name)] = _write(kind, change, locked, written)
                    if change.action == CREATE:
                        result.created += 1
                    else:
                        result.changed += 1
        for kind in order:
            for change in plan.changes:
                if change.kind == kind.key and change.action in (CREATE, CHANGE):
                    assert change.definition is not None
                    kind.write_after(written[(kind.key, change.name)], change.definition)
        deleting = {
            key: {c.pk for c in plan.changes if c.kind == key and c.action == DELETE}
            for key in kinds
        }
        for kind in reversed(order):
            for change in plan.changes:
                if change.kind != kind.key or change.action != DELETE:
                    continue
                obj = locked[(kind.key, change.pk)]
                reason = kind.keep_reason(obj, deleting)
                if reason:
                    raise Conflict(kind.label, change.name, f"can no longer be deleted ({reason})")
                kind.delete(obj)
                result.deleted += 1
    # After the commit: one line per object written, names and actions only.
    for change in plan.changes:
        if change.action in (CREATE, CHANGE, DELETE):
            log.info("definition applied: %s %s %r", change.action, change.label, change.name)
    return result


def _lock(plan: Plan, kinds: dict[str, Kind]) -> dict[tuple[str, Any], Any]:
    """Lock and re-check every row the plan saw; returns them by (kind key, pk)."""
    deleting = {(c.kind, c.pk) for c in plan.changes if c.action == DELETE}
    locked: dict[tuple[str, Any], Any] = {}
    for kind in sorted(kinds.values(), key=lambda k: k.order, reverse=True):
        seen = {pk: v for (key, pk), v in plan.seen.items() if key == kind.key}
        if not seen:
            continue
        strong = [pk for pk in seen if kind.strong_lock or (kind.key, pk) in deleting]
        weak = [pk for pk in seen if pk not in strong]
        manager = kind.model._default_manager
        for pks, no_key in ((strong, False), (weak, True)):
            if not pks:
                continue
            rows = manager.select_for_update(no_key=no_key).filter(pk__in=pks).order_by("pk")
            for obj in rows:
                locked[(kind.key, obj.pk)] = obj
        for pk, (name, fingerprint) in seen.items():
            row = locked.get((kind.key, pk))
            if row is None:
                raise Conflict(kind.label, name, "was deleted")
            if row.name != name:
                raise Conflict(kind.label, name, f"was renamed to {row.name!r}")
            if kind.fingerprint(row) != fingerprint:
                raise Conflict(kind.label, name, "was changed")
    return locked


def _write(
    kind: Kind,
    change: Change,
    locked: dict[tuple[str, Any], Any],
    written: dict[tuple[str, str], Any],
) -> Any:
    definition = change.definition
    assert definition is not None
    obj = kind.model() if change.action == CREATE else locked[(kind.key, change.pk)]
    refs: dict[str, Any] = {}
    for f in kind.fields:
        if not f.ref:
            continue
        target = definition.values[f.key]
        found: Any = written.get((f.ref, target)) or next(
            (row for (key, _), row in locked.items() if key == f.ref and row.name == target),
            None,
        )
        if found is None:  # the plan saw every object it refers to: a bug, not a race
            raise Conflict(f.ref.rstrip("s"), target, "is not among the objects the plan saw")
        refs[f.key] = found
    kind.assign(obj, definition, refs)
    try:
        # A savepoint: a unique violation is reported as the conflict it is, not as a
        # broken transaction.
        with transaction.atomic():
            kind.save(obj)
    except IntegrityError:
        if change.action == CREATE:
            raise Conflict(kind.label, change.name, "was created by someone else") from None
        raise
    return obj
