-- A frozen snapshot of dispatch/sql/functions/ (docs/sql.md): installed by a migration,
-- never edited. A change to a function is a new snapshot and a new migration.

-- sql/functions/binding.sql

-- A binding's state, as the claim, the capacity marks and the triggers read it.
--
-- Helpers, not called from Python: no version in their names, replaced in place by the
-- migration that installs a new snapshot (docs/sql.md).

-- Why a due PENDING attempt cannot be claimed now, or NULL if it can.
CREATE OR REPLACE FUNCTION dispatch_blocked_reason(
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

-- A binding's disabled reason (NULL: job, binding and both datasources enabled) and its
-- room (max_concurrency minus its RUNNING runs, never below 0); both NULL when there is
-- no such binding. A run's status is its latest attempt's, written in the same
-- transaction (the claim included), so counting the binding's RUNNING runs counts its
-- RUNNING attempts, through dispatch_run_running_idx, without touching other bindings'
-- work.
--
-- PL/pgSQL, planned once per session (a LANGUAGE sql helper called from PL/pgSQL is
-- planned again by every statement that calls it). Primary keys and
-- dispatch_run_running_idx only: sequential scans are off, so statistics taken while the
-- tables were empty cannot plan the count as a walk of dispatch_run (and JIT is off with
-- them: a plan left without an index would cost enough to be compiled).
CREATE OR REPLACE FUNCTION dispatch_binding_state(
    p_binding uuid, OUT disabled text, OUT room bigint
) LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET jit = off
AS $$
BEGIN
    SELECT dispatch_blocked_reason(j.enabled, b.enabled, src.enabled, snk.enabled, 0, 1),
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

-- sql/functions/capacity.sql

-- Capacity kept on the attempt row: the one implementation, used by the claim, by the
-- run-left-running trigger, by the marking after an enable or a change of
-- max_concurrency (marks.sql) and by the refresh.
--
-- A queued attempt of a binding at capacity is marked BINDING_AT_CAPACITY and so kept
-- out of dispatch_attempt_ready_idx (blocked_reason IS NULL): a queue behind a busy
-- binding (max_concurrency is 1 by default) is never walked by a generic claim. The
-- invariant, kept by the transitions that change a binding's room (max_concurrency minus
-- its RUNNING runs):
--
--   a binding with room r has at most about r unmarked queued attempts beyond what its
--   claims will take, its oldest first; one with no room has none, but for stragglers
--   (an insert racing a claim), which the claim's re-check still filters and the refresh
--   marks.
--
--   * a claim that fills a binding marks its unmarked queued attempts (hold);
--   * a new attempt of a binding with no room is marked on insert (triggers.sql);
--   * a run leaving RUNNING (settled, recovered, released, cancelled) lets the oldest
--     marked attempts go, as many as the room it made (release), by a trigger on
--     dispatch_run, whatever wrote the change;
--   * a change of max_concurrency releases or holds; enabling a binding turns its
--     disabled marks into capacity marks and releases its room (marks.sql).
--
-- Every marking statement takes attempts FOR UPDATE SKIP LOCKED and never waits; a mark
-- skipped so (rare: a row an operator or a claim holds) is repaired by
-- dispatch_refresh_blocked_v4. Capacity marks only delay: the claim re-checks capacity
-- under its locks, and the directed claim still takes a marked attempt of a binding that
-- has room.
--
-- Each statement is ordered as dispatch_attempt_queued_idx (binding_id, blocked_reason,
-- available_at) is, with sorts and sequential scans off, so no statistics can plan it as
-- anything but a walk of that binding's entries; JIT is off with them (a plan that still
-- sorts would cost enough to be compiled on every call). Generic plans: planned once per
-- session.

-- Let the oldest capacity-marked queued attempts of an enabled binding go, as many as its
-- room beyond the unmarked ones already queued. It first asks whether the binding holds
-- any mark (one probe of dispatch_attempt_queued_idx) and stops there when it holds none:
-- the usual case, and every run leaving RUNNING calls this. Cost otherwise: the room
-- (<= max_concurrency), in dispatch_attempt_queued_idx order.
CREATE OR REPLACE FUNCTION dispatch_release_capacity(p_binding uuid)
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
    v_state := dispatch_binding_state(p_binding);
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

-- Mark the unmarked queued attempts of an enabled binding with no room. Cost: those
-- attempts.
CREATE OR REPLACE FUNCTION dispatch_hold_capacity(p_binding uuid)
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
    v_state := dispatch_binding_state(p_binding);
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

-- sql/functions/marks.sql

