#!/usr/bin/env python3
"""Dependency cycles between the top-level modules of each workspace crate.

Why: the compiler enforces one-way dependencies between crates, not between
modules inside one crate. This reads each library crate's module tree (from
`src/lib.rs`, following `mod` declarations and `#[path]`), finds every path
into another top-level module (`crate::x`, `super::x` resolved against the
module it appears in, `use crate::{x, y::z}` groups, and names that `lib.rs`
re-exports), builds the graph of top-level modules and reports its strongly
connected components. Code under `#[cfg(test)]` is left out: a test importing
a sibling is not a design dependency.

It fails when a crate has any cycle (two or more top-level modules that
reach each other), unless the baseline file lists a known cycle that
contains it (a cycle may shrink, never grow or appear). The baseline is
empty: module dependencies inside every crate go one way (issue #32). Standard library only: it runs wherever the
bench scripts run.

  scripts/module-cycles.sh                 # check every crate (the test.sh gate)
  scripts/module-cycles.sh --graph sidecar # Mermaid graph of one crate's modules
  scripts/module-cycles.sh --edges sidecar # the same as a table: module, cycle, imports
  scripts/module-cycles.sh --crates        # Mermaid graph of the workspace crates
  scripts/module-cycles.sh --baseline      # print today's cycles in baseline format
  scripts/module-cycles.sh --self-test     # the checker's own tests
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import unittest
from pathlib import Path

# The largest strongly connected component allowed: a module alone.
MAX_CYCLE = 1
ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "scripts" / "module-cycles.baseline"

# --------------------------------------------------------------------- lexing

TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<line_comment>//[^\n]*)
  | (?P<block_comment>/\*)
  | (?P<raw_str>b?r(?P<hashes>\#*)")
  | (?P<str>b?"(?:\\.|[^"\\])*")
  | (?P<char>b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])')
  | (?P<lifetime>'[A-Za-z_][A-Za-z0-9_]*)
  | (?P<ident>r\#[A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*)
  | (?P<path_sep>::)
  | (?P<num>[0-9][0-9A-Za-z_.]*)
  | (?P<punct>.)
    """,
    re.VERBOSE | re.DOTALL,
)


