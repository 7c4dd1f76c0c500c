"""The remote-storage test servers (tests/servers/servers.py) as a pytest fixture: one set for
the module, stopped at its end. The Python entry points' own s3:// and http(s):// tests use the
same fixture; here it is checked against independent clients (boto3, urllib), so a broken
server is not mistaken for a broken TensorFerry."""
import json
import os
import ssl
import sys
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "servers"))
import servers as test_servers  # noqa: E402


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    with test_servers.Servers(tmp_path_factory.mktemp("servers")) as s:
        yield s.info


def get(url, rng=None, context=None, headers=None):
    req = urllib.request.Request(url, headers=dict(headers or {}, **({"Range": rng} if rng else {})))
    with urllib.request.urlopen(req, context=context, timeout=30) as r:
        return r.status, dict(r.headers), r.read()


def test_nginx_serves_ranges_over_http_and_https(remote):
    if "nginx" in remote["missing"]:
        pytest.skip(remote["missing"]["nginx"])
    expect = test_servers.seed_bytes("seed/large.bin", remote["seed"]["seed/large.bin"])
    status, headers, body = get(remote["http"] + "/seed/large.bin", "bytes=100-199")
    assert status == 206 and body == expect[100:200]
    assert headers["Content-Range"] == "bytes 100-199/%d" % len(expect)
    ctx = ssl.create_default_context(cafile=remote["ca"])
    status, _, body = get(remote["https"] + "/seed/large.bin", "bytes=-10", context=ctx)
    assert status == 206 and body == expect[-10:]
    with pytest.raises(urllib.error.URLError):  # the test CA is not the system's
        get(remote["https"] + "/seed/large.bin", "bytes=0-1",
            context=ssl.create_default_context())


def test_moto_holds_the_seed_and_checks_signatures(remote):
    if "moto" in remote["missing"]:
        pytest.skip(remote["missing"]["moto"])
    import boto3
    import botocore.exceptions
    s3 = remote["s3"]

    def client(secret):
        return boto3.client("s3", endpoint_url=s3["endpoint"], region_name=s3["region"],
                            aws_access_key_id=s3["access_key_id"], aws_secret_access_key=secret)

    for name, size in remote["seed"].items():
        body = client(s3["secret_access_key"]).get_object(Bucket=s3["bucket"], Key=name)["Body"]
        assert body.read() == test_servers.seed_bytes(name, size)
    with pytest.raises(botocore.exceptions.ClientError, match="SignatureDoesNotMatch"):
        client("wrong").get_object(Bucket=s3["bucket"], Key="seed/one.bin")


def test_the_fault_server_injects_then_serves(remote):
    url = remote["fault"] + "/pytest/status503/1/seed/small.bin"
    with pytest.raises(urllib.error.HTTPError) as e:
        get(url, "bytes=0-9")
    assert e.value.code == 503
    status, headers, body = get(url, "bytes=0-9")
    assert status == 206 and body == test_servers.seed_bytes("seed/small.bin", 100_000)[:10]
    with pytest.raises(urllib.error.HTTPError) as e:
        get(url, "bytes=0-9", headers={"If-Match": '"stale"'})
    assert e.value.code == 412
    _, _, log = get(remote["fault"] + "/_ranges/pytest/status503/1/seed/small.bin")
    assert json.loads(log) == ["bytes=0-9"] * 3
