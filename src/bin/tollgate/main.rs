//! `tollgate`: the operator's command for a PostgreSQL-backed deployment.
//!
//! Accounts, balances, refills, keys, usage, reclaim and the ledger audit,
//! against the same database the gateway instances share. Every change a
//! command makes is one transaction: it happens entirely or not at all.
//! `reclaim` settles a transaction per page and, should a page fail, says
//! what the pages before it settled; a command that reads back what it
//! changed says so if the read fails. Run `tollgate --help` for the
//! commands.
//!
//! Configuration is layered, later layers winning: the file named by
//! `--config` (or `TOLLGATE_CONFIG`, default `tollgate.toml` when it
//! exists), then `TOLLGATE_*` environment variables, then `--database-url`
//! (or `DATABASE_URL`) and `--schema` on the command line.
#![allow(
    clippy::doc_markdown,
    reason = "the argument docs are the --help text, read without markdown"
)]

mod config;
mod parse;
mod render;

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use jiff::Timestamp;
use tollgate::store::{
    AccountSpec, AdminError, LeaseAllocator as _, Movement, Page, PageCursor, PostgresStore,
    RefillSchedule, SchemaStatus,
};
use tollgate::{AccountId, AccountStatus, CostUnits, EnforcementMode, KeyId, PermissionBits};

use crate::config::Settings;
use crate::parse::{
    Mode, account_id, duration, key_id, period, permissions, positive_count, timestamp,
};

/// Rows a listing (`usage`, `balance history`) reads at a time.
const PAGE: usize = 1_000;

/// Operate a tollgate deployment's PostgreSQL store.
#[derive(Debug, Parser)]
#[command(name = "tollgate", version, about, long_about = None)]
struct Cli {
    /// The configuration file (default: `$TOLLGATE_CONFIG` if set and not
    /// empty, else `tollgate.toml` if it exists).
    #[arg(long, global = true)]
    config: Option<std::path::PathBuf>,
    /// The PostgreSQL URL, e.g. `postgres://user@host/db`.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// The PostgreSQL schema tollgate's tables live in (default `tollgate`).
    #[arg(long, global = true)]
    schema: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Creates or upgrades tollgate's schema (safe to run from many
    /// processes at once: one applies, the others wait and find it done).
    Migrate,
    /// Says whether the schema matches this build; exits 3 when it does not.
    CheckSchema,
    /// Accounts.
    #[command(subcommand)]
    Account(AccountCommand),
    /// Balances: top-ups, adjustments and their history.
    #[command(subcommand)]
    Balance(BalanceCommand),
    /// Periodic refills.
    #[command(subcommand)]
    Refill(RefillCommand),
    /// API keys.
    #[command(subcommand)]
    Key(KeyCommand),
    /// The usage events billed to an account, in the order the store
    /// recorded them (a batch retried or delivered late comes after events
    /// that happened later).
    Usage {
        /// The account (`acct_7` or `7`).
        #[arg(value_parser = account_id)]
        account: AccountId,
        /// Only events at or after this instant (RFC 3339).
        #[arg(long, value_parser = timestamp)]
        since: Option<Timestamp>,
        /// Only events before this instant (RFC 3339).
        #[arg(long, value_parser = timestamp)]
        until: Option<Timestamp>,
    },
    /// Settles leases whose holder never came back: every active lease whose
    /// expiry plus the reclaim grace has passed.
    Reclaim {
        /// How long after a lease's expiry it may be reclaimed. Must be the
        /// gateways' `reclaim_grace` (or the config file's).
        #[arg(long, value_parser = duration)]
        reclaim_grace: Option<jiff::SignedDuration>,
        /// Leases settled per transaction: at least one.
        #[arg(long, default_value_t = 100, value_parser = positive_count)]
        batch: usize,
    },
    /// Checks the ledger equation for every account and lease; exits 3 on
    /// any violation.
    Audit,
}