-- Eligibility kept on the attempt row: blocked_reason says what blocks a queued
-- (PENDING) attempt: something disabled (JOB_, BINDING_, SOURCE_, SINK_DISABLED) or its
-- binding's capacity (BINDING_AT_CAPACITY, capacity.sql), or upstream runs of its chain
-- that have not ended (WAITING_UPSTREAM, chains.sql: written and cleared there only; it
-- sorts after every other mark, outside the refresh's probes). Only unmarked attempts are in
-- dispatch_attempt_ready_idx, the claim's walk; dispatch_attempt_queued_idx
-- (binding_id, blocked_reason, available_at) WHERE status = 'PENDING' finds a binding's
-- queued attempts for the marking below.
--
-- Every transition that changes a mark maintains it, whatever wrote the change (the
-- admin, a bulk update, a SQL client): triggers on dispatch_job, dispatch_jobbinding and
-- dispatch_datasource re-mark the queued attempts of each binding involved
-- (dispatch_mark_binding, triggers.sql); the insert trigger marks a new attempt of a
-- blocked binding. The claim re-checks everything under its locks, so a mark that is
-- stale (a race between two enables, or an enable and a claim) can delay work, never run
-- blocked work; dispatch_refresh_blocked_v4 (every recovery pass) repairs stale marks in
-- a pass bounded by the number of bindings, not by the queue.
--
-- Locks: the triggers run inside the UPDATE of a job, binding or datasource row, so they
-- hold that row. They mark attempts with SKIP LOCKED (never waiting: a claim may hold a
-- picked attempt while it waits for that binding or datasource). Clearing disabled marks
-- may wait, but only for attempts that carry one, and no claim holds such an attempt
-- while it waits for a lock: a claim picks only unmarked attempts (or, directed, a
-- capacity-marked one), and marks one (a miss) only after it holds all its locks.

-- The disabled marks of one binding's queued attempts: disabled, every queued attempt
-- carries the binding's reason (SKIP LOCKED); enabled, the disabled marks are cleared
-- (without regard to capacity: dispatch_mark_binding, which handles an enabled binding
-- itself, calls this only for a disabled one). Cost: that binding's queued attempts,
-- through dispatch_attempt_queued_idx.
CREATE OR REPLACE FUNCTION dispatch_mark_binding_disabled(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_state record;
    v_reason text;
    v_count integer;
BEGIN
    v_state := dispatch_binding_state(p_binding);
    v_reason := v_state.disabled;
    IF v_reason IS NULL THEN
        UPDATE dispatch_attempt a SET blocked_reason = NULL
         WHERE a.binding_id = p_binding AND a.status = 'PENDING'
           AND a.blocked_reason IN ('JOB_DISABLED', 'BINDING_DISABLED',
                                    'SOURCE_DISABLED', 'SINK_DISABLED');
    ELSE
        -- WAITING_UPSTREAM stays: only its chain's settlement clears it (chains.sql); a
        -- disabled mark in its place would let an enable start the run too early.
        UPDATE dispatch_attempt a SET blocked_reason = v_reason
         WHERE a.id IN (SELECT x.id FROM dispatch_attempt x
                         WHERE x.binding_id = p_binding AND x.status = 'PENDING'
                           AND x.blocked_reason IS DISTINCT FROM v_reason
                           AND x.blocked_reason IS DISTINCT FROM 'WAITING_UPSTREAM'
                           FOR UPDATE SKIP LOCKED);
    END IF;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END
$$;

-- Re-mark a binding's queued attempts after something it depends on changed (enabled
-- flags, its job or datasources, max_concurrency): disabled, every queued attempt carries
-- the reason; enabled, the oldest disabled marks the binding has room for are cleared
-- and the others become capacity marks (each attempt written once; released as runs
-- make room), then the binding's capacity is released or held for its new room.
CREATE OR REPLACE FUNCTION dispatch_mark_binding(p_binding uuid)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_state record;
    v_room bigint;
    v_first uuid[];
    v_count integer;
BEGIN
    v_state := dispatch_binding_state(p_binding);
    IF v_state.disabled IS NOT NULL THEN
        RETURN dispatch_mark_binding_disabled(p_binding);
    END IF;
    v_room := coalesce(v_state.room, 0);
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
    RETURN v_count + dispatch_release_capacity(p_binding) + dispatch_hold_capacity(p_binding);
END
$$;

-- The safety net for stale marks, bounded by the number of bindings: for each binding,
-- three single-entry probes of dispatch_attempt_queued_idx (its smallest and largest
-- mark, and whether any queued attempt is unmarked); only a binding with a wrong mark is
-- re-marked (SKIP LOCKED: this pass never waits). Called by every recovery pass.
--
-- Each probe is ordered by all three columns of dispatch_attempt_queued_idx, an order no
-- other index provides, so that index answers it without a sort under any statistics (a
-- LIMIT 1 probe ordered by blocked_reason alone was planned on the console's
-- blocked-reason index, filtering a whole binding's entries). Generic plans: planned
-- once per session.
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
                    dispatch_blocked_reason(j.enabled, x.enabled, src.enabled,
                                            snk.enabled, 0, 1) AS reason
               FROM dispatch_jobbinding x
               JOIN dispatch_job j ON j.id = x.job_id
               JOIN dispatch_datasource src ON src.id = x.source_id
               JOIN dispatch_datasource snk ON snk.id = x.sink_id
              ORDER BY x.id LOOP
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
                   ORDER BY a.binding_id DESC, a.blocked_reason DESC, a.available_at DESC
                   LIMIT 1);
        v_null := (SELECT 1 FROM dispatch_attempt a
                    WHERE a.status = 'PENDING' AND a.binding_id = b.id
                      AND a.blocked_reason IS NULL
                    ORDER BY a.binding_id, a.blocked_reason, a.available_at
                    LIMIT 1) IS NOT NULL;
        IF b.reason IS NULL THEN
            -- Enabled: a disabled mark (every one sorts after BINDING_AT_CAPACITY) is
            -- stale; a capacity mark while there is room, or an unmarked attempt while
            -- there is none, is released or held.
            IF v_max > 'BINDING_AT_CAPACITY' THEN
                v_changed := v_changed + dispatch_mark_binding(b.id);
            ELSIF v_min = 'BINDING_AT_CAPACITY' OR v_null THEN
                v_changed := v_changed + dispatch_release_capacity(b.id)
                                       + dispatch_hold_capacity(b.id);
            END IF;
        ELSIF v_null OR v_min <> b.reason OR v_max <> b.reason THEN
            -- Blocked: an unmarked attempt, or a mark other than the binding's reason.
            v_changed := v_changed + dispatch_mark_binding_disabled(b.id);
        END IF;
    END LOOP;
    RETURN v_changed;
END
$$;

-- sql/functions/claim.sql

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

-- sql/functions/events.sql

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

-- sql/functions/settle.sql

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

-- sql/functions/slices.sql

-- Slices: a run of a big table split into ranges of a key, each copied by a slice run of
-- its own (docs/architecture.md, "Slices").
--
-- A sliced run is planned by its first attempt (dispatch_slices_plan_v1): the plan
-- (dispatch_sliceplan, one row) and its ranges (dispatch_slice, one row each) are written
-- and the first max_slices_in_flight slice runs created, in one transaction guarded by
-- the planning attempt's status and token; the run becomes WAITING (not RUNNING: it holds
-- no capacity, and it has no live attempt, so no claim picks it). Each slice run is an
-- ordinary run (parent_id, slice_number): claimed, heartbeated, fenced, recovered and
-- retried like any other. Its terminal settlement (dispatch_settle_v3 calls
-- dispatch_slice_settled) updates the plan's counters and settles the parent in the same
-- transaction, and starts the next slice: no scan of the siblings. A slice that has not
-- started is a plan row, which no claim reads.
--
-- Lock order, added to run -> attempt -> binding -> datasources: a slice before its
-- parent. A slice's settlement (a worker's, recovery's) holds the slice run and its
-- attempt and then locks the parent run, then the plan row, then the range rows it
-- starts (FOR UPDATE, ascending number). The operator's cancel and retry of a sliced run
-- (dispatch.services) lock its slice runs (ascending id), their attempts, then the
-- parent. The claim never locks a parent. New slice runs are created only by a holder of
-- the parent's lock.

