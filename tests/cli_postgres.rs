//! The `tollgate` operator command against a real `PostgreSQL` server: every
//! command, its output and exit status, bad input, idempotent top-ups, the
//! layered configuration, and an audit that catches a tampered ledger.
#![cfg(feature = "cli")]

mod support;

use std::path::Path;
use std::process::{Command, Output};

use jiff::{SignedDuration, Timestamp};
use support::postgres::{database_url, unique_schema};
use tollgate::store::{
    GrantPolicy, IngestOutcome, LeaseAllocator, Movement, PostgresConfig, PostgresStore,
    TailSharing, UsageSink,
};
use tollgate::{AccountId, CostUnits, PolicyRevision, RequestId, UsageEvent, UsageSource};

/// One schema on the test server and the command pointed at it.
struct Cli {
    url: String,
    schema: String,
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    #[track_caller]
    fn ok(self) -> String {
        assert_eq!(
            self.code, 0,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        self.stdout
    }

    #[track_caller]
    fn fails(self, code: i32, says: &str) -> Self {
        assert_eq!(
            self.code, code,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        assert!(
            self.stderr.contains(says) || self.stdout.contains(says),
            "expected {says:?} in\nstdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        self
    }
}

impl Cli {
    /// A Strict account created with `balance` units, by the command.
    fn strict_account(&self, balance: &str) -> AccountId {
        account_of(
            &self
                .run(&[
                    "account",
                    "create",
                    "--balance",
                    balance,
                    "--mode",
                    "strict",
                ])
                .ok(),
        )
    }

    fn new(test: &str) -> Option<Self> {
        let url = database_url(test)?;
        Some(Self {
            url,
            schema: unique_schema(test),
        })
    }

    fn bare() -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_tollgate"));
        // Only what each test states reaches the command.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy().into_owned();
            if name == "DATABASE_URL" || name.starts_with("TOLLGATE_") {
                command.env_remove(name);
            }
        }
        command.current_dir(std::env::temp_dir());
        command
    }

    fn run(&self, args: &[&str]) -> Run {
        let mut command = Self::bare();
        command
            .arg("--database-url")
            .arg(&self.url)
            .arg("--schema")
            .arg(&self.schema)
            .args(args);
        finish(&command.output().expect("the tollgate binary runs"))
    }

    async fn store(&self) -> PostgresStore {
        PostgresStore::connect(
            &self.url,
            PostgresConfig {
                schema: self.schema.clone(),
                policy: GrantPolicy {
                    max_ttl: SignedDuration::from_secs(60),
                    reclaim_grace: SignedDuration::from_secs(10),
                    tail: TailSharing {
                        instances: 1,
                        min_grant: CostUnits(1),
                    },
                },
                lock_timeout: std::time::Duration::from_secs(5),
                queue_timeout: std::time::Duration::from_secs(5),
            },
        )
        .await
        .unwrap()
    }
}

fn finish(output: &Output) -> Run {
    Run {
        code: output.status.code().expect("the command exited"),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn account_of(line: &str) -> AccountId {
    AccountId(
        line.trim()
            .strip_prefix("acct_")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("an account id, not {line:?}")),
    )
}

#[test]
fn migrate_applies_once_and_check_schema_says_where_the_schema_stands() {
    let Some(cli) = Cli::new("cli_migrate") else {
        return;
    };
    cli.run(&["check-schema"])
        .fails(3, "run `tollgate migrate`");
    // Nothing else runs on a schema this build does not know.
    cli.run(&["account", "list"])
        .fails(1, "has no tollgate tables: run `tollgate migrate`");
    cli.run(&[
        "balance",
        "top-up",
        "acct_1",
        "5",
        "--idempotency-key",
        "k",
        "--reason",
        "r",
    ])
    .fails(1, "has no tollgate tables: run `tollgate migrate`");
    assert!(cli.run(&["migrate"]).ok().contains("applied migration 1"));
    assert!(cli.run(&["migrate"]).ok().contains("is current"));
    assert!(cli.run(&["check-schema"]).ok().contains("is current"));
    let bad = Cli::bare()
        .args([
            "--database-url",
            &cli.url,
            "--schema",
            "Bad-Name",
            "migrate",
        ])
        .output()
        .unwrap();
    finish(&bad).fails(1, "schema");
}

#[test]
fn accounts_are_created_shown_listed_suspended_resumed_and_remoded() {
    let Some(cli) = Cli::new("cli_accounts") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let strict = cli.strict_account("100");
    let elastic = account_of(
        &cli.run(&[
            "account",
            "create",
            "--balance",
            "5",
            "--mode",
            "elastic",
            "--overage-cap",
            "20",
        ])
        .ok(),
    );
    cli.run(&["account", "create", "--balance", "5", "--mode", "elastic"])
        .fails(1, "--overage-cap");
    cli.run(&[
        "account",
        "create",
        "--balance",
        "5",
        "--mode",
        "strict",
        "--overage-cap",
        "3",
    ])
    .fails(1, "only to --mode elastic");
    cli.run(&["account", "create", "--balance", "-5", "--mode", "strict"])
        .fails(2, "unexpected argument '-5'");

    let shown = cli.run(&["account", "show", &strict.to_string()]).ok();
    assert!(
        shown.contains("status=active balance=100 leased=0 mode=strict"),
        "{shown}"
    );
    let listed = cli.run(&["account", "list"]).ok();
    assert_eq!(listed.lines().count(), 2, "{listed}");
    assert!(listed.contains("mode=elastic overage_cap=20"), "{listed}");

    cli.run(&["account", "suspend", &strict.get().to_string()])
        .ok();
    assert!(
        cli.run(&["account", "show", &strict.to_string()])
            .ok()
            .contains("status=suspended")
    );
    cli.run(&["account", "resume", &strict.to_string()]).ok();
    assert!(
        cli.run(&["account", "show", &strict.to_string()])
            .ok()
            .contains("status=active")
    );
    cli.run(&[
        "account",
        "set-mode",
        &elastic.to_string(),
        "--mode",
        "strict",
    ])
    .ok();
    assert!(
        cli.run(&["account", "show", &elastic.to_string()])
            .ok()
            .contains("mode=strict")
    );

    cli.run(&["account", "show", "acct_999"])
        .fails(1, "unknown account acct_999");
    cli.run(&["account", "show", "acct_x"])
        .fails(2, "expected acct_N");
    cli.run(&["account", "show", "0"])
        .fails(2, "positive integer");
}

/// A movement the store could not answer may or may not have applied: the
/// command says so, and how to make sure it applies once. Here the
/// account's row is held by another session past the lock timeout, and
/// the same command run again once it is free applies the top-up once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_movement_cut_off_by_a_lock_says_how_to_apply_it_once() {
    let Some(cli) = Cli::new("cli_locked") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let account = cli.strict_account("100");
    let id = account.to_string();
    let store = cli.store().await;
    let mut holder = store.pool().begin().await.unwrap();
    sqlx::query(&format!(
        "SELECT 1 FROM {}.accounts WHERE id = $1 FOR UPDATE",
        cli.schema
    ))
    .bind(i64::try_from(account.get()).unwrap())
    .execute(&mut *holder)
    .await
    .unwrap();
    let top_up = [
        "balance",
        "top-up",
        &id,
        "5",
        "--idempotency-key",
        "k1",
        "--reason",
        "r",
    ];
    cli.run(&top_up).fails(
        1,
        "run the same command again, with the same --idempotency-key",
    );
    holder.rollback().await.unwrap();
    cli.run(&top_up).ok();
    cli.run(&top_up).ok();
    assert!(
        cli.run(&["account", "show", &id])
            .ok()
            .contains("balance=105 ")
    );
}

#[test]
fn top_ups_apply_once_per_idempotency_key_and_adjustments_never_go_below_zero() {
    let Some(cli) = Cli::new("cli_balance") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let account = cli.strict_account("100");
    let id = account.to_string();
    let top_up = |units: &str, key: &str| {
        cli.run(&[
            "balance",
            "top-up",
            &id,
            units,
            "--idempotency-key",
            key,
            "--reason",
            "invoice 7",
        ])
    };
    assert!(top_up("50", "inv-7").ok().contains("balance=150"));
    let again = top_up("50", "inv-7").ok();
    assert!(
        again.contains("balance=150") && again.contains("already applied"),
        "{again}"
    );
    top_up("60", "inv-7").fails(1, "idempotency key");
    top_up("5", "").fails(1, "idempotency");
    assert!(
        cli.run(&["account", "show", &id])
            .ok()
            .contains("balance=150"),
        "applied once"
    );

    let adjust = |delta: &str, key: &str| {
        cli.run(&[
            "balance",
            "adjust",
            &id,
            delta,
            "--idempotency-key",
            key,
            "--reason",
            "goodwill",
        ])
    };
    adjust("-151", "adj-1").fails(1, "below zero");
    assert!(adjust("-20", "adj-2").ok().contains("balance=130"));
    assert!(adjust("5", "adj-3").ok().contains("balance=135"));

    let history = cli.run(&["balance", "history", &id]).ok();
    let kinds: Vec<(&str, &str)> = history
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            (fields[2], fields[3])
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("open", "+100"),
            ("top_up", "+50"),
            ("adjustment", "-20"),
            ("adjustment", "+5")
        ],
        "{history}"
    );
    assert!(history.contains("reason=\"invoice 7\""), "{history}");
    assert!(history.contains("idempotency_key=\"inv-7\""), "{history}");
}

