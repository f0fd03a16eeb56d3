-- Dispatch's concurrency-carrying SQL, version 2 (beside version 1, which stays
-- installed and unchanged for workers of the previous release during a rolling deploy).
--
-- Installed by migration 0010. Same lock order and time rules as version 1:
-- run -> attempt -> binding -> datasources (ascending id); PostgreSQL's clock only.
--
-- dispatch_settle_v2: dispatch_settle_v1 with its time arithmetic clamped in SQL. A retry's
-- delay is at most MAX_DELAY_SECONDS = 31,622,400 (366 days) whatever the job's backoff
-- settings say (model validators and CHECK constraints bound them too; this is the last
-- line, so a bad row cannot make a settlement raise "timestamp out of range").

CREATE OR REPLACE FUNCTION dispatch_settle_v2(
    p_attempt uuid, p_token bigint, p_outcome text, p_reason text, p_error text,
    p_rows_read bigint, p_rows_written bigint
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
        RAISE EXCEPTION 'dispatch_settle_v2: unknown outcome %', p_outcome;
    END IF;

    UPDATE dispatch_attempt
       SET status = v_status, reason = v_reason, error = coalesce(p_error, error),
           finished_at = v_now, source_snapshot = NULL, sink_snapshot = NULL,
           rows_read = coalesce(p_rows_read, rows_read),
           rows_written = coalesce(p_rows_written, rows_written)
     WHERE id = p_attempt;

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
    END IF;
    RETURN v_status;
END
$$;

-- One recovery pass, each row isolated: settle up to p_limit RUNNING attempts whose lease
-- has expired, each in its own subtransaction (a BEGIN ... EXCEPTION block). A row whose
-- settlement raises is rolled back alone, left RUNNING, and returned with outcome NULL and
-- the error text, so the pass reports it, skips it and settles the rest. Attempts in
-- p_skip are not picked (the caller passes those that already failed in this round, so a
-- failing row cannot fill every batch). Locks as dispatch_recover_v1: run + attempt FOR
-- UPDATE SKIP LOCKED, then dispatch_settle_v2 re-checks status, token and expiry.
CREATE OR REPLACE FUNCTION dispatch_recover_v2(p_limit integer, p_skip uuid[] DEFAULT '{}')
RETURNS TABLE (attempt_id uuid, run_id uuid, number integer, outcome text, error text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    c record;
BEGIN
    FOR c IN
        SELECT a.id, a.run_id, a.number, a.lease_token
          FROM dispatch_attempt a
          JOIN dispatch_run r ON r.id = a.run_id
         WHERE a.status = 'RUNNING' AND a.lease_until <= clock_timestamp()
           AND a.id <> ALL (coalesce(p_skip, '{}'))
         ORDER BY a.lease_until
         LIMIT p_limit
           FOR UPDATE OF r, a SKIP LOCKED
    LOOP
        attempt_id := c.id;
        run_id := c.run_id;
        number := c.number;
        error := NULL;
        BEGIN
            outcome := dispatch_settle_v2(c.id, c.lease_token, 'EXPIRED', 'LEASE_EXPIRED',
                                          NULL, NULL, NULL);
        EXCEPTION WHEN OTHERS THEN
            outcome := NULL;
            error := SQLSTATE || ': ' || SQLERRM;
            RETURN NEXT;
            CONTINUE;
        END;
        IF outcome IS NOT NULL THEN
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;
