-- The settlement of a RUNNING attempt, the one place that applies the retry policy, and
-- a settlement followed by the claim of the slot's next attempt in one call.
--
-- Lock order as in claim.sql: the run FOR UPDATE, then the attempt FOR UPDATE; a slice
-- run's terminal settlement then locks its parent run and the parent's plan
-- (dispatch_slice_settled, slices.sql: a slice before its parent); a run's terminal
-- settlement then locks its downstream runs (dispatch_chain_fire, chains.sql: an upstream
-- before its downstream runs). A settlement commits
-- nothing else first; the claim that follows it in the same
-- transaction never waits for a run or an attempt (SKIP LOCKED), so it adds no wait to
-- that order.

-- Settle a RUNNING attempt.
--
-- Guard: the attempt must still be RUNNING with p_token (and, for EXPIRED, an expired
-- lease by clock_timestamp()); otherwise nothing changes and NULL is returned, so a
-- completion, a cancel or a recovery that landed first always wins.
-- p_outcome: SUCCEEDED | CANCELLED | ERROR | PERMANENT | EXPIRED | RELEASE.
-- p_events, p_lost, p_cap: the worker's events not yet written, those it dropped itself,
-- and the cap (events.sql), logged under the same guard; then a `settled` event with the
-- new status, which the cap does not count (a recovery passes no events and no cap).
-- Returns the attempt's new status.
--
-- The time arithmetic is clamped in SQL: a retry's delay is at most MAX_DELAY_SECONDS =
-- 31,622,400 (366 days) whatever the job's backoff settings say (model validators and
-- CHECK constraints bound them too; this is the last line, so a bad row cannot make a
-- settlement raise "timestamp out of range").
CREATE OR REPLACE FUNCTION dispatch_settle_v3(
    p_attempt uuid, p_token bigint, p_outcome text, p_reason text, p_error text,
    p_rows_read bigint, p_rows_written bigint, p_events jsonb, p_lost integer,
    p_cap integer
) RETURNS text LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_run dispatch_run%ROWTYPE;
    v_att dispatch_attempt%ROWTYPE;
    v_job dispatch_job%ROWTYPE;
    v_now timestamptz;
    v_status text;
    v_reason text := p_reason;
    v_budget_start integer;
    v_used integer;
    v_delay double precision := 0;
    v_origin text;
    v_buffered integer := CASE WHEN jsonb_typeof(p_events) = 'array'
                               THEN jsonb_array_length(p_events) ELSE 0 END;
    v_offered integer;