-- A range as text, for errors and the console: "id >= 375000 and < 500000".
CREATE OR REPLACE FUNCTION dispatch_slice_label(
    p_key text, p_lower text, p_upper text
) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_lower IS NULL AND p_upper IS NULL THEN 'all rows'
        WHEN p_lower IS NULL THEN format('%s < %s or null', p_key, p_upper)
        WHEN p_upper IS NULL THEN format('%s >= %s', p_key, p_lower)
        ELSE format('%s >= %s and < %s', p_key, p_lower, p_upper)
    END
$$;

-- Start up to p_limit slices of a sliced run that have no run yet, in number order: a
-- slice run (a version-8 UUID: the worker knows a slice from its claim) and its attempt
-- 1, due now, the earlier slice a microsecond earlier. Slices start in number order and
-- never go back, so the next one is number `started` + 1 of the plan: unique-index
-- lookups, whatever the number of slices. The caller holds the parent run's lock (only a
-- holder of it starts slices, so two callers never start the same one). Returns the new
-- slice runs' ids, for the wake-ups.
CREATE OR REPLACE FUNCTION dispatch_slices_start_v1(p_parent uuid, p_limit integer)
RETURNS SETOF uuid LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_parent dispatch_run%ROWTYPE;
    v_plan dispatch_sliceplan%ROWTYPE;
    v_now timestamptz := clock_timestamp();
    v_last integer;
    v_id uuid;
    v_at timestamptz;
    v_slice bigint;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RETURN;
    END IF;
    SELECT * INTO v_parent FROM dispatch_run WHERE id = p_parent;
    SELECT * INTO v_plan FROM dispatch_sliceplan WHERE run_id = p_parent FOR UPDATE;
    IF v_parent.id IS NULL OR v_plan.run_id IS NULL THEN
        RETURN;
    END IF;
    v_last := least(v_plan.started + p_limit, v_plan.total);
    FOR n IN v_plan.started + 1 .. v_last LOOP
        SELECT x.id INTO v_slice FROM dispatch_slice x
         WHERE x.parent_id = p_parent AND x.number = n AND x.run_id IS NULL
           FOR UPDATE;
        CONTINUE WHEN NOT FOUND;
        -- gen_random_uuid() is version 4; the 13th hex digit is the version.
        v_id := overlay(gen_random_uuid()::text PLACING '8' FROM 15 FOR 1)::uuid;
        v_at := v_now - make_interval(secs => (v_last - n + 1) / 1e6);
        INSERT INTO dispatch_run (
            id, binding_id, trigger, status, created_at, requested_by, parent_id,
            slice_number)
        VALUES (
            v_id, v_parent.binding_id, v_parent.trigger, 'PENDING', v_at,
            v_parent.requested_by, p_parent, n);
        -- A statement after its run's: the insert trigger reads the run's binding.
        INSERT INTO dispatch_attempt (
            id, run_id, number, origin, status, created_at, available_at,
            error, rows_read, rows_written)
        VALUES (gen_random_uuid(), v_id, 1, 'TRIGGER', 'PENDING', v_at, v_at, '', 0, 0);
        UPDATE dispatch_slice SET run_id = v_id WHERE id = v_slice;
        RETURN NEXT v_id;
    END LOOP;
    IF v_last > v_plan.started THEN
        UPDATE dispatch_sliceplan
           SET live = live + (v_last - v_plan.started), started = v_last
         WHERE run_id = p_parent;
    END IF;
END
$$;

-- Plan a sliced run: its planning attempt (RUNNING with p_token) records the ranges
-- computed on the source (p_lowers[i], p_uppers[i]: the i-th range, NULL = open) and the
-- specs its slices run with, starts the first max_slices_in_flight slices, ends
-- SUCCEEDED / SLICES_PLANNED, and its run becomes WAITING: all in this one transaction.
-- Locks the run, then the attempt (as dispatch_settle_v3 does). Returns the run's new
-- status and the started slice runs; NULL status: the attempt is no longer the caller's
-- (nothing changed). A run with a cancel request is cancelled instead (no plan).
CREATE OR REPLACE FUNCTION dispatch_slices_plan_v1(
    p_attempt uuid, p_token bigint, p_key text, p_key_type text, p_method text,
    p_basis text, p_lowers text[], p_uppers text[], p_source_spec jsonb, p_sink_spec jsonb
) RETURNS TABLE (status text, started uuid[]) LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    v_run dispatch_run%ROWTYPE;
    v_total integer := coalesce(cardinality(p_lowers), 0);
    v_in_flight integer;
    v_now timestamptz;