#[derive(Debug, Subcommand)]
enum AccountCommand {
    /// Opens an account; prints its id.
    Create {
        /// The opening balance, in cost units: at most the ledger's largest
        /// balance (2^63 - 1).
        #[arg(long, value_parser = clap::value_parser!(u64).range(0..=i64::MAX.unsigned_abs()))]
        balance: u64,
        #[command(flatten)]
        mode: ModeArgs,
        /// Open it suspended.
        #[arg(long)]
        suspended: bool,
    },
    /// Shows one account.
    Show {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
    },
    /// Lists every account.
    List,
    /// Suspends an account: its keys are refused until it is resumed.
    Suspend {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
    },
    /// Resumes a suspended account.
    Resume {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
    },
    /// Changes how an account may spend beyond its leases.
    SetMode {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
        #[command(flatten)]
        mode: ModeArgs,
    },
}

#[derive(Debug, Args)]
struct ModeArgs {
    /// `strict` (never beyond the balance) or `elastic` (overage up to a
    /// cap per instance, billed as debt).
    #[arg(long, value_enum)]
    mode: Mode,
    /// The overage cap per instance; required for, and only for, `elastic`.
    /// At most 2^63 - 1.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=i64::MAX.unsigned_abs()))]
    overage_cap: Option<u64>,
}

#[derive(Debug, Subcommand)]
enum BalanceCommand {
    /// Adds units to a balance, once per idempotency key.
    TopUp {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
        /// The units to add: at least one, and no more than the ledger's
        /// largest balance (2^63 - 1).
        #[arg(value_parser = clap::value_parser!(u64).range(1..=i64::MAX.unsigned_abs()))]
        units: u64,
        #[command(flatten)]
        movement: MovementArgs,
    },
    /// Corrects a balance by a signed number of units, once per idempotency
    /// key; never below zero.
    Adjust {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
        /// The change, e.g. `-50` or `25`.
        #[arg(allow_negative_numbers = true)]
        delta: i64,
        #[command(flatten)]
        movement: MovementArgs,
    },
    /// Every movement of an account's balance, oldest first.
    History {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
    },
}

#[derive(Debug, Args)]
struct MovementArgs {
    /// Makes a retried command apply once: the same key with the same
    /// account and amount answers with the first outcome.
    #[arg(long)]
    idempotency_key: String,
    /// Why, recorded in the journal.
    #[arg(long)]
    reason: String,
}

#[derive(Debug, Subcommand)]
enum RefillCommand {
    /// Resets the balance to `--amount` at the end of every `--every`
    /// period; the first period ends one period from now.
    Set {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
        /// The balance each period starts with. Units out on leases at the
        /// reset come back on top of it as the leases settle, so a period
        /// can fund up to this plus what was leased at its start. At most
        /// 2^63 - 1.
        #[arg(long, value_parser = clap::value_parser!(u64).range(0..=i64::MAX.unsigned_abs()))]
        amount: u64,
        /// The period, e.g. `30d` or `1h`: a whole number of microseconds,
        /// the most `PostgreSQL` keeps.
        #[arg(long, value_parser = period)]
        every: jiff::SignedDuration,
    },
    /// Removes an account's refill.
    Clear {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
    },
}

#[derive(Debug, Subcommand)]
enum KeyCommand {
    /// Issues a key and prints it. The plaintext is shown this once and
    /// never stored.
    Issue {
        /// The account the key spends from.
        #[arg(value_parser = account_id)]
        account: AccountId,
        /// Permission bits: `all`, `none`, a mask (`0x3`), or bit indices
        /// (`0,1`).
        #[arg(long, value_parser = permissions)]
        permissions: PermissionBits,
    },
    /// Revokes a key for good.
    Revoke {
        /// The key (`key_3` or `3`).
        #[arg(value_parser = key_id)]
        key: KeyId,
    },
    /// Lists an account's keys (prefixes only).
    List {
        /// The account.
        #[arg(value_parser = account_id)]
        account: AccountId,
    },
}

/// How a command failed, and the exit status it maps to.
enum Failure {
    /// The command could not be carried out (exit 1).
    Error(String),
    /// The command ran and found something wrong: a schema mismatch or a
    /// ledger violation (exit 3).
    Finding,
    /// Whatever read the output stopped reading (`tollgate usage … | head`):
    /// the command stops quietly, with the status a process killed by
    /// SIGPIPE would have (exit 141), so a pipeline that checks statuses
    /// does not take a cut-short audit or reclaim for a complete one.
    OutputClosed,
}

/// Writes one line of a command's output. Unlike `println!`, a closed or
/// failing stdout is an answer, not a panic.
macro_rules! say {
    ($($arg:tt)*) => {
        emit(format_args!($($arg)*))?
    };
}