def tokens(src: str) -> list[tuple[str, str]]:
    """(kind, text) tokens with comments and whitespace dropped. Strings are
    kept as one token (their text matters only for `#[path = "…"]`)."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(src)
    while i < n:
        m = TOKEN.match(src, i)
        if m is None:  # pragma: no cover - `.` with DOTALL matches anything
            raise ValueError(f"cannot lex at offset {i}")
        kind = m.lastgroup
        if kind == "block_comment":
            depth, j = 1, m.end()
            while depth and j < n:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            i = j
            continue
        if kind == "raw_str":
            end = '"' + m.group("hashes")
            j = src.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append(("str", src[m.end() : j - len(end)]))
            i = j
            continue
        i = m.end()
        if kind == "hashes":  # pragma: no cover - inner group, never last
            continue
        if kind in ("ws", "line_comment"):
            continue
        text = m.group()
        if kind == "str":
            text = text[text.index('"') + 1 : -1]
        if kind == "ident" and text.startswith("r#"):
            text = text[2:]
        out.append((kind, text))
    return out


# --------------------------------------------------------------- module tree


class Crate:
    """Top-level modules of one library crate and the edges between them."""

    def __init__(self, name: str, src: Path):
        self.name = name
        self.src = src
        self.modules: list[str] = []  # top-level modules, in declaration order
        self.reexports: dict[str, str] = {}  # name re-exported by lib.rs -> module
        self.refs: list[tuple[str, list[str]]] = []  # (from module, absolute path)
        self.edges: dict[str, set[str]] = {}

    @classmethod
    def load(cls, name: str, src: Path) -> "Crate":
        crate = cls(name, src)
        crate._file(src / "lib.rs", [], src, is_mod_rs=True, test=False)
        mods = set(crate.modules)
        crate.edges = {m: set() for m in crate.modules}
        for frm, path in crate.refs:
            if not path:
                continue
            to = path[0] if path[0] in mods else crate.reexports.get(path[0])
            if to in mods and to != frm and frm in mods:
                crate.edges[frm].add(to)
        return crate

    def _file(self, file: Path, modpath: list[str], dir_for_children: Path, is_mod_rs: bool, test: bool) -> None:
        toks = tokens(file.read_text(encoding="utf-8"))
        # Stack of (module path, brace depth at which it closes, under cfg(test)).
        stack: list[tuple[list[str], int, bool]] = [(modpath, -1, test)]
        depth = 0
        pending_test = False
        pending_path: str | None = None
        i = 0
        while i < len(toks):
            kind, text = toks[i]
            cur_path, _, cur_test = stack[-1]
            if text == "#" and i + 1 < len(toks) and toks[i + 1][1] in ("[", "!"):
                # An attribute: note cfg(test) and path = "…" for the next item.
                j = i + 1 + (toks[i + 1][1] == "!")
                if j < len(toks) and toks[j][1] == "[":
                    k, level = j, 0
                    while k < len(toks):
                        level += {"[": 1, "]": -1}.get(toks[k][1], 0)
                        if level == 0:
                            break
                        k += 1
                    body = toks[j + 1 : k]
                    words = [t for _, t in body]
                    if words[:4] == ["cfg", "(", "test", ")"]:
                        if toks[i + 1][1] == "!":  # #![cfg(test)]: the whole file
                            stack[-1] = (cur_path, stack[-1][1], True)
                        else:
                            pending_test = True
                    if words[:2] == ["path", "="] and len(body) > 2 and body[2][0] == "str":
                        pending_path = body[2][1]
                    i = k + 1
                    continue
            if text == "{":
                if pending_test:  # a #[cfg(test)] fn/impl/block: nothing in it counts
                    stack.append((cur_path, depth, True))
                depth += 1
            elif text == "}":
                depth -= 1
                if len(stack) > 1 and depth == stack[-1][1]:
                    stack.pop()
            elif kind == "ident" and text == "mod" and i + 2 < len(toks) and toks[i + 1][0] == "ident":
                name, after = toks[i + 1][1], toks[i + 2][1]
                child_test = cur_test or pending_test
                child_path = cur_path + [name]
                if after == ";":
                    self._declare(file, child_path, dir_for_children, is_mod_rs, pending_path, child_test, inline_depth=len(stack) - 1)
                    i += 3
                    pending_test, pending_path = False, None
                    continue
                if after == "{":
                    if not cur_path and not child_test:
                        self.modules.append(name)
                    stack.append((child_path, depth, child_test))
                    depth += 1
                    i += 3
                    pending_test, pending_path = False, None
                    continue
            elif kind == "ident" and text in ("crate", "super", "self") and not (cur_test or pending_test):
                i = self._path(toks, i, cur_path)
                continue
            elif kind == "ident" and text == "use" and not cur_path and not cur_test:
                i = self._root_use(toks, i + 1)
                continue
            if text in (";", "}", "{"):
                pending_test, pending_path = False, None
            i += 1

    def _declare(self, file, child_path, dir_for_children, is_mod_rs, path_attr, test, inline_depth) -> None:
        name = child_path[-1]
        if not child_path[:-1] and not test:
            self.modules.append(name)
        if test:
            return  # test-only files contribute no design edges
        if path_attr is not None:
            target = (file.parent / path_attr) if inline_depth == 0 else (dir_for_children / path_attr)
            self._file(target, child_path, target.parent, is_mod_rs=True, test=test)
            return
        base = dir_for_children if is_mod_rs else dir_for_children / file.stem
        for cand, mod_rs in ((base / f"{name}.rs", False), (base / name / "mod.rs", True)):
            if cand.exists():
                children = cand.parent if mod_rs else cand.parent
                self._file(cand, child_path, children, is_mod_rs=mod_rs, test=test)
                return
        raise FileNotFoundError(f"{file}: `mod {name};` has no file under {base}")

    def _path(self, toks, i, cur_path) -> int:
        """Resolve the path starting at toks[i] (`crate`, `super` or `self`),
        record where it points, return the index after it."""
        path = [] if toks[i][1] == "crate" else list(cur_path)
        first = toks[i][1]
        if first == "super":
            path = path[:-1]
        i += 1
        while i + 1 < len(toks) and toks[i][1] == "::" and toks[i + 1][1] == "super" and first != "crate":
            path, i = path[:-1], i + 2
        if i < len(toks) and toks[i][1] == "::":
            if i + 1 < len(toks) and toks[i + 1][1] == "{":
                for head in self._group_heads(toks, i + 1):
                    self._ref(cur_path, path + [head])
                return i + 2
            if i + 1 < len(toks) and toks[i + 1][0] == "ident":
                self._ref(cur_path, path + [toks[i + 1][1]])
                return i + 2
        return i

    @staticmethod
    def _group_heads(toks, open_idx) -> list[str]:
        """First segment of each element of a `{a, b::c, d::{e}}` use group."""
        heads, level, expect = [], 0, True
        k = open_idx
        while k < len(toks):
            t = toks[k][1]
            if t == "{":
                level += 1
                if level == 1:
                    expect = True
            elif t == "}":
                level -= 1
                if level == 0:
                    break
            elif t == "," and level == 1:
                expect = True
            elif level == 1 and expect and toks[k][0] == "ident":
                if t != "self":
                    heads.append(t)
                expect = False
            elif level == 1:
                expect = False
            k += 1
        return heads

    def _ref(self, cur_path, absolute) -> None:
        if cur_path and absolute:
            self.refs.append((cur_path[0], absolute))

    def _root_use(self, toks, i) -> int:
        """`use a::b::{C, D as E};` in lib.rs: the leaf names point at `a`."""
        start = i
        while i < len(toks) and toks[i][1] != ";":
            i += 1
        words = [t for _, t in toks[start:i]]
        if not words or words[0] in ("crate", "self", "super", "std", "core", "alloc"):
            return i + 1
        module = words[0]
        leaves = [w for k, w in enumerate(words) if re.match(r"^[A-Za-z_]\w*$", w) and (k + 1 == len(words) or words[k + 1] in (",", "}"))]
        for leaf in leaves:
            self.reexports.setdefault(leaf, module)
        return i + 1


# ----------------------------------------------------------------- the graph


def sccs(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def read_baseline(path: Path) -> dict[str, list[set[str]]]:
    known: dict[str, list[set[str]]] = {}
    if not path.exists():
        return known
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        crate, sep, members = line.partition(":")
        if not sep or not members.split():
            raise SystemExit(f"{path}:{n}: expected `crate: module module …`, got {line!r}")
        known.setdefault(crate.strip(), []).append(set(members.split()))
    return known


def check(crate: Crate, known: list[set[str]]) -> tuple[list[str], list[str]]:
    """(failures, notes) for one crate against its baseline cycles."""
    failures, notes = [], []
    big = [c for c in sccs(crate.edges) if len(c) > MAX_CYCLE]
    for comp in big:
        if any(set(comp) <= k for k in known):
            notes.append(f"{crate.name}: known cycle of {len(comp)} modules (baseline): {' '.join(comp)}")
        else:
            grown = [k for k in known if k & set(comp)]
            what = "grew beyond its baseline" if grown else "is new"
            extra = sorted(set(comp) - set().union(*grown)) if grown else []
            failures.append(
                f"{crate.name}: a cycle of {len(comp)} top-level modules {what} (none allowed): "
                f"{' '.join(comp)}" + (f"\n    not in the baseline: {' '.join(extra)}" if extra else "")
                + "\n    " + "\n    ".join(path_hint(crate, comp))
            )
    for k in known:
        now = [c for c in big if set(c) <= k]
        if not now:
            notes.append(f"{crate.name}: the baseline cycle ({len(k)} modules) is gone: delete its line from {BASELINE.relative_to(ROOT)}")
        elif len(now[0]) < len(k):
            notes.append(f"{crate.name}: the cycle shrank to {len(now[0])} of {len(k)} modules: update the baseline (--baseline)")
    return failures, notes


def path_hint(crate: Crate, comp: list[str]) -> list[str]:
    inside = set(comp)
    return [f"{m} -> {' '.join(sorted(crate.edges[m] & inside))}" for m in comp]


def workspace_crates() -> list[tuple[str, Path]]:
    members = re.search(r"members\s*=\s*\[([^\]]*)\]", (ROOT / "Cargo.toml").read_text())
    out = []
    for d in re.findall(r'"([^"]+)"', members.group(1) if members else ""):
        manifest = (ROOT / d / "Cargo.toml").read_text()
        name = re.search(r'^\s*name\s*=\s*"([^"]+)"', manifest, re.M).group(1)
        if (ROOT / d / "src" / "lib.rs").exists():
            out.append((name, ROOT / d / "src"))
    return out


def crate_graph() -> str:
    """Mermaid graph of the workspace crates' normal dependencies on each other."""
    names = {}
    deps = {}
    for d in re.findall(r'"([^"]+)"', re.search(r"members\s*=\s*\[([^\]]*)\]", (ROOT / "Cargo.toml").read_text()).group(1)):
        manifest = (ROOT / d / "Cargo.toml").read_text()
        names[d] = re.search(r'^\s*name\s*=\s*"([^"]+)"', manifest, re.M).group(1)
        section = re.search(r"^\[dependencies\]\n(.*?)(?=^\[|\Z)", manifest, re.M | re.S)
        deps[d] = re.findall(r"^(baton-[\w-]+)\s*=", section.group(1) if section else "", re.M)
    lines = ["graph LR"]
    for d, name in names.items():
        for dep in deps[d]:
            # Mermaid ids cannot hold '-'; the label keeps the package name.
            lines.append(f'  {name.replace("-", "_")}["{name}"] --> {dep.replace("-", "_")}["{dep}"]')
    return "\n".join(lines)


