-- The worker's heartbeat: its leases extended, its attempts' events logged and its cancel
-- requests read in one call.

-- One heartbeat for all of a worker's attempts: extend each lease that is still the
-- worker's (status + token), store progress and the events the worker buffered since its
-- last heartbeat (events.sql: p_events[i] is a JSON array of attempt i's events, p_lost[i]
-- how many more it dropped itself when its buffer was full; at most p_cap per attempt),
-- and say which runs have a cancel request.
-- Attempts missing from the result are lost: the worker stops them and records nothing.
-- The events of a lost attempt are written nowhere: the insert reads only the rows the
-- guarded UPDATE matched, in the same statement.
-- Locks only the attempt rows (never a run), so it cannot deadlock with a settlement.
-- The attempt row is updated once (lease, progress and event counters together): a second
-- update in the transaction would make its foreign key to the run be checked again at
-- commit (see record_estimates in queries.sql).
CREATE OR REPLACE FUNCTION dispatch_heartbeat_v2(
    p_worker text, p_attempts uuid[], p_tokens bigint[], p_rows_read bigint[],
    p_rows_written bigint[], p_events jsonb[], p_lost integer[], p_cap integer,
    p_stats jsonb
) RETURNS TABLE (attempt_id uuid, cancel_requested boolean, lease_seconds integer)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v record;
BEGIN
    UPDATE dispatch_worker w
       SET heartbeat_at = clock_timestamp(), stats = coalesce(p_stats, w.stats)
     WHERE w.id = p_worker;

    FOR v IN
        WITH beat AS (
            UPDATE dispatch_attempt a
               SET heartbeat_at = clock_timestamp(),
                   lease_until = clock_timestamp() + make_interval(secs => j.lease_seconds),
                   rows_read = h.rows_read, rows_written = h.rows_written,
                   events_seen = a.events_seen + h.offered,
                   events_dropped = a.events_dropped + h.lost
                       + dispatch_attempt_log_dropped(a.events_seen, h.buffered, p_cap)
              FROM (SELECT u.id, u.token, u.rows_read, u.rows_written, u.events,
                           coalesce(jsonb_array_length(u.events), 0) AS buffered,
                           greatest(coalesce(u.lost, 0), 0) AS lost,
                           coalesce(jsonb_array_length(u.events), 0)
                               + greatest(coalesce(u.lost, 0), 0) AS offered
                      FROM unnest(p_attempts, p_tokens, p_rows_read, p_rows_written,
                                  p_events, p_lost)
                               AS u(id, token, rows_read, rows_written, events, lost)) h,
                   dispatch_run r, dispatch_jobbinding b, dispatch_job j
             WHERE a.id = h.id AND a.lease_token = h.token AND a.status = 'RUNNING'
               AND a.worker_id = p_worker
               AND r.id = a.run_id AND b.id = r.binding_id AND j.id = b.job_id
            -- events_seen is the new value here: these events were offered after
            -- events_seen - offered (the worker's own drops come after its buffer).
            RETURNING a.id, a.events_seen - h.offered AS seen_before, h.events, h.buffered,
                      r.cancel_requested_at IS NOT NULL AS cancel, j.lease_seconds
        )
        SELECT * FROM beat
    LOOP
        -- Only attempts the guarded UPDATE matched reach here.
        IF v.buffered > 0 THEN
            PERFORM dispatch_attempt_log(v.id, v.seen_before, v.events, p_cap);
        END IF;
        attempt_id := v.id;
        cancel_requested := v.cancel;
        lease_seconds := v.lease_seconds;
        RETURN NEXT;
    END LOOP;
END
$$;
