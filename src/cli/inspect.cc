// `ferry inspect`: what a checkpoint holds, as a table or as JSON.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/util.hpp"
#include "cli.hpp"
#include "format/block_source.hpp"
#include "fp8_json.hpp"
#include "io/source.hpp"

namespace ferry::cli {

namespace {

// A URL without its query (a presigned URL's signature) or user information; paths as given.
std::string Shown(const std::string& path) {
  return IsRemoteName(path) ? PrintableUrl(path) : path;
}

std::string Floats(const float* v, size_t n, size_t limit = 8) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < n && i < limit; ++i) out << (i ? ", " : "") << v[i];
  if (n > limit) out << ", ... (" << n << ")";
  out << "]";
  return out.str();
}

std::string ComponentText(const QuantizedComponent& c) {
  std::string out = "data " + Printable(c.data);
  if (!c.scale_inv.empty()) {
    out += ", scale_inv " + Printable(c.scale_inv) + " (" +
           (c.scale_layout == ScaleLayout::kRowMajor ? "row-major" : "swizzled") + ")";
  }
  if (!c.amax.empty()) out += ", amax " + Printable(c.amax);
  return out;
}

// Terminal columns of UTF-8 text, counted as code points (close enough for names).
size_t Columns(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// `s` padded with spaces to `width` columns.
std::string Pad(const std::string& s, size_t width) {
  size_t cols = Columns(s);
  return cols >= width ? s : s + std::string(width - cols, ' ');
}

}  // namespace

