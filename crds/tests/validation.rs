//! Every validation rule, exercised through both enforcers: the Rust
//! `Validate` (what the webhook runs; the only enforcement on clusters
//! without CEL) and the schema's CEL rules (what newer API servers run at
//! `kubectl apply`). Each case states which errors it expects from each, so
//! the two cannot drift apart silently.

mod support;

use serde_json::{Value, json};
use support::{cel_errors, object, rust_errors, set};

/// Asserts the Rust errors are exactly `rust` (by path prefix + message
/// fragment, `path: fragment`) and that the CEL errors contain `cel`
/// fragments (empty: CEL accepts).
fn check(kind: &str, obj: &Value, rust: &[&str], cel: &[&str]) {
    let r = rust_errors(kind, obj);
    assert_eq!(
        r.len(),
        rust.len(),
        "rust errors {r:#?}, expected {rust:#?}"
    );
    for (got, want) in r.iter().zip(rust) {
        let (path, frag) = want.split_once(": ").unwrap_or((want, ""));
        assert!(
            got.starts_with(&format!("{path}: ")) && got.contains(frag),
            "rust error {got:?} does not match {want:?}"
        );
    }
    let c = cel_errors(kind, obj);
    assert_eq!(c.len(), cel.len(), "cel errors {c:#?}, expected {cel:#?}");
    for want in cel {
        assert!(
            c.iter().any(|got| got.contains(want)),
            "no cel error contains {want:?}: {c:#?}"
        );
    }
}

// ---------------------------------------------------------------- Route

fn route() -> Value {
    object(
        "Route",
        json!({
            "parentRef": { "name": "reviews", "port": 9080 },
            "protocol": "http",
            "rules": [{
                "name": "api",
                "matches": [{
                    "path": { "type": "PathPrefix", "value": "/api" },
                    "method": "GET",
                    "headers": [{ "name": "x-canary", "value": "1" }],
                    "queryParams": [{ "type": "RegularExpression", "name": "v", "value": "^[0-9]+$" }]
                }],
                "backendRefs": [
                    { "name": "reviews-v1", "port": 9080, "weight": 90 },
                    { "name": "reviews-v2", "port": 9080, "weight": 10 }
                ],
                "timeout": "5s",
                "retries": { "attempts": 3, "perTryTimeout": "1s", "retryOn": ["5xx", "reset", "503"] },
                "fault": {
                    "delay": { "fixedDelay": "100ms", "percent": 5 },
                    "abort": { "httpStatus": 503, "percent": 1 }
                },
                "mirror": { "backendRef": { "name": "reviews-shadow", "port": 9080 }, "percent": 10 },
                "requestHeaderModifier": { "set": [{ "name": "x-route", "value": "api" }], "remove": ["x-debug"] },
                "responseHeaderModifier": { "add": [{ "name": "x-served-by", "value": "baton" }] }
            }, {
                "name": "rest",
                "backendRefs": [{ "name": "reviews-v1", "port": 9080 }]
            }]
        }),
    )
}

#[test]
fn accepts_a_route_using_every_feature() {
    check("Route", &route(), &[], &[]);
}

#[test]
fn accepts_a_backend_drained_to_weight_zero_when_another_has_weight() {
    let r = set(route(), "spec.rules.0.backendRefs.0.weight", json!(0));
    check("Route", &r, &[], &[]);
}

#[test]
fn rejects_route_with_zero_total_weight() {
    let r = set(route(), "spec.rules.0.backendRefs.0.weight", json!(0));
    let r = set(r, "spec.rules.0.backendRefs.1.weight", json!(0));
    check(
        "Route",
        &r,
        &["spec.rules[0].backendRefs: give at least one backend a weight above 0"],
        &["non-zero weight"],
    );
}

#[test]
fn rejects_duplicate_rule_names() {
    let r = set(route(), "spec.rules.1.name", json!("api"));
    check(
        "Route",
        &r,
        &["spec.rules[1].name: rule names must be unique"],
        &["rule names must be unique"],
    );
}

#[test]
fn rejects_a_path_regex_that_does_not_compile() {
    let r = set(
        route(),
        "spec.rules.0.matches.0.path",
        json!({ "type": "RegularExpression", "value": "/api/(v1" }),
    );
    check(
        "Route",
        &r,
        &["spec.rules[0].matches[0].path.value: is not a valid regular expression"],
        &[],
    );
}

