//! Decoding AdmissionReview bodies and encoding the answers.
//!
//! The decoder never panics and never fails "silently": it sorts every input
//! into one of three cases, which decide what goes back to the API server.
//!
//! * [`Decoded::Request`]: a well-formed review. The handler answers HTTP 200
//!   with an `AdmissionResponse` carrying the request's `uid`.
//! * [`Decoded::Refused`]: a review whose `uid` we could read but whose
//!   request is unusable (object missing or not decodable). We still answer
//!   HTTP 200 with `allowed: false` and a message naming the problem: the
//!   API server shows that message to the user verbatim.
//! * [`DecodeError`]: no `uid` can be recovered (not JSON, not an
//!   AdmissionReview, no `request`). There is no valid AdmissionResponse to
//!   write (the API server rejects a response whose `uid` differs from the
//!   request's), so the server answers HTTP 400 with the message as text; the
//!   API server treats that as a failed call and applies `failurePolicy`.
//!   A real API server never sends such a body, so this only matters for
//!   fuzzers and misconfigured clients.
//!
//! `admission.k8s.io/v1` is what Baton registers; `v1beta1` has the same
//! shape and is accepted too (the answer echoes the request's apiVersion).

use kube::core::{
    DynamicObject, TypeMeta,
    admission::{AdmissionRequest, AdmissionResponse, AdmissionReview},
};
use serde::de::DeserializeOwned;

/// Accepted `apiVersion`s of the AdmissionReview envelope.
pub const API_VERSIONS: &[&str] = &["admission.k8s.io/v1", "admission.k8s.io/v1beta1"];

/// Why a body could not be turned into a request we can answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("request body is not JSON: {0}")]
    NotJson(String),
    #[error("request body is not an AdmissionReview (kind {kind:?}, apiVersion {api_version:?})")]
    NotAdmissionReview { kind: String, api_version: String },
    #[error("AdmissionReview has no request (or no request.uid)")]
    NoRequest,
}

/// The outcome of decoding a body.
#[derive(Debug)]
pub enum Decoded {
    Request(Box<AdmissionRequest<DynamicObject>>),
    /// Envelope readable, request unusable: answer with this denial.
    Refused(Box<AdmissionResponse>),
}

/// Decodes an AdmissionReview body. Pure and total: every byte string maps to
/// one of the documented outcomes (this is the cargo-fuzz target).
pub fn decode(body: &[u8]) -> Result<Decoded, DecodeError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| DecodeError::NotJson(e.to_string()))?;
    let kind = value
        .get("kind")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let api_version = value
        .get("apiVersion")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    if kind != "AdmissionReview" || !API_VERSIONS.contains(&api_version) {
        return Err(DecodeError::NotAdmissionReview {
            kind: kind.to_owned(),
            api_version: api_version.to_owned(),
        });
    }
    let types = TypeMeta {
        api_version: api_version.to_owned(),
        kind: kind.to_owned(),
    };
    let uid = value
        .get("request")
        .and_then(|r| r.get("uid"))
        .and_then(|u| u.as_str())
        .filter(|u| !u.is_empty())
        .ok_or(DecodeError::NoRequest)?
        .to_owned();
    let refused = |message: String| {
        let mut response = AdmissionResponse::invalid(message);
        response.uid = uid.clone();
        response.types = types.clone();
        Ok(Decoded::Refused(Box::new(response)))
    };
    let review: AdmissionReview<DynamicObject> = match serde_json::from_value(value) {
        Ok(review) => review,
        Err(e) => return refused(format!("malformed AdmissionReview request: {e}")),
    };
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(e) => return refused(e.to_string()),
    };
    Ok(Decoded::Request(Box::new(request)))
}

/// Reads the request's object as a typed resource `K`, with a message fit for
/// a denial when it is absent or does not decode.
pub fn typed_object<K: DeserializeOwned>(
    request: &AdmissionRequest<DynamicObject>,
) -> Result<K, String> {
    let object = request.object.as_ref().ok_or_else(|| {
        format!(
            "AdmissionReview request {} for {} has no object",
            request.uid, request.kind.kind
        )
    })?;
    typed(object).map_err(|e| format!("{} object does not decode: {e}", request.kind.kind))
}

