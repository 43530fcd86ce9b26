//! Where the `PostgreSQL` tests find their server, and a fresh schema each.
//!
//! `scripts/test` starts a throwaway cluster and exports its URL as
//! `TOLLGATE_TEST_DATABASE_URL`. Without it a `PostgreSQL` test says loudly
//! that it was skipped and passes, so `cargo test` works on a laptop with
//! no `PostgreSQL`; with `CI` set it fails instead, so a CI run can never pass
//! without having run them.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// The variable `scripts/test` exports.
pub(crate) const URL_VARIABLE: &str = "TOLLGATE_TEST_DATABASE_URL";

/// The test server's URL, or `None` (after saying so) when there is none
/// and this is not CI.
///
/// # Panics
///
/// When `CI` is set and there is no URL.
pub(crate) fn database_url(test: &str) -> Option<String> {
    match std::env::var(URL_VARIABLE) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "{test}: CI is set but {URL_VARIABLE} is not; run the tests with scripts/test"
            );
            eprintln!(
                "SKIPPED {test}: no PostgreSQL ({URL_VARIABLE} is not set; scripts/test starts one)"
            );
            None
        }
    }
}

/// A schema name no other test in any process uses: each test gets its own
/// tables, so the tests run in parallel against one server.
pub(crate) fn unique_schema(test: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.subsec_nanos());
    let stem: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(32)
        .collect();
    format!("t_{stem}_{}_{n}_{nanos}", std::process::id())
}

/// A throwaway cluster of the caller's own, started by `scripts/pg-cluster`
/// and stopped when dropped: a test that stops its server disturbs no
/// other, and a benchmark needs no server set up beforehand.
pub(crate) struct Cluster {
    dir: PathBuf,
    /// Where to connect.
    pub(crate) url: String,
}

impl Cluster {
    /// A cluster of `test`'s own, or `None` (after saying so) on a machine
    /// without the `PostgreSQL` server binaries that is not CI: a server
    /// reached through a URL cannot be stopped and started by the test.
    ///
    /// # Panics
    ///
    /// When `CI` is set and there are no server binaries.
    pub(crate) fn start_or_skip(test: &str) -> Option<Self> {
        if server_binaries_present() {
            return Some(Self::start(test));
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: CI is set but there is no initdb on PATH or under /usr/lib/postgresql"
        );
        eprintln!("SKIPPED {test}: no PostgreSQL server binaries to start a cluster with");
        None
    }

    fn script() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-cluster")
    }

    fn run(command: &str, dir: &PathBuf) -> String {
        let output = Command::new(Self::script())
            .arg(command)
            .arg(dir)
            .output()
            .expect("scripts/pg-cluster runs");
        assert!(
            output.status.success(),
            "pg-cluster {command}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8(output.stdout).unwrap().trim().to_owned()
    }

    pub(crate) fn start(test: &str) -> Self {
        let dir = std::env::temp_dir().join(unique_schema(test));
        let url = Self::run("start", &dir);
        Self { dir, url }
    }

    pub(crate) fn pause(&self) {
        Self::run("pause", &self.dir);
    }

    pub(crate) fn resume(&self) {
        Self::run("resume", &self.dir);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(Self::script())
            .arg("stop")
            .arg(&self.dir)
            .output();
    }
}

/// Whether `scripts/pg-cluster` can find `initdb`: on `PATH`, or where
/// Debian's packages put it.
fn server_binaries_present() -> bool {
    let on_path = std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join("initdb").is_file()));
    on_path
        || std::fs::read_dir("/usr/lib/postgresql").is_ok_and(|versions| {
            versions
                .flatten()
                .any(|version| version.path().join("bin/initdb").is_file())
        })
}