BEGIN
    IF v_total < 1 OR v_total <> coalesce(cardinality(p_uppers), 0) THEN
        RAISE EXCEPTION 'dispatch_slices_plan_v1: % lower and % upper bounds',
            v_total, coalesce(cardinality(p_uppers), 0);
    END IF;
    SELECT * INTO v_run FROM dispatch_run
     WHERE id = (SELECT a.run_id FROM dispatch_attempt a WHERE a.id = p_attempt)
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    PERFORM 1 FROM dispatch_attempt a
     WHERE a.id = p_attempt AND a.status = 'RUNNING' AND a.lease_token = p_token
       FOR UPDATE;
    IF NOT FOUND THEN
        status := NULL;
        started := '{}';
        RETURN NEXT;
        RETURN;
    END IF;
    IF v_run.cancel_requested_at IS NOT NULL THEN
        status := dispatch_settle_v3(p_attempt, p_token, 'CANCELLED', 'CANCELLED_BY_OPERATOR',
                                     NULL, 0, 0, NULL, NULL, NULL);
        started := '{}';
        RETURN NEXT;
        RETURN;
    END IF;
    IF v_run.parent_id IS NOT NULL THEN
        RAISE EXCEPTION 'dispatch_slices_plan_v1: run % is a slice; a slice is not sliced',
            v_run.id;
    END IF;
    SELECT least(coalesce(j.max_slices_in_flight, v_total), v_total) INTO v_in_flight
      FROM dispatch_jobbinding b JOIN dispatch_job j ON j.id = b.job_id
     WHERE b.id = v_run.binding_id;
    v_now := clock_timestamp();

    INSERT INTO dispatch_sliceplan (
        run_id, key, key_type, method, basis, total, in_flight, source_spec, sink_spec,
        succeeded, failed, live, started, rows_written, error, planned_at)
    VALUES (
        v_run.id, p_key, p_key_type, p_method, coalesce(p_basis, ''), v_total, v_in_flight,
        p_source_spec, p_sink_spec, 0, 0, 0, 0, 0, '', v_now);
    INSERT INTO dispatch_slice (parent_id, number, lower, upper, rows_written)
    SELECT v_run.id, b.n, b.lower, b.upper, 0
      FROM unnest(p_lowers, p_uppers) WITH ORDINALITY AS b(lower, upper, n);

    UPDATE dispatch_attempt
       SET status = 'SUCCEEDED', reason = 'SLICES_PLANNED', finished_at = v_now,
           source_snapshot = NULL, sink_snapshot = NULL
     WHERE id = p_attempt;
    UPDATE dispatch_run SET status = 'WAITING', finished_at = NULL WHERE id = v_run.id;

    status := 'WAITING';
    started := ARRAY(SELECT dispatch_slices_start_v1(v_run.id, v_in_flight));
    RETURN NEXT;
END
$$;

