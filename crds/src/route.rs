//! `Route` (namespaced): L7 (http) or L4 (tcp) routing for one Service port.
//!
//! Field names follow Gateway API `HTTPRoute` (parentRef, rules, matches,
//! backendRefs, requestHeaderModifier) with Istio `VirtualService` names where
//! Gateway API has none (retries.perTryTimeout, retryOn, fault, mirror).
//! Traffic from meshed clients to `parentRef.name:parentRef.port` is routed by
//! the first rule whose matches accept the request.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::common::{
    BackendRef, DURATION_PATTERN, HEADER_NAME_PATTERN, ServicePort, check_duration, check_percent,
    check_port, check_service_name, is_header_name, parse_duration,
};
use crate::validation::{Errors, FieldError, Validate};

/// Routing for one Service port.
// Each printcolumn(...) repeats `type_ = ...`; clippy reads that as a duplicate.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "baton.dev",
    doc = "Route: L7 (http) or L4 (tcp) routing for the traffic meshed clients send to one Service port.",
    version = "v1alpha1",
    kind = "Route",
    namespaced,
    status = "RouteStatus",
    shortname = "brt",
    category = "baton",
    derive = "PartialEq",
    printcolumn(
        name = "Service",
        type_ = "string",
        json_path = ".spec.parentRef.name",
        description = "Service whose traffic this Route steers"
    ),
    printcolumn(
        name = "Port",
        type_ = "integer",
        json_path = ".spec.parentRef.port",
        description = "Service port"
    ),
    printcolumn(
        name = "Protocol",
        type_ = "string",
        json_path = ".spec.protocol",
        description = "http or tcp"
    ),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status",
        description = "Route is valid and attached"
    ),
    printcolumn(
        name = "Programmed",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Programmed\")].status",
        priority = 1,
        description = "Config reached the sidecars"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("self.rules.all(r, !has(r.name) || self.rules.exists_one(o, has(o.name) && o.name == r.name))").message("rule names must be unique within a Route: rename the duplicate rule"))]
#[x_kube(validation = Rule::new("self.protocol == 'http' || (size(self.rules) == 1 && self.rules.all(r, (!has(r.matches) || size(r.matches) == 0) && !has(r.retries) && !has(r.fault) && !has(r.mirror) && !has(r.requestHeaderModifier) && !has(r.responseHeaderModifier)))").message("protocol tcp allows exactly one rule with backendRefs and timeout only: matches, retries, fault, mirror and header modifiers need protocol http"))]
#[serde(rename_all = "camelCase")]
pub struct RouteSpec {
    /// The Service port whose traffic this Route steers. One Route per
    /// Service port: the validating webhook refuses a second one (a
    /// duplicate that got in anyway reports Accepted=False, reason
    /// Conflicted).
    pub parent_ref: ServicePort,

    /// http: requests are matched and routed one by one (HTTP/1.1 and
    /// HTTP/2). tcp: connections are balanced across the backends of the
    /// single rule.
    #[serde(default)]
    pub protocol: RouteProtocol,

    /// Ordered rules: the first rule whose `matches` accept a request routes
    /// it. Requests no rule accepts get 404. tcp Routes have exactly one rule.
    #[schemars(length(min = 1, max = 32))]
    pub rules: Vec<RouteRule>,
}

/// Protocol of the Service port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RouteProtocol {
    /// HTTP/1.1 or HTTP/2 (L7 routing).
    #[default]
    Http,
    /// Opaque TCP (L4 balancing).
    Tcp,
}

/// One routing rule.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[x_kube(validation = Rule::new("self.backendRefs.exists(b, !has(b.weight) || b.weight > 0)").message("at least one backendRef of a rule must have a non-zero weight"))]
#[x_kube(validation = Rule::new("!has(self.timeout) || !has(self.retries) || !has(self.retries.perTryTimeout) || duration(self.retries.perTryTimeout) <= duration(self.timeout)").message("retries.perTryTimeout must not exceed timeout: lower perTryTimeout or raise timeout"))]
#[serde(rename_all = "camelCase")]
pub struct RouteRule {
    /// Optional name, unique within the Route; shows up in metrics and
    /// status messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: Option<String>,

