// `ferry inspect` and `ferry convert` of PyTorch checkpoints: torch.save files (.pt, .bin),
// sharded pytorch_model.bin.index.json and DCP folders, read without running their pickles
// (src/torch_import).
#include <cstdio>
#include <set>

#include "cli.hpp"
#include "fp8_json.hpp"
#include "import/torch/import_writer.hpp"
#include "import/torch/torch_checkpoint.hpp"
#include "base/util.hpp"

namespace ferry::cli {

namespace {

using torch_import::ImportedTensor;
using torch_import::TorchCheckpoint;

// Printable: control bytes escaped, as Quote does, without the quotes.
std::string Printable(const std::string& s) {
  std::string q = Quote(s);
  return q.substr(1, q.size() - 2);
}

std::string Notes(const ImportedTensor& t) {
  std::string notes;
  if (!torch_import::IsContiguous(*t.ref)) notes += "strided view (copied dense)";
  if (t.ref->storage_offset != 0)
    notes += std::string(notes.empty() ? "" : ", ") + "storage offset";
  if (t.location != "cpu") {
    notes += std::string(notes.empty() ? "" : ", ") + "saved from " + Printable(t.location);
  }
  return notes;
}

void PrintSkipped(const TorchCheckpoint& ck) {
  for (const std::string& s : ck.skipped()) {
    std::fprintf(stderr, "ferry: warning: not imported: %s\n", Printable(s).c_str());
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
    std::string text = j.dump(2, ' ', false, Json::error_handler_t::replace);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fputc('\n', stdout);
    return kExitOk;
  }
  std::printf("file       %s\n", Printable(ck.path()).c_str());
  std::printf("format     %s (read without running its pickles)\n", ck.kind().c_str());
  std::printf("tensors    %zu, %s\n", ck.tensors().size(), HumanBytes(total).c_str());
  if (!ck.tensors().empty()) {
    std::printf("\n");
    for (const ImportedTensor& t : ck.tensors()) {
      std::string notes = Notes(t);
      std::printf("%s  %s  %s  %s%s%s\n", Printable(t.name).c_str(), DTypeName(t.dtype),
                  ShapeString(t.shape).c_str(), HumanBytes(t.nbytes).c_str(),
                  notes.empty() ? "" : "  ", notes.c_str());
    }
  }
  if (!ck.scaling().empty()) {
    std::printf("\nTransformerEngine extra state (%zu modules)\n", ck.scaling().size());
    for (const ScalingState& s : ck.scaling()) {
      std::printf("  %s: %s\n", Printable(s.module).c_str(), RecipeText(s.recipe).c_str());
      if (s.states.empty()) std::printf("    (no scaling state)\n");
      for (const DirectionState& d : s.states) {
        std::printf("    %s: num_gemms %d, %zu slots, amax_history %d x %zu\n",
                    DirectionName(d.direction), d.num_gemms, d.slot_roles.size(), d.history_len,
                    d.slot_roles.size());
      }
    }
  }
  if (!ck.metadata().empty()) {
    std::printf("\nmetadata (%zu)\n", ck.metadata().size());
    for (const auto& [k, v] : ck.metadata()) {
      std::string value = v.size() > 200 ? v.substr(0, 200) + "..." : v;
      std::printf("  %s = %s\n", Printable(k).c_str(), Printable(value).c_str());
    }
  }
  PrintSkipped(ck);
  return kExitOk;
}

int RunConvertTorch(const ConvertOptions& options, const WriterOptions& wo) {
  auto opened = TorchCheckpoint::Open(options.in);
  if (!opened.ok()) return Fail(opened.status());
  const TorchCheckpoint& ck = **opened;
  PrintSkipped(ck);
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
  std::printf("%s (%s) -> %s\n", Printable(options.in).c_str(), ck.kind().c_str(),
              Printable(options.out).c_str());
  std::printf(
      "%zu tensors, %s of tensor data, %zu TransformerEngine modules' scaling state, "
      "%.2f s (%s)\n",
      ck.tensors().size(), HumanBytes(total).c_str(), ck.scaling().size(), progress.seconds(),
      Rate(total, progress.seconds()).c_str());
  return kExitOk;
}

}  // namespace ferry::cli