/// Bad input is named before the command connects: with no server to
/// reach, each of these still says what is wrong, not that the database is
/// unreachable.
#[test]
fn bad_input_is_named_before_connecting() {
    let nowhere = |args: &[&str]| {
        let mut command = Cli::bare();
        command
            .arg("--database-url")
            .arg("postgres://tollgate@127.0.0.1:9/nowhere")
            .args(args);
        finish(&command.output().expect("the tollgate binary runs"))
    };
    let movement = ["--idempotency-key", "k1", "--reason", "test"];
    let top_up_nothing = [&["balance", "top-up", "acct_1", "0"][..], &movement].concat();
    nowhere(&top_up_nothing).fails(2, "0 is not in 1..");
    let top_up_too_much = [
        &["balance", "top-up", "acct_1", "9223372036854775808"][..],
        &movement,
    ]
    .concat();
    nowhere(&top_up_too_much).fails(2, "is not in 1..=9223372036854775807");
    let adjust_nothing = [&["balance", "adjust", "acct_1", "0"][..], &movement].concat();
    nowhere(&adjust_nothing).fails(1, "an adjustment of 0 changes nothing");
    nowhere(&["reclaim", "--reclaim-grace", "10s", "--batch", "0"]).fails(2, "at least 1");
    nowhere(&[
        "usage",
        "acct_1",
        "--since",
        "2026-01-02T00:00:00Z",
        "--until",
        "2026-01-01T00:00:00Z",
    ])
    .fails(1, "must be before --until");
    nowhere(&["account", "create", "--balance", "10", "--mode", "elastic"])
        .fails(1, "--mode elastic needs --overage-cap");
    // What the ledger cannot hold is refused by the parser, not the store.
    let too_large = "9223372036854775808";
    nowhere(&[
        "account",
        "create",
        "--balance",
        too_large,
        "--mode",
        "strict",
    ])
    .fails(2, "is not in 0..=9223372036854775807");
    nowhere(&[
        "account",
        "create",
        "--balance",
        "10",
        "--mode",
        "elastic",
        "--overage-cap",
        too_large,
    ])
    .fails(2, "is not in 0..=9223372036854775807");
    nowhere(&[
        "refill", "set", "acct_1", "--amount", too_large, "--every", "1d",
    ])
    .fails(2, "is not in 0..=9223372036854775807");
    nowhere(&[
        "refill", "set", "acct_1", "--amount", "10", "--every", "1ns",
    ])
    .fails(2, "a whole number of microseconds");
    let other_database = Cli::bare()
        .args([
            "--database-url",
            "mysql://tollgate@127.0.0.1:9/app",
            "account",
            "list",
        ])
        .output()
        .expect("the tollgate binary runs");
    finish(&other_database).fails(1, "must start with postgres:// or postgresql://");
    // Good input gets as far as the connection, which fails, and says why
    // (the pool alone would say only that it timed out).
    let refused = nowhere(&["account", "list"]).fails(1, "cannot connect to postgres");
    assert!(
        !refused.stderr.contains("pool timed out"),
        "the cause is named: {}",
        refused.stderr
    );
}

