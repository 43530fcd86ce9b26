//! Log lines captured from the `tracing` events of the current thread.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tracing::subscriber::DefaultGuard;

/// What the capture has heard so far, as plain text (no colours).
#[derive(Clone, Default)]
pub(crate) struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Starts hearing this thread's events until the guard drops. A task on
    /// a current-thread runtime driven from this thread is heard too.
    pub(crate) fn capture() -> (Self, DefaultGuard) {
        // While one dispatcher is registered, `tracing` takes a callsite's
        // interest from whichever thread hits it first: a test without a
        // capture could then silence a callsite for this one. A second
        // dispatcher, kept for the whole run, makes every registration ask
        // all of them.
        static ALSO_REGISTERED: OnceLock<tracing::Dispatch> = OnceLock::new();
        ALSO_REGISTERED.get_or_init(|| tracing::Dispatch::new(tracing_subscriber::registry()));
        let logs = Self::default();
        let guard = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(logs.clone())
                .with_ansi(false)
                .finish(),
        );
        (logs, guard)
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }

    /// The captured lines that contain `needle`.
    pub(crate) fn lines_with(&self, needle: &str) -> Vec<String> {
        Self::lines(&self.text(), needle)
    }

    /// The lines of `text` that contain `needle`.
    pub(crate) fn lines(text: &str, needle: &str) -> Vec<String> {
        text.lines()
            .filter(|line| line.contains(needle))
            .map(str::to_owned)
            .collect()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl tracing_subscriber::fmt::MakeWriter<'_> for Logs {
    type Writer = Self;

    fn make_writer(&self) -> Self::Writer {
        self.clone()
    }
}