-- A slice run ended (p_status SUCCEEDED, FAILED or CANCELLED), called by
-- dispatch_settle_v3 in its transaction, which holds the slice run and its attempt. Locks
-- the parent run, then its plan row; updates the counters (no scan of the siblings) and
-- settles the parent:
--   * every slice SUCCEEDED -> the parent SUCCEEDED;
--   * a cancel requested on the parent -> CANCELLED once no slice is queued or running;
--   * a slice FAILED (or cancelled without the parent's cancel) -> the parent FAILED, its
--     plan's error naming the slice: "slice 3 of 8 (id >= 375000 and < 500000): ...".
--     Siblings already started run to their end (their rows commit, which a retry then
--     need not redo); no new slice starts;
--   * otherwise the next slice starts (as many as max_slices_in_flight leaves room for).
-- A parent that ends fires its edges (dispatch_chain_fire, chains.sql) in this
-- transaction. A parent already FAILED or CANCELLED only counts (a sibling finishing
-- after the decision). Generic plans (as the claim): every statement is a primary-key or unique
-- index lookup, and a custom plan per call would read the statistics each time.
CREATE OR REPLACE FUNCTION dispatch_slice_settled(
    p_parent uuid, p_number integer, p_status text, p_rows bigint, p_error text,
    p_now timestamptz
) RETURNS void LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_parent dispatch_run%ROWTYPE;
    v_plan dispatch_sliceplan%ROWTYPE;
    v_slice dispatch_slice%ROWTYPE;
BEGIN
    SELECT * INTO v_parent FROM dispatch_run WHERE id = p_parent FOR UPDATE;
    SELECT * INTO v_plan FROM dispatch_sliceplan WHERE run_id = p_parent FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF p_status = 'SUCCEEDED' THEN
        UPDATE dispatch_slice SET rows_written = coalesce(p_rows, 0)
         WHERE parent_id = p_parent AND number = p_number;
        UPDATE dispatch_sliceplan
           SET live = greatest(live - 1, 0), succeeded = succeeded + 1,
               rows_written = rows_written + coalesce(p_rows, 0)
         WHERE run_id = p_parent
        RETURNING * INTO v_plan;
    ELSE
        UPDATE dispatch_sliceplan
           SET live = greatest(live - 1, 0), failed = failed + 1
         WHERE run_id = p_parent
        RETURNING * INTO v_plan;
    END IF;

    IF v_parent.status <> 'WAITING' THEN
        RETURN;
    END IF;
    IF v_plan.succeeded >= v_plan.total THEN
        UPDATE dispatch_run SET status = 'SUCCEEDED', finished_at = p_now WHERE id = p_parent;
        PERFORM dispatch_chain_fire(p_parent, 'SUCCEEDED', p_now);
    ELSIF v_parent.cancel_requested_at IS NOT NULL THEN
        IF v_plan.live = 0 THEN
            UPDATE dispatch_run SET status = 'CANCELLED', finished_at = p_now
             WHERE id = p_parent;
            PERFORM dispatch_chain_fire(p_parent, 'CANCELLED', p_now);
        END IF;
    ELSIF p_status <> 'SUCCEEDED' THEN
        SELECT * INTO v_slice FROM dispatch_slice
         WHERE parent_id = p_parent AND number = p_number;
        UPDATE dispatch_run SET status = 'FAILED', finished_at = p_now WHERE id = p_parent;
        PERFORM dispatch_chain_fire(p_parent, 'FAILED', p_now);
        UPDATE dispatch_sliceplan
           SET error = format('slice %s of %s (%s): %s', p_number, v_plan.total,
                              dispatch_slice_label(v_plan.key, v_slice.lower, v_slice.upper),
                              coalesce(nullif(p_error, ''), lower(p_status)))
         WHERE run_id = p_parent;
    ELSIF v_plan.live < v_plan.in_flight AND v_plan.started < v_plan.total THEN
        PERFORM dispatch_slices_start_v1(p_parent, v_plan.in_flight - v_plan.live);
    END IF;
END
$$;

-- sql/functions/chains.sql

-- Chains: bindings that follow one another (docs/architecture.md, "Chains").
--
-- An edge (dispatch_bindingedge: upstream, downstream, on_status) says that a run of the
-- downstream binding follows a run of the upstream one that ended SUCCEEDED (on SUCCESS)
-- or ended at all (on COMPLETION: SUCCEEDED, FAILED or CANCELLED). Every run carries the
-- root of its chain (dispatch_run.chain_root_id: the run a trigger created; NULL on that
-- run itself). A chain holds at most one run of each binding
-- (dispatch_run_chain_uniq (chain_root_id, binding_id)): that key is the edge's
-- idempotency key, for a single upstream and a fan-in alike.
--
-- Whatever makes a run end (dispatch_settle_v3: a worker's settlement, recovery;
-- dispatch_slice_settled: a sliced run's last slice; dispatch.services: an operator's
-- cancel) calls dispatch_chain_fire in its own transaction, after the run's new status is
-- written. So an edge fires in the transaction that ends its upstream, never before it
-- commits and never again: a settlement repeated or recovered finds the attempt no
-- longer RUNNING with its token and changes nothing, and a downstream run already there
-- is found, not created (ON CONFLICT DO NOTHING).
--
-- A fan-in (a downstream with several upstreams) is one run, created by whichever of its
-- upstreams ends first, with its attempt 1 PENDING and marked WAITING_UPSTREAM while an
-- upstream of its chain has not ended as its edge asks; the settlement of the last one
-- clears the mark (to the binding's own mark: disabled, at capacity, or none). The claim
-- takes only unmarked attempts (or, directed, capacity-marked ones), and no marking but
-- this one writes or clears WAITING_UPSTREAM (marks.sql, capacity.sql).
--
-- Lock order, added to run -> attempt -> binding -> datasources: an upstream run before
-- its downstream runs. The settlement holds the upstream run and its attempt (a slice's
-- settlement, its parent too), then locks each downstream run of the chain (FOR UPDATE,
-- ascending downstream binding id): two upstreams of one fan-in that end at once take
-- the downstream's lock in turn, and the second sees the first's committed status. Edges
-- form no cycle (the trigger below), so no run is both upstream and downstream of
-- another and the order cannot close a cycle.

-- The edges of a run that ended: for each edge of the run's binding that the status
-- satisfies, the downstream run of the chain (created if missing), and its attempt made
-- eligible once every upstream of the downstream binding has a run in this chain that
-- ended as its edge asks. Called by the transaction that ended the run, after its status
-- is written. A slice run fires nothing (its sliced run does, when it ends). Returns the
-- downstream runs created eligible or made eligible, for the caller's wake-ups.
-- Generic plans: every statement is a primary-key or unique-index lookup.
CREATE OR REPLACE FUNCTION dispatch_chain_fire(p_run uuid, p_status text, p_now timestamptz)
RETURNS SETOF uuid LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_run dispatch_run%ROWTYPE;
    v_root dispatch_run%ROWTYPE;
    v_root_id uuid;
    v_new uuid;
    v_down uuid;
    v_ready boolean;
    v_state record;
    v_reason text;
    e record;
BEGIN
    IF p_status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN
        RETURN;
    END IF;
    SELECT * INTO v_run FROM dispatch_run WHERE id = p_run;
    IF NOT FOUND OR v_run.parent_id IS NOT NULL THEN
        RETURN;
    END IF;
    v_root_id := coalesce(v_run.chain_root_id, v_run.id);
    FOR e IN
        SELECT x.downstream_id FROM dispatch_bindingedge x
         WHERE x.upstream_id = v_run.binding_id
           AND (x.on_status = 'COMPLETION' OR p_status = 'SUCCEEDED')
         ORDER BY x.downstream_id
    LOOP
        IF v_root.id IS NULL THEN
            -- The downstream runs carry the root's trigger and who asked for it.
            SELECT * INTO v_root FROM dispatch_run WHERE id = v_root_id;
            IF NOT FOUND THEN
                v_root := v_run;  -- the root was deleted (retention): this run's
            END IF;
        END IF;
        -- The key: one run of a binding per chain. A concurrent upstream of the same
        -- fan-in waits here for the other's commit, then finds its run.
        v_new := NULL;
        INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at, requested_by,
                                  chain_root_id)
        VALUES (gen_random_uuid(), e.downstream_id, v_root.trigger, 'PENDING', p_now,
                v_root.requested_by, v_root_id)
        ON CONFLICT (chain_root_id, binding_id) WHERE chain_root_id IS NOT NULL DO NOTHING
        RETURNING id INTO v_new;
        SELECT r.id INTO v_down FROM dispatch_run r
         WHERE r.chain_root_id = v_root_id AND r.binding_id = e.downstream_id
           FOR UPDATE;
        -- A new statement after the lock: under READ COMMITTED it sees what an upstream
        -- that held the lock before committed.
        v_ready := NOT EXISTS (
            SELECT 1 FROM dispatch_bindingedge u
             WHERE u.downstream_id = e.downstream_id
               AND NOT EXISTS (
                   SELECT 1 FROM dispatch_run r
                    WHERE r.binding_id = u.upstream_id
                      AND (r.id = v_root_id OR r.chain_root_id = v_root_id)
                      AND (r.status = 'SUCCEEDED'
                           OR (u.on_status = 'COMPLETION' AND r.status IN ('FAILED', 'CANCELLED')))));
        IF v_new IS NOT NULL THEN
            -- Eligible: the insert trigger marks it as its binding stands (disabled, at
            -- capacity). Waiting: marked here, and no other marking touches the mark.
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, blocked_reason, error, rows_read,
                                          rows_written)
            VALUES (gen_random_uuid(), v_new, 1, 'TRIGGER', 'PENDING', p_now, p_now,
                    CASE WHEN v_ready THEN NULL ELSE 'WAITING_UPSTREAM' END, '', 0, 0);
            IF v_ready THEN
                RETURN NEXT v_new;
            END IF;
        ELSIF v_ready THEN
            v_state := dispatch_binding_state(e.downstream_id);
            v_reason := v_state.disabled;
            IF v_reason IS NULL AND coalesce(v_state.room, 0) < 1 THEN
                v_reason := 'BINDING_AT_CAPACITY';
            END IF;
            UPDATE dispatch_attempt
               SET blocked_reason = v_reason, available_at = p_now
             WHERE run_id = v_down AND status = 'PENDING'
               AND blocked_reason = 'WAITING_UPSTREAM';
            IF FOUND THEN
                RETURN NEXT v_down;
            END IF;
        END IF;
    END LOOP;
