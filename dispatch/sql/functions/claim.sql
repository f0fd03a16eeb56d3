-- The claim: due attempts handed to a worker, with a lease and a snapshot of their
-- datasources, in one call.
--
-- Lock order, everywhere: run -> attempt -> binding (FOR NO KEY UPDATE, ascending id) ->
-- datasources (FOR SHARE, ascending id). Time: always PostgreSQL's clock. now() is the
-- transaction's start, so anything that may have waited for a lock uses
-- clock_timestamp().

-- What a claim returns, one row per claimed attempt (also the row type of
-- dispatch_settle_claim_v6's claimed column; created once, kept across snapshots).
DO $$
BEGIN
    IF to_regtype('dispatch_claimed_v5') IS NULL THEN
        CREATE TYPE dispatch_claimed_v5 AS (
            attempt_id uuid, run_id uuid, number integer, lease_token bigint,
            lease_seconds integer, timeout_seconds integer, binding_id uuid,
            source_spec jsonb, sink_spec jsonb,
            source_id uuid, source_kind text, source_version integer, source_snapshot text,
            sink_id uuid, sink_kind text, sink_version integer, sink_snapshot text,
            directed boolean
        );
    END IF;
END
$$;

-- Claim up to p_limit due attempts for p_worker, in one transaction.
--
-- Directed: when p_run is given, that run's due attempt is tried first. Generic: the
-- oldest due attempts fill the remaining slots (p_generic = false limits the call to the
-- directed attempt, for a burst of notifications after a miss).
--
-- 1. Pick and lock run + attempt, SKIP LOCKED (never waits for either, so taking an
--    attempt before its run here cannot deadlock with the run -> attempt order
--    elsewhere). The generic pick reads dispatch_attempt_ready_idx (unmarked PENDING
--    attempts, marks.sql and capacity.sql) in (available_at, id) order from its start,
--    bounded above by the time read once (an index condition, not a row filter), and
--    stops after p_limit unlocked candidates; what it still filters row by row is work
--    locked by other claims and a binding at capacity whose mark is not yet written.
-- 2. Every binding FOR NO KEY UPDATE in ascending id (serialises the capacity count).
-- 3. Every datasource FOR SHARE in ascending id (holds off an edit while the snapshot is
--    copied, without serialising claims that share a datasource).
-- 4. Each candidate re-checked by a new statement, i.e. on a fresh snapshot taken after
--    the locks, then claimed; a miss is left PENDING with its reason.
-- 5. A binding this claim filled holds its queue (dispatch_hold_capacity).
--
-- The planner settings keep every statement an index or TID path whatever the
-- statistics say (fresh, stale, taken while the queue was empty): sorts and sequential
-- scans off, JIT off with them (with sorts off a plan that still sorts costs about 10^10,
-- past jit_above_cost: tens of milliseconds compiling per call), generic plans (a custom
-- plan per call costs about a millisecond and is the same index scan). The RUNNING counts
-- are subqueries in the claim's own statements on dispatch_run_running_idx.
CREATE OR REPLACE FUNCTION dispatch_claim_v5(
    p_worker text, p_run uuid, p_limit integer, p_generic boolean DEFAULT true
) RETURNS SETOF dispatch_claimed_v5 LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET jit = off
SET enable_sort = off
SET enable_seqscan = off
AS $$
DECLARE
    v_attempts uuid[] := '{}';
    v_runs uuid[] := '{}';
    v_bindings uuid[] := '{}';
    v_full uuid[] := '{}';
    -- Where the locked rows are: a locked row keeps its place until this transaction
    -- changes it, and a TID lookup is the one plan statistics cannot make worse.
    v_attempt_tids tid[] := '{}';
    v_run_tids tid[] := '{}';
    g_attempts uuid[];
    g_runs uuid[];
    g_bindings uuid[];
    g_tids tid[];
    g_locked uuid[];
    g_locked_tids tid[];
    k integer;
    v_directed uuid;
    v_now timestamptz;
    v_reason text;
    v_state record;
    v_ready boolean := false;
    c record;
    v_out dispatch_claimed_v5;
    i integer;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RETURN;
    END IF;
    -- One reading of the clock for the pick: a plain value, so an index bound.
    v_now := clock_timestamp();

    -- 1. Pick and lock run + attempt (SKIP LOCKED: never waits for either).
    IF p_run IS NOT NULL THEN
        -- The run's live attempt without a lock through the unique live-attempt index,
        -- then the run by primary key and the attempt by its TID, both SKIP LOCKED:
        -- single-table statements that no join order can turn into a walk. Only a due
        -- attempt that no disabled thing blocks is locked, so a directed claim never
        -- holds a disabled-marked attempt (which the enable trigger may wait for) nor a
        -- RUNNING one's run. The lookup names the run and the live statuses only, so the
        -- index of live attempts (or the run's attempts by number) is the only one whose
        -- predicate it implies: no statistics can turn it into a walk of the PENDING
        -- backlog by available_at. Whether the attempt is due and unblocked is checked
        -- on the row.
        SELECT a.run_id AS run, a.binding_id AS binding, a.id AS attempt,
               a.ctid AS attempt_tid, NULL::tid AS run_tid,
               a.status = 'PENDING' AND a.available_at <= v_now
               AND (a.blocked_reason IS NULL OR a.blocked_reason = 'BINDING_AT_CAPACITY')
                   AS ready
          INTO c
          FROM dispatch_attempt a
         WHERE a.run_id = p_run AND a.status IN ('PENDING', 'RUNNING');
        IF FOUND AND c.ready THEN
            SELECT c.run, c.binding, c.attempt, c.attempt_tid, r.ctid AS run_tid INTO c
              FROM dispatch_run r WHERE r.id = c.run FOR UPDATE SKIP LOCKED;
            v_ready := FOUND;
        END IF;
        IF v_ready THEN
            PERFORM 1 FROM dispatch_attempt a
              WHERE a.ctid = c.attempt_tid AND a.id = c.attempt AND a.status = 'PENDING'
                AND (a.blocked_reason IS NULL OR a.blocked_reason = 'BINDING_AT_CAPACITY')
                FOR UPDATE SKIP LOCKED;
        END IF;
        IF v_ready AND FOUND THEN
            v_state := dispatch_binding_state(c.binding);
            IF v_state.disabled IS NULL AND v_state.room > 0 THEN
                v_directed := c.attempt;
                v_attempts := ARRAY[c.attempt];
                v_runs := ARRAY[c.run];
                v_bindings := ARRAY[c.binding];
                v_attempt_tids := ARRAY[c.attempt_tid];
                v_run_tids := ARRAY[c.run_tid];
            END IF;
        END IF;
    END IF;

    IF p_generic AND cardinality(v_attempts) < p_limit THEN
        -- The attempts alone, through the ready index, the small tables joined by the
        -- attempt's own binding_id; the capacity count a subquery on
        -- dispatch_run_running_idx. Runs are not joined here: with statistics that
        -- believe dispatch_run empty, a join may scan it whole for every candidate. They
        -- are locked next, by primary key, in a statement of their own.
        SELECT coalesce(array_agg(x.attempt ORDER BY x.available_at, x.attempt), '{}'),
               coalesce(array_agg(x.run ORDER BY x.available_at, x.attempt), '{}'),
               coalesce(array_agg(x.binding ORDER BY x.available_at, x.attempt), '{}'),
               coalesce(array_agg(x.attempt_tid ORDER BY x.available_at, x.attempt), '{}')
          INTO g_attempts, g_runs, g_bindings, g_tids
          FROM (
            SELECT a.id AS attempt, a.run_id AS run, a.binding_id AS binding, a.available_at,
                   a.ctid AS attempt_tid
              FROM dispatch_attempt a
              JOIN dispatch_jobbinding b ON b.id = a.binding_id
              JOIN dispatch_job j ON j.id = b.job_id
              JOIN dispatch_datasource src ON src.id = b.source_id
              JOIN dispatch_datasource snk ON snk.id = b.sink_id
             WHERE a.status = 'PENDING'
               AND a.blocked_reason IS NULL
               AND a.available_at <= v_now
               AND a.id IS DISTINCT FROM v_directed
               AND j.enabled AND b.enabled AND src.enabled AND snk.enabled
               AND (SELECT count(*) FROM dispatch_run q
                     WHERE q.binding_id = b.id AND q.status = 'RUNNING') < b.max_concurrency
             ORDER BY a.available_at, a.id
             LIMIT p_limit - cardinality(v_attempts)
               FOR UPDATE OF a SKIP LOCKED
          ) x;
        -- Their runs, SKIP LOCKED too: a run held by someone else (a cancel, a settlement)
        -- drops its candidate.
        IF cardinality(g_attempts) > 0 THEN
            SELECT coalesce(array_agg(y.id), '{}'), coalesce(array_agg(y.ctid), '{}')
              INTO g_locked, g_locked_tids
              FROM (SELECT q.id, q.ctid FROM dispatch_run q
                     WHERE q.id = ANY (g_runs) FOR UPDATE SKIP LOCKED) y;
            FOR i IN 1 .. cardinality(g_attempts) LOOP
                k := array_position(g_locked, g_runs[i]);
                CONTINUE WHEN k IS NULL;
                v_attempts := v_attempts || g_attempts[i];
                v_runs := v_runs || g_runs[i];
                v_bindings := v_bindings || g_bindings[i];
                v_attempt_tids := v_attempt_tids || g_tids[i];
                v_run_tids := v_run_tids || g_locked_tids[k];
            END LOOP;
        END IF;
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
               snk.enabled AS sink_enabled,
               (SELECT count(*) FROM dispatch_run q
                 WHERE q.binding_id = b.id AND q.status = 'RUNNING') AS running
          INTO c
          FROM dispatch_jobbinding b
          JOIN dispatch_job j ON j.id = b.job_id
          JOIN dispatch_datasource src ON src.id = b.source_id
          JOIN dispatch_datasource snk ON snk.id = b.sink_id
         WHERE b.id = v_bindings[i];

        v_reason := dispatch_blocked_reason(
            c.job_enabled, c.binding_enabled, c.source_enabled, c.sink_enabled,
            c.running, c.max_concurrency);
        IF v_reason IS NOT NULL THEN
            -- A miss: leave it PENDING and say why (a disabled reason also takes it out
            -- of the ready index until the trigger or the refresh clears it).
            UPDATE dispatch_attempt SET blocked_reason = v_reason
             WHERE ctid = v_attempt_tids[i] AND id = v_attempts[i]
               AND blocked_reason IS DISTINCT FROM v_reason;
            CONTINUE;
        END IF;

        v_out.attempt_id := v_attempts[i];
        v_out.run_id := v_runs[i];
        v_out.lease_token := nextval('dispatch_lease_token_seq');
        v_out.lease_seconds := c.lease_seconds;
        v_out.timeout_seconds := c.timeout_seconds;
        v_out.binding_id := c.binding_id;
        v_out.source_spec := c.source_spec;
        v_out.sink_spec := c.sink_spec;
        v_out.source_id := c.source_id;
        v_out.source_kind := c.source_kind;
        v_out.source_version := c.source_version;
        v_out.source_snapshot := c.source_ciphertext;
        v_out.sink_id := c.sink_id;
        v_out.sink_kind := c.sink_kind;
        v_out.sink_version := c.sink_version;
        v_out.sink_snapshot := c.sink_ciphertext;
        v_out.directed := v_directed IS NOT NULL AND v_attempts[i] = v_directed;

        UPDATE dispatch_attempt a
           SET status = 'RUNNING', worker_id = p_worker, lease_token = v_out.lease_token,
               lease_until = v_now + make_interval(secs => c.lease_seconds),
               claimed_at = v_now, heartbeat_at = v_now, blocked_reason = NULL,
               source_id = c.source_id, sink_id = c.sink_id,
               source_version = c.source_version, sink_version = c.sink_version,
               source_snapshot = c.source_ciphertext, sink_snapshot = c.sink_ciphertext,
               source_redacted = c.source_redacted, sink_redacted = c.sink_redacted,
               datasources_resolved_at = v_now
         WHERE a.ctid = v_attempt_tids[i] AND a.id = v_attempts[i] AND a.status = 'PENDING'
        RETURNING a.number INTO v_out.number;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        UPDATE dispatch_run SET status = 'RUNNING'
         WHERE ctid = v_run_tids[i] AND id = v_runs[i];
        IF c.running + 1 >= c.max_concurrency THEN
            v_full := v_full || c.binding_id;  -- this claim took the binding's last slot
        END IF;
        RETURN NEXT v_out;
    END LOOP;

    -- 5. A binding this claim filled holds its queue: its unmarked queued attempts are
    -- marked BINDING_AT_CAPACITY and leave the ready index, so no later pick walks them.
    -- A binding with room left holds nothing. (A loop over the array, not a query: with
    -- sorts off a DISTINCT ... ORDER BY costs enough to be JIT-compiled. Holding marks
    -- SKIP LOCKED, so the order of bindings does not matter.)
    FOR i IN 1 .. cardinality(v_full) LOOP
        IF array_position(v_full, v_full[i]) = i THEN
            PERFORM dispatch_hold_capacity(v_full[i]);
        END IF;
    END LOOP;
END
$$;
