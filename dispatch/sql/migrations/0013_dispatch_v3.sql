-- Dispatch's concurrency-carrying SQL, version 3: a claim whose work is bounded by what
-- it returns (beside versions 1 and 2, which stay installed for workers of the previous
-- release during a rolling deploy).
--
-- Installed by migration 0013, with the column, indexes and triggers it relies on:
--
--   dispatch_attempt.binding_id   the run's binding, copied on insert (BEFORE INSERT
--                                 trigger; a run never changes binding);
--   dispatch_attempt_eligible_idx (available_at, id) WHERE status = 'PENDING' AND
--                                 (blocked_reason IS NULL OR = 'BINDING_AT_CAPACITY'):
--                                 the claim's walk; attempts blocked by something
--                                 disabled are not in it;
--   dispatch_attempt_queued_idx   (binding_id, blocked_reason, available_at) WHERE
--                                 status = 'PENDING':
--                                 a binding's queued attempts, for the marking below.
--
-- Eligibility is kept on the attempt row: blocked_reason says which disabled thing
-- blocks it (JOB_, BINDING_, SOURCE_, SINK_DISABLED). Every transition that changes it
-- maintains it, whatever wrote the change (the admin, a bulk update, a SQL client):
-- triggers on dispatch_job, dispatch_jobbinding and dispatch_datasource re-mark the
-- queued attempts of each binding involved; the insert trigger marks a new attempt of a
-- blocked binding. The claim re-checks everything under its locks as before, so a mark
-- that is stale (a race between two enables, or an enable and a claim) can delay work,
-- never run blocked work; dispatch_refresh_blocked_v3 (every recovery pass) repairs stale
-- marks in a pass bounded by the number of bindings, not by the queue.
--
-- Locks: the triggers run inside the UPDATE of a job, binding or datasource row, so they
-- hold that row. They mark attempts with SKIP LOCKED (never waiting: a claim may hold a
-- picked attempt while it waits for that binding or datasource). Clearing marks may wait,
-- but only for attempts that carry a disabled mark, and no claim holds such an attempt
-- while it waits for a lock: a claim picks only unmarked attempts, and marks one (a miss)
-- only after it holds all its locks. Lock order of the claim is unchanged: run ->
-- attempt -> binding -> datasources (ascending id).

-- Why the binding's queued attempts cannot run (something disabled), or NULL. Capacity
-- is not considered: it changes with every claim and settlement and is checked by the
-- claim itself.
CREATE OR REPLACE FUNCTION dispatch_binding_disabled_v3(p_binding uuid)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT dispatch_blocked_reason_v1(j.enabled, b.enabled, src.enabled, snk.enabled, 0, 1)
      FROM dispatch_jobbinding b
      JOIN dispatch_job j ON j.id = b.job_id
      JOIN dispatch_datasource src ON src.id = b.source_id
      JOIN dispatch_datasource snk ON snk.id = b.sink_id
     WHERE b.id = p_binding
$$;

-- Re-mark the queued (PENDING) attempts of one binding after something it depends on
-- changed. Cost: that binding's queued attempts, through dispatch_attempt_queued_idx.
CREATE OR REPLACE FUNCTION dispatch_mark_binding_v3(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_reason text;
    v_count integer;
BEGIN
    v_reason := dispatch_binding_disabled_v3(p_binding);
    IF v_reason IS NULL THEN
        UPDATE dispatch_attempt a SET blocked_reason = NULL
         WHERE a.binding_id = p_binding AND a.status = 'PENDING'
           AND a.blocked_reason IN ('JOB_DISABLED', 'BINDING_DISABLED',
                                    'SOURCE_DISABLED', 'SINK_DISABLED');
    ELSE
        UPDATE dispatch_attempt a SET blocked_reason = v_reason
         WHERE a.id IN (SELECT x.id FROM dispatch_attempt x
                         WHERE x.binding_id = p_binding AND x.status = 'PENDING'
                           AND x.blocked_reason IS DISTINCT FROM v_reason
                           FOR UPDATE SKIP LOCKED);
    END IF;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_attempt_before_insert_v3()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.binding_id IS NULL THEN
        NEW.binding_id := (SELECT r.binding_id FROM dispatch_run r WHERE r.id = NEW.run_id);
    END IF;
    IF NEW.status = 'PENDING' AND NEW.blocked_reason IS NULL THEN
        NEW.blocked_reason := dispatch_binding_disabled_v3(NEW.binding_id);
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_job_enabled_changed_v3()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    b uuid;
BEGIN
    FOR b IN SELECT x.id FROM dispatch_jobbinding x WHERE x.job_id = NEW.id ORDER BY x.id LOOP
        PERFORM dispatch_mark_binding_v3(b);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_binding_changed_v3()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_mark_binding_v3(NEW.id);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION dispatch_datasource_enabled_changed_v3()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    b uuid;
BEGIN
    FOR b IN SELECT x.id FROM dispatch_jobbinding x WHERE x.source_id = NEW.id
             UNION
             SELECT x.id FROM dispatch_jobbinding x WHERE x.sink_id = NEW.id
             ORDER BY 1 LOOP
        PERFORM dispatch_mark_binding_v3(b);
    END LOOP;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS dispatch_attempt_before_insert ON dispatch_attempt;
CREATE TRIGGER dispatch_attempt_before_insert BEFORE INSERT ON dispatch_attempt
    FOR EACH ROW EXECUTE FUNCTION dispatch_attempt_before_insert_v3();

DROP TRIGGER IF EXISTS dispatch_job_enabled_changed ON dispatch_job;
CREATE TRIGGER dispatch_job_enabled_changed AFTER UPDATE OF enabled ON dispatch_job
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION dispatch_job_enabled_changed_v3();

DROP TRIGGER IF EXISTS dispatch_binding_changed ON dispatch_jobbinding;
CREATE TRIGGER dispatch_binding_changed
    AFTER UPDATE OF enabled, job_id, source_id, sink_id ON dispatch_jobbinding
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled
                       OR OLD.job_id IS DISTINCT FROM NEW.job_id
                       OR OLD.source_id IS DISTINCT FROM NEW.source_id
                       OR OLD.sink_id IS DISTINCT FROM NEW.sink_id)
    EXECUTE FUNCTION dispatch_binding_changed_v3();

