//! What handlers see: the [`Admitted`] extractor for axum.

use std::fmt;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;

use super::service::Admitted;

/// The rejection when a handler asks for [`Admitted`] but no tollgate layer
/// admitted the request: the route is not behind the layer. It is a server
/// misconfiguration, so it answers 500 and says which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingAdmission;

impl fmt::Display for MissingAdmission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("this route reads tollgate's admission but is not behind a TollgateLayer")
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
            .copied()
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
