"""Upper bounds on every number that reaches time arithmetic.

A value past these bounds (`backoff_seconds=1e300`) would make `now() + interval`
overflow a timestamp inside a settle or a recovery pass. Each bound is enforced three
times: by the model field's validators (a clear form error), by a database CHECK (no
bulk update or SQL client gets past it), and by the connector's spec validation for the
per-spec timeouts.
"""

from __future__ import annotations

DAY = 86_400
# Job retry delays: a week is longer than any retry policy that still makes sense.
MAX_BACKOFF_SECONDS = 7 * DAY
# One execution: a week.
MAX_TIMEOUT_SECONDS = 7 * DAY
# A lease: a day (a worker heartbeats every lease/3 seconds).
MAX_LEASE_SECONDS = DAY
MAX_ATTEMPTS = 100
# Per-session timeouts set on connector sessions (PostgreSQL takes milliseconds in an
# int4: at most about 24 days).
MAX_STATEMENT_TIMEOUT_SECONDS = DAY
MAX_LOCK_TIMEOUT_SECONDS = 3_600

# Definition files (dispatch.ascode): one file or request body; the objects one apply may
# define; the YAML nodes (scalars, lists, mappings) of one file. A file past them is
# refused before anything is built from it.
MAX_DEFINITION_BYTES = 1024 * 1024
MAX_DEFINITION_OBJECTS = 5_000
MAX_DEFINITION_NODES = 200_000
# A secret read from a `file:` reference.
MAX_SECRET_FILE_BYTES = 64 * 1024
