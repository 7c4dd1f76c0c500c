#!/usr/bin/env python3
"""The include rules of src/: every layer folder has a README.md whose "May include:" line
names the folders its files may include from, and only src/format/ sees the generated
FlatBuffers header, directly or through a header of its own.

    tests/check_layers.py [SRC_DIR]       (exit 1 and one line per broken rule)
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
GENERATED = "ferry_generated.h"
SOURCES = (".cc", ".hpp", ".h", ".cu", ".cuh")
# Broken rules still being mended, each to be deleted with its fix (a listed rule that holds
# again is an error too, so this list only shrinks).
PENDING = set()


def layers(src):
    """{folder relative to src: set of folders it may include}, from the READMEs."""
    out = {}
    for dirpath, _, files in os.walk(src):
        if "README.md" not in files:
            continue
        rel = os.path.relpath(dirpath, src)
        if rel == ".":
            continue
        with open(os.path.join(dirpath, "README.md"), encoding="utf-8") as f:
            m = re.search(r"^May include:\s*(.*)$", f.read(), re.M)
        if not m:
            raise SystemExit("%s/README.md has no 'May include:' line" % rel)
        allowed = {w.strip() for w in m.group(1).split(",")}
        out[rel] = {w for w in allowed if w and not w.startswith("(")}
    return out


def layer_of(rel, known):
    """The longest known folder that holds `rel` (a path relative to src)."""
    best = None
    for layer in known:
        if rel.startswith(layer + "/") and (best is None or len(layer) > len(best)):
            best = layer
    return best


def main():
    src = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                          os.path.join(os.path.dirname(__file__), "..", "src"))
    known = layers(src)
    includes = {}
    for dirpath, _, files in os.walk(src):
        for name in files:
            if name.endswith(SOURCES):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    includes[os.path.relpath(path, src)] = INCLUDE.findall(f.read())

    def resolve(rel, inc):
        """The file under src an include names, or None (public and system headers)."""
        here = os.path.normpath(os.path.join(os.path.dirname(rel), inc))
        if here in includes:
            return here
        return inc if inc in includes else None

    # Which files see the generated header, directly or through other files of src/.
    sees = {}

    def sees_generated(rel, stack=()):
        if rel in sees:
            return sees[rel]
        if rel in stack:
            return False
        found = False
        for inc in includes[rel]:
            if inc == GENERATED:
                found = True
            else:
                target = resolve(rel, inc)
                if target and sees_generated(target, stack + (rel,)):
                    found = True
        sees[rel] = found
        return found

    errors = []
    for rel in sorted(includes):
        layer = layer_of(rel, known)
        if layer is None:
            errors.append("%s: not in a layer folder (one with a README.md)" % rel)
            continue
        for inc in includes[rel]:
            if inc == GENERATED:
                if layer != "format":
                    errors.append("%s: includes %s outside src/format/" % (rel, GENERATED))
                continue
            target = resolve(rel, inc)
            if target is None:
                continue
            other = layer_of(target, known)
            if other != layer and other not in known[layer]:
                errors.append("%s: includes %s (%s/ may include only: %s)" %
                              (rel, inc, layer, ", ".join(sorted(known[layer])) or "nothing"))
            elif layer != "format" and sees_generated(target):
                errors.append("%s: includes %s, which brings in %s" % (rel, inc, GENERATED))
    for p in sorted(PENDING - set(errors)):
        errors.append("no longer broken, delete from PENDING: %s" % p)
    errors = [e for e in errors if e not in PENDING]
    for e in errors:
        print(e)
    print("check_layers: %d files, %d layers, %d broken rules" %
          (len(includes), len(known), len(errors)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
