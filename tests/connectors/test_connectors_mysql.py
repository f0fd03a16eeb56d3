"""The `mysql` connector against the tests' own MariaDB server (tests/support/mariadb.py)
and scratch PostgreSQL databases: types both ways, copies, the fence, incremental reads,
least privilege and cancellation."""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.core.exceptions import ValidationError

from dispatch.connectors.base import FenceRejected, PermanentError, TransientError
from dispatch.connectors.mysql import MySQLConnector
from dispatch.connectors.mysql.localinfile import RefusedRequest
from dispatch.connectors.mysql.types import NO_LOAD, MySQLType
from dispatch.connectors.postgresql import PostgreSQLConnector
from tests.support.connectors import Ctx, Fence, ScratchDB, run_transfer, scratch_db
from tests.support.mariadb import MyDB
from tools.blackhole import BlackholeProxy

pytestmark = pytest.mark.django_db(transaction=True)

MY, PG = MySQLConnector, PostgreSQLConnector


@pytest.fixture
def pg(django_db_setup: Any) -> Iterator[ScratchDB]:
    yield from scratch_db("dispatch_mysql_pg")


ALL_TYPES = """CREATE TABLE alltypes (
  id INT PRIMARY KEY, ti TINYINT, tiu TINYINT UNSIGNED, si SMALLINT, siu SMALLINT UNSIGNED,
  mi MEDIUMINT, mu MEDIUMINT UNSIGNED, i INT, iu INT UNSIGNED, bi BIGINT, bu BIGINT UNSIGNED,
  dec_big DECIMAL(65,30), dec_small DECIMAL(5,2), f FLOAT, d DOUBLE, b1 BIT(1), b12 BIT(12),
  c CHAR(3), vc VARCHAR(20), tt TINYTEXT, tx TEXT, mt MEDIUMTEXT, lt LONGTEXT,
  bn BINARY(4), vb VARBINARY(10), bl BLOB, lb LONGBLOB, j JSON, e ENUM('a','b','c'),
  st SET('x','y','z'), dd DATE, dtm DATETIME(6), ts TIMESTAMP(3) NULL, tm TIME(6), yr YEAR,
  bo BOOLEAN
) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"""

AWKWARD = (
    1, -128, 255, -32768, 65535, -8388608, 16777215, -2147483648, 4294967295,
    -9223372036854775808, 18446744073709551615,
    "12345678901234567890123456789012345.123456789012345678901234567890", "-999.99",
    1.5, 2.2250738585072014e-308, 1, 4095,
    "abc", "😀 utf8mb4 ✓", "tiny", "text", "medium", "x" * 100_000,
    b"\x00\x01\xfe\xff", b"\x00", b"\xde\xad", bytes(range(256)) * 10,
    '{"k": [1, 2.5, "😀", null], "n": {"deep": true}}', "b", "x,z",
    "1000-01-01", "9999-12-31 23:59:59.999999", "2038-01-19 03:14:07.499", "-838:59:59.000000",
    2155, 1,
)  # fmt: skip


def _seed_all_types(my: MyDB) -> None:
    my.execute(ALL_TYPES)
    my.execute(f"INSERT INTO alltypes VALUES ({', '.join(['%s'] * len(AWKWARD))})", AWKWARD)
    my.execute("INSERT INTO alltypes (id) VALUES (2)")  # every other column NULL