    /// Conditions a request must meet; the rule applies when ANY match
    /// accepts (OR), and a match accepts when ALL its fields do (AND).
    /// Empty matches every request. http only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub matches: Vec<RouteMatch>,

    /// Where matching traffic goes, split by weight.
    #[schemars(length(min = 1, max = 16))]
    pub backend_refs: Vec<BackendRef>,

    /// Total time for a request including retries (http), or the connect
    /// timeout (tcp). Absent: no timeout. Duration syntax: `500ms`, `15s`, `1m30s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub timeout: Option<String>,

    /// Retry failed requests. http only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<RetryPolicy>,

    /// Inject delays or errors into a share of requests, to test resilience.
    /// http only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<FaultInjection>,

    /// Copy a share of requests to another backend; its responses are
    /// discarded. http only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<Mirror>,

    /// Headers to set, add or remove on the request before forwarding. http only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_header_modifier: Option<HeaderModifier>,

    /// Headers to set, add or remove on the response before returning it.
    /// http only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_header_modifier: Option<HeaderModifier>,
}

/// Conditions on one request; all present fields must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteMatch {
    /// Match on the request path (without the query string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathMatch>,
    /// Match on the HTTP method.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<HttpMethod>,
    /// Match on request headers; all must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub headers: Vec<HeaderMatch>,
    /// Match on query parameters; all must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub query_params: Vec<QueryParamMatch>,
}

/// How a path is compared.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PathMatch {
    /// Exact: the whole path equals `value`. PathPrefix: the path starts with
    /// `value` on a `/` boundary (`/api` matches `/api` and `/api/x`, not
    /// `/apix`). RegularExpression: `value` (RE2 syntax, anchored) matches
    /// the whole path.
    #[serde(rename = "type", default)]
    pub type_: PathMatchType,
    /// Path or pattern; Exact and PathPrefix values start with `/`.
    #[schemars(length(min = 1, max = 1024))]
    pub value: String,
}

/// Path comparison.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PathMatchType {
    /// The whole path equals the value.
    Exact,
    /// The path starts with the value, on a `/` boundary.
    #[default]
    PathPrefix,
    /// The value, a regular expression, matches the whole path.
    RegularExpression,
}

/// HTTP method.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
#[allow(missing_docs)]
pub enum HttpMethod {
    Get,
    Head,
    Post,
    Put,
    Delete,
    Connect,
    Options,
    Trace,
    Patch,
}

/// How a header or query value is compared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum StringMatchType {
    /// The value equals `value`.
    #[default]
    Exact,
    /// `value` (RE2 syntax, anchored) matches the whole value.
    RegularExpression,
}

/// A condition on one request header.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderMatch {
    /// Exact (default) or RegularExpression.
    #[serde(rename = "type", default)]
    pub type_: StringMatchType,
    /// Header name, case-insensitive.
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = HEADER_NAME_PATTERN)
    )]
    pub name: String,
    /// Value or pattern.
    #[schemars(length(max = 4096))]
    pub value: String,
}

/// A condition on one query parameter.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueryParamMatch {
    /// Exact (default) or RegularExpression.
    #[serde(rename = "type", default)]
    pub type_: StringMatchType,
    /// Parameter name, case-sensitive.
    #[schemars(length(min = 1, max = 256))]
    pub name: String,
    /// Value or pattern.
    #[schemars(length(max = 1024))]
    pub value: String,
}

