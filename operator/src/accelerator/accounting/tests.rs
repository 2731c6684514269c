//! The books as a pure function: every rule of the module docs, one test
//! each, plus the agreement with the grant decision.

use super::*;
use baton_crds::AcceleratorPoolSpec;
use baton_crds::contract::DEFAULT_QAT_RESOURCE;
use k8s_openapi::api::core::v1::{NodeStatus, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, ObjectMeta};
use k8s_openapi::jiff::Timestamp;

const R: &str = DEFAULT_QAT_RESOURCE;

fn pool(per_sidecar: i32, selector: bool) -> AcceleratorPool {
    let mut p = AcceleratorPool::new(
        "qat",
        AcceleratorPoolSpec {
            resource_name: R.into(),
            node_selector: selector.then(|| LabelSelector {
                match_labels: Some(BTreeMap::from([("qat".to_owned(), "yes".to_owned())])),
                match_expressions: None,
            }),
            devices_per_sidecar: per_sidecar,
        },
    );
    p.metadata.generation = Some(4);
    p
}

fn node(name: &str, qat_label: bool, devices: Option<&str>) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(if qat_label {
                BTreeMap::from([("qat".to_owned(), "yes".to_owned())])
            } else {
                BTreeMap::new()
            }),
            ..Default::default()
        },
        status: Some(NodeStatus {
            allocatable: Some(
                devices
                    .map(|d| (R.to_owned(), Quantity(d.into())))
                    .into_iter()
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A meshed pod granted `devices` on `node` (None: not scheduled yet).
pub(crate) fn granted(name: &str, node: Option<&str>, devices: i64) -> PodDevices {
    PodDevices {
        namespace: "shop".into(),
        name: name.into(),
        uid: format!("uid-{name}").into(),
        node: node.map(Into::into),
        meshed: true,
        offload: Some(OFFLOAD_QAT.into()),
        pool: Some("qat".into()),
        requests: [(R.into(), devices)].into(),
        ..Default::default()
    }
}

/// A meshed pod on `n1` that fell back to software for pool `qat`.
pub(crate) fn fallback(name: &str, created: i64) -> PodDevices {
    PodDevices {
        namespace: "shop".into(),
        name: name.into(),
        uid: format!("uid-{name}").into(),
        node: Some("n1".into()),
        meshed: true,
        offload: Some(OFFLOAD_FALLBACK.into()),
        pool: Some("qat".into()),
        fallback_reason: Some(format!("exhausted for {name}").into()),
        created,
        ..Default::default()
    }
}

fn now() -> Time {
    Time(Timestamp::from_second(1_800_000_000).unwrap())
}

fn condition<'a>(s: &'a AcceleratorPoolStatus, t: &str) -> &'a Condition {
    s.conditions.iter().find(|c| c.type_ == t).unwrap()
}

fn status(p: &AcceleratorPool, nodes: &[Node], pods: &[PodDevices]) -> AcceleratorPoolStatus {
    compute(p, nodes, pods, &RuntimeVerdicts::new(), &now()).status
}

#[test]
fn an_empty_pool_with_capacity_is_ready_not_exhausted_not_degraded() {
    let s = status(&pool(1, false), &[node("n1", false, Some("4"))], &[]);
    assert_eq!(
        (
            s.node_count,
            s.capacity,
            s.allocated,
            s.free,
            s.pending,
            s.fallbacks
        ),
        (1, 4, 0, 4, 0, 0)
    );
    assert_eq!(s.observed_generation, Some(4));
    let ready = condition(&s, cond::READY);
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "DevicesAvailable")
    );
    assert_eq!(ready.observed_generation, Some(4));
    assert_eq!(condition(&s, cond::EXHAUSTED).status, "False");
    assert_eq!(condition(&s, cond::DEGRADED).status, "False");
}

