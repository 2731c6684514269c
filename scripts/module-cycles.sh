#!/usr/bin/env bash
# Dependency cycles between each crate's top-level modules (see
# scripts/module_cycles.py for what is read and why); a gate in scripts/test.sh.
set -euo pipefail
exec python3 "$(dirname "$0")/module_cycles.py" "$@"
