"""Progress as the console and `trigger --wait` show it: rows read against the source's
estimate, the rate and the time left, from an attempt's own times (database time)."""

from __future__ import annotations

import io
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from dispatch.api import RunResult
from dispatch.console.badges import progress_bar
from dispatch.core.progress import Progress, describe
from dispatch.management.progress import WaitDisplay, summary_lines

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def attempt(status: str, read: int, written: int, estimated: int | None, seconds: float) -> object:
    return SimpleNamespace(
        status=status,
        rows_read=read,
        rows_written=written,
        rows_estimated=estimated,
        claimed_at=T0,
        heartbeat_at=T0 + timedelta(seconds=seconds) if status == "RUNNING" else T0,
        finished_at=None if status == "RUNNING" else T0 + timedelta(seconds=seconds),
    )


def test_progress__running_with_an_estimate_has_percent_rate_and_time_left() -> None:
    p = Progress.of(attempt("RUNNING", 250_000, 240_000, 1_000_000, 10))
    assert (p.total, p.fraction, p.rate, p.eta_seconds) == (1_000_000, 0.25, 25_000, 30)
    assert describe(p) == (
        "250,000 of about 1,000,000 rows read (25 %), 240,000 written, 25,000 rows/s, "
        "about 30.0 s left"
    )
    html = progress_bar(p, detail=True)
    assert '<progress max="100" value="25"></progress> 250,000 of ~1,000,000 rows (25 %)' in html
    assert "· 240,000 written · 25,000 rows/s · about 30.0 s left" in html


def test_progress__past_its_estimate_the_total_is_unknown_not_over_100_percent() -> None:
    p = Progress.of(attempt("RUNNING", 1_200, 1_200, 1_000, 2))
    assert (p.total, p.fraction, p.eta_seconds) == (None, None, None)
    assert p.rate == 600
    html = progress_bar(p)
    assert "<progress></progress> 1,200 rows" in html  # indeterminate


def test_progress__finished_shows_what_was_read_and_a_failure_where_it_stopped() -> None:
    done = Progress.of(attempt("SUCCEEDED", 9_000, 9_000, 100_000, 3))
    assert (done.total, done.fraction, done.rate, done.eta_seconds) == (9_000, 1.0, 3_000, None)
    assert '<progress max="100" value="100"></progress> 9,000 rows' in progress_bar(done)
    failed = Progress.of(attempt("FAILED", 40, 0, 100, 1))
    assert (failed.fraction, failed.eta_seconds) == (0.4, None)
    assert "40 of ~100 rows (40 %)" in progress_bar(failed)
    assert progress_bar(Progress.of(SimpleNamespace(status="PENDING"))) == "—"


def _result(status: str, error: str, p: Progress, attempts: int = 1) -> RunResult:
    return RunResult(
        run_id=uuid.UUID(int=7),
        binding="b",
        status=status,
        attempts=attempts,
        reason="ERROR" if error else None,
        error=error,
        created_at=T0,
        finished_at=T0,
        duration_seconds=83.25,
        progress=p,
    )


def test_summary__status_duration_reason_first_error_line_and_rows() -> None:
    failed = _result(
        "FAILED",
        '\nsource read: relation "x" does not exist\nLINE 1: ...',
        Progress.of(attempt("FAILED", 5, 3, 10, 0.5)),
        attempts=3,
    )
    assert summary_lines(failed) == [
        f"Run {failed.run_id} FAILED in 1 min 23 s (3 attempts), reason ERROR.",
        'Error: source read: relation "x" does not exist',
        "Rows: 5 read, 3 written (about 10 expected), 10 rows/s.",
    ]
    ok = _result("SUCCEEDED", "", Progress.of(attempt("SUCCEEDED", 100, 100, 90, 0)))
    assert summary_lines(ok) == [
        f"Run {ok.run_id} SUCCEEDED in 1 min 23 s (1 attempt).",
        "Rows: 100 read, 100 written.",
    ]


def test_wait_display__plain_lines_when_something_new_is_known_then_at_most_every_period() -> None:
    out = io.StringIO()
    display = WaitDisplay(out, tty=False, every=3600)
    pending = _result("PENDING", "", Progress())
    display.update(pending)
    display.update(pending)
    running = Progress.of(attempt("RUNNING", 0, 0, None, 0))
    display.update(_result("RUNNING", "", running))
    with_total = Progress.of(attempt("RUNNING", 0, 0, 1000, 0))
    display.update(_result("RUNNING", "", with_total))
    with_rate = Progress.of(attempt("RUNNING", 100, 100, 1000, 1))
    display.update(_result("RUNNING", "", with_rate))
    display.update(_result("RUNNING", "", Progress.of(attempt("RUNNING", 200, 200, 1000, 2))))
    lines = out.getvalue().splitlines()
    run = uuid.UUID(int=7)
    assert lines == [
        f"Run {run} PENDING",
        f"Run {run} RUNNING: 0 rows read, 0 written",
        f"Run {run} RUNNING: 0 of about 1,000 rows read (0 %), 0 written",
        f"Run {run} RUNNING: 100 of about 1,000 rows read (10 %), 100 written, 100 rows/s, "
        "about 9.0 s left",
    ]


def test_wait_display__draws_a_bar_on_a_terminal() -> None:
    out = io.StringIO()
    display = WaitDisplay(out, tty=True)
    display.update(_result("RUNNING", "", Progress.of(attempt("RUNNING", 250, 250, 1000, 1))))
    display.note("No live worker [yet]")  # printed above the bar, as written
    display.close()
    drawn = out.getvalue()
    assert "No live worker [yet]" in drawn
    assert "\x1b[" in drawn  # drawn by rich, not printed as lines
    assert "250 / ~1,000 rows (25 %)" in drawn
    assert "250 rows/s" in drawn and "about 3.0 s left" in drawn
