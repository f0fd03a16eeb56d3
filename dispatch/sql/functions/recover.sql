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
