"""The plan: what applying definitions would change, checked before anything is written.

`plan(documents)` reads the database (no lock, no write): it checks the files' structure,
resolves references by name (to an object in the files, else to one in the database),
resolves secret references, validates every object with the console's own validators on
model instances that hold the desired state, and diffs it against the stored rows. It
records a fingerprint of every row it relied on (`Plan.seen`); `apply` refuses to write if
any of them changed meanwhile.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError

from dispatch import services
from dispatch.ascode.errors import DefinitionError, Problem, where
from dispatch.ascode.kinds import Definition, Kind, all_kinds, secret_keys, stored_config
from dispatch.ascode.loader import Document, dotted
from dispatch.models import MANAGED_BY_FILES, SECRET_MASK, BindingEdge
from dispatch.security import limits

FORMAT_VERSION = 1

CREATE = "create"
CHANGE = "change"
UNCHANGED = "unchanged"
DELETE = "delete"
KEEP = "keep"
ACTIONS = (CREATE, CHANGE, DELETE, KEEP, UNCHANGED)
_MARK = {CREATE: "+", CHANGE: "~", DELETE: "-", KEEP: "!", UNCHANGED: "="}


@dataclass(frozen=True)
class FieldChange:
    """One field's change, as display text (secrets are never in it)."""

    field: str
    old: str | None  # None: a new object's field
    new: str

    def __str__(self) -> str:
        return (
            f"{self.field}: {self.new}"
            if self.old is None
            else f"{self.field}: {self.old} → {self.new}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old, "new": self.new}


@dataclass
class Change:
    """What the plan does to one object."""

    kind: str  # the kind's key: "datasources"
    label: str  # "datasource"
    name: str
    action: str
    fields: list[FieldChange] = field(default_factory=list)
    file: str | None = None
    line: int | None = None
    reason: str = ""  # why a prune keeps the object
    permissions: frozenset[str] = frozenset()
    pk: Any = field(default=None, repr=False)
    definition: Definition | None = field(default=None, repr=False)

    def heading(self) -> str:
        at = f"  ({where(self.file, self.line)})" if self.file else ""
        return f"{_MARK[self.action]} {self.label} {self.name}: {self.action}{at}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "action": self.action,
            "fields": [c.as_dict() for c in self.fields],
            "file": self.file,
            "line": self.line,
            "reason": self.reason,
        }


@dataclass
class Plan:
    changes: list[Change]
    prune: bool
    # (kind key, pk) -> (name, fingerprint) of every stored row the plan relies on.
    seen: dict[tuple[str, Any], tuple[str, str]] = field(default_factory=dict, repr=False)
    # Managed objects the files no longer name (deleted only with prune).
    orphans: list[str] = field(default_factory=list)

    @property
    def has_changes(self) -> bool:
        return any(c.action in (CREATE, CHANGE, DELETE) for c in self.changes)

    def counts(self) -> dict[str, int]:
        return {a: sum(1 for c in self.changes if c.action == a) for a in ACTIONS}

    def permissions(self) -> set[str]:
        """Every Django permission applying this plan needs (as the console would ask)."""
        return {p for c in self.changes if c.action != UNCHANGED for p in c.permissions}

    def render(self) -> str:
        lines: list[str] = []
        for change in self.changes:
            lines.append(change.heading())
            lines.extend(f"    {f}" for f in change.fields)
            if change.reason:
                lines.append(f"    {change.reason}")
        if self.orphans and not self.prune:
            lines.append(
                f"Not in the files, managed by files (--prune deletes them): {', '.join(self.orphans)}"
            )
        n = self.counts()
        lines.append(
            f"Plan: {n[CREATE]} to create, {n[CHANGE]} to change, {n[DELETE]} to delete, "
            f"{n[UNCHANGED]} unchanged" + (f", {n[KEEP]} kept" if n[KEEP] else "") + "."
        )
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "changes": [c.as_dict() for c in self.changes],
            "counts": self.counts(),
            "orphans": list(self.orphans),
            "prune": self.prune,
        }


