#!/usr/bin/env python3
"""Loads of checkpoints from object storage and HTTP, beside the ceiling of the same run.

    remote_bench.py --build BUILD [--mib 256] [--reps 2] [--device] [--limit-mbit 400]
                    [--servers s3,http] [--peers-path DIR] [--json OUT]

The test servers of tests/servers/servers.py are started on 127.0.0.1 (moto's S3 server,
nginx; where nginx is missing, the Python range server of that file serves HTTP instead and
the table says so). One llama-like bf16 state dict (N(0, 0.02) weights) is written three ways
(raw, shuffle+zstd, planes) with the library, plus a .safetensors copy for the peers, and
every object is put on both servers. Then, per server and file:

  ceiling   curl --parallel: range GETs of the whole object, as many at once and as large as
            the library's (8 x 8 MiB), into /dev/null (S3 requests signed with --aws-sigv4);
            the figure is stored bytes per second
  ferry     benchmarks/remote_load (Reader::Open + Loader, every tensor, to host memory, or to
            the GPU with --device), uncompressed tensor bytes per second
  peers     boto3 download (its transfer manager) then safetensors.numpy.load; Run:ai Model
            Streamer and tensorizer where they import (both need torch): tensor bytes/s

"of ceiling" is tensor bytes per second over the ceiling's stored bytes per second, so a
compressed file that crosses the link compressed can exceed 1.

The limited link: `tc` on the loopback device (root only): an htb qdisc whose default class is
far faster than the loopback, a class of --limit-mbit, and u32 filters that send only the
packets from the servers' ports to that class, so other traffic on the loopback keeps its speed. Removed on exit. Where tc is not
usable the limited rows are skipped and the table says why.
"""
import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "servers"))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))

PIECE = 8 << 20  # the remote source's range size (RemoteOptions::piece_bytes)
IN_FLIGHT = 8    # and its requests in flight (HttpOptions::max_in_flight)
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
ENCODINGS = [("raw", "raw"), ("shuffle+zstd", "shuffle+zstd"), ("planes", "planes")]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- the checkpoint ---------------------------------------------------------------------
def to_bf16(a):
    """float32 numpy -> bf16 (ml_dtypes where installed, else torch) and the saver for a
    .safetensors copy of such tensors."""
    try:
        import ml_dtypes
        from safetensors.numpy import save_file
        return a.astype(ml_dtypes.bfloat16), save_file
    except ImportError:
        import torch
        from safetensors.torch import save_file
        return torch.from_numpy(a).to(torch.bfloat16), save_file


def state_dict(mib):
    """Llama-like bf16 layers (attention and MLP matrices, norms) up to about `mib` MiB."""
    import numpy as np
    rng = np.random.default_rng(7)
    hidden, inter = 1024, 2816
    out, total, layer, saver = {}, 0, 0, None
    while total < mib << 20:
        for name, shape in (("q", (hidden, hidden)), ("k", (hidden, hidden)),
                            ("v", (hidden, hidden)), ("o", (hidden, hidden)),
                            ("gate", (inter, hidden)), ("up", (inter, hidden)),
                            ("down", (hidden, inter)), ("norm", (hidden,))):
            a, saver = to_bf16(rng.standard_normal(shape, dtype=np.float32) * 0.02)
            out["layers.%d.%s.weight" % (layer, name)] = a
            total += int(np.prod(shape)) * 2
        layer += 1
    return out, total, saver


def write_files(d, mib):
    import tensorferry
    tensors, total, st_save = state_dict(mib)
    names = {}
    for tag, enc in ENCODINGS:
        path = os.path.join(d, "bench-%s.ferry" % tag.replace("+", "-"))
        tensorferry.save_file(tensors, path, encoding=enc)
        names[tag] = os.path.basename(path)
    st = os.path.join(d, "bench.safetensors")
    st_save(tensors, st)
    names["safetensors"] = os.path.basename(st)
    return names, total


