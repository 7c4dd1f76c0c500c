// `ferry convert`: safetensors (single or sharded) <-> TensorFerry, and re-encoding.
#include <sys/stat.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "base/util.hpp"
#include "cli.hpp"
#include "format/block_source.hpp"
#include "format/safetensors.hpp"
#include "fp8_json.hpp"
#include "io/source.hpp"

namespace ferry::cli {

namespace {

// Checksums of a source are checked on the way through (where it has them).
constexpr ReadPath kVerified{/*verify=*/true, /*streaming=*/false, /*direct=*/nullptr};

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct Source {
  std::shared_ptr<Reader> reader;
  std::string path;
  // What the file describes beyond its tensors. A safetensors file has no place for FP8
  // descriptions but its metadata, where `ferry convert` puts them (kQuantizedKey,
  // kScalingKey); they are taken back out of `metadata` here.
  std::vector<QuantizedTensor> quantized;
  std::vector<ScalingState> scaling;
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Fills a source's descriptions from its reader.
void Describe(Source* s) {
  const Reader& r = *s->reader;
  s->metadata = r.metadata();
  if (!BlocksOf(r).safetensors()) {
    s->quantized = r.quantized();
    s->scaling = r.scaling_states();
    return;
  }
  Fp8Metadata described = DescribeFp8Metadata(std::move(s->metadata));
  // A description that does not parse stays ordinary metadata, with a warning: the tensors
  // still convert.
  for (const auto& [key, why] : described.kept) {
    std::fprintf(stderr, "ferry: warning: %s: metadata %s is kept as plain metadata: %s\n",
                 s->path.c_str(), Quote(key).c_str(), Printable(why).c_str());
  }
  s->quantized = std::move(described.quantized);
  s->scaling = std::move(described.scaling);
  s->metadata = std::move(described.metadata);
}

// One tensor to copy: source index and tensor index within it.
struct Item {
  size_t source;
  size_t tensor;
};

// Opens IN: one file, or every shard of a sharded safetensors index, checked against the
// index's weight_map in both directions so a stale or hand-edited index cannot silently drop
// or duplicate tensors.
Result<std::vector<Source>> OpenSources(const std::string& in) {
  std::vector<Source> sources;
  if (!EndsWith(in, ".json")) {
    FERRY_ASSIGN_OR_RETURN(auto reader, Reader::Open(in));
    sources.push_back(Source{std::move(reader), in});
    Describe(&sources.back());
    return sources;
  }
  FERRY_ASSIGN_OR_RETURN(SafetensorsIndex index, ReadSafetensorsIndex(in));
  if (index.shards.empty()) {
    return Error(StatusCode::kInvalidArgument, in, ": the index's weight_map lists no tensors");
  }
  for (const std::string& shard : index.shards) {
    auto reader = Reader::Open(shard);
    if (!reader.ok()) {
      return Status(reader.status().code(), StrCat(in, ": shard: ", reader.status().message()));
    }
    sources.push_back(Source{std::move(*reader), shard});
    Describe(&sources.back());
  }
  for (const auto& [name, k] : index.weight_map) {
    if (!sources[k].reader->Find(name).ok()) {
      return Error(StatusCode::kDataLoss, in, ": weight_map puts tensor ", Quote(name),
                   " in shard ", sources[k].path, ", which does not hold it");
    }
  }
  std::map<std::string_view, size_t> listed;
  for (const auto& [name, k] : index.weight_map) listed.emplace(name, k);
  for (size_t k = 0; k < sources.size(); ++k) {
    const Reader& r = *sources[k].reader;
    for (size_t i = 0; i < r.num_tensors(); ++i) {
      std::string name = r.tensor(i).name;
      auto it = listed.find(name);
      if (it == listed.end()) {
        return Error(StatusCode::kDataLoss, in, ": shard ", sources[k].path, " holds tensor ",
                     Quote(name), ", which the weight_map does not list");
      }
      if (it->second != k) {
        return Error(StatusCode::kDataLoss, in, ": shard ", sources[k].path, " holds tensor ",
                     Quote(name), ", which the weight_map puts in ", sources[it->second].path);
      }
    }
  }
  return sources;
}

// Every tensor of every source, each source in file order (sequential reads), names unique.
Result<std::vector<Item>> CollectItems(const std::vector<Source>& sources) {
  std::vector<Item> items;
  std::map<std::string, size_t> seen;
  for (size_t k = 0; k < sources.size(); ++k) {
    const Reader& r = *sources[k].reader;
    std::vector<Item> mine;
    for (size_t i = 0; i < r.num_tensors(); ++i) {
      std::string name = r.tensor(i).name;
      auto [it, fresh] = seen.emplace(name, k);
      if (!fresh) {
        return Error(StatusCode::kInvalidArgument, "tensor ", Quote(name), " is in both ",
                     sources[it->second].path, " and ", sources[k].path);
      }
      mine.push_back(Item{k, i});
    }
    std::stable_sort(mine.begin(), mine.end(), [&](const Item& a, const Item& b) {
      return BlocksOf(r).FileOffset(a.tensor) < BlocksOf(r).FileOffset(b.tensor);
    });
    items.insert(items.end(), mine.begin(), mine.end());
  }
  return items;
}

// Metadata of every source; the first source wins a conflict (with a warning), which keeps
// shards' repeated entries such as {"format": "pt"} as one.
std::vector<std::pair<std::string, std::string>> MergeMetadata(const std::vector<Source>& sources) {
  std::map<std::string, std::pair<std::string, size_t>> merged;
  for (size_t k = 0; k < sources.size(); ++k) {
    for (const auto& [key, value] : sources[k].metadata) {
      auto [it, fresh] = merged.emplace(key, std::make_pair(value, k));
      if (!fresh && it->second.first != value) {
        std::fprintf(stderr,
                     "ferry: warning: metadata %s differs between %s and %s; keeping "
                     "the first\n",
                     Quote(key).c_str(), sources[it->second.second].path.c_str(),
                     sources[k].path.c_str());
      }
    }
  }
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& [k, v] : merged) out.emplace_back(k, v.first);
  return out;
}

// Stops a conversion that was asked to stop; returning the error drops the writer, which
// removes its temporary file, and leaves `out` as it was.
Status Interrupted(const std::string& out) {
  int sig = InterruptSignal();
  if (sig == 0) return Status::Ok();
  return Error(StatusCode::kIoError, out, ": conversion interrupted by ",
               sig == SIGINT ? "SIGINT" : "SIGTERM", "; ", out, " was left as it was");
}

Status ToFerry(const std::vector<Source>& sources, const std::vector<Item>& items,
               const std::string& out, WriterOptions wo, Progress* progress) {
  // Reads run ahead of compression by up to a staging pool's worth, so progress and
  // interruption follow the blocks written, not the bytes read.
  uint64_t reported = 0;
  wo.progress = [&](uint64_t written) {
    progress->Add(written - reported);
    reported = written;
    return Interrupted(out);
  };
  FERRY_ASSIGN_OR_RETURN(Writer writer, Writer::Create(out, wo));
  for (const Item& it : items) {
    const Reader& r = *sources[it.source].reader;
    const BlockSource& blocks = BlocksOf(r);
    TensorInfo info = r.tensor(it.tensor);
    // Checksums of the source are checked on the way through (where it has them), so a
    // corrupt input never becomes a new file with fresh, matching checksums.
    FillFn fill = [&](uint64_t offset, void* dst, size_t size) -> Status {
      FERRY_RETURN_IF_ERROR(Interrupted(out));
      return blocks.Read(it.tensor, offset, size, static_cast<uint8_t*>(dst), kVerified);
    };
    FERRY_RETURN_IF_ERROR(
        writer.AddTensorFrom(info.name, info.dtype, info.shape, fill, wo.encoding));
  }
  // A description the writer refuses came from the input: the error says so, and names it.
  auto blame = [&](const Source& s, const char* key, const Status& st) {
    std::string message = st.message();
    if (message.rfind(out + ": ", 0) == 0) message.erase(0, out.size() + 2);
    return Error(st.code(), s.path, ": ",
                 BlocksOf(*s.reader).safetensors() ? StrCat("metadata ", Quote(key), ": ") : "",
                 message);
  };
  std::set<std::string> names;
  for (const Item& it : items) names.insert(sources[it.source].reader->tensor(it.tensor).name);
  for (const Source& s : sources) {
    for (const QuantizedTensor& q : s.quantized) {
      // The writer would check these references only at commit, naming the output.
      for (const auto* c : {&q.rowwise, &q.columnwise}) {
        for (const std::string* ref : {*c ? &(*c)->data : nullptr, *c ? &(*c)->scale_inv : nullptr,
                                       *c ? &(*c)->amax : nullptr}) {
          if (ref != nullptr && (!ref->empty() || ref == &(*c)->data) && !names.count(*ref)) {
            return blame(s, kQuantizedKey,
                         Status(StatusCode::kInvalidArgument,
                                StrCat("quantized tensor ", Quote(q.name), " refers to tensor ",
                                       Quote(*ref), ", which the input does not hold")));
          }
        }
      }
      Status st = writer.AddQuantized(q);
      if (!st.ok()) return blame(s, kQuantizedKey, st);
    }
    for (const ScalingState& sc : s.scaling) {
      Status st = writer.AddScalingState(sc);
      if (!st.ok()) return blame(s, kScalingKey, st);
    }
  }
  for (const auto& [k, v] : MergeMetadata(sources)) {
    FERRY_RETURN_IF_ERROR(writer.SetMetadata(k, v));
  }
  return writer.Commit();
}

Status ToSafetensors(const std::vector<Source>& sources, const std::vector<Item>& items,
                     const std::string& out, Progress* progress) {
  std::vector<SafetensorsEntry> entries;
  std::map<std::string, Item> by_name;
  for (const Item& it : items) {
    TensorInfo info = sources[it.source].reader->tensor(it.tensor);
    if (SafetensorsDTypeName(info.dtype) == nullptr) {
      return Error(StatusCode::kUnimplemented, sources[it.source].path, ": tensor ",
                   Quote(info.name), " is ", DTypeName(info.dtype),
                   ", which safetensors cannot represent");
    }
    by_name.emplace(info.name, it);
    entries.push_back(SafetensorsEntry{info.name, info.dtype, info.shape});
  }
  SortSafetensorsEntries(&entries);
  // FP8 descriptions travel in the metadata, so converting back restores them.
  auto metadata = MergeMetadata(sources);
  Json quantized = Json::array(), scaling = Json::array();
  for (const Source& s : sources) {
    for (const QuantizedTensor& q : s.quantized) quantized.push_back(QuantizedJson(q));
    for (const ScalingState& st : s.scaling) scaling.push_back(ScalingJson(st));
  }
  if (!quantized.empty()) metadata.emplace_back(kQuantizedKey, quantized.dump());
  if (!scaling.empty()) metadata.emplace_back(kScalingKey, scaling.dump());
  FERRY_ASSIGN_OR_RETURN(SafetensorsWriter writer,
                         SafetensorsWriter::Create(out, entries, metadata));
  constexpr uint64_t kPiece = uint64_t{16} << 20;
  std::vector<uint8_t> buf;
  for (const SafetensorsEntry& e : entries) {
    const Item& it = by_name.at(e.name);
    const BlockSource& blocks = BlocksOf(*sources[it.source].reader);
    uint64_t nbytes = blocks.RawSize(it.tensor);
    buf.resize(std::min(nbytes, kPiece));
    for (uint64_t off = 0; off < nbytes; off += kPiece) {
      FERRY_RETURN_IF_ERROR(Interrupted(out));
      uint64_t len = std::min(kPiece, nbytes - off);
      FERRY_RETURN_IF_ERROR(blocks.Read(it.tensor, off, len, buf.data(), kVerified));
      FERRY_RETURN_IF_ERROR(writer.Write(buf.data(), len));
      progress->Add(len);
    }
  }
  return writer.Commit();
}

uint64_t FileSize(const std::string& path) {
  if (IsRemoteName(path)) {
    auto object = OpenSource(path, {});
    return object.ok() ? (*object)->size() : 0;
  }
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

}  // namespace

int RunConvert(const ConvertOptions& given) {
  auto format = ChooseOutputFormat(given.out, given.to);
  if (!format.ok()) {
    std::fprintf(stderr, "ferry convert: %s\n", Printable(format.status().message()).c_str());
    return kExitUsage;
  }
  const bool to_safetensors = *format == OutputFormat::kSafetensors;
  // The format decided once, for every path below (torch inputs included).
  ConvertOptions options = given;
  options.to = to_safetensors ? "safetensors" : "ferry";
  WriterOptions wo;
  if (auto encoding = ParseEncoding(options.encoding)) {
    wo.encoding = *encoding;
  } else {
    std::fprintf(stderr, "ferry convert: unknown --encoding %s; give one of %s\n",
                 Printable(options.encoding).c_str(), kEncodingNames);
    return kExitUsage;
  }
  if (to_safetensors && wo.encoding != Encoding::kRaw) {
    std::fprintf(stderr,
                 "ferry convert: %s: safetensors stores raw bytes only; --encoding %s needs a "
                 "TensorFerry output\n",
                 Printable(options.out).c_str(), EncodingName(wo.encoding));
    return kExitUsage;
  }
  auto block = ParseSize(options.block_size);
  if (!block) {
    std::fprintf(stderr, "ferry convert: --block-size %s is not a size\n",
                 options.block_size.c_str());
    return kExitUsage;
  }
  wo.block_size = *block;
  wo.zstd_level = options.level;
  wo.threads = options.threads;
  if (IsTorchInput(options.in)) return RunConvertTorch(options, wo);

  auto sources = OpenSources(options.in);
  if (!sources.ok()) return Fail(sources.status());
  auto items = CollectItems(*sources);
  if (!items.ok()) return Fail(items.status());
  uint64_t raw_total = 0;
  for (const Item& it : *items) {
    raw_total += BlocksOf(*(*sources)[it.source].reader).RawSize(it.tensor);
  }
  bool from_safetensors = true;
  for (const Source& s : *sources) from_safetensors &= BlocksOf(*s.reader).safetensors();

  CatchInterrupts();
  Progress progress("converting", raw_total);
  Status st = to_safetensors ? ToSafetensors(*sources, *items, options.out, &progress)
                             : ToFerry(*sources, *items, options.out, wo, &progress);
  progress.Finish();
  if (!st.ok()) {
    Fail(st);
    return InterruptSignal() != 0 ? 128 + InterruptSignal() : kExitFailure;
  }
  if (g_quiet) return kExitOk;
  double secs = progress.seconds();
  uint64_t out_size = FileSize(options.out);
  std::string in_desc = StrCat(sources->size() > 1 ? StrCat(sources->size(), " shards, ") : "",
                               from_safetensors ? "safetensors" : "TensorFerry");
  std::string out_desc =
      to_safetensors ? "safetensors"
                     : StrCat("TensorFerry, ", EncodingName(wo.encoding),
                              wo.encoding == Encoding::kRaw || wo.encoding == Encoding::kPlanes
                                  ? ""
                                  : StrCat(" level ", wo.zstd_level),
                              ", ", HumanBytes(wo.block_size), " blocks");
  std::printf("%s (%s) -> %s (%s)\n", options.in.c_str(), in_desc.c_str(), options.out.c_str(),
              out_desc.c_str());
  std::printf("%zu tensors, %s of tensor data, output file %s", items->size(),
              HumanBytes(raw_total).c_str(), HumanBytes(out_size).c_str());
  if (out_size > 0 && raw_total > out_size) {
    std::printf(" (%.2fx smaller)", static_cast<double>(raw_total) / out_size);
  }
  std::printf(", %.2f s (%s)\n", secs, Rate(raw_total, secs).c_str());
  return kExitOk;
}

}  // namespace ferry::cli
