"""The operator console: Django admin for datasources, jobs, bindings, runs, attempts
and workers.

Runs, attempts and workers are history: read-only, never added or deleted by hand. Every
operator action calls `dispatch.services` (the same functions the management commands
use), has its own permission, asks for confirmation when destructive, and is recorded in
the admin history. See docs/console.md.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import (
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    IntegerField,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
)
from django.db.models.functions import Coalesce, Now
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.http.response import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.decorators import method_decorator
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString
from django.utils.timezone import is_aware, localtime
from django.views.decorators.debug import sensitive_post_parameters

from dispatch import checks, services
from dispatch.connectors import incremental
from dispatch.connectors.base import ConnectorError
from dispatch.connectors.postgresql.schema_policy import describe_changes
from dispatch.console import bulk as console_bulk
from dispatch.console import querypermission
from dispatch.console import slices as console_slices
from dispatch.console.actions import (
    ActionRefused,
    ActionResult,
    ActionSpec,
    confirmation_page,
    run_action,
)
from dispatch.console.badges import (
    ORIGIN_LABEL,
    blocked_badge,
    duration_text,
    progress_bar,
    reason_badge,
    status_badge,
)
from dispatch.console.forms import BindingForm, DatasourceForm, JobForm, config_field_names
from dispatch.console.managed import ManagedByFilesAdmin
from dispatch.console.overview import overview_view
from dispatch.console.paging import CappedPaginator
from dispatch.core import conf
from dispatch.core.progress import Progress
from dispatch.core.states import (
    RETRYABLE_RUN_STATUSES,
    UNFINISHED_RUN_STATUSES,
    BlockedReason,
    Status,
    Trigger,
)
from dispatch.models import (
    SECRET_MASK,
    Attempt,
    AttemptEvent,
    BindingCursor,
    BindingEdge,
    BindingHealth,
    BulkOperation,
    BulkStatus,
    Datasource,
    Job,
    JobBinding,
    Overview,
    Run,
    SlicePlan,
    Worker,
)
from dispatch.ops import bulk as ops_bulk
from dispatch.security import crypto, jsondepth

log = logging.getLogger("dispatch.console")

# --- the action implementations (each one call of a service) -------------------------


def _trigger(request: HttpRequest, binding: JobBinding) -> ActionResult:
    run = services.trigger(binding, trigger=Trigger.MANUAL, requested_by=request.user)
    blocked = run.attempts.values_list("blocked_reason", flat=True).first()
    warning = ""
    if blocked:
        # The service creates the run anyway (contract: it waits, visibly); say so.
        warning = (
            f"Run {run.pk} of {binding.name} was created but waits: "
            f"{BlockedReason(blocked).label.lower()}. It starts once that is enabled."
        )
    return ActionResult(
        services.Outcome.TRIGGERED, detail=f"run {run.pk}", warning=warning, created=run
    )


def _service(fn: Callable[..., services.Outcome]) -> Callable[[HttpRequest, Any], ActionResult]:
    def call(request: HttpRequest, obj: Any) -> ActionResult:
        return ActionResult(fn(obj, by=request.user))

    return call


# The same functions a bulk operation applies (dispatch.ops.bulk), one row at a time.
def _release_from_run(request: HttpRequest, run: Run) -> ActionResult:
    outcome, detail = ops_bulk.release_running(run, request.user)
    return ActionResult(outcome, detail=detail)


def _set_enabled(
    enabled: bool, request: HttpRequest, obj: Datasource | Job | JobBinding
) -> ActionResult:
    outcome, _ = ops_bulk.set_enabled(enabled, obj, request.user)
    return ActionResult(outcome)


def _cancel_bulk(request: HttpRequest, operation: BulkOperation) -> ActionResult:
    return ActionResult(ops_bulk.cancel(operation, by=request.user))


def scrub(text: str, config: dict[str, Any], secret_fields: frozenset[str]) -> str:
    """Replace any secret value of `config` that appears in `text` by the mask. A last
    line of defence: connectors already promise secret-free messages."""
    for name in secret_fields:
        value = config.get(name)
        if isinstance(value, str) and value:
            text = text.replace(value, SECRET_MASK)
    return text


def _test_connection(request: HttpRequest, datasource: Datasource) -> ActionResult:
    try:
        connector = datasource.connector()
    except LookupError as exc:
        raise ActionRefused("CONNECTION_FAILED", str(exc)) from None
    try:
        config = datasource.config
    except crypto.SnapshotUnreadable:  # no detail: it could name key material
        raise ActionRefused(
            "CONNECTION_FAILED", "the stored settings cannot be decrypted (unknown key?)"
        ) from None
    secret = connector.secret_fields()
    try:
        connector.test_connection(config)
    except ConnectorError as exc:
        raise ActionRefused("CONNECTION_FAILED", scrub(str(exc), config, secret)) from None
    except Exception as exc:  # noqa: BLE001 - a connector's bug must not 500 the page
        # Connectors raise ConnectorError for everything a server or a setting can cause:
        # anything else is a bug in the connector. The operator sees it; the log keeps the
        # traceback, scrubbed of the datasource's secrets like the message.
        message = scrub(" ".join(str(exc).split())[:300], config, secret)
        trace = scrub("".join(traceback.format_exception(exc)), config, secret)
        log.error("test connection raised %s (a connector bug)\n%s", type(exc).__name__, trace)
        raise ActionRefused("CONNECTION_FAILED", f"{type(exc).__name__}: {message}") from None
    return ActionResult("CONNECTION_OK")


# How much of a cursor's JSON a page or a history entry shows (a value may be up to
# limits.MAX_CURSOR_VALUE_BYTES, a copy written before that bound larger still).
CURSOR_SHOWN_CHARS = 200


def cursor_text(cursor: Any) -> str:
    """A cursor's JSON, cut to CURSOR_SHOWN_CHARS with its full length said."""
    text = json.dumps(cursor)
    if len(text) <= CURSOR_SHOWN_CHARS:
        return text
    return f"{text[:CURSOR_SHOWN_CHARS]}… ({len(text)} characters in all)"


def _reset_cursor(request: HttpRequest, binding: JobBinding) -> ActionResult:
    was = getattr(getattr(binding, "cursor_copy", None), "cursor", None)
    committed = services.set_binding_cursor(binding, None, by=request.user)
    return ActionResult(
        "CURSOR_RESET", detail=f"was {cursor_text(was)}", warning=committed.replaced
    )


def _set_cursor(request: HttpRequest, binding: JobBinding) -> ActionResult:
    raw = request.POST.get("value", "")
    # Before parsing: json recurses once per level, so a few thousand `[` would raise
    # RecursionError (a 500), not ValueError.
    if jsondepth.text_too_deep(raw):
        raise ActionRefused("BAD_CURSOR", f"the cursor {jsondepth.MESSAGE}")
    try:
        cursor = json.loads(raw)
    except ValueError:
        raise ActionRefused(
            "BAD_CURSOR", 'the cursor must be a JSON list of strings, e.g. ["2024-01-01", "42"]'
        ) from None
    was = getattr(getattr(binding, "cursor_copy", None), "cursor", None)
    committed = services.set_binding_cursor(binding, cursor, by=request.user)
    return ActionResult(
        "CURSOR_SET",
        detail=f"to {cursor_text(cursor)}, was {cursor_text(was)}",
        warning=committed.replaced,
    )