#[test]
fn holders_are_counted_per_node_with_their_names_and_sidecars() {
    let nodes = [node("n2", true, Some("2")), node("n1", true, Some("4"))];
    let pods = [
        granted("web-0", Some("n1"), 1),
        granted("web-1", Some("n1"), 2),
        granted("api-0", Some("n2"), 1),
    ];
    let s = status(&pool(1, true), &nodes, &pods);
    assert_eq!((s.capacity, s.allocated, s.free), (6, 4, 2));
    assert_eq!(
        s.nodes,
        vec![
            NodeAllocation {
                node: "n1".into(),
                capacity: 4,
                allocated: 3,
                free: 1,
                sidecars: 2,
                pods: vec!["shop/web-0".into(), "shop/web-1".into()],
            },
            NodeAllocation {
                node: "n2".into(),
                capacity: 2,
                allocated: 1,
                free: 1,
                sidecars: 1,
                pods: vec!["shop/api-0".into()],
            },
        ]
    );
}

#[test]
fn nodes_outside_the_selector_or_without_devices_are_not_in_the_pool() {
    let nodes = [
        node("gpu", false, Some("8")),
        node("cpu", true, None),
        node("qat", true, Some("2")),
    ];
    let s = status(&pool(1, true), &nodes, &[]);
    assert_eq!(s.node_count, 1);
    assert_eq!(s.nodes.len(), 1);
    assert_eq!(s.nodes[0].node, "qat");
}

#[test]
fn a_pod_that_is_not_meshed_still_takes_a_device_but_is_not_a_sidecar() {
    let mut other = granted("batch-0", Some("n1"), 1);
    other.meshed = false;
    other.offload = None;
    other.pool = None;
    let s = status(&pool(1, false), &[node("n1", false, Some("2"))], &[other]);
    assert_eq!((s.allocated, s.free), (1, 1));
    assert_eq!(s.nodes[0].sidecars, 0);
    assert_eq!(s.nodes[0].pods, vec!["shop/batch-0".to_owned()]);
}

#[test]
fn ended_pods_release_their_devices() {
    let mut done = granted("job-0", Some("n1"), 1);
    done.ended = true;
    let running = granted("web-0", Some("n1"), 1);
    let s = status(
        &pool(1, false),
        &[node("n1", false, Some("2"))],
        &[done, running],
    );
    assert_eq!((s.allocated, s.free), (1, 1));
    assert_eq!(s.nodes[0].pods, vec!["shop/web-0".to_owned()]);
}

#[test]
fn unscheduled_grants_are_pending_and_count_against_exhaustion() {
    let nodes = [node("n1", false, Some("2"))];
    let pods = [granted("web-0", Some("n1"), 1), granted("web-1", None, 1)];
    let s = status(&pool(1, false), &nodes, &pods);
    assert_eq!((s.allocated, s.free, s.pending), (1, 1, 1));
    let e = condition(&s, cond::EXHAUSTED);
    assert_eq!(
        (e.status.as_str(), e.reason.as_str()),
        ("True", "AllAllocated")
    );
    assert!(
        e.message.contains("Required ones are refused"),
        "{}",
        e.message
    );
}

#[test]
fn recent_grants_list_every_grant_seen_in_the_window_held_pending_or_ended() {
    let t = now().0.as_second();
    let with = |mut p: PodDevices, id: &str, created: i64| {
        p.grant = Some(id.into());
        p.created = created;
        p
    };
    let mut ended = with(granted("c", Some("n1"), 1), "g-c", t - 1);
    ended.ended = true;
    let mut other_pool = with(granted("d", None, 1), "g-d", t);
    other_pool.pool = Some("other".into());
    let pods = [
        with(granted("a", Some("n1"), 1), "g-a", t),
        with(
            granted("b", None, 1),
            "g-b",
            t - RECENT_GRANT_WINDOW_SECONDS,
        ),
        ended,
        other_pool,
        with(
            granted("old", Some("n1"), 1),
            "g-old",
            t - RECENT_GRANT_WINDOW_SECONDS - 1,
        ),
        granted("no-id", Some("n1"), 1),
    ];
    let s = status(&pool(1, false), &[node("n1", false, Some("8"))], &pods);
    assert_eq!(
        s.recent_grants,
        Some(vec!["g-a".to_owned(), "g-b".to_owned(), "g-c".to_owned()])
    );
    // The cap keeps the newest, the ones a webhook may still remember.
    let burst: Vec<PodDevices> = (0..MAX_RECENT_GRANTS + 5)
        .map(|i| {
            with(
                granted(&format!("p{i}"), None, 1),
                &format!("g{i:04}"),
                t - 30 + (i as i64 % 30),
            )
        })
        .collect();
    let s = status(&pool(1, false), &[node("n1", false, Some("8"))], &burst);
    let listed = s.recent_grants.unwrap();
    assert_eq!(listed.len(), MAX_RECENT_GRANTS);
    let newest = burst.iter().max_by_key(|p| p.created).unwrap();
    assert!(listed.contains(&newest.grant.as_deref().unwrap().to_owned()));
}

