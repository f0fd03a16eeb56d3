"""Helpers shared by the management commands: resolve ids and names into rows."""

from __future__ import annotations

import uuid
from typing import TypeVar

from django.core.management.base import CommandError

from dispatch.models import Attempt, JobBinding, Run

M = TypeVar("M", Run, Attempt)


def _uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def binding_from_arg(value: str) -> JobBinding:
    """A binding by id or by name."""
    as_id = _uuid(value)
    binding = (
        JobBinding.objects.filter(pk=as_id).first() if as_id else None
    ) or JobBinding.objects.filter(name=value).first()
    if binding is None:
        raise CommandError(f"No binding with id or name {value!r}.")
    return binding


def _by_id(model: type[M], value: str, noun: str, article: str = "a") -> M:
    as_id = _uuid(value)
    if as_id is None:
        raise CommandError(f"{value!r} is not {article} {noun} id (a UUID).")
    row = model._default_manager.filter(pk=as_id).first()
    if row is None:
        raise CommandError(f"No {noun} with id {value}.")
    return row


def run_from_arg(value: str) -> Run:
    return _by_id(Run, value, "run")


def attempt_from_arg(value: str) -> Attempt:
    return _by_id(Attempt, value, "attempt", "an")
