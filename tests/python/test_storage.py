"""Every Python and CLI entry point that takes a path takes an http(s):// or s3:// URL, against
real servers started here (tests/servers/servers.py: nginx over HTTP and HTTPS, moto's S3
server): load_file, safe_open, Reader, read_metadata, open_checkpoint on a sharded index,
save_file and save_file_async to s3://, tensorferry.torch (where torch is installed), and
`ferry inspect`, `verify`, `convert` (both ways) and `bench`."""
import glob
import json
import os
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest

import tensorferry
import tensorferry.distributed as tfd
import tensorferry.numpy as tfn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "servers"))
import servers as test_servers  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _find_ferry():
    candidates = []
    if os.environ.get("FERRY_BUILD_DIR"):
        candidates.append(os.path.join(os.environ["FERRY_BUILD_DIR"], "src", "cli", "ferry"))
    candidates += sorted(glob.glob(os.path.join(ROOT, "build*", "src", "cli", "ferry")),
                         key=os.path.getmtime, reverse=True)
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


FERRY = _find_ferry()
needs_ferry = pytest.mark.skipif(FERRY is None, reason="no built `ferry`")

TENSORS = {
    "raw": np.arange(300 * 257, dtype=np.float32).reshape(300, 257),
    "ints": np.arange(12, dtype=np.int32).reshape(3, 4),
}


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    with test_servers.Servers(tmp_path_factory.mktemp("servers")) as s:
        info = s.info
        for server in ("nginx", "moto"):
            if server in info["missing"]:
                pytest.skip("%s: %s" % (server, info["missing"][server]))
        # The process environment of a user of the test S3 server (the library reads it at
        # each open), without shared AWS files.
        s3 = info["s3"]
        env = {"AWS_ACCESS_KEY_ID": s3["access_key_id"],
               "AWS_SECRET_ACCESS_KEY": s3["secret_access_key"],
               "AWS_REGION": s3["region"], "AWS_ENDPOINT_URL_S3": s3["endpoint"],
               "HOME": str(tmp_path_factory.mktemp("home"))}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield info
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def s3_url(remote, key):
    return "s3://%s/%s" % (remote["s3"]["bucket"], key)


def http_url(remote, name, https=False):
    return "%s/%s" % (remote["https" if https else "http"], urllib.parse.quote(name))


@pytest.fixture(scope="module")
def published(remote):
    """The same checkpoint (raw and shuffle+zstd tensors) served by nginx and, saved straight
    to the bucket by save_file, by moto: its URLs."""
    name = "py/%d/model one.ferry" % os.getpid()
    local = os.path.join(remote["root"], name)
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tfn.save_file(TENSORS, local, metadata={"step": "3"}, encoding="shuffle+zstd")
    tfn.save_file(TENSORS, s3_url(remote, name), metadata={"step": "3"}, encoding="shuffle+zstd")
    return [http_url(remote, name), s3_url(remote, name)]


def expect_tensors(got):
    assert sorted(got) == sorted(TENSORS)
    for k, v in TENSORS.items():
        np.testing.assert_array_equal(got[k], v)


def test_load_file_reader_and_metadata(published):
    for url in published:
        expect_tensors(tfn.load_file(url))
        expect_tensors(tensorferry.load_file(url, verify=True))
        assert tensorferry.read_metadata(url) == {"step": "3"}
        with tensorferry.Reader(url) as r:
            assert sorted(r.keys()) == sorted(TENSORS)
            assert r.path == url
            r.verify()


def test_https_with_the_test_ca(remote, published, monkeypatch):
    url = http_url(remote, urllib.parse.unquote(published[0][len(remote["http"]) + 1:]), True)
    monkeypatch.setenv("CURL_CA_BUNDLE", remote["ca"])
    expect_tensors(tfn.load_file(url))
    monkeypatch.setenv("CURL_CA_BUNDLE", "")
    monkeypatch.setenv("SSL_CERT_FILE", "")
    with pytest.raises(tensorferry.FerryError):
        tfn.load_file(url)