#[test]
fn pending_grants_for_another_pool_are_not_ours() {
    let mut other = granted("web-1", None, 1);
    other.pool = Some("other-pool".into());
    // Two devices: what a pod with two slots needs.
    let s = status(&pool(1, false), &[node("n1", false, Some("2"))], &[other]);
    assert_eq!(s.pending, 0);
    assert_eq!(condition(&s, cond::EXHAUSTED).status, "False");
}

#[test]
fn a_full_pool_is_exhausted_and_agrees_with_the_grant_decision() {
    let nodes = [node("n1", false, Some("1")), node("n2", false, Some("1"))];
    let pods = [granted("a", Some("n1"), 1), granted("b", Some("n2"), 1)];
    let p = pool(1, false);
    let s = status(&p, &nodes, &pods);
    assert_eq!(s.free, 0);
    assert_eq!(condition(&s, cond::EXHAUSTED).status, "True");
    // The webhook, given the same numbers, refuses a Required sidecar.
    let inventory: Vec<NodeInventory> = nodes
        .iter()
        .map(|n| NodeInventory::from_node(n, R, 1))
        .collect();
    let o = PrivateKeyOffload {
        mode: OffloadMode::Required,
        resource: R.into(),
        pool: None,
    };
    assert!(matches!(
        accelerator::decide_offload(&OffloadInput {
            offload: Some(&o),
            pool: Some(&p),
            nodes: &inventory,
            pending: s.pending,
            pinned_node: None,
            slots: SLOTS_PER_POD,
        }),
        OffloadDecision::Deny {
            reason: NoGrant::Exhausted { .. }
        }
    ));
}

#[test]
fn one_free_device_is_exhausted_for_a_pod_whose_two_slots_each_need_one() {
    let nodes = [node("n1", false, Some("3"))];
    let pods = [granted("a", Some("n1"), 2)];
    let s = status(&pool(1, false), &nodes, &pods);
    assert_eq!((s.allocated, s.free), (2, 1));
    assert_eq!(condition(&s, cond::EXHAUSTED).status, "True");
}

#[test]
fn free_devices_split_across_nodes_exhaust_a_two_device_pool() {
    let nodes = [node("n1", false, Some("2")), node("n2", false, Some("2"))];
    let pods = [granted("a", Some("n1"), 1), granted("b", Some("n2"), 1)];
    let s = status(&pool(2, false), &nodes, &pods);
    assert_eq!(s.free, 2);
    assert_eq!(condition(&s, cond::EXHAUSTED).status, "True");
}

#[test]
fn no_node_with_devices_is_not_ready_with_a_hint() {
    let s = status(&pool(1, true), &[node("n1", false, Some("4"))], &[]);
    let r = condition(&s, cond::READY);
    assert_eq!((r.status.as_str(), r.reason.as_str()), ("False", "NoNodes"));
    assert!(r.message.contains("nodeSelector"), "{}", r.message);
    assert_eq!(s.node_count, 0);
    assert!(s.nodes.is_empty());
}

#[test]
fn an_invalid_spec_is_not_ready_and_degraded() {
    let mut p = pool(1, false);
    p.spec.devices_per_sidecar = 40;
    let s = status(&p, &[node("n1", false, Some("4"))], &[]);
    assert_eq!(condition(&s, cond::READY).reason, "InvalidSpec");
    let d = condition(&s, cond::DEGRADED);
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "InvalidSpec")
    );
    assert!(d.message.contains("devicesPerSidecar"), "{}", d.message);
}

