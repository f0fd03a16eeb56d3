"""The console's side of bulk operations (docs/console.md, "Bulk operations"): the
"apply to all N matching" links on a list, the confirmation page that stores the request,
and an operation's own page (its ModelAdmin is `BulkOperationAdmin` in
`dispatch.console.admin`). The work is the maintenance loop's (`dispatch.ops.bulk`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from dispatch.console.paging import COUNT_CAP, capped_count
from dispatch.models import BulkOperation, BulkSkip, BulkStatus, Job, JobBinding
from dispatch.ops import bulk

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

# The skipped rows a page of an operation lists (the history has each one's entry too).
SKIPS_SHOWN = 100


def _query(request: HttpRequest) -> str:
    return urlencode(list(request.GET.lists()), doseq=True)


def _changelist_url(modeladmin: ModelAdmin[Any], request: HttpRequest) -> str:
    opts = modeladmin.model._meta
    url = reverse(
        f"admin:{opts.app_label}_{opts.model_name}_changelist",
        current_app=modeladmin.admin_site.name,
    )
    query = _query(request)
    return f"{url}?{query}" if query else url


def count_text(n: int) -> str:
    return f"more than {COUNT_CAP:,}" if n > COUNT_CAP else f"{n:,}"


def links(modeladmin: ModelAdmin[Any], request: HttpRequest, count: int) -> list[dict[str, str]]:
    """The list's "apply to all N matching" links: one per bulk action the user may
    apply, each to its confirmation page with the list's query string."""
    opts = modeladmin.model._meta
    model = str(opts.model_name)
    if model not in bulk.FILTERS or not count:
        return []
    query = _query(request)
    found = []
    for spec in bulk.actions_of(model):
        if not request.user.has_perm(spec.perm):
            continue
        url = reverse(
            f"admin:{opts.app_label}_{model}_bulk",
            args=[spec.name],
            current_app=modeladmin.admin_site.name,
        )
        found.append({"label": spec.label, "url": f"{url}?{query}" if query else url})
    return found


def request_view(modeladmin: ModelAdmin[Any], request: HttpRequest, action: str) -> HttpResponse:
    """GET: the confirmation page (the filter, the count, the action). POST with
    `post=yes`: the operation stored, and back to the list with a link to its page. A
    filter that does not validate: back to the list with the reason."""
    opts = modeladmin.model._meta
    model = str(opts.model_name)
    spec = bulk.ACTIONS.get((model, action))
    if spec is None:
        raise Http404(f"no bulk action {action!r}")
    # The list's permission and the action's, as for the one-at-a-time action.
    if not (modeladmin.has_view_permission(request) and request.user.has_perm(spec.perm)):
        raise PermissionDenied
    back = _changelist_url(modeladmin, request)
    params = dict(request.GET.lists())
    try:
        filters = bulk.validate_filters(model, params)
    except bulk.BulkRequestError as exc:
        modeladmin.message_user(request, f"{spec.label} of all matching: {exc}", messages.ERROR)
        return HttpResponseRedirect(back)
    if request.method == "POST" and request.POST.get("post") == "yes":
        try:
            operation = bulk.request(model, action, params, request.user)
        except bulk.BulkRequestError as exc:
            modeladmin.message_user(request, f"{spec.label} of all matching: {exc}", messages.ERROR)
            return HttpResponseRedirect(back)
        page = reverse(
            "admin:dispatch_bulkoperation_change",
            args=[operation.pk],
            current_app=modeladmin.admin_site.name,
        )
        modeladmin.message_user(
            request,
            format_html(
                "{}: bulk operation {} requested for {} {}; the workers apply it in batches. "
                '<a href="{}">Follow it on its page</a>.',
                spec.label,
                operation.pk,
                f"{operation.total:,}",
                opts.verbose_name if operation.total == 1 else opts.verbose_name_plural,
                page,
            ),
            messages.SUCCESS,
        )
        return HttpResponseRedirect(back)
    count = capped_count(bulk.matching(model, filters))
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": f"{spec.label} all matching: are you sure?",
        "spec": spec,
        "opts": opts,
        "filters": sorted(filters.items()),
        "count": count_text(count),
        "back": back,
        "media": modeladmin.media,
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, "admin/dispatch/bulk_confirmation.html", context)


# The id filters, and the model whose name the page shows beside the id.
NAMED = {
    "binding__id__exact": JobBinding,
    "binding__job__id__exact": Job,
    "job__id__exact": Job,
}


def filter_text(operation: BulkOperation) -> str:
    parts = []
    for key, value in sorted(operation.filters.items()):
        model = NAMED.get(key)
        name = (
            model._default_manager.filter(pk=value).values_list("name", flat=True).first()
            if model
            else None
        )
        parts.append(f"{key} = {value}" + (f" ({name})" if name else ""))
    return ", ".join(parts) or "(none: all)"


def progress_html(operation: BulkOperation) -> SafeString:
    handled = operation.done + operation.skipped
    # The total is the count at request time: rows that came to match since can make
    # `handled` pass it (the bar is full then).
    percent = 100 if operation.total == 0 else min(100, round(100 * handled / operation.total))
    return format_html(
        '<span class="dsp-progress" data-done="{}" data-skipped="{}" data-total="{}">'
        '<progress max="100" value="{}"></progress> {} done, {} skipped of {} ({} %)</span>',
        operation.done,
        operation.skipped,
        operation.total,
        percent,
        f"{operation.done:,}",
        f"{operation.skipped:,}",
        f"{operation.total:,}",
        percent,
    )


@dataclass
class SkipsPage:
    """A page of an operation's skipped rows, read by keyset (id > after) on
    dispatch_bulkskip_op_idx: any page costs the same."""

    rows: list[BulkSkip]
    after: int  # the id the page starts after (0: the first page)
    next_after: int | None  # the last id shown, when more follow


def skips_page(operation: BulkOperation, after_raw: str | None) -> SkipsPage:
    try:
        after = max(0, int(after_raw or "0"))
    except ValueError:
        after = 0
    rows = list(
        BulkSkip.objects.filter(operation=operation, id__gt=after).order_by("id")[: SKIPS_SHOWN + 1]
    )
    more = len(rows) > SKIPS_SHOWN
    rows = rows[:SKIPS_SHOWN]
    return SkipsPage(rows, after, rows[-1].pk if more else None)


def is_live(operation: BulkOperation) -> bool:
    return operation.status == BulkStatus.PENDING
