//! Layered settings: a TOML file, then `TOLLGATE_*` variables, then flags.

use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Format, Toml};
use jiff::SignedDuration;
use serde::Deserialize;
use tollgate::CostUnits;
use tollgate::store::{GrantPolicy, PostgresConfig, TailSharing};

use crate::parse::duration;

/// The file read when `--config` is not given, if it exists.
const DEFAULT_FILE: &str = "tollgate.toml";

/// The largest configuration file read: a few settings take a few hundred
/// bytes, so anything near this is the wrong file, refused before it is
/// read rather than parsed whole.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// How long an operator's command waits for a row a gateway holds before it
/// fails: longer than a gateway's own calls wait, since nobody gives up on
/// a command before it answers.
const LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a command's call waits for a free connection: as long as it
/// waits for a row, for the same reason.
const QUEUE_TIMEOUT: std::time::Duration = LOCK_TIMEOUT;

/// What the file and the environment may set. Unknown keys in the file are
/// errors, so a misspelt setting is not silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Layered {
    database_url: Option<String>,
    schema: Option<String>,
    /// The gateways' `reclaim_grace`, e.g. `"10s"`.
    reclaim_grace: Option<String>,
}

/// A parse error's message without the excerpt of the file it quotes: the
/// line at fault may hold the database password, and errors end up in logs.
/// The line and column stay, so the place is still named.
fn without_source(message: &str) -> String {
    message
        .lines()
        .filter(|line| {
            let quoted = line
                .trim_start()
                .trim_start_matches(|c: char| c.is_ascii_digit());
            !quoted.trim_start().starts_with('|')
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The settings a command runs with.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) database_url: String,
    pub(crate) schema: String,
    reclaim_grace: Option<String>,
}

impl Settings {
    /// Merges the layers, later ones winning: `file` (else
    /// `TOLLGATE_CONFIG`, else `tollgate.toml` when it exists),
    /// `TOLLGATE_DATABASE_URL` / `TOLLGATE_SCHEMA` /
    /// `TOLLGATE_RECLAIM_GRACE`, then the flags.
    pub(crate) fn load(
        file: Option<&Path>,
        database_url: Option<&str>,
        schema: Option<&str>,
    ) -> Result<Self, String> {
        let mut figment = Figment::new();
        // Read here rather than by the flag's parser, which refuses an
        // empty path: an empty variable counts as unset, as every other
        // variable's does, and a flag wins over it.
        let from_env = std::env::var_os("TOLLGATE_CONFIG")
            .filter(|path| !path.is_empty())
            .map(PathBuf::from);
        let file = match file.or(from_env.as_deref()) {
            Some(path) if !path.is_file() => {
                return Err(format!("no configuration file at {}", path.display()));
            }
            Some(path) => Some(path),
            None => Some(Path::new(DEFAULT_FILE)).filter(|path| path.is_file()),
        };
        if let Some(path) = file {
            let size = std::fs::metadata(path)
                .map_err(|error| format!("configuration file {}: {error}", path.display()))?
                .len();
            if size > MAX_FILE_BYTES {
                return Err(format!(
                    "configuration file {} is {size} bytes; a configuration is at most {MAX_FILE_BYTES}",
                    path.display()
                ));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        let mut layered: Layered = figment
            .extract()
            .map_err(|error| format!("configuration: {}", without_source(&error.to_string())))?;
        // Each variable is read as the text it is (a schema named `true` is
        // a name, not a boolean), and an empty one counts as unset.
        for (variable, setting) in [
            ("TOLLGATE_DATABASE_URL", &mut layered.database_url),
            ("TOLLGATE_SCHEMA", &mut layered.schema),
            ("TOLLGATE_RECLAIM_GRACE", &mut layered.reclaim_grace),
        ] {
            match std::env::var(variable) {
                Ok(value) if !value.is_empty() => *setting = Some(value),
                Ok(_) | Err(std::env::VarError::NotPresent) => {}
                Err(std::env::VarError::NotUnicode(_)) => {
                    return Err(format!("{variable} is not UTF-8"));
                }
            }
        }
        // An empty `DATABASE_URL` (or flag) counts as unset, as an empty
        // `TOLLGATE_*` variable does: it does not hide the file's URL.
        let database_url = database_url
            .filter(|url| !url.is_empty())
            .map(str::to_owned)
            .or(layered.database_url)
            .ok_or_else(|| {
                "no database: pass --database-url, or set DATABASE_URL or database_url in the configuration"
                    .to_owned()
            })?;
        // Named before connecting: another scheme (or none) would be tried
        // as PostgreSQL and fail as an unreachable server, or as a parse
        // error that does not say what was expected.
        if !(database_url.starts_with("postgres://") || database_url.starts_with("postgresql://")) {
            return Err("the database URL must start with postgres:// or postgresql://".to_owned());
        }
        let schema = schema
            .map(str::to_owned)
            .or(layered.schema)
            .unwrap_or_else(|| "tollgate".to_owned());
        Ok(Self {
            database_url,
            schema,
            reclaim_grace: layered.reclaim_grace,
        })
    }

    /// The reclaim grace: the flag, else the configuration's. It has no
    /// default, because reclaiming before the gateways' grace has passed
    /// would take units from a holder still entitled to them.
    pub(crate) fn reclaim_grace(
        &self,
        flag: Option<SignedDuration>,
    ) -> Result<SignedDuration, String> {
        if let Some(grace) = flag {
            return Ok(grace);
        }
        let text = self.reclaim_grace.as_deref().ok_or_else(|| {
            "reclaim needs --reclaim-grace (or reclaim_grace in the configuration), equal to the gateways'"
                .to_owned()
        })?;
        duration(text).map_err(|error| format!("reclaim_grace: {error}"))
    }

    /// The store's configuration. The operator command never grants a
    /// lease, so only the reclaim grace of its policy matters, and only to
    /// `reclaim`; the other values merely satisfy the policy's rules.
    pub(crate) fn store_config(
        &self,
        reclaim_grace: Option<SignedDuration>,
    ) -> Result<PostgresConfig, String> {
        let policy = GrantPolicy {
            max_ttl: SignedDuration::from_secs(1),
            reclaim_grace: reclaim_grace.unwrap_or(SignedDuration::from_secs(1)),
            tail: TailSharing {
                instances: 1,
                min_grant: CostUnits(1),
            },
        };
        policy.validate().map_err(|error| error.to_string())?;
        Ok(PostgresConfig {
            schema: self.schema.clone(),
            policy,
            lock_timeout: LOCK_TIMEOUT,
            queue_timeout: QUEUE_TIMEOUT,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parse_error_names_the_place_but_not_the_line() {
        let message = "TOML parse error at line 2, column 16
  |
2 | database_url = postgres://tollgate:s3cret@db/app
  |                ^
invalid string
expected `\"`, `'`
 in tollgate.toml TOML file";
        assert_eq!(
            without_source(message),
            "TOML parse error at line 2, column 16\ninvalid string\nexpected `\"`, `'`\n in tollgate.toml TOML file"
        );
    }
}
