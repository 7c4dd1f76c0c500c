#!/usr/bin/env python3
"""Side-by-side load benchmark: TensorFerry beside the loaders users would pick instead, and
beside the hardware ceilings, measured on the same machine in the same run.

    python3 benchmarks/compare/run_compare.py --out DIR [--size-gib 8] [--modes hot,cold]
    python3 benchmarks/compare/run_compare.py --out /tmp/cmp --dry-run     # CPU-only machine

Generates a llama-like checkpoint (bf16 layers, FP8 layers with scale_inv/amax and a
DelayedScaling state; see ckpt.py), writes it as TensorFerry raw and shuffle+zstd,
safetensors and torch.save, then loads it with every loader that is installed, each run in a
fresh process (children.py), hot (file in the page cache) and cold (page cache dropped just
before the timed part). Writes into --out: results.csv (best of the repetitions per loader and
mode), runs.csv (every run), meta.json (machine, versions, configuration, failures) and
compare.png. README.md beside this file explains the columns.

The parent process never touches CUDA: children report through stdin/stdout, and the parent
samples each child's /proc entries while it runs and asks NVML which GPUs hold memory of it.
"""

import argparse
import datetime
import glob
import json
import os
import platform
import queue
import re
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import report  # noqa: E402

FORMAT_FILES = {"ferry-raw": "ckpt.ferry", "ferry-zstd": "ckpt-zstd.ferry",
                "ferry-planes": "ckpt-planes.ferry",
                "safetensors": "ckpt.safetensors", "pt": "ckpt.pt"}
FORMATS = ["ferry-raw", "ferry-zstd", "ferry-planes", "safetensors", "pt"]


class Entry:
    """One row of the comparison: a loader of one file format."""

    def __init__(self, name, fmt, kind, loader=None, needs=None, modes=("hot", "cold"),
                 env=None, variant=None, gpu=True, note=""):
        self.name, self.fmt, self.kind = name, fmt, kind
        self.loader = loader or name
        self.needs, self.modes, self.env, self.variant = needs, modes, env or {}, variant
        self.gpu, self.note = gpu, note


GPU_ENTRIES = [
    Entry("tensorferry-c", "ferry-raw", "c", note="C API, one ferry_loader_load of every tensor"),
    Entry("tensorferry-c-zstd", "ferry-zstd", "c",
          note="C API, shuffle+zstd file"),
    Entry("ferry-bench-cli", "ferry-raw", "cli", note="`ferry bench FILE` as it prints"),
    Entry("ferry-bench-cli-zstd", "ferry-zstd", "cli", note="`ferry bench FILE` as it prints"),
    Entry("tensorferry-py", "ferry-raw", "gpu",
          note="tensorferry.load_file(device='cuda') + load_scaling_state"),
    Entry("tensorferry-py-zstd", "ferry-zstd", "gpu", loader="tensorferry-py",
          note="as tensorferry-py, shuffle+zstd file"),
    Entry("tensorferry-c-planes", "ferry-planes", "c",
          note="C API, planes file (expanded on the GPU)"),
    Entry("ferry-bench-cli-planes", "ferry-planes", "cli", note="`ferry bench FILE` as it prints"),
    Entry("tensorferry-py-planes", "ferry-planes", "gpu", loader="tensorferry-py",
          note="as tensorferry-py, planes file"),
    Entry("safetensors", "safetensors", "gpu", note="safetensors.torch.load_file(device=)"),
    Entry("torch-mmap", "pt", "gpu", note="torch.load(mmap=True), then .to('cuda') per tensor"),
    Entry("torch-map_location", "pt", "gpu", note="torch.load(map_location='cuda')"),
    Entry("fastsafetensors", "safetensors", "gpu", needs="fastsafetensors",
          note="fastsafe_open(nogds=True), defaults (O_DIRECT reads)"),
    Entry("fastsafetensors-buffered", "safetensors", "gpu", loader="fastsafetensors",
          needs="fastsafetensors", modes=("hot",), env={"FASTSAFETENSORS_ODIRECT": "0"},
          note="as fastsafetensors with FASTSAFETENSORS_ODIRECT=0 (page cache)"),
    Entry("instanttensor", "safetensors", "gpu", needs="instanttensor",
          note="safe_open(...).tensors(), default backend"),
    Entry("instanttensor-buffered", "safetensors", "gpu", loader="instanttensor",
          needs="instanttensor", modes=("hot",), variant="buffered",
          note="as instanttensor with backend=BackendPolicy.BUFFERED (page cache)"),
    Entry("runai-streamer", "safetensors", "gpu", needs="runai_model_streamer",
          note="SafetensorsStreamer.stream_file(device=).get_tensors()"),
]