END
$$;

-- The lock every edit of edges takes before its first write (named statement
-- lock_edges): a function, since a LOCK statement cannot be prepared or explained.
CREATE OR REPLACE FUNCTION dispatch_lock_edges()
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    LOCK TABLE dispatch_bindingedge IN SHARE ROW EXCLUSIVE MODE;
END
$$;

-- Edges form no cycle: an edge whose downstream already leads to its upstream is
-- refused, naming the cycle ("binding edges would form a cycle: a -> b -> c -> a",
-- SQLSTATE 23514 check_violation). Every writer of dispatch_bindingedge takes the table
-- in SHARE ROW EXCLUSIVE mode before its first write (the console's form and definition
-- files do, dispatch.services.set_upstreams; this trigger takes it too, for any other
-- writer), so two transactions that each add half of a cycle check one after the other,
-- the second seeing the first's edge. The walk reads the edges only: a few rows.
CREATE OR REPLACE FUNCTION dispatch_bindingedge_no_cycle()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_path uuid[];
    v_names text;
BEGIN
    LOCK TABLE dispatch_bindingedge IN SHARE ROW EXCLUSIVE MODE;
    WITH RECURSIVE walk(node, path) AS (
        SELECT NEW.downstream_id, ARRAY[NEW.upstream_id, NEW.downstream_id]
        UNION ALL
        SELECT x.downstream_id, w.path || x.downstream_id
          FROM walk w JOIN dispatch_bindingedge x ON x.upstream_id = w.node
         WHERE x.id IS DISTINCT FROM NEW.id
           AND w.node <> NEW.upstream_id
           AND NOT x.downstream_id = ANY (w.path[2:])
    )
    SELECT w.path INTO v_path FROM walk w WHERE w.node = NEW.upstream_id LIMIT 1;
    IF v_path IS NOT NULL THEN
        SELECT string_agg(coalesce(b.name, p.id::text), ' -> ' ORDER BY p.o) INTO v_names
          FROM unnest(v_path) WITH ORDINALITY AS p(id, o)
          LEFT JOIN dispatch_jobbinding b ON b.id = p.id;
        RAISE EXCEPTION 'binding edges would form a cycle: %', v_names
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS dispatch_bindingedge_no_cycle ON dispatch_bindingedge;
CREATE TRIGGER dispatch_bindingedge_no_cycle
    BEFORE INSERT OR UPDATE OF upstream_id, downstream_id ON dispatch_bindingedge
    FOR EACH ROW EXECUTE FUNCTION dispatch_bindingedge_no_cycle();

-- sql/functions/recover.sql

-- Recovery: RUNNING attempts whose lease ran out, settled as expired.

-- One recovery pass, each row isolated: settle up to p_limit RUNNING attempts whose lease
-- has expired, each in its own subtransaction (a BEGIN ... EXCEPTION block). A row whose
-- settlement raises is rolled back alone, left RUNNING, and returned with outcome NULL and
-- the error text, so the pass reports it, skips it and settles the rest. Attempts in
-- p_skip are not picked (the caller passes those that already failed in this round, so a
-- failing row cannot fill every batch).
-- Locks run + attempt FOR UPDATE SKIP LOCKED (a pass never waits for another pass, a
-- completion or an operator); dispatch_settle_v3 re-checks status, token and expiry in
-- the statement that changes the row.
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
            outcome := dispatch_settle_v3(c.id, c.lease_token, 'EXPIRED', 'LEASE_EXPIRED',
                                          NULL, NULL, NULL, NULL, NULL, NULL);
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

-- sql/functions/heartbeat.sql

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

-- sql/functions/queue.sql

-- The worker's look at the queue, read by every heartbeat in the heartbeat's own
-- transaction.
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

-- sql/functions/trigger.sql

-- The trigger: runs and their attempt 1 (PENDING, due now), in two ways.
--
--   * dispatch_trigger_v4 (a function), inside the caller's transaction.
--     - The caller proposes each run's id. A run is created when its id comes back;
--       a call repeated with the same ids creates nothing again (an id already taken
--       conflicts like a key), so a caller that lost the answer can ask again. An
--       element whose idempotency key or schedule slot already has a run returns that
--       run with created = false and creates nothing (a concurrent trigger of the same
--       key waits for the other to commit, then finds its run).
--     - Runs are inserted in one stable order (idempotency key, schedule, slot) and
--       returned in the order given: two calls whose keys overlap cannot each hold the
--       unique-index entry the other waits for (a deadlock); the second waits for the
--       first and then finds its runs.
--     Each run's created_at increases in the order given: the statement's time less one
--     microsecond per run still to come. The attempt's blocked_reason comes from the
--     insert trigger (triggers.sql). The wake-up is not sent here: a NOTIFY in this
--     transaction could fail its commit.
--
--   * dispatch_trigger_notify_v4 (a procedure, called outside any transaction): the
--     trigger, COMMIT, then the wake-ups in a transaction of their own, in one round
--     trip. The wake-up cannot fail or undo the trigger: the runs are committed (and
--     durable) before the first pg_notify, and a full notification queue fails only
--     the second transaction, whose commit is where PostgreSQL reports it. The caller
--     then asks dispatch_trigger_v4 again with the same ids for its answer (nothing is
--     created twice) and leaves the wake-ups to polling. synchronous_commit is off for
--     the wake-ups' transaction only: they write no data.
--
-- Locks: inserting a run takes FOR KEY SHARE on its binding (the foreign key) and the
-- unique-index entries of its id, key and slot, in the order above.

