"""Definitions as files: datasources, jobs, bindings and schedules in YAML, keyed by their
stable names (docs/as-code.md).

The service the `dispatch apply` and `dispatch export` subcommands (`dispatch_apply`, `dispatch_export`) call, and the HTTP API:

    documents = load_files(["pipelines.yaml"])      # or load_text(body, source="request")
    p = plan(documents, prune=False)                 # DefinitionError: problems, nothing written
    print(p.render())                                # the diff, secrets masked
    apply(p)                                         # Conflict: changed since the plan
    export(managed_only=True).text                   # YAML that applies back to the same state
"""

from __future__ import annotations

from dispatch.ascode.apply import Result, apply
from dispatch.ascode.errors import Conflict, DefinitionError, Problem
from dispatch.ascode.export import Export, export
from dispatch.ascode.loader import Document, load_files, load_text
from dispatch.ascode.plan import Change, FieldChange, Plan, plan

__all__ = [
    "Change",
    "Conflict",
    "DefinitionError",
    "Document",
    "Export",
    "FieldChange",
    "Plan",
    "Problem",
    "Result",
    "apply",
    "export",
    "load_files",
    "load_text",
    "plan",
]