HOST_ENTRIES = [
    Entry("tensorferry-c-host", "ferry-raw", "c", gpu=False, note="C API, load to host"),
    Entry("tensorferry-c-host-zstd", "ferry-zstd", "c", gpu=False, note="C API, load to host"),
    Entry("ferry-bench-cli-host", "ferry-raw", "cli", gpu=False,
          note="`ferry bench FILE` as it prints"),
    Entry("tensorferry-py-host", "ferry-raw", "host", gpu=False,
          note="tensorferry.load_file() (numpy)"),
    Entry("tensorferry-py-host-zstd", "ferry-zstd", "host", loader="tensorferry-py-host",
          gpu=False, note="tensorferry.load_file() (numpy)"),
    Entry("safetensors-host", "safetensors", "host", gpu=False,
          note="safetensors load to host memory"),
    Entry("torch-host", "pt", "host", gpu=False, note="torch.load() to host memory"),
]

CEILINGS = [
    Entry("ceiling:pinned-h2d", "ferry-raw", "pinned-h2d",
          note="pinned host -> device, 256 MiB chunks, CUDA events"),
    Entry("ceiling:file-read", "ferry-raw", "file-read", gpu=False,
          note="threaded pread of the ferry file (O_DIRECT when cold)"),
]


def log(msg):
    stamp = time.strftime("%H:%M:%S")
    line = "[%s] %s" % (stamp, msg)
    print(line, file=sys.stderr, flush=True)
    if LOG_FILE is not None:
        LOG_FILE.write(line + "\n")
        LOG_FILE.flush()


LOG_FILE = None


# ---- environment ----------------------------------------------------------------------------


def fs_type(path):
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _free_bytes(d):
    st = os.statvfs(d)
    existing = sum(os.path.getsize(p) for p in glob.glob(os.path.join(d, "ckpt*")))
    return st.f_bavail * st.f_frsize + existing


def pick_data_dir(explicit):
    """A disk-backed directory (not tmpfs: cold runs must read the disk), the one with the
    most room. Returns (path, bytes available for the checkpoint files)."""
    if explicit:
        os.makedirs(explicit, exist_ok=True)
        return explicit, _free_bytes(explicit)
    best = None
    for cand in (os.path.expanduser("~/tferry-compare"), "/var/tmp/tferry-compare",
                 "/tmp/tferry-compare"):
        parent = os.path.dirname(cand)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            continue
        if fs_type(parent) in ("tmpfs", "ramfs", "devtmpfs"):
            continue
        os.makedirs(cand, exist_ok=True)
        free = _free_bytes(cand)
        if best is None or free > best[1]:
            best = (cand, free)
    if best is None:
        raise SystemExit("run_compare: no disk-backed directory; pass --data-dir")
    return best


# Bytes of each format relative to the tensor bytes (shuffle+zstd of bf16: about 0.8).
FORMAT_SIZE = {"ferry-raw": 1.0, "ferry-zstd": 0.85, "ferry-planes": 0.7, "safetensors": 1.0,
               "pt": 1.0}


def fit_formats(formats, total, free):
    """The formats that fit in `free` bytes, dropping the last ones first (pt, then zstd)."""
    order = list(formats)
    keep = list(formats)
    for drop in ("pt", "ferry-zstd", "ferry-planes", "safetensors"):
        need = sum(FORMAT_SIZE[f] for f in keep) * total * 1.03 + (1 << 30)
        if need <= free or len(keep) == 1:
            break
        if drop in keep:
            keep.remove(drop)
    return [f for f in order if f in keep]


def find_build_dir(explicit):
    if explicit:
        return os.path.abspath(explicit)
    cands = [d for d in glob.glob(os.path.join(ROOT, "build*"))
             if os.path.exists(os.path.join(d, "src", "libferry.so"))]
    if not cands:
        return None
    # Prefer a tree with the `ferry` command, then the most recently built library.
    cands.sort(key=lambda d: (os.path.exists(os.path.join(d, "src", "cli", "ferry")),
                              os.path.getmtime(os.path.join(d, "src", "libferry.so"))))
    return cands[-1]


def run_text(cmd, timeout=20):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)


def machine_info(data_dir):
    info = {"hostname": platform.node(), "kernel": platform.release(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "data_dir": data_dir, "data_fs": fs_type(data_dir)}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    if shutil.which("nvidia-smi"):
        rc, out = run_text(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                            "--format=csv,noheader"])
        if rc == 0:
            gpus = [l.strip() for l in out.strip().splitlines() if l.strip()]
            info["gpus"] = gpus
            info["gpu_name"] = gpus[0].split(",")[1].strip() if gpus else ""
            info["driver"] = gpus[0].split(",")[-1].strip() if gpus else ""
    return info


