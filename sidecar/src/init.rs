//! `baton-sidecar init`: program iptables for transparent capture.
//!
//! Runs once as the injected init container (with NET_ADMIN). Rules live in
//! Baton's own nat chains so they can be listed and removed as a unit:
//!
//! ```text
//! PREROUTING ─▶ BATON_INBOUND ──(excluded ports: RETURN)──▶ BATON_IN_REDIRECT ─▶ REDIRECT :15006
//! OUTPUT     ─▶ BATON_OUTPUT ──(sidecar uid, loopback, excluded ports/CIDRs: RETURN)──▶ BATON_REDIRECT ─▶ REDIRECT :15001
//! ```
//! The sidecar's own uid is excluded so its upstream connections are not
//! captured again (the classic redirect loop). Rule generation is a pure
//! function ([`rules`]); [`apply`] only runs the commands.

use std::process::Command;

use crate::filters::Cidr;

pub const CHAIN_INBOUND: &str = "BATON_INBOUND";
pub const CHAIN_IN_REDIRECT: &str = "BATON_IN_REDIRECT";
pub const CHAIN_OUTPUT: &str = "BATON_OUTPUT";
pub const CHAIN_REDIRECT: &str = "BATON_REDIRECT";

/// What to capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    pub outbound_port: u16,
    pub inbound_port: u16,
    pub proxy_uid: u32,
    pub exclude_inbound_ports: Vec<u16>,
    pub exclude_outbound_ports: Vec<u16>,
    pub exclude_outbound_cidrs: Vec<Cidr>,
    /// Capture inbound traffic too (off for outbound-only pods).
    pub inbound: bool,
}

/// Parse a comma-separated list (empty entries ignored).
pub fn parse_list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<T>()
                .map_err(|_| format!("invalid list entry {x:?}"))
        })
        .collect()
}

/// The iptables invocations (arguments after `iptables`), in order.
pub fn rules(o: &InitOptions) -> Vec<Vec<String>> {
    let mut r: Vec<Vec<String>> = Vec::new();
    let mut add = |args: &[&str]| r.push(args.iter().map(|s| s.to_string()).collect());
    let out_port = o.outbound_port.to_string();
    let in_port = o.inbound_port.to_string();
    let uid = o.proxy_uid.to_string();

    add(&["-t", "nat", "-N", CHAIN_REDIRECT]);
    add(&[
        "-t",
        "nat",
        "-A",
        CHAIN_REDIRECT,
        "-p",
        "tcp",
        "-j",
        "REDIRECT",
        "--to-ports",
        &out_port,
    ]);
    add(&["-t", "nat", "-N", CHAIN_OUTPUT]);
    add(&["-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-j", CHAIN_OUTPUT]);
    // The sidecar's own connections go out untouched.
    add(&[
        "-t",
        "nat",
        "-A",
        CHAIN_OUTPUT,
        "-m",
        "owner",
        "--uid-owner",
        &uid,
        "-j",
        "RETURN",
    ]);
    // Loopback stays local (app ↔ sidecar, app ↔ itself).
    add(&[
        "-t",
        "nat",
        "-A",
        CHAIN_OUTPUT,
        "-d",
        "127.0.0.1/32",
        "-j",
        "RETURN",
    ]);
    add(&["-t", "nat", "-A", CHAIN_OUTPUT, "-o", "lo", "-j", "RETURN"]);
    for p in &o.exclude_outbound_ports {
        add(&[
            "-t",
            "nat",
            "-A",
            CHAIN_OUTPUT,
            "-p",
            "tcp",
            "--dport",
            &p.to_string(),
            "-j",
            "RETURN",
        ]);
    }
    for c in &o.exclude_outbound_cidrs {
        if c.addr.is_ipv4() {
            add(&[
                "-t",
                "nat",
                "-A",
                CHAIN_OUTPUT,
                "-d",
                &c.to_string(),
                "-j",
                "RETURN",
            ]);
        }
    }
    add(&["-t", "nat", "-A", CHAIN_OUTPUT, "-j", CHAIN_REDIRECT]);

    if o.inbound {
        add(&["-t", "nat", "-N", CHAIN_IN_REDIRECT]);
        add(&[
            "-t",
            "nat",
            "-A",
            CHAIN_IN_REDIRECT,
            "-p",
            "tcp",
            "-j",
            "REDIRECT",
            "--to-ports",
            &in_port,
        ]);
        add(&["-t", "nat", "-N", CHAIN_INBOUND]);
        add(&[
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-p",
            "tcp",
            "-j",
            CHAIN_INBOUND,
        ]);
        let admin = baton_contract::ports::ADMIN.to_string();
        for p in o
            .exclude_inbound_ports
            .iter()
            .map(|p| p.to_string())
            .chain([admin])
        {
            add(&[
                "-t",
                "nat",
                "-A",
                CHAIN_INBOUND,
                "-p",
                "tcp",
                "--dport",
                &p,
                "-j",
                "RETURN",
            ]);
        }
        add(&[
            "-t",
            "nat",
            "-A",
            CHAIN_INBOUND,
            "-p",
            "tcp",
            "-j",
            CHAIN_IN_REDIRECT,
        ]);
    }
    r
}