/// Retries of failed requests (Istio `HTTPRetry`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RetryPolicy {
    /// Retries after the first try (0 disables retries).
    #[schemars(range(min = 0, max = 10))]
    pub attempts: i32,
    /// Timeout of each try. Must not exceed the rule's `timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub per_try_timeout: Option<String>,
    /// Which failures are retried. Default: connect-failure, refused-stream,
    /// reset, 503.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(regex(
            pattern = r"^(5xx|gateway-error|reset|connect-failure|refused-stream|retriable-4xx|[1-5][0-9][0-9])$"
        ))
    )]
    pub retry_on: Vec<String>,
}

/// Retry conditions accepted in `retryOn` besides 3-digit status codes.
pub const RETRY_ON: &[&str] = &[
    "5xx",
    "gateway-error",
    "reset",
    "connect-failure",
    "refused-stream",
    "retriable-4xx",
];

/// Fault injection (Istio `HTTPFaultInjection`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FaultInjection {
    /// Delay a share of requests before forwarding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay: Option<FaultDelay>,
    /// Answer a share of requests with an error without forwarding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort: Option<FaultAbort>,
}

/// Injected delay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FaultDelay {
    /// How long to wait, e.g. `2s`.
    #[schemars(length(max = 32), regex(pattern = DURATION_PATTERN))]
    pub fixed_delay: String,
    /// Percentage of requests delayed, 0-100.
    #[schemars(range(min = 0, max = 100))]
    pub percent: i32,
}

/// Injected error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FaultAbort {
    /// Status code returned, 200-599.
    #[schemars(range(min = 200, max = 599))]
    pub http_status: i32,
    /// Percentage of requests aborted, 0-100.
    #[schemars(range(min = 0, max = 100))]
    pub percent: i32,
}

/// Request mirroring.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Mirror {
    /// Service port that receives the copies.
    pub backend_ref: ServicePort,
    /// Percentage of requests mirrored, 0-100. Default 100.
    #[serde(default = "default_mirror_percent")]
    #[schemars(range(min = 0, max = 100))]
    pub percent: i32,
}

fn default_mirror_percent() -> i32 {
    100
}

/// Header rewrites (Gateway API `HTTPHeaderFilter`). Applied in the order
/// remove, set, add.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderModifier {
    /// Replace the header's value (adding it if absent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub set: Vec<HeaderValue>,
    /// Append a value (keeping existing values).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub add: Vec<HeaderValue>,
    /// Header names to remove.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(min = 1, max = 256)))]
    pub remove: Vec<String>,
}

/// A header name and value.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderValue {
    /// Header name, case-insensitive.
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = HEADER_NAME_PATTERN)
    )]
    pub name: String,
    /// Header value.
    #[schemars(length(max = 4096))]
    pub value: String,
}

/// Observed state of a Route.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RouteStatus {
    /// `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Accepted, ResolvedRefs, Programmed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

impl Validate for Route {
    fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut e = Errors::default();
        let s = &self.spec;
        check_service_name(&mut e, "spec.parentRef.name", &s.parent_ref.name);
        check_port(&mut e, "spec.parentRef.port", s.parent_ref.port);
        if s.rules.is_empty() {
            e.push("spec.rules", "must contain at least one rule");
        }
        if s.protocol == RouteProtocol::Tcp && s.rules.len() > 1 {
            e.push(
                "spec.rules",
                format!(
                    "protocol tcp allows exactly one rule, found {}: merge the backends into one rule or use protocol http",
                    s.rules.len()
                ),
            );
        }
        let mut names = BTreeSet::new();
        for (i, rule) in s.rules.iter().enumerate() {
            let p = format!("spec.rules[{i}]");
            if let Some(name) = &rule.name
                && !names.insert(name.as_str())
            {
                e.push(
                    format!("{p}.name"),
                    format!("{name:?} is used by an earlier rule: rule names must be unique"),
                );
            }
            validate_rule(&mut e, &p, rule, s.protocol);
        }
        e.into_result()
    }
}

