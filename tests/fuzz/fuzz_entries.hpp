// The bodies of the libFuzzer targets, shared with tests/fuzz_regression_test.cc so that every
// input a fuzzer ever found is replayed through exactly the same calls by the normal suite.
//
// Each entry returns the first error Status it met (or OK). An input may be rejected, but only
// with a clean Status: a known code other than Internal and a message that names the file.
// Anything else (a crash, a sanitizer report, a broken invariant) aborts.
#ifndef FERRY_TESTS_FUZZ_FUZZ_ENTRIES_HPP_
#define FERRY_TESTS_FUZZ_FUZZ_ENTRIES_HPP_

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "../torch_builders.hpp"
#include "codec/codec.hpp"
#include "codec/planes.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "format/footer.hpp"
#include "format/format.hpp"
#include "format/safetensors.hpp"
#include "import/torch/te_extra_state.hpp"
#include "import/torch/torch_checkpoint.hpp"
#include "import/torch/unpickle.hpp"
#include "import/torch/zip.hpp"

namespace ferry::fuzz {

// Tensors larger than this are listed but not read: a footer may legitimately declare a
// terabyte tensor of compressed chunks, and allocating it would only measure the allocator.
inline constexpr uint64_t kMaxTensorBytes = uint64_t{16} << 20;
inline constexpr uint64_t kMaxTotalBytes = uint64_t{64} << 20;
// Raw size cap of the chunk decompression target.
inline constexpr uint32_t kMaxChunkBytes = uint32_t{4} << 20;

[[noreturn]] inline void Broken(const char* what, const std::string& detail = {}) {
  std::fprintf(stderr, "fuzz invariant broken: %s %s\n", what, detail.c_str());
  std::abort();
}

inline void Expect(bool cond, const char* what, const std::string& detail = {}) {
  if (!cond) Broken(what, detail);
}

// An error must be a user-facing one; Internal means a bug, and an unnamed file is useless to
// whoever has to find the bad checkpoint among thousands.
inline Status Clean(Status st, const std::string& path) {
  if (st.ok()) return st;
  Expect(st.code() != StatusCode::kInternal, "Internal status", st.ToString());
  Expect(!st.message().empty(), "empty error message");
  if (!path.empty()) {
    Expect(st.message().find(path) != std::string::npos, "message does not name the file",
           st.ToString());
  }
  return st;
}

inline uint64_t LoadU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// A fuzzer cannot forge XXH3: rewrite the trailer's footer checksum so mutated footers reach
// the FlatBuffers verifier and the semantic checks behind it.
inline void FixFooterChecksum(std::vector<uint8_t>& file) {
  const uint64_t n = file.size();
  if (n < format::kMagicSize + format::kTrailerSize) return;
  uint64_t footer_size = LoadU64(file.data() + n - format::kTrailerSize);
  uint64_t room = n - format::kTrailerSize - format::kMagicSize;
  if (footer_size > room) return;
  uint64_t sum = Checksum64(file.data() + n - format::kTrailerSize - footer_size, footer_size);
  std::memcpy(file.data() + n - 16, &sum, 8);
}

// ---- footer: trailer, checksum, verifier and semantic validation --------------------------

inline Status FooterOnce(const uint8_t* file, size_t size, const std::string& path) {
  auto loc = LocateFooter(file, size, path);
  if (!loc.ok()) return Clean(loc.status(), path);
  Expect(loc->offset >= format::kMagicSize && loc->offset + loc->size <= size,
         "footer location outside the file");
  // As Reader::Open: the footer is parsed from an 8-byte aligned copy.
  std::vector<uint64_t> copy((loc->size + 7) / 8);
  std::memcpy(copy.data(), file + loc->offset, loc->size);
  auto ck =
      ParseFooter(reinterpret_cast<const uint8_t*>(copy.data()), loc->size, loc->offset, path);
  if (!ck.ok()) return Clean(ck.status(), path);
  // Everything validated must be readable without surprises.
  const auto* tensors = (*ck)->tensors();
  for (flatbuffers::uoffset_t i = 0; tensors && i < tensors->size(); ++i) {
    const fb::Tensor* t = tensors->Get(i);
    Expect(t->data_offset() + t->data_size() <= loc->offset, "tensor extent past data end");
  }
  return Status::Ok();
}

inline Status FuzzFooter(const uint8_t* data, size_t size) {
  const std::string path = "fuzz-footer.ferry";
  // The input as it is (exercises the checksum check), then with the checksum made right.
  Status raw = FooterOnce(data, size, path);
  std::vector<uint8_t> file(data, data + size);
  FixFooterChecksum(file);
  Status fixed = FooterOnce(file.data(), file.size(), path);
  return fixed.ok() ? raw : fixed;
}

// ---- full host load: Reader::Open, View, ReadInto, ReadRowsInto, Verify, LoadToHost -------

// A scratch directory reused across inputs (a fuzzer runs millions of them); each write
// replaces its file (a fresh inode each time, as a new checkpoint would be).
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry_fuzz_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) Broken("mkdtemp");
    dir_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string Write(const std::string& name, const uint8_t* data, size_t size) {
    const std::string path = dir_ + "/" + name;
    ::unlink(path.c_str());
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) Broken("open scratch file");
    for (size_t done = 0; done < size;) {
      ssize_t w = ::write(fd, data + done, size - done);
      if (w <= 0) Broken("write scratch file");
      done += static_cast<size_t>(w);
    }
    ::close(fd);
    return path;
  }
  const std::string& path() const { return dir_; }

 private:
  std::string dir_;
};

