#!/usr/bin/env python3
"""The source tree's rooms and which uses which, read from the code.

  layout.py --write README.md   rewrites README's picture (between the layout markers): a
                                Mermaid graph of the folders, an arrow A --> B where a file in A
                                includes a header of B, labelled with how many such includes
  layout.py --check README.md   exits 1 when that picture is not what the code says (make test)
                                or when the folders' includes form a cycle (A includes B's
                                headers and B, directly or not, A's; a subfolder using its
                                parent's contract header, as cache/store/ does cache/cache.h,
                                is no edge of a cycle: the parent holds what its rooms implement)
  layout.py --calls OBJDIR      exits 1 when two files of server/ call each other, or when the
                                folders' calls form a cycle: from the objects' symbol tables (nm),
                                a file in A calling a function defined in B (OBJDIR: build/obj)
  layout.py --functions         exits 1 when a C function (.c, .cu, .cc, .inc) is 100 lines or
                                longer, from its first signature line to its closing brace

`make layout` runs --write; `make test-unit` runs --check, --calls and --functions.
"""
import argparse
import collections
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- layout:begin (scripts/layout.py) -->", "<!-- layout:end -->"
SOURCES = (".c", ".h", ".cu", ".cuh", ".cc")
# the folders drawn, from the bottom of the stack up; a file belongs to the deepest one listed
ROOMS = ["util", "config", "kernels", "kernels/cpu", "kernels/cuda", "model/tokenizer",
         "model/grammar", "model/chat", "model", "cache/codec", "cache/store", "cache/blend",
         "cache/schema", "cache", "server/metrics", "server", "server/engine", "server/http",
         "server/api", "server/cli"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def room_of(path):
    best = None
    for r in ROOMS:
        if path == r or path.startswith(r + "/"):
            if best is None or len(r) > len(best):
                best = r
    return best


def source_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [p for p in out if p.endswith(SOURCES) and room_of(p)]


def edges():
    count = collections.Counter()
    for p in source_files():
        with open(os.path.join(ROOT, p), encoding="utf-8", errors="replace") as f:
            text = f.read()
        a = room_of(p)
        for inc in INCLUDE.findall(text):
            b = room_of(inc)
            if b and b != a:
                count[(a, b)] += 1
    return count


def picture():
    count = edges()
    used = sorted({r for e in count for r in e}, key=ROOMS.index)
    ident = {r: r.replace("/", "_") for r in used}
    lines = ["```mermaid", "graph TD"]
    for r in used:
        lines.append(f'    {ident[r]}["{r}/"]')
    for (a, b), n in sorted(count.items(), key=lambda e: (ROOMS.index(e[0][0]),
                                                           ROOMS.index(e[0][1]))):
        lines.append(f"    {ident[a]} -->|{n}| {ident[b]}")
    lines.append("```")
    return "\n".join(lines)


def block(readme):
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        sys.exit(f"{readme}: no layout markers ({BEGIN} ... {END})")
    return text, i + len(BEGIN), j


def write(readme):
    text, i, j = block(readme)
    new = text[:i] + "\n" + picture() + "\n" + text[j:]
    if new != text:
        with open(readme, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"{readme}: layout picture updated")


def cycles(graph):
    """The strongly connected components of more than one node (Tarjan's algorithm): each is
    a set of folders that reach each other."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
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
                out.append(sorted(comp, key=ROOMS.index))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def report_cycles(kind, graph):
    """Prints and counts the cycles of the graph {folder: folders it uses}, without the edges
    from a subfolder up to the folder holding it (its contract)."""
    graph = {a: {b for b in bs if not a.startswith(b + "/")} for a, bs in graph.items()}
    found = cycles(graph)
    for comp in found:
        print(f"{kind} cycle between folders: {' <-> '.join(c + '/' for c in comp)}",
              file=sys.stderr)
    return 1 if found else 0


def check(readme):
    text, i, j = block(readme)
    rc = 0
    if text[i:j].strip() != picture().strip():
        print(f"{readme}: the layout picture is stale; run `make layout`", file=sys.stderr)
        rc = 1
    graph = collections.defaultdict(set)
    for a, b in edges():
        graph[a].add(b)
    return rc | report_cycles("include", graph)


def symbols(obj):
    """(defined, undefined) global function and data names of an object file."""
    out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBR":
            defined.add(parts[2])
    return defined, undefined


def objects(objdir):
    """{source path: (defined, undefined)} of the library's objects under OBJDIR whose source
    still exists (not a stale one), C and CUDA."""
    objs = {}
    for d, _, files in os.walk(objdir):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), objdir)
            for ext, srcext in ((".cuda.o", ".cu"), (".o", ".c")):
                if rel.endswith(ext) and not rel.endswith(".emu.o"):
                    src = rel[:-len(ext)] + srcext
                    if room_of(src) and os.path.exists(os.path.join(ROOT, src)):
                        objs[src] = symbols(os.path.join(d, f))
                    break
    return objs


def calls(objdir):
    every = objects(objdir)
    objs = {p: v for p, v in every.items() if p.startswith("server/")}
    if not objs:
        sys.exit(f"{objdir}/server: no objects (build first)")
    owner = {}
    for p, (defined, _) in every.items():
        for name in defined:
            owner[name] = room_of(p)
    graph = collections.defaultdict(set)
    for p, (_, undefined) in every.items():
        for name in undefined:
            if name in owner and owner[name] != room_of(p):
                graph[room_of(p)].add(owner[name])
    bad = []
    names = sorted(objs)
    for x in range(len(names)):
        for y in range(x + 1, len(names)):
            a, b = names[x], names[y]
            ab = objs[a][1] & objs[b][0]
            ba = objs[b][1] & objs[a][0]
            if ab and ba:
                bad.append(f"{a} calls {b} ({', '.join(sorted(ab)[:3])}) and {b} calls {a} "
                           f"({', '.join(sorted(ba)[:3])})")
    for line in bad:
        print("mutual calls: " + line, file=sys.stderr)
    print(f"server/: {len(objs)} files, {len(bad)} pairs calling each other")
    return (1 if bad else 0) | report_cycles("call", graph)


FUNC_LIMIT = 100
FUNC_SOURCES = (".c", ".cu", ".cc", ".inc")
NAME = re.compile(r"([A-Za-z_]\w*)\s*\($")


def functions_of(path):
    """(name, first line, lines) of each function defined in a clang-formatted C source: a
    definition starts at a line in column 0 whose signature ends with '{', and ends at the next
    '}' in column 0."""
    with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    out, i, n = [], 0, len(lines)
    while i < n:
        line = lines[i]
        if not line or line[0].isspace() or line[0] in "}#/*" or \
                line.startswith(("typedef", "struct", "enum", "union")):
            i += 1
            continue
        j = i
        while j < n and not lines[j].rstrip().endswith(("{", ";")) and j - i < 16:
            j += 1
        if j >= n:
            break
        head = " ".join(s.strip() for s in lines[i:j + 1]).split("(")[0]
        if lines[j].rstrip().endswith("{") and "(" in lines[i] + lines[j] and "=" not in head:
            k = j + 1
            while k < n and not lines[k].startswith("}"):
                k += 1
            m = NAME.search(head + "(")
            if m:
                out.append((m.group(1), i + 1, k - i + 1))
            i = k + 1
        else:
            i = j + 1
    return out


def functions():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    long = []
    for p in out:
        if p.endswith(FUNC_SOURCES):
            long += [(n, p, line, name) for name, line, n in functions_of(p) if n >= FUNC_LIMIT]
    for n, p, line, name in sorted(long, reverse=True):
        print(f"{p}:{line}: {name} is {n} lines (the limit is {FUNC_LIMIT - 1})", file=sys.stderr)
    print(f"functions: {len(long)} of {FUNC_LIMIT} lines or more")
    return 1 if long else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", metavar="README")
    ap.add_argument("--check", metavar="README")
    ap.add_argument("--calls", metavar="OBJDIR")
    ap.add_argument("--functions", action="store_true")
    a = ap.parse_args()
    rc = 0
    if a.write:
        write(a.write)
    if a.check:
        rc |= check(a.check)
    if a.calls:
        rc |= calls(a.calls)
    if a.functions:
        rc |= functions()
    if not (a.write or a.check or a.calls or a.functions):
        print(picture())
    return rc


if __name__ == "__main__":
    sys.exit(main())
