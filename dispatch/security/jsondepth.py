"""A nesting-depth limit on every JSON value dispatch stores.

Python's `json` recurses once per level, so a few thousand levels (a few KB of `[`) raise
RecursionError wherever the value is parsed or printed: a form submit, every page that
loads the row, a worker reading a spec. Specs and configs are settings: a handful of
levels is all they use. The limit is checked

- on the raw text before it is parsed (forms: `BoundedJSONFormField`, the datasource JSON
  editor), without recursion, so a 50,000-level POST is a form error, not a 500;
- on the value (model validation: `BoundedJSONField`, `Datasource.clean`), iteratively;
- by the database (CHECK constraints using `jsonb_path_exists`), so no other writer can
  store a row that would break the pages that read it.

The level of a value is the number of arrays/objects around it (the top-level value is
at level 0); nothing may sit deeper than MAX_JSON_DEPTH. This is exactly what the SQL
`lax $.**{N to last}` path counts.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.db import models

MAX_JSON_DEPTH = 32
# The CHECK expression's path: some value deeper than the limit.
TOO_DEEP_PATH = f"lax $.**{{{MAX_JSON_DEPTH + 1} to last}}"

MESSAGE = f"is nested more than {MAX_JSON_DEPTH} levels deep (arrays/objects within each other)"


def value_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when some part of `value` sits at a level deeper than `limit`."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if level > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, level + 1) for v in item)
    return False


def text_too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when JSON text opens more brackets than a value within the limit needs.

    Counts `[`/`{` outside strings without parsing. Called before `json.loads`; the exact
    check runs on the parsed value.
    """
    depth = 0
    in_string = False
    escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit + 1:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def check(field: str, value: Any) -> None:
    if value_too_deep(value):
        raise ValidationError({field: MESSAGE}, code="json_too_deep")


class BoundedJSONFormField(forms.JSONField):
    """A JSON form field that refuses deep nesting before parsing it."""

    def to_python(self, value: Any) -> Any:
        if isinstance(value, str) and text_too_deep(value):
            raise ValidationError(f"This JSON {MESSAGE}.", code="json_too_deep")
        parsed = super().to_python(value)
        if value_too_deep(parsed):
            raise ValidationError(f"This JSON {MESSAGE}.", code="json_too_deep")
        return parsed

    def bound_data(self, data: Any, initial: Any) -> Any:
        if isinstance(data, str) and text_too_deep(data):
            # Re-displayed as the submitted text, never parsed.
            return forms.fields.InvalidJSONInput(data)
        return super().bound_data(data, initial)


class BoundedJSONField(models.JSONField):  # type: ignore[type-arg]
    """A JSONField with the depth limit in validation and in its form field.

    Deconstructs as a plain JSONField: the limit lives in code and in the table's CHECK
    constraints, not in the column type.
    """

    def formfield(self, **kwargs: Any) -> Any:
        kwargs.setdefault("form_class", BoundedJSONFormField)
        return super().formfield(**kwargs)

    def validate(self, value: Any, model_instance: Any) -> None:
        if value_too_deep(value):
            raise ValidationError(f"This JSON {MESSAGE}.", code="json_too_deep")
        super().validate(value, model_instance)

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs


def depth_check(field: str, name: str) -> models.CheckConstraint:
    """A CHECK that no value of `field` sits deeper than the limit."""
    from django.db.models import Func, Q, Value

    deep = Func(
        models.F(field),
        Value(TOO_DEEP_PATH, output_field=models.TextField()),
        function="jsonb_path_exists",
        template="%(function)s(%(expressions)s::jsonpath)",
        output_field=models.BooleanField(),
    )
    return models.CheckConstraint(condition=~Q(deep), name=name)