/// Same as [`typed_object`] for `oldObject` (UPDATE requests); `None` if absent.
pub fn typed_old_object<K: DeserializeOwned>(
    request: &AdmissionRequest<DynamicObject>,
) -> Option<K> {
    request.old_object.as_ref().and_then(|o| typed(o).ok())
}

fn typed<K: DeserializeOwned>(object: &DynamicObject) -> Result<K, serde_json::Error> {
    serde_json::to_value(object).and_then(serde_json::from_value)
}

/// Serializes a response into the review body the API server expects.
///
/// kube serializes `patch` (a `Vec<u8>`) as a JSON array of numbers; Go's
/// `[]byte` convention, and what every API server documents, is a base64
/// string (4x smaller, too), so the patch is re-encoded here.
pub fn encode(response: AdmissionResponse) -> Vec<u8> {
    let patch = response.patch.clone();
    let review = response.into_review();
    let mut value = match serde_json::to_value(&review) {
        Ok(v) => v,
        // Only strings, maps and bytes inside: cannot fail; stay total anyway.
        Err(_) => return FALLBACK.to_vec(),
    };
    if let (Some(patch), Some(slot)) = (patch, value.pointer_mut("/response/patch")) {
        *slot = serde_json::Value::String(base64(&patch));
    }
    serde_json::to_vec(&value).unwrap_or_else(|_| FALLBACK.to_vec())
}

const FALLBACK: &[u8] = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"","allowed":false}}"#;