/// Prints a listing a page at a time, each as it comes: an account's usage
/// and journal grow with its traffic, and need not fit in memory.
async fn print_pages<T>(
    mut page: impl AsyncFnMut(Option<PageCursor>) -> Result<Page<T>, Failure>,
    render: impl Fn(&T) -> String,
) -> Result<(), Failure> {
    let mut from = None;
    loop {
        let read = page(from).await?;
        for item in &read.items {
            say!("{}", render(item));
        }
        match read.next {
            Some(next) => from = Some(next),
            None => return Ok(()),
        }
    }
}

/// Writes a line to stderr. A failure to write it is ignored: there is
/// nowhere left to report it, and the exit code still tells.
fn complain(line: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(line).and_then(|()| err.write_all(b"\n"));
}

fn emit(line: std::fmt::Arguments<'_>) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(line)
        .and_then(|()| out.write_all(b"\n"))
        .map_err(|error| match error.kind() {
            std::io::ErrorKind::BrokenPipe => Failure::OutputClosed,
            _ => Failure::Error(format!("cannot write the output: {error}")),
        })
}

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(error: E) -> Self {
        Self::Error(error.to_string())
    }
}

/// A store's answer about `account`, naming it when it does not exist.
fn about(account: AccountId) -> impl Fn(AdminError) -> Failure {
    move |error| match error {
        AdminError::UnknownAccount => Failure::Error(format!("unknown account {account}")),
        other => other.into(),
    }
}

/// [`about`], for a balance movement: a storage error may have applied it,
/// and running it again with its idempotency key applies it once.
fn moving(account: AccountId) -> impl Fn(AdminError) -> Failure {
    move |error| match error {
        AdminError::Storage(error) => Failure::Error(format!(
            "{error}; the movement may or may not have applied: run the same command \
             again, with the same --idempotency-key, and it applies once"
        )),
        other => about(account)(other),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            complain(format_args!(
                "tollgate: error: cannot start the async runtime: {error}"
            ));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Error(message)) => {
            complain(format_args!("tollgate: error: {message}"));
            ExitCode::FAILURE
        }
        Err(Failure::Finding) => ExitCode::from(3),
        Err(Failure::OutputClosed) => ExitCode::from(141),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    check_input(&cli.command)?;
    let settings = Settings::load(
        cli.config.as_deref(),
        cli.database_url.as_deref(),
        cli.schema.as_deref(),
    )?;
    let reclaim_grace = match &cli.command {
        Command::Reclaim { reclaim_grace, .. } => Some(settings.reclaim_grace(*reclaim_grace)?),
        _ => None,
    };
    let store = PostgresStore::connect(
        &settings.database_url,
        settings.store_config(reclaim_grace)?,
    )
    .await?;
    // Every other command reads or moves money in tables of the schema's
    // shape this build knows: one it does not is named, with what to do,
    // rather than met as a failing query (or a query that succeeds on
    // tables of another shape).
    if !matches!(cli.command, Command::Migrate | Command::CheckSchema) {
        let status = store.check_schema().await?;
        if !matches!(status, SchemaStatus::Current { .. }) {
            return Err(Failure::Error(render::schema_status(
                store.schema(),
                &status,
            )));
        }
    }
    let now = Timestamp::now();
    match cli.command {
        Command::Migrate => {
            let report = store.migrate().await?;
            if report.applied.is_empty() {
                say!(
                    "schema {} is current (version {})",
                    store.schema(),
                    report.current
                );
            } else {
                for version in &report.applied {
                    say!("applied migration {version}");
                }
                say!("schema {} is at version {}", store.schema(), report.current);
            }
        }
        Command::CheckSchema => {
            let status = store.check_schema().await?;
            say!("{}", render::schema_status(store.schema(), &status));
            if !matches!(status, SchemaStatus::Current { .. }) {
                return Err(Failure::Finding);
            }
        }
        Command::Account(command) => account(&store, command, now).await?,
        Command::Balance(command) => balance(&store, command, now).await?,
        Command::Refill(command) => refill(&store, command, now).await?,
        Command::Key(command) => key(&store, command, now).await?,
        Command::Usage {
            account,
            since,
            until,
        } => {
            print_pages(
                async |from| {
                    (store.usage_page(account, since, until, from, PAGE).await)
                        .map_err(about(account))
                },
                render::usage_event,
            )
            .await?;
        }
        Command::Reclaim { batch, .. } => reclaim(&store, batch, now).await?,
        Command::Audit => {
            let violations = store.audit().await?;
            if violations.is_empty() {
                say!("the ledger balances");
            } else {
                for violation in &violations {
                    say!("violation: {violation}");
                }
                return Err(Failure::Finding);
            }
        }
    }
    Ok(())
}