# ---- child processes ------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Samples a child's /proc entries: growth of its /dev/nvidia* mappings (where the driver
    maps cudaHostAlloc'd pinned memory; cudaHostRegister'd memory does not show there),
    VmPin, VmLck and VmRSS."""

    def __init__(self, pid, interval=0.02):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.peak = {"map": 0, "VmPin": 0, "VmLck": 0, "VmRSS": 0}
        self.last = {"map": 0, "VmPin": 0, "VmLck": 0, "VmRSS": 0}

    def sample(self):
        cur = {"map": 0, "VmPin": 0, "VmLck": 0, "VmRSS": 0}
        try:
            with open("/proc/%d/maps" % self.pid) as f:
                for line in f:
                    if "/dev/nvidia" not in line or "nvidia-uvm" in line:
                        continue
                    lo, hi = line.split(" ", 1)[0].split("-")
                    cur["map"] += int(hi, 16) - int(lo, 16)
            with open("/proc/%d/status" % self.pid) as f:
                for line in f:
                    key = line.split(":", 1)[0]
                    if key in cur:
                        cur[key] = int(line.split()[1]) * 1024
        except (OSError, ValueError):
            return None
        with self.lock:
            self.last = cur
            for k, v in cur.items():
                self.peak[k] = max(self.peak[k], v)
        return cur

    def baseline(self):
        """Samples now and restarts the peaks from this sample; returns it."""
        cur = self.sample()
        with self.lock:
            if cur is None:
                cur = dict(self.last)
            self.peak = dict(cur)
        return cur

    def run(self):
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)


class Nvml:
    def __init__(self):
        self.ok = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.ok = True
        except Exception as e:
            self.error = "%s: %s" % (type(e).__name__, e)

    def usage(self, pid):
        """{gpu index: MiB used by pid} for every GPU where pid has a context."""
        out = {}
        if not self.ok:
            return None
        for i in range(self.count):
            h = self.nv.nvmlDeviceGetHandleByIndex(i)
            procs = []
            for fn in ("nvmlDeviceGetComputeRunningProcesses",
                       "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    procs += getattr(self.nv, fn)(h)
                except Exception:
                    pass
            for p in procs:
                if p.pid == pid:
                    mem = p.usedGpuMemory
                    out[i] = out.get(i, 0) + (mem / 2**20 if mem is not None else 0)
        return out


def resident_pct(path):
    """Percentage of the file's pages in the page cache (mincore on a mapping of it)."""
    import ctypes

    try:
        size = os.path.getsize(path)
        if size == 0:
            return 100.0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        page = os.sysconf("SC_PAGE_SIZE")
        vec = ctypes.create_string_buffer((size + page - 1) // page)
        try:
            if libc.mincore(addr, size, vec) != 0:
                return None
        finally:
            libc.munmap(addr, size)
        raw = vec.raw
        return 100.0 * (len(raw) - raw.count(0)) / len(raw)  # bit 0: resident; the rest 0
    except (OSError, AttributeError, ValueError):
        return None


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def can_drop_caches():
    try:
        drop_caches()
        return True, ""
    except OSError as e:
        return False, "cannot drop the page cache (%s): cold runs need root" % e


def _wait4(p, deadline):
    """Reaps the child, returning its rusage (ru_maxrss is its peak RSS)."""
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return ru
        if time.monotonic() > deadline:
            _kill(p)
            pid, status, ru = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            return ru
        time.sleep(0.01)


def _kill(p):
    try:
        os.killpg(p.pid, 9)  # the child's own session (start_new_session)
    except OSError:
        pass


def run_protocol_child(cmd, env, mode, timeout, log_path, nvml, path=None):
    """Runs a child that speaks the @@READY / @@RESULT / @@HOLD protocol (children.py,
    ferry_load.c). Returns a dict of measurements."""
    t_spawn = time.monotonic()
    deadline = t_spawn + timeout
    logf = open(log_path, "w")
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf,
                         env=env, start_new_session=True, text=True, bufsize=1)
    lines = queue.Queue()

    def pump():
        for line in p.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    sampler = Sampler(p.pid)
    sampler.start()
    out = {"status": "error"}

    def expect(tag):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(tag)
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(tag)
            if line is None:
                return None
            if line.startswith("@@RESULT "):
                try:
                    return json.loads(line[len("@@RESULT "):])
                except ValueError:
                    return {"error": "unreadable result line: %r" % line[:300]}
            if line.startswith(tag):
                return line
            logf.write("[stdout] " + line)

    try:
        if expect("@@READY") is None:
            out["note"] = "child exited before READY"
        else:
            if mode == "cold":
                drop_caches()
            resident = resident_pct(path) if path else None
            base = sampler.baseline()
            p.stdin.write("GO\n")
            p.stdin.flush()
            result = expect("@@RESULT")
            if result is None:
                out["note"] = "child exited without a result"
            elif "error" in result:
                out["note"] = result["error"]
            else:
                peak = dict(sampler.peak)
                out.update(result)
                out["status"] = "ok"
                out["rss_ready_mib"] = base["VmRSS"] / 2**20
                out["cache_resident_pct"] = resident
                out["pinned_map_peak_mib"] = max(0, peak["map"] - base["map"]) / 2**20
                out["vmpin_peak_mib"] = peak["VmPin"] / 2**20
                out["vmlck_peak_mib"] = peak["VmLck"] / 2**20
                if expect("@@HOLD") is not None:
                    out["nvml"] = nvml.usage(p.pid) if nvml is not None else None
                    p.stdin.write("EXIT\n")
                    p.stdin.flush()
    except TimeoutError:
        out["status"] = "timeout"
        out["note"] = "no answer within %d s" % timeout
        _kill(p)
    except (BrokenPipeError, OSError) as e:
        out["note"] = "child pipe: %s" % e
    try:
        p.stdin.close()
    except OSError:
        pass
    ru = _wait4(p, max(deadline, time.monotonic() + 10))
    sampler.stop_event.set()
    sampler.join()
    logf.close()
    out["peak_rss_mib"] = ru.ru_maxrss / 1024
    out["wall_s"] = time.monotonic() - t_spawn
    if out["status"] != "ok":
        out["log_tail"] = _tail(log_path)
    return out