// One scratch file in its own directory.
class ScratchFile {
 public:
  const std::string& Write(const uint8_t* data, size_t size) {
    path_ = dir_.Write("input.ferry", data, size);
    return path_;
  }

 private:
  ScratchDir dir_;
  std::string path_;
};

inline Loader& HostLoader(IoMode io) {
  auto make = [](IoMode mode) {
    LoaderOptions o;
    o.threads = 1;
    o.io = mode;
    o.verify = true;
    o.slot_bytes = 64 << 10;
    o.staging_bytes = 128 << 10;
    auto l = Loader::Create(o);
    if (!l.ok()) Broken("Loader::Create", l.status().ToString());
    return std::move(*l);
  };
  static std::unique_ptr<Loader> page = make(IoMode::kPageCache);
  static std::unique_ptr<Loader> direct = make(IoMode::kDirect);
  return io == IoMode::kDirect ? *direct : *page;
}

inline Status LoadFile(const std::string& path, IoMode io) {
  auto opened = Reader::Open(path);
  if (!opened.ok()) return Clean(opened.status(), path);
  const Reader& r = **opened;
  Status first;
  auto note = [&](Status st) {
    Clean(st, path);
    if (first.ok()) first = std::move(st);
  };
  (void)r.metadata();
  (void)r.quantized();
  (void)r.scaling_states();
  (void)r.producer();
  std::vector<LoadRequest> requests;
  std::vector<std::vector<uint8_t>> plain;
  uint64_t total = 0;
  for (size_t i = 0; i < r.num_tensors(); ++i) {
    TensorInfo info = r.tensor(i);
    auto found = r.Find(info.name);
    Expect(found.ok() && found->index == i, "Find of a listed name", info.name);
    if (info.nbytes > kMaxTensorBytes || total + info.nbytes > kMaxTotalBytes) continue;
    total += info.nbytes;
    // One spare byte keeps data() non-null and catches writes past the tensor.
    std::vector<uint8_t> out(info.nbytes + 1, 0xA5), checked(info.nbytes + 1, 0x5A);
    Status st = r.ReadInto(info.name, out.data(), info.nbytes);
    Expect(out[info.nbytes] == 0xA5, "ReadInto wrote past the tensor", info.name);
    note(st);
    Status vst = r.ReadInto(info.name, checked.data(), info.nbytes, {true});
    note(vst);
    if (st.ok() && vst.ok()) {
      Expect(std::memcmp(out.data(), checked.data(), info.nbytes) == 0,
             "verified and unverified reads differ", info.name);
    }
    note(r.Verify(info.name));
    if (info.encoding == Encoding::kRaw) {
      auto view = r.View(info.name);
      note(view.status());
      if (view.ok() && st.ok() && info.nbytes > 0) {
        Expect(std::memcmp(view->data, out.data(), info.nbytes) == 0, "view differs", info.name);
      }
    }
    if (!info.shape.empty() && info.shape[0] > 1) {
      int64_t rows = info.shape[0];
      std::vector<uint8_t> part(info.nbytes + 1);
      Status rst = r.ReadRowsInto(info.name, rows / 2, rows, part.data(), info.nbytes);
      if (!rst.ok()) Clean(rst, path);  // odd packed FP4 rows are a legitimate refusal
    }
    if (st.ok()) {
      plain.push_back(std::move(out));
      requests.push_back(LoadRequest{info.name});
    }
  }
  if (!requests.empty()) {
    auto loaded = HostLoader(io).LoadToHost(r, requests);
    note(loaded.status());
    if (loaded.ok()) {
      for (size_t k = 0; k < requests.size(); ++k) {
        const LoadedTensor& t = (*loaded)[k];
        Expect(t.info.name == requests[k].name && t.nbytes == plain[k].size() - 1,
               "LoadToHost answered a different request", requests[k].name);
        Expect(t.nbytes == 0 || std::memcmp(t.data, plain[k].data(), t.nbytes) == 0,
               "LoadToHost differs from ReadInto", requests[k].name);
      }
    }
  }
  return first;
}