def _incremental(binding: JobBinding) -> bool:
    try:
        return incremental.parse(binding.job.source_spec) is not None
    except ValidationError:  # an invalid stored spec: no cursor actions
        return False


def cursor_index_notice(binding: JobBinding) -> str | None:
    """After a binding is saved: for an incremental read of a PostgreSQL table, a warning
    when the source table has no index on the cursor (with the statement that creates
    one), or that the check could not be made (the source did not answer: the save stands,
    and every run checks again). None when there is nothing to say."""
    spec = binding.job.source_spec
    if not _incremental(binding) or not isinstance(spec, dict) or not spec.get("table"):
        return None
    try:
        connector = binding.source.connector()
    except LookupError:
        return None
    check = getattr(connector, "cursor_index_needed", None)
    if check is None:
        return None
    try:
        config = binding.source.config
    except crypto.SnapshotUnreadable:
        return "The source's cursor index was not checked: its settings cannot be decrypted."
    try:
        needed = check(config, spec)
    except ConnectorError as exc:
        detail = scrub(str(exc), config, connector.secret_fields())
        return (
            f"The source's cursor index was not checked ({detail}); the binding is saved, "
            "and each run checks it again."
        )
    if needed is None:
        return None
    return (
        f"{spec['table']} has no index on the incremental cursor: each run sorts its whole "
        f"increment before the first row moves. Create one on the source: {needed}"
    )


def binding_checks_notices(binding: JobBinding) -> list[str]:
    """After a binding is saved: the source table's lack of a column the spec's `columns`
    names, and an upsert key the sink does not enforce, each as a warning; or that a
    check could not be made (a datasource did not answer: the save stands, and every run
    checks again)."""
    notices = []
    for role, check_name, spec in (
        ("source", "columns_problem", binding.job.source_spec),
        ("sink", "sink_key_problem", binding.job.sink_spec),
    ):
        datasource = binding.source if role == "source" else binding.sink
        try:
            connector = datasource.connector()
        except LookupError:
            continue
        check = getattr(connector, check_name, None)
        if check is None or not isinstance(spec, dict):
            continue
        try:
            config = datasource.config
        except crypto.SnapshotUnreadable:
            notices.append(f"The {role} was not checked: its settings cannot be decrypted.")
            continue
        try:
            problem = check(config, spec)
        except ConnectorError as exc:
            detail = scrub(str(exc), config, connector.secret_fields())
            notices.append(
                f"The {role} was not checked ({detail}); the binding is saved, and each run "
                "checks it again."
            )
            continue
        if problem is not None:
            notices.append(f"The {role}: {problem}")
    return notices


RESET_CURSOR = ActionSpec(
    "reset_cursor",
    "Reset cursor",
    "dispatch.reset_cursor_binding",
    True,
    _reset_cursor,
    "Forget the incremental cursor committed in the sink: the next run reads the whole "
    "source (from the spec's start, if it has one). A run in progress cannot commit over "
    "the reset; its retry starts again.",
    applies=_incremental,
)
SET_CURSOR = ActionSpec(
    "set_cursor",
    "Set cursor",
    "dispatch.set_cursor_binding",
    True,
    _set_cursor,
    "Set the incremental cursor committed in the sink: the next run reads the rows whose "
    "cursor is above it (a backfill from that point).",
    applies=_incremental,
    input_label="New cursor, a JSON list with one string per cursor column",
)
TRIGGER = ActionSpec(
    "trigger_binding",
    "Trigger now",
    "dispatch.trigger_binding",
    False,
    _trigger,
    "Create a run (trigger MANUAL) with its first attempt pending, and wake a worker.",
)
CANCEL = ActionSpec(
    "cancel_run",
    "Cancel",
    "dispatch.cancel_run",
    True,
    _service(services.cancel_run),
    "A pending run is cancelled at once; a running one stops at its worker's next "
    "heartbeat. A sink commit that already happened wins. A sliced run: its queued slices at "
    "once, its running ones at their next heartbeat (a slice is cancelled with its run).",
    # Not offered on a slice: the service refuses it (SLICE_RUN), its sliced run is the one.
    applies=lambda run: run.status in UNFINISHED_RUN_STATUSES and run.parent_id is None,
)
RETRY = ActionSpec(
    "retry_run",
    "Retry",
    "dispatch.retry_run",
    False,
    _service(services.retry_run),
    "Add a new attempt (operator retry, fresh retry budget) to a failed or cancelled run. "
    "A sliced run: each of its slices that did not commit gets one; those that did are kept.",
    applies=lambda run: run.status in RETRYABLE_RUN_STATUSES and run.parent_id is None,
)
RUN_NOW = ActionSpec(
    "run_now",
    "Run now",
    "dispatch.run_now",
    False,
    _service(services.run_now),
    "Make the attempt that waits on a retry backoff due now.",
    applies=lambda run: run.status == Status.PENDING,
)
RELEASE = ActionSpec(
    "release_attempt",
    "Release",
    "dispatch.release_attempt",
    True,
    _service(services.release_attempt),
    "Settle the running attempt now (its worker is gone): it becomes RETRY_SCHEDULED and a "
    "successor is due at once. A worker that is in fact alive is fenced off.",
    applies=lambda attempt: attempt.status == Status.RUNNING,
)
RELEASE_FROM_RUN = ActionSpec(
    "release_attempt",
    "Release running attempt",
    "dispatch.release_attempt",
    True,
    _release_from_run,
    RELEASE.describe,
    applies=lambda run: run.status == Status.RUNNING,
)
CANCEL_BULK = ActionSpec(
    "cancel_bulk",
    "Cancel operation",
    "dispatch.cancel_bulkoperation",
    True,
    _cancel_bulk,
    "Stop the bulk operation before its next batch. The batches already done stay "
    "applied (a batch in flight finishes first).",
    applies=lambda operation: operation.status == BulkStatus.PENDING,
)
TEST = ActionSpec(
    "test_datasource",
    "Test connection",
    "dispatch.test_datasource",
    False,
    _test_connection,
    "Open and close a connection with the stored settings.",
)


def _enable_spec(model: str, enabled: bool) -> ActionSpec:
    if enabled:
        return ActionSpec(
            "enable",
            "Enable",
            f"dispatch.change_{model}",
            False,
            partial(_set_enabled, True),
            "Allow claims (and fires) again.",
            applies=lambda obj: not obj.enabled,
        )
    return ActionSpec(
        "disable",
        "Disable",
        f"dispatch.change_{model}",
        True,
        partial(_set_enabled, False),
        "Block future claims. Running attempts are not touched; pending runs wait "
        "with a visible reason.",
        applies=lambda obj: obj.enabled,
    )


# --- shared admin machinery --------------------------------------------------------------