def _tail(path, n=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def run_cli_child(cmd, env, mode, timeout, log_path, path=None):
    """Runs `ferry bench` (no protocol): throughput as it prints it; RSS from wait4."""
    if mode == "cold":
        drop_caches()
    resident = resident_pct(path) if path else None
    t_spawn = time.monotonic()
    with open(log_path, "w") as logf:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=logf,
                             env=env, start_new_session=True, text=True)
        sampler = Sampler(p.pid)
        sampler.start()
        chunks = []
        t = threading.Thread(target=lambda: chunks.append(p.stdout.read()), daemon=True)
        t.start()
        ru = _wait4(p, t_spawn + timeout)
        t.join(5)
        sampler.stop_event.set()
        sampler.join()
    text = "".join(chunks)
    out = {"peak_rss_mib": ru.ru_maxrss / 1024, "wall_s": time.monotonic() - t_spawn,
           "pinned_map_peak_mib": sampler.peak["map"] / 2**20, "cli_output": text[-2000:],
           "cache_resident_pct": resident}
    if time.monotonic() - t_spawn >= timeout:
        out.update(status="timeout", note="no result within %d s" % timeout)
        return out
    if p.returncode != 0:
        out.update(status="error", note="exit %d" % p.returncode, log_tail=_tail(log_path))
        return out
    parsed = parse_cli(text, mode)
    if not parsed.get("gbps"):
        out.update(status="error", note="no load rate found in `ferry bench` output")
        return out
    notes = ["ferry bench: %s" % ("its first load" if mode == "cold" else "best of its runs"),
             "RSS includes its own ceiling pass"]
    if parsed.get("path"):
        notes.append(parsed["path"])
    if parsed.get("ceiling_gbps"):
        notes.append("its ceiling %.2f GB/s" % parsed["ceiling_gbps"])
    out.update(status="ok", gbps_reported=parsed["gbps"], note="; ".join(notes),
               cli_pinned_mib=parsed.get("pinned_mib"))
    return out


_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*GB/s")


