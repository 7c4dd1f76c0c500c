#!/usr/bin/env python3
"""Real servers for the remote-storage tests, on 127.0.0.1 only:

  * moto's standalone S3 server (PyPI moto[server]), with signature checking on: the helper
    creates an IAM user and key, a bucket, and uploads the seed objects with boto3;
  * nginx (Debian) serving a folder over HTTP and over HTTPS, with a certificate authority
    and a certificate for 127.0.0.1 made here with openssl;
  * a fault-injecting HTTP server (this file) serving the same folder.

    servers.py serve --dir DIR [--watch-stdin]   run until SIGTERM/SIGINT (or stdin closes)
    servers.py start --dir DIR                   serve in the background; return when ready
    servers.py stop --dir DIR                    stop what `start` started

When ready, DIR/servers.json says where everything is:
  {"pid", "root", "seed": {name: size}, "http", "https", "ca", "fault",
   "s3": {"endpoint", "region", "bucket", "access_key_id", "secret_access_key"},
   "missing": {server: reason}}
A server whose program is missing is left out and named under "missing" (tests skip then).
From Python: `with Servers(dir) as s: s.info[...]` (see tests/python/test_servers.py).

Fault server URLs: http://127.0.0.1:PORT/NONCE/KIND/COUNT/FILE, FILE under the root. The
first COUNT GET requests of that URL (the NONCE keeps tests apart) get fault KIND, later ones
are served correctly (Range, ETag, If-Match honoured). Suffix-range requests (a client's
opening probe) are neither faulted nor counted unless COUNT ends with "p" ("2p"); the
"changed" kinds count every request:
  ok          never a fault
  drop        headers and half the body, then the connection is closed
  status500, status503, status429   that status (503 and 429 with Retry-After: 0)
  short       a correct head, half the body, then the connection is closed
  lying       Content-Length shorter than the range sent (the rest follows anyway)
  badrange    Content-Range one byte off what was asked
  slow        headers, then nothing until the client gives up (at most 60 s)
  changed     after COUNT requests the file's bytes and ETag change (If-Match honoured: 412)
  changed-ignore  as changed, but If-Match ignored: new bytes with the new ETag
  norange     Range ignored: always 200 with the whole file
  noetag      no ETag header (Last-Modified only)
GET /_ranges/NONCE/KIND/COUNT/FILE answers the Range headers that URL's requests carried, as a
JSON list.
"""
import argparse
import hashlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

SEED = {  # name: size; bytes are Seed(name, size)
    "seed/empty.bin": 0,
    "seed/one.bin": 1,
    "seed/small.bin": 100_000,
    "seed/large.bin": (9 << 20) + 4321,
    # moto checks signatures of keys with spaces, but not of other escaped characters.
    "seed/dir one/key with spaces.bin": 70_000,
}
BUCKET = "ferry-test"
REGION = "us-east-1"
HOST = "127.0.0.1"


