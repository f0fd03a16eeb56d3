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
