//! What handlers see: the [`Admitted`] extractor for axum.

use std::fmt;

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use super::body::DenyBody;
use super::deferred::{NOT_ADMITTED, PendingCharge, yield_once};
use super::service::Admitted;

/// Runs the extractor `T`, then commits the request's deferred charge: the
/// commit point for a handler whose work starts only once its input is
/// valid.
///
/// With [`TollgateBuilder::commit_in_handler`](super::TollgateBuilder::commit_in_handler),
/// a request whose `T` rejects never starts its handler, so its charge is
/// released for zero when the request ends (I4); a request whose `T`
/// succeeds is charged in full before the handler body runs (I3), after one
/// yield if it came over HTTP/2 or waited (I37). If the
/// commit is refused the rejection renders the layer's denial. Without a
/// pending charge (the layer commits at the hand-over, or a
/// [`CommitMarkerLayer`](super::CommitMarkerLayer) already committed) it
/// is `T` alone. On a route no tollgate layer admitted it refuses with
/// [`MissingAdmission`] (500) before `T` runs, so the handler never runs
/// unmetered.
///
/// ```no_run
/// use tollgate::layer::Charged;
///
/// async fn handler(Charged(body): Charged<String>) -> String {
///     body
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charged<T>(pub T);

/// Why a [`Charged`] extractor refused the request.
#[derive(Debug)]
pub enum ChargedRejection<R> {
    /// The inner extractor rejected. This extractor charged nothing; in
    /// the default commit mode the layer committed at the hand-over, so
    /// the request pays all the same.
    Inner(R),
    /// No tollgate layer admitted the request.
    NotAdmitted(MissingAdmission),
    /// The inner extractor succeeded but the commit was refused; the
    /// layer's rendered denial.
    Denied(http::Response<DenyBody>),
}

impl<R: IntoResponse> IntoResponse for ChargedRejection<R> {
    fn into_response(self) -> Response {
        match self {
            Self::Inner(rejection) => rejection.into_response(),
            Self::NotAdmitted(missing) => missing.into_response(),
            Self::Denied(denial) => {
                denial.map(|body| axum::body::Body::from(body.as_bytes().to_vec()))
            }
        }
    }
}

/// `T: Send` because the extracted value is held across the yield a request
/// may owe before its commit (I37).
impl<S, T> FromRequest<S> for Charged<T>
where
    S: Send + Sync,
    T: FromRequest<S> + Send,
{
    type Rejection = ChargedRejection<T::Rejection>;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let pending = request.extensions().get::<PendingCharge>().cloned();
        if pending.is_none() && request.extensions().get::<Admitted>().is_none() {
            return Err(ChargedRejection::NotAdmitted(MissingAdmission));
        }
        let value = T::from_request(request, state)
            .await
            .map_err(ChargedRejection::Inner)?;
        // I4, I37: a request that came over HTTP/2, or waited on its way
        // here or in `T` (for a limit's place, say), yields once before it
        // commits, so that a server which polls it before looking for its
        // client's reset can drop it unpaid (see `CommitMarker`). After `T`,
        // so that a wait inside it is covered too; a client that leaves
        // while its body is still arriving fails the extraction instead.
        if pending
            .as_ref()
            .is_some_and(|PendingCharge(cell)| cell.yield_owed())
        {
            yield_once().await;
        }
        if let Some(denial) = pending.and_then(|PendingCharge(cell)| cell.commit()) {
            return Err(ChargedRejection::Denied(denial));
        }
        Ok(Self(value))
    }
}

/// The rejection when a handler asks for [`Admitted`] but no tollgate layer
/// admitted the request: the route is not behind the layer. It is a server
/// misconfiguration, so it answers 500 and says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingAdmission;

impl fmt::Display for MissingAdmission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(NOT_ADMITTED)
    }
}

impl std::error::Error for MissingAdmission {}

impl IntoResponse for MissingAdmission {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
    }
}

/// Reads the request's admission in a handler:
///
/// ```no_run
/// use tollgate::layer::Admitted;
///
/// async fn handler(admitted: Admitted) -> String {
///     format!("charged {} to {}", admitted.units, admitted.account_id)
/// }
/// ```
impl<S: Send + Sync> FromRequestParts<S> for Admitted {
    type Rejection = MissingAdmission;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Admitted>()
            .cloned()
            .ok_or(MissingAdmission)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_route_outside_the_layer_is_a_500_naming_the_cause() {
        let (mut parts, ()) = http::Request::new(()).into_parts();
        let rejection = Admitted::from_request_parts(&mut parts, &())
            .await
            .unwrap_err();
        let response = rejection.into_response();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(
            MissingAdmission
                .to_string()
                .contains("not behind a TollgateLayer")
        );
    }
}
