"""A sliced run in the console: its slices as a table (a page of them: a run may have
100,000), the run's progress as the sum of its slices, and the note the run list shows
under a slice run or a sliced one (docs/console.md, "Slices").

Every figure is read from the database (`dispatch.services.run_slices`: the plan's
counters, the slices' rows and their attempts' database times), in a fixed number of
queries whatever the number of slices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from dispatch import services
from dispatch.console.badges import status_badge
from dispatch.core.progress import Progress, rate_text
from dispatch.models import Run, Slice, SlicePlan

# Slices per page of a sliced run's table.
SLICE_PAGE = 100


@dataclass(frozen=True)
class SliceRow:
    number: int
    label: str
    state: str  # done, running, waiting, failed
    queued: bool  # waiting: its run exists (queued) rather than not started yet
    status: SafeString  # the slice run's badge ("—" when not started)
    attempts: int
    rows_read: str  # "1,234"
    rows_written: str
    rate: str
    progress: SafeString
    url: str  # its slice run's page ("" when not started)
    error: str  # the first line of its latest attempt's error


def page_number(raw: str | None) -> int:
    """The `slices` query parameter: a page from 1; anything else is page 1."""
    try:
        page = int(raw or "1")
    except ValueError:
        return 1
    return max(1, page)


def plan_of(run: Run) -> SlicePlan | None:
    """The run's plan when the run was read with select_related("slice_plan") (no query);
    None for a run that is not sliced (or not planned yet)."""
    try:
        return run.slice_plan  # type: ignore[no-any-return]
    except SlicePlan.DoesNotExist:
        return None


def table(run: Run, page: int, site: str = "admin") -> dict[str, Any] | None:
    """The context of a sliced run's slice table and summary; None for any other run."""
    plan = plan_of(run)
    if plan is None:
        return None
    pages = max(1, -(-plan.total // SLICE_PAGE))
    page = min(page, pages)
    view = services.run_slices(run, offset=(page - 1) * SLICE_PAGE, limit=SLICE_PAGE)
    if view is None:  # the plan went away with its run meanwhile
        return None
    rows = [
        SliceRow(
            number=s.number,
            label=s.label,
            state=s.state,
            queued=s.run_id is not None and s.state == "waiting",
            status=status_badge(s.status),
            attempts=s.attempts,
            rows_read=f"{s.progress.rows_read:,}",
            rows_written=f"{s.progress.rows_written:,}",
            rate=rate_text(s.progress.rate),
            progress=slice_bar(s.progress),
            url=(
                reverse(f"{site}:dispatch_run_change", args=[s.run_id])
                if s.run_id is not None
                else ""
            ),
            error=s.error.strip().splitlines()[0] if s.error.strip() else "",
        )
        for s in view.slices
    ]
    counts = view.counts
    first = (page - 1) * SLICE_PAGE + 1
    return {
        "plan": plan,
        "rows": rows,
        "counts": counts,
        "summary": summary(view, run),
        "page": page,
        "pages": pages,
        "first": first,
        "last": first + len(rows) - 1,
        "previous": page - 1 if page > 1 else None,
        "next": page + 1 if page < pages else None,
    }


def slice_bar(p: Progress) -> SafeString:
    """A slice's bar, compact (its rows are in their own columns): rows read against its
    estimate and the percentage; full once done; "—" before its first heartbeat."""
    fraction = p.fraction
    if not p.started or fraction is None:
        return format_html("{}", "—")
    return format_html(
        '<span class="dsp-progress"><progress max="100" value="{}"></progress> {} %</span>',
        round(100 * fraction),
        f"{100 * fraction:.0f}",
    )


def run_rate(view: services.SlicedRunView, run: Run) -> float | None:
    """Rows per second of the whole run: while it copies, its running slices' rates
    together (as of their last heartbeats); once finished, the rows its slices wrote over
    the run's time, trigger to end (database time)."""
    if run.finished_at is not None:
        seconds = (run.finished_at - run.created_at).total_seconds()
        return view.plan.rows_written / seconds if seconds > 0 and view.plan.rows_written else None
    return view.rate


def summary(view: services.SlicedRunView, run: Run) -> SafeString:
    """The run's progress as the sum of its slices: a bar of the slices done, the rows
    written (slices done, and running ones as of their last heartbeat) and the rate."""
    plan = view.plan
    done = plan.succeeded
    parts = [f"{done:,} of {plan.total:,} slices done ({100 * done / plan.total:.0f} %)"]
    parts.append(f"{view.rows_written:,} rows written")
    rate = rate_text(run_rate(view, run))
    if rate:
        parts.append(rate)
    return format_html(
        '<span class="dsp-progress" id="dsp-slices-progress" title="{}">'
        '<progress max="{}" value="{}"></progress> {}</span>',
        f"{plan.rows_written:,} rows written by the slices done",
        plan.total,
        done,
        " · ".join(parts),
    )


def slice_of(run: Run, site: str = "admin") -> SafeString:
    """A slice run's place, for its page: "slice 3 of 8 (id >= 250 and < 375) of run
    1a2b3c4d" linking to the sliced run; "—" for any other run."""
    if run.parent_id is None:
        return format_html("{}", "—")
    row = Slice.objects.filter(run_id=run.pk).values("lower", "upper").first()
    plan = SlicePlan.objects.filter(run_id=run.parent_id).values("total", "key").first()
    total = f" of {plan['total']:,}" if plan else ""
    label = (
        f" ({services.slice_label(plan['key'], row['lower'], row['upper'])})"
        if plan and row
        else ""
    )
    return format_html(
        'slice {}{}{} of run <a href="{}">{}</a>',
        run.slice_number,
        total,
        label,
        reverse(f"{site}:dispatch_run_change", args=[run.parent_id]),
        str(run.parent_id)[:8],
    )


def list_note(run: Any) -> str:
    """What the run list says under a run's id about slices, from the row's annotations
    (no query): "slice 3/8 of 1a2b3c4d", "sliced: 3/8 done", or ""."""
    if run.parent_id is not None:
        total = getattr(run, "slice_total", None)
        of = f"/{total}" if total else ""
        return f"slice {run.slice_number}{of} of {str(run.parent_id)[:8]}"
    total = getattr(run, "plan_total", None)
    if total:
        return f"sliced: {getattr(run, 'plan_done', 0) or 0}/{total} done"
    return ""


def list_progress(run: Any) -> SafeString | None:
    """A sliced run's bar in the list: slices done of all, and their rows (None: not a
    sliced run, the latest attempt's bar applies)."""
    total = getattr(run, "plan_total", None)
    if not total:
        return None
    done = getattr(run, "plan_done", 0) or 0
    rows = getattr(run, "plan_rows", 0) or 0
    return format_html(
        '<span class="dsp-progress" title="{}"><progress max="{}" value="{}"></progress> '
        "{} rows</span>",
        f"{done:,} of {total:,} slices done",
        total,
        done,
        f"{rows:,}",
    )


__all__ = ["SLICE_PAGE", "SliceRow", "list_note", "list_progress", "page_number", "table"]
