"""What goes wrong with definition files, as data: each problem names the file, the line,
the path to the field and what is wrong, so the command prints `file:line: path: message`
and the HTTP API returns the same objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def where(file: str, line: int | None) -> str:
    """`file:line`, or the file alone when the line is unknown."""
    return f"{file}:{line}" if line else file


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the definitions. `line` is 1-based; None when unknown (a
    whole file, or a body that is not YAML at all)."""

    file: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        at = where(self.file, self.line)
        return f"{at}: {self.path}: {self.message}" if self.path else f"{at}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "path": self.path, "message": self.message}


class DefinitionError(Exception):
    """The definitions are invalid: nothing was (or will be) written."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class Conflict(Exception):  # noqa: N818 - the outcome a caller handles, like LeaseLost
    """An object changed between the plan and its apply (a console edit, another apply):
    the whole apply was rolled back and nothing was written. Plan again."""

    def __init__(self, kind: str, name: str, detail: str) -> None:
        self.kind = kind
        self.name = name
        self.detail = detail
        super().__init__(
            f"{kind} {name!r} {detail} since the plan was made (a console edit or another "
            "apply): nothing was written; plan and apply again"
        )
