"""The schedule wake-up: a notification on `DISPATCH_SCHEDULE_CHANNEL` that tells
reconciler loops (scheduling.reconciler, which LISTENs on it) to recompute their sleep. A
hint only: a lost one costs at most the loop's bounded sleep (conf.MAX_SLEEP_SECONDS)."""

from __future__ import annotations

import logging
import uuid

from django.db import connection, transaction

from dispatch.core import sqlfiles as dispatch_sqlfiles
from dispatch.core.db import DB_ERRORS
from dispatch.worker.log import db_error
from scheduling import conf, sqlfiles

log = logging.getLogger("scheduling.wakeup")


def notify(schedule_id: uuid.UUID | str) -> None:
    """Wake reconciler loops; the payload is the schedule id.

    Inside a transaction the notification joins it (`notify_in_transaction`, in a
    savepoint): PostgreSQL delivers it when that transaction commits, after the write it
    announces is visible, and never if it rolls back. Outside one it is sent in a short
    transaction of its own with synchronous_commit off (dispatch's `notify`).
    `Schedule.save` calls this after its commit. A database error is logged and swallowed
    (the write it announces stands; the savepoint keeps the caller's transaction usable);
    anything else is a bug and raises.
    """
    params = {"channel": conf.schedule_channel(), "payload": str(schedule_id)}
    try:
        if connection.in_atomic_block:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(sqlfiles.query("notify_in_transaction"), params)
        else:
            with connection.cursor() as cursor:
                cursor.execute(dispatch_sqlfiles.query("notify"), params)
    except DB_ERRORS as exc:
        log.warning("schedule wake-up not sent schedule=%s error=%s", schedule_id, db_error(exc))
