"""The action runner that every admin action and object button goes through.

Every action calls the service function the management commands use, writes one admin
history entry per object (who, what, outcome, refusals too) and reports counts of what
was done and what was skipped and why.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from dispatch.services import ActionRefused

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin
from dispatch.console.badges import DETAILED_REFUSALS, OUTCOME_TEXT, REFUSAL_TEXT

# --- actions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionSpec:
    """One operator action: the service it calls and how it is guarded and shown."""

    name: str
    label: str  # button and action label
    perm: str  # "app_label.codename" the user must hold
    destructive: bool  # a confirmation page first
    call: Callable[[HttpRequest, Any], ActionResult]  # raises ActionRefused to refuse
    describe: str = ""  # one line on the confirmation page
    applies: Callable[[Any], bool] = lambda obj: True  # show the object button?
    # A value the confirmation page asks for (posted as `value`; `call` reads it).
    input_label: str = ""


@dataclass
class ActionResult:
    outcome: str  # a services.Outcome or another code of OUTCOME_TEXT
    detail: str = ""  # for the history entry (e.g. the new run's id)
    warning: str = ""  # shown to the operator as a warning (e.g. the run waits)
    created: Any = None  # a row the action created (a run)


@dataclass
class ActionReport:
    done: Counter[str] = field(default_factory=Counter)  # outcome code -> count
    # refusal code -> (object, message) pairs
    skipped: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))
    notes: list[str] = field(default_factory=list)  # extra warnings (e.g. a blocked run)
    created: list[Any] = field(default_factory=list)  # rows the action created (runs)

    @property
    def done_count(self) -> int:
        return sum(self.done.values())

    @property
    def skipped_count(self) -> int:
        return sum(len(v) for v in self.skipped.values())


def run_action(
    modeladmin: ModelAdmin[Any], request: HttpRequest, objects: Iterable[Model], spec: ActionSpec
) -> ActionReport:
    """Apply `spec` to each object; record every outcome (refusals too) in the history and
    tell the operator what was done and what was skipped and why."""
    report = ActionReport()
    for obj in objects:
        try:
            result = spec.call(request, obj)
        except ActionRefused as refused:
            report.skipped[refused.code].append((str(obj), refused.message))
            modeladmin.log_change(
                request, obj, f"{spec.label}: refused ({refused.code}): {refused.message}"
            )
            continue
        report.done[result.outcome] += 1
        if result.warning:
            report.notes.append(result.warning)
        if result.created is not None:
            report.created.append(result.created)
        detail = "; ".join(x for x in (result.detail, result.warning) if x)
        modeladmin.log_change(
            request, obj, f"{spec.label}: {result.outcome}" + (f" ({detail})" if detail else "")
        )
    _report_messages(modeladmin, request, spec, report)
    return report


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


def _report_messages(
    modeladmin: ModelAdmin[Any], request: HttpRequest, spec: ActionSpec, report: ActionReport
) -> None:
    opts = modeladmin.model._meta
    if report.done:
        parts = [
            f"{_plural(n, str(opts.verbose_name), str(opts.verbose_name_plural))} "
            f"{OUTCOME_TEXT.get(code, code.lower())}"
            for code, n in sorted(report.done.items())
        ]
        modeladmin.message_user(
            request, f"{spec.label}: " + "; ".join(parts) + ".", messages.SUCCESS
        )
    for note in report.notes:
        modeladmin.message_user(request, note, messages.WARNING)
    if report.skipped:
        parts = []
        for code, pairs in sorted(report.skipped.items()):
            if code in DETAILED_REFUSALS:
                # The error text is the point (it is secret-free by the connector contract
                # and scrubbed again by the caller).
                names = [f"{name}: {message}" for name, message in pairs]
            else:
                names = [name for name, _ in pairs]
            parts.append(
                f"{len(pairs)} {REFUSAL_TEXT.get(code, code.lower())} ({', '.join(names[:5])}"
                f"{', ...' if len(names) > 5 else ''})"
            )
        modeladmin.message_user(
            request,
            f"{spec.label}: skipped {_plural(report.skipped_count, str(opts.verbose_name), str(opts.verbose_name_plural))}: "
            + "; ".join(parts)
            + ".",
            messages.WARNING if report.done else messages.ERROR,
        )
    if not report.done and not report.skipped:
        modeladmin.message_user(request, f"{spec.label}: nothing selected.", messages.WARNING)


def confirmation_page(
    modeladmin: ModelAdmin[Any],
    request: HttpRequest,
    spec: ActionSpec,
    objects: Sequence[Model],
    *,
    action_url: str | None = None,
) -> HttpResponse:
    """The page a destructive action shows first; posting it back (with `post=yes`)
    applies the action. `action_url` set = an object button, else a changelist action."""
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": f"{spec.label}: are you sure?",
        "spec": spec,
        "objects": objects,
        "opts": opts,
        "action_url": action_url,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media,
    }
    return TemplateResponse(request, "admin/dispatch/action_confirmation.html", context)