def changelist_action(spec: ActionSpec, permission: str) -> Callable[..., HttpResponse | None]:
    """A changelist action for `spec`, guarded by `has_<permission>_permission`."""

    def action(
        modeladmin: ConsoleAdmin, request: HttpRequest, queryset: QuerySet[Any]
    ) -> HttpResponse | None:
        if spec.destructive and request.POST.get("post") != "yes":
            return confirmation_page(modeladmin, request, spec, list(queryset))
        run_action(modeladmin, request, queryset, spec)
        return None

    action.__name__ = spec.name
    return admin.action(permissions=[permission], description=f"{spec.label} (selected)")(action)


class ConsoleAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Object buttons (POST forms to guarded views) and the console's styling."""

    object_actions: Sequence[ActionSpec] = ()

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/do/<str:action>/",
                self.admin_site.admin_view(self.object_action_view),
                name=f"{info[0]}_{info[1]}_object_action",
            ),
            # "Apply to all matching" (the models of dispatch.ops.bulk.FILTERS).
            path(
                "bulk/<str:action>/",
                self.admin_site.admin_view(self.bulk_view),
                name=f"{info[0]}_{info[1]}_bulk",
            ),
            *super().get_urls(),
        ]

    def bulk_view(self, request: HttpRequest, action: str) -> HttpResponse:
        return console_bulk.request_view(self, request, action)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        cl = context.get("cl") if context else None
        if cl is not None and context is not None:
            # The list's own (capped) count of the filtered rows: no query more.
            context["bulk_links"] = console_bulk.links(self, request, cl.result_count)
            context["bulk_count"] = console_bulk.count_text(cl.result_count)
        return response

    def _spec(self, name: str) -> ActionSpec:
        for spec in self.object_actions:
            if spec.name == name:
                return spec
        raise Http404(f"no action {name!r}")

    def object_action_view(self, request: HttpRequest, object_id: str, action: str) -> HttpResponse:
        """POST applies the action (after a confirmation page when destructive); GET shows
        that page for a destructive action and is refused otherwise. CSRF is checked by
        `admin_view`; the permission here, before the object is even read."""
        spec = self._spec(action)
        if not request.user.has_perm(spec.perm):
            raise PermissionDenied
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404(f"{self.opts.verbose_name} {object_id} does not exist")
        request.current_app = self.admin_site.name
        url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_object_action",
            args=[object_id, action],
            current_app=self.admin_site.name,
        )
        if request.method == "GET" and not spec.destructive:
            return HttpResponseNotAllowed(["POST"])
        if request.method != "POST" or (spec.destructive and request.POST.get("post") != "yes"):
            response = confirmation_page(self, request, spec, [obj], action_url=url)
            next_url = request.POST.get("next") or request.GET.get("next")
            if next_url:
                response.context_data["next"] = next_url  # type: ignore[attr-defined]
            return response
        report = run_action(self, request, [obj], spec)
        next_url = request.POST.get("next", "")
        if next_url and url_has_allowed_host_and_scheme(
            next_url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
        ):
            return HttpResponseRedirect(next_url)
        if report.created and request.user.has_perm("dispatch.view_run"):
            return HttpResponseRedirect(
                reverse(
                    "admin:dispatch_run_change",
                    args=[report.created[0].pk],
                    current_app=self.admin_site.name,
                )
            )
        return HttpResponseRedirect(
            reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_change",
                args=[obj.pk],
                current_app=self.admin_site.name,
            )
        )

    def object_buttons(self, request: HttpRequest, obj: Any) -> list[dict[str, Any]]:
        return [
            {
                "label": spec.label,
                "destructive": spec.destructive,
                "help": spec.describe,
                "url": reverse(
                    f"admin:{self.opts.app_label}_{self.opts.model_name}_object_action",
                    args=[obj.pk, spec.name],
                    current_app=self.admin_site.name,
                ),
            }
            for spec in self.object_actions
            if request.user.has_perm(spec.perm) and spec.applies(obj)
        ]

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        if obj is not None:
            context["object_buttons"] = self.object_buttons(request, obj)
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        """On an add page, without the read-only fields the database fills (`db_default`,
        e.g. `created_at`): the row does not exist yet, so they have no value (Django 5.2
        would print its `DatabaseDefault` placeholder there)."""
        fieldsets = super().get_fieldsets(request, obj)
        if obj is not None:
            return fieldsets
        unset = set(self.get_readonly_fields(request, obj)) & database_filled(self.model)
        if not unset:
            return fieldsets
        kept = []
        for name, options in fieldsets:
            fields: list[Any] = []
            for entry in options["fields"]:
                if isinstance(entry, list | tuple):  # fields on one line
                    line = [f for f in entry if f not in unset]
                    if line:
                        fields.append(line)
                elif entry not in unset:
                    fields.append(entry)
            if fields:
                kept.append((name, {**options, "fields": fields}))
        return kept


def database_filled(model: Any) -> set[str]:
    """The names of `model`'s fields whose value the database writes on insert."""
    return {f.name for f in model._meta.concrete_fields if f.has_db_default()}