int RunInspect(const InspectOptions& options) {
  if (IsTorchInput(options.file)) return RunInspectTorch(options);
  auto opened = Reader::Open(options.file);
  if (!opened.ok()) return Fail(opened.status());
  const Reader& reader = **opened;
  const BlockSource& blocks = BlocksOf(reader);

  uint64_t raw_total = 0, stored_total = 0;
  std::vector<TensorInfo> tensors;
  tensors.reserve(reader.num_tensors());
  for (size_t i = 0; i < reader.num_tensors(); ++i) {
    tensors.push_back(reader.tensor(i));
    raw_total += tensors.back().nbytes;
    stored_total += tensors.back().data_size;
  }
  std::vector<QuantizedTensor> quantized = reader.quantized();
  std::vector<ScalingState> scaling = reader.scaling_states();
  auto metadata = reader.metadata();
  const char* format = blocks.safetensors() ? "safetensors" : "tensorferry";

  if (options.json) {
    Json j = Json::object();
    j["path"] = Shown(reader.path());
    j["format"] = format;
    if (!blocks.safetensors()) j["format_version"] = reader.format_version();
    j["producer"] = reader.producer();
    j["file_size"] = reader.file_size();
    j["read"] = blocks.bytes().Describe();
    j["checksums"] = blocks.has_checksums() ? Json("xxh3-64") : Json(nullptr);
    j["raw_bytes"] = raw_total;
    j["stored_bytes"] = stored_total;
    Json jt = Json::array();
    for (const TensorInfo& t : tensors) {
      Json e = Json::object();
      e["name"] = t.name;
      e["dtype"] = DTypeName(t.dtype);
      e["shape"] = t.shape;
      e["encoding"] = EncodingName(t.encoding);
      e["stored_bytes"] = t.data_size;
      e["raw_bytes"] = t.nbytes;
      e["data_offset"] = t.data_offset;
      if (blocks.has_checksums()) e["block_size"] = t.block_size;
      jt.push_back(std::move(e));
    }
    j["tensors"] = std::move(jt);
    Json jq = Json::array();
    for (const QuantizedTensor& q : quantized) jq.push_back(QuantizedJson(q));
    j["quantized"] = std::move(jq);
    Json js = Json::array();
    for (const ScalingState& s : scaling) js.push_back(ScalingJson(s));
    j["scaling"] = std::move(js);
    Json jm = Json::object();
    for (const auto& [k, v] : metadata) jm[k] = v;
    j["metadata"] = std::move(jm);
    PrintJson(j);
    return kExitOk;
  }

  std::printf("file       %s\n", Printable(Shown(reader.path())).c_str());
  if (blocks.safetensors()) {
    std::printf("format     safetensors\n");
  } else {
    std::printf("format     TensorFerry v%u (producer \"%s\")\n", reader.format_version(),
                Printable(reader.producer()).c_str());
  }
  std::printf("size       %s (%llu bytes)\n", HumanBytes(reader.file_size()).c_str(),
              static_cast<unsigned long long>(reader.file_size()));
  std::printf("read       %s\n", Printable(blocks.bytes().Describe()).c_str());
  if (blocks.has_checksums()) {
    std::printf("checksums  XXH3-64 per block\n");
  } else {
    std::printf("checksums  none (safetensors files carry no checksums)\n");
  }
  std::printf("tensors    %zu, raw %s, stored %s", tensors.size(), HumanBytes(raw_total).c_str(),
              HumanBytes(stored_total).c_str());
  if (stored_total != raw_total && stored_total > 0) {
    std::printf(" (%.2fx smaller)", static_cast<double>(raw_total) / stored_total);
  }
  std::printf("\n");

  if (!tensors.empty()) {
    size_t wname = 4, wdtype = 5, wshape = 5, wenc = 8;
    std::vector<std::string> names, shapes;
    names.reserve(tensors.size());
    shapes.reserve(tensors.size());
    for (const TensorInfo& t : tensors) {
      // Control bytes in a hostile name must not reach the terminal.
      names.push_back(Printable(t.name));
      shapes.push_back(ShapeString(t.shape));
      wname = std::max(wname, Columns(names.back()));
      wdtype = std::max(wdtype, std::string(DTypeName(t.dtype)).size());
      wshape = std::max(wshape, shapes.back().size());
      wenc = std::max(wenc, std::string(EncodingName(t.encoding)).size());
    }
    std::printf("\n%s  %s  %s  %s  %12s  %12s\n", Pad("NAME", wname).c_str(),
                Pad("DTYPE", wdtype).c_str(), Pad("SHAPE", wshape).c_str(),
                Pad("ENCODING", wenc).c_str(), "STORED", "RAW");
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorInfo& t = tensors[i];
      std::printf("%s  %s  %s  %s  %12s  %12s\n", Pad(names[i], wname).c_str(),
                  Pad(DTypeName(t.dtype), wdtype).c_str(), Pad(shapes[i], wshape).c_str(),
                  Pad(EncodingName(t.encoding), wenc).c_str(), HumanBytes(t.data_size).c_str(),
                  HumanBytes(t.nbytes).c_str());
    }
  }

  if (!quantized.empty()) {
    std::printf("\nquantized tensors (%zu)\n", quantized.size());
    for (const QuantizedTensor& q : quantized) {
      std::printf("  %s: %s -> %s %s, %s\n", Printable(q.name).c_str(),
                  DTypeName(q.quantized_dtype), DTypeName(q.logical_dtype),
                  ShapeString(q.shape).c_str(), ScalingModeName(q.scaling_mode));
      if (q.rowwise) std::printf("    rowwise: %s\n", ComponentText(*q.rowwise).c_str());
      if (q.columnwise) std::printf("    columnwise: %s\n", ComponentText(*q.columnwise).c_str());
    }
  }

  if (!scaling.empty()) {
    std::printf("\nscaling state (%zu module%s)\n", scaling.size(), scaling.size() == 1 ? "" : "s");
    for (const ScalingState& s : scaling) {
      std::printf("  %s: %s\n", Printable(s.module).c_str(),
                  Printable(RecipeText(s.recipe)).c_str());
      if (s.states.empty()) std::printf("    (stateless)\n");
      for (const DirectionState& d : s.states) {
        std::string roles;
        for (size_t k = 0; k < d.slot_roles.size(); ++k) {
          roles += (k ? ", " : "") + std::string(SlotRoleName(d.slot_roles[k]));
        }
        size_t slots = d.slot_roles.size();
        std::printf("    %s: num_gemms %d, slots [%s], scale %s, amax_history %d x %zu",
                    DirectionName(d.direction), d.num_gemms, roles.c_str(),
                    Floats(d.scale.data(), d.scale.size()).c_str(), d.history_len, slots);
        if (d.history_len > 0 && d.amax_history.size() >= slots) {
          std::printf(", current amax %s", Floats(d.amax_history.data(), slots).c_str());
        }
        std::printf("\n");
      }
    }
  }

  if (!metadata.empty()) {
    std::printf("\nmetadata (%zu)\n", metadata.size());
    for (const auto& [k, v] : metadata) {
      std::string value = v.size() > 200 ? Printable(v.substr(0, 200)) + "... (" +
                                               std::to_string(v.size()) + " bytes)"
                                         : Printable(v);
      std::printf("  %s = %s\n", Printable(k).c_str(), value.c_str());
    }
  }
  return kExitOk;
}

}  // namespace ferry::cli