CREATE OR REPLACE FUNCTION dispatch_trigger_v4(
    p_ids uuid[], p_bindings uuid[], p_trigger text, p_requested_by text,
    p_keys text[] DEFAULT NULL, p_schedules uuid[] DEFAULT NULL,
    p_slots timestamptz[] DEFAULT NULL
) RETURNS TABLE (run_id uuid, binding_id uuid, status text, created_at timestamptz,
                 created boolean)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    n integer := coalesce(cardinality(p_bindings), 0);
    i integer;
    v_id uuid;
    v_key text;
    v_schedule uuid;
    v_slot timestamptz;
    v_at timestamptz;
    v_now timestamptz := clock_timestamp();
    v_missing uuid;
    v_ids uuid[] := array_fill(NULL::uuid, ARRAY[greatest(n, 1)]);
    v_created boolean[] := array_fill(false, ARRAY[greatest(n, 1)]);
BEGIN
    IF coalesce(cardinality(p_ids), 0) <> n THEN
        RAISE EXCEPTION 'dispatch_trigger_v4: % ids for % bindings',
            coalesce(cardinality(p_ids), 0), n USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT x.b INTO v_missing FROM unnest(p_bindings) AS x(b)
     WHERE NOT EXISTS (SELECT 1 FROM dispatch_jobbinding j WHERE j.id = x.b) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'no binding %', v_missing USING ERRCODE = 'foreign_key_violation';
    END IF;
    FOR i IN
        SELECT o.i FROM generate_series(1, n) AS o(i)
         ORDER BY p_keys[o.i] NULLS LAST, p_schedules[o.i] NULLS LAST,
                  p_slots[o.i] NULLS LAST, p_ids[o.i]
    LOOP
        v_key := p_keys[i];
        v_schedule := p_schedules[i];
        v_slot := p_slots[i];
        v_at := v_now - make_interval(secs => (n - i) / 1e6);
        INSERT INTO dispatch_run (id, binding_id, trigger, status, created_at,
                                  idempotency_key, requested_by, schedule_id, scheduled_for)
        VALUES (p_ids[i], p_bindings[i], p_trigger, 'PENDING', v_at,
                v_key, coalesce(p_requested_by, ''), v_schedule, v_slot)
        ON CONFLICT DO NOTHING
        RETURNING id INTO v_id;
        IF v_id IS NOT NULL THEN
            INSERT INTO dispatch_attempt (id, run_id, number, origin, status, created_at,
                                          available_at, error, rows_read, rows_written)
            VALUES (gen_random_uuid(), v_id, 1, 'TRIGGER', 'PENDING', v_at, v_at,
                    '', 0, 0);
            v_created[i] := true;
        ELSE
            SELECT r.id INTO v_id FROM dispatch_run r WHERE r.id = p_ids[i];
            IF v_id IS NULL THEN
                SELECT r.id INTO v_id FROM dispatch_run r
                 WHERE (v_key IS NOT NULL AND r.idempotency_key = v_key)
                    OR (v_schedule IS NOT NULL AND r.schedule_id = v_schedule
                        AND r.scheduled_for IS NOT DISTINCT FROM v_slot);
            END IF;
        END IF;
        v_ids[i] := v_id;
        v_id := NULL;
    END LOOP;
    RETURN QUERY
        SELECT r.id, r.binding_id, r.status::text, r.created_at, x.c
          FROM unnest(v_ids[1:n], v_created[1:n]) WITH ORDINALITY AS x(id, c, o)
          JOIN dispatch_run r ON r.id = x.id
         ORDER BY x.o;
END
$$;

CREATE OR REPLACE PROCEDURE dispatch_trigger_notify_v4(
    p_channel text, p_ids uuid[], p_bindings uuid[], p_trigger text, p_requested_by text,
    p_keys text[], p_schedules uuid[], p_slots timestamptz[],
    INOUT o_ids uuid[] DEFAULT NULL, INOUT o_bindings uuid[] DEFAULT NULL,
    INOUT o_status text[] DEFAULT NULL, INOUT o_created_at timestamptz[] DEFAULT NULL,
    INOUT o_created boolean[] DEFAULT NULL
)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT array_agg(t.run_id ORDER BY t.o), array_agg(t.binding_id ORDER BY t.o),
           array_agg(t.status ORDER BY t.o), array_agg(t.created_at ORDER BY t.o),
           array_agg(t.created ORDER BY t.o)
      INTO o_ids, o_bindings, o_status, o_created_at, o_created
      FROM dispatch_trigger_v4(p_ids, p_bindings, p_trigger, p_requested_by,
                               p_keys, p_schedules, p_slots)
           WITH ORDINALITY AS t(run_id, binding_id, status, created_at, created, o);
    COMMIT;
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_notify(p_channel, x.id::text)
       FROM unnest(o_ids, o_created) AS x(id, c) WHERE x.c;
END
$$;

-- sql/functions/triggers.sql

-- The table triggers: those that keep the marks on queued attempts (marks.sql,
-- capacity.sql), and the one that times a binding's new alert recipients, whatever wrote
-- the change: the admin, a bulk update, a SQL client. Each trigger has the name of its
-- function.