class HistoryAdmin(ConsoleAdmin):
    """Rows the system writes: viewable, never added, edited or deleted by hand."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _perm(codename: str) -> Callable[[Any, HttpRequest], bool]:
    def check(self: Any, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"dispatch.{codename}"))

    return check


def _link(modeladmin: Any, viewname: str, pk: Any, text: Any) -> SafeString:
    """A link into the admin site `modeladmin` is registered on (not the default one)."""
    url = reverse(viewname, args=[pk], current_app=modeladmin.admin_site.name)
    return format_html('<a href="{}">{}</a>', url, text)


# --- datasources, jobs, bindings ----------------------------------------------------------


def fieldset_fields(fieldsets: list[Any]) -> list[str]:
    """Every field named in `fieldsets`, in order (for admins whose rows are read-only)."""
    return [name for _, options in fieldsets for name in options["fields"]]


def _attempt_count(group: str, **filters: Any) -> Coalesce:
    """A correlated count of attempts per outer row (0 when none), as one subquery: the
    lists annotate it instead of counting per row (no N+1)."""
    counted = (
        Attempt.objects.filter(**filters)
        .order_by()
        .values(group)
        .annotate(n=Count("id"))
        .values("n")
    )
    return Coalesce(Subquery(counted, output_field=IntegerField()), 0)


@admin.register(Datasource)
class DatasourceAdmin(ManagedByFilesAdmin, querypermission.QueryPermissionAdmin, ConsoleAdmin):
    form = DatasourceForm
    # Re-pointing a datasource a query binding reads needs the query permission
    # (dispatch.security.sqlperm).
    form_wrapper = staticmethod(querypermission.datasource_form)
    guard = staticmethod(querypermission.guard_datasource_save)
    list_display = ["name", "kind", "enabled", "version", "updated_at"]
    list_filter = ["enabled", "kind"]
    search_fields = ["name", "kind"]
    ordering = ["name"]
    actions = [
        changelist_action(_enable_spec("datasource", True), "change"),
        changelist_action(_enable_spec("datasource", False), "change"),
        changelist_action(TEST, "test"),
    ]
    object_actions = (TEST,)
    has_test_permission = _perm("test_datasource")

    # Every view that receives a datasource's settings: an error report (the debug page,
    # the admins' error mail) shows none of the POST values.
    @method_decorator(sensitive_post_parameters())
    def changeform_view(self, *args: Any, **kwargs: Any) -> Any:
        return super().changeform_view(*args, **kwargs)

    @method_decorator(sensitive_post_parameters())
    def changelist_view(self, *args: Any, **kwargs: Any) -> Any:
        return super().changelist_view(*args, **kwargs)

    @method_decorator(sensitive_post_parameters())
    def object_action_view(self, *args: Any, **kwargs: Any) -> Any:
        return super().object_action_view(*args, **kwargs)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fixed = ["version", "created_at", "updated_at", "stored_settings"]
        return ["kind", *fixed] if obj is not None else []

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        kind = (
            obj.kind if obj is not None else (request.POST.get("kind") or request.GET.get("kind"))
        )
        stored = obj.redacted_config if obj is not None else None
        settings = config_field_names(kind, stored=stored)
        main: list[str] = ["name", "kind", "enabled", "config_kind"]
        if obj is not None:
            main = ["name", "kind", "enabled", "version", "updated_at", "config_kind"]
        description = (
            "Secret fields are never shown; leave one blank to keep the stored value."
            if settings
            else "Choose a kind to see its settings."
        )
        sets: list[tuple[str | None, dict[str, Any]]] = [
            (None, {"fields": main}),
            ("Settings", {"fields": settings, "description": description}),
        ]
        if obj is not None:
            sets.append(("Stored (secrets masked)", {"fields": ["stored_settings"]}))
        return sets

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        # The settings fields are added by the form itself for the kind it resolves;
        # only model fields go through modelform_factory.
        kwargs["fields"] = ["name", "enabled"] if obj is not None else ["name", "kind", "enabled"]
        return super().get_form(request, obj, change, **kwargs)

    @admin.display(description="stored settings")
    def stored_settings(self, obj: Datasource) -> SafeString:
        if not obj.redacted_config:
            return format_html("<em>{}</em>", "none")
        return format_html(
            '<table class="dsp-kv">{}</table>',
            format_html_join(
                "",
                "<tr><th>{}</th><td><code>{}</code></td></tr>",
                ((k, json.dumps(v)) for k, v in sorted(obj.redacted_config.items())),
            ),
        )


class BindingInline(admin.TabularInline):  # type: ignore[type-arg]
    """A job's bindings, read-only here (edit them on the binding page)."""

    model = JobBinding
    fields = ["name", "source", "sink", "enabled", "max_concurrency"]
    readonly_fields = ["name", "source", "sink", "enabled", "max_concurrency"]
    extra = 0
    show_change_link = True
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[JobBinding]:
        return super().get_queryset(request).select_related("source", "sink", "job")


class BindingAlertsForm(forms.ModelForm):  # type: ignore[type-arg]
    """The alert settings of a binding's health row. Saving writes those fields only: the
    rest of the row is the health scan's, which may have moved it (warned, disabled)
    since this page was loaded, and must not be written back from the page."""

    class Meta:
        model = BindingHealth
        fields = list(BindingHealth.SETTINGS_FIELDS)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "alert_emails" in self.fields:
            domains = conf.alert_email_domains()
            allowed = (
                "any domain"
                if conf.ANY_DOMAIN in domains
                else ", ".join(sorted(domains))
                or "none: DISPATCH_ALERT_EMAIL_DOMAINS is empty, alerts go to the site's ADMINS"
            )
            self.fields["alert_emails"].help_text += f" Allowed domains: {allowed}."
        if "alert_webhook" not in self.fields:
            return  # read-only for this user (BindingAlertsInline)
        names = sorted(conf.alert_webhooks())
        choices = [("", "the site's default webhook, if any"), *((n, n) for n in names)]
        stored = self.instance.alert_webhook if self.instance.pk else ""
        if stored and stored not in names:
            choices.append((stored, f"{stored} (no longer configured: its alerts fail)"))
        field = BindingHealth._meta.get_field("alert_webhook")
        self.fields["alert_webhook"] = forms.ChoiceField(
            choices=choices, required=False, label="Alert webhook", help_text=field.help_text
        )

    def save(self, commit: bool = True) -> BindingHealth:
        health = self.instance
        # The fields of this form only: those read-only for the user keep what is stored.
        values = {f: getattr(health, f) for f in BindingHealth.SETTINGS_FIELDS if f in self.fields}
        if not commit:
            return health
        if health._state.adding:
            # As the health scan's first pass does: the streak counts every run.
            row, _ = BindingHealth.objects.get_or_create(
                binding_id=health.binding_id,
                defaults={"counted_since": health.binding.created_at, **values},
            )
            health.pk = row.pk
            health._state.adding = False
        BindingHealth.objects.filter(pk=health.pk).update(**values)
        return health


class BindingAlertsInline(admin.StackedInline):  # type: ignore[type-arg]
    """A binding's alert settings (its health row; the state itself is the health
    scan's, shown read-only on the binding). The webhook is chosen among the site's named
    ones: a binding never names a host of its own.

    Choosing who gets the alerts (addresses, webhook) needs `dispatch.view_run` besides
    the health permissions: alerts tell about runs. Without it the two fields are
    read-only, so they are not in the form and a value posted for them is never read."""

    model = BindingHealth
    form = BindingAlertsForm
    fields = list(BindingHealth.SETTINGS_FIELDS)
    verbose_name = "alert settings"
    verbose_name_plural = "alert settings"
    max_num = 1
    can_delete = False

    RECIPIENT_FIELDS = ("alert_emails", "alert_webhook")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if request.user.has_perm("dispatch.view_run"):
            return []
        return list(self.RECIPIENT_FIELDS)


