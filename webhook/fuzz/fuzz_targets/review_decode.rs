//! Fuzzes the AdmissionReview decoder: any byte string must map to one of
//! the documented outcomes (request, refusal with the uid, or a decode
//! error), never a panic; and whatever is answered must encode.
#![no_main]

use baton_webhook::review::{Decoded, decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match decode(data) {
        Ok(Decoded::Request(request)) => {
            let _ =
                baton_webhook::review::typed_object::<k8s_openapi::api::core::v1::Pod>(&request);
        }
        Ok(Decoded::Refused(response)) => {
            assert!(!response.uid.is_empty());
            let _ = encode(*response);
        }
        Err(_) => {}
    }
});
