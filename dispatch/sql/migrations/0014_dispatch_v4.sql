-- Dispatch's SQL, version 4 (beside versions 1-3, which stay installed for workers of the
-- previous release during a rolling deploy), installed by migration 0014: the worker's
-- look at the queue, read by every heartbeat in the heartbeat's own transaction; and
-- capacity kept on the attempt row, with the claim and the refresh that rely on it.
--
-- Three single-entry index probes, each bounded by the time read once (a plain value,
-- so an index condition), whatever the tables hold:
--
--   due_for    seconds the oldest ready attempt has been due (dispatch_attempt_ready_idx,
--              its first entry at or before now), NULL if none is: the worker claims
--              when that is longer than a notified run waits for its worker. Attempts
--              blocked by something disabled or by capacity are not in that index;
--   next_in    seconds until the earliest ready attempt after now falls due (the same
--              index, its first entry after now): the worker's timer.
--   expiry_in  seconds until the earliest RUNNING lease runs out (negative: it has; the
--              running index's first entry): the worker's next recovery pass.
--
-- Each probe is ordered as exactly one index is, so no statistics (fresh, stale, taken
-- while the queue was empty) can plan it as a walk of another index filtered row by
-- row; sorts are off for the same reason. Generic plans: planned once per session.
CREATE OR REPLACE FUNCTION dispatch_queue_view_v4(
    OUT due_for float8, OUT next_in float8, OUT expiry_in float8
) LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET enable_incremental_sort = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_at timestamptz;
BEGIN
    v_at := (
        SELECT a.available_at FROM dispatch_attempt a
         WHERE a.status = 'PENDING'
           AND a.blocked_reason IS NULL
           AND a.available_at <= v_now
         ORDER BY a.available_at, a.id
         LIMIT 1);
    due_for := EXTRACT(EPOCH FROM (v_now - v_at));
    v_at := (
        SELECT a.available_at FROM dispatch_attempt a
         WHERE a.status = 'PENDING'
           AND a.blocked_reason IS NULL
           AND a.available_at > v_now
         ORDER BY a.available_at, a.id
         LIMIT 1);
    next_in := EXTRACT(EPOCH FROM (v_at - v_now));
    v_at := (
        SELECT a.lease_until FROM dispatch_attempt a
         WHERE a.status = 'RUNNING'
         ORDER BY a.lease_until
         LIMIT 1);
    expiry_in := EXTRACT(EPOCH FROM (v_at - v_now));
END
$$;

-- --- Capacity kept on the attempt row ---------------------------------------------------
--
-- Version 3 kept attempts of a binding at capacity in the eligible index and filtered
-- them row by row, so a queue behind a busy binding (max_concurrency is 1 by default) was
-- walked by every generic claim. Version 4 marks them BINDING_AT_CAPACITY and keeps them
-- out of a ready index (blocked_reason IS NULL), under one invariant kept by the
-- transitions that change a binding's room (max_concurrency minus its RUNNING runs):
--
--   a binding with room r has at most about r unmarked queued attempts beyond what its
--   claims will take, its oldest first; one with no room has none, but for stragglers
--   (an insert racing a claim), which the claim's re-check still filters and the refresh
--   marks.
--
--   * a claim that fills a binding marks its unmarked queued attempts (hold);
--   * a new attempt of a binding with no room is marked on insert;
--   * a run leaving RUNNING (settled, recovered, released, cancelled) lets the oldest
--     marked attempts go, as many as the room it made (release), by a trigger on
--     dispatch_run, whatever wrote the change;
--   * a change of max_concurrency releases or holds; enabling a binding turns its
--     disabled marks into capacity marks and releases its room.
--
-- Every marking statement takes attempts FOR UPDATE SKIP LOCKED and never waits; a mark
-- skipped so (rare: a row an operator or a claim holds) is repaired by
-- dispatch_refresh_blocked_v4. Capacity marks only delay: the claim re-checks capacity
-- under its locks as before, and the directed claim still takes a marked attempt of a
-- binding that has room.
--
-- Installed with dispatch_attempt_ready_idx by migration 0014.

-- Room left on a binding: max_concurrency minus its RUNNING runs, never below 0.
CREATE OR REPLACE FUNCTION dispatch_binding_room_v4(p_binding uuid)
RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT greatest(0, b.max_concurrency - dispatch_binding_running_v1(b.id))
      FROM dispatch_jobbinding b WHERE b.id = p_binding
$$;

-- Let the oldest capacity-marked queued attempts of an enabled binding go, as many as its
-- room beyond the unmarked ones already queued. Cost: the room (<= max_concurrency), in
-- dispatch_attempt_queued_idx order.
CREATE OR REPLACE FUNCTION dispatch_release_capacity_v4(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_room bigint;
    v_ids uuid[];
BEGIN
    IF dispatch_binding_disabled_v3(p_binding) IS NOT NULL THEN
        RETURN 0;
    END IF;
    v_room := coalesce(dispatch_binding_room_v4(p_binding), 0);
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

-- Mark the unmarked queued attempts of a binding with no room. Cost: those attempts.
CREATE OR REPLACE FUNCTION dispatch_hold_capacity_v4(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_ids uuid[];
BEGIN
    IF coalesce(dispatch_binding_room_v4(p_binding), 0) > 0
       OR dispatch_binding_disabled_v3(p_binding) IS NOT NULL THEN
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

-- Re-mark a binding's queued attempts after something it depends on changed (version 3's
-- marking, capacity-aware): disabled, every queued attempt carries the reason; enabled,
-- the oldest disabled marks the binding has room for are cleared and the others become
-- capacity marks (each attempt written once; released as runs make room).
CREATE OR REPLACE FUNCTION dispatch_mark_binding_v4(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_room bigint;
    v_first uuid[];
    v_count integer;
BEGIN
    IF dispatch_binding_disabled_v3(p_binding) IS NOT NULL THEN
        RETURN dispatch_mark_binding_v3(p_binding);
    END IF;
    v_room := coalesce(dispatch_binding_room_v4(p_binding), 0);
    IF v_room > 0 THEN
        v_room := v_room - (SELECT count(*) FROM (
            SELECT 1 FROM dispatch_attempt x
             WHERE x.binding_id = p_binding AND x.status = 'PENDING'
               AND x.blocked_reason IS NULL
             ORDER BY x.binding_id, x.blocked_reason, x.available_at
             LIMIT v_room) u);
    END IF;
    SELECT coalesce(array_agg(y.id), '{}') INTO v_first FROM (
        SELECT x.id FROM dispatch_attempt x
         WHERE x.binding_id = p_binding AND x.status = 'PENDING'
           AND x.blocked_reason IN ('JOB_DISABLED', 'BINDING_DISABLED',
                                    'SOURCE_DISABLED', 'SINK_DISABLED')
         ORDER BY x.available_at, x.id
         LIMIT greatest(v_room, 0)) y;
    UPDATE dispatch_attempt a
       SET blocked_reason = CASE WHEN a.id = ANY (v_first) THEN NULL
                                 ELSE 'BINDING_AT_CAPACITY' END
     WHERE a.binding_id = p_binding AND a.status = 'PENDING'
       AND a.blocked_reason IN ('JOB_DISABLED', 'BINDING_DISABLED',
                                'SOURCE_DISABLED', 'SINK_DISABLED');
    GET DIAGNOSTICS v_count = ROW_COUNT;
    -- A changed max_concurrency: let go what the new room allows, or hold the queue.
    RETURN v_count + dispatch_release_capacity_v4(p_binding) + dispatch_hold_capacity_v4(p_binding);
END
$$;

CREATE OR REPLACE FUNCTION dispatch_attempt_before_insert_v4()
RETURNS trigger LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
BEGIN
    IF NEW.binding_id IS NULL THEN
        NEW.binding_id := (SELECT r.binding_id FROM dispatch_run r WHERE r.id = NEW.run_id);
    END IF;
    IF NEW.status = 'PENDING' AND NEW.blocked_reason IS NULL THEN
        NEW.blocked_reason := dispatch_binding_disabled_v3(NEW.binding_id);
        IF NEW.blocked_reason IS NULL
           AND coalesce(dispatch_binding_room_v4(NEW.binding_id), 0) < 1 THEN
            NEW.blocked_reason := 'BINDING_AT_CAPACITY';
        END IF;
    END IF;
    RETURN NEW;
END
$$;

-- A run that leaves RUNNING makes room on its binding.
CREATE OR REPLACE FUNCTION dispatch_run_left_running_v4()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_release_capacity_v4(NEW.binding_id);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_job_enabled_changed_v4()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    b uuid;
BEGIN
    FOR b IN SELECT x.id FROM dispatch_jobbinding x WHERE x.job_id = NEW.id ORDER BY x.id LOOP
        PERFORM dispatch_mark_binding_v4(b);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_binding_changed_v4()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_mark_binding_v4(NEW.id);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_datasource_enabled_changed_v4()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    b uuid;
BEGIN
    FOR b IN SELECT x.id FROM dispatch_jobbinding x WHERE x.source_id = NEW.id
             UNION
             SELECT x.id FROM dispatch_jobbinding x WHERE x.sink_id = NEW.id
             ORDER BY 1 LOOP
        PERFORM dispatch_mark_binding_v4(b);
    END LOOP;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS dispatch_attempt_before_insert ON dispatch_attempt;
CREATE TRIGGER dispatch_attempt_before_insert BEFORE INSERT ON dispatch_attempt
    FOR EACH ROW EXECUTE FUNCTION dispatch_attempt_before_insert_v4();

DROP TRIGGER IF EXISTS dispatch_run_left_running ON dispatch_run;
CREATE TRIGGER dispatch_run_left_running AFTER UPDATE OF status ON dispatch_run
    FOR EACH ROW WHEN (OLD.status = 'RUNNING' AND NEW.status <> 'RUNNING')
    EXECUTE FUNCTION dispatch_run_left_running_v4();

DROP TRIGGER IF EXISTS dispatch_job_enabled_changed ON dispatch_job;
CREATE TRIGGER dispatch_job_enabled_changed AFTER UPDATE OF enabled ON dispatch_job
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION dispatch_job_enabled_changed_v4();

DROP TRIGGER IF EXISTS dispatch_binding_changed ON dispatch_jobbinding;
CREATE TRIGGER dispatch_binding_changed
    AFTER UPDATE OF enabled, job_id, source_id, sink_id, max_concurrency ON dispatch_jobbinding
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled
                       OR OLD.job_id IS DISTINCT FROM NEW.job_id
                       OR OLD.source_id IS DISTINCT FROM NEW.source_id
                       OR OLD.sink_id IS DISTINCT FROM NEW.sink_id
                       OR OLD.max_concurrency IS DISTINCT FROM NEW.max_concurrency)
    EXECUTE FUNCTION dispatch_binding_changed_v4();

DROP TRIGGER IF EXISTS dispatch_datasource_enabled_changed ON dispatch_datasource;
CREATE TRIGGER dispatch_datasource_enabled_changed AFTER UPDATE OF enabled ON dispatch_datasource
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION dispatch_datasource_enabled_changed_v4();

-- Claim up to p_limit due attempts: dispatch_claim_v3 with a pick over the ready index
-- (unmarked attempts only: capacity marks are kept as above) and, after the claim, the
-- capacity of every binding it filled held (step 5).
CREATE OR REPLACE FUNCTION dispatch_claim_v4(
    p_worker text, p_run uuid, p_limit integer, p_generic boolean DEFAULT true
) RETURNS TABLE (
    attempt_id uuid, run_id uuid, number integer, lease_token bigint,
    lease_seconds integer, timeout_seconds integer, binding_id uuid,
    source_spec jsonb, sink_spec jsonb,
    source_id uuid, source_kind text, source_version integer, source_snapshot text,
    sink_id uuid, sink_kind text, sink_version integer, sink_snapshot text,
    directed boolean
) LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET jit = off
SET enable_sort = off
AS $$
#variable_conflict use_column
DECLARE
    v_attempts uuid[] := '{}';
    v_runs uuid[] := '{}';
    v_bindings uuid[] := '{}';
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
    c record;
    i integer;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RETURN;
    END IF;
    -- One reading of the clock for the pick: a plain value, so an index bound.
    v_now := clock_timestamp();

    -- 1. Pick and lock run + attempt (SKIP LOCKED: never waits for either).
    IF p_run IS NOT NULL THEN
        -- The run's live attempt first, without a lock, through the unique live-attempt
        -- index (no other index's predicate is implied, and no time bound is offered to
        -- an available_at index): only a due attempt that no disabled thing blocks is
        -- locked, so a directed claim never holds a marked attempt (which the enable
        -- trigger may wait for) nor a RUNNING one's run. Then the run by primary key and
        -- the attempt by its TID, both SKIP LOCKED: single-table statements that no
        -- join order can turn into a walk.
        SELECT a.run_id AS run, a.binding_id AS binding, a.id AS attempt,
               a.ctid AS attempt_tid, NULL::tid AS run_tid INTO c
          FROM dispatch_attempt a
         WHERE a.run_id = p_run AND a.status IN ('PENDING', 'RUNNING')
           AND a.status = 'PENDING' AND a.available_at <= v_now
           AND (a.blocked_reason IS NULL OR a.blocked_reason = 'BINDING_AT_CAPACITY');
        IF FOUND THEN
            SELECT c.run, c.binding, c.attempt, c.attempt_tid, r.ctid AS run_tid INTO c
              FROM dispatch_run r WHERE r.id = c.run FOR UPDATE SKIP LOCKED;
        END IF;
        IF FOUND THEN
            PERFORM 1 FROM dispatch_attempt a
              WHERE a.ctid = c.attempt_tid AND a.id = c.attempt AND a.status = 'PENDING'
                AND (a.blocked_reason IS NULL OR a.blocked_reason = 'BINDING_AT_CAPACITY')
                FOR UPDATE SKIP LOCKED;
        END IF;
        IF FOUND AND dispatch_binding_disabled_v3(c.binding) IS NULL
           AND dispatch_binding_running_v1(c.binding) < (
               SELECT b.max_concurrency FROM dispatch_jobbinding b WHERE b.id = c.binding) THEN
            v_directed := c.attempt;
            v_attempts := ARRAY[c.attempt];
            v_runs := ARRAY[c.run];
            v_bindings := ARRAY[c.binding];
            v_attempt_tids := ARRAY[c.attempt_tid];
            v_run_tids := ARRAY[c.run_tid];
        END IF;
    END IF;

    IF p_generic AND cardinality(v_attempts) < p_limit THEN
        -- The attempts alone, through the ready index (the small tables joined by the
        -- attempt's own binding_id). Runs are not joined here: with statistics that
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
               AND dispatch_binding_running_v1(b.id) < b.max_concurrency
             ORDER BY a.available_at, a.id
             LIMIT p_limit - cardinality(v_attempts)
               FOR UPDATE OF a SKIP LOCKED
          ) x;
        -- Their runs, SKIP LOCKED too: a run held by someone else (a cancel, a settlement)
        -- drops its candidate. The claim never waits for a run or an attempt, so taking
        -- the attempt first here cannot deadlock with the run -> attempt order elsewhere.
        IF cardinality(g_attempts) > 0 THEN
            SELECT coalesce(array_agg(y.id), '{}'), coalesce(array_agg(y.ctid), '{}')
              INTO g_locked, g_locked_tids
              FROM (SELECT r.id, r.ctid FROM dispatch_run r
                     WHERE r.id = ANY (g_runs) FOR UPDATE SKIP LOCKED) y;
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
            -- A miss: leave it PENDING and say why (a disabled reason also takes it out
            -- of the eligible index until the trigger or the refresh clears it).
            UPDATE dispatch_attempt SET blocked_reason = v_reason
             WHERE ctid = v_attempt_tids[i] AND id = v_attempts[i]
               AND blocked_reason IS DISTINCT FROM v_reason;
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
           SET status = 'RUNNING', worker_id = p_worker, lease_token = dispatch_claim_v4.lease_token,
               lease_until = v_now + make_interval(secs => c.lease_seconds),
               claimed_at = v_now, heartbeat_at = v_now, blocked_reason = NULL,
               source_id = c.source_id, sink_id = c.sink_id,
               source_version = c.source_version, sink_version = c.sink_version,
               source_snapshot = c.source_ciphertext, sink_snapshot = c.sink_ciphertext,
               source_redacted = c.source_redacted, sink_redacted = c.sink_redacted,
               datasources_resolved_at = v_now
         WHERE a.ctid = v_attempt_tids[i] AND a.id = v_attempts[i] AND a.status = 'PENDING'
        RETURNING a.number INTO number;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        UPDATE dispatch_run SET status = 'RUNNING'
         WHERE ctid = v_run_tids[i] AND id = v_runs[i];
        RETURN NEXT;
    END LOOP;

    -- 5. A binding this claim filled holds its queue: its unmarked queued attempts are
    -- marked BINDING_AT_CAPACITY and leave the ready index, so no later pick walks them.
    -- Usually none or a few (the room a settlement let go); the first fill of a backlog
    -- queued while the binding had room marks it once.
    -- (A loop over the array, not a query: with sorts off a DISTINCT ... ORDER BY costs
    -- enough to be JIT-compiled, 40 ms a claim. Holding marks SKIP LOCKED, so the order
    -- of bindings does not matter.)
    FOR i IN 1 .. cardinality(v_bindings) LOOP
        IF array_position(v_bindings, v_bindings[i]) = i THEN
            PERFORM dispatch_hold_capacity_v4(v_bindings[i]);
        END IF;
    END LOOP;
END
$$;

-- The safety net for stale marks (version 3's pass, capacity-aware): per binding, three
-- probes of dispatch_attempt_queued_idx; only a binding with a wrong mark is re-marked.
CREATE OR REPLACE FUNCTION dispatch_refresh_blocked_v4()
RETURNS integer LANGUAGE plpgsql VOLATILE
SET enable_sort = off
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    b record;
    v_min text;
    v_max text;
    v_null boolean;
    v_changed integer := 0;
BEGIN
    FOR b IN SELECT x.id,
                    dispatch_blocked_reason_v1(j.enabled, x.enabled, src.enabled,
                                               snk.enabled, 0, 1) AS reason
               FROM dispatch_jobbinding x
               JOIN dispatch_job j ON j.id = x.job_id
               JOIN dispatch_datasource src ON src.id = x.source_id
               JOIN dispatch_datasource snk ON snk.id = x.sink_id
              ORDER BY x.id LOOP
        v_min := (SELECT a.blocked_reason FROM dispatch_attempt a
                   WHERE a.status = 'PENDING' AND a.binding_id = b.id
                     AND a.blocked_reason >= 'BINDING_AT_CAPACITY'
                     AND a.blocked_reason <= 'SOURCE_DISABLED'
                   ORDER BY a.binding_id, a.blocked_reason, a.available_at LIMIT 1);
        v_max := (SELECT a.blocked_reason FROM dispatch_attempt a
                   WHERE a.status = 'PENDING' AND a.binding_id = b.id
                     AND a.blocked_reason >= 'BINDING_AT_CAPACITY'
                     AND a.blocked_reason <= 'SOURCE_DISABLED'
                   ORDER BY a.binding_id DESC, a.blocked_reason DESC, a.available_at DESC
                   LIMIT 1);
        v_null := (SELECT 1 FROM dispatch_attempt a
                    WHERE a.status = 'PENDING' AND a.binding_id = b.id
                      AND a.blocked_reason IS NULL
                    ORDER BY a.binding_id, a.blocked_reason, a.available_at
                    LIMIT 1) IS NOT NULL;
        IF b.reason IS NULL THEN
            -- Enabled: a disabled mark is stale; a capacity mark while there is room, or
            -- an unmarked attempt while there is none, is released or held.
            IF v_max > 'BINDING_AT_CAPACITY' THEN
                v_changed := v_changed + dispatch_mark_binding_v4(b.id);
            ELSIF v_min = 'BINDING_AT_CAPACITY' OR v_null THEN
                v_changed := v_changed + dispatch_release_capacity_v4(b.id)
                                       + dispatch_hold_capacity_v4(b.id);
            END IF;
        ELSIF v_null OR v_min <> b.reason OR v_max <> b.reason THEN
            -- Blocked: an unmarked attempt, or a mark other than the binding's reason.
            v_changed := v_changed + dispatch_mark_binding_v3(b.id);
        END IF;
    END LOOP;
    RETURN v_changed;
END
$$;
