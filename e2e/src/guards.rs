//! The harness's egress guards, read back by tests: iptables chains
//! `BATON-E2E-FWD` (pods are never routed off the bridge) and
//! `BATON-E2E-OUT` (nothing reaches the link-local metadata range), installed
//! by `e2e/cluster.sh up` with packet counters.

use std::process::Command;

/// Chain in `FORWARD` dropping everything from the bridge to elsewhere.
pub const FORWARD_GUARD: &str = "BATON-E2E-FWD";
/// Chain in `OUTPUT` dropping everything to 169.254.0.0/16.
pub const OUTPUT_GUARD: &str = "BATON-E2E-OUT";
/// The cluster's pod bridge.
pub const BRIDGE: &str = "baton0";
/// The pod subnet on that bridge.
pub const POD_SUBNET: &str = "10.88.0.0/16";

/// One rule of a guard chain with its counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardRule {
    pub packets: u64,
    pub bytes: u64,
    /// The rule as `iptables -S` prints it.
    pub spec: String,
}

/// Errors reading a chain.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("running {0}: {1}")]
    Exec(&'static str, std::io::Error),
    #[error("{tool} could not read chain {chain}: {stderr}")]
    Missing {
        tool: &'static str,
        chain: String,
        stderr: String,
    },
}

/// Rules of `chain` in the filter table, with exact counters.
/// `tool` is `iptables` or `ip6tables`.
pub fn read_chain(tool: &'static str, chain: &str) -> Result<Vec<GuardRule>, GuardError> {
    // `-S -v` prints each rule with `-c <packets> <bytes>`: exact and parseable.
    let out = Command::new(tool)
        .args(["-w", "-t", "filter", "-S", chain, "-v"])
        .output()
        .map_err(|e| GuardError::Exec(tool, e))?;
    if !out.status.success() {
        return Err(GuardError::Missing {
            tool,
            chain: chain.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(parse_rules(&String::from_utf8_lossy(&out.stdout), chain))
}

/// Parses `iptables -S <chain> -v` output (pure, unit-tested).
pub fn parse_rules(text: &str, chain: &str) -> Vec<GuardRule> {
    let prefix = format!("-A {chain} ");
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(&prefix)?;
            let words: Vec<&str> = rest.split_whitespace().collect();
            let c = words.iter().position(|w| *w == "-c")?;
            let packets = words.get(c + 1)?.parse().ok()?;
            let bytes = words.get(c + 2)?.parse().ok()?;
            let spec: Vec<&str> = words[..c].iter().chain(&words[c + 3..]).copied().collect();
            Some(GuardRule {
                packets,
                bytes,
                spec: spec.join(" "),
            })
        })
        .collect()
}

/// Total packets dropped by a chain's rules.
pub fn dropped_packets(rules: &[GuardRule]) -> u64 {
    rules.iter().map(|r| r.packets).sum()
}

/// Whether built-in `parent` (e.g. `FORWARD`) jumps to `chain` as its first rule.
pub fn jumps_first(tool: &'static str, parent: &str, chain: &str) -> Result<bool, GuardError> {
    let out = Command::new(tool)
        .args(["-w", "-t", "filter", "-S", parent])
        .output()
        .map_err(|e| GuardError::Exec(tool, e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first_rule = text.lines().find(|l| l.starts_with("-A "));
    Ok(first_rule == Some(&format!("-A {parent} -j {chain}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_specs_are_parsed_from_iptables_s_v() {
        let text = "-N BATON-E2E-FWD\n-A BATON-E2E-FWD -i baton0 ! -o baton0 -c 12 720 -j DROP\n";
        assert_eq!(
            parse_rules(text, FORWARD_GUARD),
            vec![GuardRule {
                packets: 12,
                bytes: 720,
                spec: "-i baton0 ! -o baton0 -j DROP".to_owned()
            }]
        );
    }

    #[test]
    fn rules_of_other_chains_are_ignored() {
        let text = "-A BATON-E2E-OUT -d 169.254.0.0/16 -c 0 0 -j DROP\n-A OTHER -c 5 5 -j DROP\n";
        let rules = parse_rules(text, OUTPUT_GUARD);
        assert_eq!(rules.len(), 1);
        assert_eq!(dropped_packets(&rules), 0);
    }
}
