#!/usr/bin/env python3
"""Fails on a circle between the modules of a Rust crate.

Usage: check-module-cycles.py CRATE_DIR...   (each a directory holding src/lib.rs or src/main.rs)
       check-module-cycles.py --self-test

It reads every path that names the crate's own items in each module (`crate::`, `super::`,
`self::` and paths that start with a child module's name; in `use` declarations and inline
paths alike) and builds the module graph one level at a time: for every module, its child
modules are the nodes, each child standing for its whole subtree, plus the module's own file.
A path from a file in child A's subtree to an item in child B's subtree is an edge A -> B; a
path from a child to an item defined in the parent's own file is an edge child -> the parent's
file, and the other way round. A name re-exported with `use` (`pub use engine::Runtime` in
lib.rs) counts where it is defined, not where it is re-exported. Modules under `#[cfg(test)]`
are left out: a test module may use what it likes.

A circle is printed with the path behind each edge (file:line), and the exit status is 1.
"""

import os
import re
import sys
import tempfile

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
KEYWORDS_FIRST = {"crate", "super", "self"}


def strip_comments_and_strings(text):
    """Replaces comments, string and char literals with spaces, keeping line breaks."""
    out = []
    i, n = 0, len(text)

    def blank(s):
        return "".join("\n" if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif (m := re.match(r'b?r(#*)"', text[i:i + 300])) and (i == 0 or not re.match(r"[A-Za-z0-9_]", text[i - 1])):
            close = '"' + m.group(1)
            j = text.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            out.append(blank(text[i:j]))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and (i == 0 or not re.match(r"[A-Za-z0-9_]", text[i - 1]))):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(blank(text[i:j + 1]))
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a): only the former is
            # blanked.
            m = re.match(r"'(\\(u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'", text[i:i + 12])
            if m:
                out.append(blank(m.group(0)))
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Module:
    def __init__(self, path, file, is_root_file):
        self.path = path  # tuple of names from the crate root
        self.file = file
        self.children = {}  # name -> Module (file or inline)
        self.uses = {}  # imported name -> (absolute module path of the `use`, path segments)
        self.refs = []  # (absolute path segments as written, line, file, module path)
        self.is_root_file = is_root_file


def split_use_tree(tree):
    """Expands `a::{b, c::{d, e as f}, self}` into lists of segments (with the name bound)."""
    tree = re.sub(r"\s+", "", tree)
    results = []

    def expand(prefix, s):
        # split top-level commas
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        for part in parts:
            if not part:
                continue
            brace = part.find("{")
            if brace >= 0 and part.endswith("}"):
                head = part[:brace].rstrip(":")
                segs = [x for x in head.split("::") if x]
                expand(prefix + segs, part[brace + 1:-1])
            else:
                alias = None
                if "as" in part and re.search(r"as" + IDENT + "$", part):
                    m = re.match(r"(.*?)as(" + IDENT + ")$", part)
                    # `as` glued by whitespace removal: only split when the left is a path
                    if m and (m.group(1).endswith(tuple("abcdefghijklmnopqrstuvwxyz"
                                                       "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_*"))):
                        part, alias = m.group(1), m.group(2)
                segs = prefix + [x for x in part.split("::") if x]
                if segs and segs[-1] == "self":
                    segs = segs[:-1]
                if segs:
                    results.append((segs, alias or segs[-1]))

    expand([], tree)
    return results