#[test]
fn holders_beyond_a_shrunken_node_degrade_the_pool_and_keep_the_node_listed() {
    // The device plugin now reports 1 healthy device (and then none) where
    // two sidecars hold one each.
    let pods = [granted("a", Some("n1"), 1), granted("b", Some("n1"), 1)];
    for advertised in [Some("1"), None] {
        let s = status(&pool(1, false), &[node("n1", false, advertised)], &pods);
        let d = condition(&s, cond::DEGRADED);
        assert_eq!(
            (d.status.as_str(), d.reason.as_str()),
            ("True", "DevicesLost")
        );
        assert!(d.message.contains("n1 holds 2"), "{}", d.message);
        assert_eq!(s.nodes.len(), 1, "{advertised:?}");
        assert_eq!(s.nodes[0].free, 0);
    }
}

#[test]
fn granted_pods_the_scheduler_cannot_place_degrade_the_pool() {
    let mut stuck = granted("web-9", None, 1);
    stuck.unschedulable = true;
    let s = status(&pool(1, false), &[node("n1", false, Some("4"))], &[stuck]);
    let d = condition(&s, cond::DEGRADED);
    assert_eq!(
        (d.status.as_str(), d.reason.as_str()),
        ("True", "GrantedPodsUnschedulable")
    );
    assert!(d.message.contains("shop/web-9"), "{}", d.message);
}

#[test]
fn fallbacks_are_counted_newest_first_and_listed_up_to_ten() {
    let pods: Vec<PodDevices> = (0..12)
        .map(|i| fallback(&format!("web-{i:02}"), i))
        .collect();
    let books = compute(
        &pool(1, false),
        &[node("n1", false, Some("1"))],
        &pods,
        &RuntimeVerdicts::new(),
        &now(),
    );
    let s = &books.status;
    assert_eq!(s.fallbacks, 12);
    assert_eq!(s.recent_fallbacks.len(), MAX_RECENT_FALLBACKS);
    assert_eq!(s.recent_fallbacks[0].pod, "web-11");
    assert_eq!(s.recent_fallbacks[0].reason, "exhausted for web-11");
    assert_eq!(books.fallbacks.len(), 12);
}

#[test]
fn fallbacks_of_other_pools_ended_pods_or_unmeshed_pods_do_not_count() {
    let mut other = fallback("a", 1);
    other.pool = Some("elsewhere".into());
    let mut ended = fallback("b", 2);
    ended.ended = true;
    let mut unmeshed = fallback("c", 3);
    unmeshed.meshed = false;
    let counted = fallback("d", 4);
    let s = status(
        &pool(1, false),
        &[node("n1", false, Some("1"))],
        &[other, ended, unmeshed, counted],
    );
    assert_eq!(s.fallbacks, 1);
    assert_eq!(s.recent_fallbacks[0].pod, "d");
}

#[test]
fn a_granted_pod_whose_sidecar_signs_in_software_is_a_fallback_that_still_holds_its_device() {
    let failing = granted("failing", Some("n1"), 1);
    let working = granted("working", Some("n1"), 1);
    // A sidecar report on a pod the webhook sent to software already: the
    // annotation's reason is the older news, the sidecar's wins.
    let both = fallback("both", 1);
    let runtime = RuntimeVerdicts::from([
        (
            "uid-failing".to_owned(),
            "SignErrors: 3 signature(s) redone in software".to_owned(),
        ),
        (
            "uid-both".to_owned(),
            "EngineUnavailable: no provider".to_owned(),
        ),
    ]);
    let books = compute(
        &pool(1, false),
        &[node("n1", false, Some("4"))],
        &[failing, working, both],
        &runtime,
        &now(),
    );
    let s = &books.status;
    assert_eq!(s.fallbacks, 2, "{s:?}");
    assert_eq!(s.allocated, 2, "the failing sidecar's pod keeps its device");
    let reasons: BTreeMap<_, _> = books
        .fallbacks
        .iter()
        .map(|f| (f.pod.as_str(), f.reason.as_str()))
        .collect();
    assert_eq!(
        reasons,
        BTreeMap::from([
            ("both", "EngineUnavailable: no provider"),
            ("failing", "SignErrors: 3 signature(s) redone in software"),
        ])
    );
}

