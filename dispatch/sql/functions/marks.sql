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