def parse_cli(text, mode):
    """Figures from `ferry bench` output (src/cli/bench.cc). Cold: its first load, the line
    "warm-up  S s  R GB/s" (the page cache was dropped just before). Hot: "best R GB/s" of
    the "load median ..., best ..." line. Also the pinned bytes and host path it reports, and
    its own ceiling."""
    out = {}
    for line in text.splitlines():
        key = line.split(" ", 1)[0]
        m = _RATE.search(line)
        if key == "warm-up" and m:
            out["first_load_gbps"] = float(m.group(1))
        elif key == "load":
            b = re.search(r"best\s+([0-9.]+)\s*GB/s", line)
            if b:
                out["best_gbps"] = float(b.group(1))
            p = re.search(r"([0-9.]+)\s*(B|KiB|MiB|GiB)\s+pinned", line)
            if p:
                scale = {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[p.group(2)]
                out["pinned_mib"] = float(p.group(1)) * scale
            for path in ("registered page cache", "staging ring"):
                if path in line:
                    out["path"] = path
        elif key == "ceiling" and m:
            out["ceiling_gbps"] = float(m.group(1))
        elif key == "target":
            out["target"] = line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
    out["gbps"] = out.get("first_load_gbps") if mode == "cold" else out.get("best_gbps")
    return out


def cli_supports_bench(ferry):
    if not ferry or not os.access(ferry, os.X_OK):
        return False, "no `ferry` command in the build directory"
    rc, out = run_text([ferry, "bench", "--help"])
    if rc != 0 or "--repeat" not in out:
        return False, "`ferry bench` is not in this build"
    return True, ""


def _compile_ferry_load(cc, build_dir, dest, rpath):
    src = os.path.join(HERE, "ferry_load.c")
    cmd = [cc, "-O2", "-std=c99", "-o", dest, src, "-I", os.path.join(ROOT, "include"),
           "-I", os.path.join(build_dir, "include"), "-L", os.path.join(build_dir, "src"),
           "-lferry", "-Wl,-rpath," + rpath, "-ldl"]
    return run_text(cmd, timeout=120)


def build_ferry_load(build_dir, dest):
    """The C API row's program, ferry_load.c, linked to the build's libferry.so. A copy in
    <build>/compare/ (found through $ORIGIN, compiled with the headers of that build) is used
    as it is; otherwise it is compiled here, into the build tree when writable, else `dest`."""
    prebuilt = os.path.join(build_dir, "compare", "ferry_load")
    if os.access(prebuilt, os.X_OK):
        return prebuilt, ""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler and no %s" % prebuilt
    try:
        os.makedirs(os.path.dirname(prebuilt), exist_ok=True)
        rc, out = _compile_ferry_load(cc, build_dir, prebuilt, "$ORIGIN/../src")
        if rc == 0:
            return prebuilt, ""
    except OSError:
        pass
    rc, out = _compile_ferry_load(cc, build_dir, dest, os.path.join(build_dir, "src"))
    if rc != 0:
        return None, "ferry_load.c did not build: " + out[-500:]
    return dest, ""


# ---- page cache -----------------------------------------------------------------------------


def warm(path, threads=16):
    """Reads a file so that it sits in the page cache (the untimed pass before hot runs)."""
    size = os.path.getsize(path)
    block = 16 << 20
    fd = os.open(path, os.O_RDONLY)

    def work(k):
        buf = bytearray(block)
        off = k * block
        while off < size:
            if os.preadv(fd, [buf], off) <= 0:
                break
            off += threads * block

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="results directory (created)")
    ap.add_argument("--size-gib", type=float, default=None,
                    help="bf16 bytes of the checkpoint, GiB (default 8; 0.05 with --dry-run)")
    ap.add_argument("--data-dir", help="where the checkpoint files go (default: a disk-backed "
                    "directory: /root, /var/tmp or /tmp, not tmpfs)")
    ap.add_argument("--build-dir", help="CMake build tree with src/libferry.so (default: the "
                    "newest build*/ of the checkout)")
    ap.add_argument("--modes", default="hot,cold", help="hot, cold or both (default hot,cold)")
    ap.add_argument("--hot-reps", type=int, default=None, help="timed hot runs (default 2)")
    ap.add_argument("--cold-reps", type=int, default=1, help="timed cold runs (default 1)")
    ap.add_argument("--loaders", default="", help="comma list of rows to run (default: all); "
                    "see --list")
    ap.add_argument("--skip", default="", help="comma list of rows to leave out")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--hot-warmup", choices=("read", "loader"), default="read",
                    help="untimed pass before hot runs: read every file once (default), or "
                    "also run each loader once untimed")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per child (default 120)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", type=int, default=None,
                    help="target GPU (default: the last one, so that any use of GPU 0 shows)")
    ap.add_argument("--host", action="store_true", help="host loads only, even with a GPU")
    ap.add_argument("--regenerate", action="store_true",
                    help="write the files again even if a matching manifest exists")
    ap.add_argument("--dry-run", action="store_true",
                    help="small and quick: --size-gib 0.05, one repetition; works without "
                    "torch or a GPU (host loads only)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size_gib is None:
        args.size_gib = 0.05 if args.dry_run else 8.0
    if args.hot_reps is None:
        args.hot_reps = 1 if args.dry_run else 2
    return args


def main(argv=None):
    global LOG_FILE
    args = parse_args(argv)
    if args.child:
        import children

        return children.main(json.loads(args.child))
    if args.list:
        for e in CEILINGS + GPU_ENTRIES + HOST_ENTRIES:
            print("%-28s %-12s %s" % (e.name, e.fmt, e.note))
        return 0
    t_start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    LOG_FILE = open(os.path.join(args.out, "run.log"), "w")
    modes = [m for m in ("hot", "cold") if m in args.modes.split(",")]

    build_dir = find_build_dir(args.build_dir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.join(ROOT, "bindings", "python")] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA ordinals in NVML's order
    if build_dir:
        env["TENSORFERRY_LIBRARY"] = os.path.join(build_dir, "src", "libferry.so")
    log("build dir: %s" % build_dir)

    # Probe in a child: versions, torch, CUDA, peers.
    probe = child_simple({"role": "probe"}, env, 180)
    if "error" in probe:
        raise SystemExit("probe failed: %s" % probe)
    gpu = bool(probe.get("cuda")) and not args.host
    n_gpus = probe.get("gpus", 0)
    device = args.device if args.device is not None else (n_gpus - 1 if gpu else -1)
    log("torch %s, CUDA %s, GPUs %d, target device %d; peers %s" % (
        probe.get("torch"), probe.get("cuda"), n_gpus, device, probe.get("peers")))

    # Sizes: 4 files of about the checkpoint's bytes (the zstd one smaller).
    import ckpt

    specs, modules, config = ckpt.layout(args.size_gib)
    total = sum(s.nbytes for s in specs + ckpt.state_specs(modules, len(specs)))
    formats = [f for f in FORMATS if f != "pt" or probe.get("torch")]
    data_dir, free = pick_data_dir(args.data_dir)
    fitting = fit_formats(formats, total, free)
    if fitting != formats:
        log("only %.1f GB free in %s: leaving out %s" % (
            free / 1e9, data_dir, ", ".join(f for f in formats if f not in fitting)))
        formats = fitting
    machine = machine_info(data_dir)
    machine["data_free_gb"] = round(free / 1e9, 1)
    log("data dir %s (%s), checkpoint %.2f GB of tensors, %d bf16 + %d FP8 layers" % (
        data_dir, machine["data_fs"], total / 1e9, config["bf16_layers"], config["fp8_layers"]))

    manifest = load_manifest(data_dir, args, "torch" if gpu else "numpy", formats,
                             args.regenerate)
    if manifest is None:
        log("generating and writing %s" % ", ".join(formats))
        gen = child_simple({"role": "generate", "data_dir": data_dir, "seed": args.seed,
                            "size_gib": args.size_gib, "backend": "torch" if gpu else "numpy",
                            "device": device, "formats": formats}, env, 1800)
        if "error" in gen:
            raise SystemExit("generation failed: %s" % gen)
        manifest = load_manifest(data_dir, args, "torch" if gpu else "numpy", formats)
        if manifest is None:
            raise SystemExit("generation wrote no usable manifest in %s" % data_dir)
        for fmt, f in manifest["files"].items():
            log("  %-12s %6.2f GB file, written in %.1f s" % (fmt, f["file_bytes"] / 1e9,
                                                              f["write_s"]))
        log("  generated in %.1f s, sync %.1f s" % (manifest["generate_s"], manifest["sync_s"]))
    else:
        log("reusing the files of %s" % os.path.join(data_dir, "manifest.json"))
    samples_path = os.path.join(data_dir, "samples.txt")
    with open(samples_path, "w") as f:
        f.write("\n".join(manifest["samples"]) + "\n")

    # The C program and the `ferry` command.
    ferry_load, ferry_load_why = (None, "no build directory with libferry.so")
    if build_dir:
        ferry_load, ferry_load_why = build_ferry_load(build_dir, os.path.join(data_dir,
                                                                              "ferry_load"))
    ferry_cli = os.path.join(build_dir, "src", "cli", "ferry") if build_dir else None
    cli_ok, cli_why = cli_supports_bench(ferry_cli)
    cold_ok, cold_why = True, ""
    nvml = Nvml() if gpu else None

    wanted = set(filter(None, args.loaders.split(",")))
    unwanted = set(filter(None, args.skip.split(",")))
    entries = [e for e in CEILINGS if e.gpu <= gpu] + (GPU_ENTRIES if gpu else HOST_ENTRIES)
    entries = [e for e in entries if (not wanted or e.name in wanted) and e.name not in unwanted]

    runs = []
    failures = []
    ceiling_bytes = manifest["files"]["ferry-raw"]["tensor_bytes"]
    for mode in modes:
        reps = args.hot_reps if mode == "hot" else args.cold_reps
        if mode == "cold":
            cold_ok, cold_why = can_drop_caches()
        else:
            # The untimed pass: every file read once so that it sits in the page cache.
            t0 = time.monotonic()
            for f in manifest["files"].values():
                warm(f["path"])
            log("hot: files read into the page cache in %.1f s" % (time.monotonic() - t0))
        for e in entries:
            if mode not in e.modes:
                continue
            fileinfo = manifest["files"].get(e.fmt)
            base = {"mode": mode, "loader": e.name, "format": e.fmt, "note": e.note,
                    "target_gpu": device if e.gpu else -1,
                    "tensor_bytes": fileinfo["tensor_bytes"] if fileinfo else 0,
                    "file_bytes": fileinfo["file_bytes"] if fileinfo else 0}
            why = skip_reason(e, fileinfo, probe, ferry_load, ferry_load_why, cli_ok, cli_why,
                              mode, cold_ok, cold_why)
            if why:
                runs.append(dict(base, rep=0, status="skipped", note=why))
                log("%-5s %-26s skipped: %s" % (mode, e.name, why))
                continue
            if mode == "hot" and e.kind != "pinned-h2d":
                pct = resident_pct(fileinfo["path"])
                if pct is not None and pct < 99.0:
                    t0 = time.monotonic()
                    warm(fileinfo["path"])
                    log("hot: %s was %.0f%% in the page cache; read again in %.1f s" % (
                        os.path.basename(fileinfo["path"]), pct, time.monotonic() - t0))
            if mode == "hot" and args.hot_warmup == "loader" and e.kind != "cli":
                run_entry(e, mode, fileinfo, manifest, env, device, ferry_load, ferry_cli,
                          samples_path, data_dir, args, probe, nvml, ceiling_bytes, reps)
            n = 1 if e.kind == "cli" else reps
            for rep in range(1, n + 1):
                row = dict(base, rep=rep)
                try:
                    res = run_entry(e, mode, fileinfo, manifest, env, device, ferry_load,
                                    ferry_cli, samples_path, data_dir, args, probe, nvml,
                                    ceiling_bytes, reps)
                    row.update(summarize(e, res, row, manifest, device, probe))
                except Exception as ex:  # a harness fault in one row must not end the run
                    import traceback

                    res = {"log_tail": traceback.format_exc()[-3000:]}
                    row.update(status="error", note="harness: %s: %s" % (type(ex).__name__, ex))
                runs.append(row)
                if row["status"] != "ok":
                    failures.append({"mode": mode, "loader": e.name, "rep": rep,
                                     "note": row.get("note"), "log_tail": res.get("log_tail"),
                                     "cli_output": res.get("cli_output")})
                log("%-5s %-26s rep %d: %s" % (mode, e.name, rep, describe(row)))

    summary = report.summarize_runs(runs)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine, "versions": probe.get("versions", {}),
            "tensorferry": probe.get("tensorferry"), "torch_cuda": probe.get("torch_cuda"),
            "peers": probe.get("peers"), "build_dir": build_dir,
            "config": dict(config, size_gib=args.size_gib, seed=args.seed,
                           tensors=len(manifest["specs"]), fp8_modules=len(modules),
                           hot_reps=args.hot_reps, cold_reps=args.cold_reps,
                           timeout_s=args.timeout, target_device=device,
                           generator=manifest["backend"]),
            "files": manifest["files"], "ferry_cli": cli_why or "ok",
            "ferry_load": ferry_load_why or "ok", "cold": cold_why or "ok",
            "nvml": (nvml.error if nvml is not None and not nvml.ok else
                     "ok" if nvml is not None else "no GPU"),
            "probe": probe, "formats": formats, "hot_warmup": args.hot_warmup,
            "failures": failures, "wall_s": round(time.monotonic() - t_start, 1)}
    report.write_all(args.out, runs, summary, meta)
    log("wrote %s (results.csv, runs.csv, meta.json, compare.png) in %.0f s" % (
        args.out, time.monotonic() - t_start))
    print(report.markdown_table(summary, meta))
    return 0