class _Problems:
    """Collects problems, each scrubbed of every secret value the plan resolved."""

    def __init__(self) -> None:
        self.items: list[Problem] = []
        self.secrets: set[str] = set()

    def add(self, source: str, line: int | None, path: Iterable[str | int], message: str) -> None:
        for value in sorted(self.secrets, key=len, reverse=True):
            message = message.replace(value, SECRET_MASK)
        self.items.append(Problem(source, line, dotted(path), message))

    def at(self, definition: Definition, path: tuple[str | int, ...], message: str) -> None:
        full = (*definition.path, *path)
        self.add(definition.source, definition.doc.line(full), full, message)

    def raise_if_any(self) -> None:
        if self.items:
            raise DefinitionError(list(self.items))


def plan(documents: list[Document], *, prune: bool = False) -> Plan:
    """What applying `documents` would do; raises `DefinitionError` with every problem
    found (file, line, path, message) when they are invalid. Reads only."""
    kinds = all_kinds()
    problems = _Problems()
    definitions = _collect(documents, kinds, problems)
    problems.raise_if_any()
    existing = {k.key: {row.name: row for row in k.rows()} for k in kinds}
    _check_references(kinds, definitions, existing, problems)
    _check_chains(definitions, existing, problems)
    problems.raise_if_any()
    for kind in kinds:
        for definition in definitions[kind.key].values():
            kind.prepare(definition, lambda path, msg, d=definition: problems.at(d, path, msg))
            if definition.secret_refs:
                config = definition.values["config"]
                problems.secrets.update(
                    str(config[k]) for k in definition.secret_refs if config.get(k)
                )
            _check_fixed(kind, definition, existing, problems)
    problems.raise_if_any()
    orphans = _orphans(kinds, definitions, existing)
    deleting, kept = _prune(kinds, definitions, existing, orphans) if prune else ({}, {})
    instances = _validate(kinds, definitions, existing, deleting, problems)
    problems.raise_if_any()

    result = Plan(
        changes=[],
        prune=prune,
        orphans=[f"{k.label} {row.name}" for k in kinds for row in orphans[k.key].values()],
    )
    for kind in kinds:
        for definition in definitions[kind.key].values():
            _add_defined(result, kinds, kind, definition, definitions, existing, instances)
    if prune:
        for kind in reversed(kinds):
            for row in orphans[kind.key].values():
                _add_orphan(result, kind, row, deleting, kept)
    return result


def _add_defined(
    result: Plan,
    kinds: list[Kind],
    kind: Kind,
    definition: Definition,
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
    instances: dict[tuple[str, str], Any],
) -> None:
    """The change of one object the files define, and the fingerprints of the stored rows
    it relies on (itself, and what it names that the files do not define)."""
    row = existing[kind.key].get(definition.name)
    if row is None:
        action, fields = CREATE, _created_fields(kind, definition)
    else:
        fields = _changed_fields(kind, row, definition)
        action = CHANGE if fields else UNCHANGED
        result.seen[(kind.key, row.pk)] = (row.name, kind.fingerprint(row))
    obj = instances[(kind.key, definition.name)]
    result.changes.append(
        Change(
            kind=kind.key,
            label=kind.label,
            name=definition.name,
            action=action,
            fields=fields,
            file=definition.source,
            line=definition.line,
            permissions=frozenset(
                kind.permissions(obj, row, action)
                | kind.field_permissions(definition, {c.field.split(".")[0] for c in fields})
                if action != UNCHANGED
                else ()
            ),
            pk=row.pk if row is not None else None,
            definition=definition,
        )
    )
    for f in kind.fields:
        target = definition.values[f.key] if f.ref else None
        if f.ref is None or target is None or target in definitions[f.ref]:
            continue
        ref_kind = next(k for k in kinds if k.key == f.ref)
        ref_row = existing[f.ref][target]
        result.seen[(f.ref, ref_row.pk)] = (ref_row.name, ref_kind.fingerprint(ref_row))


