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