/// Why `init` failed.
#[derive(Debug, thiserror::Error)]
#[error("iptables {args}: {reason}")]
pub struct InitError {
    pub args: String,
    pub reason: String,
}

/// Run the rules with `iptables_bin`, stopping at the first failure.
pub fn apply(o: &InitOptions, iptables_bin: &str) -> Result<(), InitError> {
    for args in rules(o) {
        let out = Command::new(iptables_bin)
            .args(&args)
            .output()
            .map_err(|e| InitError {
                args: args.join(" "),
                reason: e.to_string(),
            })?;
        if !out.status.success() {
            return Err(InitError {
                args: args.join(" "),
                reason: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        tracing::info!(rule = %args.join(" "), "iptables");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> InitOptions {
        InitOptions {
            outbound_port: 15001,
            inbound_port: 15006,
            proxy_uid: 2137,
            exclude_inbound_ports: vec![22],
            exclude_outbound_ports: vec![5432],
            exclude_outbound_cidrs: vec![Cidr::parse("10.96.0.0/12").unwrap()],
            inbound: true,
        }
    }

    fn has(r: &[Vec<String>], line: &str) -> bool {
        r.iter().any(|a| a.join(" ") == line)
    }

    #[test]
    fn rules_exclude_the_sidecar_uid_before_redirecting() {
        let r = rules(&opts());
        let pos = |line: &str| {
            r.iter()
                .position(|a| a.join(" ") == line)
                .unwrap_or_else(|| panic!("missing {line}"))
        };
        let uid = pos("-t nat -A BATON_OUTPUT -m owner --uid-owner 2137 -j RETURN");
        let redirect = pos("-t nat -A BATON_OUTPUT -j BATON_REDIRECT");
        assert!(uid < redirect);
        assert!(has(
            &r,
            "-t nat -A BATON_REDIRECT -p tcp -j REDIRECT --to-ports 15001"
        ));
        assert!(has(
            &r,
            "-t nat -A BATON_OUTPUT -p tcp --dport 5432 -j RETURN"
        ));
        assert!(has(&r, "-t nat -A BATON_OUTPUT -d 10.96.0.0/12 -j RETURN"));
    }

    #[test]
    fn inbound_rules_exclude_listed_ports_and_the_admin_port() {
        let r = rules(&opts());
        assert!(has(
            &r,
            "-t nat -A BATON_INBOUND -p tcp --dport 22 -j RETURN"
        ));
        assert!(has(
            &r,
            "-t nat -A BATON_INBOUND -p tcp --dport 15020 -j RETURN"
        ));
        assert!(has(
            &r,
            "-t nat -A BATON_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006"
        ));
        let no_in = rules(&InitOptions {
            inbound: false,
            ..opts()
        });
        assert!(!no_in.iter().any(|a| a.iter().any(|s| s == CHAIN_INBOUND)));
    }

    #[test]
    fn comma_lists_parse_and_reject_garbage() {
        assert_eq!(parse_list::<u16>("80, 443,,").unwrap(), vec![80, 443]);
        assert!(parse_list::<u16>("80,http").is_err());
        assert!(parse_list::<u16>("").unwrap().is_empty());
    }
}
