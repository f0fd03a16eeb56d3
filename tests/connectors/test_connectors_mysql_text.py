"""The `mysql` sink's LOAD DATA text, made by one function per column (`types.loader`),
is the generic encoder's text of the checked value, for every base type; the checks
still refuse what does not fit. No server needed."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest

from dispatch.connectors.base import PermanentError
from dispatch.connectors.mysql import types

UTC2 = dt.timezone(dt.timedelta(hours=2))
VALUES: dict[str, list[Any]] = {
    "tinyint(1)": [True, False, 0, 127, -128, Decimal("5"), 5.0],
    "bigint unsigned": [0, 2**64 - 1, "42"],
    "year": [1901, 2155, 0],
    "decimal(12,2)": [Decimal("1.5"), Decimal("-9999999999.99"), 3, "0.10", 2.25],
    "double": [1.5, -2.2250738585072014e-308, 10**20, Decimal("0.1")],
    "float": [0.25],
    "varchar(20)": ["tab\there", "nl\nbs\\", "ctrl-z \x1a", "😀", 12, b"bytes"],
    "longtext": ['{"k": [1, 2.5]}', {"k": [1, "😀"]}, ["a", 1], "x" * 1000, "nul\x00"],
    "enum('a','b')": ["a", "b"],
    "set('x','y','z')": ["x,z", ["y", "x"], ""],
    "datetime(6)": [
        dt.datetime(2024, 1, 2, 3, 4, 5, 6),
        dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC2),
        dt.date(2024, 1, 2),
        "2024-01-02 03:04:05.5",
    ],
    "timestamp(3)": [dt.datetime(2038, 1, 19, 3, 14, 7, tzinfo=dt.UTC)],
    "date": [dt.date(1000, 1, 1), dt.datetime(2024, 5, 6), "9999-12-31"],
    "time(6)": [dt.timedelta(hours=-838, minutes=-59), dt.time(23, 59, 59, 1)],
    "varbinary(10)": [b"\x00\t\n\\", bytearray(b"ab"), "text"],
    "char(36)": ["6f1c1e2a-0000-4000-8000-000000000000"],
}
REFUSED: dict[str, list[Any]] = {
    "tinyint": [128, 1.5, "x"],
    "decimal(5,2)": [Decimal("1000"), Decimal("1.001"), "nan"],
    "double": [float("inf")],
    "varchar(3)": ["abcd", "\ud800"],
    "tinytext": ["é" * 200],
    "enum('a','b')": ["c", "a\x00"],
    "timestamp": [dt.datetime(2038, 1, 19, 3, 14, 8), dt.datetime(1969, 12, 31)],
    "date": [dt.datetime(2024, 1, 1, 12, 0)],
    "time": [dt.timedelta(hours=839)],
}


@pytest.mark.parametrize("column_type", sorted(VALUES))
def test_loader__same_text_as_the_generic_encoder(column_type: str) -> None:
    t = types.MySQLType(column_type)
    check, load = t.check("c"), types.loader(t, "c")
    for value in [None, *VALUES[column_type]]:
        assert load(value) == types._field(check(value)), (column_type, value)
    rows = [[v] for v in [None, *VALUES[column_type]]]
    expected = b"".join(types._field(check(r[0])) + b"\n" for r in rows)
    assert types.load_rows([load], rows) == expected


@pytest.mark.parametrize("column_type", sorted(REFUSED))
def test_loader__refuses_what_the_check_refuses_naming_the_column(column_type: str) -> None:
    t = types.MySQLType(column_type)
    load = types.loader(t, "the_column")
    for value in REFUSED[column_type]:
        with pytest.raises(PermanentError, match="sink column 'the_column'"):
            load(value)
