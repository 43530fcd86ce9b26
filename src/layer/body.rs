//! The layer's response body: the inner body, or a rendered denial.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Buf;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio_util::sync::DropGuard;

/// The bytes of a rendered denial: what a [`DenyRenderer`](super::DenyRenderer)
/// puts in its response.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DenyBody(Vec<u8>);

impl DenyBody {
    /// A body holding `bytes`.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// The body's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for DenyBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DenyBody")
            .field(&String::from_utf8_lossy(&self.0))
            .finish()
    }
}

pin_project! {
    /// The body of every response a [`Tollgate`](super::Tollgate) returns:
    /// the inner service's body untouched, or a denial's bytes as one data
    /// frame of the inner body's data type (which must convert from a
    /// `Vec<u8>`, as `Bytes` does).
    pub struct TollgateBody<B> {
        #[pin]
        kind: Kind<B>,
        // Cancels the request's token if the body is dropped before its
        // end: its client left mid-stream. Disarmed at the end.
        cancel_on_drop: Option<StreamGuard>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Denial { bytes: Option<Vec<u8>> },
    }
}

impl<B> TollgateBody<B> {
    /// Wraps the inner service's body.
    pub fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
            cancel_on_drop: None,
        }
    }

    /// Wraps the inner service's body, which is not at its end yet, so that
    /// dropping it before the end cancels the request's token. `length` is
    /// the length the response declares, if any: a server stops reading a
    /// body once it has sent that many bytes.
    pub(super) fn streaming(body: B, guard: DropGuard, length: Option<u64>) -> Self {
        Self {
            kind: Kind::Inner { body },
            cancel_on_drop: Some(StreamGuard {
                guard,
                left: length,
            }),
        }
    }

    /// A denial's body.
    pub fn denial(body: DenyBody) -> Self {
        let bytes = (!body.0.is_empty()).then_some(body.0);
        Self {
            kind: Kind::Denial { bytes },
            cancel_on_drop: None,
        }
    }

    /// Whether this body is a denial rendered by the layer.
    pub fn is_denial(&self) -> bool {
        matches!(self.kind, Kind::Denial { .. })
    }
}

/// An empty inner body: what a layer outside builds its own responses with
/// (tower-http's `Timeout` answers a request that ran too long with an
/// empty body of the service's type).
impl<B: Default> Default for TollgateBody<B> {
    fn default() -> Self {
        Self::inner(B::default())
    }
}

impl<B> Body for TollgateBody<B>
where
    B: Body,
    B::Data: From<Vec<u8>>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        match this.kind.project() {
            KindProj::Inner { mut body } => {
                if this.cancel_on_drop.is_none() {
                    return body.poll_frame(cx);
                }
                let frame = body.as_mut().poll_frame(cx);
                let ended = match (&frame, this.cancel_on_drop.as_mut()) {
                    (Poll::Ready(None), _) => true,
                    (Poll::Ready(Some(Ok(frame))), Some(stream)) => {
                        if let (Some(left), Some(data)) = (stream.left.as_mut(), frame.data_ref()) {
                            let sent = u64::try_from(data.remaining()).unwrap_or(u64::MAX);
                            *left = left.saturating_sub(sent);
                        }
                        // Trailers are always a body's last frame.
                        frame.is_trailers() || body.is_end_stream() || stream.left == Some(0)
                    }
                    // An error ends nothing: whatever feeds the body has
                    // no reader left once it is dropped.
                    _ => false,
                };
                if ended && let Some(stream) = this.cancel_on_drop.take() {
                    stream.guard.disarm();
                }
                frame
            }
            KindProj::Denial { bytes } => {
                Poll::Ready(bytes.take().map(|bytes| Ok(Frame::data(bytes.into()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Denial { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Denial { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |bytes| bytes.len() as u64))
            }
        }
    }
}

/// A streaming body's hold on the request's cancellation token.
struct StreamGuard {
    guard: DropGuard,
    /// Bytes still to send of a declared length.
    left: Option<u64>,
}

impl<B> fmt::Debug for TollgateBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner { .. } => f
                .debug_struct("TollgateBody::Inner")
                .field("cancels_if_dropped", &self.cancel_on_drop.is_some())
                .finish_non_exhaustive(),
            Kind::Denial { bytes } => f
                .debug_struct("TollgateBody::Denial")
                .field("len", &bytes.as_ref().map_or(0, Vec::len))
                .finish(),
        }
    }
}
