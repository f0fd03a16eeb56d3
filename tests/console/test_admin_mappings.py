"""Every display mapping of the console covers every state it can be asked about."""

from __future__ import annotations

import pytest

from dispatch.console import badges
from dispatch.core.states import TERMINAL_RUN_STATUSES, BlockedReason, Origin, Reason, Status
from dispatch.services import ActionRefused, Outcome


@pytest.mark.parametrize(
    ("mapping", "choices"),
    [
        (badges.STATUS_TONE, Status),
        (badges.STATUS_SYMBOL, Status),
        (badges.ORIGIN_LABEL, Origin),
        (badges.REASON_TONE, Reason),
        (badges.BLOCKED_HINT, BlockedReason),
    ],
    ids=["status-tone", "status-symbol", "origin", "reason", "blocked"],
)
def test_mapping__covers_every_member(mapping: dict[str, str], choices: type) -> None:
    assert set(mapping) == set(choices.values)  # type: ignore[attr-defined]


def test_tones__each_has_a_css_class() -> None:
    from pathlib import Path

    css = (
        Path(badges.__file__).parents[1] / "templates/admin/dispatch/includes/console_style.html"
    ).read_text()
    for tone in {*badges.STATUS_TONE.values(), *badges.REASON_TONE.values()}:
        assert f".dsp-{tone} " in css or f".dsp-{tone}," in css, tone


def test_chart__one_series_per_terminal_status() -> None:
    assert set(badges.CHART_ORDER) == set(TERMINAL_RUN_STATUSES)


def test_outcomes_and_refusal_codes__all_have_a_text() -> None:
    assert set(Outcome.__members__.values()) <= set(badges.OUTCOME_TEXT)
    # The refusal codes the service documents on ActionRefused.
    documented = {w.strip(",.") for w in (ActionRefused.__doc__ or "").split() if w.isupper()}
    assert documented and documented <= set(badges.REFUSAL_TEXT)


def test_badges__render_every_status_with_label_and_symbol() -> None:
    for status in Status:
        html = badges.status_badge(status)
        assert status.label in html and badges.STATUS_SYMBOL[status] in html
