// safetensors: header validation into a synthesized index, the writer, and sharded indexes.
#include "format/safetensors.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "base/strict_json.hpp"
#include "base/util.hpp"
#include "ferry_generated.h"
#include "format/checkpoint_index.hpp"
#include "format/format.hpp"
#include "io/remote_sink.hpp"
#include "io/source.hpp"
#include "io/temp_file.hpp"

namespace ferry {

namespace {

using Json = nlohmann::json;

struct NamedDType {
  const char* name;
  DType dtype;
};
// Every dtype safetensors defines except the packed 6-bit F6 types (see ParseEntry), in the
// order of its Dtype enum: its writer lays tensors out by that order, descending, then by
// name, and so does ours, so a file converted back comes out byte for byte the same.
constexpr NamedDType kSafetensorsDTypes[] = {
    {"BOOL", DType::kBool},
    // Logical element count in the shape, two per byte, element 2i in the low nibble: the
    // same convention as ours (torch.float4_e2m1fn_x2's).
    {"F4", DType::kF4_E2M1FN},
    {"U8", DType::kU8},
    {"I8", DType::kI8},
    {"F8_E5M2", DType::kF8_E5M2},
    {"F8_E4M3", DType::kF8_E4M3FN},
    {"F8_E8M0", DType::kF8_E8M0FNU},
    {"F8_E4M3FNUZ", DType::kF8_E4M3FNUZ},
    {"F8_E5M2FNUZ", DType::kF8_E5M2FNUZ},
    {"I16", DType::kI16},
    {"U16", DType::kU16},
    {"F16", DType::kF16},
    {"BF16", DType::kBF16},
    {"I32", DType::kI32},
    {"U32", DType::kU32},
    {"F32", DType::kF32},
    {"C64", DType::kC64},
    {"F64", DType::kF64},
    {"I64", DType::kI64},
    {"U64", DType::kU64},
};

// Position in kSafetensorsDTypes; -1 for dtypes safetensors lacks.
int SafetensorsRank(DType dtype) {
  for (size_t i = 0; i < std::size(kSafetensorsDTypes); ++i) {
    if (kSafetensorsDTypes[i].dtype == dtype) return static_cast<int>(i);
  }
  return -1;
}

uint64_t LoadU64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Duplicate keys in one header: the message says where (top level or inside one entry).
std::string DuplicateKey(const std::string& key, int depth) {
  return StrCat("has the key ", Quote(key), " twice", depth == 1 ? "" : " in one entry");
}

struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the data section
};

class HeaderParser {
 public:
  HeaderParser(const std::string& path, uint64_t header_size, uint64_t data_start,
               uint64_t data_size)
      : path_(path), header_size_(header_size), data_start_(data_start), data_size_(data_size) {}

  Status Fail(const std::string& what) const {
    return Error(StatusCode::kDataLoss, path_, ": safetensors header (file offset 8, ",
                 header_size_, " bytes): ", what);
  }
  Status FailTensor(const std::string& name, const std::string& what) const {
    return Fail(StrCat("tensor ", Quote(name), ": ", what));
  }

  Status CheckName(const std::string& name) const {
    if (name.empty()) return Fail("a tensor has an empty name");
    if (name.size() > format::kMaxNameBytes) {
      return Fail(
          StrCat("a tensor name is ", name.size(), " bytes (limit ", format::kMaxNameBytes, ")"));
    }
    if (name.find('\0') != std::string::npos) {
      return FailTensor(name, "name contains a NUL byte");
    }
    return Status::Ok();
  }