#[test]
fn unchanged_books_keep_their_condition_times_so_the_write_is_skipped() {
    let p0 = pool(1, false);
    let nodes = [node("n1", false, Some("2"))];
    let first = status(&p0, &nodes, &[]);
    let mut p1 = p0.clone();
    p1.status = Some(first.clone());
    let later = Time(Timestamp::from_second(1_800_000_999).unwrap());
    let second = compute(
        &p1,
        &nodes,
        &[] as &[PodDevices],
        &RuntimeVerdicts::new(),
        &later,
    )
    .status;
    assert_eq!(first, second);
}

#[test]
fn holders_per_node_are_capped_but_the_count_is_exact() {
    let pods: Vec<PodDevices> = (0..25)
        .map(|i| granted(&format!("p{i:02}"), Some("n1"), 1))
        .collect();
    let s = status(&pool(1, false), &[node("n1", false, Some("32"))], &pods);
    assert_eq!(s.nodes[0].allocated, 25);
    assert_eq!(s.nodes[0].pods.len(), MAX_PODS_PER_NODE);
}

#[test]
fn unannounced_fallbacks_are_those_without_an_event_yet() {
    let books = compute(
        &pool(1, false),
        &[],
        &[fallback("a", 1), fallback("b", 2)],
        &RuntimeVerdicts::new(),
        &now(),
    );
    let announced = BTreeSet::from(["uid-a".to_owned()]);
    let new: Vec<&str> = unannounced(&books.fallbacks, &announced)
        .iter()
        .map(|f| f.pod.as_str())
        .collect();
    assert_eq!(new, vec!["b"]);
}

