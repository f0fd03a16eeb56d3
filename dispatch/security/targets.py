"""The site's target policy for database datasources (docs/security.md).

A user who may edit a datasource decides which server the worker connects to, as which
role, with which client-side files. Three rules bound that:

- hosts: every host of a connection must match `DISPATCH_DATASOURCE_HOSTS`: `*` (any TCP
  host, the default), a host name (`db.example.com`, `*.example.com`), an address or a
  network (`10.0.0.0/8`), or an absolute directory for Unix sockets. Unix sockets are
  refused unless their directory is listed: a local socket usually means peer
  authentication as the worker's own OS user.
- the site's own database is refused as a source or sink unless
  `DISPATCH_ALLOW_SITE_DATABASE` is true: a sink there could write into `auth_user`.
- no libpq option that reads a local file (`passfile`, `sslkey`, `sslcert`,
  `sslrootcert`, `sslcrl`, `service`, ...) may come from a datasource; URLs may carry only
  the parameters in URL_PARAMETERS. Every connection also sets `passfile` to the null
  device and (libpq 16+) `sslcertmode=disable`, so the worker's own `~/.pgpass` and
  client certificate are never used for a datasource.
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import os
import socket
from collections.abc import Iterator
from typing import Any

from django.conf import settings

# What a datasource URL may say; anything else (passfile, sslkey, service, options, ...)
# is refused.
URL_PARAMETERS = frozenset(
    {
        "host",
        "hostaddr",
        "port",
        "dbname",
        "user",
        "password",
        "sslmode",
        "require_auth",
        "channel_binding",
        "connect_timeout",
        "target_session_attrs",
        "application_name",
    }
)
FILE_OPTIONS = frozenset(
    {
        "passfile",
        "sslkey",
        "sslcert",
        "sslrootcert",
        "sslcrl",
        "sslcrldir",
        "sslpassword",
        "service",
        "servicefile",
        "krbsrvname",
        "gsslib",
        "options",
    }
)


def allowed_hosts() -> list[str]:
    hosts = getattr(settings, "DISPATCH_DATASOURCE_HOSTS", ["*"])
    if isinstance(hosts, str):
        hosts = hosts.split(",")
    return [h.strip() for h in hosts if h.strip()]


def site_database_allowed() -> bool:
    return bool(getattr(settings, "DISPATCH_ALLOW_SITE_DATABASE", False))


def _is_socket(host: str) -> bool:
    return host.startswith(("/", "@"))


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


def host_refused(host: str) -> str | None:
    """Why the policy refuses `host` (one entry of a host list), or None."""
    entries = allowed_hosts()
    if _is_socket(host):
        real = os.path.realpath(host) if host.startswith("/") else host
        for entry in entries:
            if entry.startswith("/") and os.path.realpath(entry) == real:
                return None
        return (
            f"{host!r} is a Unix-socket directory the site does not allow "
            "(DISPATCH_DATASOURCE_HOSTS lists the allowed ones)"
        )
    name = host.lower().rstrip(".")
    networks = []
    for entry in entries:
        if entry == "*":
            return None
        if entry.startswith("/"):
            continue
        if entry.startswith("*.") and name.endswith(entry[1:].lower()):
            return None
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        if entry.lower().rstrip(".") == name:
            return None
    addresses = _addresses(host) if networks else []
    if addresses and all(any(a in n for n in networks) for a in addresses):
        return None
    return f"{host!r} is not a host the site allows (DISPATCH_DATASOURCE_HOSTS)"


def conninfo_refusals(params: dict[str, Any], *, from_url: bool) -> list[str]:
    """Everything the policy refuses in a connection's parameters."""
    problems = []
    bad = sorted(k for k in params if k in FILE_OPTIONS or (from_url and k not in URL_PARAMETERS))
    if bad:
        problems.append(
            f"the connection option(s) {', '.join(bad)} are not allowed: a datasource may "
            "not make the worker read local files or services"
        )
    hosts = [h for h in str(params.get("host") or "").split(",") if h.strip()]
    hosts += [h for h in str(params.get("hostaddr") or "").split(",") if h.strip()]
    if not hosts:
        # libpq would fall back to the default Unix socket.
        hosts = ["/var/run/postgresql"]
    for host in hosts:
        refused = host_refused(host.strip())
        if refused:
            problems.append(refused)
    return problems


# Sent to the site's database and to every datasource (dispatch/connectors/postgresql/
# connect.py): each name is schema-qualified, so a datasource's own functions cannot
# answer for the catalog's (docs/security.md, "Catalog calls").
SITE_FINGERPRINT_SQL = (
    "SELECT pg_catalog.current_database(),"
    " pg_catalog.pg_postmaster_start_time()::pg_catalog.text,"
    " pg_catalog.current_setting('port'), (SELECT d.oid FROM pg_catalog.pg_database d"
    " WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())"
)


# The fingerprint read once for one execution (`site_fingerprint_pinned`), so that the
# threads it starts with a copy of its context never open a site connection of their own.
_PINNED: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "dispatch_site_fingerprint", default=None
)


@contextlib.contextmanager
def site_fingerprint_pinned() -> Iterator[None]:
    """`site_fingerprint()` read now (on this thread's site connection) and answered from
    memory inside the block, in this context and in threads run with a copy of it."""
    token = _PINNED.set(None if site_database_allowed() else site_fingerprint())
    try:
        yield
    finally:
        _PINNED.reset(token)


def site_fingerprint() -> tuple[Any, ...]:
    """Identifies the site's own database: name, server start time, port and oid, as the
    server itself reports them (host names and proxies in between do not matter)."""
    pinned = _PINNED.get()
    if pinned is not None:
        return pinned
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(SITE_FINGERPRINT_SQL)
        return tuple(str(v) for v in cursor.fetchone())


# Roles whose members can reach the server's files, programs or other sessions.
PRIVILEGED_ROLES = (
    "pg_read_server_files",
    "pg_write_server_files",
    "pg_execute_server_program",
    "pg_signal_backend",
)
# Every function, operator and type is named with its schema (a role may define
# `its_schema.pg_has_role(name, regrole, text)`, an exact match that would beat the
# catalog's `(name, oid, text)` whatever the search_path order), and the reader runs it
# under `search_path = pg_catalog, pg_temp` as well (sqlsafety.catalog_only).
PRIVILEGED_ROLE_SQL = (
    "SELECT current_user::pg_catalog.text, "
    "pg_catalog.array_remove(ARRAY[CASE WHEN r.rolsuper THEN 'superuser' END, "
    "CASE WHEN r.rolcreaterole THEN 'CREATEROLE' END, "
    "CASE WHEN r.rolbypassrls THEN 'BYPASSRLS' END]::pg_catalog.text[] "
    "OPERATOR(pg_catalog.||) ARRAY("
    "SELECT g FROM pg_catalog.unnest(%s::pg_catalog.text[]) AS g "
    "WHERE pg_catalog.to_regrole(g) IS NOT NULL "
    "AND pg_catalog.pg_has_role(current_user, g::pg_catalog.regrole, 'MEMBER')"
    "), NULL::pg_catalog.text) "
    "FROM pg_catalog.pg_roles r WHERE r.rolname OPERATOR(pg_catalog.=) current_user"
)


def query_sources_least_privilege() -> bool:
    """Refuse `query` sources whose role is a superuser or may reach server files,
    programs or other sessions (default true)."""
    return bool(getattr(settings, "DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE", True))