  Result<Entry> ParseEntry(const std::string& name, const Json& value) const {
    FERRY_RETURN_IF_ERROR(CheckName(name));
    if (!value.is_object()) return FailTensor(name, "entry is not a JSON object");
    for (const auto& [key, unused] : value.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        return FailTensor(name, StrCat("unknown field ", Quote(key)));
      }
    }
    Entry e;
    e.name = name;
    auto dt = value.find("dtype");
    if (dt == value.end()) return FailTensor(name, "no \"dtype\"");
    if (!dt->is_string()) return FailTensor(name, "\"dtype\" is not a string");
    const std::string& dname = dt->get_ref<const std::string&>();
    auto dtype = ParseSafetensorsDType(dname);
    if (!dtype) {
      if (dname == "F6_E2M3" || dname == "F6_E3M2") {
        return Error(StatusCode::kUnimplemented, path_, ": safetensors tensor ", Quote(name),
                     ": dtype ", dname,
                     " (packed 6-bit elements) has no TensorFerry equivalent (F6 types are "
                     "stored one per byte)");
      }
      return FailTensor(name, StrCat("unknown dtype ", Quote(dname)));
    }
    e.dtype = *dtype;

    auto sh = value.find("shape");
    if (sh == value.end()) return FailTensor(name, "no \"shape\"");
    if (!sh->is_array()) return FailTensor(name, "\"shape\" is not an array");
    if (sh->size() > format::kMaxDims) {
      return FailTensor(name,
                        StrCat("shape has ", sh->size(), " dims (limit ", format::kMaxDims, ")"));
    }
    uint64_t numel = 1;
    for (size_t d = 0; d < sh->size(); ++d) {
      const Json& dim = (*sh)[d];
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        return FailTensor(
            name, StrCat("shape dim ", d, " is ", dim.dump(), ", not a non-negative integer"));
      }
      uint64_t v = dim.get<uint64_t>();
      if (MulOverflows(numel, v, &numel)) {
        return FailTensor(name, "element count overflows 64 bits");
      }
      e.shape.push_back(static_cast<int64_t>(v));
    }

    auto off = value.find("data_offsets");
    if (off == value.end()) return FailTensor(name, "no \"data_offsets\"");
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return FailTensor(name, StrCat("\"data_offsets\" is ", off->dump(),
                                     ", not [begin, end] as non-negative integers"));
    }
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    std::string where = StrCat("data_offsets [", e.begin, ", ", e.end, "]");
    if (e.begin > e.end) return FailTensor(name, where + " has begin after end");
    if (e.end > data_size_) {
      return FailTensor(
          name, StrCat(where, " (file offsets ", FileOffset(e.begin), " to ", FileOffset(e.end),
                       ") run past the end of the ", data_size_,
                       "-byte data section, which ends at file offset ", data_start_ + data_size_));
    }
    auto expect = StorageBytes(e.dtype, numel);
    if (!expect) return FailTensor(name, "byte size overflows 64 bits");
    if (e.end - e.begin != *expect) {
      return FailTensor(
          name, StrCat(where, " (file offset ", FileOffset(e.begin), ") hold ", e.end - e.begin,
                       " bytes but shape ", sh->dump(), " of ", dname, " needs ", *expect));
    }
    return e;
  }

  // Data section ranges must not overlap: two tensors sharing bytes would alias in memory
  // and make a write through one corrupt the other after conversion.
  // Also returns, in `order`, the positions of the non-empty entries in file order: the
  // index's data_order, which spares the footer check a second sort.
  Status CheckOverlaps(const std::vector<Entry>& entries, std::vector<uint32_t>* order) const {
    std::vector<uint32_t> by_offset;
    by_offset.reserve(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].begin != entries[i].end) by_offset.push_back(static_cast<uint32_t>(i));
    }
    std::sort(by_offset.begin(), by_offset.end(), [&](uint32_t a, uint32_t b) {
      return entries[a].begin != entries[b].begin ? entries[a].begin < entries[b].begin
                                                  : entries[a].end < entries[b].end;
    });
    const Entry* prev = nullptr;
    for (uint32_t i : by_offset) {
      const Entry* e = &entries[i];
      if (prev != nullptr && e->begin < prev->end) {
        return FailTensor(e->name,
                          StrCat("data_offsets [", e->begin, ", ", e->end, "] overlap tensor ",
                                 Quote(prev->name), " at [", prev->begin, ", ", prev->end,
                                 "] (file offset ", FileOffset(e->begin), ")"));
      }
      prev = e;
    }
    *order = std::move(by_offset);
    return Status::Ok();
  }

  uint64_t FileOffset(uint64_t rel) const { return data_start_ + rel; }

 private:
  const std::string& path_;
  uint64_t header_size_, data_start_, data_size_;
};

}  // namespace