def test_safe_open_gets_tensors_and_slices(published):
    for url in published:
        with tensorferry.safe_open(url, "np") as f:
            assert sorted(f.keys()) == sorted(TENSORS)
            assert f.metadata() == {"step": "3"}
            np.testing.assert_array_equal(f.get_tensor("raw"), TENSORS["raw"])
            np.testing.assert_array_equal(f.get_slice("raw")[10:20], TENSORS["raw"][10:20])
            np.testing.assert_array_equal(f.get_slice("ints")[1:], TENSORS["ints"][1:])


def test_missing_objects_raise_file_not_found(remote):
    for url in (http_url(remote, "py/none.ferry"), s3_url(remote, "py/none.ferry")):
        with pytest.raises(FileNotFoundError) as e:
            tfn.load_file(url)
        assert url in str(e.value)
        assert remote["s3"]["secret_access_key"] not in str(e.value)


def test_sharded_index_on_s3_and_http(remote):
    folder = "py/%d/sharded/" % os.getpid()
    parts = {"part 1.ferry": {"a": np.ones(100, np.float32)},
             "sub/part2.ferry": {"b": np.arange(50, dtype=np.int64)}}
    os.makedirs(os.path.join(remote["root"], folder, "sub"), exist_ok=True)
    index = {"metadata": {}, "weight_map": {}}
    for shard, tensors in parts.items():
        tfn.save_file(tensors, os.path.join(remote["root"], folder, shard))
        tfn.save_file(tensors, s3_url(remote, folder + shard))
        index["weight_map"].update(dict.fromkeys(tensors, shard))
    text = json.dumps(index).encode()
    with open(os.path.join(remote["root"], folder, "model.ferry.index.json"), "wb") as f:
        f.write(text)
    import boto3
    s3 = remote["s3"]
    boto3.client("s3", endpoint_url=s3["endpoint"], region_name=s3["region"]).put_object(
        Bucket=s3["bucket"], Key=folder + "model.ferry.index.json", Body=text)
    for url in (s3_url(remote, folder + "model.ferry.index.json"),
                http_url(remote, folder + "model.ferry.index.json")):
        with tfd.open_checkpoint(url) as ck:
            assert ck.keys() == ["a", "b"]
            # Shards are named beside the index: percent-encoded over HTTP, literal on S3.
            assert ck.reader("a").path.endswith(
                "/part%201.ferry" if url.startswith("http") else "/part 1.ferry")
            for name, shard in (("a", "part 1.ferry"), ("b", "sub/part2.ferry")):
                got = tfn.load_file(ck.reader(name).path)
                np.testing.assert_array_equal(got[name], parts[shard][name])


def test_save_file_and_async_to_s3(remote):
    big = {"w": np.random.default_rng(1).standard_normal((3, 1 << 20), dtype=np.float32),
           "b": np.arange(10, dtype=np.int16)}
    for encoding in ("raw", "shuffle+zstd"):
        # moto checks signatures of keys with spaces but not with other escaped characters.
        tag = encoding.replace("+", "-")
        url = s3_url(remote, "py/%d/saved %s.ferry" % (os.getpid(), tag))
        tfn.save_file(big, url, encoding=encoding, metadata={"e": encoding})
        got = tfn.load_file(url, verify=True)
        for k in big:
            np.testing.assert_array_equal(got[k], big[k])
        assert tensorferry.read_metadata(url) == {"e": encoding}
        url = s3_url(remote, "py/%d/async %s.ferry" % (os.getpid(), tag))
        future = tensorferry.save_file_async(big, url, encoding=encoding)
        assert future.result(timeout=300) == url
        got = tfn.load_file(url)
        for k in big:
            np.testing.assert_array_equal(got[k], big[k])


def test_uploads_to_plain_http_are_refused(remote):
    url = http_url(remote, "py/up.ferry")
    with pytest.raises(tensorferry.FerryError, match="only s3:// destinations take uploads"):
        tfn.save_file(TENSORS, url)


