"""An attempt's progress as the database recorded it: rows read against the source's
estimate, the rate and the time left.

Every time comes from the attempt's own row (`claimed_at`, `heartbeat_at`, `finished_at`:
database time), never from the reader's clock. While an attempt runs, its counters are
those of its last heartbeat (every `lease_seconds / 3`), so the rate and the time left are
as of that heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol


class _AttemptRow(Protocol):
    status: str
    rows_read: int
    rows_written: int
    rows_estimated: int | None
    claimed_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True)
class Progress:
    # The attempt's status ("" for none).
    status: str = ""
    rows_read: int = 0
    rows_written: int = 0
    # The source's estimate of the rows it reads (None: it gave none).
    rows_estimated: int | None = None
    # Seconds from the claim to the counters' time: the last heartbeat while running,
    # the settlement once finished (None: never claimed).
    seconds: float | None = None

    @classmethod
    def of(cls, attempt: _AttemptRow | Any) -> Progress:
        """The progress recorded on an attempt row (`None`: an empty one)."""
        status = getattr(attempt, "status", "") or ""
        claimed = getattr(attempt, "claimed_at", None)
        until = getattr(attempt, "heartbeat_at", None) if status == "RUNNING" else None
        until = until or getattr(attempt, "finished_at", None)
        seconds = (
            max(0.0, (until - claimed).total_seconds())
            if claimed is not None and until is not None
            else None
        )
        return cls(
            status=status,
            rows_read=int(getattr(attempt, "rows_read", 0) or 0),
            rows_written=int(getattr(attempt, "rows_written", 0) or 0),
            rows_estimated=getattr(attempt, "rows_estimated", None),
            seconds=seconds,
        )

    @property
    def running(self) -> bool:
        return self.status == "RUNNING"

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCEEDED"

    @property
    def started(self) -> bool:
        """Claimed, with something to show (a pending attempt has no progress)."""
        return (
            self.running
            or self.seconds is not None
            or self.rows_read > 0
            or self.rows_estimated is not None
        )

    @property
    def total(self) -> int | None:
        """The rows the read yields: what it read, once it succeeded; otherwise the
        source's estimate, unless the read has already passed it (then nobody knows)."""
        if self.succeeded:
            return self.rows_read
        if self.rows_estimated is None or self.rows_read > self.rows_estimated:
            return None
        return self.rows_estimated

    @property
    def fraction(self) -> float | None:
        """Rows read as a share of the total, 0 to 1 (None: no total)."""
        total = self.total
        if total is None:
            return None
        if total == 0:
            return 1.0  # nothing to read
        return min(1.0, self.rows_read / total)

    @property
    def rate(self) -> float | None:
        """Rows read per second, claim to the counters' time (None: too early to say)."""
        if self.seconds is None or self.seconds <= 0 or self.rows_read <= 0:
            return None
        return self.rows_read / self.seconds

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the current rate, as of the counters' time (running only)."""
        total, rate = self.total, self.rate
        if not self.running or total is None or rate is None:
            return None
        return max(0, total - self.rows_read) / rate


def rows_text(n: int | None) -> str:
    return "—" if n is None else f"{n:,}"


def rate_text(rate: float | None) -> str:
    if rate is None:
        return ""
    return f"{rate:,.0f} rows/s" if rate >= 10 else f"{rate:.1f} rows/s"


def seconds_text(seconds: float | None) -> str:
    """A duration as a person reads it: 0.4 s, 42.0 s, 3 min 05 s, 2 h 10 min, 3 d 4 h."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    return f"{hours // 24} d {hours % 24} h"


def describe(p: Progress) -> str:
    """One line: "30,000 of about 1,000,000 rows read (3 %), 28,500 written, 25,000 rows/s,
    about 39 s left"; what is unknown is left out."""
    total = p.total
    if total is not None and not p.succeeded:
        text = f"{p.rows_read:,} of about {total:,} rows read ({100 * (p.fraction or 0):.0f} %)"
    else:
        text = f"{p.rows_read:,} rows read"
    parts = [text, f"{p.rows_written:,} written"]
    if p.rate is not None:
        parts.append(rate_text(p.rate))
    if p.eta_seconds is not None:
        parts.append(f"about {seconds_text(p.eta_seconds)} left")
    return ", ".join(parts)
