//! Counts the yields a future takes: polls that return pending after waking
//! their own task, as a future does to let its caller look at the world
//! before it goes on (I37).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};

/// `future`, counting its yields in `yields`.
pub(crate) fn counting_yields<F: Future>(
    future: F,
    yields: Arc<AtomicUsize>,
) -> impl Future<Output = F::Output> {
    let mut future = Box::pin(future);
    std::future::poll_fn(move |cx| {
        let counting = Arc::new(CountingWaker {
            inner: cx.waker().clone(),
            wakes: AtomicUsize::new(0),
        });
        let waker = Waker::from(Arc::clone(&counting));
        let polled = future.as_mut().poll(&mut Context::from_waker(&waker));
        // Read as the poll returns: on a current-thread runtime nothing
        // else runs in between, so every wake counted so far came from
        // inside the poll.
        if polled.is_pending() && counting.wakes.load(Ordering::SeqCst) > 0 {
            yields.fetch_add(1, Ordering::SeqCst);
        }
        polled
    })
}

/// Forwards wakes to the task's waker, counting them.
struct CountingWaker {
    inner: Waker,
    wakes: AtomicUsize,
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.inner.wake_by_ref();
    }
}

/// Polls `future` once with a waker that does nothing; `Some` if it
/// completed. Also how many times it woke itself in that poll.
pub(crate) fn poll_by_hand<F: Future + ?Sized>(future: Pin<&mut F>) -> (Option<F::Output>, usize) {
    let counting = Arc::new(CountingWaker {
        inner: Waker::noop().clone(),
        wakes: AtomicUsize::new(0),
    });
    let waker = Waker::from(Arc::clone(&counting));
    let polled = future.poll(&mut Context::from_waker(&waker));
    let woken = counting.wakes.load(Ordering::SeqCst);
    (
        match polled {
            Poll::Ready(output) => Some(output),
            Poll::Pending => None,
        },
        woken,
    )
}
