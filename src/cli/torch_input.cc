// `ferry inspect` and `ferry convert` of PyTorch checkpoints: torch.save files (.pt, .bin),
// sharded pytorch_model.bin.index.json and DCP folders, read without running their pickles
// (src/import/torch).
//
// Everything this file prints reaches the terminal through Emit, which escapes the whole line
// (Printable): names, keys, values, storage locations, recipe fields and warnings all come
// from a hostile file, and a line assembled from them is escaped once, at the end, whichever
// of them it holds. Nothing here calls printf on file text.
#include <cstdio>
#include <string_view>

#include "base/util.hpp"
#include "cli.hpp"
#include "fp8_json.hpp"
#include "import/torch/import_writer.hpp"
#include "import/torch/torch_checkpoint.hpp"

namespace ferry::cli {

namespace {

using torch_import::ImportedTensor;
using torch_import::TorchCheckpoint;

// One line of output, escaped whole.
void Emit(std::FILE* f, std::string_view line) {
  std::string out = Printable(line);
  out += '\n';
  std::fwrite(out.data(), 1, out.size(), f);
}

// --json: ASCII only (non-ASCII code points as \u escapes, invalid UTF-8 as U+FFFD), and
// through Emit line by line like everything else.
void EmitJson(const Json& j) {
  const std::string text = j.dump(2, ' ', true, Json::error_handler_t::replace);
  for (size_t begin = 0; begin <= text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    Emit(stdout, std::string_view(text).substr(begin, end - begin));
    begin = end + 1;
  }
}

std::string Notes(const ImportedTensor& t) {
  std::string notes;
  auto add = [&](std::string_view note) { notes += StrCat(notes.empty() ? "" : ", ", note); };
  if (!torch_import::IsContiguous(*t.ref)) add("strided view (copied dense)");
  if (t.ref->storage_offset != 0) add("storage offset");
  if (t.location != "cpu") add(StrCat("saved from ", t.location));
  return notes;
}

void EmitSkipped(const TorchCheckpoint& ck) {
  for (const std::string& s : ck.skipped()) Emit(stderr, "ferry: warning: not imported: " + s);
}

Json InspectJson(const TorchCheckpoint& ck, uint64_t total) {
  Json j = Json::object();
  j["path"] = ck.path();
  j["format"] = ck.kind();
  j["raw_bytes"] = total;
  Json jt = Json::array();
  for (const ImportedTensor& t : ck.tensors()) {
    Json e = Json::object();
    e["name"] = t.name;
    e["dtype"] = DTypeName(t.dtype);
    e["shape"] = t.shape;
    e["raw_bytes"] = t.nbytes;
    e["torch_dtype"] = t.ref->dtype.name;
    e["storage"] = t.ref->storage->key;
    e["storage_offset"] = t.ref->storage_offset;
    e["stride"] = t.ref->stride;
    e["contiguous"] = torch_import::IsContiguous(*t.ref);
    e["saved_location"] = t.location;
    e["source"] = t.source;
    jt.push_back(std::move(e));
  }
  j["tensors"] = std::move(jt);
  Json js = Json::array();
  for (const ScalingState& s : ck.scaling()) js.push_back(ScalingJson(s));
  j["scaling"] = std::move(js);
  Json jm = Json::object();
  for (const auto& [k, v] : ck.metadata()) jm[k] = v;
  j["metadata"] = std::move(jm);
  j["skipped"] = ck.skipped();
  return j;
}

void EmitScaling(const TorchCheckpoint& ck) {
  Emit(stdout, "");
  Emit(stdout, StrCat("TransformerEngine extra state (", ck.scaling().size(), " modules)"));
  for (const ScalingState& s : ck.scaling()) {
    Emit(stdout, StrCat("  ", s.module, ": ", RecipeText(s.recipe)));
    if (s.states.empty()) Emit(stdout, "    (no scaling state)");
    for (const DirectionState& d : s.states) {
      Emit(stdout, StrCat("    ", DirectionName(d.direction), ": num_gemms ", d.num_gemms, ", ",
                          d.slot_roles.size(), " slots, amax_history ", d.history_len, " x ",
                          d.slot_roles.size()));
    }
  }
}

}  // namespace

bool IsTorchInput(const std::string& path) { return TorchCheckpoint::Recognises(path); }

int RunInspectTorch(const InspectOptions& options) {
  auto opened = TorchCheckpoint::Open(options.file);
  if (!opened.ok()) return Fail(opened.status());
  const TorchCheckpoint& ck = **opened;
  uint64_t total = 0;
  for (const ImportedTensor& t : ck.tensors()) total += t.nbytes;
  if (options.json) {
    EmitJson(InspectJson(ck, total));
    return kExitOk;
  }
  Emit(stdout, StrCat("file       ", ck.path()));
  Emit(stdout, StrCat("format     ", ck.kind(), " (read without running its pickles)"));
  Emit(stdout, StrCat("tensors    ", ck.tensors().size(), ", ", HumanBytes(total)));
  if (!ck.tensors().empty()) Emit(stdout, "");
  for (const ImportedTensor& t : ck.tensors()) {
    std::string notes = Notes(t);
    Emit(stdout, StrCat(t.name, "  ", DTypeName(t.dtype), "  ", ShapeString(t.shape), "  ",
                        HumanBytes(t.nbytes), notes.empty() ? "" : "  ", notes));
  }
  if (!ck.scaling().empty()) EmitScaling(ck);
  if (!ck.metadata().empty()) {
    Emit(stdout, "");
    Emit(stdout, StrCat("metadata (", ck.metadata().size(), ")"));
    for (const auto& [k, v] : ck.metadata()) {
      Emit(stdout, StrCat("  ", k, " = ", v.size() > 200 ? v.substr(0, 200) + "..." : v));
    }
  }
  EmitSkipped(ck);
  return kExitOk;
}

int RunConvertTorch(const ConvertOptions& options, const WriterOptions& wo) {
  auto opened = TorchCheckpoint::Open(options.in);
  if (!opened.ok()) return Fail(opened.status());
  const TorchCheckpoint& ck = **opened;
  EmitSkipped(ck);
  uint64_t total = 0;
  for (const ImportedTensor& t : ck.tensors()) total += t.nbytes;
  torch_import::ImportWriteOptions o;
  o.writer = wo;
  // safetensors output keeps the scaling state in its metadata, as for ferry -> safetensors.
  o.to = options.to;  // decided by RunConvert
  const bool to_safetensors = options.to == "safetensors";
  if (to_safetensors && !ck.scaling().empty()) {
    Json scaling = Json::array();
    for (const ScalingState& s : ck.scaling()) scaling.push_back(ScalingJson(s));
    o.scaling_in_metadata = true;
    o.extra_metadata.emplace_back(kScalingKey, scaling.dump());
  }
  Progress progress("converting", total);
  o.progress = [&](uint64_t n) { progress.Add(n); };
  Status st = torch_import::WriteImported(ck, options.out, o);
  progress.Finish();
  if (!st.ok()) return Fail(st);
  if (g_quiet) return kExitOk;
  Emit(stdout, StrCat(options.in, " (", ck.kind(), ") -> ", options.out));
  char timing[64];
  std::snprintf(timing, sizeof(timing), "%.2f s", progress.seconds());
  Emit(stdout, StrCat(ck.tensors().size(), " tensors, ", HumanBytes(total), " of tensor data, ",
                      ck.scaling().size(), " TransformerEngine modules' scaling state, ", timing,
                      " (", Rate(total, progress.seconds()), ")"));
  return kExitOk;
}

}  // namespace ferry::cli
