-- tollgate's PostgreSQL schema, version 1.
--
-- `{schema}` is replaced by the validated schema name before this runs, so
-- every object lives in tollgate's own schema. tollgate's migration runner
-- applies this file inside one transaction, together with its row in
-- `{schema}.schema_migrations`.
--
-- Every amount of units is a bigint (at most i64::MAX, the limit the memory
-- store keeps too). Every instant is a timestamptz, written from the
-- caller's `now` (I13), never from the server's clock.

CREATE TABLE {schema}.accounts (
    id                 bigserial   PRIMARY KEY,
    status             text        NOT NULL CHECK (status IN ('active', 'suspended')),
    balance            bigint      NOT NULL CHECK (balance >= 0),
    mode               text        NOT NULL CHECK (mode IN ('strict', 'elastic')),
    overage_cap        bigint      CHECK (overage_cap >= 0),
    refill_amount      bigint      CHECK (refill_amount >= 0),
    refill_interval_us bigint      CHECK (refill_interval_us > 0),
    period_end         timestamptz,
    overage_debt       bigint      NOT NULL DEFAULT 0 CHECK (overage_debt >= 0),
    created_at         timestamptz NOT NULL,
    CHECK ((mode = 'elastic') = (overage_cap IS NOT NULL)),
    CHECK ((refill_amount IS NULL) = (refill_interval_us IS NULL)),
    CHECK ((refill_amount IS NULL) = (period_end IS NULL))
);

CREATE SEQUENCE {schema}.fencing_tokens AS bigint;

CREATE TABLE {schema}.leases (
    id            bigserial   PRIMARY KEY,
    account_id    bigint      NOT NULL REFERENCES {schema}.accounts (id),
    fencing_token bigint      NOT NULL UNIQUE DEFAULT nextval('{schema}.fencing_tokens'),
    granted       bigint      NOT NULL CHECK (granted >= 0),
    used          bigint      NOT NULL DEFAULT 0 CHECK (used >= 0),
    granted_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    state         text        NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'settled')),
    credited      bigint      CHECK (credited >= 0),
    settled_at    timestamptz,
    CHECK ((state = 'settled') = (credited IS NOT NULL)),
    CHECK ((state = 'settled') = (settled_at IS NOT NULL))
);

-- Reclaim walks active leases by expiry (I19).
CREATE INDEX leases_due ON {schema}.leases (expires_at, id) WHERE state = 'active';
CREATE INDEX leases_by_account ON {schema}.leases (account_id);

CREATE TABLE {schema}.usage_events (
    -- The request id is the idempotency key (I8).
    request_id      uuid        PRIMARY KEY,
    -- Arrival order.
    seq             bigserial   NOT NULL UNIQUE,
    account_id      bigint      NOT NULL REFERENCES {schema}.accounts (id),
    -- NULL for overage.
    lease_id        bigint      REFERENCES {schema}.leases (id),
    fencing_token   bigint,
    units           bigint      NOT NULL CHECK (units >= 0),
    occurred_at     timestamptz NOT NULL,
    policy_revision bigint      NOT NULL CHECK (policy_revision >= 0),
    key_id          bigint      CHECK (key_id >= 0),
    CHECK ((lease_id IS NULL) = (fencing_token IS NULL))
);

CREATE INDEX usage_events_by_account ON {schema}.usage_events (account_id, seq);
CREATE INDEX usage_events_by_lease ON {schema}.usage_events (lease_id) WHERE lease_id IS NOT NULL;

-- Policy revisions of principals' snapshots. Every transaction that draws
-- from it first takes the revision advisory lock, so revisions commit in
-- number order and paging by revision never skips one.
CREATE SEQUENCE {schema}.revisions AS bigint;

CREATE TABLE {schema}.keys (
    -- I16: only the SHA-256 of a key and its visible prefix are stored.
    hash        bytea       PRIMARY KEY CHECK (octet_length(hash) = 32),
    key_id      bigserial   NOT NULL UNIQUE,
    prefix      text        NOT NULL,
    account_id  bigint      NOT NULL REFERENCES {schema}.accounts (id),
    -- The 64 permission bits, reinterpreted as a signed integer.
    permissions bigint      NOT NULL,
    status      text        NOT NULL CHECK (status IN ('active', 'revoked')),
    created_at  timestamptz NOT NULL,
    revoked_at  timestamptz,
    revision    bigint      NOT NULL UNIQUE,
    CHECK ((status = 'revoked') = (revoked_at IS NOT NULL))
);

CREATE INDEX keys_by_account ON {schema}.keys (account_id, key_id);

-- Every movement of an account's balance, written in the transaction that
-- makes it: the balance is always the sum of its account's deltas.
CREATE TABLE {schema}.journal (
    seq             bigserial   PRIMARY KEY,
    account_id      bigint      NOT NULL REFERENCES {schema}.accounts (id),
    kind            text        NOT NULL CHECK (kind IN (
                        'open', 'grant', 'release', 'consolidation', 'reclaim',
                        'top_up', 'refill', 'adjustment')),
    delta           bigint      NOT NULL,
    balance_after   bigint      NOT NULL CHECK (balance_after >= 0),
    lease_id        bigint      REFERENCES {schema}.leases (id),
    occurred_at     timestamptz NOT NULL,
    reason          text,
    idempotency_key text
);

CREATE UNIQUE INDEX journal_idempotency ON {schema}.journal (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX journal_by_account ON {schema}.journal (account_id, seq);

-- Records a batch of usage events in one statement and answers, per event
-- and in order (`ord` counts from 0), what became of it. The semantics are
-- the memory store's `Ledger::ingest`, event by event. The caller marks an
-- event whose units (or key id, or policy revision) PostgreSQL cannot hold
-- with negative units; it is malformed unless its request id was seen.
CREATE FUNCTION {schema}.ingest_usage(
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