DROP TRIGGER IF EXISTS dispatch_datasource_enabled_changed ON dispatch_datasource;
CREATE TRIGGER dispatch_datasource_enabled_changed AFTER UPDATE OF enabled ON dispatch_datasource
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION dispatch_datasource_enabled_changed_v3();

-- Claim up to p_limit due attempts for p_worker, in one transaction: dispatch_claim_v1
-- with a pick that walks only eligible work.
--
-- The pick reads dispatch_attempt_eligible_idx in (available_at, id) order from its
-- start, bounded above by the time read once (an index condition, not a row filter), and
-- stops after p_limit unlocked candidates. Attempts blocked by something disabled are not
-- in that index; what it still filters row by row is work locked by other claims, a
-- binding at capacity, and a mark not yet written (see the header). The planner settings
-- below keep the plan an ordered index walk under any statistics (fresh, stale, taken
-- while the queue was empty): the walk is the only plan whose cost does not grow with
-- the table. Steps 2-4 (locks, re-check, claim) are version 1's.
CREATE OR REPLACE FUNCTION dispatch_claim_v3(
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
        -- The attempts alone, through the eligible index (the small tables joined by the
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
               AND (a.blocked_reason IS NULL OR a.blocked_reason = 'BINDING_AT_CAPACITY')
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
           SET status = 'RUNNING', worker_id = p_worker, lease_token = dispatch_claim_v3.lease_token,
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
END
$$;

-- The safety net for stale marks, bounded by the number of bindings: for each binding,
-- a few index probes (dispatch_attempt_queued_idx) find whether any queued attempt
-- carries the wrong mark; only then are its attempts re-marked (SKIP LOCKED: this pass
-- never waits). A binding at capacity keeps no mark of its own here: a capacity mark a
-- claim wrote is cleared once the binding has room again.
CREATE OR REPLACE FUNCTION dispatch_refresh_blocked_v3()
RETURNS integer LANGUAGE plpgsql VOLATILE
-- Each probe is ordered by all three columns of dispatch_attempt_queued_idx, an order no
-- other index provides, so that index answers it without a sort under any statistics (a
-- LIMIT 1 probe ordered by blocked_reason alone was planned on the console's
-- blocked-reason index, filtering a whole binding's entries). Generic plans:
-- planned once per session, not on every call.
SET enable_sort = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    b record;
    v_min text;
    v_max text;
    v_null boolean;
    v_changed integer := 0;
    v_count integer;
BEGIN
    FOR b IN SELECT x.id, x.max_concurrency,
                    dispatch_blocked_reason_v1(j.enabled, x.enabled, src.enabled,
                                               snk.enabled, 0, 1) AS reason
               FROM dispatch_jobbinding x
               JOIN dispatch_job j ON j.id = x.job_id
               JOIN dispatch_datasource src ON src.id = x.source_id
               JOIN dispatch_datasource snk ON snk.id = x.sink_id
              ORDER BY x.id LOOP
        -- The smallest and largest mark of the binding's queued attempts, and whether
        -- any is unmarked: three probes of the index, each a single entry.
        -- A range bounded on both sides (every reason lies between the first and the
        -- last in sort order), so neither scan steps into the binding's unmarked
        -- entries, which sort after the marked ones.
        v_min := (SELECT a.blocked_reason FROM dispatch_attempt a
                   WHERE a.status = 'PENDING' AND a.binding_id = b.id
                     AND a.blocked_reason >= 'BINDING_AT_CAPACITY'
                     AND a.blocked_reason <= 'SOURCE_DISABLED'
                   ORDER BY a.binding_id, a.blocked_reason, a.available_at LIMIT 1);
        v_max := (SELECT a.blocked_reason FROM dispatch_attempt a
                   WHERE a.status = 'PENDING' AND a.binding_id = b.id
                     AND a.blocked_reason >= 'BINDING_AT_CAPACITY'
                     AND a.blocked_reason <= 'SOURCE_DISABLED'
                   ORDER BY a.binding_id DESC, a.blocked_reason DESC, a.available_at DESC LIMIT 1);
        IF b.reason IS NULL THEN
            -- Enabled: a disabled mark (every one sorts after BINDING_AT_CAPACITY), or a
            -- capacity mark while the binding has room, is stale.
            IF v_max > 'BINDING_AT_CAPACITY'
               OR (v_min = 'BINDING_AT_CAPACITY'
                   AND dispatch_binding_running_v1(b.id) < b.max_concurrency) THEN
                UPDATE dispatch_attempt a SET blocked_reason = NULL
                 WHERE a.id IN (SELECT x.id FROM dispatch_attempt x
                                 WHERE x.binding_id = b.id AND x.status = 'PENDING'
                                   AND x.blocked_reason IS NOT NULL
                                   AND (x.blocked_reason <> 'BINDING_AT_CAPACITY'
                                        OR dispatch_binding_running_v1(b.id) < b.max_concurrency)
                                   FOR UPDATE SKIP LOCKED);
                GET DIAGNOSTICS v_count = ROW_COUNT;
                v_changed := v_changed + v_count;
            END IF;
        ELSE
            v_null := (SELECT 1 FROM dispatch_attempt a
                        WHERE a.status = 'PENDING' AND a.binding_id = b.id
                          AND a.blocked_reason IS NULL
                        ORDER BY a.binding_id, a.blocked_reason, a.available_at
                        LIMIT 1) IS NOT NULL;
            -- Blocked: an unmarked attempt, or a mark other than the binding's reason.
            IF v_null OR v_min <> b.reason OR v_max <> b.reason THEN
                v_changed := v_changed + dispatch_mark_binding_v3(b.id);
            END IF;
        END IF;
    END LOOP;
    RETURN v_changed;
END
$$;

-- Create runs and their attempt 1 (PENDING, due now), one per element of p_bindings, in
-- one round trip: the trigger (and trigger_many). An element whose idempotency key or
-- schedule slot already has a run returns that run with created = false and creates
-- nothing (a concurrent trigger of the same key waits for the other to commit, then
-- finds its run). The attempt's blocked_reason comes from the insert trigger. The
-- wake-up is not sent here: a NOTIFY in this transaction could fail its commit.
CREATE OR REPLACE FUNCTION dispatch_trigger_v3(
    p_bindings uuid[], p_trigger text, p_requested_by text,
    p_keys text[] DEFAULT NULL, p_schedules uuid[] DEFAULT NULL,
    p_slots timestamptz[] DEFAULT NULL
) RETURNS TABLE (run_id uuid, binding_id uuid, status text, created_at timestamptz,
                 created boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    i integer;
    v_id uuid;
    v_key text;
    v_schedule uuid;
    v_slot timestamptz;
    v_at timestamptz;
    v_missing uuid;
BEGIN
    SELECT x.b INTO v_missing FROM unnest(p_bindings) AS x(b)
     WHERE NOT EXISTS (SELECT 1 FROM dispatch_jobbinding j WHERE j.id = x.b) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'no binding %', v_missing USING ERRCODE = 'foreign_key_violation';
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_bindings), 0) LOOP
        v_key := p_keys[i];
        v_schedule := p_schedules[i];
        v_slot := p_slots[i];
        -- The statement's own time per run, increasing: runs of one call are claimed in
        -- the order they were given.
        v_at := clock_timestamp();
        INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                  idempotency_key, requested_by, schedule_id, scheduled_for)
        VALUES (gen_random_uuid(), p_bindings[i], p_trigger, 'PENDING', v_at,
                v_key, coalesce(p_requested_by, ''), v_schedule, v_slot)
        ON CONFLICT DO NOTHING
        RETURNING id INTO v_id;
        IF v_id IS NOT NULL THEN
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, error, rows_read, rows_written)
            VALUES (gen_random_uuid(), v_id, 1, 'TRIGGER', 'PENDING', v_at, v_at,
                    '', 0, 0);
            created := true;
        ELSE
            SELECT r.id INTO v_id FROM dispatch_run r
             WHERE (v_key IS NOT NULL AND r.idempotency_key = v_key)
                OR (v_schedule IS NOT NULL AND r.schedule_id = v_schedule
                    AND r.scheduled_for IS NOT DISTINCT FROM v_slot);
            created := false;
        END IF;
        SELECT r.id, r.binding_id, r.status, r.created_at
          INTO run_id, binding_id, status, created_at
          FROM dispatch_run r WHERE r.id = v_id;
        RETURN NEXT;
        v_id := NULL;
    END LOOP;
END
$$;