bool LooksLikeSafetensors(const uint8_t* file, uint64_t file_size) {
  // Anything without TensorFerry's magic whose first 8 bytes could be a header length: a
  // broken or tiny safetensors file then gets a safetensors error ("[]" is not an object,
  // an empty header is not JSON) rather than one about TensorFerry's trailer. The header may
  // start with whitespace, as the safetensors library allows.
  // A header that opens with '{' right after the length is safetensors too, so a length that
  // runs past the end gets the safetensors message that names it.
  return file_size >= 8 && std::memcmp(file, format::kMagic, format::kMagicSize) != 0 &&
         (LoadU64(file) <= file_size - 8 || (file_size >= 9 && file[8] == '{'));
}

const char* SafetensorsDTypeName(DType dtype) {
  for (const NamedDType& d : kSafetensorsDTypes) {
    if (d.dtype == dtype) return d.name;
  }
  return nullptr;
}

std::optional<DType> ParseSafetensorsDType(std::string_view name) {
  for (const NamedDType& d : kSafetensorsDTypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

Result<uint64_t> ParseSafetensors(const uint8_t* file, uint64_t file_size, const std::string& path,
                                  std::vector<uint64_t>* index) {
  if (file_size < 8) {
    return Error(StatusCode::kDataLoss, path, ": ", file_size,
                 "-byte file is too short for a safetensors header length (8 bytes)");
  }
  const uint64_t n = LoadU64(file);
  if (n > kMaxSafetensorsHeaderBytes) {
    return Error(StatusCode::kDataLoss, path, ": safetensors header length ", n,
                 " (file offset 0) exceeds the limit of ", kMaxSafetensorsHeaderBytes, " bytes");
  }
  if (n > file_size - 8) {
    return Error(StatusCode::kDataLoss, path, ": safetensors header length ", n,
                 " (file offset 0) runs past the end of the ", file_size, "-byte file");
  }
  const uint64_t data_start = 8 + n;
  HeaderParser parser(path, n, data_start, file_size - data_start);

  Json header;
  StrictJsonOptions json;
  // object > tensor object > array is all a header needs.
  json.max_depth = 3;
  json.too_deep = "nests deeper than a safetensors header can";
  json.duplicate = DuplicateKey;
  json.where = "file offset";
  json.byte_base = 8;
  const char* text = reinterpret_cast<const char*>(file + 8);
  if (auto error = ParseStrictJson(text, text + n, json, &header)) return parser.Fail(*error);
  if (!header.is_object()) return parser.Fail("is not a JSON object");

  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
  try {
    if (header.size() > format::kMaxTensors + 1) {
      return parser.Fail(StrCat(header.size(), " entries (limit ", format::kMaxTensors, ")"));
    }
    entries.reserve(header.size());
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        if (value.is_null()) continue;
        if (!value.is_object()) return parser.Fail("\"__metadata__\" is not an object");
        for (const auto& [mk, mv] : value.items()) {
          if (mk.empty() || mk.size() > format::kMaxNameBytes ||
              mk.find('\0') != std::string::npos) {
            return parser.Fail(StrCat("\"__metadata__\" key ", Quote(mk),
                                      " is empty, too long or contains a NUL byte"));
          }
          if (!mv.is_string()) {
            return parser.Fail(StrCat("\"__metadata__\" value of ", Quote(mk), " is not a string"));
          }
          metadata.emplace(mk, mv.get<std::string>());
        }
        continue;
      }
      FERRY_ASSIGN_OR_RETURN(Entry e, parser.ParseEntry(key, value));
      entries.push_back(std::move(e));
    }
  } catch (const std::exception& e) {
    // Not expected (every access is type-checked first); a bad header must never escape
    // as an exception.
    return parser.Fail(StrCat("unexpected: ", e.what()));
  }

  std::vector<uint32_t> data_order;
  FERRY_RETURN_IF_ERROR(parser.CheckOverlaps(entries, &data_order));

  // nlohmann's object is a std::map, so entries arrive sorted by name, as the index needs.
  flatbuffers::FlatBufferBuilder b(std::min<uint64_t>(n * 2 + 1024, uint64_t{1} << 26));
  std::vector<flatbuffers::Offset<fb::Tensor>> tensors;
  tensors.reserve(entries.size());
  for (const Entry& e : entries) {
    uint64_t nbytes = e.end - e.begin;
    // No checksums to group bytes by, so one "block" per gibibyte: the loader never has to
    // split a copy for the block's sake.
    uint64_t block = nbytes == 0 ? 0 : format::kMaxBlockSize;
    tensors.push_back(fb::CreateTensor(b, b.CreateString(e.name), static_cast<fb::DType>(e.dtype),
                                       b.CreateVector(e.shape), data_start + e.begin, nbytes,
                                       nbytes, fb::Encoding::RAW, block));
  }
  std::vector<flatbuffers::Offset<fb::KeyValue>> kvs;
  for (const auto& [k, v] : metadata) {
    kvs.push_back(fb::CreateKeyValue(b, b.CreateString(k), b.CreateString(v)));
  }
  auto root = fb::CreateCheckpoint(b, kFormatVersion, b.CreateString("safetensors"),
                                   fb::ChecksumAlgo::XXH3_64, b.CreateVector(tensors), 0, 0,
                                   kvs.empty() ? 0 : b.CreateVector(kvs),
                                   data_order.empty() ? 0 : b.CreateVector(data_order));
  fb::FinishCheckpointBuffer(b, root);
  uint64_t size = b.GetSize();
  index->assign(size / 8 + 1, 0);
  std::memcpy(index->data(), b.GetBufferPointer(), size);
  return size;
}

