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