@admin.register(Job)
class JobAdmin(ManagedByFilesAdmin, querypermission.QueryPermissionAdmin, ConsoleAdmin):
    form = JobForm
    # Source queries need a permission of their own (dispatch.security.sqlperm).
    form_wrapper = staticmethod(querypermission.job_form)
    guard = staticmethod(querypermission.guard_job_save)

    list_display = [
        "name",
        "enabled",
        "max_attempts",
        "backoff_seconds",
        "lease_seconds",
        "timeout_seconds",
        "binding_count",
    ]
    list_filter = ["enabled"]
    search_fields = ["name", "description"]
    ordering = ["name"]
    inlines = [BindingInline]
    readonly_fields = ["created_at"]
    actions = [
        changelist_action(_enable_spec("job", True), "change"),
        changelist_action(_enable_spec("job", False), "change"),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        return super().get_queryset(request).annotate(binding_count=Count("bindings"))

    @admin.display(description="bindings", ordering="binding_count")
    def binding_count(self, obj: Job) -> int:
        return int(getattr(obj, "binding_count", 0))


@admin.register(JobBinding)
class JobBindingAdmin(ManagedByFilesAdmin, querypermission.QueryPermissionAdmin, ConsoleAdmin):
    form = BindingForm
    form_wrapper = staticmethod(querypermission.binding_form)
    guard = staticmethod(querypermission.guard_binding_save)

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change=change, **kwargs)
        if request.user.has_perm("dispatch.trigger_binding"):
            return form

        class EdgesReadOnly(form):  # type: ignore[misc, valid-type]
            """Without the trigger permission the upstreams are shown, not edited: an
            edge starts this binding whenever its upstream ends."""

            def __init__(self, *args: Any, **kw: Any) -> None:
                super().__init__(*args, **kw)
                for name in ("after", "on"):
                    if name in self.fields:
                        self.fields[name].disabled = True
                        self.fields[name].help_text = (
                            "Editing what this binding waits for needs the permission to "
                            "trigger runs."
                        )

        return EdgesReadOnly

    def save_model(self, request: HttpRequest, obj: JobBinding, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        # After the save: a source that does not answer never blocks it.
        notice = cursor_index_notice(obj)
        if notice is not None:
            self.message_user(request, notice, level=messages.WARNING)
        for notice in binding_checks_notices(obj):
            self.message_user(request, notice, level=messages.WARNING)

    list_display = [
        "name",
        "job",
        "source",
        "sink",
        "enabled",
        "max_concurrency",
        "running_count",
        "latest_run",
    ]
    list_filter = ["enabled", ("job", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["name", "job__name", "source__name", "sink__name"]
    list_select_related = ["job", "source", "sink"]
    ordering = ["name"]
    readonly_fields = ["created_at", "incremental_cursor", "health_state", "chain_edges"]
    actions = [
        changelist_action(TRIGGER, "trigger"),
        changelist_action(_enable_spec("jobbinding", True), "change"),
        changelist_action(_enable_spec("jobbinding", False), "change"),
        changelist_action(RESET_CURSOR, "reset_cursor"),
    ]
    object_actions = (TRIGGER, RESET_CURSOR, SET_CURSOR)
    inlines = [BindingAlertsInline]
    has_trigger_permission = _perm("trigger_binding")
    has_reset_cursor_permission = _perm("reset_cursor_binding")

    def get_queryset(self, request: HttpRequest) -> QuerySet[JobBinding]:
        latest = Run.objects.filter(binding=OuterRef("pk")).order_by("-created_at")
        return (
            super()
            .get_queryset(request)
            .annotate(
                latest_status=Subquery(latest.values("status")[:1]),
                latest_id=Subquery(latest.values("id")[:1]),
                running=_attempt_count(
                    "run__binding", run__binding=OuterRef("pk"), status=Status.RUNNING
                ),
            )
        )

    @admin.display(description="chain")
    def chain_edges(self, obj: JobBinding) -> SafeString:
        """Its upstreams (what it waits for) and downstreams (what waits for it)."""
        if obj.pk is None or obj._state.adding:
            return format_html("<em>{}</em>", "none")
        ups = BindingEdge.objects.filter(downstream_id=obj.pk).select_related("upstream")
        downs = BindingEdge.objects.filter(upstream_id=obj.pk).select_related("downstream")

        def row(label: str, edges: list[tuple[JobBinding, str]]) -> SafeString:
            links = format_html_join(
                ", ",
                "{} ({})",
                (
                    (_link(self, "admin:dispatch_jobbinding_change", b.pk, b.name), on.lower())
                    for b, on in edges
                ),
            )
            return format_html(
                '<div class="dsp-chain-{}">{}: {}</div>', label, label, links or "none"
            )

        return format_html(
            "{}{}",
            row("upstreams", [(e.upstream, e.on) for e in ups]),
            row("downstreams", [(e.downstream, e.on) for e in downs]),
        )

    @admin.display(description="incremental cursor")
    def incremental_cursor(self, obj: JobBinding) -> SafeString:
        """The console's copy of the cursor committed in the sink (the sink's row is the
        truth), when it moved and by which run or operator."""
        if not _incremental(obj):
            return format_html("<em>{}</em>", "not incremental (reads the whole source)")
        copy = BindingCursor.objects.filter(binding=obj).first()
        if copy is None or copy.cursor is None:
            state = "none committed: the next run reads the whole source"
            if copy is None:
                return format_html("<em>{}</em>", state)
            return format_html(
                "<em>{}</em> (reset by {} at {}, version {})",
                state,
                copy.changed_by or "operator",
                copy.recorded_at,
                copy.version,
            )
        by: Any = copy.changed_by or "operator"
        if copy.run_id is not None:
            by = _link(self, "admin:dispatch_run_change", copy.run_id, f"run {copy.run_id}")
        return format_html(
            "<code>({})</code> = <code>{}</code><br>moved at {} by {} (version {})",
            ", ".join(copy.columns or []),
            cursor_text(copy.cursor),
            copy.committed_at or copy.recorded_at,
            by,
            copy.version,
        )

    @admin.display(description="health")
    def health_state(self, obj: JobBinding) -> SafeString:
        """The failure streak the health scan keeps (dispatch.ops.alerts): warned or
        auto-disabled with the reason; re-enabling clears an auto-disable."""
        from dispatch.models.ops import BindingHealth, HealthState

        h = BindingHealth.objects.filter(binding=obj).first()
        if h is None:
            return format_html("<em>{}</em>", "no finished run scanned yet")
        if h.state == HealthState.OK and not h.consecutive_failures:
            return format_html("OK (last success {})", h.last_success_at or "—")
        return format_html(
            "{}: {} failed run(s) in a row since {}{}{}",
            HealthState(h.state).label,
            h.consecutive_failures,
            h.failing_since or "—",
            format_html(" — {}", h.reason) if h.reason else "",
            " (alerts muted)" if h.alerts_muted else "",
        )

    @admin.display(description="running", ordering="running")
    def running_count(self, obj: JobBinding) -> str:
        return f"{getattr(obj, 'running', 0)} / {obj.max_concurrency}"

    @admin.display(description="latest run")
    def latest_run(self, obj: JobBinding) -> SafeString:
        run_id = getattr(obj, "latest_id", None)
        if run_id is None:
            return format_html("{}", "—")
        return _link(
            self,
            "admin:dispatch_run_change",
            run_id,
            status_badge(getattr(obj, "latest_status", None)),
        )


# --- runs, attempts, workers --------------------------------------------------------------


class AttemptInline(admin.TabularInline):  # type: ignore[type-arg]
    """A run's attempts, rendered as a timeline (admin/dispatch/run/attempt_timeline.html)."""

    model = Attempt
    template = "admin/dispatch/run/attempt_timeline.html"
    fields = ["number"]
    readonly_fields = ["number"]
    extra = 0
    can_delete = False
    verbose_name_plural = "attempts"

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Attempt]:
        return (
            super()
            .get_queryset(request)
            .defer("source_snapshot", "sink_snapshot")
            .order_by("number")
            # Every attempt's events in one query (dispatch_attemptevent_seq_uniq), at
            # most DISPATCH_EVENTS_PER_ATTEMPT + 1 each.
            .prefetch_related(
                Prefetch("events", queryset=AttemptEvent.objects.order_by("attempt_id", "seq"))
            )
        )


def external_log_link(run_id: Any) -> str:
    """The run's page in the external log system (DISPATCH_EXTERNAL_LOG_URL with the
    run's id); "" when none is set, or when the template is one `dispatch.E021` refuses
    (system checks do not run under every server: an attribute or a format spec in it
    is never evaluated)."""
    template = conf.external_log_url()
    if not template or checks.external_log_url_problem(template):
        return ""
    return template.format(run_id=str(run_id))


def receipt_text(attempt: Attempt | None) -> str:
    """An attempt's receipt (rows and digest its sink committed) and its last
    verification on the sink, in one line; a dash when it has none."""
    if attempt is None or attempt.receipt_rows is None:
        return "—"
    text = f"{attempt.receipt_rows:,} rows, digest {attempt.receipt_digest or 'not computed'}"
    if attempt.receipt_verified_at is None:
        return text + "; not verified yet"
    when = date_format(localtime(attempt.receipt_verified_at), "DATETIME_FORMAT")
    return f"{text}; verified {when}: {attempt.receipt_verification}"


def _latest_attempt(field: str) -> Subquery:
    return Subquery(
        Attempt.objects.filter(run=OuterRef("pk")).order_by("-number").values(field)[:1]
    )


def _plan(run: str, field: str) -> Subquery:
    """A field of the slice plan of the run `run` names (its primary key: one probe)."""
    return Subquery(SlicePlan.objects.filter(run_id=OuterRef(run)).values(field)[:1])


@admin.register(Run)
class RunAdmin(HistoryAdmin):
    # Five columns, so the list fits 1,280 px beside the admin's menu and the filters: the
    # trigger goes under the run's id, the attempt count and the blocked reason under its
    # status, how long it took (or has taken so far) under its creation time.
    list_display = ["short_id", "binding", "status_badge", "created", "progress"]
    list_display_links = ["short_id"]
    list_filter = [
        "status",
        "trigger",
        # Every binding / job as a choice: "only those with runs" is a DISTINCT over all
        # runs (a full scan at a million).
        ("binding", admin.RelatedFieldListFilter),
        ("binding__job", admin.RelatedFieldListFilter),
        "created_at",
        "finished_at",
    ]
    search_fields = ["id", "binding__name", "binding__job__name", "requested_by", "idempotency_key"]
    list_select_related = ["binding"]
    ordering = ["-created_at"]
    list_max_show_all = 500
    # At a million rows (docs/console.md, "At scale"): no count of the unfiltered table,
    # a count of the filtered rows that stops at a cap, no date drill-down (it aggregates
    # every row's date); the list is read newest first through an index.
    show_full_result_count = False
    paginator = CappedPaginator
    inlines = [AttemptInline]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "binding_link",
                    "job_link",
                    "slice_link",
                    "status_badge",
                    "trigger",
                    "requested_by",
                    "created_at",
                    "finished_at",
                    "duration",
                    "cancel_requested_at",
                    "receipt",
                    "schema_changes_text",
                    "chain",
                ]
            },
        ),
        (
            "Schedule and idempotency",
            {
                "fields": ["schedule_id", "scheduled_for", "idempotency_key"],
                "classes": ["collapse"],
            },
        ),
    ]
    readonly_fields = fieldset_fields(fieldsets)  # every shown field is read-only
    actions = [
        changelist_action(CANCEL, "cancel"),
        changelist_action(RETRY, "retry"),
        changelist_action(RUN_NOW, "run_now"),
    ]
    object_actions = (CANCEL, RETRY, RUN_NOW, RELEASE_FROM_RUN)
    has_cancel_permission = _perm("cancel_run")
    has_retry_permission = _perm("retry_run")
    has_run_now_permission = _perm("run_now")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Run]:
        return (
            super()
            .get_queryset(request)
            .select_related("binding__job")
            .annotate(
                # Database time: a live run's duration runs on the server's clock, not ours.
                elapsed=ExpressionWrapper(
                    Coalesce(F("finished_at"), Now()) - F("created_at"),
                    output_field=DurationField(),
                ),
                n_attempts=_attempt_count("run", run=OuterRef("pk")),
                latest_blocked=_latest_attempt("blocked_reason"),
                latest_read=_latest_attempt("rows_read"),
                latest_written=_latest_attempt("rows_written"),
                latest_estimated=_latest_attempt("rows_estimated"),
                latest_status=_latest_attempt("status"),
                # Slices (docs/console.md, "Slices"): a slice run's plan total, a sliced
                # run's counters; each a primary-key probe of dispatch_sliceplan.
                slice_total=_plan("parent_id", "total"),
                plan_total=_plan("pk", "total"),
                plan_done=_plan("pk", "succeeded"),
                plan_rows=_plan("pk", "rows_written"),
            )
        )

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        # A run's page: its slice plan in the same query (a LEFT JOIN on the plan's key).
        queryset = self.get_queryset(request).select_related("slice_plan")
        model = queryset.model
        field = model._meta.pk if from_field is None else model._meta.get_field(from_field)
        try:
            return queryset.get(**{field.name: field.to_python(object_id)})  # type: ignore[union-attr]
        except (model.DoesNotExist, ValidationError, ValueError):
            return None

    def get_urls(self) -> list[URLPattern]:
        return [
            path("overview/", self.admin_site.admin_view(self.overview), name="dispatch_overview"),
            *super().get_urls(),
        ]

    def overview(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return overview_view(self, request)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra_context = {
            **(extra_context or {}),
            "overview_url": reverse("admin:dispatch_overview", current_app=self.admin_site.name),
        }
        return super().changelist_view(request, extra_context)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        response = super().change_view(request, object_id, form_url, extra_context)
        if isinstance(response, TemplateResponse):
            original = response.context_data.get("original") if response.context_data else None
            if original is not None:
                # A sliced run WAITING on its slices refreshes too.
                response.context_data["run_live"] = original.status in UNFINISHED_RUN_STATUSES  # type: ignore[index]
                response.context_data["sliced"] = console_slices.table(  # type: ignore[index]
                    original,
                    console_slices.page_number(request.GET.get("slices")),
                    self.admin_site.name,
                )
                response.context_data["release_perm"] = request.user.has_perm(RELEASE.perm)  # type: ignore[index]
                response.context_data["external_log_url"] = external_log_link(original.pk)  # type: ignore[index]
        return response

    @admin.display(description="run", ordering="id")
    def short_id(self, obj: Run) -> SafeString:
        """The id's first 8 characters; in the list, how the run came (the trigger) under it."""
        note = console_slices.list_note(obj)
        return format_html(
            '{}<span class="dsp-under">{}</span>',
            str(obj.pk)[:8],
            f"{obj.get_trigger_display()} · {note}" if note else obj.get_trigger_display(),
        )

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Run) -> SafeString:
        """The badge; in the list, the attempts (past the first) and why a pending run
        waits, under it."""
        badge = status_badge(obj.status)
        if obj.cancel_requested_at and obj.is_live:
            badge = format_html(
                '{} <span class="dsp-reason dsp-off">{}</span>', badge, "cancelling"
            )
        notes = []
        attempts = int(getattr(obj, "n_attempts", 0) or 0)
        if attempts > 1:
            notes.append(format_html("{} attempts", attempts))
        blocked = getattr(obj, "latest_blocked", None)
        if obj.status == Status.PENDING and blocked:
            notes.append(blocked_badge(blocked))
        if not notes:
            return badge
        return format_html(
            '{}<span class="dsp-under">{}</span>',
            badge,
            format_html_join(" ", "{}", ((n,) for n in notes)),
        )

    @admin.display(description="receipt")
    def receipt(self, obj: Run) -> str:
        """The receipt of the run's delivery (its attempt that committed one)."""
        return receipt_text(
            Attempt.objects.filter(run=obj, receipt_rows__isnull=False)
            .only("receipt_rows", "receipt_digest", "receipt_verified_at", "receipt_verification")
            .order_by("-number")
            .first()
        )

    @admin.display(description="schema changes")
    def schema_changes_text(self, obj: Run) -> str:
        """What the run's delivery changed in (or found missing from) its sink table."""
        attempt = (
            Attempt.objects.filter(run=obj, schema_changes__isnull=False)
            .only("schema_changes")
            .order_by("-number")
            .first()
        )
        return describe_changes(attempt.schema_changes or []) if attempt else "-"

    @admin.display(description="duration")  # not sortable: a computed value sorts every row
    def duration(self, obj: Run) -> str:
        elapsed = getattr(obj, "elapsed", None)
        return duration_text(elapsed.total_seconds() if elapsed is not None else None)

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Run) -> SafeString:
        """When the run was created, and under it how long it took (or has taken so far,
        in database time)."""
        took = self.duration(obj)
        created = localtime(obj.created_at) if is_aware(obj.created_at) else obj.created_at
        return format_html(
            '{}<span class="dsp-under">{}</span>',
            date_format(created, "DATETIME_FORMAT"),
            f"took {took}" if obj.finished_at is not None else f"{took} so far",
        )

    @admin.display(description="rows")
    def progress(self, obj: Run) -> SafeString:
        # The list's annotations: rows and the estimate of the latest attempt (its rate
        # and time left are on the run's page); a sliced run's: its slices done and rows.
        sliced = console_slices.list_progress(obj)
        if sliced is not None:
            return sliced
        return progress_bar(
            Progress(
                status=getattr(obj, "latest_status", None) or "",
                rows_read=getattr(obj, "latest_read", 0) or 0,
                rows_written=getattr(obj, "latest_written", 0) or 0,
                rows_estimated=getattr(obj, "latest_estimated", None),
            )
        )

    @admin.display(description="binding")
    def binding_link(self, obj: Run) -> SafeString:
        return _link(self, "admin:dispatch_jobbinding_change", obj.binding_id, obj.binding.name)

    @admin.display(description="chain")
    def chain(self, obj: Run) -> SafeString:
        """The runs this run was caused by (its upstream bindings' runs in its chain) and
        those it caused (its downstream bindings' runs), with their statuses."""
        root = obj.chain_root
        ups = BindingEdge.objects.filter(downstream_id=obj.binding_id).values_list(
            "upstream_id", flat=True
        )
        downs = BindingEdge.objects.filter(upstream_id=obj.binding_id).values_list(
            "downstream_id", flat=True
        )
        in_chain = Q(pk=root) | Q(chain_root_id=root)
        caused_by = (
            Run.objects.filter(in_chain, binding_id__in=list(ups)).select_related("binding")
            if obj.chain_root_id is not None
            else Run.objects.none()
        )
        caused = Run.objects.filter(chain_root_id=root, binding_id__in=list(downs)).select_related(
            "binding"
        )

        def runs(label: str, slug: str, found: Any) -> SafeString:
            links = format_html_join(
                " ",
                '<span class="dsp-chain-run">{} {}</span>',
                (
                    (
                        _link(self, "admin:dispatch_run_change", r.pk, r.binding.name),
                        status_badge(r.status),
                    )
                    for r in found.order_by("created_at")
                ),
            )
            return format_html(
                '<div class="dsp-chain-{}">{}: {}</div>', slug, label, links or "none"
            )

        head = format_html("")
        if obj.chain_root_id is not None:
            started = Run.objects.filter(pk=root).select_related("binding").first()
            text = f"{started.binding.name} ({started.trigger.lower()})" if started else "deleted"
            head = format_html(
                '<div class="dsp-chain-root">chain begun by: {}</div>',
                _link(self, "admin:dispatch_run_change", root, text) if started else text,
            )
        return format_html(
            "{}{}{}",
            head,
            runs("caused by", "upstream", caused_by),
            runs("caused", "downstream", caused),
        )

    @admin.display(description="slice of")
    def slice_link(self, obj: Run) -> SafeString:
        return console_slices.slice_of(obj, self.admin_site.name)

    @admin.display(description="job")
    def job_link(self, obj: Run) -> SafeString:
        return _link(self, "admin:dispatch_job_change", obj.binding.job_id, obj.binding.job.name)