#[test]
fn rejects_header_and_query_regexes_that_do_not_compile() {
    let r = set(
        route(),
        "spec.rules.0.matches.0.headers.0",
        json!({ "type": "RegularExpression", "name": "x-canary", "value": "[" }),
    );
    let r = set(r, "spec.rules.0.matches.0.queryParams.0.value", json!("*"));
    check(
        "Route",
        &r,
        &[
            "spec.rules[0].matches[0].headers[0].value: not a valid regular expression",
            "spec.rules[0].matches[0].queryParams[0].value: not a valid regular expression",
        ],
        &[],
    );
}

#[test]
fn rejects_exact_and_prefix_paths_not_starting_with_a_slash() {
    let r = set(
        route(),
        "spec.rules.0.matches.0.path",
        json!({ "type": "Exact", "value": "api" }),
    );
    check(
        "Route",
        &r,
        &["spec.rules[0].matches[0].path.value: must start with '/'"],
        &[],
    );
}

#[test]
fn rejects_percentages_above_100() {
    let r = set(route(), "spec.rules.0.fault.abort.percent", json!(101));
    let r = set(r, "spec.rules.0.fault.delay.percent", json!(150));
    let r = set(r, "spec.rules.0.mirror.percent", json!(200));
    check(
        "Route",
        &r,
        &[
            "spec.rules[0].fault.delay.percent: use 0-100",
            "spec.rules[0].fault.abort.percent: use 0-100",
            "spec.rules[0].mirror.percent: use 0-100",
        ],
        &[],
    );
}

#[test]
fn rejects_per_try_timeout_longer_than_the_rule_timeout() {
    let r = set(route(), "spec.rules.0.retries.perTryTimeout", json!("1m"));
    check(
        "Route",
        &r,
        &["spec.rules[0].retries.perTryTimeout: exceeds the rule timeout"],
        &["perTryTimeout must not exceed timeout"],
    );
}

#[test]
fn accepts_per_try_timeout_equal_to_the_rule_timeout() {
    let r = set(
        route(),
        "spec.rules.0.retries.perTryTimeout",
        json!("5000ms"),
    );
    check("Route", &r, &[], &[]);
}

#[test]
fn rejects_durations_outside_the_gateway_api_syntax() {
    let r = set(route(), "spec.rules.0.timeout", json!("1.5s"));
    let r = set(r, "spec.rules.0.fault.delay.fixedDelay", json!("2 seconds"));
    let r = set(r, "spec.rules.0.retries.perTryTimeout", json!(null));
    check(
        "Route",
        &r,
        &[
            "spec.rules[0].timeout: is not a duration",
            "spec.rules[0].fault.delay.fixedDelay: is not a duration",
        ],
        // the schema pattern rejects these before CEL runs on a real server;
        // here the CEL `duration()` call is never reached (no perTryTimeout)
        &[],
    );
}

#[test]
fn rejects_unknown_retry_conditions_and_lists_the_known_ones() {
    let r = set(
        route(),
        "spec.rules.0.retries.retryOn.1",
        json!("sometimes"),
    );
    check(
        "Route",
        &r,
        &[
            "spec.rules[0].retries.retryOn[1]: one of 5xx, gateway-error, reset, connect-failure, refused-stream, retriable-4xx",
        ],
        &[],
    );
}

#[test]
fn rejects_retry_attempts_above_ten() {
    let r = set(route(), "spec.rules.0.retries.attempts", json!(11));
    check(
        "Route",
        &r,
        &["spec.rules[0].retries.attempts: between 0 and 10"],
        &[],
    );
}

#[test]
fn rejects_abort_status_outside_200_to_599() {
    let r = set(route(), "spec.rules.0.fault.abort.httpStatus", json!(700));
    check(
        "Route",
        &r,
        &["spec.rules[0].fault.abort.httpStatus: use 200-599"],
        &[],
    );
}

#[test]
fn rejects_an_empty_fault() {
    let r = set(route(), "spec.rules.0.fault", json!({}));
    check(
        "Route",
        &r,
        &["spec.rules[0].fault: set delay, abort or both"],
        &[],
    );
}

