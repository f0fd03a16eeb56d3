-- Dispatch's SQL, version 5 (beside versions 1-4, which stay installed for workers of the
-- previous release during a rolling deploy), installed by migration 0016: the same
-- claim, capacity marks, lock order and time rules as version 4, at a lower cost per run.
--
-- What a run cost in version 4, measured on one connection with no contention
-- (docs/benchmarks.md, "Cost per run"): the claim and the settlement each called small
-- LANGUAGE sql helpers (the binding's disabled reason, its RUNNING count, its room). A
-- LANGUAGE sql function called from PL/pgSQL is planned again by every statement that
-- calls it, so each call planned a four-table join or a count: about half of a
-- lifecycle's server time. And every run leaving RUNNING walked its binding's capacity
-- marks (room, unmarked queue, marked queue) even when nothing was held, which is the
-- usual case. Version 5:
--
--   * dispatch_binding_state_v5: the helpers' answers in PL/pgSQL (planned once per
--     session), one call for both the disabled reason and the room;
--   * the release of capacity marks looks first whether the binding holds any (one
--     probe of dispatch_attempt_queued_idx) and stops there when it holds none;
--   * the claim counts a binding's RUNNING runs in its own statements and holds the
--     capacity (step 5) only of a binding this claim filled;
--   * dispatch_settle_claim_v5: a settlement and the claim of the slot's next attempt in
--     one call (one round trip, one transaction). The claim runs in a subtransaction: if
--     it raises, the settlement still commits and nothing is claimed (as the worker's
--     savepoint did before).
--
-- Lock order, unchanged: run -> attempt -> binding (FOR NO KEY UPDATE, ascending id) ->
-- datasources (FOR SHARE, ascending id). A settlement locks its run and attempt and
-- commits nothing else first; the claim that follows it in the same transaction never
-- waits for a run or an attempt (SKIP LOCKED), so it adds no wait to that order.

-- What a claim returns, one row per claimed attempt.
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

-- A binding's disabled reason (NULL: job, binding and both datasources enabled) and its
-- room (max_concurrency minus its RUNNING runs, never below 0); both NULL when there is
-- no such binding. Primary keys and dispatch_run_running_idx only: sequential scans are
-- off, so statistics taken while the tables were empty cannot plan the count as a walk
-- of dispatch_run (and JIT is off with them: a plan left without an index would cost
-- enough to be compiled).
CREATE OR REPLACE FUNCTION dispatch_binding_state_v5(
    p_binding uuid, OUT disabled text, OUT room bigint
) LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
BEGIN
    SELECT dispatch_blocked_reason_v1(j.enabled, b.enabled, src.enabled, snk.enabled, 0, 1),
           greatest(0, b.max_concurrency - (SELECT count(*) FROM dispatch_run r
                                             WHERE r.binding_id = b.id
                                               AND r.status = 'RUNNING'))
      INTO disabled, room
      FROM dispatch_jobbinding b
      JOIN dispatch_job j ON j.id = b.job_id
      JOIN dispatch_datasource src ON src.id = b.source_id
      JOIN dispatch_datasource snk ON snk.id = b.sink_id
     WHERE b.id = p_binding;
END
$$;

