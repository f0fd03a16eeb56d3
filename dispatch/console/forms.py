"""The datasource form: one form field per connector config field, secrets masked.

Built from `registry.get(kind).config_fields`, so it works for any kind a site adds;
a kind that declares no fields gets a JSON editor instead. Secret fields are password
inputs that never render a value; left blank they keep the stored value. The form never
puts a decrypted secret into a page: non-secret initial values come from the row's
`redacted_config`, and the stored config is decrypted only on save, server-side.

The job form: its source and sink specs carry, as help, the fields each kind accepts,
from the connectors' declarations (the names their validators accept).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from django import forms
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from dispatch import services
from dispatch.connectors import registry
from dispatch.connectors.base import ConfigField, Connector
from dispatch.core.states import ChainOn
from dispatch.models import SECRET_MASK, BindingEdge, Datasource, Job, JobBinding
from dispatch.models.core import HASH_KEY_MIN_CHARS
from dispatch.security import crypto, jsondepth

PREFIX = "config__"
CLEAR_SUFFIX = "__clear"
JSON_FIELD = "config_json"


def kind_choices() -> list[tuple[str, str]]:
    return [("", "---------")] + [
        (kind, f"{kind} — {cls.label}" if cls.label else kind)
        for kind, cls in sorted(registry.kinds().items())
    ]


def connector_for(kind: str | None) -> type[Connector] | None:
    if not kind:
        return None
    try:
        return registry.get(kind)
    except registry.UnknownKind:
        return None


def config_field_names(kind: str | None, *, stored: dict[str, Any] | None = None) -> list[str]:
    """The form field names of a kind's settings, in declaration order."""
    connector = connector_for(kind)
    if connector is None:
        return []
    if not connector.config_fields:
        return [JSON_FIELD]
    names: list[str] = []
    for f in connector.config_fields:
        names.append(PREFIX + f.name)
        if f.secret and not f.required and stored and stored.get(f.name) not in (None, ""):
            names.append(PREFIX + f.name + CLEAR_SUFFIX)
    return names


def _form_field(f: ConfigField, *, stored: bool) -> forms.Field:
    help_text = f.help
    if f.secret:
        keep = (
            "A value is stored; leave blank to keep it. Changing where it is sent (host, "
            "port, user, ...) needs it again."
            if stored
            else ""
        )
        help_text = " ".join(x for x in (help_text, keep, "Never shown again after saving.") if x)
        # render_value=False: the stored secret never travels back to the browser, not
        # even after a failed submit.
        return forms.CharField(
            label=f.name,
            required=False,
            help_text=help_text,
            strip=False,
            widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        )
    if f.choices:
        return forms.ChoiceField(
            label=f.name,
            required=f.required,
            help_text=help_text,
            choices=[("", "---------"), *((c, c) for c in f.choices)],
            error_messages={
                "invalid_choice": f"must be one of {', '.join(f.choices)} (not %(value)s)"
            },
        )
    if f.kind is bool:
        return forms.BooleanField(label=f.name, required=False, help_text=help_text)
    if f.kind is int:
        return forms.IntegerField(label=f.name, required=f.required, help_text=help_text)
    if f.kind is float:
        return forms.FloatField(label=f.name, required=f.required, help_text=help_text)
    return forms.CharField(label=f.name, required=f.required, help_text=help_text)