def _add_orphan(
    result: Plan,
    kind: Kind,
    row: Any,
    deleting: dict[str, set[Any]],
    kept: dict[tuple[str, Any], str],
) -> None:
    """What `--prune` does to a managed row the files no longer define."""
    if row.pk in deleting.get(kind.key, ()):
        result.seen[(kind.key, row.pk)] = (row.name, kind.fingerprint(row))
        result.changes.append(
            Change(
                kind=kind.key,
                label=kind.label,
                name=row.name,
                action=DELETE,
                permissions=frozenset(kind.permissions(row, row, DELETE)),
                pk=row.pk,
            )
        )
    elif (kind.key, row.pk) in kept:
        result.changes.append(
            Change(
                kind=kind.key,
                label=kind.label,
                name=row.name,
                action=KEEP,
                reason=f"not deleted: {kept[(kind.key, row.pk)]}",
                pk=row.pk,
            )
        )


# --- structure -----------------------------------------------------------------------------


def _collect(
    documents: list[Document], kinds: list[Kind], problems: _Problems
) -> dict[str, dict[str, Definition]]:
    by_key = {k.key: k for k in kinds}
    sections = ", ".join(by_key)
    definitions: dict[str, dict[str, Definition]] = {k.key: {} for k in kinds}
    count = 0
    for doc in documents:
        if doc.data is None:
            continue
        if not isinstance(doc.data, dict):
            problems.add(
                doc.source,
                doc.start_line,
                (),
                f"a definition file is a mapping with the sections {sections}",
            )
            continue
        for section_key, section in doc.data.items():
            if section_key == "version":
                if section != FORMAT_VERSION:
                    problems.add(
                        doc.source,
                        doc.line(("version",)),
                        ("version",),
                        f"must be {FORMAT_VERSION} (the only format version there is)",
                    )
                continue
            kind = by_key.get(section_key)
            if kind is None:
                hint = (
                    " (schedules need the scheduling app in INSTALLED_APPS)"
                    if section_key == "schedules"
                    else ""
                )
                problems.add(
                    doc.source,
                    doc.line((section_key,)),
                    (section_key,),
                    f"unknown section; the sections are version, {sections}{hint}",
                )
                continue
            if section is None:
                continue
            if not isinstance(section, dict):
                problems.add(
                    doc.source,
                    doc.line((section_key,)),
                    (section_key,),
                    f"must be a mapping of names to {kind.label}s",
                )
                continue
            for name, body in section.items():
                count += 1
                if count > limits.MAX_DEFINITION_OBJECTS:
                    problems.add(
                        doc.source,
                        doc.line((section_key, name)),
                        (section_key, name),
                        f"more than {limits.MAX_DEFINITION_OBJECTS:,} objects in one apply",
                    )
                    return definitions
                definition = _definition(kind, name, body, doc, problems)
                if definition is None:
                    continue
                first = definitions[kind.key].get(name)
                if first is not None:
                    problems.add(
                        doc.source,
                        definition.line,
                        definition.path,
                        f"the {kind.label} {name} is defined twice (first in "
                        f"{where(first.source, first.line)})",
                    )
                    continue
                definitions[kind.key][name] = definition
    return definitions


def _definition(
    kind: Kind, name: str, body: Any, doc: Document, problems: _Problems
) -> Definition | None:
    path = (kind.key, name)
    line = doc.line(path)
    if body is None:
        body = {}
    if not isinstance(body, dict):
        problems.add(doc.source, line, path, f"a {kind.label} is a mapping of its fields")
        return None
    allowed = [f.key for f in kind.fields]
    ok = True
    for key in body:
        if key not in allowed:
            problems.add(
                doc.source,
                doc.line((*path, key)),
                (*path, key),
                f"unknown field of a {kind.label}; the fields are {', '.join(allowed)}",
            )
            ok = False
    values: dict[str, Any] = {}
    for f in kind.fields:
        if f.key not in body:
            if f.required:
                problems.add(doc.source, line, (*path, f.key), "this field is required")
                ok = False
                continue
            values[f.key] = kind.default(f)
            continue
        error = f.type_error(body[f.key])
        if error:
            problems.add(doc.source, doc.line((*path, f.key)), (*path, f.key), error)
            ok = False
            continue
        values[f.key] = body[f.key]
    if not ok:
        return None
    return Definition(
        kind=kind,
        name=name,
        values=values,
        source=doc.source,
        line=line,
        path=path,
        doc=doc,
    )


