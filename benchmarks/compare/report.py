"""Results of the comparison: CSV files, meta.json, the plot and the Markdown table.

Used by run_compare.py (writing) and publish.py (reading a results directory back).
"""

import csv
import json
import os

COLUMNS = ["mode", "loader", "format", "rep", "status", "gbps", "seconds", "ttft_s", "ttft_kind",
           "tensor_bytes", "file_bytes", "cache_resident_pct", "peak_rss_mib", "rss_ready_mib",
           "pinned_configured_mib", "pinned_map_peak_mib", "vmpin_peak_mib", "vmlck_peak_mib",
           "target_gpu", "gpu_mem_mib", "other_gpu_mib", "other_gpu_contexts",
           "max_reserved_mib", "verified", "wall_s", "note"]
SUMMARY_COLUMNS = COLUMNS[:4] + ["reps_ok", "ceiling_gbps", "ratio_to_ceiling"] + COLUMNS[4:]
PINNED, FILE_READ = "ceiling:pinned-h2d", "ceiling:file-read"


def is_ferry(name):
    return name.startswith("tensorferry") or name.startswith("ferry-")


def is_ceiling(name):
    return name.startswith("ceiling:")


def ceiling_for(summary, mode):
    """The mode's hardware ceiling: hot, pinned host-to-device copy (DMA can read the page
    cache directly, so the copy engine is the limit); cold, the slower of the disk read and
    the pinned copy. Without a GPU, the file read of that mode."""
    ok = {r["loader"]: r["gbps"] for r in summary if r["mode"] == mode and r["status"] == "ok"}
    if mode == "hot":
        return ok.get(PINNED) or ok.get(FILE_READ)
    vals = [v for v in (ok.get(PINNED), ok.get(FILE_READ)) if v]
    return min(vals) if vals else None


def summarize_runs(runs):
    """Best repetition (highest GB/s) per (mode, loader), in run order."""
    order, groups = [], {}
    # `ferry bench` warms the page cache before it times anything, so a "cold" row of it is a
    # hot measurement; earlier harness versions recorded one.
    runs = [r for r in runs if not (r["mode"] == "cold" and r["loader"].startswith("ferry-bench-cli"))]
    for r in runs:
        key = (r["mode"], r["loader"])
        if key not in groups:
            order.append(key)
            groups[key] = []
        groups[key].append(r)
    out = []
    for key in order:
        rows = groups[key]
        ok = [r for r in rows if r["status"] == "ok"]
        best = dict(max(ok, key=lambda r: r["gbps"]) if ok else rows[0])
        best["reps_ok"] = len(ok)
        if ok:
            best["peak_rss_mib"] = max(r.get("peak_rss_mib") or 0 for r in ok)
            ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
            if ttfts:
                best["ttft_s"] = min(ttfts)
        out.append(best)
    for mode in ("hot", "cold"):
        c = ceiling_for(out, mode)
        for r in out:
            if r["mode"] == mode and c:
                r["ceiling_gbps"] = c
                if r["status"] == "ok":
                    r["ratio_to_ceiling"] = r["gbps"] / c
    return out


def _fmt(v):
    if isinstance(v, float):
        return "%.4g" % v if abs(v) < 1e5 else "%d" % v
    if v is None:
        return ""
    return str(v)


def header_lines(meta):
    m = meta["machine"]
    v = meta.get("versions", {})
    lines = [
        "TensorFerry side-by-side load benchmark (benchmarks/compare)",
        "date: %s" % meta["date"],
        "machine: %s; GPUs: %s; driver %s; %s CPUs (%s); %s GiB RAM; kernel %s" % (
            m.get("hostname"), " | ".join(m.get("gpus", [])) or "none", m.get("driver", "-"),
            m.get("cpus"), m.get("cpu_model", "?"), m.get("mem_total_gib", "?"),
            m.get("kernel")),
        "data: %s (%s)" % (m.get("data_dir"), m.get("data_fs")),
        "versions: tensorferry %s; %s" % (
            meta.get("tensorferry"), "; ".join("%s %s" % kv for kv in sorted(v.items()))),
        "config: %s" % json.dumps(meta.get("config", {}), sort_keys=True),
        "GB/s are decimal (1e9 bytes/s) over the checkpoint's uncompressed tensor bytes",
    ]
    return lines


