//! The body read deadline (config `http.body_timeout_s`; docs/torpord.md, "Connections"): a
//! request's body must arrive whole within this of its headers, or the request is answered
//! `408 Request Timeout` with one JSON error line and its connection is closed. Without it a
//! client that sent its headers in time could trickle a body (an invoke's may be 63 MiB) for
//! ever, holding a connection, a task and a growing buffer.
//!
//! hyper has a timer for the headers only (crate::connections), so the body is wrapped here:
//! [`TimedBody`] passes the frames through and, once the deadline has passed while the reader
//! waits for more, ends the body with an error and marks the request; the middleware then
//! answers 408 whatever the handler's extractor made of the broken body (400, 413…). A handler
//! that does not read the body is not affected, nor is the time a handler takes after reading.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};

use super::ApiError;

/// The body of a request, ended with an error once `deadline` has passed while its reader waits.
struct TimedBody {
    inner: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
    timed_out: Arc<AtomicBool>,
}

/// The error a body ends with when its deadline passes.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within the body timeout")]
struct BodyTimedOut;

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.timed_out.store(true, Ordering::Relaxed);
                Poll::Ready(Some(Err(axum::Error::new(BodyTimedOut))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The middleware: wraps the body, and answers 408 when its deadline passed.
pub async fn limit(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    let timed_out = Arc::new(AtomicBool::new(false));
    let req = req.map(|inner| {
        Body::new(TimedBody {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timed_out: Arc::clone(&timed_out),
        })
    });
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let res = next.run(req).await;
    if !timed_out.load(Ordering::Relaxed) {
        return res;
    }
    tracing::warn!(%method, %path, timeout_s = timeout.as_secs_f64(), "refused a request whose body did not arrive in time");
    let mut res = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        format!(
            "the request body did not arrive within {} s of its headers: send the whole body at \
             once (the limit is torpord's http.body_timeout_s)",
            timeout.as_secs_f64()
        ),
    )
    .into_response();
    // The rest of the body may still come: the connection cannot carry another request.
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}