inline Status FuzzLoad(const uint8_t* data, size_t size) {
  static ScratchFile scratch;
  std::vector<uint8_t> file(data, data + size);
  FixFooterChecksum(file);
  const std::string& path = scratch.Write(file.data(), file.size());
  // Direct I/O for a third of inputs (chosen by size, so each input always takes one path):
  // it reads chunks into its own buffers, a different route to the same decoder.
  return LoadFile(path, size % 3 == 0 ? IoMode::kDirect : IoMode::kPageCache);
}

// ---- chunk decompression and byte unshuffle ---------------------------------------------

// Input: u8 mode (bit 7: a stored chunk, else zstd; low bits: element width), u32 raw size
// (capped), then the chunk's bytes, as DecodeStored sees them.
inline Status FuzzChunk(const uint8_t* data, size_t size) {
  if (size < 5) return Status::Ok();
  const bool stored = (data[0] & 0x80) != 0;
  const size_t width = (data[0] & 0x7f) % 10;  // the shuffle's widths and some it passes through
  uint32_t raw;
  std::memcpy(&raw, data + 1, 4);
  raw %= kMaxChunkBytes + 1;
  const uint8_t* src = data + 5;
  const size_t n = size - 5;
  if (stored) raw = static_cast<uint32_t>(std::min<size_t>(raw, n));
  // Exactly sized heap buffers (plus one byte so data() is never null), so any write past
  // `raw` is an ASan report.
  std::unique_ptr<uint8_t[]> dst(new uint8_t[raw + 1]);
  std::unique_ptr<uint8_t[]> plain(new uint8_t[raw + 1]);
  std::unique_ptr<uint8_t[]> back(new uint8_t[raw + 1]);
  if (stored) {
    std::memcpy(dst.get(), src, raw);
  } else {
    Status st = ZstdDecompressExact(src, n, dst.get(), raw);
    if (!st.ok()) {
      Clean(st, "");
      Expect(st.code() == StatusCode::kDataLoss, "decompression error is not DataLoss",
             st.ToString());
      return st;
    }
  }
  Unshuffle(dst.get(), plain.get(), raw, width);
  Shuffle(plain.get(), back.get(), raw, width);
  Expect(std::memcmp(back.get(), dst.get(), raw) == 0, "shuffle does not invert unshuffle");
  // What decoded must survive a round trip through the writer's compressor.
  std::vector<uint8_t> frame(CompressBound(raw));
  auto csize = ZstdCompress(plain.get(), raw, frame.data(), frame.size(), 1);
  Expect(csize.ok(), "compression failed", csize.status().ToString());
  Status again = ZstdDecompressExact(frame.data(), *csize, back.get(), raw);
  Expect(again.ok() && std::memcmp(back.get(), plain.get(), raw) == 0, "round trip differs");
  return Status::Ok();
}

// ---- PLANES blocks ------------------------------------------------------------------------