def _json_block(value: Any) -> SafeString:
    if value is None:
        return format_html("<em>{}</em>", "none")
    return format_html(
        '<pre class="dsp-json">{}</pre>', json.dumps(value, indent=2, sort_keys=True)
    )


@admin.register(Attempt)
class AttemptAdmin(HistoryAdmin):
    list_display = [
        "__str__",
        "binding",
        "number",
        "status_badge",
        "origin",
        "worker_id",
        "claimed_at",
        "heartbeat_at",
        "lease_until",
        "finished_at",
        "reason_badge",
        "blocked",
        "progress",
    ]
    list_filter = [
        "status",
        "origin",
        "reason",
        "blocked_reason",
        ("run__binding", admin.RelatedFieldListFilter),
        "created_at",
        "finished_at",
    ]
    search_fields = ["run__id", "worker_id", "run__binding__name", "run__binding__job__name"]
    list_select_related = ["run__binding"]
    ordering = ["-created_at"]
    list_max_show_all = 500
    # At a million rows (docs/console.md, "At scale"): no count of the unfiltered table,
    # a count of the filtered rows that stops at a cap, no date drill-down (it aggregates
    # every row's date); the list is read newest first through an index.
    show_full_result_count = False
    paginator = CappedPaginator
    # The ciphertext snapshots are never shown: only the redacted copies.
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "run_link",
                    "number",
                    "origin_text",
                    "status_badge",
                    "reason_badge",
                    "error",
                    "blocked",
                    "progress_detail",
                    "receipt",
                    "schema_changes_text",
                ]
            },
        ),
        (
            "Lease",
            {
                "fields": [
                    "worker_id",
                    "lease_token",
                    "created_at",
                    "available_at",
                    "claimed_at",
                    "heartbeat_at",
                    "lease_until",
                    "finished_at",
                ]
            },
        ),
        (
            "Datasource snapshot (secrets masked)",
            {
                "fields": [
                    "source_link",
                    "source_version",
                    "source_redacted_view",
                    "sink_link",
                    "sink_version",
                    "sink_redacted_view",
                    "datasources_resolved_at",
                ],
            },
        ),
    ]
    readonly_fields = fieldset_fields(fieldsets)  # every shown field is read-only
    actions = [changelist_action(RELEASE, "release")]
    object_actions = (RELEASE,)
    has_release_permission = _perm("release_attempt")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Attempt]:
        return (
            super()
            .get_queryset(request)
            .select_related("run__binding", "source", "sink")
            .defer("source_snapshot", "sink_snapshot")
        )

    @admin.display(description="binding", ordering="run__binding__name")
    def binding(self, obj: Attempt) -> str:
        return obj.run.binding.name

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Attempt) -> SafeString:
        return status_badge(obj.status)

    @admin.display(description="reason", ordering="reason")
    def reason_badge(self, obj: Attempt) -> SafeString:
        return reason_badge(obj.reason)

    @admin.display(description="origin")
    def origin_text(self, obj: Attempt) -> str:
        return f"{obj.origin} ({ORIGIN_LABEL.get(obj.origin, '')})"

    @admin.display(description="blocked")
    def blocked(self, obj: Attempt) -> SafeString:
        return blocked_badge(obj.blocked_reason if obj.status == Status.PENDING else None)

    @admin.display(description="progress")
    def progress(self, obj: Attempt) -> SafeString:
        return progress_bar(Progress.of(obj))

    @admin.display(description="progress")
    def progress_detail(self, obj: Attempt) -> SafeString:
        return progress_bar(Progress.of(obj), detail=True)

    @admin.display(description="receipt")
    def receipt(self, obj: Attempt) -> str:
        return receipt_text(obj)

    @admin.display(description="schema changes")
    def schema_changes_text(self, obj: Attempt) -> str:
        return describe_changes(obj.schema_changes) if obj.schema_changes else "-"

    @admin.display(description="run")
    def run_link(self, obj: Attempt) -> SafeString:
        return _link(self, "admin:dispatch_run_change", obj.run_id, obj.run_id)

    @admin.display(description="source")
    def source_link(self, obj: Attempt) -> SafeString:
        if obj.source_id is None:
            return format_html("{}", "—")
        return _link(self, "admin:dispatch_datasource_change", obj.source_id, obj.source)

    @admin.display(description="sink")
    def sink_link(self, obj: Attempt) -> SafeString:
        if obj.sink_id is None:
            return format_html("{}", "—")
        return _link(self, "admin:dispatch_datasource_change", obj.sink_id, obj.sink)

    @admin.display(description="source settings")
    def source_redacted_view(self, obj: Attempt) -> SafeString:
        return _json_block(obj.source_redacted)

    @admin.display(description="sink settings")
    def sink_redacted_view(self, obj: Attempt) -> SafeString:
        return _json_block(obj.sink_redacted)