def test_torch_entry_points(remote, published):
    torch = pytest.importorskip("torch")
    tft = pytest.importorskip("tensorferry.torch")
    for url in published:
        got = tft.load_file(url)
        assert torch.equal(got["raw"], torch.from_numpy(TENSORS["raw"]))
        state = tft.load_state_dict(url, device="cpu")
        assert torch.equal(state["ints"], torch.from_numpy(TENSORS["ints"]))
        model = torch.nn.Linear(257, 300, bias=False)
        missing, unexpected = tft.load_model(model, url, strict=False)
        assert "weight" in missing and sorted(unexpected) == ["ints", "raw"]
    url = s3_url(remote, "py/%d/torch.ferry" % os.getpid())
    sd = {"w": torch.arange(1000, dtype=torch.bfloat16)}
    tft.save_file(sd, url)
    assert torch.equal(tft.load_file(url)["w"], sd["w"])
    tft.save_state_dict_async(sd, url).result(timeout=300)
    assert torch.equal(tft.load_state_dict(url, device="cpu")["w"], sd["w"])
    if torch.cuda.is_available() and tensorferry.cuda_available():
        dev = {"w": sd["w"].cuda()}
        tft.save_file(dev, url)
        assert torch.equal(tft.load_file(url, device="cuda")["w"], dev["w"])


# ---- the CLI --------------------------------------------------------------------------------


def ferry(*args):
    return subprocess.run([FERRY, *args], capture_output=True, text=True, timeout=300)


@needs_ferry
def test_cli_inspect_says_how_it_reads(remote, published):
    for url, how in zip(published, ("HTTP range GETs", "S3 range GETs (SigV4")):
        r = ferry("inspect", url)
        assert r.returncode == 0, r.stderr
        read = [line for line in r.stdout.splitlines() if line.startswith("read ")][0]
        assert how in read and "pinned" in read, read
        assert remote["s3"]["secret_access_key"] not in r.stdout
        j = json.loads(ferry("inspect", "--json", url).stdout)
        assert j["path"] == url and how in j["read"]
    # A presigned URL's signature is not printed back.
    r = ferry("inspect", published[0] + "?X-Amz-Signature=topsecret")
    assert r.returncode == 0, r.stderr
    assert "topsecret" not in r.stdout and r.stdout.startswith("file       %s\n" % published[0])
    local = os.path.join(remote["root"], urllib.parse.unquote(
        published[0][len(remote["http"]) + 1:]))
    r = ferry("inspect", local)
    read = [line for line in r.stdout.splitlines() if line.startswith("read ")][0]
    assert read.split(None, 1)[1].startswith(("mmap (local file system", "pread ("))


@needs_ferry
def test_cli_verify_and_bench(published):
    for url in published:
        r = ferry("verify", url)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(url + ": OK: footer and 2 tensors"), r.stdout
        r = ferry("bench", "--repeat", "1", url)
        assert r.returncode == 0, r.stderr
        assert "summary" in r.stdout
        assert "\nread        %s range GETs" % ("S3" if url.startswith("s3") else "HTTP") \
            in r.stdout
        r = ferry("bench", "--cold", url)
        assert r.returncode == 2
        assert "is read from its server on every load" in r.stderr


@needs_ferry
def test_cli_convert_both_ways(remote, published, tmp_path):
    import safetensors.numpy
    # TensorFerry on S3 -> safetensors on S3 -> TensorFerry on S3 (planes), and a remote
    # .safetensors to a local file.
    key = "py/%d/conv" % os.getpid()
    st_url = s3_url(remote, key + ".safetensors")
    r = ferry("convert", published[1], st_url)
    assert r.returncode == 0, r.stderr
    assert "-> %s (safetensors)" % st_url in r.stdout
    local = tmp_path / "back.safetensors"
    assert ferry("convert", st_url, str(local)).returncode == 0
    loaded = safetensors.numpy.load_file(str(local))
    for k in TENSORS:
        np.testing.assert_array_equal(loaded[k], TENSORS[k])
    ferry_url = s3_url(remote, key + ".ferry")
    r = ferry("convert", "--encoding", "zstd", st_url, ferry_url)
    assert r.returncode == 0, r.stderr
    expect_tensors(tfn.load_file(ferry_url, verify=True))
    r = ferry("convert", published[0], http_url(remote, "py/out.ferry"))
    assert r.returncode != 0
    assert "only s3:// destinations take uploads" in r.stderr