-- A new attempt gets its run's binding (a run never changes binding) and, if PENDING,
-- the mark of what blocks it: something disabled, or the binding's capacity.
--
-- The binding is read from the run, so the run must be there when the attempt is
-- inserted. The parts of one statement with a data-modifying WITH run in an order
-- PostgreSQL does not promise (a part whose rows nothing reads runs after the main
-- statement): an attempt inserted that way before its run, as a bulk import might write
-- it, would get no binding, be marked BINDING_AT_CAPACITY (its room is NULL) and stay
-- PENDING forever, since no claim takes and no release clears an attempt of no binding.
-- So that insert fails, with SQLSTATE 23503 (foreign_key_violation: the run it
-- references is not there for it), naming the run.
CREATE OR REPLACE FUNCTION dispatch_attempt_before_insert()
RETURNS trigger LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    v_state record;
BEGIN
    IF NEW.binding_id IS NULL THEN
        NEW.binding_id := (SELECT r.binding_id FROM dispatch_run r WHERE r.id = NEW.run_id);
    END IF;
    IF NEW.binding_id IS NULL THEN
        RAISE EXCEPTION 'cannot resolve the binding of run % for a new attempt: the run is not there when the attempt is inserted',
            NEW.run_id
            USING ERRCODE = 'foreign_key_violation',
                  HINT = 'Insert the run in an earlier statement than its attempts: the parts of one statement with a data-modifying WITH run in no promised order.';
    END IF;
    IF NEW.status = 'PENDING' AND NEW.blocked_reason IS NULL THEN
        v_state := dispatch_binding_state(NEW.binding_id);
        NEW.blocked_reason := v_state.disabled;
        IF NEW.blocked_reason IS NULL AND coalesce(v_state.room, 0) < 1 THEN
            NEW.blocked_reason := 'BINDING_AT_CAPACITY';
        END IF;
    END IF;
    RETURN NEW;
END
$$;

-- A run that leaves RUNNING makes room on its binding.
CREATE OR REPLACE FUNCTION dispatch_run_left_running()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_release_capacity(NEW.binding_id);
    RETURN NULL;
END
$$;

-- A job enabled or disabled: its bindings re-marked, in ascending id.
CREATE OR REPLACE FUNCTION dispatch_job_enabled_changed()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    b uuid;
BEGIN
    FOR b IN SELECT x.id FROM dispatch_jobbinding x WHERE x.job_id = NEW.id ORDER BY x.id LOOP
        PERFORM dispatch_mark_binding(b);
    END LOOP;
    RETURN NULL;
END
$$;

-- A binding enabled or disabled, moved to another job or datasource, or given another
-- max_concurrency: re-marked.
CREATE OR REPLACE FUNCTION dispatch_binding_changed()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM dispatch_mark_binding(NEW.id);
    RETURN NULL;
END
$$;

-- A datasource enabled or disabled: the bindings that read or write it re-marked, in
-- ascending id.
CREATE OR REPLACE FUNCTION dispatch_datasource_enabled_changed()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    b uuid;
BEGIN
    FOR b IN SELECT x.id FROM dispatch_jobbinding x WHERE x.source_id = NEW.id
             UNION
             SELECT x.id FROM dispatch_jobbinding x WHERE x.sink_id = NEW.id
             ORDER BY 1 LOOP
        PERFORM dispatch_mark_binding(b);
    END LOOP;
    RETURN NULL;
END
$$;

-- A binding's alert settings gained a recipient (an address not there before, compared
-- without case or blanks, or another named webhook): alert_settings_changed_at moves to
-- now, whatever wrote the change. The health scan sends alerts of events before that time
-- to the site's ADMINS and default webhook only (dispatch.ops.alerts), so an address
-- added today is never told about yesterday's failures. A recipient removed, or a move to
-- the site's default webhook (''), adds no one and leaves the time.
CREATE OR REPLACE FUNCTION dispatch_alert_recipients_changed()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.alert_webhook <> '' AND NEW.alert_webhook IS DISTINCT FROM OLD.alert_webhook)
       OR EXISTS (
           SELECT 1
           FROM unnest(string_to_array(NEW.alert_emails, ',')) AS n(address)
           WHERE btrim(n.address) <> ''
             AND lower(btrim(n.address)) NOT IN (
                 SELECT lower(btrim(o.address))
                 FROM unnest(string_to_array(OLD.alert_emails, ',')) AS o(address)))
    THEN
        NEW.alert_settings_changed_at := now();
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS dispatch_attempt_before_insert ON dispatch_attempt;
CREATE TRIGGER dispatch_attempt_before_insert BEFORE INSERT ON dispatch_attempt
    FOR EACH ROW EXECUTE FUNCTION dispatch_attempt_before_insert();

DROP TRIGGER IF EXISTS dispatch_run_left_running ON dispatch_run;
CREATE TRIGGER dispatch_run_left_running AFTER UPDATE OF status ON dispatch_run
    FOR EACH ROW WHEN (OLD.status = 'RUNNING' AND NEW.status <> 'RUNNING')
    EXECUTE FUNCTION dispatch_run_left_running();

DROP TRIGGER IF EXISTS dispatch_job_enabled_changed ON dispatch_job;
CREATE TRIGGER dispatch_job_enabled_changed AFTER UPDATE OF enabled ON dispatch_job
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION dispatch_job_enabled_changed();

DROP TRIGGER IF EXISTS dispatch_binding_changed ON dispatch_jobbinding;
CREATE TRIGGER dispatch_binding_changed
    AFTER UPDATE OF enabled, job_id, source_id, sink_id, max_concurrency ON dispatch_jobbinding
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled
                       OR OLD.job_id IS DISTINCT FROM NEW.job_id
                       OR OLD.source_id IS DISTINCT FROM NEW.source_id
                       OR OLD.sink_id IS DISTINCT FROM NEW.sink_id
                       OR OLD.max_concurrency IS DISTINCT FROM NEW.max_concurrency)
    EXECUTE FUNCTION dispatch_binding_changed();

DROP TRIGGER IF EXISTS dispatch_datasource_enabled_changed ON dispatch_datasource;
CREATE TRIGGER dispatch_datasource_enabled_changed AFTER UPDATE OF enabled ON dispatch_datasource
    FOR EACH ROW WHEN (OLD.enabled IS DISTINCT FROM NEW.enabled)
    EXECUTE FUNCTION dispatch_datasource_enabled_changed();

DROP TRIGGER IF EXISTS dispatch_alert_recipients_changed ON dispatch_bindinghealth;
CREATE TRIGGER dispatch_alert_recipients_changed
    BEFORE UPDATE OF alert_emails, alert_webhook ON dispatch_bindinghealth
    FOR EACH ROW WHEN (OLD.alert_emails IS DISTINCT FROM NEW.alert_emails
                       OR OLD.alert_webhook IS DISTINCT FROM NEW.alert_webhook)
    EXECUTE FUNCTION dispatch_alert_recipients_changed();
