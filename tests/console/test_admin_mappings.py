"""Every display mapping of the console covers every state it can be asked about."""

from __future__ import annotations

import pytest

from dispatch.console import views as admin_views
from dispatch.services import ActionRefused, Outcome
from dispatch.states import TERMINAL_RUN_STATUSES, BlockedReason, Origin, Reason, Status


@pytest.mark.parametrize(
    ("mapping", "choices"),
    [
        (admin_views.STATUS_TONE, Status),
        (admin_views.STATUS_SYMBOL, Status),
        (admin_views.ORIGIN_LABEL, Origin),
        (admin_views.REASON_TONE, Reason),
        (admin_views.BLOCKED_HINT, BlockedReason),
    ],
    ids=["status-tone", "status-symbol", "origin", "reason", "blocked"],
)
def test_mapping__covers_every_member(mapping: dict[str, str], choices: type) -> None:
    assert set(mapping) == set(choices.values)  # type: ignore[attr-defined]


def test_tones__each_has_a_css_class() -> None:
    from pathlib import Path

    css = (
        Path(admin_views.__file__).parents[1]
        / "templates/admin/dispatch/includes/console_style.html"
    ).read_text()
    for tone in {*admin_views.STATUS_TONE.values(), *admin_views.REASON_TONE.values()}:
        assert f".dsp-{tone} " in css or f".dsp-{tone}," in css, tone


def test_chart__one_series_per_terminal_status() -> None:
    assert set(admin_views.CHART_ORDER) == set(TERMINAL_RUN_STATUSES)


def test_outcomes_and_refusal_codes__all_have_a_text() -> None:
    assert set(Outcome.__members__.values()) <= set(admin_views.OUTCOME_TEXT)
    # The refusal codes the service documents on ActionRefused.
    documented = {w.strip(",.") for w in (ActionRefused.__doc__ or "").split() if w.isupper()}
    assert documented and documented <= set(admin_views.REFUSAL_TEXT)


def test_badges__render_every_status_with_label_and_symbol() -> None:
    for status in Status:
        html = admin_views.status_badge(status)
        assert status.label in html and admin_views.STATUS_SYMBOL[status] in html