void SortSafetensorsEntries(std::vector<SafetensorsEntry>* entries) {
  std::stable_sort(entries->begin(), entries->end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     int ra = SafetensorsRank(a.dtype), rb = SafetensorsRank(b.dtype);
                     return ra != rb ? ra > rb : a.name < b.name;
                   });
}

// ---- SafetensorsWriter --------------------------------------------------------------------

struct SafetensorsWriter::State {
  std::string path, tmp_path;
  std::string dest;  // `path`, or the file a symbolic link at `path` resolves to
  File file;         // the temporary file; messages name `dest`
  File lock;         // its lock (io/temp_file.hpp), held until the rename or the removal
  // Instead of the file, for an s3:// destination: written in order, visible at Commit, and
  // abandoned (the previous object kept) when destroyed before.
  std::unique_ptr<RemoteSink> upload;
  bool durable = true;
  bool spent = false;
  uint64_t header_bytes = 0;
  uint64_t data_bytes = 0;
  uint64_t written = 0;

  ~State() { Abort(); }
  void Abort() {
    if (spent) return;
    spent = true;
    upload.reset();
    (void)file.Close();
    if (!tmp_path.empty()) ::unlink(tmp_path.c_str());
    (void)lock.Close();
  }
  Status WriteAll(const void* data, size_t size) {
    return upload ? upload->Append(static_cast<const uint8_t*>(data), size)
                  : file.WriteAll(data, size);
  }
};

SafetensorsWriter::SafetensorsWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}
SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&&) noexcept = default;
SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&&) noexcept = default;
SafetensorsWriter::~SafetensorsWriter() = default;