// Input: u32 raw size (capped), then one stored PLANES block, as the CPU decoder sees it. A
// block that decodes must survive a round trip through the encoder.
inline Status FuzzPlanes(const uint8_t* data, size_t size) {
  if (size < 4) return Status::Ok();
  uint32_t raw;
  std::memcpy(&raw, data, 4);
  raw %= kMaxChunkBytes + 1;
  // The stored bytes in an exactly sized heap buffer: any read past them is an ASan report.
  const size_t n = size - 4;
  std::unique_ptr<uint8_t[]> src(new uint8_t[n + 1]);
  std::memcpy(src.get(), data + 4, n);
  std::unique_ptr<uint8_t[]> dst(new uint8_t[raw + 1]);
  std::unique_ptr<uint8_t[]> scratch(new uint8_t[raw + 1]);
  Status st = planes::Decode(src.get(), n, dst.get(), raw, scratch.get());
  if (!st.ok()) {
    Clean(st, "");
    Expect(st.code() == StatusCode::kDataLoss, "planes decode error is not DataLoss",
           st.ToString());
    return st;
  }
  planes::Layout l;
  Expect(planes::Parse(src.get(), n, raw, &l).ok(), "a decodable block does not parse");
  std::vector<uint8_t> enc(planes::Bound(raw)), again(raw + 1);
  size_t m = planes::Encode(dst.get(), raw, l.width, enc.data(), scratch.get(), -1);
  Expect(raw == 0 || m > 0, "re-encoding failed");
  if (m > 0) {
    Status back = planes::Decode(enc.data(), m, again.data(), raw, scratch.get());
    Expect(back.ok() && std::memcmp(again.data(), dst.get(), raw) == 0, "round trip differs",
           back.ToString());
  }
  return Status::Ok();
}

// ---- safetensors header -----------------------------------------------------------------

inline Status FuzzSafetensors(const uint8_t* data, size_t size) {
  const std::string path = "fuzz.safetensors";
  (void)LooksLikeSafetensors(data, size);
  std::vector<uint64_t> index;
  auto index_size = ParseSafetensors(data, size, path, &index);
  if (!index_size.ok()) return Clean(index_size.status(), path);
  Expect(*index_size <= index.size() * 8, "index size past its buffer");
  // As Reader::Open: the synthesized index passes the same validation as a footer.
  FooterRules rules;
  rules.checksums = false;
  rules.alignment = 1;
  auto ck =
      ParseFooter(reinterpret_cast<const uint8_t*>(index.data()), *index_size, size, path, rules);
  Expect(ck.ok(), "an accepted safetensors header gives an invalid index", ck.status().ToString());
  return Status::Ok();
}

// ---- PyTorch pickles and archives ---------------------------------------------------------

// Whatever a pickle built must be safe to use: every tensor's bytes are read (a tensor the
// interpreter accepted lies inside its storage), and every value is tried as
// TransformerEngine extra state.
inline void UseTorchValues(torch_import::Heap* heap, const torch_import::Value* root,
                           const std::string& path, uint64_t input_bytes) {
  torch_import::WalkBudget budget;  // as TorchCheckpoint's: proportional to the input
  budget.Grant(input_bytes);
  std::vector<const torch_import::Value*> todo{root};
  std::vector<uint8_t> buf;
  for (size_t k = 0; k < todo.size() && k < 4096; ++k) {
    const torch_import::Value* v = todo[k];
    if (v->is(torch_import::Value::Kind::kTensor)) {
      uint64_t n = torch_import::TensorBytes(*v->tensor);
      if (n <= kMaxTensorBytes) {
        buf.assign(n + 1, 0);
        Clean(torch_import::CopyTensorBytes(*v->tensor, 0, buf.data(), n, nullptr, path), path);
      }
    }
    std::vector<std::pair<std::string, std::string>> md;
    auto st = torch_import::DecodeExtraState(heap, v, "m", nullptr, path, &md, &budget);
    if (!st.ok()) Clean(st.status(), path);
    for (const auto* x : v->Elements()) todo.push_back(x);
    for (const auto& [a, b] : v->dict) todo.push_back(b);
    if (v->state != nullptr) todo.push_back(v->state);
  }
}

// A torch.save archive (starts "PK"), a legacy torch.save stream of one storage (as
// torch.storage._load_from_bytes holds), or a bare pickle.
inline Status FuzzUnpickle(const uint8_t* data, size_t size) {
  const std::string path = "fuzz.pt";
  torch_import::Heap heap;
  if (torch_import::LooksLikeZip(data, size)) {
    auto root = torch_import::LoadTorchZip(&heap, data, size, path);
    if (!root.ok()) return Clean(root.status(), path);
    UseTorchValues(&heap, *root, path, size);
    return Status::Ok();
  }
  if (torch_import::LooksLikeLegacyTorch(data, size)) {
    auto st = torch_import::ParseLegacyStorage(&heap, data, size, path);
    if (!st.ok()) return Clean(st.status(), path);
    Expect((*st)->data >= data && (*st)->data + (*st)->nbytes <= data + size,
           "legacy storage outside its stream");
    return Status::Ok();
  }
  torch_import::UnpickleOptions o;
  o.where = path;
  auto root = torch_import::Unpickle(&heap, data, size, o);
  if (!root.ok()) return Clean(root.status(), path);
  UseTorchValues(&heap, *root, path, size);
  return Status::Ok();
}

