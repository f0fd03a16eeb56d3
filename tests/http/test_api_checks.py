"""The HTTP API's settings are checked at start-up: dispatch.E019 for the whole numbers,
dispatch.E005 for the long-poll's maximum."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from dispatch import checks


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("DISPATCH_API_MAX_BODY_BYTES", "1MB"),
        ("DISPATCH_API_MAX_BODY_BYTES", 0),
        ("DISPATCH_API_MAX_BODY_BYTES", True),
        ("DISPATCH_API_TOKEN_MAX_DAYS", 0),
        ("DISPATCH_API_TOKEN_MAX_DAYS", 36_500),
    ],
)
def test_e019__names_the_setting_and_its_bounds(setting: str, value: Any) -> None:
    with override_settings(**{setting: value}):
        (error,) = checks.check_api_settings()
    assert error.id == "dispatch.E019" and setting in error.msg


def test_e019__the_defaults_pass() -> None:
    assert checks.check_api_settings() == []


def test_e005__the_long_polls_maximum_is_bounded() -> None:
    with override_settings(DISPATCH_API_WAIT_MAX_SECONDS=1e9):
        errors = checks.check_time_settings()
    assert [e.id for e in errors] == ["dispatch.E005"]
    assert "DISPATCH_API_WAIT_MAX_SECONDS" in errors[0].msg
