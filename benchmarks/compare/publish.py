#!/usr/bin/env python3
"""Copies a comparison run into benchmarks/results/ and prints its Markdown table.

    python3 benchmarks/compare/publish.py RUN_DIR [--dest benchmarks/results] [--name compare]

RUN_DIR is run_compare.py's --out directory. Copies results.csv, runs.csv, meta.json and
compare.png as <name>.csv, <name>-runs.csv, <name>.json and <name>.png, then prints the table
(and TensorFerry's ratio to the best peer and to the ceiling, per mode) for the README.
"""

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import report  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--dest", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--name", default="compare")
    args = ap.parse_args(argv)
    src = {"results.csv": args.name + ".csv", "runs.csv": args.name + "-runs.csv",
           "meta.json": args.name + ".json", "compare.png": args.name + ".png"}
    missing = [f for f in src if not os.path.exists(os.path.join(args.run_dir, f))]
    if "results.csv" in missing or "meta.json" in missing:
        raise SystemExit("publish: %s has no results.csv / meta.json" % args.run_dir)
    os.makedirs(args.dest, exist_ok=True)
    for f, dst in src.items():
        if f in missing:
            print("publish: no %s in %s" % (f, args.run_dir), file=sys.stderr)
            continue
        shutil.copyfile(os.path.join(args.run_dir, f), os.path.join(args.dest, dst))
    with open(os.path.join(args.run_dir, "meta.json")) as f:
        meta = json.load(f)
    summary = report.read_csv(os.path.join(args.run_dir, "results.csv"))
    rel = os.path.relpath(args.dest, ROOT)
    print("![load throughput](%s/%s.png)\n" % (rel, args.name))
    print(report.markdown_table(summary, meta))
    print("\nData: [%s/%s.csv](%s/%s.csv) (every run: %s-runs.csv; machine and versions: "
          "%s.json)." % (rel, args.name, rel, args.name, args.name, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