# ---- the limited link -------------------------------------------------------------------
class Link:
    """tc on lo: packets from `ports` through a token bucket; everything else as before."""

    def __init__(self, ports, mbit):
        self.ports, self.mbit, self.active, self.why = ports, mbit, False, None

    def _tc(self, *args):
        return subprocess.run(["tc"] + list(args), capture_output=True, text=True)

    def __enter__(self):
        if shutil.which("tc") is None:
            self.why = "tc is not installed"
            return self
        if os.geteuid() != 0:
            self.why = "tc needs root"
            return self
        root = self._tc("qdisc", "show", "dev", "lo").stdout
        if "htb" in root or "tbf" in root or "prio" in root:
            self.why = "the loopback already has a qdisc: %s" % root.strip()
            return self
        # Class 1:1 (the default) is far above what the loopback moves, so other traffic is
        # not slowed; the servers' answers go through 1:3.
        rate = "%dmbit" % self.mbit
        steps = [
            ["qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "1"],
            ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:1", "htb", "rate",
             "100gbit"],
            ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:3", "htb", "rate", rate,
             "ceil", rate, "burst", "1mb", "cburst", "1mb"],
        ] + [["filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
              "match", "ip", "sport", str(p), "0xffff", "flowid", "1:3"] for p in self.ports]
        for s in steps:
            r = self._tc(*s)
            if r.returncode != 0:
                self.why = "tc %s: %s" % (" ".join(s[:2]), r.stderr.strip())
                self._tc("qdisc", "del", "dev", "lo", "root")
                return self
        self.active = True
        return self

    def __exit__(self, *exc):
        if self.active:
            self._tc("qdisc", "del", "dev", "lo", "root")
            self.active = False


# ---- the measurements -------------------------------------------------------------------
def curl_ceiling(url, size, s3=None):
    """Seconds for parallel range GETs of the whole object into /dev/null."""
    auth = []
    if s3 is not None:
        auth = ["--aws-sigv4", "aws:amz:%s:s3" % s3["region"],
                "--user", "%s:%s" % (s3["access_key_id"], s3["secret_access_key"]),
                # S3 wants the payload hash as a header; curl before 8.x does not send it.
                "-H", "x-amz-content-sha256: " + EMPTY_SHA256]
    # Per-transfer options (the range above all) hold until --next; --parallel is global.
    cmd = ["curl", "--parallel", "--parallel-max", str(IN_FLIGHT), "--parallel-immediate"]
    for off in range(0, size, PIECE):
        if off:
            cmd.append("--next")
        cmd += ["-sS", "--fail", "-w", "%{size_download}\\n"] + auth + [
            "-r", "%d-%d" % (off, min(size, off + PIECE) - 1), "-o", "/dev/null", url]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:  # the command line carries the key: not printed
        raise RuntimeError("curl %s: %s" % (url, r.stderr.strip()[-2000:]))
    got = sum(int(x) for x in r.stdout.split())
    if got != size:
        raise RuntimeError("curl %s: %d bytes of %d" % (url, got, size))
    return seconds


def ferry_loads(build, url, reps, device, env):
    cmd = [os.path.join(build, "benchmarks", "remote_load"), "--reps=%d" % reps]
    if device:
        cmd.append("--device")
    r = subprocess.run(cmd + [url], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError("remote_load %s: %s" % (url, r.stderr.strip()))
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def boto3_safetensors(s3, key):
    """boto3's transfer manager into memory, then safetensors' parser (every tensor as a numpy
    array; safetensors.numpy.load itself refuses bf16)."""
    import boto3
    from boto3.s3.transfer import TransferConfig
    import numpy as np
    from safetensors import deserialize
    try:
        import ml_dtypes
        bf16 = ml_dtypes.bfloat16
    except ImportError:
        bf16 = np.uint16  # the same bytes, without the element type
    t0 = time.perf_counter()
    client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name=s3["region"],
                          aws_access_key_id=s3["access_key_id"],
                          aws_secret_access_key=s3["secret_access_key"])
    buf = io.BytesIO()
    client.download_fileobj(s3["bucket"], key, buf,
                            Config=TransferConfig(multipart_chunksize=PIECE,
                                                  max_concurrency=IN_FLIGHT))
    types = {"BF16": bf16, "F16": np.float16, "F32": np.float32}
    tensors = {name: np.frombuffer(t["data"], dtype=types[t["dtype"]]).reshape(t["shape"])
               for name, t in deserialize(buf.getvalue())}
    n = sum(t.nbytes for t in tensors.values())
    return time.perf_counter() - t0, n


