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
