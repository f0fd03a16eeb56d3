"""Reading YAML: lines kept, JSON's types only, and what could cost more than its size
refused before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dispatch.ascode import DefinitionError, load_files, load_text
from dispatch.security import limits

# The classic "billion laughs": 9 levels of 9 aliases each, 9^9 strings once expanded.
BOMB = """
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def problem_of(text: str | bytes) -> str:
    with pytest.raises(DefinitionError) as caught:
        load_text(text, source="f.yaml")
    (problem,) = caught.value.problems
    return str(problem)


def test_load__keeps_the_line_of_every_key_and_item() -> None:
    (doc,) = load_text("jobs:\n  copy:\n    source_spec:\n      rows: 5\n", source="f.yaml")

    assert doc.data == {"jobs": {"copy": {"source_spec": {"rows": 5}}}}
    assert doc.line(("jobs", "copy", "source_spec", "rows")) == 4
    assert doc.line(("jobs", "copy", "no_such_field")) == 2  # its nearest ancestor


def test_load__an_alias_bomb_is_refused_at_its_first_alias_without_expanding_it() -> None:
    # What it would be: PyYAML composes aliases as shared nodes, so the graph is small
    # until something walks it; nine levels mean 387,420,489 strings.
    assert problem_of(BOMB) == (
        "f.yaml:3: an alias (*a) is not allowed: definition files hold no anchors' copies "
        "(write the value out)"
    )


def test_load__nesting_deeper_than_the_limit_is_refused_without_recursing() -> None:
    assert "nested more than 38 levels" in problem_of("[" * 100 + "]" * 100)
    # libyaml's scanner stops at its own limit first; refused either way, never a
    # RecursionError.
    assert "f.yaml:1: " in problem_of("[" * 100_000)
    assert "nested more than" in problem_of(
        "a:\n" + "".join(f"{' ' * i}b:\n" for i in range(1, 60))
    )


def test_load__more_nodes_than_the_limit_are_refused() -> None:
    text = "[" + "0," * limits.MAX_DEFINITION_NODES + "0]"
    assert len(text) < limits.MAX_DEFINITION_BYTES  # refused for its nodes, not its size
    assert f"more than {limits.MAX_DEFINITION_NODES:,} YAML nodes" in problem_of(text)


def test_load__a_file_past_the_size_limit_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (limits.MAX_DEFINITION_BYTES + 1))

    with pytest.raises(DefinitionError) as caught:
        load_files([str(path)])

    assert f"is larger than {limits.MAX_DEFINITION_BYTES:,} bytes" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: 1\na: 2\n", "f.yaml:2: a: appears twice in this mapping (first on line 1)"),
        ("a: 2024-01-01\n", "f.yaml:1: a: a date or time is not a value here; quote it"),
        ("a: !!binary aGk=\n", "f.yaml:1: a: the tag tag:yaml.org,2002:binary is not allowed"),
        (
            "a: !!python/object/apply:os.system [id]\n",
            "f.yaml:1: a: the tag tag:yaml.org,2002:python",
        ),
        ("a: .nan\n", "f.yaml:1: a: infinity and NaN are not numbers JSON can hold"),
        ("<<: {a: 1}\n", "f.yaml:1: merge keys (<<) are not allowed"),
        ("? [a]\n: 1\n", "f.yaml:1: a key must be plain text, not a list or mapping"),
        ("a: [1,\n", "f.yaml:2: not valid YAML"),
        (b"a: \xff\n", "f.yaml: is not UTF-8 text (byte 3)"),
    ],
)
def test_load__refuses_what_is_not_plain_data_naming_the_line(
    text: str | bytes, message: str
) -> None:
    assert problem_of(text).startswith(message)


def test_load__keys_are_the_text_as_written() -> None:
    (doc,) = load_text("2024: 1\nyes: 2\nnull: 3\n", source="f.yaml")

    assert doc.data == {"2024": 1, "yes": 2, "null": 3}


def test_load__every_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("jobs: {}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("jobs: [\n")

    with pytest.raises(DefinitionError) as caught:
        load_files([str(tmp_path / "missing.yaml"), str(good), str(bad)])

    assert [p.file for p in caught.value.problems] == [
        str(tmp_path / "missing.yaml"),
        str(bad),
    ]


def test_load__pyyaml_would_expand_the_bomb() -> None:
    """The refusal matters: the same text is valid YAML that safe_load accepts (the
    expansion happens when the result is walked, e.g. serialised)."""
    loaded = yaml.safe_load(BOMB)
    assert len(loaded["i"]) == 9 and loaded["i"][0] is loaded["h"]
