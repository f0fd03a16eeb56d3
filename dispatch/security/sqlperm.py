"""`query` source specs run arbitrary SQL as the source's role: a permission of their own.

A READ ONLY transaction does not stop `dblink_exec`, `pg_terminate_backend` or
`pg_read_file` where the role may call them, so writing (or re-targeting) a query is
granted separately from changing jobs and bindings: `dispatch.write_source_query`.

- A job whose `source_spec` gains a query, or whose query text changes, needs it.
- A binding that attaches a job with a query to a source (new binding, another job,
  another source) needs it: the same query against another database is new SQL there.
- A change to where a datasource connects (any config key but the password: host, port,
  dbname, user, url, sslmode, ...) needs it while a binding whose job has a query reads
  from that datasource: the same query then runs on another database too.

This module is the policy; the console applies it (`dispatch.console.querypermission`: the
admin forms say so as an error, `save_model` refuses with 403 on every other path).
Least-privilege source roles (docs/security.md) remain the real boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.http import HttpRequest

QUERY_PERMISSION = "dispatch.write_source_query"
MESSAGE = (
    "A source query is SQL that runs on the source database: writing one, changing it or "
    "pointing it at another source needs the permission 'Can write SQL queries that "
    "sources run' (dispatch | job) as well."
)

DATASOURCE_MESSAGE = (
    "A binding whose job runs a source query reads from this datasource: changing where it "
    "connects ({fields}) runs that query on another database, which needs the permission "
    "'Can write SQL queries that sources run' (dispatch | job) as well."
)
# Config keys that say only how to log in, never where: changing them alone re-points no
# query. Every other key counts (a url names its host; a kind's undeclared keys may too).
LOGIN_ONLY_KEYS = frozenset({"password"})


def spec_query(spec: Any) -> str | None:
    if isinstance(spec, dict) and isinstance(spec.get("query"), str) and spec["query"].strip():
        return str(spec["query"])
    return None


def job_needs(source_spec: Any, stored_spec: Any | None) -> bool:
    query = spec_query(source_spec)
    if query is None:
        return False
    return stored_spec is None or spec_query(stored_spec) != query


def binding_needs(job: Any, source_id: Any, stored: Mapping[str, Any] | None) -> bool:
    if job is None or spec_query(job.source_spec) is None:
        return False
    if stored is None:
        return True
    return stored["job_id"] != job.pk or stored["source_id"] != source_id


def target_changes(config: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    """The config keys whose change may move where a datasource connects."""

    def value(settings: Mapping[str, Any], key: str) -> Any:
        found = settings.get(key)
        return None if found in (None, "") else found

    return sorted(
        key
        for key in set(config) | set(stored)
        if key not in LOGIN_ONLY_KEYS and value(config, key) != value(stored, key)
    )


def datasource_needs(
    config: Mapping[str, Any], stored: Mapping[str, Any] | None, query_specs: Iterable[Any]
) -> list[str]:
    """The target keys a datasource change moves (empty when it needs no permission):
    `query_specs` are the source specs of the jobs whose bindings read from it; a new
    datasource (`stored` None) has no binding yet."""
    if stored is None or not any(spec_query(spec) for spec in query_specs):
        return []
    return target_changes(config, stored)


def allowed(request: HttpRequest | None) -> bool:
    return request is not None and bool(request.user.has_perm(QUERY_PERMISSION))
