#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a cycle.

The graph comes from the paths `crate::a::b` and `super::b` named in a crate's source folder (in
`use` statements and inline, not in comments), outside `#[cfg(test)]` modules: an edge from each
file's module to the deepest module of the path that is a file of that crate. Paths to modules the
crate imports from elsewhere (the extension's `crate::batch` is the core crate's) are not edges.
Run from the repository root with the source folders to check (default: the extension's src and
the core crate's crates/core/src); prints each graph with -v.
"""
import os
import re
import sys

DEFAULT_ROOTS = ["src", "crates/core/src"]


def module_of(path, src):
    """src/worker/task.rs -> worker::task; src/decode/mod.rs -> decode; src/lib.rs -> crate."""
    parts = os.path.relpath(path, src)[: -len(".rs")].split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return "::".join(parts) if parts != ["lib"] else "crate"


def non_test_text(text):
    """The file without its `#[cfg(test)] mod … { … }` blocks (brace-matched)."""
    out, position = [], 0
    for match in re.finditer(r"#\[cfg\(test\)\]\s*(pub\s+)?mod\s+\w+\s*\{", text):
        if match.start() < position:
            continue
        out.append(text[position : match.start()])
        depth, index = 1, match.end()
        while depth and index < len(text):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            index += 1
        position = index
    out.append(text[position:])
    return "".join(out)


def main():
    roots = [arg for arg in sys.argv[1:] if arg != "-v"] or DEFAULT_ROOTS
    return 1 if any([check(root) for root in roots]) else 0


def check(src):
    """Prints the cycles among the modules under src; returns whether there is one."""
    files = {}
    for root, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(root, name)
                files[module_of(path, src)] = path
    modules = set(files)
    graph = {module: set() for module in modules}
    for module, path in files.items():
        with open(path, encoding="utf-8") as handle:
            text = non_test_text(handle.read())
        # Comments name paths (doc links) without importing them.
        text = re.sub(r"//[^\n]*", "", text)
        # `use crate::{a, b::c}` groups as well as `crate::a::b` paths.
        paths = re.findall(r"crate::((?:\w+::)*\w+)", text)
        for group_prefix, group in re.findall(r"crate::((?:\w+::)*)\{([^}]*)\}", text):
            paths += [group_prefix + item.strip() for item in re.split(r",\s*", group) if item.strip()]
        # `super::x` from `a::b` (or from the module `a::b` of `a/b/mod.rs`) is `a::x`.
        parent = module.rsplit("::", 1)[0] if "::" in module else ""
        if path.endswith("mod.rs"):
            parent = module
        for target in re.findall(r"(?<![\w:])super::((?:\w+::)*\w+)", text):
            paths.append(f"{parent}::{target}" if parent else target)
        for target in paths:
            segments = target.split("::")
            for length in range(len(segments), 0, -1):
                candidate = "::".join(segments[:length])
                if candidate in modules:
                    if candidate != module and not module.startswith(candidate + "::"):
                        graph[module].add(candidate)
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
    return bool(cycles)


if __name__ == "__main__":
    sys.exit(main())