USE_RE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);")
MOD_RE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*([;{])")
PATH_RE = re.compile(r"(?<![A-Za-z0-9_:$])((?:" + IDENT + r"\s*::\s*)+" + IDENT + r"|(?:" + IDENT + r"\s*::\s*)+\*|(?:" + IDENT + r"\s*::\s*)+\{)")


def cfg_test_before(text, pos):
    """Whether the item starting at `pos` carries `#[cfg(test)]` in its attributes."""
    before = text[:pos].rstrip()
    while before.endswith("]"):
        start = before.rfind("#[")
        if start < 0:
            return False
        if re.fullmatch(r"#\[\s*cfg\s*\(\s*test\s*\)\s*\]", before[start:]):
            return True
        before = before[:start].rstrip()
    return False


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def parse_module_file(crate, file, path, is_root_file, modules):
    with open(file, encoding="utf-8") as f:
        text = strip_comments_and_strings(f.read())
    if is_root_file:
        child_dir = os.path.dirname(file)
    else:
        child_dir = os.path.splitext(file)[0]
    parse_body(crate, file, text, 0, len(text), path, child_dir, modules)


def matching_brace(text, open_pos):
    depth = 0
    for j in range(open_pos, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def parse_body(crate, file, text, start, end, path, child_dir, modules):
    module = modules.setdefault(path, Module(path, file, True))
    module.file = file
    pos = start
    skip = []  # (start, end) of inline child modules, parsed on their own
    for m in MOD_RE.finditer(text, start, end):
        if any(a <= m.start() < b for a, b in skip):
            continue
        name = m.group(1)
        test_only = cfg_test_before(text, m.start())
        if m.group(2) == "{":
            close = matching_brace(text, m.end() - 1)
            skip.append((m.start(), close + 1))
            if test_only:
                continue
            child_path = path + (name,)
            modules[child_path] = Module(child_path, file, False)
            module.children[name] = modules[child_path]
            parse_body(crate, file, text, m.end(), close, child_path,
                       os.path.join(child_dir, name), modules)
        else:
            skip.append((m.start(), m.end()))
            if test_only:
                continue
            candidates = [os.path.join(child_dir, name + ".rs"),
                          os.path.join(child_dir, name, "mod.rs")]
            found = next((c for c in candidates if os.path.exists(c)), None)
            if found is None:
                continue
            child_path = path + (name,)
            modules[child_path] = Module(child_path, found, found.endswith("mod.rs"))
            module.children[name] = modules[child_path]
            parse_module_file(crate, found, child_path, found.endswith("mod.rs"), modules)
    # The text of this module alone (inline children cut out).
    pieces, cur = [], start
    for a, b in sorted(skip):
        if a < cur:
            continue
        pieces.append(text[cur:a])
        pieces.append("".join("\n" if c == "\n" else " " for c in text[a:b]))
        cur = b
    pieces.append(text[cur:end])
    own = "".join(pieces)
    offset = line_of(text, start) - 1
    uses_spans = []
    for m in USE_RE.finditer(own):
        uses_spans.append((m.start(), m.end()))
        line = offset + line_of(own, m.start())
        for segs, alias in split_use_tree(m.group(1)):
            if segs[0] == "::":
                continue
            module.refs.append((segs, line, file, path))
            if alias != "*":
                module.uses[alias] = segs
    for m in PATH_RE.finditer(own):
        if any(a <= m.start() < b for a, b in uses_spans):
            continue
        segs = [s for s in re.split(r"\s*::\s*", m.group(1)) if s and s not in ("{",)]
        module.refs.append((segs, offset + line_of(own, m.start()), file, path))


def resolve(modules, from_path, segs, depth=0):
    """The module path where the item `segs` (written in module `from_path`) is defined, or
    None when the path leaves the crate."""
    if depth > 16 or not segs:
        return None
    first = segs[0]
    if first == "crate":
        cur, rest = (), segs[1:]
    elif first == "super":
        cur, rest = from_path, segs
        while rest and rest[0] == "super":
            if not cur:
                return None
            cur, rest = cur[:-1], rest[1:]
    elif first == "self":
        cur, rest = from_path, segs[1:]
    elif first in modules[from_path].children:
        cur, rest = from_path, segs
    elif first in modules[from_path].uses and modules[from_path].uses[first] != segs:
        target = modules[from_path].uses[first]
        return resolve(modules, from_path, target + segs[1:], depth + 1)
    else:
        return None
    while rest:
        name = rest[0]
        module = modules.get(cur)
        if module is None:
            return None
        if name in module.children:
            cur, rest = cur + (name,), rest[1:]
            continue
        if name == "*":
            return cur
        if name in module.uses:
            target = module.uses[name]
            found = resolve(modules, cur, target + rest[1:], depth + 1)
            return found if found is not None else cur
        return cur
    return cur


def crate_graphs(crate_dir):
    src = os.path.join(crate_dir, "src")
    root = next((os.path.join(src, f) for f in ("lib.rs", "main.rs")
                 if os.path.exists(os.path.join(src, f))), None)
    if root is None:
        raise SystemExit(f"error: {crate_dir} has no src/lib.rs or src/main.rs")
    modules = {}
    modules[()] = Module((), root, True)
    parse_module_file(crate_dir, root, (), True, modules)
    # graphs[parent] = {node: {node: [(file, line, path text)]}}; a node is a child name, or
    # None for the parent's own file.
    graphs = {}
    for module in list(modules.values()):
        for segs, line, file, from_path in module.refs:
            target = resolve(modules, from_path, segs)
            if target is None or target == from_path:
                continue
            common = 0
            while (common < len(from_path) and common < len(target)
                   and from_path[common] == target[common]):
                common += 1
            parent = from_path[:common]
            src_node = from_path[common] if len(from_path) > common else None
            dst_node = target[common] if len(target) > common else None
            if src_node == dst_node:
                continue
            # `mod x;` and `pub use x::...` of a parent are its wiring, not a use.
            graph = graphs.setdefault(parent, {})
            graph.setdefault(src_node, {}).setdefault(dst_node, []).append(
                (file, line, "::".join(segs)))
    return modules, graphs


def find_cycles(graph):
    """Strongly connected components of more than one node, each as one circle (a list)."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]
    nodes = set(graph) | {d for e in graph.values() for d in e}

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(nodes, key=lambda x: (x is not None, x or "")):
        if v not in index:
            strong(v)
    circles = []
    for comp in comps:
        members = set(comp)
        start = sorted(comp, key=lambda x: (x is not None, x or ""))[0]
        # the shortest circle through `start` inside the component (breadth first)
        prev, frontier, seen = {}, [start], {start}
        end = None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, {}), key=lambda x: (x is not None, x or "")):
                    if w not in members:
                        continue
                    if w == start:
                        end = v
                        break
                    if w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [end]
        while path[-1] != start:
            path.append(prev[path[-1]])
        circles.append((list(reversed(path)), sorted(comp, key=lambda x: (x is not None, x or ""))))
    return circles


def node_name(parent, node):
    if node is None:
        return "::".join(("crate",) + parent) + " (its own file)"
    return "::".join(("crate",) + parent + (node,))


def check(crate_dir, out=sys.stdout):
    """Prints the circles of one crate; returns how many there are."""
    _, graphs = crate_graphs(crate_dir)
    found = 0
    for parent in sorted(graphs):
        graph = graphs[parent]
        for circle, tangle in find_cycles(graph):
            found += 1
            names = [node_name(parent, n) for n in circle]
            print(f"{crate_dir}: module circle: {' -> '.join(names + names[:1])}", file=out)
            if len(tangle) > len(circle):
                print(f"    (one of the circles among {', '.join(node_name(parent, n) for n in tangle)})",
                      file=out)
            for a, b in zip(circle, circle[1:] + circle[:1]):
                file, line, text = graph[a][b][0]
                more = len(graph[a][b]) - 1
                extra = f" (and {more} more)" if more else ""
                print(f"    {node_name(parent, a)} -> {node_name(parent, b)}: "
                      f"{os.path.relpath(file)}:{line}: {text}{extra}", file=out)
    return found


def self_test():
    """Checks the checker on made-up crates: one with circles, one without."""
    import io

    def write(root, files):
        for name, text in files.items():
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        circular = os.path.join(tmp, "circular")
        write(circular, {
            "src/lib.rs": "mod a;\nmod b;\nmod c;\nmod hub;\npub use b::B;\n"
                          "#[cfg(test)]\nmod tests { use crate::a::A; }\n",
            # a -> b through a re-export at the crate root, inline path
            "src/a.rs": "pub struct A;\npub fn f() -> crate::B { crate::B }\n"
                        "// crate::c::C in a comment is no use\n"
                        "const S: &str = \"crate::c::C\";\n",
            # b -> a through a grouped use
            "src/b.rs": "use crate::{a::{self, A}};\npub struct B;\nfn g(_: A) {}\n",
            "src/c.rs": "pub struct C;\n",
            # a child using what its parent's own file defines, the parent using the child
            "src/hub/mod.rs": "mod leaf;\npub struct Shared;\nfn h() { leaf::go(); }\n",
            "src/hub/leaf.rs": "use super::Shared;\npub fn go() -> Option<Shared> { None }\n",
        })
        out = io.StringIO()
        count = check(circular, out)
        text = out.getvalue()
        if count != 2:
            failures.append(f"expected 2 circles, found {count}:\n{text}")
        if "crate::a -> crate::b -> crate::a" not in text:
            failures.append(f"the a/b circle is not named:\n{text}")
        if "crate::hub (its own file) -> crate::hub::leaf -> crate::hub (its own file)" not in text:
            failures.append(f"the hub/leaf circle is not named:\n{text}")
        if "crate::c" in text:
            failures.append(f"a path in a comment or a string was read:\n{text}")

        clean = os.path.join(tmp, "clean")
        write(clean, {
            "src/lib.rs": "mod engine;\nmod limits;\npub use engine::Runtime;\n"
                          "pub use limits::Limits;\n",
            "src/engine/mod.rs": "mod store;\nuse crate::limits::Limits;\n"
                                 "pub struct Runtime(Limits, store::Store);\n",
            "src/engine/store.rs": "use crate::Limits;\npub struct Store(Limits);\n"
                                   "#[cfg(test)]\nmod tests;\n",
            "src/engine/store/tests.rs": "use super::super::Runtime;\n",
            "src/limits.rs": "pub struct Limits;\nimpl Limits { fn f() -> Self { Self } }\n"
                             "fn lt<'a>(x: &'a str) -> char { let _ = x; 'x' }\n",
        })
        out = io.StringIO()
        count = check(clean, out)
        if count != 0:
            failures.append(f"the clean crate has circles:\n{out.getvalue()}")
    for failure in failures:
        print(f"self-test failed: {failure}", file=sys.stderr)
    if not failures:
        print("self-test passed")
    return 1 if failures else 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    if not argv or any(a.startswith("-") for a in argv):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    circles = sum(check(crate) for crate in argv)
    if circles:
        print(f"error: {circles} module circle(s); break each by moving what both sides need "
              "into a module below them both, or by handing a callback down", file=sys.stderr)
        return 1
    print(f"no module circles in {', '.join(argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