def module_graph(crate: Crate) -> str:
    """Mermaid graph of one crate's top-level modules; a cycle's members are
    drawn inside one box so the direction outside it stays readable."""
    comps = sccs(crate.edges)
    lines = ["graph TD"]
    comp_of = {}
    for n, comp in enumerate(c for c in comps if len(c) > 1):
        lines.append(f"  subgraph cycle{n}[\"cycle of {len(comp)}\"]")
        for m in comp:
            lines.append(f"    {m}")
            comp_of[m] = n
        lines.append("  end")
    seen = set()
    for m in crate.modules:
        for to in sorted(crate.edges[m]):
            a = f"cycle{comp_of[m]}" if m in comp_of else m
            b = f"cycle{comp_of[to]}" if to in comp_of else to
            if a == b or (a, b) in seen:
                continue
            seen.add((a, b))
            lines.append(f"  {a} --> {b}")
    for m in crate.modules:
        if not crate.edges[m] and not any(m in e for e in crate.edges.values()) and m not in comp_of:
            lines.append(f"  {m}")
    return "\n".join(lines)


def edge_table(crate: Crate) -> str:
    """Markdown table: each top-level module, the cycle it is in, what it imports."""
    comp_size = {m: len(c) for c in sccs(crate.edges) for m in c}
    rows = ["| module | in a cycle of | imports |", "|---|---:|---|"]
    for m in sorted(crate.modules):
        size = comp_size[m] if comp_size[m] > 1 else ""
        rows.append(f"| `{m}` | {size} | {', '.join(f'`{t}`' for t in sorted(crate.edges[m])) or '—'} |")
    return "\n".join(rows)