#[test]
fn rejects_backend_names_that_are_not_service_names_and_bad_ports() {
    let r = set(
        route(),
        "spec.rules.0.backendRefs.0.name",
        json!("Reviews_V1"),
    );
    let r = set(r, "spec.rules.0.backendRefs.1.port", json!(0));
    let r = set(r, "spec.parentRef.port", json!(70000));
    check(
        "Route",
        &r,
        &[
            "spec.parentRef.port: use 1-65535",
            "spec.rules[0].backendRefs[0].name: is not a Service name",
            "spec.rules[0].backendRefs[1].port: use 1-65535",
        ],
        &[],
    );
}

#[test]
fn rejects_a_header_matched_twice_in_one_match() {
    let r = set(
        route(),
        "spec.rules.0.matches.0.headers.1",
        json!({ "name": "X-Canary", "value": "2" }),
    );
    check(
        "Route",
        &r,
        &["spec.rules[0].matches[0].headers[1].name: is matched twice"],
        &[],
    );
}

#[test]
fn rejects_header_modifiers_with_bad_names_or_crlf_values() {
    let r = set(
        route(),
        "spec.rules.0.requestHeaderModifier",
        json!({
            "set": [{ "name": "bad name", "value": "x" }, { "name": "ok", "value": "a\r\nInjected: 1" }],
            "remove": ["also bad"]
        }),
    );
    check(
        "Route",
        &r,
        &[
            "spec.rules[0].requestHeaderModifier.set[0].name: is not a valid header name",
            "spec.rules[0].requestHeaderModifier.set[1].value: must not contain CR, LF or NUL",
            "spec.rules[0].requestHeaderModifier.remove[0]: is not a valid header name",
        ],
        &[],
    );
}

#[test]
fn rejects_http_features_on_a_tcp_route() {
    let r = set(route(), "spec.protocol", json!("tcp"));
    let r = set(r, "spec.rules.1", json!(null));
    let r = {
        let mut r = r;
        r["spec"]["rules"].as_array_mut().unwrap().truncate(1);
        r
    };
    check(
        "Route",
        &r,
        &[
            "spec.rules[0].matches: set spec.protocol to http",
            "spec.rules[0].retries: set spec.protocol to http",
            "spec.rules[0].fault: set spec.protocol to http",
            "spec.rules[0].mirror: set spec.protocol to http",
            "spec.rules[0].requestHeaderModifier: set spec.protocol to http",
            "spec.rules[0].responseHeaderModifier: set spec.protocol to http",
        ],
        &["protocol tcp allows exactly one rule"],
    );
}

#[test]
fn rejects_a_tcp_route_with_two_rules() {
    let r = object(
        "Route",
        json!({
            "parentRef": { "name": "db", "port": 5432 },
            "protocol": "tcp",
            "rules": [
                { "backendRefs": [{ "name": "db-a", "port": 5432 }] },
                { "backendRefs": [{ "name": "db-b", "port": 5432 }] }
            ]
        }),
    );
    check(
        "Route",
        &r,
        &["spec.rules: protocol tcp allows exactly one rule, found 2"],
        &["protocol tcp allows exactly one rule"],
    );
}

#[test]
fn accepts_a_weighted_tcp_route_with_a_connect_timeout() {
    let r = object(
        "Route",
        json!({
            "parentRef": { "name": "db", "port": 5432 },
            "protocol": "tcp",
            "rules": [{
                "timeout": "2s",
                "backendRefs": [{ "name": "db-a", "port": 5432, "weight": 1 }, { "name": "db-b", "port": 5432, "weight": 3 }]
            }]
        }),
    );
    check("Route", &r, &[], &[]);
}

#[test]
fn rejects_an_unknown_protocol_naming_the_valid_ones() {
    let r = set(route(), "spec.protocol", json!("grpc"));
    let errs = rust_errors("Route", &r);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].contains("unknown variant `grpc`") && errs[0].contains("`http`"),
        "{errs:?}"
    );
}

// ---------------------------------------------------------------- TlsPolicy

fn tls() -> Value {
    object(
        "TlsPolicy",
        json!({
            "podSelector": { "matchLabels": { "app": "web" } },
            "mtls": { "mode": "Strict" },
            "minVersion": "TLSv1.2",
            "cipherSuites": ["TLS13_AES_128_GCM_SHA256", "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"],
            "certificate": { "source": "Mesh" },
            "privateKeyOffload": { "mode": "Preferred", "resource": "qat.intel.com/cy" }
        }),
    )
}

#[test]
fn accepts_a_complete_tls_policy() {
    check("TlsPolicy", &tls(), &[], &[]);
}

