"""The HTTP API (django-ninja): bindings, runs, their actions, and API tokens.

`api.py` builds the `NinjaAPI` that `dispatch.urls` mounts under `api/`; each resource has
a router module of its own (`bindings.py`, `runs.py`); `auth.py` authenticates (bearer
tokens, the console's session with CSRF) and checks the console's permissions;
`problems.py` turns every refusal into `application/problem+json`; `schemas.py` holds the
types the endpoints, the OpenAPI document and `manage.py dispatch runs|bindings --json`
share; `reads.py` the queries behind them. docs/api.md, "HTTP API", has the details.
"""
