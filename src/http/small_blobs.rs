//! A plain `GET` of a small blob kept in memory (an initrd piece, a signature, a
//! manifest), answered before routing: axum's router, its extractors and the metrics
//! middleware were about a quarter of such a request's CPU, the difference between 0.7-0.9x
//! nginx's rate and 1.0-1.1x (BENCHMARKS.md). The answer and its count in `/metrics` are
//! the router's; anything else (HEAD, a range, a condition, a boot's download, a blob
//! not in memory, a malformed path) goes to the router as before.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::HttpBody;
use axum::http::{Method, Request, header};
use axum::response::Response;
use futures_util::future::Either;

use super::AppState;
use crate::api::Digest;
use crate::metrics::HttpRouteCounters;

/// The blob route's template, as the router matches it and `/metrics` labels it.
pub const ROUTE: &str = "/blobs/sha256/{hex}";

/// What answers small blobs before routing.
pub struct SmallBlobs {
    state: AppState,
    /// The route's `GET`/2xx series, looked up once.
    counted: HttpRouteCounters,
}

impl SmallBlobs {
    /// `None` with an object store: its cache marks each blob it serves on disk (the
    /// eviction order), which only the router's path does.
    pub fn new(state: &AppState) -> Option<Arc<Self>> {
        if state.registry.shared.is_some() {
            return None;
        }
        let counted = state.metrics.http_route(ROUTE, "GET", 200);
        Some(Arc::new(Self {
            state: state.clone(),
            counted,
        }))
    }

    /// The answer to `req` if it is a whole, unconditional `GET` of a small blob kept in
    /// memory, with no query (a boot's download is recorded for its boot) and no body.
    fn answer<B: HttpBody>(&self, req: &Request<B>) -> Option<Response> {
        let started = std::time::Instant::now();
        let hex = req.uri().path().strip_prefix("/blobs/sha256/")?;
        let headers = req.headers();
        let plain = req.method() == Method::GET
            && req.uri().query().is_none()
            && req.body().is_end_stream()
            && !headers.contains_key(header::RANGE)
            && !headers.contains_key(header::IF_RANGE)
            && !headers.contains_key(header::IF_NONE_MATCH);
        if !plain {
            return None;
        }
        let digest = Digest::from_hex(hex).ok()?;
        let response = super::blobs::kept_whole(&self.state, &digest)?;
        let bytes = response.body().size_hint().exact().unwrap_or(0);
        self.counted.record(bytes, started.elapsed().as_secs_f64());
        Some(response)
    }
}

/// `inner` (the router) behind `SmallBlobs`, where there are any.
#[derive(Clone)]
pub struct SmallBlobsFirst<S> {
    inner: S,
    small: Option<Arc<SmallBlobs>>,
}

impl<S> SmallBlobsFirst<S> {
    pub fn new(inner: S, small: Option<Arc<SmallBlobs>>) -> Self {
        Self { inner, small }
    }
}

impl<S, B> tower::Service<Request<B>> for SmallBlobsFirst<S>
where
    S: tower::Service<Request<B>, Response = Response, Error = Infallible>,
    B: HttpBody,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Either<std::future::Ready<Result<Response, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        match self.small.as_ref().and_then(|small| small.answer(&req)) {
            Some(response) => Either::Left(std::future::ready(Ok(response))),
            None => Either::Right(self.inner.call(req)),
        }
    }
}