-- dispatch_release_capacity_v4, first asking whether the binding holds any mark.
CREATE OR REPLACE FUNCTION dispatch_release_capacity_v5(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_state record;
    v_room bigint;
    v_ids uuid[];
BEGIN
    PERFORM 1 FROM dispatch_attempt x
     WHERE x.binding_id = p_binding AND x.status = 'PENDING'
       AND x.blocked_reason = 'BINDING_AT_CAPACITY'
     ORDER BY x.binding_id, x.blocked_reason, x.available_at
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN 0;  -- nothing held: the usual case
    END IF;
    v_state := dispatch_binding_state_v5(p_binding);
    IF v_state.disabled IS NOT NULL THEN
        RETURN 0;
    END IF;
    v_room := coalesce(v_state.room, 0);
    IF v_room < 1 THEN
        RETURN 0;
    END IF;
    v_room := v_room - (SELECT count(*) FROM (
        SELECT 1 FROM dispatch_attempt x
         WHERE x.binding_id = p_binding AND x.status = 'PENDING' AND x.blocked_reason IS NULL
         ORDER BY x.binding_id, x.blocked_reason, x.available_at
         LIMIT v_room) u);
    IF v_room < 1 THEN
        RETURN 0;
    END IF;
    SELECT array_agg(y.id) INTO v_ids FROM (
        SELECT x.id FROM dispatch_attempt x
         WHERE x.binding_id = p_binding AND x.status = 'PENDING'
           AND x.blocked_reason = 'BINDING_AT_CAPACITY'
         ORDER BY x.binding_id, x.blocked_reason, x.available_at
         LIMIT v_room
           FOR UPDATE SKIP LOCKED) y;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    UPDATE dispatch_attempt SET blocked_reason = NULL
     WHERE id = ANY (v_ids) AND status = 'PENDING'
       AND blocked_reason = 'BINDING_AT_CAPACITY';
    RETURN cardinality(v_ids);
END
$$;

-- dispatch_hold_capacity_v4 with the binding's state in one call.
CREATE OR REPLACE FUNCTION dispatch_hold_capacity_v5(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_state record;
    v_ids uuid[];
BEGIN
    v_state := dispatch_binding_state_v5(p_binding);
    IF coalesce(v_state.room, 0) > 0 OR v_state.disabled IS NOT NULL THEN
        RETURN 0;
    END IF;
    SELECT array_agg(y.id) INTO v_ids FROM (
        SELECT x.id FROM dispatch_attempt x
         WHERE x.binding_id = p_binding AND x.status = 'PENDING' AND x.blocked_reason IS NULL
         ORDER BY x.binding_id, x.blocked_reason, x.available_at
           FOR UPDATE SKIP LOCKED) y;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    UPDATE dispatch_attempt SET blocked_reason = 'BINDING_AT_CAPACITY'
     WHERE id = ANY (v_ids) AND status = 'PENDING' AND blocked_reason IS NULL;
    RETURN cardinality(v_ids);
END
$$;

-- dispatch_attempt_before_insert_v4 with the binding's state in one call.
CREATE OR REPLACE FUNCTION dispatch_attempt_before_insert_v5()
RETURNS trigger LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    v_state record;
BEGIN
    IF NEW.binding_id IS NULL THEN
        NEW.binding_id := (SELECT r.binding_id FROM dispatch_run r WHERE r.id = NEW.run_id);
    END IF;
    IF NEW.status = 'PENDING' AND NEW.blocked_reason IS NULL THEN
        v_state := dispatch_binding_state_v5(NEW.binding_id);
        NEW.blocked_reason := v_state.disabled;
        IF NEW.blocked_reason IS NULL AND coalesce(v_state.room, 0) < 1 THEN
            NEW.blocked_reason := 'BINDING_AT_CAPACITY';
        END IF;
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_run_left_running_v5()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_release_capacity_v5(NEW.binding_id);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS dispatch_attempt_before_insert ON dispatch_attempt;
CREATE TRIGGER dispatch_attempt_before_insert BEFORE INSERT ON dispatch_attempt
    FOR EACH ROW EXECUTE FUNCTION dispatch_attempt_before_insert_v5();

DROP TRIGGER IF EXISTS dispatch_run_left_running ON dispatch_run;
CREATE TRIGGER dispatch_run_left_running AFTER UPDATE OF status ON dispatch_run
    FOR EACH ROW WHEN (OLD.status = 'RUNNING' AND NEW.status <> 'RUNNING')
    EXECUTE FUNCTION dispatch_run_left_running_v5();

-- Claim up to p_limit due attempts: dispatch_claim_v4, with the RUNNING counts in its own
-- statements and step 5 only for the bindings it filled. Sequential scans are off as
-- well as sorts: every statement has an index or TID path, whatever the statistics say.
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
        -- As version 4: the run's live attempt without a lock through the unique
        -- live-attempt index, then the run by primary key and the attempt by its TID.
        -- The lookup names the run and the live statuses only, so the index of live
        -- attempts (or the run's attempts by number) is the only one whose predicate it
        -- implies: no statistics can turn it into a walk of the PENDING backlog by
        -- available_at. Whether the attempt is due and unblocked is checked on the row.
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
            v_state := dispatch_binding_state_v5(c.binding);
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
        -- As version 4: the attempts alone, through the ready index, the small tables
        -- joined by the attempt's own binding_id; the capacity count a subquery on
        -- dispatch_run_running_idx.
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
        -- Their runs, SKIP LOCKED too (see version 4).
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

    -- 2. Bindings, FOR NO KEY UPDATE, ascending id (see dispatch_claim_v1).
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

        v_reason := dispatch_blocked_reason_v1(
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

    -- 5. A binding this claim filled holds its queue (version 4's step 5, for the filled
    -- bindings only: a binding with room left holds nothing).
    FOR i IN 1 .. cardinality(v_full) LOOP
        IF array_position(v_full, v_full[i]) = i THEN
            PERFORM dispatch_hold_capacity_v5(v_full[i]);
        END IF;
    END LOOP;
END
$$;

-- Settle one attempt (dispatch_settle_v2: guarded by status + token) and claim up to
-- p_limit more for p_worker (dispatch_claim_v5, generic), in one transaction. Returns
-- the settlement's status (NULL: the lease was lost) on every row, with one row per
-- claimed attempt, or one row with no attempt when nothing was claimed. The claim runs
-- in a subtransaction: an error in it is rolled back alone, the settlement stands and
-- nothing is claimed. A lost lease claims nothing: the caller is no longer sure of its
-- slot's state.
CREATE OR REPLACE FUNCTION dispatch_settle_claim_v5(
    p_attempt uuid, p_token bigint, p_outcome text, p_reason text, p_error text,
    p_rows_read bigint, p_rows_written bigint, p_worker text, p_limit integer
) RETURNS TABLE (settled text, claimed dispatch_claimed_v5) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_claimed dispatch_claimed_v5[] := '{}';
    v_status text;
BEGIN
    v_status := dispatch_settle_v2(p_attempt, p_token, p_outcome, p_reason, p_error,
                                   p_rows_read, p_rows_written);
    IF v_status IS NOT NULL AND p_limit > 0 THEN
        BEGIN
            SELECT coalesce(array_agg(x), '{}') INTO v_claimed
              FROM dispatch_claim_v5(p_worker, NULL, p_limit, true) x;
        EXCEPTION WHEN OTHERS THEN
            v_claimed := '{}';
            RAISE WARNING 'dispatch_settle_claim_v5: the claim after a settlement failed: %',
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

-- Version 3's claim and refresh (kept for workers of an older release) turn sorts off
-- too: the same rule, so a plan that still sorts is never JIT-compiled on every call.
ALTER FUNCTION dispatch_claim_v3(text, uuid, integer, boolean) SET jit = off;
ALTER FUNCTION dispatch_refresh_blocked_v3() SET jit = off;