WORKER_FIELDS: list[str] = [
    "id",
    "host",
    "pid",
    "concurrency",
    "started_at",
    "heartbeat_at",
    "heartbeat_age",
    "stopped_at",
    "held_attempts",
    "stats_view",
]


@admin.register(Worker)
class WorkerAdmin(HistoryAdmin):
    list_display = [
        "id",
        "host",
        "pid",
        "concurrency",
        "started_at",
        "heartbeat_at",
        "heartbeat_age",
        "stopped_at",
        "held",
    ]
    list_filter = [("stopped_at", admin.EmptyFieldListFilter), "host"]
    search_fields = ["id", "host"]
    ordering = ["-started_at"]
    fields = WORKER_FIELDS  # type: ignore[assignment]
    readonly_fields = WORKER_FIELDS

    def get_queryset(self, request: HttpRequest) -> QuerySet[Worker]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                age=ExpressionWrapper(Now() - F("heartbeat_at"), output_field=DurationField()),
                n_held=_attempt_count("worker_id", worker_id=OuterRef("pk"), status=Status.RUNNING),
            )
        )

    @admin.display(description="heartbeat age", ordering="-heartbeat_at")
    def heartbeat_age(self, obj: Worker) -> str:
        age = getattr(obj, "age", None)
        text = duration_text(age.total_seconds() if age is not None else None)
        return "stopped" if obj.stopped_at else text

    @admin.display(description="running attempts", ordering="n_held")
    def held(self, obj: Worker) -> int:
        return int(getattr(obj, "n_held", 0))

    @admin.display(description="running attempts")
    def held_attempts(self, obj: Worker) -> SafeString:
        attempts = (
            Attempt.objects.running()
            .filter(worker_id=obj.pk)
            .select_related("run__binding")
            .defer("source_snapshot", "sink_snapshot")
            .order_by("claimed_at")
        )
        rows = [
            (
                reverse(
                    "admin:dispatch_attempt_change", args=[a.pk], current_app=self.admin_site.name
                ),
                a.run.binding.name,
                a.number,
                a.run_id,
            )
            for a in attempts
        ]
        if not rows:
            return format_html("{}", "none")
        return format_html(
            "<ul>{}</ul>",
            format_html_join("", '<li><a href="{}">{} attempt {}</a> (run {})</li>', rows),
        )

    @admin.display(description="counters")
    def stats_view(self, obj: Worker) -> SafeString:
        return _json_block(obj.stats or {})