async fn account(
    store: &PostgresStore,
    command: AccountCommand,
    now: Timestamp,
) -> Result<(), Failure> {
    match command {
        AccountCommand::Create {
            balance,
            mode,
            suspended,
        } => {
            let spec = AccountSpec {
                balance: CostUnits(balance),
                mode: enforcement(&mode)?,
                status: if suspended {
                    AccountStatus::Suspended
                } else {
                    AccountStatus::Active
                },
                refill: None,
            };
            let id = store.create_account(spec, now).await?;
            say!("{id}");
        }
        AccountCommand::Show { account } => {
            say!(
                "{}",
                render::account(&store.account(account, now).await.map_err(about(account))?)
            );
        }
        AccountCommand::List => {
            for view in store.accounts(now).await? {
                say!("{}", render::account(&view));
            }
        }
        AccountCommand::Suspend { account } => {
            store
                .set_status(account, AccountStatus::Suspended)
                .await
                .map_err(about(account))?;
            say!("{account}: suspended");
        }
        AccountCommand::Resume { account } => {
            store
                .set_status(account, AccountStatus::Active)
                .await
                .map_err(about(account))?;
            say!("{account}: active");
        }
        AccountCommand::SetMode { account, mode } => {
            let mode = enforcement(&mode)?;
            store
                .set_mode(account, mode)
                .await
                .map_err(about(account))?;
            say!("{account}: {}", render::mode(mode));
        }
    }
    Ok(())
}

async fn balance(
    store: &PostgresStore,
    command: BalanceCommand,
    now: Timestamp,
) -> Result<(), Failure> {
    match command {
        BalanceCommand::TopUp {
            account,
            units,
            movement,
        } => {
            let change = store
                .top_up(account, CostUnits(units), &movement.borrow(), now)
                .await
                .map_err(moving(account))?;
            say!("{}", render::balance_change(account, &change));
        }
        BalanceCommand::Adjust {
            account,
            delta,
            movement,
        } => {
            let change = store
                .adjust(account, delta, &movement.borrow(), now)
                .await
                .map_err(moving(account))?;
            say!("{}", render::balance_change(account, &change));
        }
        BalanceCommand::History { account } => {
            print_pages(
                async |from| {
                    (store.history_page(account, from, PAGE).await).map_err(about(account))
                },
                render::journal_entry,
            )
            .await?;
        }
    }
    Ok(())
}

async fn key(store: &PostgresStore, command: KeyCommand, now: Timestamp) -> Result<(), Failure> {
    match command {
        KeyCommand::Issue {
            account,
            permissions,
        } => {
            let issued = store
                .issue_key(account, permissions, now)
                .await
                .map_err(about(account))?;
            // The id first: should the key fail to reach stdout (a closed
            // pipe, a full disk), the operator still knows which key to
            // revoke, and the failure is an error, not a panic.
            complain(format_args!(
                "{} for {account}, permissions {permissions}: shown once, store it now \
                 (gateways accept it from their next policy refresh)",
                issued.key_id
            ));
            let mut out = std::io::stdout().lock();
            writeln!(out, "{}", issued.key.expose())
                .and_then(|()| out.flush())
                .map_err(|error| {
                    format!(
                        "{} was issued but could not be written ({error}); revoke it",
                        issued.key_id
                    )
                })?;
        }
        KeyCommand::Revoke { key } => {
            store
                .revoke_key(key, now)
                .await
                .map_err(|error| match error {
                    AdminError::UnknownKey => Failure::Error(format!("unknown key {key}")),
                    other => other.into(),
                })?;
            say!("{key}: revoked");
        }
        KeyCommand::List { account } => {
            for info in store.list_keys(account).await.map_err(about(account))? {
                say!("{}", render::key(&info));
            }
        }
    }
    Ok(())
}

