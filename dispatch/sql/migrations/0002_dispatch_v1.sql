-- Dispatch's concurrency-carrying SQL, version 1: claim, settle, recover, heartbeat.
--
-- Installed by migration 0002 (a test fails if a file here has no migration). A change
-- of behaviour is a new version (dispatch_claim_v2 ...) in a new file and migration, so a
-- rolling deploy never runs old Python against new SQL.
--
-- Lock order, everywhere: run -> attempt -> binding -> datasources (ascending id).
-- Time: always PostgreSQL's clock. now() is the transaction's start, so anything that may
-- have waited for a lock uses clock_timestamp().

-- Why a due PENDING attempt cannot be claimed now, or NULL if it can.
CREATE OR REPLACE FUNCTION dispatch_blocked_reason_v1(
    job_enabled boolean, binding_enabled boolean, source_enabled boolean,
    sink_enabled boolean, running bigint, max_concurrency integer
) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN NOT job_enabled THEN 'JOB_DISABLED'
        WHEN NOT binding_enabled THEN 'BINDING_DISABLED'
        WHEN NOT source_enabled THEN 'SOURCE_DISABLED'
        WHEN NOT sink_enabled THEN 'SINK_DISABLED'
        WHEN running >= max_concurrency THEN 'BINDING_AT_CAPACITY'
    END
$$;

-- RUNNING attempts of a binding (the capacity count). A run's status is its latest
-- attempt's, written in the same transaction (the claim included), so counting RUNNING
-- runs of the binding counts its RUNNING attempts, through dispatch_run_running_idx,
-- without touching other bindings' work.
CREATE OR REPLACE FUNCTION dispatch_binding_running_v1(p_binding uuid)
RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT count(*)
      FROM dispatch_run r
     WHERE r.binding_id = p_binding AND r.status = 'RUNNING'
$$;