def load_manifest(data_dir, args, backend, formats, regenerate=False):
    path = os.path.join(data_dir, "manifest.json")
    if regenerate or not os.path.exists(path):
        if regenerate and os.path.exists(path):
            os.remove(path)
        return None
    with open(path) as f:
        m = json.load(f)
    if (m.get("seed") != args.seed or m.get("size_gib") != args.size_gib or
            m.get("backend") != backend or set(m.get("files", {})) != set(formats)):
        return None
    for fmt, f in m["files"].items():
        if not os.path.exists(f["path"]) or os.path.getsize(f["path"]) != f["file_bytes"]:
            return None
    return m


def child_simple(spec, env, timeout):
    """A child without the READY/HOLD protocol (probe, generate); returns its result."""
    cmd = [sys.executable, os.path.join(HERE, "run_compare.py"), "--out", "-", "--child",
           json.dumps(spec)]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=None, text=True,
                       timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("@@RESULT "):
            return json.loads(line[len("@@RESULT "):])
    return {"error": "no result (exit %d)" % p.returncode}


def skip_reason(e, fileinfo, probe, ferry_load, ferry_load_why, cli_ok, cli_why, mode, cold_ok,
                cold_why):
    if mode == "cold" and not cold_ok:
        return cold_why
    if fileinfo is None:
        return "no %s file (torch missing, or no disk room: see run.log)" % e.fmt
    if e.kind == "c" and not ferry_load:
        return ferry_load_why
    if e.kind == "cli" and not cli_ok:
        return cli_why
    if e.kind == "cli" and mode == "cold":
        return "ferry bench reads the file into the page cache before it times loads"

    if e.needs and probe.get("peers", {}).get(e.needs) != "ok":
        status = probe.get("peers", {}).get(e.needs, "not installed")
        if "No module named" in status:
            status = "wheel not installed"
        return "%s: %s" % (e.needs, status)
    if e.loader.startswith("tensorferry") and probe.get("tensorferry_error"):
        return probe["tensorferry_error"]
    if e.gpu and e.loader.startswith("tensorferry") and not probe.get("tensorferry_cuda"):
        return "libferry.so was built without the CUDA loader"
    if e.loader == "torch-host" and not probe.get("torch"):
        return "torch not installed"
    return ""


