"""`query` source specs run arbitrary SQL as the source's role: a permission of their own.

A READ ONLY transaction does not stop `dblink_exec`, `pg_terminate_backend` or
`pg_read_file` where the role may call them, so writing (or re-targeting) a query is
granted separately from changing jobs and bindings: `dispatch.write_source_query`.

- A job whose `source_spec` gains a query, or whose query text changes, needs it.
- A binding that attaches a job with a query to a source (new binding, another job,
  another source) needs it: the same query against another database is new SQL there.

The admin forms say so as an error; `save_model` refuses with 403 on every other path.
Least-privilege source roles (docs/security.md) remain the real boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django import forms
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

QUERY_PERMISSION = "dispatch.write_source_query"
MESSAGE = (
    "A source query is SQL that runs on the source database: writing one, changing it or "
    "pointing it at another source needs the permission 'Can write SQL queries that "
    "sources run' (dispatch | job) as well."
)


def spec_query(spec: Any) -> str | None:
    if isinstance(spec, dict) and isinstance(spec.get("query"), str) and spec["query"].strip():
        return str(spec["query"])
    return None


def job_needs(source_spec: Any, stored_spec: Any | None) -> bool:
    query = spec_query(source_spec)
    if query is None:
        return False
    return stored_spec is None or spec_query(stored_spec) != query


def binding_needs(job: Any, source_id: Any, stored: Mapping[str, Any] | None) -> bool:
    if job is None or spec_query(job.source_spec) is None:
        return False
    if stored is None:
        return True
    return stored["job_id"] != job.pk or stored["source_id"] != source_id


def allowed(request: HttpRequest | None) -> bool:
    return request is not None and bool(request.user.has_perm(QUERY_PERMISSION))


def job_form(form_class: type[forms.ModelForm], request: HttpRequest) -> type:  # type: ignore[type-arg]
    from dispatch.models import Job

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
    from dispatch.models import JobBinding

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


def guard_job_save(request: HttpRequest, obj: Any, change: bool) -> None:
    from dispatch.models import Job

    stored = (
        Job.objects.filter(pk=obj.pk).values_list("source_spec", flat=True).first()
        if change
        else None
    )
    if job_needs(obj.source_spec, stored) and not allowed(request):
        raise PermissionDenied(MESSAGE)


def guard_binding_save(request: HttpRequest, obj: Any, change: bool) -> None:
    from dispatch.models import JobBinding

    stored = (
        JobBinding.objects.filter(pk=obj.pk).values("job_id", "source_id").first()
        if change
        else None
    )
    if binding_needs(obj.job, obj.source_id, stored) and not allowed(request):
        raise PermissionDenied(MESSAGE)