#[test]
fn accepts_a_minimal_tls_policy_with_defaults() {
    let t = object("TlsPolicy", json!({ "podSelector": {} }));
    check("TlsPolicy", &t, &[], &[]);
}

#[test]
fn rejects_unknown_cipher_suites_listing_the_valid_names() {
    let t = set(
        tls(),
        "spec.cipherSuites.1",
        json!("ECDHE-RSA-AES128-GCM-SHA256"),
    );
    check(
        "TlsPolicy",
        &t,
        &["spec.cipherSuites[1]: use one of TLS13_AES_256_GCM_SHA384, TLS13_AES_128_GCM_SHA256"],
        &[],
    );
}

#[test]
fn rejects_tls12_suites_when_min_version_is_tls13() {
    let t = set(tls(), "spec.minVersion", json!("TLSv1.3"));
    check(
        "TlsPolicy",
        &t,
        &["spec.cipherSuites[1]: is a TLS 1.2 suite and minVersion is TLSv1.3"],
        &["never negotiates TLS 1.2 suites"],
    );
}

#[test]
fn rejects_cipher_suites_without_any_tls13_suite() {
    let t = set(
        tls(),
        "spec.cipherSuites",
        json!(["TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384"]),
    );
    check(
        "TlsPolicy",
        &t,
        &["spec.cipherSuites: must include at least one TLS 1.3 suite"],
        &["at least one TLS 1.3 suite"],
    );
}

#[test]
fn rejects_a_cipher_suite_listed_twice() {
    let t = set(
        tls(),
        "spec.cipherSuites.1",
        json!("TLS13_AES_128_GCM_SHA256"),
    );
    check(
        "TlsPolicy",
        &t,
        &["spec.cipherSuites[1]: is listed twice"],
        &[],
    );
}

#[test]
fn rejects_an_unknown_min_version_naming_the_valid_ones() {
    let t = set(tls(), "spec.minVersion", json!("TLSv1.1"));
    let errs = rust_errors("TlsPolicy", &t);
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].contains("`TLSv1.2`") && errs[0].contains("`TLSv1.3`"),
        "{errs:?}"
    );
}

#[test]
fn rejects_an_unknown_mtls_mode() {
    let t = set(tls(), "spec.mtls.mode", json!("STRICT"));
    let errs = rust_errors("TlsPolicy", &t);
    assert!(
        errs.len() == 1 && errs[0].contains("`Permissive`"),
        "{errs:?}"
    );
}

#[test]
fn accepts_allowed_clients_by_service_account_and_by_spiffe_id() {
    let t = set(
        tls(),
        "spec.mtls.allowedClients",
        json!([
            "shop/frontend",
            "spiffe://cluster.local/ns/ops/sa/prober.v2"
        ]),
    );
    check("TlsPolicy", &t, &[], &[]);
}

#[test]
fn rejects_allowed_clients_that_name_no_service_account_or_repeat() {
    let t = set(
        tls(),
        "spec.mtls.allowedClients",
        json!([
            "frontend",
            "Shop/frontend",
            "spiffe://cluster.local/frontend",
            "shop/frontend",
            "shop/frontend"
        ]),
    );
    check(
        "TlsPolicy",
        &t,
        &[
            "spec.mtls.allowedClients[0]: names no ServiceAccount",
            "spec.mtls.allowedClients[1]: is not a valid namespace name",
            "spec.mtls.allowedClients[2]: is not a workload SPIFFE ID",
            "spec.mtls.allowedClients[4]: is listed twice",
        ],
        &[],
    );
}

#[test]
fn rejects_allowed_clients_without_mtls() {
    let t = set(
        set(
            tls(),
            "spec.mtls",
            json!({"mode": "Disabled", "allowedClients": ["shop/frontend"]}),
        ),
        "spec.privateKeyOffload.mode",
        json!("Disabled"),
    );
    check(
        "TlsPolicy",
        &t,
        &["spec.mtls.allowedClients: needs client identities from mTLS"],
        &["mtls.allowedClients needs client identities"],
    );
}

#[test]
fn rejects_secret_source_without_a_secret_ref() {
    let t = set(tls(), "spec.certificate", json!({ "source": "Secret" }));
    check(
        "TlsPolicy",
        &t,
        &["spec.certificate.secretRef: is required with source Secret"],
        &["secretRef is required with source Secret"],
    );
}

