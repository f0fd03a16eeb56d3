"""Names of datasources, jobs and bindings: printable text only.

A name reaches email headers (an alert's subject), log lines, metrics labels and the
console. A control character in one would split a header (`narrow\\r\\nBcc: ...`: every
email alert for that binding then fails, which mutes it without the muting permission) or
forge a log line. Refused twice: by the model field's validator (a form error naming the
field) and by a database CHECK (no bulk update or SQL client gets past it).
"""

from __future__ import annotations

import re

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

# C0 controls and DEL; NUL cannot be stored in PostgreSQL text at all. The same class in
# Python and, as a PostgreSQL regular expression, in the CHECK.
CONTROL_CLASS = r"[\x01-\x1f\x7f]"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def validate_name(value: str) -> None:
    if _CONTROL.search(value or ""):
        raise ValidationError(
            "A name must not contain control characters (line breaks, tabs, ...).",
            code="control_characters",
        )


def name_check(table: str) -> models.CheckConstraint:
    """The CHECK that keeps control characters out of `table`'s `name`."""
    return models.CheckConstraint(
        condition=~Q(name__regex=CONTROL_CLASS), name=f"{table}_name_printable"
    )
