"""Connector kinds: the built-in ones plus those a site lists in DISPATCH_CONNECTORS."""

from __future__ import annotations

import importlib.util
from functools import cache

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from dispatch.connectors.base import Connector
from dispatch.core import conf

BUILTIN = [
    "dispatch.connectors.builtin.GenerateConnector",
    "dispatch.connectors.builtin.NullConnector",
    "dispatch.connectors.postgresql.PostgreSQLConnector",
    "dispatch.connectors.csv.CSVConnector",
]
# Built-in kinds that need an optional dependency (an extra of the package): listed when
# it is installed, absent (an unknown kind) when not.
OPTIONAL_BUILTIN = {
    "dispatch.connectors.parquet.ParquetConnector": "pyarrow",
    "dispatch.connectors.mysql.MySQLConnector": "pymysql",
}


def _optional() -> list[str]:
    return [p for p, module in OPTIONAL_BUILTIN.items() if importlib.util.find_spec(module)]


class UnknownKind(LookupError):
    pass


@cache
def _load(paths: tuple[str, ...]) -> dict[str, type[Connector]]:
    kinds: dict[str, type[Connector]] = {}
    for path in paths:
        # A bad entry is a configuration error named as such (system check dispatch.E012
        # reports it before a worker or `check` starts).
        try:
            cls = import_string(path)
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"DISPATCH_CONNECTORS entry {path!r} cannot be imported: {exc} (dispatch.E012)"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, Connector)):
            raise ImproperlyConfigured(
                f"DISPATCH_CONNECTORS entry {path!r} is not a dispatch Connector subclass "
                "(dispatch.E012)"
            )
        kinds[cls.kind] = cls
    return kinds


def kinds() -> dict[str, type[Connector]]:
    return _load(tuple(BUILTIN + _optional() + conf.extra_connectors()))


def get(kind: str) -> type[Connector]:
    try:
        return kinds()[kind]
    except KeyError:
        known = ", ".join(sorted(kinds()))
        raise UnknownKind(f"unknown connector kind {kind!r} (known: {known})") from None