#[test]
fn rejects_a_secret_ref_with_mesh_source() {
    let t = set(
        tls(),
        "spec.certificate.secretRef",
        json!({ "name": "web-tls" }),
    );
    check(
        "TlsPolicy",
        &t,
        &["spec.certificate.secretRef: is only allowed with source Secret"],
        &["not allowed with source Mesh"],
    );
}

#[test]
fn accepts_a_secret_source_with_its_ref() {
    let t = set(
        tls(),
        "spec.certificate",
        json!({ "source": "Secret", "secretRef": { "name": "web-tls" } }),
    );
    check("TlsPolicy", &t, &[], &[]);
}

#[test]
fn rejects_key_offload_when_mtls_is_disabled() {
    let t = set(tls(), "spec.mtls.mode", json!("Disabled"));
    check(
        "TlsPolicy",
        &t,
        &["spec.privateKeyOffload.mode: privateKeyOffload needs TLS"],
        &["privateKeyOffload needs TLS"],
    );
}

#[test]
fn rejects_offload_resources_that_are_not_extended_resource_names() {
    for bad in [
        "qat",
        "QAT.intel.com/cy",
        "kubernetes.io/qat",
        "qat.intel.com/",
        "intel/cy",
    ] {
        let t = set(tls(), "spec.privateKeyOffload.resource", json!(bad));
        check(
            "TlsPolicy",
            &t,
            &["spec.privateKeyOffload.resource: is not an extended resource name"],
            &[],
        );
    }
}

#[test]
fn rejects_selectors_with_unknown_operators_or_missing_values() {
    let t = set(
        tls(),
        "spec.podSelector",
        json!({ "matchExpressions": [
            { "key": "app", "operator": "In" },
            { "key": "tier", "operator": "Like", "values": ["web"] }
        ]}),
    );
    check(
        "TlsPolicy",
        &t,
        &[
            "spec.podSelector.matchExpressions[0].values: needs at least one value",
            "spec.podSelector.matchExpressions[1].operator: use In, NotIn, Exists or DoesNotExist",
        ],
        &[],
    );
}

// ---------------------------------------------------------------- SidecarRelease

fn release() -> Value {
    object(
        "SidecarRelease",
        json!({
            "version": "1.2.0",
            "image": "docker.io/baton/sidecar:1.2.0",
            "emptyImage": "docker.io/baton/empty:0.1.0",
            "namespaceSelector": { "matchLabels": { "team": "payments" } },
            "podSelector": { "matchExpressions": [{ "key": "app", "operator": "Exists" }] },
            "resources": { "requests": { "cpu": "50m", "memory": "32Mi" }, "limits": { "memory": "64Mi" } },
            "upgrade": { "strategy": "HotUpgrade", "maxUnavailable": "25%", "partition": 1, "paused": false, "handoffTimeoutSeconds": 30 }
        }),
    )
}

#[test]
fn accepts_a_complete_release() {
    check("SidecarRelease", &release(), &[], &[]);
}

#[test]
fn accepts_a_minimal_release_with_default_upgrade_settings() {
    let r = object(
        "SidecarRelease",
        json!({ "version": "1.0.0", "image": "i:1", "emptyImage": "e:1" }),
    );
    check("SidecarRelease", &r, &[], &[]);
}

#[test]
fn rejects_hot_upgrade_without_an_empty_image() {
    let r = set(release(), "spec.emptyImage", json!(null));
    check(
        "SidecarRelease",
        &r,
        &["spec.emptyImage: HotUpgrade needs emptyImage"],
        &["HotUpgrade needs emptyImage"],
    );
}

#[test]
fn rejects_the_default_strategy_without_an_empty_image() {
    let r = object(
        "SidecarRelease",
        json!({ "version": "1.0.0", "image": "i:1" }),
    );
    check(
        "SidecarRelease",
        &r,
        &["spec.emptyImage: HotUpgrade needs emptyImage"],
        &["HotUpgrade needs emptyImage"],
    );
}

#[test]
fn accepts_recreate_without_an_empty_image() {
    let r = set(release(), "spec.emptyImage", json!(null));
    let r = set(r, "spec.upgrade.strategy", json!("Recreate"));
    check("SidecarRelease", &r, &[], &[]);
}