Result<SafetensorsWriter> SafetensorsWriter::Create(
    const std::string& path, const std::vector<SafetensorsEntry>& entries,
    const std::vector<std::pair<std::string, std::string>>& metadata, bool durable) {
  if (path.empty()) return Error(StatusCode::kInvalidArgument, "empty safetensors path");
  // ordered_json keeps "__metadata__" first and the tensors in data order, as the
  // safetensors library writes them.
  // What ParseSafetensors refuses is never written: a file this library cannot read back.
  auto unreadable = [](std::string_view key) -> std::string {
    if (key.size() > format::kMaxNameBytes) {
      return StrCat("is ", key.size(), " bytes (limit ", format::kMaxNameBytes, ")");
    }
    if (key.find('\0') != std::string_view::npos) return "contains a NUL byte";
    return {};
  };
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) {
      const std::string why = k.empty() ? "is empty" : unreadable(k);
      if (!why.empty()) {
        return Error(StatusCode::kInvalidArgument, path, ": metadata key ", Quote(k.substr(0, 256)),
                     " ", why, "; safetensors cannot hold it");
      }
      md[k] = v;
    }
    header["__metadata__"] = std::move(md);
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    if (e.name.empty() || e.name == "__metadata__" || !names.insert(e.name).second) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(e.name),
                   " is empty, reserved or a duplicate");
    }
    if (const std::string why = unreadable(e.name); !why.empty()) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor name ",
                   Quote(e.name.substr(0, 256)), " ", why, "; safetensors cannot hold it");
    }
    const char* dname = SafetensorsDTypeName(e.dtype);
    if (dname == nullptr) {
      return Error(StatusCode::kUnimplemented, path, ": tensor ", Quote(e.name), " of dtype ",
                   DTypeName(e.dtype), " has no safetensors equivalent");
    }
    auto numel = NumElements(e.shape);
    auto nbytes = numel ? StorageBytes(e.dtype, *numel) : std::nullopt;
    if (!nbytes) {
      return Error(StatusCode::kInvalidArgument, path, ": tensor ", Quote(e.name), ": bad shape");
    }
    if (e.dtype == DType::kF4_E2M1FN && *numel % 2 != 0) {
      return Error(StatusCode::kUnimplemented, path, ": tensor ", Quote(e.name), " holds ", *numel,
                   " F4 elements; safetensors needs an even count (whole bytes)");
    }
    uint64_t end;
    if (AddOverflows(offset, *nbytes, &end)) {
      return Error(StatusCode::kInvalidArgument, path, ": data section overflows 64 bits");
    }
    header[e.name] = {{"dtype", dname}, {"shape", e.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const std::exception& ex) {
    // dump() throws on invalid UTF-8 in a name or a metadata string.
    return Error(StatusCode::kInvalidArgument, path, ": cannot write the header: ", ex.what());
  }
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxSafetensorsHeaderBytes) {
    return Error(StatusCode::kResourceExhausted, path, ": safetensors header of ", text.size(),
                 " bytes exceeds the limit of ", kMaxSafetensorsHeaderBytes);
  }

  auto state = std::make_unique<State>();
  state->path = path;
  state->durable = durable;
  if (IsRemoteName(path)) {
    FERRY_ASSIGN_OR_RETURN(state->upload, OpenRemoteSink(path));
  } else {
    FERRY_ASSIGN_OR_RETURN(TempFile temp, BeginReplace(path));
    state->dest = std::move(temp.dest);
    state->file = std::move(temp.file);
    state->tmp_path = std::move(temp.path);
    state->lock = std::move(temp.lock);
  }
  uint64_t len = text.size();
  uint8_t prefix[8];
  std::memcpy(prefix, &len, 8);
  FERRY_RETURN_IF_ERROR(state->WriteAll(prefix, 8));
  FERRY_RETURN_IF_ERROR(state->WriteAll(text.data(), text.size()));
  state->header_bytes = 8 + len;
  state->data_bytes = offset;
  return SafetensorsWriter(std::move(state));
}

Status SafetensorsWriter::Write(const void* data, size_t size) {
  if (!state_ || state_->spent) {
    return Error(StatusCode::kInvalidArgument, "safetensors writer already committed or aborted");
  }
  if (size > state_->data_bytes - state_->written) {
    return Error(StatusCode::kInvalidArgument, state_->path, ": writing ", size,
                 " bytes at data offset ", state_->written, " runs past the ", state_->data_bytes,
                 " bytes the header describes");
  }
  Status st = state_->WriteAll(data, size);
  if (!st.ok()) {
    state_->Abort();
    return st;
  }
  state_->written += size;
  return Status::Ok();
}