-- Claim up to p_limit due attempts for p_worker, in one transaction.
--
-- Directed: when p_run is given, that run's due attempt is tried first. Fallback and
-- generic: the oldest due attempts fill the remaining slots (p_generic = false limits the
-- call to the directed attempt, for a burst of notifications after a miss).
-- Locks: run + attempt FOR UPDATE SKIP LOCKED (never waits for a run while holding an
-- attempt); then every binding FOR NO KEY UPDATE in ascending id (serialises the
-- capacity count); then every datasource FOR SHARE in ascending id (holds off an edit while the
-- snapshot is copied, without serialising claims that share a datasource). Each kind of
-- lock is taken for the whole batch before the next kind. Then each candidate is
-- re-checked by a new statement, i.e. on a fresh snapshot taken after the locks.
CREATE OR REPLACE FUNCTION dispatch_claim_v1(
    p_worker text, p_run uuid, p_limit integer, p_generic boolean DEFAULT true
) RETURNS TABLE (
    attempt_id uuid, run_id uuid, number integer, lease_token bigint,
    lease_seconds integer, timeout_seconds integer, binding_id uuid,
    source_spec jsonb, sink_spec jsonb,
    source_id uuid, source_kind text, source_version integer, source_snapshot text,
    sink_id uuid, sink_kind text, sink_version integer, sink_snapshot text,
    directed boolean
) LANGUAGE plpgsql VOLATILE
-- Its statements are planned once, generically: a custom plan per call costs about a
-- millisecond and the generic plan is the same index scan (see docs/benchmarks.md).
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_attempts uuid[] := '{}';
    v_runs uuid[] := '{}';
    v_bindings uuid[] := '{}';
    v_directed uuid;
    v_now timestamptz;
    v_reason text;
    c record;
    i integer;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RETURN;
    END IF;

    -- 1. Pick and lock run + attempt. The joins pre-filter blocked work without locking
    --    it, so blocked attempts are never picked and never starve others.
    IF p_run IS NOT NULL THEN
        SELECT a.id AS attempt, r.id AS run, r.binding_id AS binding INTO c
          FROM dispatch_run r
          JOIN dispatch_attempt a ON a.run_id = r.id
          JOIN dispatch_jobbinding b ON b.id = r.binding_id
          JOIN dispatch_job j ON j.id = b.job_id
          JOIN dispatch_datasource src ON src.id = b.source_id
          JOIN dispatch_datasource snk ON snk.id = b.sink_id
         WHERE r.id = p_run
           AND a.status = 'PENDING' AND a.available_at <= clock_timestamp()
           AND j.enabled AND b.enabled AND src.enabled AND snk.enabled
           AND dispatch_binding_running_v1(b.id) < b.max_concurrency
           FOR UPDATE OF r, a SKIP LOCKED;
        IF FOUND THEN
            v_directed := c.attempt;
            v_attempts := ARRAY[c.attempt];
            v_runs := ARRAY[c.run];
            v_bindings := ARRAY[c.binding];
        END IF;
    END IF;

    IF p_generic AND cardinality(v_attempts) < p_limit THEN
        -- Oldest due first; the pending index (available_at, id) makes this an index scan
        -- that stops after p_limit unlocked, eligible rows.
        SELECT v_attempts || coalesce(array_agg(x.attempt ORDER BY x.available_at, x.attempt), '{}'),
               v_runs || coalesce(array_agg(x.run ORDER BY x.available_at, x.attempt), '{}'),
               v_bindings || coalesce(array_agg(x.binding ORDER BY x.available_at, x.attempt), '{}')
          INTO v_attempts, v_runs, v_bindings
          FROM (
            SELECT a.id AS attempt, r.id AS run, r.binding_id AS binding, a.available_at
              FROM dispatch_attempt a
              JOIN dispatch_run r ON r.id = a.run_id
              JOIN dispatch_jobbinding b ON b.id = r.binding_id
              JOIN dispatch_job j ON j.id = b.job_id
              JOIN dispatch_datasource src ON src.id = b.source_id
              JOIN dispatch_datasource snk ON snk.id = b.sink_id
             WHERE a.status = 'PENDING' AND a.available_at <= clock_timestamp()
               AND a.id IS DISTINCT FROM v_directed
               AND j.enabled AND b.enabled AND src.enabled AND snk.enabled
               AND dispatch_binding_running_v1(b.id) < b.max_concurrency
             ORDER BY a.available_at, a.id
             LIMIT p_limit - cardinality(v_attempts)
               FOR UPDATE OF r, a SKIP LOCKED
          ) x;
    END IF;

    IF cardinality(v_attempts) = 0 THEN
        RETURN;
    END IF;

    -- 2. Bindings, FOR NO KEY UPDATE, ascending id. NO KEY: a transaction that inserted
    --    a run of this binding holds FOR KEY SHARE on it (the foreign key) until it
    --    commits; FOR UPDATE would wait for it, FOR NO KEY UPDATE does not, and it still
    --    serialises claims of the binding with each other and with edits of the binding.
    PERFORM 1 FROM dispatch_jobbinding
     WHERE id = ANY (v_bindings) ORDER BY id FOR NO KEY UPDATE;

    -- 3. Datasources of those bindings, FOR SHARE, ascending id.
    PERFORM 1 FROM dispatch_datasource
     WHERE id IN (SELECT b.source_id FROM dispatch_jobbinding b WHERE b.id = ANY (v_bindings)
                  UNION
                  SELECT b.sink_id FROM dispatch_jobbinding b WHERE b.id = ANY (v_bindings))
     ORDER BY id FOR SHARE;

    v_now := clock_timestamp();

    -- 4. Re-check each candidate on a fresh snapshot, then claim it.
    FOR i IN 1 .. cardinality(v_attempts) LOOP
        SELECT b.id AS binding_id, b.max_concurrency, b.enabled AS binding_enabled,
               j.enabled AS job_enabled, j.lease_seconds, j.timeout_seconds,
               j.source_spec, j.sink_spec,
               src.id AS source_id, src.kind AS source_kind, src.version AS source_version,
               src.config_ciphertext AS source_ciphertext, src.redacted_config AS source_redacted,
               src.enabled AS source_enabled,
               snk.id AS sink_id, snk.kind AS sink_kind, snk.version AS sink_version,
               snk.config_ciphertext AS sink_ciphertext, snk.redacted_config AS sink_redacted,
               snk.enabled AS sink_enabled
          INTO c
          FROM dispatch_jobbinding b
          JOIN dispatch_job j ON j.id = b.job_id
          JOIN dispatch_datasource src ON src.id = b.source_id
          JOIN dispatch_datasource snk ON snk.id = b.sink_id
         WHERE b.id = v_bindings[i];

        v_reason := dispatch_blocked_reason_v1(
            c.job_enabled, c.binding_enabled, c.source_enabled, c.sink_enabled,
            dispatch_binding_running_v1(c.binding_id), c.max_concurrency);
        IF v_reason IS NOT NULL THEN
            -- A miss: leave it PENDING (the lock ends with this transaction) and say why.
            UPDATE dispatch_attempt SET blocked_reason = v_reason
             WHERE id = v_attempts[i] AND blocked_reason IS DISTINCT FROM v_reason;
            CONTINUE;
        END IF;

        attempt_id := v_attempts[i];
        run_id := v_runs[i];
        lease_token := nextval('dispatch_lease_token_seq');
        lease_seconds := c.lease_seconds;
        timeout_seconds := c.timeout_seconds;
        binding_id := c.binding_id;
        source_spec := c.source_spec;
        sink_spec := c.sink_spec;
        source_id := c.source_id;
        source_kind := c.source_kind;
        source_version := c.source_version;
        source_snapshot := c.source_ciphertext;
        sink_id := c.sink_id;
        sink_kind := c.sink_kind;
        sink_version := c.sink_version;
        sink_snapshot := c.sink_ciphertext;
        directed := v_directed IS NOT NULL AND v_attempts[i] = v_directed;

        UPDATE dispatch_attempt a
           SET status = 'RUNNING', worker_id = p_worker, lease_token = dispatch_claim_v1.lease_token,
               lease_until = v_now + make_interval(secs => c.lease_seconds),
               claimed_at = v_now, heartbeat_at = v_now, blocked_reason = NULL,
               source_id = c.source_id, sink_id = c.sink_id,
               source_version = c.source_version, sink_version = c.sink_version,
               source_snapshot = c.source_ciphertext, sink_snapshot = c.sink_ciphertext,
               source_redacted = c.source_redacted, sink_redacted = c.sink_redacted,
               datasources_resolved_at = v_now
         WHERE a.id = v_attempts[i] AND a.status = 'PENDING'
        RETURNING a.number INTO number;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        UPDATE dispatch_run SET status = 'RUNNING' WHERE id = v_runs[i];
        RETURN NEXT;
    END LOOP;
