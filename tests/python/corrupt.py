"""Damage to a checkpoint's tensor data, for the tests of verification by default."""
import tensorferry as tf


def flip_data_byte(path, name, at):
    """Flips byte `at` of tensor `name`'s stored data (not the footer) in place."""
    with tf.Reader(path) as r:
        offset = r.info(name).data_offset
    with open(path, "r+b") as f:
        f.seek(offset + at)
        b = f.read(1)
        f.seek(offset + at)
        f.write(bytes([b[0] ^ 0x20]))