Status SafetensorsWriter::Commit() {
  if (!state_ || state_->spent) {
    return Error(StatusCode::kInvalidArgument, "safetensors writer already committed or aborted");
  }
  State& s = *state_;
  if (s.written != s.data_bytes) {
    uint64_t written = s.written;
    s.Abort();
    return Error(StatusCode::kInvalidArgument, s.path, ": ", written, " of ", s.data_bytes,
                 " data bytes written");
  }
  Status st;
  if (s.upload) {
    st = s.upload->Commit();
    if (!st.ok()) {
      s.Abort();
      return st;
    }
    s.spent = true;
    return Status::Ok();
  }
  if (s.durable) st = s.file.Sync();
  if (st.ok()) st = KeepPermissions(s.file, s.dest);
  if (st.ok()) st = s.file.Close();
  if (st.ok()) st = RenameFile(s.tmp_path, s.dest);
  if (!st.ok()) {
    s.Abort();
    return st;
  }
  s.spent = true;
  (void)s.lock.Close();
  if (s.durable) FERRY_RETURN_IF_ERROR(SyncParentDir(s.dest));
  return Status::Ok();
}

void SafetensorsWriter::Abort() {
  if (state_) state_->Abort();
}

uint64_t SafetensorsWriter::data_bytes() const { return state_ ? state_->data_bytes : 0; }
uint64_t SafetensorsWriter::header_bytes() const { return state_ ? state_->header_bytes : 0; }

// ---- sharded index -------------------------------------------------------------------------

Result<SafetensorsIndex> ReadSafetensorsIndex(const std::string& path) {
  FERRY_ASSIGN_OR_RETURN(CheckpointIndex parsed, ReadCheckpointIndex(path));
  SafetensorsIndex index;
  index.path = parsed.path;
  for (size_t s = 0; s < parsed.shard_files.size(); ++s)
    index.shards.push_back(parsed.ShardPath(s));
  index.weight_map.reserve(parsed.weight_map.size());
  for (auto& [name, s] : parsed.weight_map) index.weight_map.emplace_back(std::move(name), s);
  index.metadata = std::move(parsed.metadata);
  return index;
}

Result<OutputFormat> ChooseOutputFormat(const std::string& path, std::string_view to) {
  auto ends_with = [&](std::string_view suffix) {
    return path.size() >= suffix.size() &&
           std::string_view(path).substr(path.size() - suffix.size()) == suffix;
  };
  std::optional<OutputFormat> by_name;
  if (ends_with(".ferry")) by_name = OutputFormat::kTensorFerry;
  if (ends_with(".safetensors")) by_name = OutputFormat::kSafetensors;
  const char* kHow =
      "name it *.ferry or *.safetensors, or choose the format: ferry convert --to "
      "ferry|safetensors, tensorferry.convert(..., to=\"ferry\"), ferry_convert_to";
  if (to.empty()) {
    if (by_name) return *by_name;
    size_t slash = path.find_last_of('/');
    size_t dot = path.find_last_of('.');
    std::string ext = dot != std::string::npos && (slash == std::string::npos || dot > slash)
                          ? StrCat("extension ", Quote(path.substr(dot)))
                          : std::string("name");
    return Error(StatusCode::kInvalidArgument, path,
                 ": cannot tell which format to write from its ", ext,
                 " (TensorFerry bytes under another format's name mislead every reader); ", kHow);
  }
  std::optional<OutputFormat> asked;
  if (to == "ferry" || to == "tensorferry") asked = OutputFormat::kTensorFerry;
  if (to == "safetensors") asked = OutputFormat::kSafetensors;
  if (!asked) {
    return Error(StatusCode::kInvalidArgument, path, ": unknown output format ",
                 Quote(std::string(to)), "; give \"ferry\" or \"safetensors\"");
  }
  if (by_name && *by_name != *asked) {
    return Error(StatusCode::kInvalidArgument, path, ": the name says ",
                 *by_name == OutputFormat::kSafetensors ? "safetensors" : "TensorFerry",
                 " but the format asked for is ", to, "; rename the output or drop the choice");
  }
  return *asked;
}

}  // namespace ferry
