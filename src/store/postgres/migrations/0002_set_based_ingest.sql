-- Usage ingest, set-based when it can be.
--
-- 0001's ingest_usage judged every event in its own statements (3 to 5 per
-- event), which held one connection to about 8,000 events a second. Nearly
-- every batch a healthy writer sends is all new, valid and within its
-- leases, and such a batch is now recorded in a handful of statements: the
-- events in one INSERT, each lease's usage and each account's overage debt
-- in one UPDATE apiece. Any batch with a duplicate, a rejection or an
-- overflow in it goes through the same per-event loop as before, so the
-- answers are exactly the memory store's either way.
--
-- With the batch's lease and account rows locked, an all-accepted batch
-- passes the per-event checks in order exactly when it passes them in
-- total: units are never negative, so each lease's (and each account's)
-- running total only grows and its last value is its largest.

CREATE OR REPLACE FUNCTION {schema}.ingest_usage(
    p_request_ids    uuid[],
    p_account_ids    bigint[],
    p_lease_ids      bigint[],
    p_fencing_tokens bigint[],
    p_units          bigint[],
    p_ats            timestamptz[],
    p_revisions      bigint[],
    p_key_ids        bigint[]
) RETURNS TABLE (ord int, outcome text)
LANGUAGE plpgsql
AS $fn$
DECLARE
    n     int := coalesce(array_length(p_request_ids, 1), 0);
    i     int;
    seen  {schema}.usage_events%ROWTYPE;
    lease {schema}.leases%ROWTYPE;
    debt  bigint;
    inserted_ids uuid[];
