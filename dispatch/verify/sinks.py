"""The checker's way into a datasource's database (a sink, or an incremental binding's
source), and what reading one may legitimately raise: such a failure is reported as the
sink's or binding's error (a violation), anything else is a bug in the checker and
propagates with its traceback."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

from django.core.exceptions import ObjectDoesNotExist, ValidationError

from dispatch.connectors import postgresql
from dispatch.connectors.base import ConnectorError
from dispatch.core.db import DB_ERRORS, one_line
from dispatch.models import Datasource
from dispatch.security.crypto import SnapshotUnreadable

# The database (Django's or the datasource's own connection), the connector (refused by
# the target policy, unreachable), a datasource deleted or whose config cannot be
# decrypted, a stored table name that no longer validates.
SINK_ERRORS: tuple[type[BaseException], ...] = (
    *DB_ERRORS,
    ConnectorError,
    SnapshotUnreadable,
    ObjectDoesNotExist,
    ValidationError,
)


@contextlib.contextmanager
def connect(datasource_id: uuid.UUID) -> Iterator[Any]:
    """A connection to the datasource's database (its stored, decrypted config), closed on
    exit."""
    config = Datasource.objects.get(pk=datasource_id).config
    conn = postgresql.connect(config, what="invariant check")
    try:
        yield conn
    finally:
        conn.close()


def error_text(exc: BaseException) -> str:
    """A sink failure as the report shows it: one line (the connector already removed
    secrets from its own errors)."""
    return one_line(exc)
