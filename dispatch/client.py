"""A small typed client of dispatch's HTTP API, on the standard library alone (urllib):
an orchestrator's task imports it without Django.

    from dispatch.client import DispatchClient

    client = DispatchClient("https://ops.example.com/dispatch/", token)
    run = client.trigger("nightly-orders", idempotency_key=f"{dag_run_id}:nightly-orders")
    run = client.wait(run["id"], timeout=3600)

Every answer is the API's JSON (dicts, as docs/api.md and the OpenAPI document describe
them). A refusal raises `DispatchAPIError` carrying the problem details. Redirects are
never followed: urllib would send the Authorization header to wherever a redirect points,
another host included, so a 3xx is an error naming where it pointed.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["DispatchAPIError", "DispatchClient"]

FINISHED = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class DispatchAPIError(Exception):
    """The API refused a request (or answered something that is not the API's). `status`
    is the HTTP status, `problem` the problem+json body (`type`, `title`, `detail`,
    `errors`, `code`), `code` a refused action's code."""

    def __init__(self, status: int, problem: Mapping[str, Any]) -> None:
        self.status = status
        self.problem = dict(problem)
        self.code: str | None = self.problem.get("code")
        self.errors: list[dict[str, str]] = list(self.problem.get("errors") or [])
        detail = self.problem.get("detail") or self.problem.get("title") or "error"
        super().__init__(f"{status}: {detail}")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Every 3xx stays a 3xx (an HTTPError below), never followed with the token."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class DispatchClient:
    """`base_url` is where the site includes `dispatch.urls` (e.g.
    "https://ops.example.com/dispatch/"); `token` an API token (dsp_...). `timeout` bounds
    each request's connect and read, beyond a long-poll's own wait."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 30.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, not {base_url!r}")
        self.api_url = base_url.rstrip("/") + "/api/v1"
        self._token = token
        self.timeout = timeout
        self._opener = urllib.request.build_opener(_NoRedirects)

    def __repr__(self) -> str:  # never the token
        return f"DispatchClient({self.api_url!r})"

    # --- transport ---------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """One request to the API; returns its JSON or raises DispatchAPIError."""
        url = self.api_url + path
        if query:
            pairs = {k: v for k, v in query.items() if v is not None}
            if pairs:
                url += "?" + urllib.parse.urlencode(pairs)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with self._opener.open(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise self._error(exc) from None

    @staticmethod
    def _error(exc: urllib.error.HTTPError) -> DispatchAPIError:
        if 300 <= exc.code < 400:
            where = exc.headers.get("Location", "?")
            return DispatchAPIError(
                exc.code,
                {
                    "title": "Redirect not followed",
                    "detail": f"the API answered with a redirect to {where}; redirects are "
                    "not followed (the token would go along): use the final URL as base_url",
                },
            )
        raw = exc.read()
        try:
            problem = json.loads(raw)
        except ValueError:
            problem = None
        if not isinstance(problem, dict):
            problem = {"title": exc.reason, "detail": raw[:200].decode(errors="replace")}
        return DispatchAPIError(exc.code, problem)

    # --- bindings ----------------------------------------------------------------------
    def bindings(self, *, page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every binding the token may see, by name, page after page."""
        cursor = None
        while True:
            page = self.request("GET", "/bindings", query={"limit": page_size, "cursor": cursor})
            yield from page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                return

    def binding(self, binding: str) -> dict[str, Any]:
        return self.request("GET", f"/bindings/{_quote(binding)}")  # type: ignore[no-any-return]

    def trigger(self, binding: str, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Create a run of `binding` (its name or id). With an `idempotency_key`, asking
        again returns the same run instead of a new one."""
        body = {"idempotency_key": idempotency_key} if idempotency_key is not None else {}
        return self.request("POST", f"/bindings/{_quote(binding)}/trigger", body=body)  # type: ignore[no-any-return]

    # --- runs --------------------------------------------------------------------------
    def run(self, run_id: str) -> dict[str, Any]:
        """The run with its attempts."""
        return self.request("GET", f"/runs/{_quote(run_id)}")  # type: ignore[no-any-return]

    def wait(self, run_id: str, timeout: float, *, poll: float = 30.0) -> dict[str, Any]:
        """Wait until the run has finished and return it; raises TimeoutError after
        `timeout` seconds. Long-polls the API `poll` seconds at a time (at most the
        server's maximum, 60 s by default)."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            step = min(poll, left)
            run: dict[str, Any] = self.request(
                "GET",
                f"/runs/{_quote(run_id)}/wait",
                query={"timeout": f"{step:.3f}"},
                timeout=self.timeout + step,
            )
            if run["status"] in FINISHED:
                return run
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} is still {run['status']} after {timeout:g} s")

    def cancel(self, run_id: str) -> dict[str, Any]:
        """Returns {"outcome": "CANCELLED" | "CANCEL_REQUESTED", "run": {...}}."""
        return self.request("POST", f"/runs/{_quote(run_id)}/cancel")  # type: ignore[no-any-return]

    def retry(self, run_id: str) -> dict[str, Any]:
        """Returns {"outcome": "RETRIED", "run": {...}}."""
        return self.request("POST", f"/runs/{_quote(run_id)}/retry")  # type: ignore[no-any-return]

    def plan_definitions(self, files: Mapping[str, str], *, prune: bool = False) -> dict[str, Any]:
        """The diff of definition files ({name: YAML text}); nothing written."""
        body = {"files": [{"name": n, "text": t} for n, t in files.items()], "prune": prune}
        return self.request("POST", "/definitions/plan", body=body)  # type: ignore[no-any-return]

    def apply_definitions(self, files: Mapping[str, str], *, prune: bool = False) -> dict[str, Any]:
        """Apply definition files ({name: YAML text}) in one transaction."""
        body = {"files": [{"name": n, "text": t} for n, t in files.items()], "prune": prune}
        return self.request("POST", "/definitions/apply", body=body)  # type: ignore[no-any-return]

    def runs(
        self,
        *,
        binding: str | None = None,
        status: str | None = None,
        since: str | None = None,
        page_size: int = 100,
    ) -> Iterator[dict[str, Any]]:
        """Runs newest first, page after page (keyset pages: none twice, none skipped).
        `since` is an ISO 8601 time."""
        cursor = None
        while True:
            page = self.request(
                "GET",
                "/runs",
                query={
                    "binding": binding,
                    "status": status,
                    "since": since,
                    "limit": page_size,
                    "cursor": cursor,
                },
            )
            yield from page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                return


def _quote(part: str) -> str:
    return urllib.parse.quote(str(part), safe="")
