"""The worker's logs go somewhere even in a site that configured nothing for them."""

from __future__ import annotations

import logging
import sys
import traceback

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