def test_types__mysql_to_postgresql_and_back_value_by_value(mydb: MyDB, pg: ScratchDB) -> None:
    _seed_all_types(mydb)
    result = run_transfer(
        MY, mydb.config, {"table": "alltypes"}, PG, pg.config, {"table": "t", "create": True}
    )
    assert result.rows_written == 2
    types = dict(
        pg.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = 't'::regclass AND attnum > 0"
        )
    )
    assert types["bu"] == "numeric(20,0)" and types["iu"] == "bigint"
    assert types["dec_big"] == "numeric(65,30)" and types["b12"] == "bit(12)"
    assert types["j"] == "jsonb" and types["st"] == "text[]" and types["e"] == "text"
    assert types["ts"] == "timestamp(3) with time zone" and types["tm"] == "interval"
    assert types["dtm"] == "timestamp(6) without time zone" and types["lb"] == "bytea"
    row = pg.execute("SELECT * FROM t WHERE id = 1")[0]
    names = [r[0] for r in pg.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = 't'::regclass AND attnum > 0"
        " ORDER BY attnum"
    )]  # fmt: skip
    got = dict(zip(names, row, strict=True))
    assert got["bu"] == Decimal(2**64 - 1) and got["bi"] == -(2**63)
    assert got["dec_big"] == Decimal(AWKWARD[11]) and got["dec_small"] == Decimal("-999.99")
    assert got["b1"] == "1" and got["b12"] == "111111111111"
    assert got["vc"] == "😀 utf8mb4 ✓" and got["lt"] == "x" * 100_000
    assert bytes(got["bn"]) == b"\x00\x01\xfe\xff" and bytes(got["lb"]) == bytes(range(256)) * 10
    assert got["j"] == {"k": [1, 2.5, "😀", None], "n": {"deep": True}}
    assert got["e"] == "b" and got["st"] == ["x", "z"]
    assert got["dd"] == dt.date(1000, 1, 1)
    assert got["dtm"] == dt.datetime(9999, 12, 31, 23, 59, 59, 999999)
    assert got["ts"] == dt.datetime(2038, 1, 19, 3, 14, 7, 499000, tzinfo=dt.UTC)
    assert got["tm"] == -dt.timedelta(hours=838, minutes=59, seconds=59)
    assert got["yr"] == 2155 and got["bo"] == 1
    assert all(v is None for k, v in zip(names, pg.execute("SELECT * FROM t WHERE id = 2")[0],
                                          strict=True) if k != "id")  # fmt: skip

    # And back: PostgreSQL -> a created MySQL table, then compared with the original.
    result = run_transfer(
        PG, pg.config, {"table": "t"}, MY, mydb.config, {"table": "back", "create": True}
    )
    assert result.rows_written == 2
    cols = ", ".join("CAST(tm AS CHAR)" if n == "tm" else n for n in names)
    original = mydb.execute(f"SELECT {cols} FROM alltypes ORDER BY id")
    back = mydb.execute(f"SELECT {cols} FROM back ORDER BY id")
    for o_row, b_row in zip(original, back, strict=True):
        for name, o, b in zip(names, o_row, b_row, strict=True):
            if name == "st":
                assert b is None if o is None else json.loads(b) == ["x", "z"], name
            elif name == "j":
                assert (o is None and b is None) or json.loads(o) == json.loads(b), name
            elif name == "bn":
                assert o == b, name
            else:
                assert o == b, (name, o, b)


def test_types__postgresql_values_mysql_cannot_hold_fail_naming_the_column(
    mydb: MyDB, pg: ScratchDB
) -> None:
    mydb.execute("CREATE TABLE narrow (id INT PRIMARY KEY, d DATETIME, n DECIMAL(5,2))")
    cases = [
        ("SELECT g AS id, DATE '2000-01-01' + g AS d, 1.5 AS n FROM generate_series(1, 20000) g"
         " UNION ALL SELECT 20001, timestamp '0500-01-01', 1", "'d'", "outside the years"),
        ("SELECT g AS id, NULL::timestamp AS d, 1.5 AS n FROM generate_series(1, 20000) g"
         " UNION ALL SELECT 20001, NULL, 1234.5", "'n'", "integer digits"),
        ("SELECT 1 AS id, NULL::timestamp AS d, 1.234 AS n", "'n'", "decimal places"),
    ]  # fmt: skip
    for query, column, why in cases:
        with pytest.raises(PermanentError) as err:
            run_transfer(PG, pg.config, {"query": query}, MY, mydb.config, {"table": "narrow"})
        assert f"sink column {column}" in str(err.value) and why in str(err.value)
        assert mydb.execute("SELECT COUNT(*) FROM narrow") == [(0,)]  # nothing committed


def test_types__a_zero_date_and_a_too_large_unsigned_fail_naming_the_column(
    mydb: MyDB, pg: ScratchDB
) -> None:
    mydb.execute("SET SESSION sql_mode = ''")
    mydb.execute("CREATE TABLE z (id INT, d DATE)")
    conn = mydb.server.root(database=mydb.name)
    with conn.cursor() as cur:
        cur.execute("SET SESSION sql_mode = ''")
        cur.execute("INSERT INTO z VALUES (1, '2020-01-01'), (2, '0000-00-00')")
    conn.close()
    with pytest.raises(PermanentError, match="source column 'd'.*0000-00-00"):
        run_transfer(MY, mydb.config, {"table": "z"}, PG, pg.config, {"table": "z", "create": True})
    assert pg.execute("SELECT to_regclass('z') IS NULL") == [(True,)]  # not even created

    mydb.execute("CREATE TABLE u (id INT, big BIGINT UNSIGNED)")
    mydb.execute("INSERT INTO u VALUES (1, 5), (2, 9223372036854775808)")
    pg.execute("CREATE TABLE u (id int, big bigint)")
    with pytest.raises(PermanentError, match="bigint"):
        run_transfer(MY, mydb.config, {"table": "u"}, PG, pg.config, {"table": "u"})
    assert pg.execute("SELECT count(*) FROM u") == [(0,)]


