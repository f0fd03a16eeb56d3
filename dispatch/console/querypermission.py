"""The console's side of the query permission (`dispatch.security.sqlperm`): admin forms
that say a source query needs it, and guards that refuse the save with 403 on any other
path."""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from dispatch.models import Datasource, Job, JobBinding
from dispatch.security import crypto
from dispatch.security.sqlperm import (
    DATASOURCE_MESSAGE,
    MESSAGE,
    allowed,
    binding_needs,
    datasource_needs,
    job_needs,
)


def job_form(form_class: type[forms.ModelForm], request: HttpRequest) -> type:  # type: ignore[type-arg]
    class JobQueryForm(form_class):  # type: ignore[valid-type,misc]
        def clean(self) -> dict[str, Any]:
            data = super().clean()
            stored = None
            if self.instance.pk and not self.instance._state.adding:
                stored = (
                    Job.objects.filter(pk=self.instance.pk)
                    .values_list("source_spec", flat=True)
                    .first()
                )
            needed = "source_spec" in data and job_needs(data["source_spec"], stored)
            if needed and not allowed(request):
                self.add_error("source_spec", MESSAGE)
            return data

    return JobQueryForm


def binding_form(form_class: type[forms.ModelForm], request: HttpRequest) -> type:  # type: ignore[type-arg]
    class BindingQueryForm(form_class):  # type: ignore[valid-type,misc]
        def clean(self) -> dict[str, Any]:
            data = super().clean()
            stored = None
            if self.instance.pk and not self.instance._state.adding:
                stored = (
                    JobBinding.objects.filter(pk=self.instance.pk)
                    .values("job_id", "source_id")
                    .first()
                )
            job = data.get("job")
            source = data.get("source")
            if binding_needs(job, source.pk if source else None, stored) and not allowed(request):
                self.add_error(None, MESSAGE)
            return data

    return BindingQueryForm


def _datasource_moves(obj: Datasource) -> list[str]:
    """The target keys this (unsaved) datasource changes while a query binding reads it."""
    if obj._state.adding or not obj.pk:
        return []
    found = Datasource.objects.filter(pk=obj.pk).first()
    if found is None:
        return []
    try:
        stored = found.config
    except crypto.SnapshotUnreadable:
        stored = {}  # nothing known of where it pointed: every key is a change
    specs = JobBinding.objects.filter(source_id=obj.pk).values_list("job__source_spec", flat=True)
    return datasource_needs(obj.config, stored, specs)


def datasource_form(form_class: type[forms.ModelForm], request: HttpRequest) -> type:  # type: ignore[type-arg]
    class DatasourceQueryForm(form_class):  # type: ignore[valid-type,misc]
        def clean(self) -> dict[str, Any]:
            data = super().clean()
            # The form's clean() puts the submitted config on the instance when it is valid.
            if self.errors:
                return data
            moved = _datasource_moves(self.instance)
            if moved and not allowed(request):
                self.add_error(None, DATASOURCE_MESSAGE.format(fields=", ".join(moved)))
            return data

    return DatasourceQueryForm


def guard_datasource_save(request: HttpRequest, obj: Any, change: bool) -> None:
    moved = _datasource_moves(obj) if change else []
    if moved and not allowed(request):
        raise PermissionDenied(DATASOURCE_MESSAGE.format(fields=", ".join(moved)))


def guard_job_save(request: HttpRequest, obj: Any, change: bool) -> None:
    stored = (
        Job.objects.filter(pk=obj.pk).values_list("source_spec", flat=True).first()
        if change
        else None
    )
    if job_needs(obj.source_spec, stored) and not allowed(request):
        raise PermissionDenied(MESSAGE)


def guard_binding_save(request: HttpRequest, obj: Any, change: bool) -> None:
    stored = (
        JobBinding.objects.filter(pk=obj.pk).values("job_id", "source_id").first()
        if change
        else None
    )
    if binding_needs(obj.job, obj.source_id, stored) and not allowed(request):
        raise PermissionDenied(MESSAGE)


class QueryPermissionAdmin:
    """A ModelAdmin mixin: the change form says when a source query needs the permission
    (`form_wrapper`), and the save refuses without it on every path (`guard`)."""

    form_wrapper: staticmethod[[type[forms.ModelForm], HttpRequest], type]  # type: ignore[type-arg]
    guard: staticmethod[[HttpRequest, Any, bool], None]

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)  # type: ignore[misc]
        return self.form_wrapper(form, request)

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        self.guard(request, obj, change)
        super().save_model(request, obj, form, change)  # type: ignore[misc]