END
$$;

-- Settle a RUNNING attempt: the one place that applies the retry policy.
--
-- Guard: the attempt must still be RUNNING with p_token (and, for EXPIRED, an expired
-- lease by clock_timestamp()); otherwise nothing changes and NULL is returned, so a
-- completion, a cancel or a recovery that landed first always wins.
-- Locks: the run FOR UPDATE, then the attempt FOR UPDATE (the contract's order).
-- p_outcome: SUCCEEDED | CANCELLED | ERROR | PERMANENT | EXPIRED | RELEASE.
-- Returns the attempt's new status.
CREATE OR REPLACE FUNCTION dispatch_settle_v1(
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
            v_delay := least(v_job.backoff_max_seconds,
                             v_job.backoff_seconds * power(2, v_used - 1));
            v_delay := v_delay / 2 + random() * v_delay / 2;
        ELSE
            v_status := 'FAILED';
        END IF;
    ELSE
        RAISE EXCEPTION 'dispatch_settle_v1: unknown outcome %', p_outcome;
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

-- One recovery pass: settle up to p_limit RUNNING attempts whose lease has expired.
-- Locks run + attempt FOR UPDATE SKIP LOCKED (a pass never waits for another pass, a
-- completion or an operator); dispatch_settle_v1 re-checks status, token and expiry in
-- the statement that changes the row. Returns each settlement.
CREATE OR REPLACE FUNCTION dispatch_recover_v1(p_limit integer)
RETURNS TABLE (attempt_id uuid, run_id uuid, number integer, outcome text)
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
         ORDER BY a.lease_until
         LIMIT p_limit
           FOR UPDATE OF r, a SKIP LOCKED
    LOOP
        outcome := dispatch_settle_v1(c.id, c.lease_token, 'EXPIRED', 'LEASE_EXPIRED',
                                      NULL, NULL, NULL);
        IF outcome IS NOT NULL THEN
            attempt_id := c.id;
            run_id := c.run_id;
            number := c.number;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

-- One heartbeat for all of a worker's attempts: extend each lease that is still the
-- worker's (status + token), store progress, and say which runs have a cancel request.
-- Attempts missing from the result are lost: the worker stops them and records nothing.
-- Locks only the attempt rows (never a run), so it cannot deadlock with a settlement.
CREATE OR REPLACE FUNCTION dispatch_heartbeat_v1(
    p_worker text, p_attempts uuid[], p_tokens bigint[], p_rows_read bigint[],
    p_rows_written bigint[], p_stats jsonb
) RETURNS TABLE (attempt_id uuid, cancel_requested boolean, lease_seconds integer)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
    UPDATE dispatch_worker w
       SET heartbeat_at = clock_timestamp(), stats = coalesce(p_stats, w.stats)
     WHERE w.id = p_worker;

    RETURN QUERY
    UPDATE dispatch_attempt a
       SET heartbeat_at = clock_timestamp(),
           lease_until = clock_timestamp() + make_interval(secs => j.lease_seconds),
           rows_read = h.rows_read, rows_written = h.rows_written
      FROM unnest(p_attempts, p_tokens, p_rows_read, p_rows_written)
               AS h(id, token, rows_read, rows_written),
           dispatch_run r, dispatch_jobbinding b, dispatch_job j
     WHERE a.id = h.id AND a.lease_token = h.token AND a.status = 'RUNNING'
       AND a.worker_id = p_worker
       AND r.id = a.run_id AND b.id = r.binding_id AND j.id = b.job_id
    RETURNING a.id, r.cancel_requested_at IS NOT NULL, j.lease_seconds;
END
$$;

-- Record why due PENDING attempts of disabled jobs, bindings or datasources cannot run,
-- and clear the reason of those that can. Cost follows the blocked work, not the queue.
-- Rows are taken FOR UPDATE SKIP LOCKED: a reason is informational, so a row somebody
-- holds (a claim, an operator) is left for the next pass, and two passes never wait for
-- each other or lock rows in opposite orders.
CREATE OR REPLACE FUNCTION dispatch_refresh_blocked_v1()
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_changed integer := 0;
    v_count integer;
BEGIN
    WITH blocked AS (
        SELECT b.id, dispatch_blocked_reason_v1(j.enabled, b.enabled, src.enabled,
                                                snk.enabled, 0, 1) AS reason
          FROM dispatch_jobbinding b
          JOIN dispatch_job j ON j.id = b.job_id
          JOIN dispatch_datasource src ON src.id = b.source_id
          JOIN dispatch_datasource snk ON snk.id = b.sink_id
         WHERE NOT (j.enabled AND b.enabled AND src.enabled AND snk.enabled)
    ), targets AS (
        SELECT a.id, blocked.reason
          FROM dispatch_attempt a
          JOIN dispatch_run r ON r.id = a.run_id
          JOIN blocked ON blocked.id = r.binding_id
         WHERE a.status = 'PENDING' AND a.available_at <= clock_timestamp()
           AND a.blocked_reason IS DISTINCT FROM blocked.reason
           FOR UPDATE OF a SKIP LOCKED
    )
    UPDATE dispatch_attempt a SET blocked_reason = targets.reason
      FROM targets WHERE a.id = targets.id;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    v_changed := v_changed + v_count;

    WITH targets AS (
        SELECT a.id
          FROM dispatch_attempt a
          JOIN dispatch_run r ON r.id = a.run_id
          JOIN dispatch_jobbinding b ON b.id = r.binding_id
          JOIN dispatch_job j ON j.id = b.job_id
          JOIN dispatch_datasource src ON src.id = b.source_id
          JOIN dispatch_datasource snk ON snk.id = b.sink_id
         WHERE a.status = 'PENDING' AND a.blocked_reason IS NOT NULL
           AND j.enabled AND b.enabled AND src.enabled AND snk.enabled
           AND dispatch_binding_running_v1(b.id) < b.max_concurrency
           FOR UPDATE OF a SKIP LOCKED
    )
    UPDATE dispatch_attempt a SET blocked_reason = NULL
      FROM targets WHERE a.id = targets.id;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_changed + v_count;
END
$$;
