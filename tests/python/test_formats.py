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


DATA = os.path.join(HERE, "..", "data")
_CONVERT = "convert it with `ferry convert {} out.ferry` (Python: tensorferry.convert)"


@pytest.mark.parametrize("fixture,name,looks", [
    ("torch/dtypes.pt", "model.pt",
     "looks like a PyTorch checkpoint (a zip archive, as torch.save writes): " + _CONVERT),
    ("torch/pytorch_model.bin", "pytorch_model.bin",
     "looks like a PyTorch checkpoint (a zip archive, as torch.save writes): " + _CONVERT),
    ("torch/legacy.pt", "legacy.pt",
     "looks like a PyTorch checkpoint in torch.save's legacy format, which TensorFerry does "
     "not read: load it with torch.load and save it with tensorferry.torch.save_state_dict (or "
     "again with a current torch.save)"),
    ("torch/pytorch_model.bin.index.json", "index.json",
     "looks like the index of a sharded checkpoint (JSON with a weight_map): open it as one "
     "(ShardedCheckpoint::Open, ferry_sharded_open, tensorferry.distributed.open_checkpoint) or "
     "merge its shards into one file with `ferry convert {} out.ferry`"),
    ("safetensors/make_fixtures.py", "notes.txt", "looks like a text file, not a checkpoint"),
])
def test_a_foreign_file_says_what_it_is_and_how_to_convert_it(tmp_path, fixture, name, looks):
    path = str(tmp_path / name)
    with open(os.path.join(DATA, fixture), "rb") as f, open(path, "wb") as out:
        out.write(f.read())
    want = path + ": not a TensorFerry checkpoint: it " + looks.format(path)
    for opener in (tf.Reader, tf.load_file):
        with pytest.raises(tf.InvalidArgumentError) as e:
            opener(path)
        assert str(e.value) == want
        assert isinstance(e.value, ValueError)
    # What the hint says works: the PyTorch files convert.
    if "`ferry convert" in looks and "index" not in name:
        tf.convert(path, str(tmp_path / "out.ferry"))
        assert len(tf.load_file(str(tmp_path / "out.ferry"))) > 0


def test_a_broken_safetensors_file_is_data_loss_that_says_so(tmp_path):
    path = str(tmp_path / "cut.safetensors")
    with open(path, "wb") as f:
        f.write(b"\xff" + b"\0" * 7 + b'  {"a": {"dtype": "F32", "shape": [1], "data_offsets":')
    with pytest.raises(tf.DataLossError) as e:
        tf.load_file(path)
    assert str(e.value) == (path + ": not a TensorFerry checkpoint: it looks like a safetensors "
                            "file whose header length does not fit the file (truncated or "
                            "damaged)")