BEGIN
    -- The store's lock order: leases by id, then accounts by id. No call
    -- locks a lease while holding an account, so batches cannot deadlock
    -- with each other or with the allocator.
    PERFORM 1 FROM {schema}.leases l
        WHERE l.id = ANY (p_lease_ids)
        ORDER BY l.id
        FOR NO KEY UPDATE;
    PERFORM 1 FROM {schema}.accounts a
        WHERE a.id IN (
            SELECT e.account_id
            FROM unnest(p_account_ids, p_lease_ids) AS e (account_id, lease_id)
            WHERE e.lease_id IS NULL)
        ORDER BY a.id
        FOR NO KEY UPDATE;

    -- The fast path: every event new, well-formed and within its lease or
    -- its account's debt limit.
    IF n > 0
        AND (SELECT count(DISTINCT r) FROM unnest(p_request_ids) r) = n
        AND NOT EXISTS (
            SELECT 1 FROM {schema}.usage_events e WHERE e.request_id = ANY (p_request_ids))
        AND NOT EXISTS (
            SELECT 1
            FROM unnest(p_account_ids, p_lease_ids, p_fencing_tokens, p_units)
                AS b (account_id, lease_id, fencing_token, units)
            LEFT JOIN {schema}.accounts a ON a.id = b.account_id
            LEFT JOIN {schema}.leases l ON l.id = b.lease_id
            WHERE b.units < 0
                OR a.id IS NULL
                OR (b.lease_id IS NOT NULL AND (l.id IS NULL
                    OR l.account_id <> b.account_id
                    OR l.fencing_token <> b.fencing_token)))
        AND NOT EXISTS (
            SELECT 1
            FROM (SELECT b.lease_id, sum(b.units::numeric) AS total
                  FROM unnest(p_lease_ids, p_units) AS b (lease_id, units)
                  WHERE b.lease_id IS NOT NULL
                  GROUP BY b.lease_id) t
            JOIN {schema}.leases l ON l.id = t.lease_id
            -- I15, as the loop checks it event by event.
            WHERE l.used::numeric + t.total + coalesce(l.credited, 0) > l.granted)
        AND NOT EXISTS (
            SELECT 1
            FROM (SELECT b.account_id, sum(b.units::numeric) AS total
                  FROM unnest(p_account_ids, p_lease_ids, p_units)
                      AS b (account_id, lease_id, units)
                  WHERE b.lease_id IS NULL
                  GROUP BY b.account_id) t
            JOIN {schema}.accounts a ON a.id = t.account_id
            WHERE a.overage_debt::numeric + t.total > 9223372036854775807)
    THEN
        -- A request id another transaction recorded since the check (one
        -- naming other rows than ours, so not serialized by our locks)
        -- sends the batch to the loop, after taking back what was inserted.
        WITH inserted AS (
            INSERT INTO {schema}.usage_events
                (request_id, account_id, lease_id, fencing_token, units, occurred_at,
                 policy_revision, key_id)
            SELECT * FROM unnest(p_request_ids, p_account_ids, p_lease_ids,
                p_fencing_tokens, p_units, p_ats, p_revisions, p_key_ids)
            ON CONFLICT (request_id) DO NOTHING
            RETURNING request_id)
        SELECT array_agg(request_id) INTO inserted_ids FROM inserted;
        IF coalesce(array_length(inserted_ids, 1), 0) = n THEN
            UPDATE {schema}.leases l SET used = l.used + t.total
                FROM (SELECT b.lease_id, sum(b.units) AS total
                      FROM unnest(p_lease_ids, p_units) AS b (lease_id, units)
                      WHERE b.lease_id IS NOT NULL
                      GROUP BY b.lease_id) t
                WHERE l.id = t.lease_id;
            UPDATE {schema}.accounts a SET overage_debt = a.overage_debt + t.total
                FROM (SELECT b.account_id, sum(b.units) AS total
                      FROM unnest(p_account_ids, p_lease_ids, p_units)
                          AS b (account_id, lease_id, units)
                      WHERE b.lease_id IS NULL
                      GROUP BY b.account_id) t
                WHERE a.id = t.account_id;
            RETURN QUERY SELECT (o - 1)::int, 'accepted'::text FROM generate_series(1, n) o;
            RETURN;
        END IF;
        DELETE FROM {schema}.usage_events e WHERE e.request_id = ANY (inserted_ids);
    END IF;

    FOR i IN 1 .. n LOOP
        ord := i - 1;
        SELECT * INTO seen FROM {schema}.usage_events e WHERE e.request_id = p_request_ids[i];
        IF FOUND THEN
            -- I8: the request id is the idempotency key.
            outcome := CASE WHEN seen.account_id = p_account_ids[i]
                    AND seen.lease_id IS NOT DISTINCT FROM p_lease_ids[i]
                    AND seen.fencing_token IS NOT DISTINCT FROM p_fencing_tokens[i]
                    AND seen.units = p_units[i]
                    AND seen.occurred_at = p_ats[i]
                    AND seen.policy_revision = p_revisions[i]
                    AND seen.key_id IS NOT DISTINCT FROM p_key_ids[i]
                THEN 'duplicate' ELSE 'conflicting_duplicate' END;
            RETURN NEXT;
            CONTINUE;
        END IF;

        IF p_units[i] < 0 THEN
            outcome := 'malformed';
        ELSIF NOT EXISTS (SELECT 1 FROM {schema}.accounts a WHERE a.id = p_account_ids[i]) THEN
            outcome := 'unknown_account';
        ELSIF p_lease_ids[i] IS NULL THEN
            SELECT a.overage_debt INTO debt FROM {schema}.accounts a WHERE a.id = p_account_ids[i];
            outcome := CASE WHEN debt > 9223372036854775807 - p_units[i]
                THEN 'malformed' ELSE 'accepted' END;
        ELSE
            SELECT * INTO lease FROM {schema}.leases l WHERE l.id = p_lease_ids[i];
            IF NOT FOUND THEN
                outcome := 'unknown_lease';
            ELSIF lease.account_id <> p_account_ids[i] THEN
                outcome := 'account_mismatch';
            ELSIF lease.fencing_token <> p_fencing_tokens[i] THEN
                outcome := 'fencing_mismatch';
            -- I15: usage plus what settlement credited back never exceeds
            -- the grant.
            ELSIF lease.used::numeric + p_units[i] + coalesce(lease.credited, 0) > lease.granted THEN
                outcome := CASE WHEN lease.state = 'settled'
                    THEN 'lease_settled' ELSE 'exceeds_lease' END;
            ELSE
                outcome := 'accepted';
            END IF;
        END IF;

        IF outcome = 'accepted' THEN
            INSERT INTO {schema}.usage_events
                (request_id, account_id, lease_id, fencing_token, units, occurred_at,
                 policy_revision, key_id)
            VALUES
                (p_request_ids[i], p_account_ids[i], p_lease_ids[i], p_fencing_tokens[i],
                 p_units[i], p_ats[i], p_revisions[i], p_key_ids[i])
            ON CONFLICT (request_id) DO NOTHING;
            IF FOUND THEN
                IF p_lease_ids[i] IS NULL THEN
                    UPDATE {schema}.accounts a SET overage_debt = a.overage_debt + p_units[i]
                        WHERE a.id = p_account_ids[i];
                ELSE
                    UPDATE {schema}.leases l SET used = l.used + p_units[i]
                        WHERE l.id = p_lease_ids[i];
                END IF;
            ELSE
                -- A concurrent batch recorded this request id first; judge
                -- this event against what it recorded (I8).
                SELECT * INTO seen FROM {schema}.usage_events e
                    WHERE e.request_id = p_request_ids[i];
                outcome := CASE WHEN seen.account_id = p_account_ids[i]
                        AND seen.lease_id IS NOT DISTINCT FROM p_lease_ids[i]
                        AND seen.fencing_token IS NOT DISTINCT FROM p_fencing_tokens[i]
                        AND seen.units = p_units[i]
                        AND seen.occurred_at = p_ats[i]
                        AND seen.policy_revision = p_revisions[i]
                        AND seen.key_id IS NOT DISTINCT FROM p_key_ids[i]
                    THEN 'duplicate' ELSE 'conflicting_duplicate' END;
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$fn$;
