#!/usr/bin/env python3
"""The source tree's rooms and which uses which, read from the code.

  layout.py --write README.md   rewrites README's picture (between the layout markers): a
                                Mermaid graph of the folders, an arrow A --> B where a file in A
                                includes a header of B, labelled with how many such includes
  layout.py --check README.md   exits 1 when that picture is not what the code says (make test)
  layout.py --calls OBJDIR      exits 1 when two files of server/ call each other: from the
                                objects' symbol tables (nm), file A calling a function defined in
                                file B and B one defined in A (OBJDIR: build/obj)

`make layout` runs --write; `make test-unit` runs --check and --calls.
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
ROOMS = ["util", "config", "kernels", "kernels/cpu", "kernels/cuda", "model", "cache/codec",
         "cache/store", "cache/blend", "cache/schema", "cache", "server",
         "server/engine", "server/http", "server/api", "server/cli"]
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


def check(readme):
    text, i, j = block(readme)
    if text[i:j].strip() != picture().strip():
        print(f"{readme}: the layout picture is stale; run `make layout`", file=sys.stderr)
        return 1
    return 0


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


def calls(objdir):
    objs = {}
    base = os.path.join(objdir, "server")
    for d, _, files in os.walk(base):
        for f in files:
            src = os.path.relpath(os.path.join(d, f), objdir)[:-2] + ".c"
            if f.endswith(".o") and os.path.exists(os.path.join(ROOT, src)):  # not a stale one
                objs[src] = symbols(os.path.join(d, f))
    if not objs:
        sys.exit(f"{base}: no objects (build first)")
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
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", metavar="README")
    ap.add_argument("--check", metavar="README")
    ap.add_argument("--calls", metavar="OBJDIR")
    a = ap.parse_args()
    rc = 0
    if a.write:
        write(a.write)
    if a.check:
        rc |= check(a.check)
    if a.calls:
        rc |= calls(a.calls)
    if not (a.write or a.check or a.calls):
        print(picture())
    return rc


if __name__ == "__main__":
    sys.exit(main())
