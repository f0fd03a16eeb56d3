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