async fn refill(
    store: &PostgresStore,
    command: RefillCommand,
    now: Timestamp,
) -> Result<(), Failure> {
    match command {
        RefillCommand::Set {
            account,
            amount,
            every,
        } => {
            let schedule = RefillSchedule {
                amount: CostUnits(amount),
                interval: every,
            };
            store
                .configure_refill(account, Some(schedule), now)
                .await
                .map_err(about(account))?;
            let view = store.account(account, now).await.map_err(|error| {
                format!("{account}: the refill is set, but reading it back failed: {error}")
            })?;
            say!("{}", render::account(&view));
        }
        RefillCommand::Clear { account } => {
            store
                .configure_refill(account, None, now)
                .await
                .map_err(about(account))?;
            say!("{account}: no refill");
        }
    }
    Ok(())
}

async fn reclaim(store: &PostgresStore, batch: usize, now: Timestamp) -> Result<(), Failure> {
    let mut settled = 0_usize;
    let mut credited = 0_u64;
    // Every page reports the blocked leases again; name each once.
    let mut blocked = std::collections::BTreeSet::new();
    loop {
        let page = match store.reclaim_expired_batch(now, batch).await {
            Ok(page) => page,
            // The pages before it are settled: say so with the error.
            Err(error) if settled > 0 => {
                return Err(Failure::Error(format!(
                    "{settled} leases reclaimed ({credited} units credited) before a page \
                     failed: {error}"
                )));
            }
            Err(error) => return Err(error.into()),
        };
        for lease in &page.reclaimed {
            say!(
                "reclaimed {} of {}: {} units credited",
                lease.lease_id,
                lease.account_id,
                lease.credited.get()
            );
            credited = credited.saturating_add(lease.credited.get());
        }
        for lease in &page.blocked {
            if blocked.insert(lease.lease_id) {
                say!(
                    "blocked {} of {}: its {} units would take the balance past the ledger's range",
                    lease.lease_id,
                    lease.account_id,
                    lease.remainder.get()
                );
            }
        }
        settled += page.reclaimed.len();
        // A store may end a page early when a lease it selected turned out
        // blocked, leaving the next pass to go on; this command has no next
        // pass, so it asks again while pages settle anything.
        if !page.more && page.reclaimed.is_empty() {
            break;
        }
    }
    say!("{settled} leases reclaimed, {credited} units credited");
    if !blocked.is_empty() {
        say!(
            "{} leases blocked; they settle once their accounts' balances have room",
            blocked.len()
        );
    }
    Ok(())
}

impl MovementArgs {
    fn borrow(&self) -> Movement<'_> {
        Movement {
            idempotency_key: &self.idempotency_key,
            reason: &self.reason,
        }
    }
}

/// The input errors a command can report before it connects, so a bad
/// argument is named even when the database is unreachable.
fn check_input(command: &Command) -> Result<(), Failure> {
    match command {
        Command::Usage {
            since: Some(since),
            until: Some(until),
            ..
        } if since >= until => Err(Failure::Error(format!(
            "--since ({since}) must be before --until ({until})"
        ))),
        Command::Account(
            AccountCommand::Create { mode, .. } | AccountCommand::SetMode { mode, .. },
        ) => enforcement(mode).map(drop),
        // A top-up refuses nothing to add; so does an adjustment, rather
        // than journal a change of nothing.
        Command::Balance(BalanceCommand::Adjust { delta: 0, .. }) => Err(Failure::Error(
            "an adjustment of 0 changes nothing: give a non-zero change".to_owned(),
        )),
        _ => Ok(()),
    }
}

fn enforcement(args: &ModeArgs) -> Result<EnforcementMode, Failure> {
    match (args.mode, args.overage_cap) {
        (Mode::Strict, None) => Ok(EnforcementMode::Strict),
        (Mode::Strict, Some(_)) => Err(Failure::Error(
            "--overage-cap applies only to --mode elastic".to_owned(),
        )),
        (Mode::Elastic, Some(cap)) => Ok(EnforcementMode::Elastic {
            overage_cap: CostUnits(cap),
        }),
        (Mode::Elastic, None) => Err(Failure::Error(
            "--mode elastic needs --overage-cap".to_owned(),
        )),
    }
}