fn validate_rule(e: &mut Errors, p: &str, rule: &RouteRule, protocol: RouteProtocol) {
    if protocol == RouteProtocol::Tcp {
        let http_only = [
            ("matches", !rule.matches.is_empty()),
            ("retries", rule.retries.is_some()),
            ("fault", rule.fault.is_some()),
            ("mirror", rule.mirror.is_some()),
            (
                "requestHeaderModifier",
                rule.request_header_modifier.is_some(),
            ),
            (
                "responseHeaderModifier",
                rule.response_header_modifier.is_some(),
            ),
        ];
        for (field, set) in http_only {
            if set {
                e.push(
                    format!("{p}.{field}"),
                    "applies to HTTP only: remove it or set spec.protocol to http",
                );
            }
        }
    }
    for (j, m) in rule.matches.iter().enumerate() {
        validate_match(e, &format!("{p}.matches[{j}]"), m);
    }

    if rule.backend_refs.is_empty() {
        e.push(format!("{p}.backendRefs"), "must list at least one backend");
    } else if rule.backend_refs.iter().all(|b| b.weight == 0) {
        e.push(
            format!("{p}.backendRefs"),
            "all weights are 0, so no traffic could be routed: give at least one backend a weight above 0",
        );
    }
    for (j, b) in rule.backend_refs.iter().enumerate() {
        let bp = format!("{p}.backendRefs[{j}]");
        check_service_name(e, &format!("{bp}.name"), &b.name);
        check_port(e, &format!("{bp}.port"), b.port);
        if !(0..=1_000_000).contains(&b.weight) {
            e.push(format!("{bp}.weight"), "must be between 0 and 1000000");
        }
    }

    check_duration(e, &format!("{p}.timeout"), rule.timeout.as_deref());
    if let Some(r) = &rule.retries {
        let rp = format!("{p}.retries");
        if !(0..=10).contains(&r.attempts) {
            e.push(format!("{rp}.attempts"), "must be between 0 and 10");
        }
        check_duration(
            e,
            &format!("{rp}.perTryTimeout"),
            r.per_try_timeout.as_deref(),
        );
        if let (Some(per_try), Some(total)) = (
            r.per_try_timeout.as_deref().and_then(parse_duration),
            rule.timeout.as_deref().and_then(parse_duration),
        ) && per_try > total
        {
            e.push(
                format!("{rp}.perTryTimeout"),
                format!(
                    "{per_try:?} exceeds the rule timeout {total:?}: lower perTryTimeout or raise timeout"
                ),
            );
        }
        for (k, cond) in r.retry_on.iter().enumerate() {
            let status_code =
                cond.len() == 3 && cond.parse::<u16>().is_ok_and(|c| (100..=599).contains(&c));
            if !status_code && !RETRY_ON.contains(&cond.as_str()) {
                e.push(
                    format!("{rp}.retryOn[{k}]"),
                    format!(
                        "unknown retry condition {cond:?}: use a status code (e.g. 503) or one of {}",
                        RETRY_ON.join(", ")
                    ),
                );
            }
        }
    }
    if let Some(f) = &rule.fault {
        let fp = format!("{p}.fault");
        if f.delay.is_none() && f.abort.is_none() {
            e.push(&fp, "set delay, abort or both, or remove fault");
        }
        if let Some(d) = &f.delay {
            check_duration(e, &format!("{fp}.delay.fixedDelay"), Some(&d.fixed_delay));
            check_percent(e, &format!("{fp}.delay.percent"), d.percent);
        }
        if let Some(a) = &f.abort {
            if !(200..=599).contains(&a.http_status) {
                e.push(
                    format!("{fp}.abort.httpStatus"),
                    format!(
                        "{} is not an HTTP status to answer with: use 200-599",
                        a.http_status
                    ),
                );
            }
            check_percent(e, &format!("{fp}.abort.percent"), a.percent);
        }
    }
    if let Some(m) = &rule.mirror {
        let mp = format!("{p}.mirror");
        check_service_name(e, &format!("{mp}.backendRef.name"), &m.backend_ref.name);
        check_port(e, &format!("{mp}.backendRef.port"), m.backend_ref.port);
        check_percent(e, &format!("{mp}.percent"), m.percent);
    }
    for (field, hm) in [
        ("requestHeaderModifier", &rule.request_header_modifier),
        ("responseHeaderModifier", &rule.response_header_modifier),
    ] {
        if let Some(hm) = hm {
            validate_header_modifier(e, &format!("{p}.{field}"), hm);
        }
    }
}