def _check_references(
    kinds: list[Kind],
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
    problems: _Problems,
) -> None:
    for kind in kinds:
        for definition in definitions[kind.key].values():
            for f in kind.fields:
                if not f.ref:
                    continue
                target = definition.values[f.key]
                if f.ref not in definitions:
                    problems.at(definition, (f.key,), f"no kind {f.ref} is installed")
                elif target not in definitions[f.ref] and target not in existing[f.ref]:
                    label = f.ref.rstrip("s")
                    problems.at(
                        definition,
                        (f.key,),
                        f"no {label} named {target!r} in the files or the database",
                    )


def _check_chains(
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
    problems: _Problems,
) -> None:
    """A binding's `after` names bindings (in the files or the database), not itself, and
    the edges the apply leaves form no cycle (the bindings the files define with theirs,
    the others with their stored edges)."""
    defined = definitions.get("bindings", {})
    known = set(defined) | set(existing.get("bindings", {}))
    edges: list[tuple[str, str]] = [
        (up, down)
        for up, down in BindingEdge.objects.values_list("upstream__name", "downstream__name")
        if down not in defined
    ]
    for name, definition in defined.items():
        for i, up in enumerate(definition.values.get("after") or []):
            if not isinstance(up, str):
                problems.at(definition, ("after", i), "must be the name of a binding")
            elif up == name:
                problems.at(definition, ("after", i), "a binding cannot wait for itself")
            elif up not in known:
                problems.at(
                    definition,
                    ("after", i),
                    f"no binding named {up!r} in the files or the database",
                )
            else:
                edges.append((up, name))
    cycle = services.chain_cycle(edges)
    if cycle is not None:
        # The first binding of the cycle the files define (the path is closed: its last
        # name is its first).
        first = next((defined[n] for n in cycle if n in defined), None)
        text = " -> ".join(cycle)
        if first is not None:
            problems.at(first, ("after",), f"these bindings would wait for each other: {text}")


def _check_fixed(
    kind: Kind,
    definition: Definition,
    existing: dict[str, dict[str, Any]],
    problems: _Problems,
) -> None:
    row = existing[kind.key].get(definition.name)
    if row is None:
        return
    for key in kind.fixed:
        stored = getattr(row, key)
        if stored != definition.values[key]:
            problems.at(
                definition,
                (key,),
                f"cannot change from {stored!r} to {definition.values[key]!r} (the "
                f"{kind.label}'s bindings were checked against it); define a new "
                f"{kind.label} under another name instead",
            )


# --- validation ----------------------------------------------------------------------------


def _validate(
    kinds: list[Kind],
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
    deleting: dict[str, set[Any]],
    problems: _Problems,
) -> dict[tuple[str, str], Any]:
    """Model instances holding the desired state, each validated as the console would;
    returns them by (kind key, name). Nothing is saved."""
    instances: dict[tuple[str, str], Any] = {}
    for kind in kinds:
        defined = definitions[kind.key]
        # Fresh copies of the stored rows: the validation puts the desired values on them.
        pks = [existing[kind.key][n].pk for n in defined if n in existing[kind.key]]
        copies = {obj.pk: obj for obj in kind.model._default_manager.filter(pk__in=pks)}
        for name, definition in defined.items():
            row = existing[kind.key].get(name)
            obj = copies[row.pk] if row is not None else kind.model()
            refs: dict[str, Any] = {}
            exclude: list[str] = []
            for f in kind.fields:
                if f.ref:
                    target = definition.values[f.key]
                    refs[f.key] = instances.get((f.ref, target)) or existing[f.ref][target]
                    if refs[f.key]._state.adding:
                        exclude.append(f.key)
            kind.assign(obj, definition, refs)
            try:
                kind.validate(obj, exclude=exclude)
            except ValidationError as exc:
                _report(kind, definition, exc, problems)
            instances[(kind.key, name)] = obj
    _check_stored_bindings(definitions, existing, instances, deleting, problems)
    return instances


