-- The event log of an attempt (dispatch_attemptevent): what its worker saw, written with
-- the heartbeats and the settlement, never on its own.
--
-- Who may write: only the SQL that has just matched the attempt as RUNNING with the
-- caller's lease token (dispatch_heartbeat_v2, dispatch_settle_v3) calls this, in the
-- same statement or transaction, with the attempt's row locked by that match. A worker
-- that lost its lease matches nothing there, so nothing of it reaches any log, its old
-- attempt's or a successor's.
--
-- The cap: an attempt holds at most p_cap events of its worker. p_seen is how many the
-- attempt had been offered before these (dispatch_attempt.events_seen, read under the
-- row lock), so the i-th event of p_events is the (p_seen + i)-th of the attempt and is
-- inserted only while that is <= p_cap; the caller counts what is left out in
-- events_dropped, in the same UPDATE that extended the lease. Each event is an object
-- {kind, message, data, ago}: `ago` is how many seconds before this call the worker saw
-- it (by its monotonic clock), so its time is the database's clock minus that, never the
-- worker's wall clock. Returns the number of events inserted.
CREATE OR REPLACE FUNCTION dispatch_attempt_log(
    p_attempt uuid, p_seen integer, p_events jsonb, p_cap integer
) RETURNS integer LANGUAGE sql VOLATILE AS $$
    WITH added AS (
        INSERT INTO dispatch_attemptevent (attempt_id, seq, at, kind, message, data)
        SELECT p_attempt, p_seen + e.n::integer,
               clock_timestamp()
                   - make_interval(secs => greatest(coalesce((e.ev ->> 'ago')::float8, 0), 0)),
               left(coalesce(e.ev ->> 'kind', ''), 40),
               left(coalesce(e.ev ->> 'message', ''), 1000),
               CASE WHEN jsonb_typeof(e.ev -> 'data') = 'object' THEN e.ev -> 'data'
                    ELSE '{}'::jsonb END
          FROM jsonb_array_elements(
                   CASE WHEN jsonb_typeof(p_events) = 'array' THEN p_events
                        ELSE '[]'::jsonb END) WITH ORDINALITY AS e(ev, n)
         WHERE p_seen + e.n <= p_cap AND jsonb_typeof(e.ev) = 'object'
        RETURNING 1
    )
    SELECT count(*)::integer FROM added;
$$;

-- How many of p_count events offered to an attempt that had been offered p_seen are
-- beyond p_cap (the part of them dispatch_attempt_log leaves out).
CREATE OR REPLACE FUNCTION dispatch_attempt_log_dropped(
    p_seen integer, p_count integer, p_cap integer
) RETURNS integer LANGUAGE sql IMMUTABLE AS $$
    SELECT greatest(0, least(p_count, p_seen + p_count - greatest(p_cap, 0)));
$$;