def test_copy__100000_rows_each_way(mydb: MyDB, pg: ScratchDB) -> None:
    pg.execute(
        "CREATE TABLE src AS SELECT g AS id, 'name-' || g AS name, (g * 1.25)::numeric(12,2)"
        " AS amount, timestamptz '2024-01-01' + g * interval '1 second' AS at"
        " FROM generate_series(1, 100000) g"
    )
    result = run_transfer(
        PG, pg.config, {"table": "src"}, MY, mydb.config, {"table": "dst", "create": True}
    )
    assert result.rows_written == 100_000
    assert mydb.execute("SELECT COUNT(*), SUM(id), SUM(amount), MAX(at) FROM dst") == [
        (100_000, Decimal(5000050000), Decimal("6250062500.00"), dt.datetime(2024, 1, 2, 3, 46, 40))
    ]
    result = run_transfer(
        MY, mydb.config, {"table": "dst"}, PG, pg.config, {"table": "again", "create": True}
    )
    assert result.rows_written == 100_000
    assert pg.execute("SELECT count(*), sum(id), sum(amount), max(at) FROM again") == [
        (100_000, 5000050000, Decimal("6250062500.00"), dt.datetime(2024, 1, 2, 3, 46, 40))
    ]


def test_json__goes_as_postgresql_text_never_parsed(mydb: MyDB, pg: ScratchDB) -> None:
    """The sink asks for JSON as text (`json_text`), so a number no float holds arrives
    digit for digit, as PostgreSQL writes it; both json and jsonb, loaded and inserted."""
    pg.execute(
        "CREATE TABLE j AS SELECT 1 AS id,"
        ' \'{"n": 12345678901234567890.123456789, "s": "😀"}\'::jsonb AS jb,'
        " '[1e400,  0.10]'::json AS js"
    )
    texts = pg.execute("SELECT jb::text, js::text FROM j")
    mydb.execute("CREATE TABLE j (id INT, jb LONGTEXT, js JSON)")  # MariaDB: JSON is text
    run_transfer(PG, pg.config, {"table": "j"}, MY, mydb.config, {"table": "j"})
    assert mydb.execute("SELECT jb, js FROM j") == texts
    mydb.execute("CREATE TABLE ju (id INT PRIMARY KEY, jb LONGTEXT, js JSON)")
    run_transfer(  # upsert: INSERTs
        PG, pg.config, {"table": "j"}, MY, mydb.config,
        {"table": "ju", "mode": "upsert", "key": ["id"]},
    )  # fmt: skip
    assert mydb.execute("SELECT jb, js FROM ju") == texts


def test_sink_modes__replace_and_upsert(mydb: MyDB, pg: ScratchDB) -> None:
    mydb.execute("CREATE TABLE m (id INT PRIMARY KEY, v VARCHAR(10), other INT DEFAULT 7)")
    mydb.execute("INSERT INTO m VALUES (1, 'old', 1), (9, 'gone', 9)")
    query = {"query": "SELECT g AS id, 'new' || g AS v FROM generate_series(1, 3) g"}
    run_transfer(
        PG, pg.config, query, MY, mydb.config, {"table": "m", "mode": "upsert", "key": ["id"]}
    )
    # Upsert updates the source's columns only: `other` keeps its value (REPLACE would not).
    assert mydb.execute("SELECT * FROM m ORDER BY id") == [
        (1, "new1", 1), (2, "new2", 7), (3, "new3", 7), (9, "gone", 9)
    ]  # fmt: skip
    run_transfer(PG, pg.config, query, MY, mydb.config, {"table": "m", "mode": "replace"})
    assert mydb.execute("SELECT id FROM m ORDER BY id") == [(1,), (2,), (3,)]
    with pytest.raises(PermanentError, match="no primary key or unique index"):
        run_transfer(PG, pg.config, query, MY, mydb.config,
                     {"table": "m", "mode": "upsert", "key": ["v"]})  # fmt: skip