def _check_stored_bindings(
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
    instances: dict[tuple[str, str], Any],
    deleting: dict[str, set[Any]],
    problems: _Problems,
) -> None:
    """Bindings the files do not define but the apply leaves, checked against the jobs
    the files change (what `Job.clean` checks in the console)."""
    for name, definition in definitions.get("jobs", {}).items():
        row = existing["jobs"].get(name)
        if row is None:
            continue
        job = instances[("jobs", name)]
        for binding in existing["bindings"].values():
            if (
                binding.job_id != row.pk
                or binding.name in definitions.get("bindings", {})
                or binding.pk in deleting.get("bindings", ())
            ):
                continue
            try:
                binding.validate_specs(job=job)
            except ValidationError as exc:
                for message in exc.messages:
                    problems.at(
                        definition,
                        (),
                        f"binding {binding.name} (not in these files) uses this job: {message}",
                    )


def _report(kind: Kind, definition: Definition, exc: ValidationError, problems: _Problems) -> None:
    if not hasattr(exc, "error_dict"):
        for message in exc.messages:
            problems.at(definition, (), message)
        return
    config = definition.values.get("config") if kind.key == "datasources" else None
    for key, errors in exc.error_dict.items():
        if key in ("name", NON_FIELD_ERRORS):
            path: tuple[str, ...] = ()
        elif kind.field(key) is not None:
            path = (key,)
        elif isinstance(config, dict):
            # A connector's config validation names config keys ("password", "host").
            path = ("config", key)
        else:
            path = ()
        for error in errors:
            for message in error.messages:
                prefix = "" if path or key == NON_FIELD_ERRORS else f"{key}: "
                problems.at(definition, path, prefix + message)


# --- prune ---------------------------------------------------------------------------------


def _orphans(
    kinds: list[Kind],
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
) -> dict[str, dict[Any, Any]]:
    """Rows files manage that the files no longer name, by kind key and pk."""
    return {
        k.key: {
            row.pk: row
            for name, row in existing[k.key].items()
            if row.managed_by == MANAGED_BY_FILES and name not in definitions[k.key]
        }
        for k in kinds
    }


def _prune(
    kinds: list[Kind],
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
    candidates: dict[str, dict[Any, Any]],
) -> tuple[dict[str, set[Any]], dict[tuple[str, Any], str]]:
    """Of the orphans, those `--prune` deletes, and those it must keep with the reason
    (live runs, history, or an object that stays refers to them)."""
    deleting = {key: set(rows) for key, rows in candidates.items()}
    kept: dict[tuple[str, Any], str] = {}
    changed = True
    while changed:
        changed = False
        for kind in reversed(kinds):
            for pk in sorted(deleting[kind.key], key=str):
                row = candidates[kind.key][pk]
                reason = kind.keep_reason(row, deleting) or _referrer(
                    kinds, kind, row, definitions, existing, deleting
                )
                if reason:
                    deleting[kind.key].discard(pk)
                    kept[(kind.key, pk)] = reason
                    changed = True
    return deleting, kept


def _referrer(
    kinds: list[Kind],
    kind: Kind,
    row: Any,
    definitions: dict[str, dict[str, Definition]],
    existing: dict[str, dict[str, Any]],
    deleting: dict[str, set[Any]],
) -> str | None:
    """An object that stays and refers to `row`, as a reason to keep it."""
    for other in kinds:
        for f in other.fields:
            if f.ref != kind.key:
                continue
            for name, definition in definitions[other.key].items():
                if definition.values[f.key] == row.name:
                    return f"{other.label} {name} (in the files) uses it as {f.key}"
            for name, ref_row in existing[other.key].items():
                if (
                    name not in definitions[other.key]
                    and ref_row.pk not in deleting[other.key]
                    and getattr(ref_row, f"{f.key}_id") == row.pk
                ):
                    how = (
                        "kept" if ref_row.managed_by == MANAGED_BY_FILES else "made in the console"
                    )
                    return f"{other.label} {name} ({how}) uses it as {f.key}"
    return None


