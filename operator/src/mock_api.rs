//! Test support: kube's tower-test mock API server with a recorder, the way
//! controller-rs tests reconcilers. Each request is decoded into a [`Seen`]
//! (method, URI, content type, JSON body), recorded, and answered by the
//! test's `respond` closure.

use std::sync::{Arc, Mutex};

use http::{Method, Request, Response};
use kube::client::Body;

pub type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// One request the fake API server received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub uri: String,
    pub content_type: String,
    pub body: serde_json::Value,
}

/// Serves until the client is dropped, answering each request with
/// `respond` (status, JSON body); returns the log of every request.
pub fn serve(
    mut handle: Handle,
    respond: impl Fn(&Seen) -> (u16, serde_json::Value) + Send + 'static,
) -> Arc<Mutex<Vec<Seen>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let method = request.method().clone();
            let uri = request.uri().to_string();
            let content_type = request
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let bytes = request.into_body().collect_bytes().await.unwrap();
            let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
            let s = Seen {
                method,
                uri,
                content_type,
                body,
            };
            log.lock().unwrap().push(s.clone());
            let (code, value) = respond(&s);
            let response = Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(&value).unwrap()))
                .unwrap();
            send.send_response(response);
        }
    });
    seen
}