fn container(name: &str, devices: Option<&str>, restart: Option<&str>) -> Container {
    Container {
        name: name.into(),
        restart_policy: restart.map(Into::into),
        resources: devices.map(|d| ResourceRequirements {
            limits: Some(BTreeMap::from([
                (R.to_owned(), Quantity(d.into())),
                ("cpu".to_owned(), Quantity("1".into())),
            ])),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn effective_requests_follow_the_scheduler_formula() {
    // Regular containers add up.
    let r = effective_requests(
        &[
            container("a", Some("1"), None),
            container("b", Some("2"), None),
        ],
        &[],
    );
    assert_eq!(r, BTreeMap::from([(R.to_owned(), 3)]));
    // A native sidecar (restartable init container) adds to them.
    let r = effective_requests(
        &[container("app", None, None)],
        &[container("baton-sidecar-a", Some("1"), Some("Always"))],
    );
    assert_eq!(r, BTreeMap::from([(R.to_owned(), 1)]));
    // A plain init container counts alone: the larger wins.
    let r = effective_requests(
        &[container("app", Some("1"), None)],
        &[container("setup", Some("2"), None)],
    );
    assert_eq!(r, BTreeMap::from([(R.to_owned(), 2)]));
    // cpu and nothing-requested pods have no extended requests.
    assert!(effective_requests(&[container("app", None, None)], &[]).is_empty());
}

#[test]
fn pod_devices_reads_node_phase_deletion_annotations_and_scheduling() {
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time as MetaTime;
    let mut pod = Pod {
        metadata: ObjectMeta {
            name: Some("web-0".into()),
            namespace: Some("shop".into()),
            uid: Some("u1".into()),
            labels: Some(BTreeMap::from([(
                labels::INJECTED.to_owned(),
                "true".to_owned(),
            )])),
            annotations: Some(BTreeMap::from([
                (annotations::OFFLOAD.to_owned(), OFFLOAD_QAT.to_owned()),
                (annotations::ACCELERATOR_POOL.to_owned(), "qat".to_owned()),
                (annotations::OFFLOAD_GRANT.to_owned(), "req-1".to_owned()),
            ])),
            creation_timestamp: Some(MetaTime(Timestamp::from_second(77).unwrap())),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some("n1".into()),
            containers: vec![container("baton-sidecar-a", Some("1"), None)],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            ..Default::default()
        }),
    };
    let v = PodDevices::from_pod(&pod);
    assert_eq!(
        v,
        PodDevices {
            namespace: "shop".into(),
            name: "web-0".into(),
            uid: "u1".into(),
            node: Some("n1".into()),
            ended: false,
            meshed: true,
            unschedulable: false,
            running_ip: None,
            offload: Some("qat".into()),
            pool: Some("qat".into()),
            fallback_reason: None,
            grant: Some("req-1".into()),
            requests: [(R.into(), 1)].into(),
            created: 77,
        }
    );
    for phase in ["Succeeded", "Failed"] {
        pod.status.as_mut().unwrap().phase = Some(phase.into());
        assert!(PodDevices::from_pod(&pod).ended, "{phase}");
    }
    pod.status.as_mut().unwrap().phase = Some("Running".into());
    pod.metadata.deletion_timestamp = Some(MetaTime(Timestamp::from_second(99).unwrap()));
    assert!(PodDevices::from_pod(&pod).ended);
    pod.metadata.deletion_timestamp = None;
    pod.spec.as_mut().unwrap().node_name = None;
    pod.status.as_mut().unwrap().phase = Some("Pending".into());
    pod.status.as_mut().unwrap().conditions = Some(vec![PodCondition {
        type_: "PodScheduled".into(),
        status: "False".into(),
        reason: Some("Unschedulable".into()),
        ..Default::default()
    }]);
    let v = PodDevices::from_pod(&pod);
    assert!(v.unschedulable && v.node.is_none() && !v.ended);
}

#[test]
fn pods_not_worth_caching_change_no_books() {
    // Read by the books or the probe: kept.
    let mut ended_grant = granted("ended", None, 0);
    ended_grant.requests = Box::default();
    ended_grant.ended = true;
    ended_grant.grant = Some("req-ended".into());
    ended_grant.created = 1_800_000_000 - 5;
    let mut probed_only = granted("probed", Some("n1"), 0);
    probed_only.requests = Box::default();
    probed_only.pool = None;
    let mut unmeshed_holder = granted("batch", Some("n1"), 1);
    unmeshed_holder.meshed = false;
    unmeshed_holder.offload = None;
    unmeshed_holder.pool = None;
    let kept = vec![
        granted("web-0", Some("n1"), 1),
        granted("web-9", None, 2),
        fallback("web-1", 1_800_000_000),
        ended_grant,
        probed_only,
        unmeshed_holder,
    ];
    for p in &kept {
        assert!(p.worth_caching(), "{p:?}");
    }
    // Read by neither: a plain pod, a meshed pod without offload, a
    // software fallback with no pool, a grant id with no pool.
    let plain = PodDevices {
        namespace: "shop".into(),
        name: "plain".into(),
        uid: "uid-plain".into(),
        node: Some("n1".into()),
        created: 1_800_000_000,
        ..Default::default()
    };
    let disabled = PodDevices {
        meshed: true,
        offload: Some("disabled".into()),
        name: "disabled".into(),
        ..plain.clone()
    };
    let mut poolless_fallback = fallback("poolless", 1_800_000_000);
    poolless_fallback.pool = None;
    let grant_only = PodDevices {
        grant: Some("req-x".into()),
        name: "grant-only".into(),
        ..plain.clone()
    };
    let dropped = [plain, disabled, poolless_fallback, grant_only];
    for p in &dropped {
        assert!(!p.worth_caching(), "{p:?}");
    }
    // Whatever the sidecars say about them.
    let runtime: RuntimeVerdicts = kept
        .iter()
        .chain(&dropped)
        .map(|p| (p.uid.to_string(), "EngineUnavailable".to_owned()))
        .collect();
    let all: Vec<PodDevices> = kept.iter().chain(&dropped).cloned().collect();
    for selected in [false, true] {
        let p = pool(1, selected);
        let nodes = [node("n1", true, Some("4"))];
        assert_eq!(
            compute(&p, &nodes, &all, &runtime, &now()),
            compute(&p, &nodes, &kept, &runtime, &now())
        );
    }
}