def run_entry(e, mode, fileinfo, manifest, env, device, ferry_load, ferry_cli, samples_path,
              data_dir, args, probe, nvml, ceiling_bytes, reps):
    logs = os.path.join(data_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    log_path = os.path.join(logs, "%s-%s.log" % (mode, e.name.replace(":", "_")))
    child_env = dict(env, **e.env)
    if e.needs == "fastsafetensors" and probe.get("cudart") not in (None, "", "none"):
        # fastsafetensors dlopens the unversioned libcudart.so; point it at torch's.
        shim = os.path.join(data_dir, "cudart-shim")
        os.makedirs(shim, exist_ok=True)
        link = os.path.join(shim, "libcudart.so")
        if not os.path.lexists(link):
            os.symlink(probe["cudart"], link)
        child_env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [shim] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    py = [sys.executable, os.path.join(HERE, "children.py")]
    spec = {"path": fileinfo["path"], "format": e.fmt, "manifest":
            os.path.join(data_dir, "manifest.json"), "device": device if e.gpu else None,
            "loader": e.loader, "variant": e.variant, "env": e.env,
            "torch": bool(probe.get("torch"))}
    if e.kind == "c":
        cmd = [ferry_load, fileinfo["path"], str(device if e.gpu else -1), samples_path]
        return run_protocol_child(cmd, child_env, mode, args.timeout, log_path, nvml,
                                  fileinfo["path"])
    if e.kind == "cli":
        cmd = [ferry_cli, "bench", fileinfo["path"], "--repeat",
               str(reps if mode == "hot" else 1)]
        if e.gpu and device >= 0:
            cmd += ["--device", str(device)]
        return run_cli_child(cmd, child_env, mode, args.timeout, log_path, fileinfo["path"])
    if e.kind == "pinned-h2d":
        spec.update(loader_kind="pinned-h2d", bytes=ceiling_bytes)
    elif e.kind == "file-read":
        spec.update(loader_kind="file-read", direct=(mode == "cold"))
    elif e.kind == "gpu":
        spec.update(loader_kind="gpu")
    else:
        spec.update(loader_kind="host")
    spec["role"] = "run"
    return run_protocol_child(py + [json.dumps(spec)], child_env, mode, args.timeout, log_path,
                              nvml if e.gpu else None,
                              None if e.kind == "pinned-h2d" else fileinfo["path"])


def summarize(e, res, row, manifest, device, probe):
    """A CSV row's measured fields from a child's result."""
    out = {"status": res.get("status", "error"), "note": res.get("note") or row["note"]}
    nbytes = row["tensor_bytes"]
    if e.kind == "file-read":
        nbytes = row["file_bytes"]
    if out["status"] == "ok":
        if e.kind == "cli":
            out["gbps"] = res["gbps_reported"]
            out["seconds"] = nbytes / (res["gbps_reported"] * 1e9)
        else:
            out["seconds"] = res["seconds"]
            out["gbps"] = nbytes / res["seconds"] / 1e9 if res["seconds"] > 0 else 0
        if res.get("ttft") is not None:
            out["ttft_s"] = res["ttft"]
            out["ttft_kind"] = res.get("ttft_kind", "")
        elif e.kind == "c":  # one call loads every tensor
            out["ttft_s"], out["ttft_kind"] = res["seconds"], "whole"
        v = res.get("verify")
        if e.kind == "c":
            v = verify_checksums(res, manifest, device if e.gpu else -1)
        if v is not None:
            out["verified"] = "yes" if v["ok"] else "NO"
            if not v["ok"]:
                out["note"] = "verify: " + json.dumps({k: x for k, x in v.items() if k != "ok"})
                out["status"] = "wrong"
        else:
            out["verified"] = "n/a"
    for k in ("cache_resident_pct", "peak_rss_mib", "rss_ready_mib", "pinned_map_peak_mib", "vmpin_peak_mib",
              "vmlck_peak_mib", "max_reserved_mib", "wall_s"):
        if res.get(k) is not None:
            out[k] = res[k]
    if e.kind == "cli" and res.get("cli_pinned_mib") is not None:
        out["pinned_configured_mib"] = res["cli_pinned_mib"]
    if e.kind == "c" and e.gpu and res.get("staging_bytes"):
        out["pinned_configured_mib"] = res["staging_bytes"] / 2**20
    if e.kind == "file-read" and out["status"] == "ok":
        out["note"] = "%d threads x 16 MiB preads%s" % (
            res.get("threads", 0), ", O_DIRECT" if res.get("direct") else ", buffered")
    if e.kind == "pinned-h2d" and res.get("pinned_bytes"):
        out["pinned_configured_mib"] = res["pinned_bytes"] / 2**20
    if e.loader.startswith("tensorferry-py") and e.gpu and probe.get("tensorferry_staging_bytes"):
        out["pinned_configured_mib"] = probe["tensorferry_staging_bytes"] / 2**20
    nv = res.get("nvml")
    if nv is not None and e.gpu:
        out["gpu_mem_mib"] = nv.get(device, 0)
        others = {i: m for i, m in nv.items() if i != device}
        out["other_gpu_mib"] = sum(others.values())
        out["other_gpu_contexts"] = ";".join(str(i) for i in sorted(others)) or "none"
        if device not in nv:
            out["other_gpu_contexts"] = "n/a (pid not visible to NVML)"
    return out


def verify_checksums(res, manifest, device):
    sums = res.get("checksums", {})
    expected = manifest["checksums"]
    ferry_names = {s["name"] for s in manifest["specs"]}
    want = {n: c for n, c in expected.items() if n in ferry_names}
    mismatched = [n for n, c in want.items() if sums.get(n) != c]
    out = {"ok": not mismatched and bool(want) and res.get("tensors") == len(ferry_names),
           "checked": len(want)}
    if mismatched:
        out["mismatched"] = mismatched[:5]
    if res.get("tensors") != len(ferry_names):
        out["tensors"] = res.get("tensors")
    if device >= 0 and not res.get("on_device", True):
        out["ok"] = False
        out["wrong_device"] = True
    return out


def describe(row):
    if row["status"] == "skipped":
        return "skipped"
    if row["status"] != "ok":
        return "%s (%s)" % (row["status"], str(row.get("note", ""))[:200])
    parts = ["%.2f GB/s" % row["gbps"], "%.3f s" % row["seconds"]]
    if row.get("ttft_s") is not None:
        parts.append("ttft %.3f s (%s)" % (row["ttft_s"], row.get("ttft_kind", "")))
    if row.get("peak_rss_mib") is not None:
        parts.append("rss %.0f MiB" % row["peak_rss_mib"])
    if row.get("pinned_map_peak_mib"):
        parts.append("pinned-map %.0f MiB" % row["pinned_map_peak_mib"])
    if row.get("other_gpu_contexts") not in (None, "none"):
        parts.append("other GPUs: %s (%.0f MiB)" % (row["other_gpu_contexts"],
                                                   row.get("other_gpu_mib", 0)))
    parts.append("verified %s" % row.get("verified", "n/a"))
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
