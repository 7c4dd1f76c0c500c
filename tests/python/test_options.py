"""Every C++ option reaches C and Python: the option structs are parsed from the headers, and a
field of LoaderOptions, WriterOptions or ReaderOptions without a C field (in ferry.h, in the
ctypes mirror and read by the C API in src/capi/) or a Python keyword fails here."""

import ctypes
import inspect
import os
import re

import pytest

import tensorferry
from tensorferry import _lib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

# C++ struct -> (its header, the C struct, the ctypes mirror, the Python entry point, renames
# {C++ field: Python keyword}). C fields carry the C++ names.
OPTIONS = {
    "LoaderOptions": ("include/ferry/loader.hpp", "ferry_loader_options_t",
                      _lib.LoaderOptions, tensorferry.Loader.__init__, {}),
    "WriterOptions": ("include/ferry/ferry.hpp", "ferry_writer_options_t",
                      _lib.WriterOptions, tensorferry.save_file, {}),
    "ReaderOptions": ("include/ferry/ferry.hpp", "ferry_reader_options_t",
                      _lib.ReaderOptions, tensorferry.Reader.__init__,
                      {"verify_on_open": "verify", "storage": "storage_options"}),
}

# C++ fields that are structs of their own: C spells out their fields in the outer C struct;
# Python takes them as one dict keyword (the renames above), each of its keys checked below.
NESTED = {"storage": ("include/ferry/ferry.hpp", "StorageOptions")}

_FUNCTION_POINTER = re.compile(r"^\s*[\w\s*]+\(\s*\*\s*(\w+)\s*\)\s*\(")
_FIELD = re.compile(r"^\s*(?:[\w:<>*]+\s+)+\**(\w+)\s*(?:=[^;]*)?;")


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _fields(text, opening, closing):
    start = text.index(opening)
    body = text[start + len(opening):text.index(closing, start)]
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = []
    for line in body.splitlines():
        line = re.sub(r"//.*", "", line)
        # Callbacks: a C function pointer, int32_t (*name)(...); or a C++ std::function<...> name;
        pointer = _FUNCTION_POINTER.match(line)
        if pointer:
            names.append(pointer.group(1))
            continue
        line = re.sub(r"std::function<.*>", "std::function", line)
        m = _FIELD.match(line)
        if m and "(" not in line:
            names.append(m.group(1))
    return names


def cpp_fields(name):
    return _fields(_read(OPTIONS[name][0]), "struct %s {" % name, "\n};")


def c_fields(cname):
    fields = _fields(_read("include/ferry/ferry.h"), "typedef struct %s {" % cname,
                     "} %s;" % cname)
    assert fields[0] == "struct_size"
    return fields[1:]


def test_the_parser_sees_every_field():
    # A parser that found nothing would pass everything below.
    assert "slot_bytes" in cpp_fields("LoaderOptions")
    assert "producer" in cpp_fields("WriterOptions")
    assert "progress" in cpp_fields("WriterOptions")
    assert {"progress", "progress_user"} <= set(c_fields("ferry_writer_options_t"))
    assert len(cpp_fields("LoaderOptions")) >= 9
    assert "io" in c_fields("ferry_loader_options_t")


def cpp_fields_flat(name):
    """cpp_fields with each nested struct's fields in place of its own name."""
    out = []
    for field in cpp_fields(name):
        if field in NESTED:
            header, struct = NESTED[field]
            out += _fields(_read(header), "struct %s {" % struct, "\n};")
        else:
            out.append(field)
    return out


def test_every_cpp_option_has_a_c_field():
    assert {"ca_bundle", "max_in_flight"} <= set(cpp_fields_flat("ReaderOptions"))
    for name, (_, cname, _, _, _) in OPTIONS.items():
        missing = set(cpp_fields_flat(name)) - set(c_fields(cname))
        assert not missing, "%s fields without a %s field: %s" % (name, cname, sorted(missing))