# --- diff ----------------------------------------------------------------------------------


def show(value: Any) -> str:
    """A value as one line of JSON (text quoted, so "10" and 10 differ)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def _created_fields(kind: Kind, definition: Definition) -> list[FieldChange]:
    out: list[FieldChange] = []
    for f in kind.fields:
        value = definition.values[f.key]
        if kind.key == "datasources" and f.key == "config":
            refs = definition.secret_refs or {}
            for key, item in value.items():
                text = f"(from {refs[key]})" if key in refs else show(item)
                out.append(FieldChange(f"config.{key}", None, text))
            continue
        out.append(FieldChange(f.key, None, show(value)))
    return out


def _changed_fields(kind: Kind, row: Any, definition: Definition) -> list[FieldChange]:
    stored = kind.stored(row)
    out: list[FieldChange] = []
    for f in kind.fields:
        old, new = stored[f.key], definition.values[f.key]
        if kind.key == "datasources" and f.key == "config":
            out.extend(_config_changes(row, definition))
        elif isinstance(old, dict) and isinstance(new, dict):
            for key in [*old, *(k for k in new if k not in old)]:
                if old.get(key, _MISSING) != new.get(key, _MISSING):
                    before, after = old.get(key, _MISSING), new.get(key, _MISSING)
                    out.append(FieldChange(f"{f.key}.{key}", _shown(before), _shown(after)))
        elif old != new:  # 10 == 10.0: a number written either way is no change
            out.append(FieldChange(f.key, show(old), show(new)))
    if row.managed_by != MANAGED_BY_FILES:
        out.append(FieldChange("managed by", "console", "files"))
    return out


class _Missing:
    pass


_MISSING = _Missing()


def _shown(value: Any) -> str:
    return "(absent)" if value is _MISSING else show(value)


def _config_changes(row: Any, definition: Definition) -> list[FieldChange]:
    """Config keys, field by field; a secret shows where it comes from, never its value."""
    stored = stored_config(row)
    desired: dict[str, Any] = definition.values["config"]
    new_refs = definition.secret_refs or {}
    old_refs: dict[str, str] = row.secret_refs or {}
    if stored is None:
        return [
            FieldChange(
                f"config.{key}",
                "(stored settings cannot be decrypted)",
                f"(from {new_refs[key]})" if key in new_refs else show(value),
            )
            for key, value in desired.items()
        ]
    keys = [*stored, *(k for k in desired if k not in stored)]
    secret = secret_keys(row.kind, frozenset(keys)) | set(new_refs) | set(old_refs)
    out: list[FieldChange] = []
    for key in keys:
        old, new = stored.get(key, _MISSING), desired.get(key, _MISSING)
        old_ref, new_ref = old_refs.get(key), new_refs.get(key)
        if old == new and old_ref == new_ref:
            continue
        name = f"config.{key}"
        if key not in secret:
            out.append(FieldChange(name, _shown(old), _shown(new)))
            continue
        before = f"(from {old_ref})" if old_ref else "(entered in the console)"
        if old is _MISSING or old in (None, ""):
            before = "(not set)"
        if new is _MISSING or new in (None, ""):
            out.append(FieldChange(name, before, "(removed)"))
        elif old_ref == new_ref:
            out.append(FieldChange(name, before, f"secret changed (from {new_ref})"))
        elif old == new:
            out.append(FieldChange(name, before, f"(from {new_ref}, the same value)"))
        else:
            out.append(FieldChange(name, before, f"secret changed (from {new_ref})"))
    return out
