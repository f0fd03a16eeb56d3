"""A table with one column of each of 35 types and awkward values: what the value
round-trip tests and the fault campaign's typed binding copy and compare (`row::text`
per row). `TYPES` creates the enum and the domain it uses and the table (its name is the
`{table}` placeholder); `ROWS` fills a table named `source`."""

# 35 value columns besides the key. The awkward values are the ones a trip through Python
# objects changed or refused: an interval's units, json's key order, duplicate keys and
# number spelling, ranges, infinite and BC dates, 24:00, NaN and infinities.
TYPES = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE TABLE {table} (
    id integer PRIMARY KEY,
    c_smallint smallint, c_integer integer, c_bigint bigint,
    c_numeric numeric, c_numeric_p numeric(12, 2), c_real real, c_double double precision,
    c_text text, c_varchar varchar(20), c_char char(5), c_boolean boolean,
    c_date date, c_timestamp timestamp, c_timestamptz timestamptz, c_time time,
    c_timetz timetz, c_interval interval, c_json json, c_jsonb jsonb, c_uuid uuid,
    c_bytea bytea, c_inet inet, c_cidr cidr, c_macaddr macaddr, c_int4range int4range,
    c_numrange numrange, c_tstzrange tstzrange, c_daterange daterange, c_text_array text[],
    c_int_matrix integer[], c_point point, c_bit bit(4), c_tsvector tsvector,
    c_enum mood, c_domain posint
)
"""

ROWS = r"""
INSERT INTO source VALUES
 (1, -32768, 2147483647, 9223372036854775807, 'NaN', 1234567890.12, 'Infinity',
  '-Infinity', 'tab	"quote", comma, back\slash, é ✓ 🚀', 'varchar', 'ab',
  true, 'infinity', '0044-03-15 12:00:00 BC', '-infinity', '24:00:00', '23:59:59+05:30',
  '1 year 2 mons 3 days 04:05:06.789', '{"b": 2.50, "a": [1, 2], "b": "dup"}',
  '{"z": 1e3, "a": null}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '\x00ff5c22',
  '2001:db8::1/64', '10.0.0.0/8', '08:00:2b:01:02:03', '(,6)', '[1.5,2.5)',
  '["2024-01-01 00:00:00+00","infinity")', 'empty', ARRAY['a', 'b,c', NULL, 'd"e', ''],
  '{{1,2},{3,NULL}}', '(1.5,-2)', B'1010', 'a:1 fat:2,4 cat', 'happy', 7),
 (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, NULL, NULL, NULL, NULL),
 (3, 0, 0, 0, -0.000000000000000000001, -0.01, 1.17549435e-38, 5e-324,
  E'line one\nline two\r\nthree', '', '', false, '2000-02-29', '1970-01-01 00:00:00',
  '2024-02-29 23:59:59.999999+00', '00:00:00', '00:00:00-12', '-1 days +23:59:59.999999',
  '[]', '{}', '00000000-0000-0000-0000-000000000000', '\x', '0.0.0.0', '::/0',
  'ff:ff:ff:ff:ff:ff', '[-2147483648,2147483647)', '(,)', 'empty', '[2000-01-01,)',
  '{}', '{}', '(0,0)', B'0000', '', 'sad', 1)
"""