// ---- whole PyTorch checkpoints: the walk and DCP folders -----------------------------------

// Splits `u32 n, n bytes` off the front of [*data, *data + *size); short inputs give what is
// there.
inline std::string TakeFramed(const uint8_t** data, size_t* size) {
  if (*size < 4) {
    *data += *size;
    *size = 0;
    return {};
  }
  uint32_t n;
  std::memcpy(&n, *data, 4);
  n = static_cast<uint32_t>(std::min<size_t>(n, *size - 4));
  std::string out(reinterpret_cast<const char*>(*data + 4), n);
  *data += 4 + n;
  *size -= 4 + n;
  return out;
}

// What an opened checkpoint promises: unique names, sizes that agree with shapes, every
// tensor (up to kMaxTensorBytes) readable whole, scaling tables of the declared shape.
inline Status UseCheckpoint(const torch_import::TorchCheckpoint& ck, const std::string& path) {
  std::set<std::string> names;
  std::vector<uint8_t> buf;
  Status first;
  for (const torch_import::ImportedTensor& t : ck.tensors()) {
    Expect(names.insert(t.name).second, "a name imported twice", t.name);
    Expect(t.ref != nullptr && t.dtype == *t.ref->dtype.dtype, "dtype differs from its ref");
    auto numel = NumElements(t.shape);
    auto bytes = numel ? StorageBytes(t.dtype, *numel) : std::nullopt;
    Expect(bytes && *bytes == t.nbytes, "nbytes disagrees with the shape", t.name);
    if (t.nbytes > kMaxTensorBytes) continue;
    buf.assign(t.nbytes + 1, 0xA5);
    Status st = Clean(ck.Read(t, 0, buf.data(), t.nbytes), path);
    Expect(buf[t.nbytes] == 0xA5, "Read wrote past the tensor", t.name);
    if (first.ok()) first = st;
  }
  for (const ScalingState& s : ck.scaling()) {
    for (const DirectionState& d : s.states) {
      Expect(d.scale.size() == d.slot_roles.size() &&
                 d.amax_history.size() == static_cast<size_t>(d.history_len) * d.slot_roles.size(),
             "scaling tables of the wrong size", s.module);
    }
  }
  return first;
}

// Input: u32 n, n bytes of data.pkl, then storages "0", "1", ... (u32 length, bytes each),
// written as a torch.save archive and opened as a checkpoint: the interpreter, the walk
// (names, metadata, extra state) and the reads behind it.
inline Status FuzzTorchWalk(const uint8_t* data, size_t size) {
  static ScratchDir scratch;
  std::string pickle = TakeFramed(&data, &size);
  std::vector<std::pair<std::string, std::string>> storages;
  while (size > 0 && storages.size() < 8) {
    storages.emplace_back(std::to_string(storages.size()), TakeFramed(&data, &size));
  }
  const std::string zip = torch_test::TorchSave(pickle, storages);
  const std::string path =
      scratch.Write("m.pt", reinterpret_cast<const uint8_t*>(zip.data()), zip.size());
  auto ck = torch_import::TorchCheckpoint::Open(path);
  if (!ck.ok()) return Clean(ck.status(), path);
  return UseCheckpoint(**ck, path);
}

// Input: u32 n, n bytes of a DCP .metadata, then the bytes of its data file "__0_0.distcp".
inline Status FuzzDcp(const uint8_t* data, size_t size) {
  static ScratchDir scratch;
  std::string meta = TakeFramed(&data, &size);
  scratch.Write(".metadata", reinterpret_cast<const uint8_t*>(meta.data()), meta.size());
  scratch.Write("__0_0.distcp", data, size);
  auto ck = torch_import::TorchCheckpoint::Open(scratch.path());
  if (!ck.ok()) return Clean(ck.status(), scratch.path());
  return UseCheckpoint(**ck, scratch.path());
}

}  // namespace ferry::fuzz

#endif  // FERRY_TESTS_FUZZ_FUZZ_ENTRIES_HPP_
