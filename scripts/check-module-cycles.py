#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a cycle, or across the extension's layers.

The graph comes from the paths `crate::a::b` and `super::b` named in a crate's source folder (in
`use` statements and inline, not in comments), outside `#[cfg(test)]` modules: an edge from each
file's module to the deepest module of the path that is a file of that crate. Paths into other
crates are not edges: the extension names the core crate's modules by the core crate's name
(`pg_meili_sync_core::pipeline::batch`), never as its own `crate::…`.

The extension's folder (`src`) is layered as well (LAYERS): the workers and the rule modules never
import `api`, and `catalog` imports none of the modules built on it. Each forbidden edge is
printed with the file, line and path that make it, unless ALLOWED names it with a reason.

Run from the repository root with the source folders to check (default: the extension's src and
the core crate's crates/core/src); prints each graph with -v.
"""
import os
import re
import sys

DEFAULT_ROOTS = ["src", "crates/core/src"]

# The modules of the extension that hold its rules: what a task may be (`rules`), and the checks
# the SQL API and the workers both run. Like the workers, they are called by `api`, never the other
# way round.
RULE_MODULES = ["rules", "plan", "security", "verify", "resync_request", "materialized", "search",
                "decode", "shmem", "catalog"]

# The layers of a source folder (named as it is passed, relative to the repository root): each
# rule is (the top-level modules an import may start from, the top-level modules it must not
# reach, why). `worker::stream` importing `api::tasks` is `worker` importing `api`.
LAYERS = {
    "src": [
        (["worker"] + RULE_MODULES, ["api"],
         "the SQL API calls the workers and the rules, never the reverse"),
        (["catalog"], ["api", "worker", "rules", "plan", "verify", "search", "materialized",
                       "resync_request"],
         "the catalog is read by the modules built on it, and reads none of them"),
    ],
}

# Edges that a layer forbids but the code has, each with the reason it stays: {(folder, from
# module, to module): why}. Empty: today `catalog` imports only error, gucs, security and shmem.
ALLOWED = {}


def module_of(path, src):
    """src/worker/task.rs -> worker::task; src/decode/mod.rs -> decode; src/lib.rs -> crate."""
    parts = os.path.relpath(path, src)[: -len(".rs")].split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return "::".join(parts) if parts != ["lib"] else "crate"


def non_test_text(text):
    """The file without its `#[cfg(test)] mod … { … }` blocks (brace-matched); each block leaves
    its newlines, so that line numbers stay those of the file."""
    out, position = [], 0
    for match in re.finditer(r"#\[cfg\(test\)\]\s*(pub\s+)?mod\s+\w+\s*\{", text):
        if match.start() < position:
            continue
        out.append(text[position : match.start()])
        depth, index = 1, match.end()
        while depth and index < len(text):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            index += 1
        out.append("\n" * text.count("\n", match.start(), index))
        position = index
    out.append(text[position:])
    return "".join(out)


def named_paths(module, path, text):
    """(crate-relative module path, line, the path as written) of every `crate::…` and `super::…`
    path of a file's text (comments and test modules already blanked)."""
    line_of = lambda offset: text.count("\n", 0, offset) + 1
    found = []
    # `crate::a::b` paths, and the items of `use crate::{a, b::c}` groups.
    for match in re.finditer(r"(?<![\w:])crate::((?:\w+::)*\w+)", text):
        found.append((match.group(1), line_of(match.start()), match.group(0)))
    for match in re.finditer(r"(?<![\w:])crate::((?:\w+::)*)\{([^}]*)\}", text):
        for item in re.split(r",\s*", match.group(2)):
            if item.strip():
                written = "crate::%s%s" % (match.group(1), item.strip())
                found.append((match.group(1) + item.strip(), line_of(match.start()), written))
    # `super::x` from `a::b` (or from the module `a::b` of `a/b/mod.rs`) is `a::x`.
    parent = module.rsplit("::", 1)[0] if "::" in module else ""
    if path.endswith("mod.rs"):
        parent = module
    for match in re.finditer(r"(?<![\w:])super::((?:\w+::)*\w+)", text):
        target = match.group(1)
        found.append((f"{parent}::{target}" if parent else target, line_of(match.start()), match.group(0)))
    return found


def main():
    roots = [arg for arg in sys.argv[1:] if arg != "-v"] or DEFAULT_ROOTS
    return 1 if any([check(root) for root in roots]) else 0


def check(src):
    """Prints the cycles among the modules under src, and the imports that break its layers;
    returns whether there is either."""
    files = {}
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(root, name)
                files[module_of(path, src)] = path
    modules = set(files)
    graph = {module: set() for module in modules}
    # (from, to) -> [(file, line, path as written)]: where each edge comes from.
    sources = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as handle:
            text = non_test_text(handle.read())
        # Comments name paths (doc links) without importing them.
        text = re.sub(r"//[^\n]*", "", text)
        for target, line, written in named_paths(module, path, text):
            segments = target.split("::")
            for length in range(len(segments), 0, -1):
                candidate = "::".join(segments[:length])
                if candidate in modules:
                    if candidate != module and not module.startswith(candidate + "::"):
                        graph[module].add(candidate)
                        sources.setdefault((module, candidate), []).append((path, line, written))
                    break
    if "-v" in sys.argv:
        print(f"# {src}")
        for module in sorted(graph):
            print(f"{module} -> {', '.join(sorted(graph[module])) or '-'}")
    # Depth-first search for a back edge; report each cycle once.
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    for cycle in cycles:
        print(f"module cycle in {src}: " + " -> ".join(cycle))
    return bool(cycles) | check_layers(src, graph, sources)


def check_layers(src, graph, sources):
    """Prints each import of src that a rule of LAYERS forbids (and ALLOWED does not name), with
    where it is; returns whether there is one."""
    rules = LAYERS.get(os.path.normpath(src), [])
    top = lambda module: module.split("::")[0]
    broken = False
    for module in sorted(graph):
        for target in sorted(graph[module]):
            reasons = [why for importers, forbidden, why in rules
                       if top(module) in importers and top(target) in forbidden]
            if not reasons or (os.path.normpath(src), top(module), top(target)) in ALLOWED:
                continue
            broken = True
            for path, line, written in sources[(module, target)]:
                print(f"layer broken in {src}: {path}:{line}: `{written}`: {module} imports "
                      f"{target}, but {top(module)} must not import {top(target)} ({reasons[0]})")
    return broken


if __name__ == "__main__":
    sys.exit(main())