#[test]
fn rejects_max_unavailable_that_would_stall_or_is_malformed() {
    for bad in [
        json!(0),
        json!(-1),
        json!("0%"),
        json!("150%"),
        json!("abc"),
        json!("5 %"),
    ] {
        let r = set(release(), "spec.upgrade.maxUnavailable", bad.clone());
        check(
            "SidecarRelease",
            &r,
            &["spec.upgrade.maxUnavailable: an integer >= 1 or a percentage between 1% and 100%"],
            &["maxUnavailable must be an integer >= 1"],
        );
    }
}

#[test]
fn rejects_max_unavailable_as_a_string_without_percent_sign_in_the_webhook_only() {
    // CEL sees int-or-string through string(), so "10" looks like 10 there;
    // the webhook (and the operator, via resolve_max_unavailable) refuse it.
    let r = set(release(), "spec.upgrade.maxUnavailable", json!("10"));
    check(
        "SidecarRelease",
        &r,
        &["spec.upgrade.maxUnavailable: an integer >= 1 or a percentage"],
        &[],
    );
}

#[test]
fn accepts_max_unavailable_as_count_or_percentage() {
    for ok in [json!(1), json!(10), json!("1%"), json!("100%")] {
        let r = set(release(), "spec.upgrade.maxUnavailable", ok);
        check("SidecarRelease", &r, &[], &[]);
    }
}

#[test]
fn rejects_versions_that_cannot_be_an_annotation_token() {
    for bad in ["", "1.0 beta", "-1.0", &"1".repeat(64)] {
        let r = set(release(), "spec.version", json!(bad));
        check(
            "SidecarRelease",
            &r,
            &["spec.version: is not a version"],
            &[],
        );
    }
}

#[test]
fn rejects_out_of_range_upgrade_numbers() {
    let r = set(release(), "spec.upgrade.partition", json!(-1));
    let r = set(r, "spec.upgrade.handoffTimeoutSeconds", json!(0));
    check(
        "SidecarRelease",
        &r,
        &[
            "spec.upgrade.partition: must be >= 0",
            "spec.upgrade.handoffTimeoutSeconds: between 1 and 3600",
        ],
        &[],
    );
}

#[test]
fn rejects_malformed_namespace_selector_expressions() {
    let r = set(
        release(),
        "spec.namespaceSelector",
        json!({ "matchExpressions": [{ "key": "team", "operator": "Exists", "values": ["a"] }] }),
    );
    check(
        "SidecarRelease",
        &r,
        &["spec.namespaceSelector.matchExpressions[0].values: takes no values"],
        &[],
    );
}

#[test]
fn rejects_an_unknown_upgrade_strategy_naming_the_valid_ones() {
    let r = set(release(), "spec.upgrade.strategy", json!("RollingUpdate"));
    let errs = rust_errors("SidecarRelease", &r);
    assert!(
        errs.len() == 1 && errs[0].contains("`HotUpgrade`") && errs[0].contains("`Recreate`"),
        "{errs:?}"
    );
}

// ---------------------------------------------------------------- AcceleratorPool

fn pool() -> Value {
    object(
        "AcceleratorPool",
        json!({
            "resourceName": "qat.intel.com/cy",
            "nodeSelector": { "matchLabels": { "intel.feature.node.kubernetes.io/qat": "true" } },
            "devicesPerSidecar": 1
        }),
    )
}

#[test]
fn accepts_a_complete_pool_and_a_defaulted_one() {
    check("AcceleratorPool", &pool(), &[], &[]);
    check(
        "AcceleratorPool",
        &object("AcceleratorPool", json!({})),
        &[],
        &[],
    );
}

#[test]
fn rejects_pool_resource_names_that_are_not_extended_resources() {
    for bad in ["cy", "kubernetes.io/qat", "qat.intel.com/c y"] {
        let p = set(pool(), "spec.resourceName", json!(bad));
        check(
            "AcceleratorPool",
            &p,
            &["spec.resourceName: is not an extended resource name"],
            &[],
        );
    }
}

#[test]
fn rejects_devices_per_sidecar_outside_1_to_16() {
    for bad in [0, 17] {
        let p = set(pool(), "spec.devicesPerSidecar", json!(bad));
        check(
            "AcceleratorPool",
            &p,
            &["spec.devicesPerSidecar: between 1 and 16"],
            &[],
        );
    }
}

#[test]
fn validate_object_ignores_kinds_that_are_not_batons() {
    assert!(baton_crds::objects::validate_object("Pod", &json!({})).is_none());
}

// ---------------------------------------------------------- AuthorizationPolicy