def runai_streamer(url, s3, device):
    """Run:ai Model Streamer's SafetensorsStreamer over every tensor (needs torch)."""
    from runai_model_streamer import SafetensorsStreamer
    env = {}
    if s3 is not None:
        env = {"AWS_ENDPOINT_URL": s3["endpoint"], "AWS_ACCESS_KEY_ID": s3["access_key_id"],
               "AWS_SECRET_ACCESS_KEY": s3["secret_access_key"], "AWS_REGION": s3["region"],
               "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "AWS_EC2_METADATA_DISABLED": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        n = 0
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(url, device="cuda" if device else "cpu")
            for _, t in streamer.get_tensors():
                n += t.numel() * t.element_size()
        return time.perf_counter() - t0, n
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def best(xs):
    """The fastest repetition: on a shared machine the others measure the neighbours too.
    Ceiling and loaders are treated alike."""
    return min(xs) if xs else float("nan")


# ---- the run ----------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="the build folder (benchmarks/remote_load)")
    ap.add_argument("--mib", type=int, default=256, help="tensor MiB of the checkpoint")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", action="store_true", help="load onto the current GPU")
    ap.add_argument("--limit-mbit", type=int, default=400,
                    help="the limited link's rate (0: no limited rows)")
    ap.add_argument("--servers", default="s3,http")
    ap.add_argument("--peers-path", default=os.environ.get("FERRY_BENCH_PEERS", ""),
                    help="a folder of peer packages (pip install --target) put on sys.path")
    ap.add_argument("--json", help="write every row here as JSON")
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed)")
    a = ap.parse_args()
    if a.peers_path:
        sys.path.insert(0, os.path.abspath(a.peers_path))
    os.environ.setdefault("TENSORFERRY_LIBRARY", os.path.join(a.build, "src", "libferry.so"))
    import servers as srv

    work = a.dir or tempfile.mkdtemp(prefix="remote_bench.")
    rows, notes = [], []
    try:
        with srv.Servers(os.path.join(work, "servers")) as s:
            info = s.info
            for what, why in info.get("missing", {}).items():
                notes.append("%s missing: %s" % (what, why))
            bench_dir = os.path.join(info["root"], "bench")
            os.makedirs(bench_dir, exist_ok=True)
            log("writing %d MiB three ways" % a.mib)
            names, tensor_bytes = write_files(bench_dir, a.mib)
            sizes = {k: os.path.getsize(os.path.join(bench_dir, v)) for k, v in names.items()}
            targets = []  # (server, base URL, s3 settings or None, ports)
            wanted = a.servers.split(",")
            if "s3" in wanted and "s3" in info:
                s3 = dict(info["s3"])
                import boto3
                client = boto3.client("s3", endpoint_url=s3["endpoint"], region_name=s3["region"],
                                      aws_access_key_id=s3["access_key_id"],
                                      aws_secret_access_key=s3["secret_access_key"])
                for v in names.values():
                    client.upload_file(os.path.join(bench_dir, v), s3["bucket"], "bench/" + v)
                targets.append(("s3 (moto)", s3, int(s3["endpoint"].rsplit(":", 1)[1])))
            if "http" in wanted:
                if "http" in info:
                    targets.append(("http (nginx)", info["http"], int(info["http"].rsplit(":", 1)[1])))
                else:
                    notes.append("HTTP served by the Python range server of servers.py "
                                 "(nginx missing)")
                    base = info["fault"] + "/bench/ok/0"
                    targets.append(("http (python)", base, int(info["fault"].rsplit(":", 1)[1])))
            env = dict(os.environ)
            if "s3" in info:
                env.update(AWS_ENDPOINT_URL=info["s3"]["endpoint"],
                           AWS_ACCESS_KEY_ID=info["s3"]["access_key_id"],
                           AWS_SECRET_ACCESS_KEY=info["s3"]["secret_access_key"],
                           AWS_REGION=info["s3"]["region"], AWS_S3_ADDRESSING_STYLE="path")
                env.pop("AWS_PROFILE", None)
                env.pop("AWS_SESSION_TOKEN", None)
            links = [("loopback", 0)] + ([("limited %d Mbit/s" % a.limit_mbit, a.limit_mbit)]
                                         if a.limit_mbit else [])
            for link_name, mbit in links:
                ports = [t[2] for t in targets]
                ctx = Link(ports, mbit) if mbit else contextlib.nullcontext()
                with ctx as link:
                    if mbit and not link.active:
                        notes.append("%s skipped: %s" % (link_name, link.why))
                        continue
                    for server, where, _ in targets:
                        rows += run_server(a, server, where, link_name, names, sizes,
                                           tensor_bytes, env, notes)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows, notes, a, tensor_bytes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "notes": notes, "tensor_bytes": tensor_bytes}, f, indent=1)
    return 0


