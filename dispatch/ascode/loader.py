"""YAML definition files into plain data that remembers where each value came from.

Only PyYAML's safe parser is used (libyaml's when installed), and only for its events:
nodes are composed and values built here, so each value keeps its line and nothing but
JSON's types comes out (text, numbers, booleans, null, lists, mappings with text keys),
with PyYAML's safe rules for plain scalars (`yes` is true, `0x1F` an integer). What a YAML
document could use to cost more than its size is refused while it is composed, before
anything is built:

- aliases (`*name`): a few lines of nested aliases expand to billions of nodes (a "YAML
  bomb"); an alias is refused where it appears, so nothing is ever expanded;
- nesting deeper than the JSON depth limit allows (building the values recurses once per
  level);
- more than `MAX_DEFINITION_NODES` nodes, or a file larger than `MAX_DEFINITION_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from dispatch.ascode.errors import DefinitionError, Problem
from dispatch.security import jsondepth, limits

PathKey = tuple[str | int, ...]

# The levels around a spec's own value (file → kind → object → field) plus slack: the
# exact depth of a spec is checked by the model's validation; this bound only keeps the
# composer's recursion short.
MAX_NESTING = jsondepth.MAX_JSON_DEPTH + 6

_YAML = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_YAML}{t}" for t in ("str", "int", "float", "bool", "null")}


@dataclass
class Document:
    """One YAML document: its data and the line (1-based) of every key and item. Data
    parsed elsewhere (a JSON body) has no lines."""

    source: str
    data: Any
    lines: dict[PathKey, int] = field(default_factory=dict, repr=False)
    start_line: int | None = None

    def line(self, path: Iterable[str | int]) -> int | None:
        """The line of `path`, else of its nearest ancestor that has one."""
        key = tuple(path)
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key[:-1]
        return self.start_line


class _Refused(Exception):  # noqa: N818 - internal: turned into a Problem at once
    def __init__(self, mark: Any, message: str) -> None:
        self.mark = mark
        self.message = message


# libyaml's parser when PyYAML has it (about fifteen times faster than the pure-Python
# one, which matters for a request body), else PyYAML's own; both safe (no tags run code).
_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER = yaml.resolver.Resolver()


def _compose(text: str) -> Iterator[yaml.Node]:
    """The root node of each document, composed from the parser's events without
    recursion, refusing aliases, deep nesting and too many nodes as they arrive."""
    stack: list[tuple[yaml.Node, list[Any]]] = []
    nodes = 0
    for event in yaml.parse(text, Loader=_PARSER):
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(
                event.start_mark,
                f"an alias (*{event.anchor}) is not allowed: definition files hold no "
                "anchors' copies (write the value out)",
            )
        node: yaml.Node | None = None
        # libyaml's marks and PyYAML's have the same line/column (typed apart).
        start: Any = event.start_mark
        if isinstance(event, yaml.ScalarEvent):
            tag = event.tag
            if tag is None or tag == "!":
                tag = _RESOLVER.resolve(yaml.ScalarNode, event.value, event.implicit)
            node = yaml.ScalarNode(tag, event.value, start, start)
        elif isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            is_seq = isinstance(event, yaml.SequenceStartEvent)
            kind = yaml.SequenceNode if is_seq else yaml.MappingNode
            tag = event.tag
            if tag is None or tag == "!":
                tag = _RESOLVER.resolve(kind, None, event.implicit)
            node = kind(tag, [], start, None)
        elif isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
            done, _ = stack.pop()
            if not stack:
                yield done
            continue
        else:
            continue  # stream and document boundaries
        nodes += 1
        if nodes > limits.MAX_DEFINITION_NODES:
            raise _Refused(
                event.start_mark,
                f"more than {limits.MAX_DEFINITION_NODES:,} YAML nodes in one file",
            )
        if stack:
            parent, pending = stack[-1]
            if isinstance(parent, yaml.SequenceNode):
                parent.value.append(node)
            elif pending:
                parent.value.append((pending.pop(), node))
            else:
                pending.append(node)  # a key, waiting for its value
        if isinstance(node, yaml.ScalarNode):
            if not stack:
                yield node
            continue
        if len(stack) >= MAX_NESTING:
            raise _Refused(
                event.start_mark,
                f"nested more than {MAX_NESTING} levels deep (lists/mappings within each other)",
            )
        stack.append((node, []))


def load_files(paths: Iterable[str]) -> list[Document]:
    """Every document of every file, in order; raises `DefinitionError` naming each file
    that cannot be read or parsed (all of them are tried)."""
    documents: list[Document] = []
    problems: list[Problem] = []
    for path in paths:
        try:
            with open(path, "rb") as handle:
                raw = handle.read(limits.MAX_DEFINITION_BYTES + 1)
        except OSError as exc:
            problems.append(Problem(path, None, "", f"cannot be read: {exc.strerror}"))
            continue
        try:
            documents.extend(load_text(raw, source=path))
        except DefinitionError as exc:
            problems.extend(exc.problems)
    if problems:
        raise DefinitionError(problems)
    return documents


def load_text(text: str | bytes, *, source: str) -> list[Document]:
    """The documents of one YAML text (a file's content or a request body)."""
    size = len(text.encode() if isinstance(text, str) else text)
    if size > limits.MAX_DEFINITION_BYTES:
        raise DefinitionError(
            [
                Problem(
                    source,
                    None,
                    "",
                    f"is larger than {limits.MAX_DEFINITION_BYTES:,} bytes; split it into "
                    "several files",
                )
            ]
        )
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DefinitionError(
                [Problem(source, None, "", f"is not UTF-8 text (byte {exc.start})")]
            ) from None
    documents: list[Document] = []
    try:
        for node in _compose(text):
            doc = Document(source=source, data=None, start_line=node.start_mark.line + 1)
            builder = _Builder(doc)
            doc.data = builder.build(node, ())
            if builder.problems:
                raise DefinitionError(builder.problems)
            documents.append(doc)
    except _Refused as exc:
        raise DefinitionError([Problem(source, exc.mark.line + 1, "", exc.message)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(x for x in (exc.context, exc.problem) if x) or "not valid YAML"
        line = mark.line + 1 if mark is not None else None
        raise DefinitionError([Problem(source, line, "", f"not valid YAML: {message}")]) from None
    except yaml.YAMLError as exc:
        raise DefinitionError([Problem(source, None, "", f"not valid YAML: {exc}")]) from None
    return documents


def dotted(path: Iterable[str | int]) -> str:
    """`datasources.warehouse.config.password`, `jobs.copy.source_spec.columns[2]`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


class _Builder:
    """Plain values from one document's nodes, recording lines and problems."""

    def __init__(self, doc: Document) -> None:
        self.doc = doc
        self.problems: list[Problem] = []
        # SafeConstructor's own scalar rules (YAML 1.1: yes/no are booleans, 0x1F an int).
        self.constructor = yaml.constructor.SafeConstructor()

    def problem(self, node: yaml.Node, path: PathKey, message: str) -> None:
        self.problems.append(
            Problem(self.doc.source, node.start_mark.line + 1, dotted(path), message)
        )

    def build(self, node: yaml.Node, path: PathKey) -> Any:
        if isinstance(node, yaml.MappingNode):
            return self.mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != f"{_YAML}seq":
                self.problem(node, path, f"the tag {node.tag} is not allowed (a plain list is)")
                return None
            items = []
            for index, item in enumerate(node.value):
                self.doc.lines[(*path, index)] = item.start_mark.line + 1
                items.append(self.build(item, (*path, index)))
            return items
        return self.scalar(node, path)

    def mapping(self, node: yaml.MappingNode, path: PathKey) -> Any:
        if node.tag != f"{_YAML}map":
            self.problem(node, path, f"the tag {node.tag} is not allowed (a plain mapping is)")
            return None
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.problem(key_node, path, "a key must be plain text, not a list or mapping")
                continue
            if key_node.tag == f"{_YAML}merge":
                self.problem(key_node, path, "merge keys (<<) are not allowed")
                continue
            # The key as written: a job named 2024 or yes is the text "2024" / "yes".
            key = str(key_node.value)
            child = (*path, key)
            if key in out:
                first = self.doc.lines[child]
                self.problem(
                    key_node, child, f"appears twice in this mapping (first on line {first})"
                )
                continue
            self.doc.lines[child] = key_node.start_mark.line + 1
            out[key] = self.build(value_node, child)
        return out

    def scalar(self, node: yaml.Node, path: PathKey) -> Any:
        tag = node.tag
        if tag == f"{_YAML}timestamp":
            self.problem(node, path, "a date or time is not a value here; quote it to make it text")
            return None
        if tag not in _SCALAR_TAGS:
            self.problem(
                node, path, f"the tag {tag} is not allowed (only text, numbers, booleans, null)"
            )
            return None
        try:
            value = self.constructor.construct_object(node)
        except (yaml.constructor.ConstructorError, ValueError):
            self.problem(node, path, f"{node.value!r} is not a valid {tag.removeprefix(_YAML)}")
            return None
        if isinstance(value, float) and not math.isfinite(value):
            self.problem(node, path, "infinity and NaN are not numbers JSON can hold")
            return None
        return value
