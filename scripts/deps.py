#!/usr/bin/env python3
"""The dependency picture of the `lanes` crate's modules, checked.

Reads every `crate::<name>` path outside comments in crates/lanes/src, resolves names re-exported
at the crate root to the module that defines them, and fails (exit 1) if a ground-floor module
(config, lifecycle, observe, util) uses a primitive, if the primitive modules' arrows form a cycle,
or if a primitive's folder lacks one of the skeleton's files (design.md: mod.rs, core.rs,
handle.rs, config.rs, error.rs, snapshot.rs). Prints the picture either way.
"""
import os
import re
import sys

SRC = os.path.join(os.path.dirname(__file__), "..", "crates", "lanes", "src")
GROUND = {"config", "lifecycle", "observe", "util"}
PRIMITIVES = {"channel", "lane", "limit", "pool", "spill"}
MODULES = GROUND | PRIMITIVES
SKELETON = ["mod.rs", "core.rs", "handle.rs", "config.rs", "error.rs", "snapshot.rs"]


def code_lines(path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if stripped.startswith("//"):
                continue
            yield line.split("//")[0] if "://" not in line else line


def root_exports():
    """Names re-exported at the root (`pub use lane::{Run, ...}`) -> their module."""
    text = open(os.path.join(SRC, "lib.rs"), encoding="utf-8").read()
    exports = {}
    for module, names in re.findall(r"pub use (\w+)::\{([^}]*)\}", text):
        for name in re.findall(r"\w+", names):
            exports[name] = module
    for module, name in re.findall(r"pub use (\w+)::(\w+);", text):
        exports[name] = module
    return exports


def files_of(module):
    folder = os.path.join(SRC, module)
    if os.path.isdir(folder):
        for root, _, files in os.walk(folder):
            for name in files:
                if name.endswith(".rs"):
                    yield os.path.join(root, name)
    single = os.path.join(SRC, module + ".rs")
    if os.path.exists(single):
        yield single


def arrows():
    exports = root_exports()
    graph = {}
    for module in sorted(MODULES):
        used = set()
        for path in files_of(module):
            for line in code_lines(path):
                for name in re.findall(r"\bcrate::(\w+)", line):
                    target = name if name in MODULES else exports.get(name)
                    if target and target != module:
                        used.add(target)
        graph[module] = used
    return graph


def cycle(graph, nodes):
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node] & nodes):
            if state.get(nxt) == "open":
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(nodes):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def main():
    graph = arrows()
    for module in sorted(graph):
        floor = "ground floor" if module in GROUND else "primitive"
        print(f"{module:8} ({floor:12}) -> {', '.join(sorted(graph[module])) or '-'}")
    failures = []
    for module in sorted(GROUND):
        up = graph[module] & PRIMITIVES
        if up:
            failures.append(f"ground floor {module} uses {', '.join(sorted(up))}")
    for module in sorted(PRIMITIVES):
        folder = os.path.join(SRC, module)
        missing = [f for f in SKELETON if not os.path.exists(os.path.join(folder, f))]
        if missing:
            failures.append(f"primitive {module} lacks {', '.join(missing)}")
    found = cycle(graph, PRIMITIVES)
    if found:
        failures.append("cycle between primitives: " + " -> ".join(found))
    for failure in failures:
        print("error:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
