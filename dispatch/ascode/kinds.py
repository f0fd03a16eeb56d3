"""The kinds of object definition files hold, each keyed by its stable name: what fields it
has, how a model instance takes them, how it is checked, saved, deleted and exported.

dispatch defines `datasources`, `jobs` and `bindings`. Another app adds its own kind by
naming a `Kind` subclass in its AppConfig's `ascode_kinds` (the scheduling app adds
`schedules`), so dispatch never imports it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from django.apps import apps
from django.core.exceptions import ValidationError
from django.db import models
from django.utils.module_loading import import_string

from dispatch import services
from dispatch.ascode.loader import Document
from dispatch.connectors import registry
from dispatch.core import conf
from dispatch.core.states import LIVE_STATUSES, ChainOn
from dispatch.models import MANAGED_BY_FILES, BindingEdge, Datasource, Job, JobBinding, redact
from dispatch.security import crypto, secretrefs, sqlperm

_TYPE_WORDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "text",
    dict: "a mapping",
    list: "a list",
}


@dataclass(frozen=True)
class Field:
    """One field of a kind: its key in the file and on the model, the types it accepts, and
    whether it names an object of another kind (`ref`: that kind's key)."""

    key: str
    types: tuple[type, ...]
    required: bool = False
    nullable: bool = False
    ref: str | None = None
    choices: tuple[str, ...] = ()
    # The value when the file leaves the field out; None: the model field's default.
    default: Callable[[], Any] | None = None

    def type_error(self, value: Any) -> str | None:
        """Why `value` does not fit this field, or None."""
        if value is None:
            return None if self.nullable else f"must be {self.describe()}, not null"
        if isinstance(value, bool) and bool not in self.types:
            return f"must be {self.describe()}, not {str(value).lower()}"
        if not isinstance(value, self.types):
            return f"must be {self.describe()}"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        return None

    def describe(self) -> str:
        if self.ref:
            return f"the name of a {self.ref.rstrip('s')}"
        words = [_TYPE_WORDS[t] for t in self.types if not (t is int and float in self.types)]
        return " or ".join(words) + (" or null" if self.nullable else "")


@dataclass
class Definition:
    """One object as the files define it: `values` holds every field (defaults filled in;
    a datasource's resolved secrets too, which is why it is never printed)."""

    kind: Kind
    name: str
    values: dict[str, Any]
    source: str
    line: int | None
    path: tuple[str, ...]
    doc: Document
    # A datasource's secret references by config key ("env:NAME"): stored, never values.
    secret_refs: dict[str, str] | None = None

    def __repr__(self) -> str:
        return f"<Definition {self.kind.label} {self.name!r}>"


class Kind:
    """How one model is defined by files. Subclasses set the class attributes and
    override the hooks where the model needs more than field assignment."""

    key: ClassVar[str]
    label: ClassVar[str]
    model: ClassVar[type[models.Model]]
    fields: ClassVar[tuple[Field, ...]]
    # Created and changed in ascending order (what is referred to first), deleted and
    # locked in descending order: schedules, bindings, jobs, datasources, which is the
    # order the claim (binding, then datasources) and the reconciler (schedule, then a run
    # of its binding) take their locks in.
    order: ClassVar[int]
    # Fields an existing object keeps (a change is refused, naming the field).
    fixed: ClassVar[tuple[str, ...]] = ()
    # Lock rows FOR UPDATE rather than FOR NO KEY UPDATE (the model's save() takes it).
    strong_lock: ClassVar[bool] = False

    def field(self, key: str) -> Field | None:
        return next((f for f in self.fields if f.key == key), None)

    def default(self, f: Field) -> Any:
        if f.default is not None:
            return f.default()
        model_field: Any = self.model._meta.get_field(f.key)
        return model_field.get_default()

    def rows(self) -> models.QuerySet[Any]:
        related = [f.key for f in self.fields if f.ref]
        return self.model._default_manager.select_related(*related).order_by("name")

    def prepare(self, definition: Definition, problem: Any) -> None:
        """Normalise `definition.values` before validation (the datasource kind resolves
        secret references here); report with `problem(field_path, message)`."""

    def stored(self, obj: Any) -> dict[str, Any]:
        """The object's current values by field key (references as names)."""
        out = {}
        for f in self.fields:
            value = getattr(obj, f.key)
            out[f.key] = value.name if f.ref and value is not None else value
        return out

    def fingerprint_values(self, obj: Any) -> dict[str, Any]:
        """What a concurrent edit would change: every field a file defines, by the stored
        column (references by id), the name and the managed marker."""
        values = {"name": obj.name, "managed_by": obj.managed_by}
        for f in self.fields:
            values[f.key] = getattr(obj, f"{f.key}_id") if f.ref else getattr(obj, f.key)
        return values

    def fingerprint(self, obj: Any) -> str:
        text = json.dumps(self.fingerprint_values(obj), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def assign(self, obj: Any, definition: Definition, refs: Mapping[str, Any]) -> None:
        """Put the definition's values on `obj` (refs: field key -> the named instance)."""
        obj.name = definition.name
        for f in self.fields:
            setattr(obj, f.key, refs[f.key] if f.ref else definition.values[f.key])
        obj.managed_by = MANAGED_BY_FILES

    def validate(self, obj: Any, *, exclude: list[str]) -> None:
        """The console's validation (raises ValidationError keyed by field). `exclude`
        names reference fields whose object this apply creates (not in the database yet:
        the apply checks those references itself)."""
        obj.full_clean(exclude=exclude)

    def save(self, obj: Any) -> None:
        obj.save()

    def keep_reason(self, obj: Any, deleting: Mapping[str, set[Any]]) -> str | None:
        """Why `--prune` must keep `obj` even though the files no longer name it (other
        than another object that stays referring to it, which the plan checks), or None."""
        return None

    def delete(self, obj: Any) -> None:
        obj.delete()

    def write_after(self, obj: Any, definition: Definition) -> None:
        """What the object needs once every object of the apply is written (a binding's
        edges name other bindings)."""

    def export(self, obj: Any, notes: list[str]) -> dict[str, Any]:
        return dict(self.stored(obj))

    def field_permissions(self, definition: Definition, changed: set[str]) -> set[str]:
        """The permissions writing these fields of `definition` needs beyond writing the
        object."""
        return set()

    def permissions(self, obj: Any, stored: Any | None, action: str) -> set[str]:
        """The Django permissions writing `obj` needs (`stored`: the row before, None for a
        new object), as the console asks for them."""
        meta = self.model._meta
        verb = {"create": "add", "change": "change", "delete": "delete"}[action]
        return {f"{meta.app_label}.{verb}_{meta.model_name}"}


# --- datasources -------------------------------------------------------------------------


def secret_keys(kind: str, keys: set[str] | frozenset[str]) -> set[str]:
    """The config keys whose values are secrets: every key the console never shows
    (`redact` masks it: declared secret, unknown to the connector, or named like a secret)."""
    try:
        connector = registry.get(kind)
        public = frozenset(f.name for f in connector.config_fields if not f.secret)
    except registry.UnknownKind:
        public = frozenset()
    shown = redact(dict.fromkeys(keys, "x"), public)
    return {k for k in keys if shown[k] != "x"}


_ENV_PART = re.compile(r"[^A-Za-z0-9]+")


def placeholder_env(datasource: str, key: str) -> str:
    """`env:DISPATCH_SECRET_<DATASOURCE>_<FIELD>`: the reference an export writes for a
    secret that came from the console (it names no variable yet: set it before applying)."""
    parts = [_ENV_PART.sub("_", p).strip("_").upper() or "X" for p in (datasource, key)]
    return f"env:{conf.apply_env_prefix()}{parts[0]}_{parts[1]}"


class DatasourceKind(Kind):
    key = "datasources"
    label = "datasource"
    model = Datasource
    order = 10
    fixed = ("kind",)
    strong_lock = True  # Datasource.save() locks its row FOR UPDATE
    fields = (
        Field("kind", (str,), required=True),
        Field("enabled", (bool,)),
        Field("config", (dict,), default=dict),
    )

    def prepare(self, definition: Definition, problem: Any) -> None:
        """Resolve the secret references of the config; a secret given as a value is
        refused (it would sit in the file, in git, in the diff)."""
        config = definition.values["config"]
        kind = definition.values["kind"]
        try:
            registry.get(kind)
        except registry.UnknownKind as exc:
            # Which config keys are secrets depends on the kind: nothing to say of them.
            problem(("kind",), str(exc))
            return
        resolved: dict[str, Any] = {}
        refs: dict[str, str] = {}
        secret = secret_keys(kind, frozenset(config))
        for key, value in config.items():
            is_ref = secretrefs.looks_like_ref(value)
            if value in (None, "") or (key not in secret and not is_ref):
                resolved[key] = value
                continue
            try:
                ref = secretrefs.parse(value) if isinstance(value, str) else None
                if ref is None:
                    raise secretrefs.RefError(
                        "must be a reference, env:NAME or file:/path (a secret is never a value)"
                    )
                resolved[key] = secretrefs.resolve(ref)
            except secretrefs.RefError as exc:
                problem(("config", key), f"{key} is a secret: {exc}")
                continue
            refs[key] = str(ref)
        definition.values["config"] = resolved
        definition.secret_refs = refs

    def stored(self, obj: Any) -> dict[str, Any]:
        return {"kind": obj.kind, "enabled": obj.enabled, "config": stored_config(obj)}

    def fingerprint_values(self, obj: Any) -> dict[str, Any]:
        # The config by its version (bumped on every config change), not by its value:
        # the fingerprint never holds a secret, and a key rotation is no edit.
        return {
            "name": obj.name,
            "managed_by": obj.managed_by,
            "kind": obj.kind,
            "enabled": obj.enabled,
            "version": obj.version,
            "secret_refs": obj.secret_refs,
        }

    def assign(self, obj: Any, definition: Definition, refs: Mapping[str, Any]) -> None:
        obj.name = definition.name
        obj.kind = definition.values["kind"]
        obj.enabled = definition.values["enabled"]
        config = definition.values["config"]
        # Set only a different config: setting one marks it dirty, and a dirty config is
        # encrypted anew under the next version (which every claim snapshot would see).
        if obj._state.adding or stored_config(obj) != config:
            obj.config = config
        obj.secret_refs = dict(definition.secret_refs or {})
        obj.managed_by = MANAGED_BY_FILES

    def keep_reason(self, obj: Any, deleting: Mapping[str, set[Any]]) -> str | None:
        from dispatch.models import Attempt

        # Attempts keep the datasource they read or wrote (PROTECT): the history of a
        # binding that stays (or moved to another datasource) still names this one.
        gone = deleting.get("bindings", set())
        names = sorted(
            set(
                Attempt.objects.filter(models.Q(source=obj) | models.Q(sink=obj))
                .exclude(run__binding_id__in=gone)
                .values_list("run__binding__name", flat=True)
                .distinct()[:3]
            )
        )
        if names:
            return (
                f"the run history of binding(s) {', '.join(names)} refers to it "
                "(retention removes that history)"
            )
        return None

    def export(self, obj: Any, notes: list[str]) -> dict[str, Any]:
        try:
            config = obj.config
        except crypto.SnapshotUnreadable:
            notes.append(
                f"datasource {obj.name}: the stored settings cannot be decrypted (unknown "
                "key?); its config is exported from the redacted copy, every secret as a "
                "reference to set"
            )
            config = dict(obj.redacted_config or {})
        secret = secret_keys(obj.kind, frozenset(config))
        refs = obj.secret_refs or {}
        out: dict[str, Any] = {}
        for key, value in config.items():
            if key in refs:
                out[key] = refs[key]
            elif key not in secret or value in (None, ""):
                out[key] = value
            else:
                ref = placeholder_env(obj.name, key)
                notes.append(
                    f"datasource {obj.name}: {key} was entered in the console; set "
                    f"{ref.removeprefix('env:')} to it before applying this file"
                )
                out[key] = ref
        return {"kind": obj.kind, "enabled": obj.enabled, "config": out}

    def permissions(self, obj: Any, stored: Any | None, action: str) -> set[str]:
        needed = super().permissions(obj, stored, action)
        if stored is not None and action == "change":
            specs = JobBinding.objects.filter(source_id=stored.pk).values_list(
                "job__source_spec", flat=True
            )
            if sqlperm.datasource_needs(obj.config, stored_config(stored), specs):
                needed.add(sqlperm.QUERY_PERMISSION)
        return needed


def stored_config(obj: Any) -> dict[str, Any] | None:
    """The decrypted config, or None when the keys cannot open it."""
    try:
        return dict(obj.config)
    except crypto.SnapshotUnreadable:
        return None


# --- jobs and bindings -------------------------------------------------------------------


class JobKind(Kind):
    key = "jobs"
    label = "job"
    model = Job
    order = 20
    fields = (
        Field("description", (str,)),
        Field("enabled", (bool,)),
        Field("source_spec", (dict,)),
        Field("sink_spec", (dict,)),
        Field("max_attempts", (int,)),
        Field("backoff_seconds", (int, float)),
        Field("backoff_max_seconds", (int, float)),
        Field("lease_seconds", (int,)),
        Field("timeout_seconds", (int,), nullable=True),
        Field("max_slices_in_flight", (int,), nullable=True),
    )

    def validate(self, obj: Any, *, exclude: list[str]) -> None:
        # Job.full_clean() would also check the job's stored bindings against the stored
        # datasources; the plan checks the bindings the apply leaves instead (some of them
        # change with this apply).
        errors: dict[str, list[str]] = {}
        for step in (
            lambda: obj.clean_fields(exclude=exclude),
            obj.clean_values,
            lambda: obj.validate_unique(exclude=exclude),
            lambda: obj.validate_constraints(exclude=exclude),
        ):
            try:
                step()
            except ValidationError as exc:
                for key, messages in exc.message_dict.items():
                    errors.setdefault(key, []).extend(messages)
        if errors:
            raise ValidationError(errors)

    def permissions(self, obj: Any, stored: Any | None, action: str) -> set[str]:
        needed = super().permissions(obj, stored, action)
        if action != "delete" and sqlperm.job_needs(
            obj.source_spec, stored.source_spec if stored is not None else None
        ):
            needed.add(sqlperm.QUERY_PERMISSION)
        return needed


class BindingKind(Kind):
    key = "bindings"
    label = "binding"
    model = JobBinding
    order = 30
    fields = (
        Field("job", (str,), required=True, ref="jobs"),
        Field("source", (str,), required=True, ref="datasources"),
        Field("sink", (str,), required=True, ref="datasources"),
        Field("enabled", (bool,)),
        Field("max_concurrency", (int,)),
        # The bindings it waits for (names; its upstream edges) and when each fires it.
        Field("after", (list,), default=list),
        Field("on", (str,), choices=("success", "completion"), default=lambda: "success"),
    )
    # Not columns of the binding: its edges (BindingEdge), written once every binding of
    # the apply is saved (`write_after`).
    edge_fields: ClassVar[tuple[str, ...]] = ("after", "on")

    def stored(self, obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in self.fields:
            if f.key not in self.edge_fields:
                value = getattr(obj, f.key)
                out[f.key] = value.name if f.ref and value is not None else value
        return {**out, **self._edges(obj)}

    def fingerprint_values(self, obj: Any) -> dict[str, Any]:
        values = {"name": obj.name, "managed_by": obj.managed_by}
        for f in self.fields:
            if f.key not in self.edge_fields:
                values[f.key] = getattr(obj, f"{f.key}_id") if f.ref else getattr(obj, f.key)
        return {**values, **self._edges(obj)}

    @staticmethod
    def _edges(obj: Any) -> dict[str, Any]:
        if obj.pk is None or getattr(obj, "_state", None) is None or obj._state.adding:
            return {"after": [], "on": "success"}
        edges = list(
            BindingEdge.objects.filter(downstream_id=obj.pk)
            .select_related("upstream")
            .order_by("upstream__name")
        )
        on = edges[0].on.lower() if edges else "success"
        return {"after": [e.upstream.name for e in edges], "on": on}

    def assign(self, obj: Any, definition: Definition, refs: Mapping[str, Any]) -> None:
        obj.name = definition.name
        for f in self.fields:
            if f.key not in self.edge_fields:
                setattr(obj, f.key, refs[f.key] if f.ref else definition.values[f.key])
        obj.managed_by = MANAGED_BY_FILES

    def write_after(self, obj: Any, definition: Definition) -> None:
        """The binding's upstream edges, once every binding of the apply is saved."""
        names = list(definition.values["after"])
        ups = {b.name: b for b in JobBinding.objects.filter(name__in=names)}
        on = ChainOn(definition.values["on"].upper())
        services.set_upstreams(obj, [(ups[n], on) for n in names])

    def keep_reason(self, obj: Any, deleting: Mapping[str, set[Any]]) -> str | None:
        live = obj.runs.filter(status__in=LIVE_STATUSES).count()
        if live:
            return (
                f"it has {live} live run(s) (PENDING or RUNNING); prune again once they "
                "have finished"
            )
        return None

    def delete(self, obj: Any) -> None:
        # Runs keep their binding (PROTECT): the binding goes with its finished history
        # (runs, their attempts; its cursor copy, health and metrics cascade).
        obj.runs.all().delete()
        obj.delete()

    def field_permissions(self, definition: Definition, changed: set[str]) -> set[str]:
        # An edge starts this binding whenever its upstream ends: who draws one must be
        # allowed to trigger runs (as in the console's form). Removing every edge is not.
        drawn = bool(definition.values.get("after")) and bool(changed & set(self.edge_fields))
        return {"dispatch.trigger_binding"} if drawn else set()

    def permissions(self, obj: Any, stored: Any | None, action: str) -> set[str]:
        needed = super().permissions(obj, stored, action)
        if action != "delete":
            before = (
                {"job_id": stored.job_id, "source_id": stored.source_id}
                if stored is not None
                else None
            )
            if sqlperm.binding_needs(obj.job, obj.source_id, before):
                needed.add(sqlperm.QUERY_PERMISSION)
        return needed


BUILTIN: tuple[type[Kind], ...] = (DatasourceKind, JobKind, BindingKind)


def all_kinds() -> list[Kind]:
    """dispatch's kinds and those installed apps add (`AppConfig.ascode_kinds`: dotted
    paths of Kind subclasses), in creation order."""
    found: list[Kind] = [cls() for cls in BUILTIN]
    for config in apps.get_app_configs():
        for path in getattr(config, "ascode_kinds", ()):
            cls = import_string(path)
            found.append(cls())
    return sorted(found, key=lambda k: k.order)
