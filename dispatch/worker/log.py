"""The worker's logs go somewhere even in a site that configured nothing for them."""

from __future__ import annotations

import logging
import sys

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
