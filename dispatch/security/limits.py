"""Upper bounds on every number that reaches time arithmetic, and on the values that are
stored, read back and shown again on every run.

A value past these bounds (`backoff_seconds=1e300`) would make `now() + interval`
overflow a timestamp inside a settle or a recovery pass. Each bound is enforced three
times: by the model field's validators (a clear form error), by a database CHECK (no
bulk update or SQL client gets past it), and by the connector's spec validation for the
per-spec timeouts.

An incremental cursor's values come from the source's rows: one of any size would be
written with every commit (the sink's `dispatch_cursor`, a CSV file's state), onto the
attempt, into the console's copy and onto the binding's page. The reader refuses a larger
one before anything is written (dispatch/connectors/incremental.py).
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
# The slices one run may be split into (each is a run of its own once started, and a plan
# row until then).
MAX_SLICES = 100_000
# Per-session timeouts set on connector sessions (PostgreSQL takes milliseconds in an
# int4: at most about 24 days).
MAX_STATEMENT_TIMEOUT_SECONDS = DAY
MAX_LOCK_TIMEOUT_SECONDS = 3_600
# One value of an incremental cursor: the UTF-8 bytes of its text form (what
# `column::text` prints). A timestamp, a number or a key is a few dozen bytes.
MAX_CURSOR_VALUE_BYTES = 4_096
# The columns of one incremental cursor (so one binding's cursor is at most 32 KiB).
MAX_CURSOR_COLUMNS = 8
# A CSV sink's state file (its size and every binding's cursor), as its reader takes it:
# a commit that would write a larger one is refused before it appends.
MAX_CSV_STATE_BYTES = 1 << 20

# Definition files (dispatch.ascode): one file or request body; the objects one apply may
# define; the YAML nodes (scalars, lists, mappings) of one file. A file past them is
# refused before anything is built from it.
MAX_DEFINITION_BYTES = 1024 * 1024
MAX_DEFINITION_OBJECTS = 5_000
MAX_DEFINITION_NODES = 200_000
# A secret read from a `file:` reference.
MAX_SECRET_FILE_BYTES = 64 * 1024