def test_c_api_reads_every_c_field():
    capi = os.path.join(ROOT, "src", "capi")
    c_api = "".join(_read(os.path.join("src", "capi", f))
                    for f in sorted(os.listdir(capi)) if f.endswith(".cc"))
    for _, (_, cname, _, _, _) in OPTIONS.items():
        for field in c_fields(cname):
            assert "FERRY_C_HAS(options, %s)" % field in c_api, "%s.%s" % (cname, field)


def test_ctypes_mirrors_the_c_structs():
    for _, (_, cname, mirror, _, _) in OPTIONS.items():
        names = [f[0] for f in mirror._fields_]
        assert names == ["struct_size"] + c_fields(cname), cname


# The other C structs Python mirrors (each once), field by field and size by size.
MIRRORS = {
    "ferry_tensor_record_t": _lib.TensorRecord,
    "ferry_tensor_table_t": _lib.TensorTable,
    "ferry_sharded_save_options_t": _lib.ShardedSaveOptions,
    "ferry_dist_plan_options_t": _lib.DistPlanOptions,
    "ferry_dist_item_t": _lib.DistItem,
    "ferry_dist_broadcast_t": _lib.DistBroadcast,
    "ferry_dist_read_t": _lib.DistRead,
    "ferry_dist_plan_view_t": _lib.DistPlanView,
}


def test_ctypes_mirrors_the_other_c_structs():
    header = _read("include/ferry/ferry.h")
    for cname, mirror in MIRRORS.items():
        names = [f[0] for f in mirror._fields_]
        assert names == _fields(header, "typedef struct %s {" % cname, "} %s;" % cname), cname
    assert ctypes.sizeof(_lib.TensorRecord) == 80  # eight uint64, four int32


def test_every_cpp_option_has_a_python_keyword():
    for name, (_, _, _, entry, renames) in OPTIONS.items():
        params = set(inspect.signature(entry).parameters)
        wanted = {renames.get(f, f) for f in cpp_fields(name)}
        missing = wanted - params
        assert not missing, "%s fields without a Python keyword: %s" % (name, sorted(missing))
    # Every field of a nested struct is a key of its dict keyword.
    for field, (header, struct) in NESTED.items():
        keys = set(_fields(_read(header), "struct %s {" % struct, "\n};"))
        assert keys == set(tensorferry._STORAGE_OPTIONS), struct


def test_loader_keywords_reach_the_library():
    # Each keyword is passed on: a bad value is refused by the library's own check.
    with pytest.raises(tensorferry.InvalidArgumentError, match="LoaderOptions.slot_bytes 1000"):
        tensorferry.Loader(slot_bytes=1000)
    with pytest.raises(tensorferry.InvalidArgumentError, match="LoaderOptions.slot_bytes 1000"):
        tensorferry.Loader(chunk_bytes=1000)  # the former name
    with pytest.raises(tensorferry.InvalidArgumentError, match="staging_bytes 8192"):
        tensorferry.Loader(staging_bytes=8192, slot_bytes=8192)
    for field in ("io", "host_path", "pinned_alloc"):
        with pytest.raises(ValueError, match=field):
            tensorferry.Loader(**{field: "bogus"})
    tensorferry.Loader(host_path="register_windows", pinned_alloc="host_alloc",
                       register_window_bytes=1 << 20, streaming_stores=True).close()


def test_save_file_min_savings(tmp_path):
    np = pytest.importorskip("numpy")
    data = {"x": (np.arange(4096) % 16).astype(np.float32)}
    # Compression saves well under 99.9%: every block is stored raw, so the stored size is
    # the raw size; with the default the same tensor compresses.
    tensorferry.save_file(data, str(tmp_path / "a.ferry"), encoding="zstd", min_savings=0.999,
                          durable=False)
    tensorferry.save_file(data, str(tmp_path / "b.ferry"), encoding="zstd", durable=False)
    with tensorferry.Reader(str(tmp_path / "a.ferry")) as a, \
            tensorferry.Reader(str(tmp_path / "b.ferry")) as b:
        assert a.info("x").data_size == a.info("x").nbytes
        assert b.info("x").data_size < b.info("x").nbytes