def run_server(a, server, where, link_name, names, sizes, tensor_bytes, env, notes):
    s3 = where if isinstance(where, dict) else None

    def url_of(name):
        return ("s3://%s/bench/%s" % (s3["bucket"], name)) if s3 else "%s/bench/%s" % (where, name)

    def http_url(name):  # what curl fetches
        return ("%s/%s/bench/%s" % (s3["endpoint"], s3["bucket"], name)) if s3 else url_of(name)

    rows = []
    for tag, _ in ENCODINGS:
        name = names[tag]
        ceil = [curl_ceiling(http_url(name), sizes[tag], s3) for _ in range(a.reps)]
        ceil_rate = sizes[tag] / best(ceil)
        loads = ferry_loads(a.build, url_of(name), a.reps, a.device, env)
        secs = [r["seconds"] for r in loads]
        rate = loads[0]["tensor_bytes"] / best(secs)
        log("%s %s %s: ceiling %.0f MB/s, ferry %.0f MB/s" % (link_name, server, tag,
                                                             ceil_rate / 1e6, rate / 1e6))
        rows.append(dict(link=link_name, server=server, file=tag, loader="ferry",
                         stored_bytes=sizes[tag], tensor_bytes=loads[0]["tensor_bytes"],
                         seconds=secs, ceiling_seconds=ceil, ceiling_Bps=ceil_rate,
                         tensor_Bps=rate, of_ceiling=rate / ceil_rate))
    # Peers read the .safetensors copy; their ceiling is that object's.
    st = names["safetensors"]
    ceil = [curl_ceiling(http_url(st), sizes["safetensors"], s3) for _ in range(a.reps)]
    ceil_rate = sizes["safetensors"] / best(ceil)
    peers = []
    if s3 is not None:
        peers.append(("boto3 + safetensors", lambda: boto3_safetensors(s3, "bench/" + st)))
    peers.append(("runai-model-streamer", lambda: runai_streamer(url_of(st), s3, a.device)))
    for peer, fn in peers:
        try:
            got = [fn() for _ in range(a.reps)]
        except ImportError as e:
            note = "%s not run: %s" % (peer, e)
            if note not in notes:
                notes.append(note)
            continue
        secs = [g[0] for g in got]
        rate = got[0][1] / best(secs)
        log("%s %s %s: ceiling %.0f MB/s, %.0f MB/s" % (link_name, server, peer, ceil_rate / 1e6,
                                                       rate / 1e6))
        rows.append(dict(link=link_name, server=server, file="safetensors", loader=peer,
                         stored_bytes=sizes["safetensors"], tensor_bytes=got[0][1], seconds=secs,
                         ceiling_seconds=ceil, ceiling_Bps=ceil_rate, tensor_Bps=rate,
                         of_ceiling=rate / ceil_rate))
    try:
        import tensorizer  # noqa: F401
        notes.append("tensorizer imports but reads its own format, written from torch "
                     "modules; not run by this script")
    except ImportError as e:
        note = "tensorizer not run: %s" % e
        if note not in notes:
            notes.append(note)
    return rows


def print_table(rows, notes, a, tensor_bytes):
    print("remote_bench: %.0f MiB of bf16 tensors, %s loads, best of %d, MB/s = 10^6 B/s" %
          (tensor_bytes / 2**20, "device" if a.device else "host", a.reps))
    print("| link | server | file | loader | stored MiB | ceiling MB/s (stored) | "
          "tensor MB/s | of ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %s | %.0f | %.0f | %.0f | %.2f |" % (
            r["link"], r["server"], r["file"], r["loader"], r["stored_bytes"] / 2**20,
            r["ceiling_Bps"] / 1e6, r["tensor_Bps"] / 1e6, r["of_ceiling"]))
    for n in notes:
        print("- " + n)


if __name__ == "__main__":
    sys.exit(main())
