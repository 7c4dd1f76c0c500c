// Hand-assembled pickles, stored zip archives, torch.save archives and DCP folders, for the
// torch import tests (torch_import_test.cc) and fuzz targets (fuzz/fuzz_entries.hpp), which
// run without torch and without Python.
#ifndef FERRY_TESTS_TORCH_BUILDERS_HPP_
#define FERRY_TESTS_TORCH_BUILDERS_HPP_

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ferry::torch_test {

inline void PutLE(std::string* out, uint64_t v, int n) {
  for (int k = 0; k < n; ++k) out->push_back(static_cast<char>((v >> (8 * k)) & 0xFF));
}

// A protocol 2 pickle, opcode by opcode. Done() appends STOP.
class Pickle {
 public:
  Pickle() : s_("\x80\x02") {}
  Pickle& Op(char op) {
    s_ += op;
    return *this;
  }
  Pickle& Str(std::string_view v) {
    s_ += 'X';
    PutLE(&s_, v.size(), 4);
    s_ += v;
    return *this;
  }
  Pickle& Bytes(std::string_view v) {
    s_ += 'B';
    PutLE(&s_, v.size(), 4);
    s_ += v;
    return *this;
  }
  Pickle& Int(int64_t v) {
    s_ += '\x8a';  // LONG1 of 8 bytes: any int64
    s_ += '\x08';
    PutLE(&s_, static_cast<uint64_t>(v), 8);
    return *this;
  }
  Pickle& Global(std::string_view module, std::string_view name) {
    s_ += 'c';
    s_ += module;
    s_ += '\n';
    s_ += name;
    s_ += '\n';
    return *this;
  }
  Pickle& Put(uint32_t n) {
    s_ += 'r';
    PutLE(&s_, n, 4);
    return *this;
  }
  Pickle& Get(uint32_t n) {
    s_ += 'j';
    PutLE(&s_, n, 4);
    return *this;
  }
  Pickle& Mark() { return Op('('); }
  Pickle& Tuple() { return Op('t'); }
  Pickle& List() { return Op('l'); }
  Pickle& Dict() { return Op('d'); }
  Pickle& Reduce() { return Op('R'); }
  Pickle& Pop() { return Op('0'); }
  // (a, b, ...) of ints.
  Pickle& Ints(const std::vector<int64_t>& v) {
    Mark();
    for (int64_t x : v) Int(x);
    return Tuple();
  }
  // A record-only object: NEWOBJ of `module.cls` with no arguments, then BUILD with a dict of
  // the fields, each written by its function.
  using Fields = std::vector<std::pair<std::string, std::function<void(Pickle&)>>>;
  Pickle& Object(std::string_view module, std::string_view cls, const Fields& fields) {
    Global(module, cls).Op(')').Op('\x81').Mark();
    for (const auto& [k, write] : fields) {
      Str(k);
      write(*this);
    }
    return Dict().Op('b');
  }
  // torch._utils._rebuild_tensor_v2(<storage `key` of float32 `numel`>, offset, size, stride,
  // False, OrderedDict()).
  Pickle& Tensor(std::string_view key, int64_t numel, int64_t offset,
                 const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                 std::string_view storage_class = "FloatStorage") {
    Global("torch._utils", "_rebuild_tensor_v2").Mark();
    Mark().Str("storage").Global("torch", storage_class).Str(key).Str("cpu").Int(numel).Tuple();
    Op('Q').Int(offset).Ints(size).Ints(stride).Op('\x89');
    Global("collections", "OrderedDict").Op(')').Reduce();
    return Tuple().Reduce();
  }
  const std::string& bytes() const { return s_; }
  std::string Done() const { return s_ + "."; }

 private:
  std::string s_;
};

// A zip archive of stored (uncompressed) entries, as torch.save writes them.
inline std::string StoredZip(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out, dir;
  for (const auto& [name, data] : entries) {
    const uint64_t local = out.size();
    PutLE(&out, 0x04034b50, 4);
    PutLE(&out, 20, 2);  // version needed
    PutLE(&out, 0, 2);   // flags
    PutLE(&out, 0, 2);   // method: stored
    PutLE(&out, 0, 4);   // time, date
    PutLE(&out, 0, 4);   // crc (not checked by the reader)
    PutLE(&out, data.size(), 4);
    PutLE(&out, data.size(), 4);
    PutLE(&out, name.size(), 2);
    PutLE(&out, 0, 2);
    out += name;
    out += data;
    PutLE(&dir, 0x02014b50, 4);
    PutLE(&dir, 20, 2);
    PutLE(&dir, 20, 2);
    PutLE(&dir, 0, 2);
    PutLE(&dir, 0, 2);
    PutLE(&dir, 0, 4);
    PutLE(&dir, 0, 4);
    PutLE(&dir, data.size(), 4);
    PutLE(&dir, data.size(), 4);
    PutLE(&dir, name.size(), 2);
    PutLE(&dir, 0, 2);  // extra
    PutLE(&dir, 0, 2);  // comment
    PutLE(&dir, 0, 2);  // disk
    PutLE(&dir, 0, 2);  // internal attributes
    PutLE(&dir, 0, 4);  // external attributes
    PutLE(&dir, local, 4);
    dir += name;
  }
  const uint64_t cd_offset = out.size();
  out += dir;
  PutLE(&out, 0x06054b50, 4);
  PutLE(&out, 0, 4);  // disks
  PutLE(&out, entries.size(), 2);
  PutLE(&out, entries.size(), 2);
  PutLE(&out, dir.size(), 4);
  PutLE(&out, cd_offset, 4);
  PutLE(&out, 0, 2);  // comment
  return out;
}

// A torch.save archive: "archive/data.pkl", "archive/byteorder" and "archive/data/<key>".
inline std::string TorchSave(const std::string& pickle,
                             const std::vector<std::pair<std::string, std::string>>& storages) {
  std::vector<std::pair<std::string, std::string>> entries{{"archive/data.pkl", pickle},
                                                           {"archive/byteorder", "little"}};
  for (const auto& [key, data] : storages) entries.emplace_back("archive/data/" + key, data);
  return StoredZip(entries);
}

// `n` float32 values 0, 1, 2, ... as storage bytes.
inline std::string FloatBytes(size_t n) {
  std::string out(4 * n, '\0');
  for (size_t i = 0; i < n; ++i) {
    float f = static_cast<float>(i);
    std::memcpy(out.data() + 4 * i, &f, 4);
  }
  return out;
}

// DCP .metadata of tensors saved in chunks: for each tensor, its global size and its chunks
// (offsets, sizes, and where the chunk's torch.save archive lies in data file `file`).
struct DcpChunk {
  std::vector<int64_t> offsets, sizes;
  std::string file;
  int64_t offset = 0, length = 0;
};
struct DcpTensor {
  std::string fqn;
  std::vector<int64_t> size;
  std::vector<DcpChunk> chunks;
};
inline std::string DcpMetadata(const std::vector<DcpTensor>& tensors) {
  constexpr const char* kMeta = "torch.distributed.checkpoint.metadata";
  Pickle p;
  auto sdm = [&](Pickle& q) {
    q.Mark();
    for (const DcpTensor& t : tensors) {
      q.Str(t.fqn).Object(kMeta, "TensorStorageMetadata",
                          {{"size", [&](Pickle& r) { r.Ints(t.size); }},
                           {"chunks", [&](Pickle& r) {
                              r.Mark();
                              for (const DcpChunk& c : t.chunks) {
                                r.Object(kMeta, "ChunkStorageMetadata",
                                         {{"offsets", [&](Pickle& u) { u.Ints(c.offsets); }},
                                          {"sizes", [&](Pickle& u) { u.Ints(c.sizes); }}});
                              }
                              r.List();
                            }}});
    }
    q.Dict();
  };
  auto storage = [&](Pickle& q) {
    q.Mark();
    for (const DcpTensor& t : tensors) {
      for (const DcpChunk& c : t.chunks) {
        q.Object(kMeta, "MetadataIndex",
                 {{"fqn", [&](Pickle& r) { r.Str(t.fqn); }},
                  {"offset", [&](Pickle& r) { r.Ints(c.offsets); }}});
        q.Object("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                 {{"relative_path", [&](Pickle& r) { r.Str(c.file); }},
                  {"offset", [&](Pickle& r) { r.Int(c.offset); }},
                  {"length", [&](Pickle& r) { r.Int(c.length); }}});
      }
    }
    q.Dict();
  };
  p.Object(kMeta, "Metadata", {{"state_dict_metadata", sdm}, {"storage_data", storage}});
  return p.Done();
}

}  // namespace ferry::torch_test

#endif  // FERRY_TESTS_TORCH_BUILDERS_HPP_