/// A configuration file that does not parse is named with the place of the
/// error, never with the line itself, which may hold the database password
/// and would end up in deploy logs.
#[test]
fn a_malformed_configuration_file_never_echoes_its_password() {
    let dir = std::env::temp_dir().join(unique_schema("cli_malformed_dir"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tollgate.toml");
    std::fs::write(&file, "database_url = postgres://tollgate:s3cret@db/app\n").unwrap();
    let run = finish(
        &Cli::bare()
            .arg("--config")
            .arg(&file)
            .arg("audit")
            .output()
            .expect("the tollgate binary runs"),
    )
    .fails(1, "TOML parse error at line 1, column 16");
    assert!(
        !run.stderr.contains("s3cret") && !run.stdout.contains("s3cret"),
        "{}",
        run.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `refill=` field of an account line: the amount and the interval,
/// which the renderer prints in jiff's friendly format. A duration's
/// largest unit there is the hour (days vary in length), so thirty days
/// reads `720h`.
fn refill_field(line: &str) -> Option<&str> {
    line.split_whitespace()
        .find_map(|field| field.strip_prefix("refill="))
}

/// A refill's interval is parsed as the days it names (24 hours each) and
/// printed exactly, stored as well as echoed, and cleared with the refill.
#[test]
fn refills_are_set_and_cleared() {
    let Some(cli) = Cli::new("cli_refill") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let id = cli.strict_account("0").to_string();
    let set = cli.run(&["refill", "set", &id, "--amount", "500", "--every", "30d"]);
    let set = set.ok();
    assert_eq!(refill_field(&set), Some("500/720h"), "thirty days: {set}");
    assert!(set.contains("period_end="), "{set}");
    cli.run(&["refill", "set", &id, "--amount", "500", "--every", "0s"])
        .fails(2, "positive duration");
    let too_much = (u64::MAX / 2 + 1).to_string();
    cli.run(&[
        "refill", "set", &id, "--amount", &too_much, "--every", "30d",
    ])
    .fails(2, "is not in 0..=9223372036854775807");
    // Stored, not only printed, and the refused change left it alone.
    let shown = cli.run(&["account", "show", &id]).ok();
    assert_eq!(refill_field(&shown), Some("500/720h"), "{shown}");
    cli.run(&["refill", "clear", &id]).ok();
    assert!(!cli.run(&["account", "show", &id]).ok().contains("refill="));
}

#[test]
fn keys_are_issued_once_listed_by_prefix_and_revoked() {
    let Some(cli) = Cli::new("cli_keys") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let id = cli.strict_account("10").to_string();
    let issued = cli.run(&["key", "issue", &id, "--permissions", "0,1"]);
    assert!(issued.stderr.contains("shown once"), "{}", issued.stderr);
    let key = issued.ok().trim().to_owned();
    assert!(key.starts_with("tg_") && key.len() == 51, "{key}");
    let listed = cli.run(&["key", "list", &id]).ok();
    assert!(
        listed.contains(&format!("prefix={}", &key[..11])),
        "{listed}"
    );
    assert!(listed.contains("permissions=0x3 status=active"), "{listed}");
    assert!(!listed.contains(&key), "the plaintext is never shown again");
    let key_id = listed.split(' ').next().unwrap().to_owned();
    cli.run(&["key", "revoke", &key_id]).ok();
    let revoked = cli.run(&["key", "list", &id]).ok();
    assert!(
        revoked.contains("status=revoked") && revoked.contains("revoked_at="),
        "{revoked}"
    );
    cli.run(&["key", "issue", &id, "--permissions", "read"])
        .fails(2, "bit indices");
    cli.run(&["key", "issue", "acct_999", "--permissions", "all"])
        .fails(1, "unknown account acct_999");
    cli.run(&["key", "revoke", "key_999"])
        .fails(1, "unknown key key_999");
    // A key that cannot be written out (stdout on a full disk) is an
    // error naming the key to revoke, not a panic.
    let mut command = Cli::bare();
    command
        .args(["--database-url", &cli.url, "--schema", &cli.schema])
        .args(["key", "issue", &id, "--permissions", "all"])
        .stdout(std::fs::File::create("/dev/full").expect("/dev/full opens"));
    let lost = finish(&command.output().expect("the tollgate binary runs"));
    let lost = lost.fails(1, "could not be written");
    assert!(lost.stderr.contains("revoke it"), "{}", lost.stderr);
    // A listing whose reader has gone (`| head`) stops quietly, with the
    // status SIGPIPE would give (so `set -o pipefail` still sees it cut
    // short); one that cannot be written at all is an error. Neither
    // panics.
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let mut command = Cli::bare();
    command
        .args(["--database-url", &cli.url, "--schema", &cli.schema])
        .args(["key", "list", &id])
        .stdout(writer);
    let closed = finish(&command.output().expect("the tollgate binary runs"));
    assert_eq!(closed.code, 141, "{}", closed.stderr);
    assert!(closed.stderr.is_empty(), "{}", closed.stderr);
    let mut command = Cli::bare();
    command
        .args(["--database-url", &cli.url, "--schema", &cli.schema])
        .args(["key", "list", &id])
        .stdout(std::fs::File::create("/dev/full").expect("/dev/full opens"));
    let full = finish(&command.output().expect("the tollgate binary runs"));
    let full = full.fails(1, "cannot write the output");
    assert!(!full.stderr.contains("panicked"), "{}", full.stderr);
}

/// Usage and the balance history are read a page at a time and printed as
/// they come: a listing longer than a page is whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_longer_than_a_page_is_printed_whole_and_in_order() {
    const EVENTS: u128 = 2_501;
    let Some(cli) = Cli::new("cli_pages") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let account = cli.strict_account("5000");
    let store = cli.store().await;
    let now = Timestamp::from_second(1_700_000_000).unwrap();
    let allocation = store
        .acquire(
            account,
            CostUnits(3_000),
            SignedDuration::from_secs(30),
            now,
        )
        .await
        .unwrap();
    let events: Vec<_> = (1..=EVENTS)
        .map(|request| UsageEvent {
            request_id: RequestId(request),
            account_id: account,
            source: UsageSource::Leased {
                lease_id: allocation.grant.lease_id,
                fencing_token: allocation.grant.fencing_token,
            },
            units: CostUnits(1),
            at: now,
            policy_revision: PolicyRevision(1),
            key_id: None,
        })
        .collect();
    for chunk in events.chunks(500) {
        store.ingest(chunk).await.unwrap();
    }
    let listed = cli.run(&["usage", &account.to_string()]).ok();
    let ids: Vec<_> = listed
        .lines()
        .map(|line| {
            line.split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    let expected: Vec<_> = (1..=EVENTS)
        .map(|request| RequestId(request).to_string())
        .collect();
    assert_eq!(ids.len(), expected.len(), "every event, once");
    let misplaced = ids.iter().zip(&expected).position(|(id, want)| id != want);
    assert_eq!(misplaced, None, "in the order they arrived");
    for top_up in 1..=1_001 {
        let key = format!("page-{top_up}");
        let movement = Movement {
            idempotency_key: &key,
            reason: "pages",
        };
        store
            .top_up(account, CostUnits(1), &movement, now)
            .await
            .unwrap();
    }
    let history = cli.run(&["balance", "history", &account.to_string()]).ok();
    // Opened, granted, and 1,001 top-ups.
    assert_eq!(history.lines().count(), 1_003, "{}", &history[..200]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_listed_by_window_reclaim_settles_expired_leases_and_audit_catches_tampering() {
    let Some(cli) = Cli::new("cli_usage_reclaim_audit") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let account = cli.strict_account("1000");
    let store = cli.store().await;
    // A lease granted long ago, whose holder never came back, with two
    // charges billed against it.
    let long_ago = Timestamp::from_second(1_700_000_000).unwrap();
    let allocation = store
        .acquire(
            account,
            CostUnits(100),
            SignedDuration::from_secs(30),
            long_ago,
        )
        .await
        .unwrap();
    let event = |request: u128, second: i64, units: u64| UsageEvent {
        request_id: RequestId(request),
        account_id: account,
        source: UsageSource::Leased {
            lease_id: allocation.grant.lease_id,
            fencing_token: allocation.grant.fencing_token,
        },
        units: CostUnits(units),
        at: Timestamp::from_second(second).unwrap(),
        policy_revision: PolicyRevision(1),
        key_id: None,
    };
    let outcomes = store
        .ingest(&[event(1, 1_700_000_001, 3), event(2, 1_700_000_005, 4)])
        .await
        .unwrap();
    assert_eq!(outcomes, [IngestOutcome::Accepted, IngestOutcome::Accepted]);

    let id = account.to_string();
    let all = cli.run(&["usage", &id]).ok();
    assert_eq!(all.lines().count(), 2, "{all}");
    let windowed = cli
        .run(&[
            "usage",
            &id,
            "--since",
            "2023-11-14T22:13:22Z",
            "--until",
            "2023-11-14T22:13:30Z",
        ])
        .ok();
    assert_eq!(windowed.lines().count(), 1, "{windowed}");
    assert!(windowed.contains("units=4"), "{windowed}");
    cli.run(&["usage", &id, "--since", "yesterday"])
        .fails(2, "RFC 3339");

    cli.run(&["reclaim"]).fails(1, "--reclaim-grace");
    // A grace past any store's range would find nothing and say so quietly.
    cli.run(&["reclaim", "--reclaim-grace", "1000000w"])
        .fails(1, "reclaim_grace must not exceed a year");
    let reclaimed = cli.run(&["reclaim", "--reclaim-grace", "10s"]).ok();
    assert!(
        reclaimed.contains("1 leases reclaimed, 93 units credited"),
        "granted 100, billed 7: {reclaimed}"
    );
    assert!(
        cli.run(&["account", "show", &id])
            .ok()
            .contains("balance=993 leased=0")
    );
    assert!(cli.run(&["audit"]).ok().contains("the ledger balances"));

    // Someone edits a balance behind the ledger's back.
    sqlx::query(&format!(
        "UPDATE {}.accounts SET balance = balance + 1 WHERE id = $1",
        cli.schema
    ))
    .bind(i64::try_from(account.get()).unwrap())
    .execute(store.pool())
    .await
    .unwrap();
    let audit = cli.run(&["audit"]).fails(3, "violation:");
    assert!(audit.stdout.contains(&id), "{}", audit.stdout);
}

/// A store may end a page early when a lease it selected turned out
/// blocked (two leases of one account each fit its balance alone, not
/// together); the reclaimer's next pass goes on, and so does the command,
/// which has no next pass: it asks again while pages settle anything, so
/// a lease of another account due after them is settled too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_goes_on_past_a_page_that_ended_early_on_a_blocked_lease() {
    let Some(cli) = Cli::new("cli_reclaim_blocked") else {
        return;
    };
    cli.run(&["migrate"]).ok();
    let top = u64::try_from(i64::MAX).unwrap();
    let full = account_of(
        &cli.run(&[
            "account",
            "create",
            "--balance",
            &(top - 210).to_string(),
            "--mode",
            "strict",
        ])
        .ok(),
    );
    let other = cli.strict_account("1000");
    let store = cli.store().await;
    let long_ago = |second: i64| Timestamp::from_second(1_700_000_000 + second).unwrap();
    let ttl = SignedDuration::from_secs(30);
    for (account, second) in [(full, 0), (full, 1), (other, 2)] {
        store
            .acquire(account, CostUnits(100), ttl, long_ago(second))
            .await
            .unwrap();
    }
    // 100 units of room below the top: one of its two leases comes back.
    cli.run(&[
        "balance",
        "top-up",
        &full.to_string(),
        "300",
        "--idempotency-key",
        "near-the-top",
        "--reason",
        "test",
    ])
    .ok();
    let reclaimed = cli
        .run(&["reclaim", "--reclaim-grace", "10s", "--batch", "2"])
        .ok();
    assert!(
        reclaimed.contains("2 leases reclaimed, 200 units credited"),
        "the first lease of each account: {reclaimed}"
    );
    assert!(reclaimed.contains("1 leases blocked"), "{reclaimed}");
    assert!(
        cli.run(&["account", "show", &other.to_string()])
            .ok()
            .contains("balance=1000 leased=0")
    );
}

#[test]
fn settings_come_from_a_file_then_the_environment_then_flags() {
    let Some(cli) = Cli::new("cli_settings") else {
        return;
    };
    let dir = std::env::temp_dir().join(unique_schema("cli_settings_dir"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tollgate.toml");
    std::fs::write(
        &file,
        format!("database_url = {:?}\nschema = {:?}\n", cli.url, cli.schema),
    )
    .unwrap();
    let run = |command: &mut Command| finish(&command.output().unwrap());

    // The file alone.
    let migrated = run(Cli::bare().arg("--config").arg(&file).arg("migrate")).ok();
    assert!(
        migrated.contains(&format!("schema {}", cli.schema)),
        "{migrated}"
    );
    // tollgate.toml in the working directory is read without --config.
    let found = run(Cli::bare().current_dir(&dir).arg("check-schema")).ok();
    assert!(found.contains("is current"), "{found}");
    // The environment overrides the file; a flag overrides the environment.
    let other = unique_schema("cli_settings_other");
    run(Cli::bare()
        .current_dir(&dir)
        .env("TOLLGATE_SCHEMA", &other)
        .arg("check-schema"))
    .fails(3, &other);
    let flagged = run(Cli::bare()
        .current_dir(&dir)
        .env("TOLLGATE_SCHEMA", &other)
        .args(["--schema", &cli.schema, "check-schema"]))
    .ok();
    assert!(flagged.contains("is current"), "{flagged}");

    // A misspelt setting is an error, not ignored.
    let typo = dir.join("typo.toml");
    std::fs::write(&typo, "databse_url = \"postgres://x\"\n").unwrap();
    run(Cli::bare().arg("--config").arg(&typo).arg("audit")).fails(1, "databse_url");
    run(Cli::bare()
        .arg("--config")
        .arg(Path::new("/nonexistent.toml"))
        .arg("audit"))
    .fails(1, "no configuration file");
    run(Cli::bare().arg("audit")).fails(1, "no database");

    // Variables are text: a schema may be named `true`.
    run(Cli::bare()
        .current_dir(&dir)
        .env("TOLLGATE_SCHEMA", "true")
        .arg("check-schema"))
    .fails(3, "schema true");
    // An empty variable is unset: it hides nothing the file says.
    let empty = run(Cli::bare()
        .current_dir(&dir)
        .env("DATABASE_URL", "")
        .env("TOLLGATE_DATABASE_URL", "")
        .arg("check-schema"))
    .ok();
    assert!(empty.contains("is current"), "{empty}");
    // The file may be named by TOLLGATE_CONFIG; empty, it is unset and
    // hides neither --config nor tollgate.toml; a flag wins over it.
    let named = run(Cli::bare()
        .env("TOLLGATE_CONFIG", &file)
        .arg("check-schema"))
    .ok();
    assert!(named.contains("is current"), "{named}");
    let flag_over_empty = run(Cli::bare()
        .env("TOLLGATE_CONFIG", "")
        .arg("--config")
        .arg(&file)
        .arg("check-schema"))
    .ok();
    assert!(flag_over_empty.contains("is current"), "{flag_over_empty}");
    let default_over_empty = run(Cli::bare()
        .current_dir(&dir)
        .env("TOLLGATE_CONFIG", "")
        .arg("check-schema"))
    .ok();
    assert!(
        default_over_empty.contains("is current"),
        "{default_over_empty}"
    );
    let flag_over_variable = run(Cli::bare()
        .env("TOLLGATE_CONFIG", Path::new("/nonexistent.toml"))
        .arg("--config")
        .arg(&file)
        .arg("check-schema"))
    .ok();
    assert!(
        flag_over_variable.contains("is current"),
        "{flag_over_variable}"
    );
    run(Cli::bare()
        .env("TOLLGATE_CONFIG", Path::new("/nonexistent.toml"))
        .arg("audit"))
    .fails(1, "no configuration file");
    // The wrong file, too large to be a configuration, is not read.
    let large = dir.join("large.toml");
    std::fs::File::create(&large)
        .unwrap()
        .set_len(2 << 20)
        .unwrap();
    run(Cli::bare().arg("--config").arg(&large).arg("audit"))
        .fails(1, "a configuration is at most 1048576");
    std::fs::remove_dir_all(&dir).unwrap();
}