def test_fence__a_stale_attempt_commit_is_refused(mydb: MyDB, pg: ScratchDB) -> None:
    mydb.execute("CREATE TABLE f (id INT)")
    stale = Ctx(fence=Fence(token=1))
    with MY.open_writer(mydb.config, {"table": "f"}, stale, []) as writer:
        writer.source_columns.append(type("C", (), {"name": "id", "type": "integer"})())
        writer.write([(1,), (2,)])
        # A successor raises the fence (token 2) and commits its rows first.
        successor = Ctx(fence=Fence(run_id=stale.fence.run_id, token=2))
        run_transfer(PG, pg.config, {"query": "SELECT 10 AS id"}, MY, mydb.config,
                     {"table": "f"}, successor)  # fmt: skip
        with pytest.raises(FenceRejected):
            writer.commit()
    assert mydb.execute("SELECT id FROM f") == [(10,)]
    # A third attempt finds the run committed and writes nothing.
    late = Ctx(fence=Fence(run_id=stale.fence.run_id, token=3))
    result = run_transfer(PG, pg.config, {"query": "SELECT 11 AS id"}, MY, mydb.config,
                          {"table": "f"}, late)  # fmt: skip
    assert result.already_committed and mydb.execute("SELECT id FROM f") == [(10,)]


def test_incremental__both_ways_exactly_once(mydb: MyDB, pg: ScratchDB) -> None:
    mydb.execute("CREATE TABLE ev (id BIGINT UNSIGNED PRIMARY KEY, at DATETIME(6), v TEXT)")
    mydb.execute(
        "INSERT INTO ev VALUES (1, '2024-01-01 00:00:00.5', 'a'), (18446744073709551614,"
        " '2024-01-02', 'b')"
    )
    spec = {"table": "ev", "incremental": {"cursor": ["id"]}}
    binding = Fence().binding_id

    def ctx() -> Ctx:
        return Ctx(fence=Fence(binding_id=binding))

    assert run_transfer(MY, mydb.config, spec, PG, pg.config,
                        {"table": "ev", "create": True}, ctx()).rows_written == 2  # fmt: skip
    assert run_transfer(MY, mydb.config, spec, PG, pg.config,
                        {"table": "ev"}, ctx()).rows_written == 0  # fmt: skip
    mydb.execute("INSERT INTO ev VALUES (18446744073709551615, '2024-01-03', 'c'), (5, NULL, 'd')")
    # 5 is below the committed cursor: not read (an id cursor assumes ids only grow).
    assert run_transfer(MY, mydb.config, spec, PG, pg.config,
                        {"table": "ev"}, ctx()).rows_written == 1  # fmt: skip
    assert pg.execute("SELECT id FROM ev ORDER BY id") == [
        (1,),
        (18446744073709551614,),
        (18446744073709551615,),
    ]

    # PostgreSQL -> MySQL: the cursor lives in the MySQL sink, beside its fence.
    pspec = {"table": "ev", "incremental": {"cursor": ["at", "id"]}}
    binding2 = Fence().binding_id
    c2 = Ctx(fence=Fence(binding_id=binding2))
    assert run_transfer(PG, pg.config, pspec, MY, mydb.config,
                        {"table": "copy", "create": True}, c2).rows_written == 3  # fmt: skip
    stored = mydb.execute("SELECT columns, cursor_value, version FROM dispatch_cursor"
                          " WHERE binding_id = %s", [str(binding2)])  # fmt: skip
    assert json.loads(stored[0][0]) == ["at", "id"] and stored[0][2] == 1
    assert json.loads(stored[0][1]) == ["2024-01-03 00:00:00", "18446744073709551615"]
    pg.execute("INSERT INTO ev VALUES (7, '2024-01-04', 'e')")
    c3 = Ctx(fence=Fence(binding_id=binding2))
    assert run_transfer(PG, pg.config, pspec, MY, mydb.config, {"table": "copy"},
                        c3).rows_written == 1  # fmt: skip
    assert mydb.execute("SELECT id FROM copy ORDER BY at") == [
        (1,),
        (18446744073709551614,),
        (18446744073709551615,),
        (7,),
    ]


