"""The worker's logs go somewhere even in a site that configured nothing for them, and
what they quote of an error says nothing a reader of the log should not learn."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from typing import Any

from django.db import connection

from dispatch.core import conf
from dispatch.core.db import connection_error

LOGGERS = ("dispatch", "scheduling")
FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def ensure_worker_logging() -> bool:
    """Give the `dispatch` and `scheduling` loggers a stderr handler at INFO when the site
    configured no handler that reaches them (Django's default LOGGING does not). True when
    it added one."""
    added = False
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if logger.hasHandlers():
            continue
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        added = True
    return added


def where(exc: BaseException) -> str:
    """An exception's traceback without its message: where it was raised carries no
    secret, while a datasource's error text may carry one (the attempt records that text
    sanitized)."""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    return f"Traceback (most recent call last):\n{frames}{type(exc).__qualname__}"


# The connection parameters that identify a server or a role, and those that are secret.
IDENTITY_PARAMS = ("host", "hostaddr", "user", "dbname")
SECRET_PARAMS = ("password", "sslpassword")


def _connection_params() -> list[dict[str, Any]]:
    """The libpq parameters of the worker's connections: the site's database and the
    LISTEN URL (when it parses; one that does not is never connected to)."""
    s = connection.settings_dict
    site = {
        "host": s.get("HOST"),
        "user": s.get("USER"),
        "dbname": s.get("NAME"),
        "password": s.get("PASSWORD"),
        **(s.get("OPTIONS") or {}),
    }
    found: list[dict[str, Any]] = [site]
    if url := conf.listen_url():
        with contextlib.suppress(ValueError):
            found.append(dict(conf.parse_listen_url(url)))
    return found


def db_error(exc: BaseException) -> str:
    """A database error of the worker's own connections (the site's, the LISTEN one) for
    a log line: its class, SQLSTATE and message without the hosts, users, databases and
    passwords of those connections (`dispatch.core.db.connection_error`). libpq's connection
    errors name the host and the role, and a connection string it cannot parse is quoted
    in part."""
    identity: list[str] = []
    secrets: list[str] = []
    for params in _connection_params():
        for key in IDENTITY_PARAMS:
            # A libpq host list: each host on its own.
            identity += [v for v in str(params.get(key) or "").split(",") if v]
        secrets += [str(params[key]) for key in SECRET_PARAMS if params.get(key)]
    return connection_error(exc, identity, secrets)