def seed_bytes(name, size):
    """Deterministic, non-repeating bytes (a SHA-256 counter stream)."""
    out = bytearray()
    counter = 0
    base = name.encode()
    while len(out) < size:
        out += hashlib.sha256(base + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:size])


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_port(port, proc, what, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("%s exited with %s" % (what, proc.returncode))
        try:
            with socket.create_connection((HOST, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("%s did not listen on %d within %d s" % (what, port, timeout))


# ---- certificates -------------------------------------------------------------------------
def make_certs(d):
    """A CA and a server certificate for 127.0.0.1 and localhost, signed by it."""
    os.makedirs(d, exist_ok=True)
    ca_key, ca = os.path.join(d, "ca.key"), os.path.join(d, "ca.pem")
    key, csr, crt = (os.path.join(d, n) for n in ("server.key", "server.csr", "server.pem"))
    ext = os.path.join(d, "server.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth\n")

    def run(*args):
        subprocess.run(["openssl", *args], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
        "-days", "2", "-subj", "/CN=TensorFerry test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", crt, "-days", "2", "-extfile", ext)
    return ca, crt, key


# ---- nginx --------------------------------------------------------------------------------
def start_nginx(d, root, certs):
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx")
                                       else None)
    if nginx is None:
        return None, "nginx is not installed (Debian package nginx)"
    ca, crt, key = certs
    ndir = os.path.join(d, "nginx")
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(ndir, sub), exist_ok=True)
    http_port, https_port = free_port(), free_port()
    user = "user root root;\n" if os.geteuid() == 0 else ""
    conf = os.path.join(ndir, "nginx.conf")
    with open(conf, "w") as f:
        f.write("""%(user)sworker_processes 1;
daemon off;
pid %(n)s/nginx.pid;
error_log %(n)s/error.log warn;
events { worker_connections 512; }
http {
  access_log off;
  client_body_temp_path %(n)s/body;
  proxy_temp_path %(n)s/proxy;
  fastcgi_temp_path %(n)s/fastcgi;
  uwsgi_temp_path %(n)s/uwsgi;
  scgi_temp_path %(n)s/scgi;
  default_type application/octet-stream;
  keepalive_requests 100000;
  sendfile on;
  server { listen %(host)s:%(http)d; root %(root)s; }
  server {
    listen %(host)s:%(https)d ssl;
    ssl_certificate %(crt)s;
    ssl_certificate_key %(key)s;
    root %(root)s;
  }
}
""" % dict(user=user, n=ndir, host=HOST, http=http_port, https=https_port, root=root,
           crt=crt, key=key))
    log = open(os.path.join(ndir, "stderr.log"), "w")
    proc = subprocess.Popen([nginx, "-p", ndir, "-c", conf, "-e", os.path.join(ndir, "error.log")],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        wait_port(http_port, proc, "nginx")
        wait_port(https_port, proc, "nginx")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, {"http": "http://%s:%d" % (HOST, http_port),
                  "https": "https://%s:%d" % (HOST, https_port)}


# ---- moto ---------------------------------------------------------------------------------
def start_moto(d, root):
    try:
        import boto3  # noqa: F401  (moto[server] brings it)
        import moto.server  # noqa: F401
    except ImportError as e:
        return None, "moto[server] is not installed (%s)" % e
    port = free_port()
    env = dict(os.environ)
    # Signature checking on after the first requests (the IAM user, its key and policy).
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    for k in list(env):
        if k.startswith("AWS_"):
            del env[k]
    log = open(os.path.join(d, "moto.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
    try:
        return proc, seed_moto(proc, port, root)
    except BaseException:
        proc.terminate()
        proc.wait()
        raise


def seed_moto(proc, port, root):
    """The IAM user and key the tests sign with, the bucket, and the seed objects."""
    wait_port(port, proc, "moto")
    import boto3
    endpoint = "http://%s:%d" % (HOST, port)
    anon = dict(endpoint_url=endpoint, region_name=REGION, aws_access_key_id="bootstrap",
                aws_secret_access_key="bootstrap")
    iam = boto3.client("iam", **anon)
    iam.create_user(UserName="ferry")
    key = iam.create_access_key(UserName="ferry")["AccessKey"]
    iam.put_user_policy(UserName="ferry", PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION,
                      aws_access_key_id=key["AccessKeyId"],
                      aws_secret_access_key=key["SecretAccessKey"])
    s3.create_bucket(Bucket=BUCKET)
    for name in SEED:
        with open(os.path.join(root, name), "rb") as f:
            try:
                s3.put_object(Bucket=BUCKET, Key=name, Body=f.read())
            except Exception as e:
                raise RuntimeError("seeding %r: %s" % (name, e))
    return {"s3": {"endpoint": endpoint, "region": REGION, "bucket": BUCKET,
                   "access_key_id": key["AccessKeyId"],
                   "secret_access_key": key["SecretAccessKey"]}}


# ---- the fault server ---------------------------------------------------------------------
class FaultState:
    def __init__(self, root):
        self.root = root
        self.lock = threading.Lock()
        self.counts = {}
        self.ranges = {}  # path: the Range headers its requests carried

    def log_range(self, key, rng):
        with self.lock:
            self.ranges.setdefault(key, []).append(rng)

    def next(self, key):
        with self.lock:
            n = self.counts.get(key, 0)
            self.counts[key] = n + 1
            return n


def make_fault_handler(state):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def fail(self, status, retry_after=False):
            body = b"<Error><Code>Injected</Code></Error>"
            self.send_response(status)
            if retry_after:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.startswith("/_ranges/"):
                with state.lock:
                    body = json.dumps(state.ranges.get(self.path[8:], [])).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            parts = self.path.split("/", 4)
            if len(parts) != 5:
                return self.fail(404)
            _, nonce, kind, count, name = parts
            from urllib.parse import unquote
            path = os.path.realpath(os.path.join(state.root, unquote(name)))
            if not path.startswith(os.path.realpath(state.root) + os.sep) or \
                    not os.path.isfile(path):
                return self.fail(404)
            with open(path, "rb") as f:
                data = f.read()
            rng = self.headers.get("Range") or ""
            state.log_range(self.path, rng)
            probe = rng.startswith("bytes=-")
            counted = not probe or count.endswith("p") or kind.startswith("changed")
            limit = int(count.rstrip("p"))
            n = state.next(self.path) if counted else limit
            faulty = kind != "ok" and n < limit
            etag = '"%s"' % hashlib.md5(data).hexdigest()
            if kind.startswith("changed") and n >= limit:
                data = bytes(b ^ 0x5A for b in data)
                etag = '"%s"' % hashlib.md5(data).hexdigest()
                faulty = False
            if faulty and kind in ("status500", "status503", "status429"):
                return self.fail(int(kind[6:]), retry_after=kind != "status500")
            match = self.headers.get("If-Match")
            if match is not None and match != etag and kind != "changed-ignore":
                return self.fail(412)
            size = len(data)
            first, last, partial = 0, size - 1, False
            if rng.startswith("bytes=") and kind != "norange":
                a, _, b = rng[6:].partition("-")
                if a == "":
                    first, last = max(0, size - int(b)), size - 1
                else:
                    first, last = int(a), min(size - 1, int(b) if b else size - 1)
                if size == 0 or first > last:
                    self.send_response(416)
                    self.send_header("Content-Range", "bytes */%d" % size)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                partial = True
            body = data[first:last + 1]
            self.send_response(206 if partial else 200)
            if partial:
                shown = (first + 1, last + 1) if faulty and kind == "badrange" else (first, last)
                self.send_header("Content-Range", "bytes %d-%d/%d" % (shown[0], shown[1], size))
            length = len(body)
            if faulty and kind == "lying":
                length = max(0, len(body) - max(1, len(body) // 2))
            self.send_header("Content-Length", str(length))
            if kind != "noetag":
                self.send_header("ETag", etag)
            self.send_header("Last-Modified", "Tue, 01 Dec 2026 00:00:00 GMT")
            if faulty and kind in ("drop", "short", "lying", "slow"):
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if faulty and kind == "slow":
                self.wfile.flush()
                deadline = time.time() + 60
                while time.time() < deadline:
                    time.sleep(0.2)
                    try:  # a closed peer makes the socket readable with EOF
                        self.connection.setblocking(False)
                        if self.connection.recv(1, socket.MSG_PEEK) == b"":
                            break
                    except BlockingIOError:
                        pass
                    except OSError:
                        break
                return
            if faulty and kind in ("drop", "short"):
                self.wfile.write(body[:len(body) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(body)

    return Handler


def start_fault(root):
    server = http.server.ThreadingHTTPServer((HOST, 0), make_fault_handler(FaultState(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, {"fault": "http://%s:%d" % (HOST, server.server_address[1])}


# ---- serve / start / stop -----------------------------------------------------------------
def serve(d, watch_stdin=False):
    d = os.path.abspath(d)
    os.makedirs(d, exist_ok=True)
    state = os.path.join(d, "servers.json")
    if os.path.exists(state):
        os.unlink(state)
    root = os.path.join(d, "www")
    for name, size in SEED.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(seed_bytes(name, size))
    info = {"pid": os.getpid(), "root": root, "seed": SEED, "missing": {}}
    procs = []
    stop = threading.Event()

    def on_signal(*_):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fault = None
    try:
        fault, where = start_fault(root)
        info.update(where)
        if shutil.which("openssl") is None:
            info["missing"]["nginx"] = "openssl is not installed (needed for the test certificate)"
        else:
            certs = make_certs(os.path.join(d, "certs"))
            info["ca"] = certs[0]
            proc, where = start_nginx(d, root, certs)
            if proc is None:
                info["missing"]["nginx"] = where
            else:
                procs.append(proc)
                info.update(where)
        proc, where = start_moto(d, root)
        if proc is None:
            info["missing"]["moto"] = where
        else:
            procs.append(proc)
            info.update(where)
        tmp = state + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f, indent=1)
        os.rename(tmp, state)
        print(json.dumps(info), flush=True)
        if watch_stdin:
            threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        while not stop.is_set():
            stop.wait(0.5)
            for p in procs:
                if p.poll() is not None:
                    print("servers.py: a server exited with %s" % p.returncode, file=sys.stderr)
                    stop.set()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGQUIT if "nginx" in p.args[0] else signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if fault is not None:
            fault.shutdown()
        if os.path.exists(state):
            os.unlink(state)


def start(d):
    d = os.path.abspath(d)
    os.makedirs(d, exist_ok=True)
    state = os.path.join(d, "servers.json")
    if os.path.exists(state):
        stop(d)
    log = open(os.path.join(d, "serve.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", "--dir", d],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.exists(state):
            with open(state) as f:
                print(f.read())
            return 0
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    with open(os.path.join(d, "serve.log")) as f:
        sys.stderr.write(f.read())
    if proc.poll() is None:
        proc.terminate()
    return 1


def stop(d):
    state = os.path.join(os.path.abspath(d), "servers.json")
    if not os.path.exists(state):
        return 0
    with open(state) as f:
        pid = json.load(f)["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    deadline = time.time() + 30
    while time.time() < deadline and os.path.exists(state):
        time.sleep(0.1)
    return 0


class Servers:
    """The servers for the length of a `with` block (pytest fixtures use this)."""

    def __init__(self, d):
        self.dir = os.path.abspath(d)
        self.proc = None
        self.info = None

    def __enter__(self):
        os.makedirs(self.dir, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", "--dir", self.dir,
             "--watch-stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("servers.py serve exited with %s" % self.proc.wait())
        self.info = json.loads(line)
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["serve", "start", "stop"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--watch-stdin", action="store_true",
                    help="serve: stop when standard input closes (the parent died)")
    a = ap.parse_args()
    if a.command == "serve":
        serve(a.dir, a.watch_stdin)
        return 0
    return start(a.dir) if a.command == "start" else stop(a.dir)


if __name__ == "__main__":
    sys.exit(main())