def test_least_privilege__a_query_source_user_with_more_than_select_is_refused(
    mydb: MyDB, pg: ScratchDB, settings: Any
) -> None:
    settings.DISPATCH_QUERY_SOURCE_LEAST_PRIVILEGE = True
    mydb.execute("CREATE TABLE s (id INT)")
    mydb.execute("INSERT INTO s VALUES (1)")
    for user, grant in (
        ("reader", f"GRANT SELECT ON `{mydb.name}`.* TO reader@'%'"),
        ("filer", f"GRANT SELECT ON `{mydb.name}`.* TO filer@'%'"),
        ("writer", f"GRANT SELECT, INSERT ON `{mydb.name}`.s TO writer@'%'"),
    ):
        mydb.execute(f"DROP USER IF EXISTS {user}@'%'")
        mydb.execute(f"CREATE USER {user}@'%' IDENTIFIED BY 'pw-{user}'")
        mydb.execute(grant)
    mydb.execute("GRANT FILE, PROCESS ON *.* TO filer@'%'")
    spec = {"query": "SELECT id FROM s"}
    for user, refused in (("filer", "FILE, PROCESS"), ("writer", "INSERT")):
        config = {**mydb.config, "user": user, "password": f"pw-{user}"}
        with pytest.raises(PermanentError, match=refused) as err:
            run_transfer(MY, config, spec, PG, pg.config, {"table": user, "create": True})
        assert f"pw-{user}" not in str(err.value)
    config = {**mydb.config, "user": "reader", "password": "pw-reader"}
    assert run_transfer(MY, config, spec, PG, pg.config,
                        {"table": "ok", "create": True}).rows_written == 1  # fmt: skip
    # The table source of a privileged user is not a query: it runs.
    config = {**mydb.config, "user": "writer", "password": "pw-writer"}
    assert run_transfer(MY, config, {"table": "s"}, PG, pg.config,
                        {"table": "ok2", "create": True}).rows_written == 1  # fmt: skip


def test_cancel__a_stop_interrupts_a_running_sleep(mydb: MyDB) -> None:
    ctx = Ctx()
    spec = {"query": "SELECT SLEEP(60) AS s"}
    mydb.execute(f"GRANT SELECT ON `{mydb.name}`.* TO reader2@'%' IDENTIFIED BY 'pw2'")
    config = {**mydb.config, "user": "reader2", "password": "pw2"}
    done = threading.Event()
    outcome: list[Any] = []

    def read() -> None:
        try:
            with MY.open_reader(config, spec, ctx) as reader:  # the query starts here
                outcome.extend(reader.batches())
        except TransientError as exc:
            outcome.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=read)
    thread.start()
    # Wait until the server runs the SLEEP, then stop as the runner does.
    conn = mydb.server.root()
    try:
        for _ in range(600):
            with conn.cursor() as cur:
                cur.execute("SELECT ID FROM information_schema.PROCESSLIST"
                            " WHERE INFO LIKE 'SELECT SLEEP(60)%'")  # fmt: skip
                if cur.fetchall():
                    break
            done.wait(0.05)
        for interrupt in list(ctx.interrupts):
            interrupt()
        assert done.wait(20), "the SLEEP(60) was not interrupted"
    finally:
        conn.close()
    thread.join()
    # KILL QUERY: the statement fails as interrupted (a transient error; the runner
    # reports the stop's own cause).
    assert len(outcome) == 1 and "MySQL error 1317" in str(outcome[0])


def test_config__policy_and_validation() -> None:
    with pytest.raises(ValidationError, match="port"):
        MY.validate_config({"host": "db", "user": "u", "port": 70000})
    with pytest.raises(ValidationError, match="tls"):
        MY.validate_config({"host": "db", "user": "u", "tls": "sometimes"})
    with pytest.raises(ValidationError, match="Unix-socket directory"):
        MY.validate_config({"host": "/var/run/mysqld/mysqld.sock", "user": "u"})
    with pytest.raises(ValidationError, match="one statement"):
        MY.validate_source_spec({"query": "SELECT 1; DROP TABLE x"})
    with pytest.raises(ValidationError, match="backticks"):
        MY.validate_sink_spec({"table": "a`b"})


def test_secrets__a_wrong_password_error_holds_no_secret(mydb: MyDB) -> None:
    config = {**mydb.config, "password": "wrong-secret-XYZ"}
    with pytest.raises(PermanentError) as err:
        MY.test_connection(config)
    assert "wrong-secret-XYZ" not in str(err.value) and "1045" in str(err.value)


