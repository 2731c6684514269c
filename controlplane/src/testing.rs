//! Test support: kube's tower-test mock API server, driven request by
//! request (the way controller-rs tests reconcilers): [`expect`] the next
//! request's method and path, [`reply`] with a status and JSON body,
//! [`status`] for an API Status.

use http::{Request, Response};
use kube::Client;
use kube::client::Body;

/// The test's end of the mock API server.
pub type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;
/// How one request is answered.
pub type Send = tower_test::mock::SendResponse<Response<Body>>;

/// A client whose every request goes to the returned [`Handle`].
pub fn mock_client() -> (Client, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), handle)
}

/// Waits for the next request, asserts its method and path, and returns
/// its JSON body (`Null` when empty) with the means to answer it.
pub async fn expect(handle: &mut Handle, method: &str, path: &str) -> (serde_json::Value, Send) {
    let (request, send) = handle.next_request().await.expect("a request");
    assert_eq!(request.method().as_str(), method, "{}", request.uri());
    assert_eq!(request.uri().path(), path);
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (body, send)
}

/// Answers with `code` and `body` as JSON.
pub fn reply(send: Send, code: u16, body: &serde_json::Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(body).unwrap()))
            .unwrap(),
    );
}

/// The API server's Status body for a failed request.
pub fn status(code: u16, reason: &str) -> serde_json::Value {
    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                       "code": code, "reason": reason, "message": reason})
}
