#!/usr/bin/env python3
"""docs/ARCHITECTURE.md against src/: every src/**/*.cc and *.cu is named there by its path
under src/ (and every such path it names exists), its include table says what each folder's
README.md allows, and no source file of src/ is over MAX_LINES lines.

    tests/check_architecture.py [ROOT]       (exit 1 and one line per broken rule)
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_layers import layers as readme_rules  # noqa: E402  (one reader of the READMEs)

MAX_LINES = 900
NAMED = (".cc", ".cu")
SOURCES = (".cc", ".cu", ".hpp", ".h", ".cuh")
# A path under src/ as the document writes it: `load/loader.cc`, `import/torch/zip.cc`.
PATH = re.compile(r"(?<![\w/.-])((?:[a-z_]+/)+[a-z_0-9]+\.(?:cc|cu))(?![\w])")
# A row of the include table: | `folder/` | list |, several folders allowed in the first cell.
ROW = re.compile(r"^\|((?:\s*`[a-z_/]+/`,?)+)\s*\|([^|]*)\|\s*$", re.M)


def doc_rules(doc):
    """{folder: set of folders} from the document's include table."""
    out = {}
    for cells, allowed in ROW.findall(doc):
        folders = re.findall(r"`([a-z_/]+)/`", cells)
        # "nothing", and remarks in parentheses, name no folder.
        allowed = re.sub(r"\([^)]*\)", "", allowed)
        names = {w.strip() for w in allowed.split(",")} - {"", "nothing"}
        for folder in folders:
            out[folder] = names
    return out


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                           os.path.join(os.path.dirname(__file__), ".."))
    src = os.path.join(root, "src")
    with open(os.path.join(root, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        doc = f.read()
    named = set(PATH.findall(doc))

    errors = []
    files = []
    for dirpath, _, names in os.walk(src):
        for name in names:
            if name.endswith(SOURCES):
                files.append(os.path.relpath(os.path.join(dirpath, name), src))
    for rel in sorted(files):
        with open(os.path.join(src, rel), encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > MAX_LINES:
            errors.append("src/%s: %d lines (at most %d: split it along its seams)" %
                          (rel, lines, MAX_LINES))
        if rel.endswith(NAMED) and rel not in named:
            errors.append("src/%s: not named in docs/ARCHITECTURE.md" % rel)
    # Paths of other trees (tests/, benchmarks/) are not src/'s to check.
    top = {d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d))}
    for rel in sorted(n for n in named - set(files) if n.split("/")[0] in top):
        errors.append("docs/ARCHITECTURE.md names %s, which is not in src/" % rel)

    readme, table = readme_rules(src), doc_rules(doc)
    for folder in sorted(set(readme) | set(table)):
        if folder not in table:
            errors.append("docs/ARCHITECTURE.md: no include-table row for %s/" % folder)
        elif folder not in readme:
            errors.append("docs/ARCHITECTURE.md: include-table row for %s/, which has no "
                          "README.md" % folder)
        elif table[folder] != readme[folder]:
            errors.append("docs/ARCHITECTURE.md: %s/ may include %s by the table, %s by its "
                          "README.md" % (folder, ", ".join(sorted(table[folder])) or "nothing",
                                         ", ".join(sorted(readme[folder])) or "nothing"))
    for e in errors:
        print(e)
    print("check_architecture: %d source files, %d named in docs/ARCHITECTURE.md, "
          "%d broken rules" % (len(files), len(named), len(errors)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
