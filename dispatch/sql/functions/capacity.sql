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