def test_query_source__column_types_from_the_wire(mydb: MyDB, pg: ScratchDB) -> None:
    mydb.execute("CREATE TABLE w (u BIGINT UNSIGNED, d DECIMAL(30,10), b BIT(3), s SET('p','q'),"
                 " t DATETIME(3), bl VARBINARY(5), e ENUM('x','y'))")  # fmt: skip
    mydb.execute("INSERT INTO w VALUES (18446744073709551615, -12345678901234567890.0123456789,"
                 " b'101', 'p,q', '2024-02-29 12:00:00.125', x'00ff', 'y')")  # fmt: skip
    query = "SELECT u, d, b, s, t, bl, e, u - 1 AS calc, 'literal 😀' AS lit FROM w"
    with MY.open_reader(mydb.config, {"query": query}, Ctx()) as reader:
        assert [c.type for c in reader.columns] == [
            "numeric(20,0)", "numeric(30,10)", "bit(3)", "text[]",
            "timestamp(3) without time zone", "bytea", "text", "numeric(20,0)", "text",
        ]  # fmt: skip
        [[row]] = list(reader.batches())
    assert list(row) == [
        18446744073709551615, Decimal("-12345678901234567890.0123456789"), "101", ["p", "q"],
        dt.datetime(2024, 2, 29, 12, 0, 0, 125000), b"\x00\xff", "y", 18446744073709551614,
        "literal 😀",
    ]  # fmt: skip
    run_transfer(MY, mydb.config, {"query": query}, PG, pg.config, {"table": "w", "create": True})
    assert pg.execute("SELECT u, s, lit FROM w") == [
        (Decimal(18446744073709551615), ["p", "q"], "literal 😀")
    ]


AWKWARD_TEXT = ["tab\there", "line\nbreak\r\n", "back\\slash", "nul\x00byte", "\\N", "", "😀",
                "ctrl-z \x1a", "NULL"]  # fmt: skip


def _load_table(my: MyDB, name: str) -> None:
    my.execute(f"CREATE TABLE {name} (id INT PRIMARY KEY, t LONGTEXT, b LONGBLOB,"
               " d DECIMAL(65,30), tm TIME(6), dtm DATETIME(6), j JSON, f DOUBLE, n INT)")  # fmt: skip


def test_load_data__escapes_every_awkward_value_as_the_inserts_do(mydb: MyDB) -> None:
    rows = [
        [i, text, bytes(range(256)) + text.encode(), Decimal("-1E+20") / 3 if i % 2 else
         Decimal("12345678901234567890123456789012345.123456789012345678901234567890"),
         -dt.timedelta(hours=838, minutes=59, seconds=58, microseconds=5) if i % 2 else
         dt.timedelta(microseconds=1),
         dt.datetime(1000, 1, 1, 0, 0, 0, 1), '{"k": "' + str(i) + '\\t"}', 1e-300 * i, None]
        for i, text in enumerate(AWKWARD_TEXT)
    ]  # fmt: skip
    columns = [type("C", (), {"name": n, "type": ""})() for n in
               ("id", "t", "b", "d", "tm", "dtm", "j", "f", "n")]  # fmt: skip
    results = []
    for table, use_load in (("by_load", True), ("by_insert", False)):
        _load_table(mydb, table)
        ctx = Ctx()
        with MY.open_writer(mydb.config, {"table": table}, ctx, columns) as writer:
            writer.use_load = use_load
            assert writer.write(rows) == len(rows)
            assert bool(writer._load) == use_load
            writer.commit()
        results.append(mydb.execute(f"SELECT * FROM {table} ORDER BY id"))
    assert results[0] == results[1]
    got = results[0]
    assert [r[1] for r in got] == AWKWARD_TEXT and all(r[8] is None for r in got)
    assert got[3][2] == bytes(range(256)) + b"nul\x00byte"


def test_load_data__a_server_that_refuses_local_infile_gets_inserts(mydb: MyDB) -> None:
    # MySQL 8's default (local_infile OFF), here on MariaDB: the refused LOAD fails alone,
    # that batch and the next ones go as INSERTs, in the same transaction.
    mydb.execute("CREATE TABLE t (id INT, v LONGTEXT)")
    columns = [type("C", (), {"name": n, "type": ""})() for n in ("id", "v")]
    [(was,)] = mydb.execute("SELECT @@GLOBAL.local_infile")
    mydb.execute("SET GLOBAL local_infile = 0")
    try:
        with MY.open_writer(mydb.config, {"table": "t", "mode": "replace"}, Ctx(), columns) as w:
            assert w.use_load  # a LOAD is tried first
            for first in (1, 3):
                assert w.write([[first, "a\tb"], [first + 1, None]]) == 2
                assert not w._load
            w.commit()
    finally:
        mydb.execute("SET GLOBAL local_infile = %s", [was])
    assert mydb.execute("SELECT * FROM t ORDER BY id") == [
        (1, "a\tb"),
        (2, None),
        (3, "a\tb"),
        (4, None),
    ]


