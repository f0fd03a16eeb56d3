-- Named statements of the schedule reconciler. Each is fetched by name with
-- scheduling.sqlfiles.query(); parameters are %(name)s placeholders. Every time comes from
-- PostgreSQL's clock: now() is the start of the (short) transaction that runs them.

-- name: due_schedule
-- The oldest due schedule nobody else is firing, with its binding's and job's enabled
-- flags. One transaction per schedule: the row lock (FOR UPDATE OF s) is held until the
-- run for the slot is inserted and next_fire_at advanced, so two reconcilers never fire
-- the same schedule at once; SKIP LOCKED lets them work on different schedules instead of
-- queueing behind each other. A reconciler that reads the row after another committed
-- re-checks `next_fire_at <= now()` on the new row version (READ COMMITTED re-evaluates
-- the WHERE clause of a locking read) and so skips an already advanced schedule. The
-- binding and job rows are read, not locked: disabling one concurrently only means the
-- run waits with a blocked_reason, as for any trigger. `exclude` holds schedules that
-- failed earlier in this pass. Uses scheduling_schedule_due_idx.
SELECT s.id, s.binding_id, s.cron, s.timezone, s.misfire_policy, s.overlap_policy,
       s.next_fire_at, now() AS db_now, b.enabled AS binding_enabled, j.enabled AS job_enabled
  FROM scheduling_schedule s
  JOIN dispatch_jobbinding b ON b.id = s.binding_id
  JOIN dispatch_job j ON j.id = b.job_id
 WHERE s.enabled
   AND s.next_fire_at <= now()
   AND NOT (s.id = ANY (%(exclude)s::uuid[]))
 ORDER BY s.next_fire_at, s.id
 LIMIT 1
   FOR UPDATE OF s SKIP LOCKED;

-- name: record_fire
-- Guarded by the slot the decision was made for: zero rows means the row changed under
-- us (it cannot while we hold its lock; the caller treats it as a bug, not a retry).
UPDATE scheduling_schedule
   SET next_fire_at = %(next_fire_at)s, last_fired_at = now(), last_run_id = %(run)s
 WHERE id = %(id)s AND next_fire_at = %(expected)s;

-- name: record_skip
UPDATE scheduling_schedule
   SET next_fire_at = %(next_fire_at)s, skip_count = skip_count + 1,
       last_skip_reason = %(reason)s, last_skip_at = now()
 WHERE id = %(id)s AND next_fire_at = %(expected)s;

-- name: advance
UPDATE scheduling_schedule
   SET next_fire_at = %(next_fire_at)s
 WHERE id = %(id)s AND next_fire_at = %(expected)s;

-- name: unregistered
-- Enabled schedules without a next_fire_at (new, re-enabled, cron or timezone changed,
-- or written by SQL), locked so that two registrations never compute the same row twice;
-- SKIP LOCKED: a row another reconciler (or a save) holds is theirs to register.
SELECT id, cron, timezone, now() AS db_now
  FROM scheduling_schedule
 WHERE enabled AND next_fire_at IS NULL
 ORDER BY id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: register
-- Never moves an existing value: only a NULL next_fire_at is set.
UPDATE scheduling_schedule
   SET next_fire_at = %(next_fire_at)s
 WHERE id = %(id)s AND enabled AND next_fire_at IS NULL;

-- name: unregister_disabled
-- Disabled schedules keep no next_fire_at (one disabled by a bulk UPDATE, say), so that
-- enabling one again registers it from now instead of catching up from the past.
UPDATE scheduling_schedule
   SET next_fire_at = NULL
 WHERE NOT enabled AND next_fire_at IS NOT NULL;

-- name: next_due_in
-- Seconds until the earliest next_fire_at, as a database-time duration (the loop keeps it
-- on its own monotonic clock; it never compares its clock with a timestamp). NULL when no
-- schedule is registered; negative when one is already due. Uses
-- scheduling_schedule_due_idx.
SELECT EXTRACT(EPOCH FROM (min(next_fire_at) - clock_timestamp()))::float8
  FROM scheduling_schedule
 WHERE enabled AND next_fire_at IS NOT NULL;

-- name: notify_in_transaction
-- The schedule wake-up when the caller is inside a transaction (scheduling.wakeup):
-- PostgreSQL queues it in that transaction and delivers it at its commit, never on a
-- rollback. No set_config('synchronous_commit', ...) here, unlike dispatch's `notify`:
-- inside the caller's transaction it would weaken that transaction's own commit.
SELECT pg_notify(%(channel)s, %(payload)s);

-- name: survey
-- A pass's first statement: upsert the one heartbeat row (database time; greatest() never
-- moves it back) and say whether anything needs (un)registering and the seconds until the
-- earliest next_fire_at (negative: due; NULL: none), so an idle pass is this alone.
WITH beat AS (
    INSERT INTO scheduling_reconcilerbeat AS b (id, beat_at, reconciler)
    VALUES (1, now(), %(reconciler)s)
    ON CONFLICT (id) DO UPDATE
       SET beat_at = greatest(b.beat_at, excluded.beat_at), reconciler = excluded.reconciler
    RETURNING b.beat_at
)
SELECT (SELECT beat_at FROM beat),
       EXISTS (SELECT 1 FROM scheduling_schedule WHERE enabled AND next_fire_at IS NULL)
         OR EXISTS (SELECT 1 FROM scheduling_schedule
                     WHERE NOT enabled AND next_fire_at IS NOT NULL),
       (SELECT EXTRACT(EPOCH FROM (min(next_fire_at) - clock_timestamp()))::float8
          FROM scheduling_schedule
         WHERE enabled AND next_fire_at IS NOT NULL);

-- name: stalled
-- Are schedules overdue with no reconciler running? Enabled schedules whose next_fire_at
-- is more than %(after)s seconds in the past (counted up to 1000: a dead fleet may leave
-- many), the oldest of them, and the last reconciler beat, with the database's now().
-- Read by the system check scheduling.W001 and the console; uses
-- scheduling_schedule_due_idx and the beat's primary key.
SELECT (SELECT count(*)
          FROM (SELECT 1 FROM scheduling_schedule
                 WHERE enabled AND next_fire_at < now() - make_interval(secs => %(after)s)
                 LIMIT 1000) AS overdue),
       (SELECT min(next_fire_at) FROM scheduling_schedule
         WHERE enabled AND next_fire_at IS NOT NULL),
       (SELECT beat_at FROM scheduling_reconcilerbeat WHERE id = 1),
       now();