fn authz() -> Value {
    object(
        "AuthorizationPolicy",
        json!({
            "podSelector": {"matchLabels": {"app": "server"}},
            "ports": [8080],
            "action": "Allow",
            "rules": [{
                "from": {"serviceAccounts": ["client"], "namespaces": ["default"],
                         "identities": ["spiffe://cluster.local/ns/default/sa/client"],
                         "ipBlocks": ["10.88.0.0/16"]},
                "to": {"methods": ["GET"], "paths": [{"exact": "/public"}, {"prefix": "/static/"}],
                       "headers": [{"name": "x-tenant", "prefix": "a"}]}
            }]
        }),
    )
}

#[test]
fn accepts_an_authorization_policy_using_every_field() {
    check("AuthorizationPolicy", &authz(), &[], &[]);
}

#[test]
fn rejects_a_deny_policy_without_rules_in_both_enforcers() {
    let a = object("AuthorizationPolicy", json!({"action": "Deny"}));
    check(
        "AuthorizationPolicy",
        &a,
        &["spec.rules: a Deny or Audit policy without rules matches nothing"],
        &["a Deny or Audit policy without rules matches nothing"],
    );
}

#[test]
fn rejects_a_path_with_both_or_neither_of_exact_and_prefix_in_both_enforcers() {
    let a = set(
        authz(),
        "spec.rules.0.to.paths.0",
        json!({"exact": "/a", "prefix": "/b"}),
    );
    check(
        "AuthorizationPolicy",
        &a,
        &["spec.rules[0].to.paths[0]: a path names exactly one of exact or prefix"],
        &["a path names exactly one of exact or prefix"],
    );
}

#[test]
fn rejects_a_header_with_both_exact_and_prefix_in_both_enforcers() {
    let a = set(authz(), "spec.rules.0.to.headers.0.exact", json!("a"));
    check(
        "AuthorizationPolicy",
        &a,
        &["spec.rules[0].to.headers[0]: a header names at most one of exact or prefix"],
        &["a header names at most one of exact or prefix"],
    );
}

#[test]
fn rejects_unauthenticated_peers_named_by_identity_in_both_enforcers() {
    let a = set(authz(), "spec.rules.0.from.authenticated", json!(false));
    check(
        "AuthorizationPolicy",
        &a,
        &[
            "spec.rules[0].from.authenticated: authenticated: false matches peers without a mesh identity",
        ],
        &["authenticated: false matches peers without a mesh identity"],
    );
}

#[test]
fn rejects_a_bad_cidr_method_and_port_with_messages_that_say_what_to_use() {
    let a = set(
        authz(),
        "spec.rules.0.from.ipBlocks.0",
        json!("10.0.0.0/40"),
    );
    let a = set(a, "spec.rules.0.to.methods.0", json!("FETCH"));
    let a = set(a, "spec.ports.0", json!(70000));
    check(
        "AuthorizationPolicy",
        &a,
        &[
            "spec.ports[0]: use 1 to 65535",
            "spec.rules[0].from.ipBlocks[0]: prefix length must be 0 to 32",
            "spec.rules[0].to.methods[0]: use one of GET, HEAD, POST",
        ],
        // `ports` has no CEL rule (docs/decisions/0054).
        &[],
    );
}

#[test]
fn port_names_are_accepted_and_malformed_ones_refused_by_the_webhook_with_what_a_name_is() {
    let a = set(authz(), "spec.ports", json!([8080, "http", "grpc-web"]));
    check("AuthorizationPolicy", &a, &[], &[]);
    let a = set(authz(), "spec.ports", json!(["http", "Bad_Name", 0]));
    check(
        "AuthorizationPolicy",
        &a,
        &[
            "spec.ports[1]: \"Bad_Name\" is not a port name: a name (IANA_SVC_NAME) is 1 to 15",
            "spec.ports[2]: port 0 is out of range",
        ],
        // Only the webhook checks ports (docs/decisions/0054).
        &[],
    );
}

#[test]
fn rejects_an_identity_that_is_not_a_workload_spiffe_id() {
    let a = set(
        authz(),
        "spec.rules.0.from.identities.0",
        json!("spiffe://cluster.local/web"),
    );
    check(
        "AuthorizationPolicy",
        &a,
        &["spec.rules[0].from.identities[0]: is not a workload SPIFFE ID"],
        &[],
    );
}