def write_csv(path, rows, columns, meta):
    with open(path, "w", newline="") as f:
        for line in header_lines(meta):
            f.write("# " + line + "\n")
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_fmt(r.get(c)) for c in columns])


def read_csv(path):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if not l.startswith("#")]
    for r in csv.DictReader(lines):
        for k, v in list(r.items()):
            if v == "":
                r[k] = None
                continue
            try:
                r[k] = float(v) if k not in ("rep", "reps_ok", "target_gpu") else int(float(v))
            except ValueError:
                pass
        rows.append(r)
    return rows


def write_all(out, runs, summary, meta):
    write_csv(os.path.join(out, "runs.csv"), runs, COLUMNS, meta)
    write_csv(os.path.join(out, "results.csv"), summary, SUMMARY_COLUMNS, meta)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    try:
        plot(os.path.join(out, "compare.png"), summary, meta)
    except ImportError as e:
        meta.setdefault("warnings", []).append("no plot: %s" % e)
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)


def plot(path, summary, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("hot", "cold") if any(r["mode"] == m for r in summary)]
    if not modes:
        return
    names = []
    for r in summary:
        if not is_ceiling(r["loader"]) and r["loader"] not in names:
            names.append(r["loader"])
    fig, axes = plt.subplots(1, len(modes), figsize=(7.5 * len(modes), 0.42 * len(names) + 2.2),
                             squeeze=False, sharey=True)
    by = {(r["mode"], r["loader"]): r for r in summary}
    for ax, mode in zip(axes[0], modes):
        ys = list(range(len(names)))[::-1]
        vmax = 1.0
        for y, name in zip(ys, names):
            r = by.get((mode, name))
            if r is None:
                ax.text(0.02, y, "hot only" if mode == "cold" else "-", va="center",
                        fontsize=8, color="0.5", transform=ax.get_yaxis_transform())
                continue
            if r["status"] != "ok":
                ax.text(0.02, y, r["status"], va="center", fontsize=8, color="0.4",
                        transform=ax.get_yaxis_transform())
                continue
            color = "#1f77b4" if is_ferry(name) else "#ff7f0e"
            ax.barh(y, r["gbps"], color=color, height=0.7)
            ax.text(r["gbps"], y, " %.1f" % r["gbps"], va="center", fontsize=8)
            vmax = max(vmax, r["gbps"])
        for cname, style, label in ((PINNED, ("#d62728", "--"), "pinned H2D"),
                                    (FILE_READ, ("#2ca02c", ":"), "file read")):
            c = by.get((mode, cname))
            if c and c["status"] == "ok":
                ax.axvline(c["gbps"], color=style[0], linestyle=style[1], linewidth=1.5,
                           label="%s %.1f GB/s" % (label, c["gbps"]))
                vmax = max(vmax, c["gbps"])
        ax.set_xlim(0, vmax * 1.18)
        ax.set_yticks(ys)
        ax.set_yticklabels(names, fontsize=9)
        ax.set_xlabel("GB/s (decimal, uncompressed tensor bytes)")
        ax.set_title({"hot": "hot: file in the page cache",
                      "cold": "cold: page cache dropped"}[mode], fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    m = meta["machine"]
    cfg = meta.get("config", {})
    size = max((f.get("tensor_bytes", 0) for f in meta.get("files", {}).values()), default=0)
    fig.suptitle("Checkpoint load to %s: %.2f GB (bf16 + FP8, llama-like), %s CPUs, %s" % (
        m.get("gpu_name") or "host memory", size / 1e9, m.get("cpus"), meta["date"][:10]),
        fontsize=11)
    fig.text(0.01, 0.005, "torch %s, safetensors %s; target GPU %s; each run a fresh process" % (
        meta.get("versions", {}).get("torch", "-"), meta.get("versions", {}).get("safetensors",
                                                                                "-"),
        cfg.get("target_device")), fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _num(v, fmt="%.2f"):
    return fmt % v if isinstance(v, (int, float)) else "-"


def markdown_table(summary, meta):
    by = {(r["mode"], r["loader"]): r for r in summary}
    names = []
    for r in summary:
        if r["loader"] not in names:
            names.append(r["loader"])
    m = meta["machine"]
    lines = ["Measured %s on %s, %s CPUs; %s. GB/s are decimal over the uncompressed "
             "tensor bytes; hot: file in the page cache, cold: page cache dropped first." % (
                 meta["date"][:10], m.get("gpu_name") or "no GPU", m.get("cpus"),
                 ", ".join("%s %s" % kv for kv in sorted(meta.get("versions", {}).items())
                           if kv[0] in ("torch", "safetensors", "fastsafetensors",
                                        "instanttensor", "runai-model-streamer"))),
             "",
             "| loader | format | hot GB/s | cold GB/s | hot / ceiling | cold / ceiling | "
             "first tensor, hot (s) | peak RSS (MiB) | pinned MiB (configured / seen) | "
             "other GPUs | "
             "verified |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for name in names:
        h, c = by.get(("hot", name)), by.get(("cold", name))
        any_r = h or c

        def rate(r):
            if r is None:
                return "-"
            return _num(r.get("gbps")) if r["status"] == "ok" else r["status"]

        def ratio(r):
            return _num(r.get("ratio_to_ceiling")) if r else "-"

        ttft = "-"
        if h and h["status"] == "ok" and h.get("ttft_s") is not None:
            ttft = "%.3f%s" % (h["ttft_s"], "" if h.get("ttft_kind") == "first" else " (all)")
        rss = max((r.get("peak_rss_mib") or 0) for r in (h, c) if r) if any_r else 0
        pinned = max((r.get("pinned_map_peak_mib") or 0) for r in (h, c) if r) if any_r else 0
        cfg = max((r.get("pinned_configured_mib") or 0) for r in (h, c) if r) if any_r else 0
        other = "-"
        for r in (h, c):
            if r and r.get("other_gpu_contexts") not in (None, "", "none"):
                other = "%s (%.0f MiB)" % (r["other_gpu_contexts"], r.get("other_gpu_mib") or 0)
            elif r and r.get("other_gpu_contexts") == "none" and other == "-":
                other = "none"
        ver = "/".join(sorted({str(r.get("verified")) for r in (h, c)
                               if r and r.get("verified")})) or "-"
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            name, any_r.get("format", ""), rate(h), rate(c), ratio(h), ratio(c), ttft,
            "%.0f" % rss if rss else "-",
            "%s / %s" % ("%.0f" % cfg if cfg else "-", "%.0f" % pinned if pinned else "-"),
            other, ver))
    lines += ["", "TensorFerry against the best peer and the ceiling:", "",
              "| mode | TensorFerry row | GB/s | best peer | peer GB/s | ratio to best peer | "
              "ratio to ceiling |", "|---|---|---:|---|---:|---:|---:|"]
    for mode in ("hot", "cold"):
        rows = [r for r in summary if r["mode"] == mode and r["status"] == "ok"]
        peers = [r for r in rows if not is_ferry(r["loader"]) and not is_ceiling(r["loader"])]
        best = max(peers, key=lambda r: r["gbps"]) if peers else None
        for r in rows:
            if not is_ferry(r["loader"]):
                continue
            lines.append("| %s | %s | %.2f | %s | %s | %s | %s |" % (
                mode, r["loader"], r["gbps"], best["loader"] if best else "-",
                _num(best["gbps"]) if best else "-",
                "%.2f" % (r["gbps"] / best["gbps"]) if best else "-",
                _num(r.get("ratio_to_ceiling"))))
    return "\n".join(lines)