def test_load_data__mysql_native_json_columns_are_inserted() -> None:
    # MySQL's JSON type (COLUMN_TYPE `json`) takes no value of CHARACTER SET binary;
    # MariaDB's JSON is a LONGTEXT and loads.
    assert MySQLType("json").base in NO_LOAD
    assert MySQLType("longtext").base not in NO_LOAD


def test_load_data__a_request_for_any_other_file_is_refused(mydb: MyDB, tmp_path: Any) -> None:
    mydb.execute("CREATE TABLE t (v LONGTEXT)")
    secret = tmp_path / "secret.txt"
    secret.write_text("worker-local-secret\n")
    with MY.open_writer(mydb.config, {"table": "t"}, Ctx(), []) as writer, writer._cur() as cur:
        for statement in (
            f"LOAD DATA LOCAL INFILE '{secret}' INTO TABLE t",
            "LOAD DATA LOCAL INFILE 'dispatch-rows' INTO TABLE t",  # nothing pending
        ):
            with pytest.raises(RefusedRequest, match="did not send; refused"):
                cur.execute(statement)
    assert mydb.execute("SELECT COUNT(*) FROM t") == [(0,)]


def test_cancel__a_server_that_stopped_answering_is_left_at_once(mydb: MyDB) -> None:
    """The stop's KILL QUERY cannot reach a server behind a black hole: the connection's
    socket is shut down instead, and the blocked read fails (transient)."""
    ctx = Ctx()
    done = threading.Event()
    outcome: list[Any] = []
    with BlackholeProxy("127.0.0.1", mydb.server.port) as proxy:
        config = {**mydb.config, "port": proxy.port, "tls": "disabled"}

        def read() -> None:
            try:
                with MY.open_reader(config, {"query": "SELECT SLEEP(60) AS s"}, ctx) as reader:
                    outcome.extend(reader.batches())
            except TransientError as exc:
                outcome.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=read)
        thread.start()
        conn = mydb.server.root()
        try:
            for _ in range(600):
                with conn.cursor() as cur:
                    cur.execute("SELECT ID FROM information_schema.PROCESSLIST"
                                " WHERE INFO LIKE 'SELECT SLEEP(60)%'")  # fmt: skip
                    if cur.fetchall():
                        break
                done.wait(0.05)
            proxy.blackhole()
            for interrupt in list(ctx.interrupts):
                interrupt()  # its own connection times out (10 s), then the shutdown
            assert done.wait(30), "the read was not interrupted"
        finally:
            conn.close()
        thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], TransientError), outcome


PG_TYPES = """CREATE TABLE pgtypes (
  id integer PRIMARY KEY, sm smallint, bi bigint, nu numeric, n2 numeric(70,35), r real,
  dp double precision, bo boolean, tx text, vc varchar(5), ch char(3), by bytea, d date,
  ts timestamp(3), tz timestamptz, t time, iv interval, u uuid, j json, jb jsonb,
  ia integer[], ta text[], b bit(4), vb bit varying(10), ip inet, ci cidr, mo money,
  x xml, rg int4range, tt timetz)"""


