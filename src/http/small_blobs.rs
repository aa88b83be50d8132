//! A plain `GET` of a small blob kept in memory (an initrd piece, a signature, a
//! manifest), answered before routing: axum's router, its extractors and the metrics
//! middleware were about a third of such a request's CPU (a 7-byte blob 0.69-0.81x
//! nginx's rate before, 0.89-1.08x after; BENCHMARKS.md "Stop 46"). The answer and its
//! count in `/metrics` are the router's; anything else (HEAD, a range, a condition, a
//! boot's download, a blob not in memory, a malformed path) goes to the router as before.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::HttpBody;
use axum::http::{Method, Request, header};
use axum::response::Response;
use futures_util::future::Either;

use super::AppState;
use super::blob_maps::BlobMaps;
use crate::api::Digest;
use crate::image::blobstore::BlobStore;
use crate::metrics::{HttpRouteCounters, Metrics};

/// The blob route's template, as the router matches it and `/metrics` labels it (a test
/// holds it to the OpenAPI document's).
pub const ROUTE: &str = "/blobs/sha256/{hex}";

/// What answers kept small blobs before routing.
pub struct KeptBlobAnswers {
    maps: Arc<BlobMaps>,
    blobs: Arc<BlobStore>,
    /// The route's `GET`/2xx series, looked up once (so shown at 0 from the start).
    counted: HttpRouteCounters,
}

impl KeptBlobAnswers {
    /// `None` with an object store: its cache marks each blob it serves on disk (the
    /// eviction order), which only the router's path does.
    pub fn new(state: &AppState) -> Option<Arc<Self>> {
        if state.registry.shared.is_some() {
            return None;
        }
        let (maps, blobs) = (state.blob_maps.clone(), state.registry.blobs.clone());
        Some(Arc::new(Self::of(maps, blobs, &state.metrics)))
    }

    fn of(maps: Arc<BlobMaps>, blobs: Arc<BlobStore>, metrics: &Metrics) -> Self {
        let counted = metrics.http_route(ROUTE, "GET", 200);
        Self {
            maps,
            blobs,
            counted,
        }
    }

    /// The answer to `req` if it is a whole, unconditional `GET` of a small blob kept in
    /// memory and read since the store's last removal, with no query (a boot's download
    /// is recorded for its boot) and no body.
    fn answer<B: HttpBody>(&self, req: &Request<B>) -> Option<Response> {
        let prefix = ROUTE
            .strip_suffix("{hex}")
            .expect("the route ends in its digest");
        let hex = req.uri().path().strip_prefix(prefix)?;
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
        let started = std::time::Instant::now();
        let bytes = self.maps.small_unremoved(&digest, self.blobs.removals())?;
        let len = bytes.len() as u64;
        let response = super::blobs::whole_small(&digest, bytes);
        self.counted.record(len, started.elapsed().as_secs_f64());
        Some(response)
    }
}

/// `inner` (the router) behind `KeptBlobAnswers`, where there are any.
#[derive(Clone)]
pub struct KeptBlobsFirst<S> {
    inner: S,
    kept: Option<Arc<KeptBlobAnswers>>,
}

impl<S> KeptBlobsFirst<S> {
    pub fn new(inner: S, kept: Option<Arc<KeptBlobAnswers>>) -> Self {
        Self { inner, kept }
    }
}

impl<S, B> tower::Service<Request<B>> for KeptBlobsFirst<S>
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
        match self.kept.as_ref().and_then(|kept| kept.answer(&req)) {
            Some(response) => Either::Left(std::future::ready(Ok(response))),
            None => Either::Right(self.inner.call(req)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use std::io::Write as _;
    use tower::ServiceExt as _;

    /// A router that answers 418 to everything: what reaches it is told apart.
    fn teapot() -> impl tower::Service<
        Request<Body>,
        Response = Response,
        Error = Infallible,
        Future = impl Future<Output = Result<Response, Infallible>>,
    > + Clone {
        tower::service_fn(|_req: Request<Body>| async {
            Ok::<_, Infallible>(Response::builder().status(418).body(Body::empty()).unwrap())
        })
    }

    async fn status(
        service: &KeptBlobsFirst<
            impl tower::Service<Request<Body>, Response = Response, Error = Infallible> + Clone,
        >,
        req: Request<Body>,
    ) -> u16 {
        service
            .clone()
            .oneshot(req)
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    #[tokio::test]
    async fn only_a_plain_get_of_a_kept_blob_is_answered_before_the_router() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = Arc::new(BlobStore::open(dir.path()).unwrap());
        let mut writer = blobs.temp_writer().unwrap();
        writer.write_all(b"initrd\n").unwrap();
        let temp = writer.finish().unwrap();
        let digest = temp.digest;
        blobs.commit(vec![temp]).unwrap();
        let maps = Arc::new(BlobMaps::default());
        let file = std::fs::File::open(blobs.path_of(&digest)).unwrap();
        maps.read_small(&digest, &file, 7, blobs.removals())
            .unwrap();
        let metrics = Metrics::default();
        let kept = KeptBlobAnswers::of(maps, blobs.clone(), &metrics);
        let service = KeptBlobsFirst::new(teapot(), Some(Arc::new(kept)));
        let url = format!("/blobs/sha256/{}", digest.hex());
        let get = |uri: &str| Request::get(uri).body(Body::empty()).unwrap();

        assert_eq!(status(&service, get(&url)).await, 200, "answered here");
        let routed = [
            Request::head(&url).body(Body::empty()).unwrap(),
            Request::get(&url)
                .header("range", "bytes=0-1")
                .body(Body::empty())
                .unwrap(),
            Request::get(&url)
                .header("if-none-match", "*")
                .body(Body::empty())
                .unwrap(),
            Request::get(&url)
                .header("if-range", "\"x\"")
                .body(Body::empty())
                .unwrap(),
            Request::get(&url).body(Body::from("a body")).unwrap(),
            get(&format!("{url}?boot=0123456789abcdef")),
            get(&format!("{url}?")),
            get(&url.to_uppercase()),
            get(&format!("{url}/")),
            get(&format!("/blobs/sha256/{}", "0".repeat(64))),
        ];
        for req in routed {
            let what = format!("{} {} {:?}", req.method(), req.uri(), req.headers());
            assert_eq!(status(&service, req).await, 418, "{what}");
        }
        // A removal since it was kept: to the router, which looks at the store.
        blobs.remove_unreferenced(&Default::default()).unwrap();
        assert_eq!(status(&service, get(&url)).await, 418, "removed");
        // Without answers (an object store), everything is routed.
        let plain = KeptBlobsFirst::new(teapot(), None);
        assert_eq!(status(&plain, get(&url)).await, 418);
    }

    #[test]
    fn the_route_is_the_routers() {
        let doc = crate::http::openapi();
        assert!(doc.paths.paths.contains_key(ROUTE), "{ROUTE} is not routed");
    }
}
