"""Export: the database's definitions as a YAML file that applies back to the same state.

Secrets are written as references: the one a datasource was applied with, else (a secret
entered in the console) `env:<prefix><DATASOURCE>_<FIELD>`, named in the file's header and
in `notes` as a variable to set before applying.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from dispatch.ascode.kinds import all_kinds
from dispatch.ascode.plan import FORMAT_VERSION
from dispatch.models import MANAGED_BY_FILES


@dataclass
class Export:
    text: str
    # What must be done before the text applies (variables to set, objects left out).
    notes: list[str] = field(default_factory=list)


def export(*, managed_only: bool = False) -> Export:
    """Every datasource, job, binding (and schedule, with the scheduling app); with
    `managed_only`, only the objects definition files manage. Reads only."""
    data: dict[str, object] = {"version": FORMAT_VERSION}
    notes: list[str] = []
    for kind in all_kinds():
        rows = kind.rows()
        if managed_only:
            rows = rows.filter(managed_by=MANAGED_BY_FILES)
        section: dict[str, object] = {}
        for row in rows:
            if not row.name:
                notes.append(
                    f"{kind.label} {row.pk} has no name (written by an older release or by "
                    "SQL) and is left out: save it once in the console to give it one"
                )
                continue
            section[row.name] = kind.export(row, notes)
        if section:
            data[kind.key] = section
    header = [
        "# dispatch definitions (docs/as-code.md): apply with `manage.py dispatch apply FILE`.",
        "# Secrets are references (env:NAME, file:/path), never values.",
    ]
    if notes:
        header.append("# Before applying:")
        header.extend(f"#   - {note}" for note in notes)
    body = yaml.safe_dump(
        data, sort_keys=False, allow_unicode=True, default_flow_style=False, width=100
    )
    return Export(text="\n".join(header) + "\n" + body, notes=notes)