# --------------------------------------------------------------- self-tests


class SelfTest(unittest.TestCase):
    def crate(self, files: dict[str, str]) -> Crate:
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        src = Path(tmp.name)
        for rel, text in files.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text(text)
        return Crate.load("t", src)

    def test_a_cycle_of_four_modules_fails_without_a_baseline(self):
        c = self.crate({
            "lib.rs": "pub mod a; pub mod b; pub mod c; pub mod d;",
            "a.rs": "use crate::b::X;", "b.rs": "use super::c::Y;",
            "c.rs": "fn f() { crate::d::g() }", "d.rs": "use crate::{a::Z, b};",
        })
        self.assertEqual(sccs(c.edges)[0], ["a", "b", "c", "d"])
        failures, _ = check(c, [])
        self.assertEqual(len(failures), 1)
        self.assertIn("is new", failures[0])

    def test_a_cycle_of_two_modules_fails_and_one_way_imports_pass(self):
        c = self.crate({
            "lib.rs": "mod a; mod b; mod c;",
            "a.rs": "use crate::b::X;", "b.rs": "use crate::a::Y;", "c.rs": "use crate::a::Z;",
        })
        failures, _ = check(c, [])
        self.assertEqual(len(failures), 1)
        self.assertIn("a cycle of 2 top-level modules is new", failures[0])
        c = self.crate({
            "lib.rs": "mod a; mod b; mod c;",
            "a.rs": "use crate::b::X;", "b.rs": "use crate::c::Y;", "c.rs": "",
        })
        self.assertEqual(check(c, []), ([], []))

    def test_a_cycle_inside_the_baseline_passes_and_a_grown_one_fails(self):
        files = {
            "lib.rs": "mod a; mod b; mod c; mod d; mod e;",
            "a.rs": "use crate::b::X;", "b.rs": "use crate::c::X;", "c.rs": "use crate::d::X;",
            "d.rs": "use crate::a::X;", "e.rs": "",
        }
        c = self.crate(files)
        self.assertEqual(check(c, [{"a", "b", "c", "d"}])[0], [])
        files["e.rs"] = "use crate::a::X;"
        files["d.rs"] = "use crate::{a::X, e::Y};"
        failures, _ = check(self.crate(files), [{"a", "b", "c", "d"}])
        self.assertEqual(len(failures), 1)
        self.assertIn("not in the baseline: e", failures[0])

    def test_a_shrunk_cycle_passes_and_says_the_baseline_can_shrink(self):
        c = self.crate({
            "lib.rs": "mod a; mod b; mod c; mod d; mod e;",
            "a.rs": "use crate::b::X;", "b.rs": "use crate::c::X;", "c.rs": "use crate::d::X;",
            "d.rs": "use crate::a::X;", "e.rs": "",
        })
        failures, notes = check(c, [{"a", "b", "c", "d", "e"}])
        self.assertEqual(failures, [])
        self.assertTrue(any("shrank to 4 of 5" in n for n in notes))

    def test_test_code_comments_and_strings_add_no_edges(self):
        c = self.crate({
            "lib.rs": "mod a; mod b; #[cfg(test)] mod t;",
            "a.rs": '// crate::b::X\n/* crate::b /* nested */ */ const S: &str = "crate::b::x";\n'
                    "#[cfg(test)]\nmod tests { use crate::b::X; }\n",
            "b.rs": "", "t.rs": "use crate::a::Y; use crate::b::Z;",
        })
        self.assertEqual(c.edges, {"a": set(), "b": set()})

    def test_super_resolves_against_nested_and_inline_modules(self):
        c = self.crate({
            "lib.rs": "mod a; mod b;",
            "a/mod.rs": "mod inner; mod x { use super::super::b::Y; }",
            "a/inner.rs": "use super::sibling; use super::super::b::Z;",
            "b.rs": "mod c { use super::Q; }",
        })
        self.assertEqual(c.edges, {"a": {"b"}, "b": set()})

    def test_path_attributes_and_lib_reexports_are_followed(self):
        c = self.crate({
            "lib.rs": "mod a; mod b; pub use b::{Thing, Other as O};",
            "a.rs": '#[path = "a_impl.rs"] mod imp;', "a_impl.rs": "use crate::Thing;",
            "b.rs": "",
        })
        self.assertEqual(c.edges, {"a": {"b"}, "b": set()})


