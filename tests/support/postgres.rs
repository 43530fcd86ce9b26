//! Where the `PostgreSQL` tests find their server, and a fresh schema each.
//!
//! `scripts/test` starts a throwaway cluster and exports its URL as
//! `TOLLGATE_TEST_DATABASE_URL`. Without it a `PostgreSQL` test says loudly
//! that it was skipped and passes, so `cargo test` works on a laptop with
//! no `PostgreSQL`; with `CI` set it fails instead, so a CI run can never pass
//! without having run them.

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