fn validate_match(e: &mut Errors, p: &str, m: &RouteMatch) {
    if let Some(path) = &m.path {
        let pp = format!("{p}.path.value");
        match path.type_ {
            PathMatchType::Exact | PathMatchType::PathPrefix => {
                if !path.value.starts_with('/') {
                    e.push(&pp, format!("{:?} must start with '/'", path.value));
                }
            }
            PathMatchType::RegularExpression => check_regex(e, &pp, &path.value),
        }
    }
    let mut seen = BTreeSet::new();
    for (k, h) in m.headers.iter().enumerate() {
        let hp = format!("{p}.headers[{k}]");
        if !is_header_name(&h.name) {
            e.push(
                format!("{hp}.name"),
                format!("{:?} is not a valid header name", h.name),
            );
        }
        if !seen.insert(h.name.to_ascii_lowercase()) {
            e.push(
                format!("{hp}.name"),
                format!(
                    "header {:?} is matched twice: combine the conditions into one",
                    h.name
                ),
            );
        }
        if h.type_ == StringMatchType::RegularExpression {
            check_regex(e, &format!("{hp}.value"), &h.value);
        }
    }
    let mut seen = BTreeSet::new();
    for (k, q) in m.query_params.iter().enumerate() {
        let qp = format!("{p}.queryParams[{k}]");
        if q.name.is_empty() {
            e.push(format!("{qp}.name"), "must not be empty");
        }
        if !seen.insert(q.name.as_str()) {
            e.push(
                format!("{qp}.name"),
                format!(
                    "query parameter {:?} is matched twice: combine the conditions into one",
                    q.name
                ),
            );
        }
        if q.type_ == StringMatchType::RegularExpression {
            check_regex(e, &format!("{qp}.value"), &q.value);
        }
    }
}

fn check_regex(e: &mut Errors, path: &str, pattern: &str) {
    // Same engine and size limit as the sidecar's matcher, so what passes
    // here compiles there.
    if let Err(err) = regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .build()
    {
        let detail = err
            .to_string()
            .lines()
            .last()
            .unwrap_or_default()
            .to_owned();
        e.push(
            path,
            format!("{pattern:?} is not a valid regular expression (RE2 syntax): {detail}"),
        );
    }
}

fn validate_header_modifier(e: &mut Errors, p: &str, hm: &HeaderModifier) {
    let mut seen = BTreeSet::new();
    for (list, values) in [("set", &hm.set), ("add", &hm.add)] {
        for (k, h) in values.iter().enumerate() {
            if !is_header_name(&h.name) {
                e.push(
                    format!("{p}.{list}[{k}].name"),
                    format!("{:?} is not a valid header name", h.name),
                );
            }
            if h.value.contains(['\r', '\n', '\0']) {
                e.push(
                    format!("{p}.{list}[{k}].value"),
                    "must not contain CR, LF or NUL",
                );
            }
            if list == "set" && !seen.insert(h.name.to_ascii_lowercase()) {
                e.push(
                    format!("{p}.set[{k}].name"),
                    format!("header {:?} is set twice: keep one", h.name),
                );
            }
        }
    }
    for (k, name) in hm.remove.iter().enumerate() {
        if !is_header_name(name) {
            e.push(
                format!("{p}.remove[{k}]"),
                format!("{name:?} is not a valid header name"),
            );
        }
    }
}
