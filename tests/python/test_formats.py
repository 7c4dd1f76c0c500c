"""Names a caller gives: the output format of a conversion (``to=`` or the extension, never a
default for an unknown name) and the spellings of encodings (``shuffle+zstd`` and
``shuffle_zstd`` both taken, one printed)."""

import os

import numpy as np
import pytest

import tensorferry as tf

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_BIN = os.path.join(HERE, "..", "data", "torch", "pytorch_model.bin")


@pytest.fixture
def src(tmp_path):
    path = str(tmp_path / "src.ferry")
    tf.save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, path)
    return path


@pytest.mark.parametrize("name", ["out.pt", "pytorch_model.bin", "model.safetensor", "model"])
def test_convert_refuses_a_name_that_says_no_format(tmp_path, src, name):
    for source in (src, TORCH_BIN):
        dst = str(tmp_path / name)
        with pytest.raises(tf.InvalidArgumentError) as e:
            tf.convert(source, dst)
        assert dst + ": cannot tell which format to write" in str(e.value)
        assert 'to="ferry"' in str(e.value)
        assert not os.path.exists(dst)


def test_convert_to_names_the_format(tmp_path, src):
    dst = str(tmp_path / "out.pt")
    tf.convert(src, dst, to="ferry")
    np.testing.assert_array_equal(tf.load_file(dst)["w"], tf.load_file(src)["w"])
    st = str(tmp_path / "weights.st")
    tf.convert(TORCH_BIN, st, to="safetensors")
    with open(st, "rb") as f:
        assert f.read(9)[8:9] == b"{"  # a safetensors header, not TensorFerry's magic
    with pytest.raises(tf.InvalidArgumentError, match="the name says safetensors"):
        tf.convert(src, str(tmp_path / "x.safetensors"), to="ferry")
    with pytest.raises(tf.InvalidArgumentError, match="unknown output format 'pickle'"):
        tf.convert(src, str(tmp_path / "x.ferry"), to="pickle")


@pytest.mark.parametrize("spelling", ["shuffle+zstd", "shuffle_zstd"])
def test_both_spellings_of_shuffle_zstd(tmp_path, src, spelling):
    w = np.linspace(0, 1, 4096, dtype=np.float32)
    path = str(tmp_path / "s.ferry")
    tf.save_file({"w": w}, path, encoding=spelling)
    with tf.safe_open(path) as f:
        assert f.info("w").encoding == "shuffle+zstd"  # one spelling printed
    np.testing.assert_array_equal(tf.load_file(path)["w"], w)
    out = str(tmp_path / "c.ferry")
    tf.convert(src, out, encoding=spelling)
    with tf.safe_open(out) as f:
        assert f.info("w").encoding == "shuffle+zstd"


def test_unknown_encoding_lists_the_names(tmp_path, src):
    for call in (lambda: tf.save_file({"w": np.zeros(2)}, str(tmp_path / "a.ferry"),
                                      encoding="lz4"),
                 lambda: tf.convert(src, str(tmp_path / "b.ferry"), encoding="lz4")):
        with pytest.raises(ValueError, match=r"'shuffle\+zstd' \(or 'shuffle_zstd'\)"):
            call()
    assert sorted(os.listdir(str(tmp_path))) == ["src.ferry"]