# ---------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", metavar="CRATE", help="print a Mermaid graph of CRATE's top-level modules")
    ap.add_argument("--edges", metavar="CRATE", help="print a Markdown table of CRATE's module imports")
    ap.add_argument("--crates", action="store_true", help="print a Mermaid graph of the workspace crates")
    ap.add_argument("--baseline", action="store_true", help="print today's cycles (any of two or more modules)")
    ap.add_argument("--self-test", action="store_true", help="run the checker's own tests")
    args = ap.parse_args()
    if args.self_test:
        res = unittest.TextTestRunner(verbosity=2).run(unittest.defaultTestLoader.loadTestsFromTestCase(SelfTest))
        return 0 if res.wasSuccessful() else 1
    if args.crates:
        print(crate_graph())
        return 0
    crates = [Crate.load(name, src) for name, src in workspace_crates()]
    wanted = args.graph or args.edges
    if wanted:
        for c in crates:
            if wanted in (c.name, c.src.parent.name):
                print(module_graph(c) if args.graph else edge_table(c))
                return 0
        print(f"no library crate named {wanted}", file=sys.stderr)
        return 2
    if args.baseline:
        print("# Known cycles between top-level modules, one per line; generated by")
        print("# `scripts/module-cycles.sh --baseline`. The check fails if a cycle is not inside one of these.")
        for c in crates:
            for comp in sccs(c.edges):
                if len(comp) > MAX_CYCLE:
                    print(f"{c.name}: {' '.join(comp)}")
        return 0
    known = read_baseline(BASELINE)
    failed = False
    for c in crates:
        comps = sccs(c.edges)
        largest = len(comps[0]) if comps else 0
        print(f"{c.name}: {len(c.modules)} top-level modules, largest cycle {largest if largest > 1 else 'none'}")
        failures, notes = check(c, known.get(c.name, []))
        for n in notes:
            print(f"  note: {n}")
        for f in failures:
            print(f"  FAIL: {f}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