def test_types__postgresql_to_mysql_for_its_types(mydb: MyDB, pg: ScratchDB) -> None:
    pg.execute(PG_TYPES)
    pg.execute(
        "INSERT INTO pgtypes VALUES (1, -32768, -9223372036854775808,"
        " 123456789012345678901234567890.000000000000000000000000000001,"
        " 1.5, 1.5, 2.2250738585072014e-308, true, E'tab\\there 😀', 'ab😀', 'xyz', '\\x00ff'::bytea,"
        " '9999-12-31', '2024-02-29 23:59:59.999', '2024-06-01 12:00:00+02', '23:59:59.999999',"
        " '-838:59:59', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{\"a\": [1, 2]}',"
        " '{\"b\": {\"c\": null}}', '{1,2,3}', '{\"x\",\"y z\"}', B'1010', B'101', '192.168.0.1',"
        " '10.0.0.0/8', 12.34, '<a>b</a>', '[1,5)', '12:00:00+02')"
    )
    pg.execute("INSERT INTO pgtypes (id) VALUES (2)")
    result = run_transfer(
        PG, pg.config, {"table": "pgtypes"}, MY, mydb.config, {"table": "pgt", "create": True}
    )
    assert result.rows_written == 2
    declared = dict(mydb.execute(
        "SELECT COLUMN_NAME, COLUMN_TYPE FROM information_schema.COLUMNS"
        " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'pgt'"
    ))  # fmt: skip
    assert declared["nu"] == "decimal(65,30)" and declared["n2"] == "decimal(65,30)"
    assert declared["bo"] == "tinyint(1)" and declared["u"] == "char(36)"
    assert declared["ts"] == "datetime(3)" and declared["tz"] == "datetime(6)"
    assert declared["iv"] == "time(6)" and declared["b"] == "bit(4)"
    assert declared["ia"] == "longtext" and declared["vc"] == "varchar(5)"  # JSON: MariaDB's
    cols = [c for c in declared if c != "n2"]
    row = dict(zip(cols, mydb.execute(f"SELECT {', '.join(f'`{c}`' for c in cols)} FROM pgt WHERE id = 1")[0],
                   strict=True))  # fmt: skip
    assert row["bi"] == -(2**63) and row["bo"] == 1
    assert row["nu"] == Decimal("123456789012345678901234567890.000000000000000000000000000001")
    assert row["tx"] == "tab\there 😀" and row["vc"] == "ab😀" and row["by"] == b"\x00\xff"
    assert row["ts"] == dt.datetime(2024, 2, 29, 23, 59, 59, 999000)
    assert row["tz"] == dt.datetime(2024, 6, 1, 10, 0)  # UTC
    assert row["iv"] == -dt.timedelta(hours=838, minutes=59, seconds=59)
    assert row["u"] == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    assert json.loads(row["ia"]) == [1, 2, 3] and json.loads(row["ta"]) == ["x", "y z"]
    assert json.loads(row["jb"]) == {"b": {"c": None}} and row["b"] == b"\x0a"
    assert row["ip"] == "192.168.0.1" and row["ci"] == "10.0.0.0/8" and row["x"] == "<a>b</a>"
    assert all(v is None for k, v in zip(cols, mydb.execute(
        f"SELECT {', '.join(f'`{c}`' for c in cols)} FROM pgt WHERE id = 2")[0], strict=True) if k != "id")  # fmt: skip
    # numeric(70,35) beyond DECIMAL(65,30): created as DECIMAL(65,30), and a value with
    # more digits than it holds fails, naming the column, before anything commits.
    assert mydb.execute("SELECT n2 FROM pgt WHERE id = 1") == [(Decimal("1.5"),)]
    pg.execute("UPDATE pgtypes SET n2 = 1.00000000000000000000000000000000001 WHERE id = 2")
    with pytest.raises(PermanentError, match=r"sink column 'n2'.*decimal places"):
        run_transfer(PG, pg.config, {"table": "pgtypes"}, MY, mydb.config, {"table": "pgt"})
    assert mydb.execute("SELECT COUNT(*) FROM pgt") == [(2,)]
    with pytest.raises(PermanentError, match=r"sink column 'iv'.*outside TIME's range"):
        run_transfer(PG, pg.config, {"query": "SELECT 3 AS id, interval '35 days' AS iv"},
                     MY, mydb.config, {"table": "pgt"})  # fmt: skip


def test_definition_schema__the_mysql_config_its_fields_and_secret_references() -> None:
    schema = json.loads((Path(__file__).parents[2] / "dispatch/ascode/schema.json").read_text())
    [entry] = [
        e for e in schema["$defs"]["datasource"]["allOf"]
        if e["if"]["properties"]["kind"]["const"] == "mysql"
    ]  # fmt: skip
    config = entry["then"]["properties"]["config"]
    assert set(config["properties"]) == {f.name for f in MY.config_fields}
    assert config["properties"]["tls"]["enum"] == list(MY.config_fields[-1].choices)
    validator = jsonschema.Draft202012Validator(schema)
    data = {"datasources": {"m": {"kind": "mysql", "config": {"host": "h", "password": "pw"}}}}
    assert list(validator.iter_errors(data))
    data["datasources"]["m"]["config"]["password"] = "env:DISPATCH_SECRET_M"
    assert not list(validator.iter_errors(data))
    data["datasources"]["m"]["config"]["sslkey"] = "/etc/key.pem"
    assert list(validator.iter_errors(data))