/// Standard base64 with padding (RFC 4648 section 4).
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(request: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": request,
        }))
        .unwrap()
    }

    fn pod_request(object: serde_json::Value) -> serde_json::Value {
        serde_json::json!({
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "apps",
            "operation": "CREATE",
            "userInfo": {"username": "admin"},
            "object": object,
        })
    }

    #[test]
    fn decodes_a_pod_review_and_keeps_the_api_version() {
        let body = review(pod_request(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "app", "image": "app"}]}
        })));
        let Decoded::Request(request) = decode(&body).unwrap() else {
            panic!("expected a request");
        };
        assert_eq!(request.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(request.types.api_version, "admission.k8s.io/v1");
        let pod: k8s_openapi::api::core::v1::Pod = typed_object(&request).unwrap();
        assert_eq!(pod.spec.unwrap().containers[0].name, "app");
    }

    #[test]
    fn rejects_bodies_that_are_not_json() {
        assert!(matches!(decode(b"{not json"), Err(DecodeError::NotJson(_))));
        assert!(matches!(decode(b""), Err(DecodeError::NotJson(_))));
    }

    #[test]
    fn rejects_json_that_is_not_an_admission_review() {
        let err = decode(br#"{"kind":"Pod","apiVersion":"v1"}"#).unwrap_err();
        assert_eq!(
            err,
            DecodeError::NotAdmissionReview {
                kind: "Pod".into(),
                api_version: "v1".into()
            }
        );
        assert!(decode(b"[1,2]").is_err());
        assert!(decode(b"null").is_err());
    }

    #[test]
    fn a_review_without_request_uid_cannot_be_answered() {
        let body = br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1"}"#;
        assert_eq!(decode(body).unwrap_err(), DecodeError::NoRequest);
        let body = review(serde_json::json!({"uid": ""}));
        assert_eq!(decode(&body).unwrap_err(), DecodeError::NoRequest);
    }

    #[test]
    fn a_malformed_request_with_a_uid_is_refused_with_that_uid() {
        // `operation` has an unknown value and `kind` is missing.
        let body = review(serde_json::json!({"uid": "u-1", "operation": "EXPLODE"}));
        let Decoded::Refused(response) = decode(&body).unwrap() else {
            panic!("expected a refusal");
        };
        assert_eq!(response.uid, "u-1");
        assert!(!response.allowed);
        assert!(
            response
                .result
                .message
                .contains("malformed AdmissionReview")
        );
        let encoded: serde_json::Value = serde_json::from_slice(&encode(*response)).unwrap();
        assert_eq!(encoded["response"]["uid"], "u-1");
        assert_eq!(encoded["apiVersion"], "admission.k8s.io/v1");
    }

    #[test]
    fn a_request_without_object_yields_a_clear_message() {
        let mut request = pod_request(serde_json::Value::Null);
        request.as_object_mut().unwrap().remove("object");
        let Decoded::Request(request) = decode(&review(request)).unwrap() else {
            panic!("expected a request");
        };
        let err = typed_object::<k8s_openapi::api::core::v1::Pod>(&request).unwrap_err();
        assert!(err.contains("has no object"), "{err}");
    }

    #[test]
    fn an_object_of_the_wrong_shape_yields_a_clear_message() {
        let body = review(pod_request(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": "not-a-list"}
        })));
        let Decoded::Request(request) = decode(&body).unwrap() else {
            panic!("expected a request");
        };
        let err = typed_object::<k8s_openapi::api::core::v1::Pod>(&request).unwrap_err();
        assert!(err.contains("Pod object does not decode"), "{err}");
    }

    #[test]
    fn base64_matches_the_rfc_4648_test_vectors() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded);
        }
    }

    #[test]
    fn a_patch_is_encoded_as_a_base64_string() {
        let body = review(pod_request(serde_json::json!({"metadata": {"name": "p"}})));
        let Decoded::Request(request) = decode(&body).unwrap() else {
            panic!("expected a request");
        };
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::json!([{"op": "add", "path": "/x", "value": 1}]))
                .unwrap();
        let response = AdmissionResponse::from(request.as_ref())
            .with_patch(patch)
            .unwrap();
        let encoded: serde_json::Value = serde_json::from_slice(&encode(response)).unwrap();
        assert_eq!(
            encoded["response"]["patch"],
            base64(br#"[{"op":"add","path":"/x","value":1}]"#)
        );
        assert_eq!(encoded["response"]["patchType"], "JSONPatch");
    }

    /// A bounded, deterministic stand-in for the cargo-fuzz target (which
    /// needs nightly): thousands of mutations of a valid review, each
    /// decoded and, when answerable, encoded. Must never panic.
    #[test]
    fn the_decoder_survives_thousands_of_mutated_reviews() {
        let seed = review(pod_request(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"a": "b"}},
            "spec": {"containers": [{"name": "app", "image": "app", "env": [{"name": "X", "value": "1"}]}]}
        })));
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let interesting = [
            b'"', b'{', b'}', b'[', b']', b':', b',', b'0', b'\\', 0xff, b'n',
        ];
        let (mut requests, mut refused, mut errors) = (0, 0, 0);
        for _ in 0..5_000 {
            let mut input = seed.clone();
            for _ in 0..(next() % 4 + 1) {
                if input.is_empty() {
                    break;
                }
                let at = (next() as usize) % input.len();
                match next() % 3 {
                    0 => input[at] = interesting[(next() as usize) % interesting.len()],
                    1 => {
                        input.remove(at);
                    }
                    _ => input.truncate(at.max(1)),
                }
            }
            match decode(&input) {
                Ok(Decoded::Request(r)) => {
                    requests += 1;
                    let _ = typed_object::<k8s_openapi::api::core::v1::Pod>(&r);
                    let _ = encode(AdmissionResponse::from(r.as_ref()));
                }
                Ok(Decoded::Refused(r)) => {
                    refused += 1;
                    assert!(!r.uid.is_empty());
                    let _ = encode(*r);
                }
                Err(_) => errors += 1,
            }
        }
        // The mutations reach all three outcomes.
        assert!(requests > 0 && errors > 0, "{requests} {refused} {errors}");
    }

    #[test]
    fn v1beta1_reviews_are_answered_in_v1beta1() {
        let mut body: serde_json::Value = serde_json::from_slice(&review(pod_request(
            serde_json::json!({"metadata": {"name": "p"}}),
        )))
        .unwrap();
        body["apiVersion"] = "admission.k8s.io/v1beta1".into();
        let Decoded::Request(request) = decode(&serde_json::to_vec(&body).unwrap()).unwrap() else {
            panic!("expected a request");
        };
        let response = AdmissionResponse::from(request.as_ref());
        let encoded: serde_json::Value = serde_json::from_slice(&encode(response)).unwrap();
        assert_eq!(encoded["apiVersion"], "admission.k8s.io/v1beta1");
        assert_eq!(encoded["response"]["allowed"], true);
    }
}