class DatasourceForm(forms.ModelForm):  # type: ignore[type-arg]
    """Name, kind, enabled, plus the kind's settings (see the module docstring)."""

    kind = forms.ChoiceField(choices=kind_choices, help_text="The connector kind.")
    # The kind whose settings this form was rendered with: a submit whose kind differs
    # re-displays the form with the new kind's settings instead of saving.
    config_kind = forms.CharField(required=False, widget=forms.HiddenInput)

    class Meta:
        model = Datasource
        fields = ["name", "kind", "enabled"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        instance: Datasource = self.instance
        adding = instance._state.adding
        if not adding:
            # A datasource keeps its kind (bindings' specs were validated against it).
            self.fields.pop("kind", None)
            self.kind_value: str | None = instance.kind
        elif self.is_bound:
            self.kind_value = self.data.get("kind") or None
        else:
            self.kind_value = self.initial.get("kind") or None
        self.connector = connector_for(self.kind_value)
        self.kind_switched = False
        if self.is_bound and adding:
            rendered = self.data.get("config_kind") or None
            self.kind_switched = rendered != self.kind_value
            data = self.data.copy()  # type: ignore[attr-defined]
            data["config_kind"] = self.kind_value or ""
            self.data = data
        else:
            self.initial["config_kind"] = self.kind_value or ""
        stored = {} if adding else dict(instance.redacted_config or {})
        if self.connector is not None and not self.connector.config_fields:
            self.fields[JSON_FIELD] = forms.CharField(
                label="config (JSON)",
                required=False,
                widget=forms.Textarea(attrs={"rows": 6}),
                help_text=f"The {self.kind_value} kind declares no settings fields; enter a JSON "
                "object ({} for none). Masked values are kept as stored.",
            )
            self.initial.setdefault(JSON_FIELD, json.dumps(stored, indent=2, sort_keys=True))
        elif self.connector is not None:
            for f in self.connector.config_fields:
                has_value = stored.get(f.name) not in (None, "")
                self.fields[PREFIX + f.name] = _form_field(f, stored=has_value)
                if f.secret:
                    if not f.required and has_value:
                        self.fields[PREFIX + f.name + CLEAR_SUFFIX] = forms.BooleanField(
                            label=f"clear {f.name}",
                            required=False,
                            help_text=f"Remove the stored {f.name}.",
                        )
                elif has_value:
                    # redacted_config holds non-secret values as they are.
                    self.initial.setdefault(PREFIX + f.name, stored[f.name])

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if self.kind_switched:
            # The settings shown were another kind's: their errors are noise.
            for name in [n for n in self.errors if n.startswith(PREFIX) or n == JSON_FIELD]:
                del self.errors[name]
            raise ValidationError(
                f"The kind is now {self.kind_value}: fill in its settings below and save again."
            )
        if self.errors:
            return cleaned
        if self.connector is None:
            self.add_error("kind", f"unknown connector kind {self.kind_value!r}")
            return cleaned
        previous = self._stored_config()
        if JSON_FIELD in self.fields:
            config = self._config_from_json(cleaned.get(JSON_FIELD) or "", previous)
        else:
            config = self._config_from_fields(cleaned, previous)
        if config is None or self.errors:
            return cleaned
        try:
            config = self.connector.validate_config(config)
        except ValidationError as exc:
            self._add_config_errors(exc)
            return cleaned
        self.instance.kind = self.kind_value or ""
        self.instance.config = config
        # A value entered or cleared here no longer comes from the reference definition
        # files took it from (dispatch.ascode): an export must not name that reference.
        refs = dict(self.instance.secret_refs or {})
        if refs:
            self.instance.secret_refs = {
                k: v for k, v in refs.items() if config.get(k) == previous.get(k)
            }
        return cleaned

    def _post_clean(self) -> None:  # type: ignore[misc]
        # Nothing is saved with errors; skipping the model's clean() then avoids reporting
        # the same config errors twice (once per field, once from the model).
        if self.errors:
            return
        super()._post_clean()  # type: ignore[misc]

    def _update_errors(self, errors: ValidationError) -> None:  # type: ignore[misc]
        # The model's clean() names config keys ("password"); map them to this form's
        # field names so they show beside the right input.
        if hasattr(errors, "error_dict"):
            remapped: dict[str, list[Any]] = {}
            for key, errs in errors.error_dict.items():
                if key in self.fields or key == NON_FIELD_ERRORS:
                    remapped.setdefault(key, []).extend(errs)
                elif PREFIX + key in self.fields:
                    remapped.setdefault(PREFIX + key, []).extend(errs)
                else:
                    remapped.setdefault(NON_FIELD_ERRORS, []).extend(
                        f"{key}: {m}" for e in errs for m in e.messages
                    )
            errors = ValidationError(remapped)
        super()._update_errors(errors)  # type: ignore[misc]

    def _stored_config(self) -> dict[str, Any]:
        if self.instance._state.adding:
            return {}
        try:
            return self.instance.config
        except crypto.SnapshotUnreadable:  # an unreadable config must not break the page
            # No detail: the exception could name key material. The operator re-enters
            # every secret; blank secrets are then missing, and required ones say so.
            self.add_error(
                None,
                "The stored settings cannot be decrypted (unknown key?): "
                "enter every secret again to replace them.",
            )
            return {}

    def _config_from_fields(
        self, cleaned: dict[str, Any], previous: dict[str, Any]
    ) -> dict[str, Any]:
        assert self.connector is not None
        config: dict[str, Any] = {}
        moved = self._destination_changes(cleaned, previous)
        for f in self.connector.config_fields:
            value = cleaned.get(PREFIX + f.name)
            if f.secret:
                if cleaned.get(PREFIX + f.name + CLEAR_SUFFIX):
                    continue
                if value in (None, "") and moved and previous.get(f.name) not in (None, ""):
                    # A stored secret is sent only where it was entered for.
                    self.add_error(
                        PREFIX + f.name,
                        f"{', '.join(moved)} changed: enter the {f.name} again (a stored "
                        f"{f.name} is never sent to a new destination)"
                        + (", or clear it" if not f.required else ""),
                    )
                    continue
                if value in (None, ""):
                    value = previous.get(f.name)  # blank keeps the stored secret
                if value in (None, ""):
                    if f.required:
                        self.add_error(PREFIX + f.name, "this field is required")
                    continue
            elif value in (None, "") and f.kind is not bool:
                continue
            config[f.name] = value
        return config

    def _destination_changes(self, cleaned: dict[str, Any], previous: dict[str, Any]) -> list[str]:
        """The destination fields (ConfigField.destination) whose value this submit changes."""
        assert self.connector is not None
        if self.instance._state.adding:
            return []

        def norm(value: Any) -> Any:
            return None if value in (None, "") else value

        return [
            f.name
            for f in self.connector.config_fields
            if f.destination and norm(cleaned.get(PREFIX + f.name)) != norm(previous.get(f.name))
        ]

    def _config_from_json(self, text: str, previous: dict[str, Any]) -> dict[str, Any] | None:
        if jsondepth.text_too_deep(text):
            self.add_error(JSON_FIELD, f"this JSON {jsondepth.MESSAGE}")
            return None
        try:
            config = json.loads(text or "{}")
        except json.JSONDecodeError as exc:
            self.add_error(JSON_FIELD, f"not valid JSON: {exc.msg} (line {exc.lineno})")
            return None
        if not isinstance(config, dict):
            self.add_error(JSON_FIELD, "must be a JSON object")
            return None
        # A masked value sent back unchanged keeps what is stored, unless another value
        # changed: the kind declares no fields, so any of them may say where the secret goes.
        masked = [k for k, v in config.items() if v == SECRET_MASK and k in previous]
        changed = sorted(
            k
            for k in set(config) | set(previous)
            if k not in masked and config.get(k) != previous.get(k)
        )
        if masked and changed:
            self.add_error(
                JSON_FIELD,
                f"{', '.join(changed)} changed: enter {', '.join(masked)} again (a stored "
                "secret is never sent to a new destination)",
            )
            return None
        return {k: (previous[k] if k in masked else v) for k, v in config.items()}

    def _add_config_errors(self, exc: ValidationError) -> None:
        if not hasattr(exc, "error_dict"):
            self.add_error(JSON_FIELD if JSON_FIELD in self.fields else None, exc.messages)
            return
        for name, errors in exc.error_dict.items():
            target = PREFIX + name if PREFIX + name in self.fields else None
            if target is None and JSON_FIELD in self.fields:
                target = JSON_FIELD
            messages = [
                f"{name}: {m}" if target in (None, JSON_FIELD) else m
                for e in errors
                for m in e.messages
            ]
            self.add_error(target, messages)


# --- the job form ---------------------------------------------------------------------------
def spec_help(role: str, used: Collection[str] = ()) -> SafeString:
    """The fields each kind accepts in a `role` ("source" or "sink") spec, as each
    connector declares them (`Connector.spec_fields`); the kinds in `used` are marked."""

    def fields_of(connector: type[Connector]) -> SafeString:
        declared = connector.spec_fields(role)
        if declared is None:
            return format_html("<em>{}</em>", "not declared by the connector")
        if not declared:
            return format_html("<em>{}</em>", "none (leave the spec {})")
        return format_html_join(
            "; ",
            "<code>{}</code>{}",
            ((f.name, f" — {f.help}" if f.help else "") for f in declared),
        )

    kinds = [(k, c) for k, c in sorted(registry.kinds().items()) if role in c.roles]
    return format_html(
        "The fields each kind accepts; the kind is the binding's {} datasource's."
        '<ul class="dsp-spec-help" data-role="{}">{}</ul>',
        role,
        role,
        format_html_join(
            "",
            '<li data-kind="{}"><strong>{}</strong>{}{}: {}</li>',
            (
                (
                    kind,
                    kind,
                    f" ({connector.label})" if connector.label else "",
                    " — this job's bindings use it" if kind in used else "",
                    fields_of(connector),
                )
                for kind, connector in kinds
            ),
        ),
    )


class JobForm(forms.ModelForm):  # type: ignore[type-arg]
    """A job: its specs say which fields each connector kind accepts."""

    class Meta:
        model = Job
        fields = [
            "name",
            "description",
            "enabled",
            "source_spec",
            "sink_spec",
            "max_attempts",
            "backoff_seconds",
            "backoff_max_seconds",
            "lease_seconds",
            "timeout_seconds",
            "max_slices_in_flight",
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        used: dict[str, set[str]] = {"source": set(), "sink": set()}
        if not self.instance._state.adding:
            pairs = self.instance.bindings.values_list("source__kind", "sink__kind").distinct()
            for source_kind, sink_kind in pairs:
                used["source"].add(source_kind)
                used["sink"].add(sink_kind)
        for role, kinds in used.items():
            field = self.fields.get(f"{role}_spec")
            if field is not None:
                field.help_text = spec_help(role, kinds)


class BindingForm(forms.ModelForm):  # type: ignore[type-arg]
    """A binding, with its hash key: write-only (never shown back, not even masked),
    blank keeps the stored one, `clear_hash_key` forgets it."""

    hash_key = forms.CharField(
        required=False,
        strip=False,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text=(
            "The key of the source's columns.hash (HMAC-SHA256), at least "
            f"{HASH_KEY_MIN_CHARS} characters. Stored encrypted, never shown; blank keeps "
            "the stored key. The same key gives the same pseudonyms in every run and every "
            "binding that uses it; another key gives others."
        ),
    )
    clear_hash_key = forms.BooleanField(required=False, label="Forget the hash key")
    after = forms.ModelMultipleChoiceField(
        queryset=JobBinding.objects.order_by("name"),
        required=False,
        label="After",
        help_text=(
            "The bindings this one waits for: a run of each, in one chain, must end as "
            "below before this binding's run of that chain starts."
        ),
    )
    on = forms.ChoiceField(
        choices=ChainOn.choices,
        initial=ChainOn.SUCCESS,
        required=False,
        label="Starts",
        help_text="on success: every upstream run succeeded; on completion: it ended at all.",
    )

    class Meta:
        model = JobBinding
        fields = ["name", "job", "source", "sink", "enabled", "max_concurrency"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stored = bool(self.instance.hash_key_ciphertext)
        self.fields["hash_key"].label = "Hash key (one is stored)" if stored else "Hash key"
        after: Any = self.fields["after"]
        if self.instance.pk is not None and not self.instance._state.adding:
            after.queryset = after.queryset.exclude(pk=self.instance.pk)
            edges = list(BindingEdge.objects.filter(downstream_id=self.instance.pk))
            self.initial.setdefault("after", [e.upstream_id for e in edges])
            if edges:
                self.initial.setdefault("on", edges[0].on)

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean() or {}
        key = data.get("hash_key") or ""
        if data.get("clear_hash_key") and key:
            self.add_error("clear_hash_key", "give a new hash key or forget it, not both")
        elif key and len(key) < HASH_KEY_MIN_CHARS:
            self.add_error("hash_key", f"must be at least {HASH_KEY_MIN_CHARS} characters")
        wide = services.chain_width_problem(self.instance, list(data.get("after") or []))
        if wide is not None and "after" in self.changed_data:
            self.add_error("after", wide)
        cycle = self._cycle(list(data.get("after") or []))
        if cycle:
            self.add_error("after", f"these upstreams would form a cycle: {cycle}")
        return data

    def _cycle(self, after: list[JobBinding]) -> str | None:
        """The cycle the chosen upstreams would close, by name (checked again under the
        edges' lock when saved: `services.set_upstreams`)."""
        if not after or self.instance._state.adding:
            return None  # a new binding has no downstream edges: it closes no cycle
        me = str(self.instance.pk)
        edges = [
            (str(up), str(down))
            for up, down in BindingEdge.objects.exclude(downstream_id=self.instance.pk).values_list(
                "upstream_id", "downstream_id"
            )
        ] + [(str(b.pk), me) for b in after]
        cycle = services.chain_cycle(edges)
        if cycle is None:
            return None
        ring = cycle[:-1]
        start = ring.index(me) if me in ring else 0
        ring = ring[start:] + ring[:start] + [ring[start]]
        names = {
            str(k): v for k, v in JobBinding.objects.filter(pk__in=ring).values_list("pk", "name")
        }
        names[me] = self.cleaned_data.get("name") or self.instance.name
        return " -> ".join(names.get(n, n) for n in ring)

    def _save_m2m(self) -> None:
        super()._save_m2m()  # type: ignore[misc]
        if not {"after", "on"} & set(self.changed_data):
            return  # unchanged (or not editable here): the stored edges stay as they are
        on = self.cleaned_data.get("on") or ChainOn.SUCCESS
        services.set_upstreams(
            self.instance, [(b, on) for b in self.cleaned_data.get("after") or []]
        )

    def save(self, commit: bool = True) -> JobBinding:
        binding: JobBinding = super().save(commit=False)
        if self.cleaned_data.get("clear_hash_key"):
            binding.set_hash_key(None)
        elif self.cleaned_data.get("hash_key"):
            binding.set_hash_key(self.cleaned_data["hash_key"])
        if commit:
            binding.save()
            self.save_m2m()
        return binding