@admin.register(BulkOperation)
class BulkOperationAdmin(HistoryAdmin):
    """A bulk operation's page: its status, progress, skipped rows with their reasons and
    a cancel button (docs/console.md, "Bulk operations")."""

    list_display = ["id", "summary", "status", "progress", "requester", "created_at"]
    list_filter = ["status", "model", "action"]
    ordering = ["-id"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "summary",
                    "filter_text",
                    "status",
                    "progress",
                    "requester",
                    "created_at",
                    "updated_at",
                    "finished_at",
                    "cancelled_by",
                    "error",
                ]
            },
        ),
    ]
    readonly_fields = fieldset_fields(fieldsets)
    object_actions = (CANCEL_BULK,)

    @admin.display(description="operation")
    def summary(self, obj: BulkOperation) -> str:
        model = obj.model
        label = (
            ops_bulk.ACTIONS[(model, obj.action)].label
            if (model, obj.action) in ops_bulk.ACTIONS
            else obj.action
        )
        return f"{label}: all {ops_bulk.MODELS[model]._meta.verbose_name_plural if model in ops_bulk.MODELS else model} matching"

    @admin.display(description="requested by", ordering="requested_by_name")
    def requester(self, obj: BulkOperation) -> str:
        return obj.requested_by_name

    @admin.display(description="filter")
    def filter_text(self, obj: BulkOperation) -> str:
        return console_bulk.filter_text(obj)

    @admin.display(description="progress")
    def progress(self, obj: BulkOperation) -> SafeString:
        return console_bulk.progress_html(obj)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        response = super().change_view(request, object_id, form_url, extra_context)
        context = getattr(response, "context_data", None)
        original = context.get("original") if context else None
        if context is not None and original is not None:
            context["bulk_live"] = console_bulk.is_live(original)
            context["skips"] = console_bulk.skips_page(original, request.GET.get("after"))
        return response


@admin.register(Overview)
class OverviewAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The admin index's "Overview" entry: its list page is the console's overview."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.has_perm("dispatch.view_run"))

    def has_module_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return HttpResponseRedirect(
            reverse("admin:dispatch_overview", current_app=self.admin_site.name)
        )
