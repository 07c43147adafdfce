//! Errors answered as RabbitMQ does: `{"error","reason"}` with a status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::NodeError;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    error: &'static str,
    reason: String,
}

impl ApiError {
    pub fn new(status: StatusCode, error: &'static str, reason: impl Into<String>) -> Self {
        Self { status, error, reason: reason.into() }
    }
    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", reason)
    }
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "Object Not Found", "Not Found")
    }
}

impl From<NodeError> for ApiError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::NoSuchQueue(_) | NodeError::NotFound(_) => Self::not_found(),
            NodeError::Invalid(r) | NodeError::Conflict(r) => Self::bad_request(r),
            NodeError::Refused(r) => Self::new(StatusCode::BAD_REQUEST, "bad_request", r),
            other => Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({"error": self.error, "reason": self.reason}))).into_response()
    }
}