BEGIN
    SELECT * INTO v_run FROM dispatch_run
     WHERE id = (SELECT a.run_id FROM dispatch_attempt a WHERE a.id = p_attempt)
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    v_now := clock_timestamp();
    SELECT * INTO v_att FROM dispatch_attempt
     WHERE id = p_attempt AND status = 'RUNNING' AND lease_token = p_token
       AND (p_outcome <> 'EXPIRED' OR lease_until <= v_now)
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;

    IF p_outcome = 'SUCCEEDED' THEN
        -- A sink commit that happened wins over a cancel request.
        v_status := 'SUCCEEDED';
    ELSIF p_outcome = 'CANCELLED' OR v_run.cancel_requested_at IS NOT NULL THEN
        -- A requested cancel wins over a retry.
        v_status := 'CANCELLED';
        v_reason := 'CANCELLED_BY_OPERATOR';
    ELSIF p_outcome = 'RELEASE' THEN
        v_status := 'RETRY_SCHEDULED';
        v_origin := 'RELEASE';
    ELSIF p_outcome = 'PERMANENT' THEN
        v_status := 'FAILED';
    ELSIF p_outcome IN ('ERROR', 'EXPIRED') THEN
        SELECT j.* INTO v_job FROM dispatch_job j
          JOIN dispatch_jobbinding b ON b.job_id = j.id WHERE b.id = v_run.binding_id;
        -- The budget: attempts since and including the latest TRIGGER or OPERATOR attempt,
        -- RELEASE successors not counted.
        SELECT max(a.number) INTO v_budget_start FROM dispatch_attempt a
         WHERE a.run_id = v_run.id AND a.origin IN ('TRIGGER', 'OPERATOR');
        SELECT count(*) INTO v_used FROM dispatch_attempt a
         WHERE a.run_id = v_run.id AND a.number >= coalesce(v_budget_start, 1)
           AND a.origin <> 'RELEASE';
        IF v_used < v_job.max_attempts THEN
            v_status := 'RETRY_SCHEDULED';
            v_origin := 'RETRY';
            -- Exponential, capped, with equal jitter: half fixed, half random.
            -- Clamped: the exponent (power(2, n) overflows float8 past n = 1023), the
            -- bounds (negative settings count as 0) and the result (at most
            -- MAX_DELAY_SECONDS), so no setting can make the timestamp overflow.
            v_delay := least(greatest(v_job.backoff_max_seconds, 0)::double precision,
                             greatest(v_job.backoff_seconds, 0)::double precision
                             * power(2::double precision, least(greatest(v_used - 1, 0), 60)),
                             31622400);
            v_delay := v_delay / 2 + random() * v_delay / 2;
        ELSE
            v_status := 'FAILED';
        END IF;
    ELSE
        RAISE EXCEPTION 'dispatch_settle_v3: unknown outcome %', p_outcome;
    END IF;

    v_offered := v_buffered + greatest(coalesce(p_lost, 0), 0);
    UPDATE dispatch_attempt
       SET status = v_status, reason = v_reason, error = coalesce(p_error, error),
           finished_at = v_now, source_snapshot = NULL, sink_snapshot = NULL,
           rows_read = coalesce(p_rows_read, rows_read),
           rows_written = coalesce(p_rows_written, rows_written),
           events_seen = events_seen + v_offered,
           events_dropped = events_dropped + v_offered - v_buffered
               + dispatch_attempt_log_dropped(events_seen, v_buffered, coalesce(p_cap, 0))
     WHERE id = p_attempt;
    IF v_buffered > 0 THEN
        PERFORM dispatch_attempt_log(p_attempt, v_att.events_seen, p_events,
                                     coalesce(p_cap, 0));
    END IF;
    -- The settlement's own event, numbered after every event offered (kept or dropped).
    PERFORM dispatch_attempt_log(
        p_attempt, v_att.events_seen + v_offered,
        jsonb_build_array(jsonb_build_object(
            'kind', 'settled',
            'message', CASE WHEN p_outcome = 'EXPIRED' THEN 'lease expired: ' ELSE '' END
                       || v_status || coalesce(' (' || v_reason || ')', ''),
            'data', jsonb_build_object('status', v_status, 'reason', v_reason,
                                       'outcome', p_outcome))),
        v_att.events_seen + v_offered + 1);

    IF v_status = 'RETRY_SCHEDULED' THEN
        INSERT INTO dispatch_attempt (
            id, run_id, number, origin, status, created_at, available_at,
            error, rows_read, rows_written)
        VALUES (
            gen_random_uuid(), v_run.id, v_att.number + 1, v_origin, 'PENDING', v_now,
            v_now + make_interval(secs => v_delay), '', 0, 0);
        UPDATE dispatch_run SET status = 'PENDING', finished_at = NULL WHERE id = v_run.id;
    ELSE
        UPDATE dispatch_run SET status = v_status, finished_at = v_now WHERE id = v_run.id;
        IF v_run.parent_id IS NOT NULL THEN
            -- A slice ended: its parent's counters and status, in this transaction.
            PERFORM dispatch_slice_settled(
                v_run.parent_id, v_run.slice_number, v_status,
                coalesce(p_rows_written, v_att.rows_written),
                coalesce(nullif(coalesce(p_error, v_att.error), ''), v_reason), v_now);
        ELSE
            -- The run ended: its downstream runs, in this transaction (chains.sql).
            PERFORM dispatch_chain_fire(v_run.id, v_status, v_now);
        END IF;
    END IF;
    RETURN v_status;
END
$$;

-- Settle one attempt (dispatch_settle_v3: guarded by status + token) and claim up to
-- p_limit more for p_worker (dispatch_claim_v5, generic), in one transaction and one
-- round trip. Returns the settlement's status (NULL: the lease was lost) on every row,
-- with one row per claimed attempt, or one row with no attempt when nothing was claimed.
-- The claim runs in a subtransaction: an error in it is rolled back alone, the
-- settlement stands and nothing is claimed. A lost lease claims nothing: the caller is no
-- longer sure of its slot's state.
CREATE OR REPLACE FUNCTION dispatch_settle_claim_v6(
    p_attempt uuid, p_token bigint, p_outcome text, p_reason text, p_error text,
    p_rows_read bigint, p_rows_written bigint, p_events jsonb, p_lost integer,
    p_cap integer, p_worker text, p_limit integer
) RETURNS TABLE (settled text, claimed dispatch_claimed_v5) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_claimed dispatch_claimed_v5[] := '{}';
    v_status text;
BEGIN
    v_status := dispatch_settle_v3(p_attempt, p_token, p_outcome, p_reason, p_error,
                                   p_rows_read, p_rows_written, p_events, p_lost, p_cap);
    IF v_status IS NOT NULL AND p_limit > 0 THEN
        BEGIN
            SELECT coalesce(array_agg(x), '{}') INTO v_claimed
              FROM dispatch_claim_v5(p_worker, NULL, p_limit, true) x;
        EXCEPTION WHEN OTHERS THEN
            v_claimed := '{}';
            RAISE WARNING 'dispatch_settle_claim_v6: the claim after a settlement failed: %',
                SQLERRM;
        END;
    END IF;
    settled := v_status;
    IF cardinality(v_claimed) = 0 THEN
        claimed := NULL;
        RETURN NEXT;
        RETURN;
    END IF;
    FOR i IN 1 .. cardinality(v_claimed) LOOP
        claimed := v_claimed[i];
        RETURN NEXT;
    END LOOP;
END
$$;
