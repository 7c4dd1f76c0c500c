// Bodies of the fuzz targets over paths the file-format targets do not drive: the sharded
// index, the FP8-description JSON a safetensors file's metadata carries, the `ferry` command's
// describe path, and strings handed to the C API. Shared with tests/fuzz_regression_test.cc,
// like fuzz_entries.hpp (whose helpers they use).
#ifndef FERRY_TESTS_FUZZ_FUZZ_HOSTILE_ENTRIES_HPP_
#define FERRY_TESTS_FUZZ_FUZZ_HOSTILE_ENTRIES_HPP_

#include <algorithm>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/strict_json.hpp"
#include "base/util.hpp"
#include "cli/cli.hpp"
#include "cli/fp8_json.hpp"
#include "ferry/ferry.h"
#include "fuzz_entries.hpp"

namespace ferry::fuzz {

// Text for a terminal must hold no control byte, raw or as a C1 code point.
inline void ExpectPrintable(const std::string& text, const char* what) {
  // The quoted text is built only for a failure: built per byte, it made long texts quadratic
  // (a 7 KB description timed out in fuzz_fp8_json).
  for (size_t k = 0; k < text.size(); ++k) {
    unsigned char c = static_cast<unsigned char>(text[k]);
    bool c1 = c == 0xc2 && k + 1 < text.size() && static_cast<unsigned char>(text[k + 1]) >= 0x80 &&
              static_cast<unsigned char>(text[k + 1]) <= 0x9f;
    if (c < 0x20 || c == 0x7f || c1) Expect(false, what, Quote(text));
  }
}

// ---- sharded index ------------------------------------------------------------------------

// Input: the text of a "model.safetensors.index.json".
inline Status FuzzIndex(const uint8_t* data, size_t size) {
  static ScratchFile scratch;
  const std::string& path = scratch.Write(data, size);
  auto index = ReadSafetensorsIndex(path);
  if (!index.ok()) return Clean(index.status(), path);
  const std::string dir = path.substr(0, path.rfind('/') + 1);
  for (const std::string& shard : index->shards) {
    Expect(shard.compare(0, dir.size(), dir) == 0, "shard outside the index's directory", shard);
    Expect(shard.find("/../") == std::string::npos, "shard path climbs", shard);
  }
  Expect(std::is_sorted(index->weight_map.begin(), index->weight_map.end()),
         "weight_map not in name order");
  for (const auto& [name, k] : index->weight_map) {
    Expect(k < index->shards.size(), "weight_map position past the shards", name);
    ExpectPrintable(cli::Printable(name), "Printable of a tensor name");
  }
  for (const auto& [k, v] : index->metadata) {
    ExpectPrintable(cli::Printable(k) + cli::Printable(v), "Printable of index metadata");
  }
  return Status::Ok();
}

// ---- FP8 descriptions ---------------------------------------------------------------------

// Every accepted description survives description -> JSON -> description unchanged.
inline void RoundTripDescriptions(const std::vector<QuantizedTensor>& quantized,
                                  const std::vector<ScalingState>& scaling) {
  for (const QuantizedTensor& q : quantized) {
    cli::Json j = cli::QuantizedJson(q);
    auto again = cli::QuantizedFromJson(j);
    Expect(again.ok(), "QuantizedJson output does not parse back", again.status().ToString());
    Expect(cli::QuantizedJson(*again).dump() == j.dump(), "quantized round trip differs", j.dump());
    ExpectPrintable(cli::Printable(q.name), "Printable of a quantized name");
  }
  for (const ScalingState& s : scaling) {
    cli::Json j = cli::ScalingJson(s);
    auto again = cli::ScalingFromJson(j);
    Expect(again.ok(), "ScalingJson output does not parse back", again.status().ToString());
    Expect(cli::ScalingJson(*again).dump() == j.dump(), "scaling round trip differs", j.dump());
    ExpectPrintable(cli::Printable(cli::RecipeText(s.recipe)), "Printable of a recipe");
  }
}

// Input: u8 selector (bit 0: a scaling-state list, else quantized tensors), then the text of
// the metadata value.
inline Status FuzzFp8Json(const uint8_t* data, size_t size) {
  if (size < 1) return Status::Ok();
  const bool scaling = (data[0] & 1) != 0;
  std::vector<std::pair<std::string, std::string>> metadata = {
      {scaling ? cli::kScalingKey : cli::kQuantizedKey,
       std::string(reinterpret_cast<const char*>(data + 1), size - 1)}};
  cli::Fp8Metadata d = cli::DescribeFp8Metadata(std::move(metadata));
  Expect(d.kept.size() + (d.quantized.size() + d.scaling.size() > 0 ? 1 : 0) <= 1 &&
             d.metadata.size() == d.kept.size(),
         "a description both kept and taken");
  for (const auto& [key, why] : d.kept) {
    Expect(!why.empty(), "a description kept without a reason", key);
  }
  RoundTripDescriptions(d.quantized, d.scaling);
  return d.kept.empty() ? Status::Ok() : Status(StatusCode::kInvalidArgument, d.kept[0].second);
}

// ---- the CLI's describe path --------------------------------------------------------------

// Input: a safetensors (or TensorFerry) file image. What `ferry convert` and `ferry inspect`
// read from it: FP8 descriptions out of the metadata, rendered as text and as JSON.
inline Status FuzzDescribe(const uint8_t* data, size_t size) {
  static ScratchFile scratch;
  std::vector<uint8_t> file(data, data + size);
  FixFooterChecksum(file);
  const std::string& path = scratch.Write(file.data(), file.size());
  auto opened = Reader::Open(path);
  if (!opened.ok()) return Clean(opened.status(), path);
  const Reader& r = **opened;
  cli::Fp8Metadata d = cli::DescribeFp8Metadata(r.metadata());
  std::vector<QuantizedTensor> quantized = r.quantized();
  std::vector<ScalingState> scaling = r.scaling_states();
  quantized.insert(quantized.end(), d.quantized.begin(), d.quantized.end());
  scaling.insert(scaling.end(), d.scaling.begin(), d.scaling.end());
  RoundTripDescriptions(quantized, scaling);
  cli::Json j = cli::Json::object();
  for (const auto& [k, v] : d.metadata) {
    ExpectPrintable(cli::Printable(k) + " = " + cli::Printable(v), "Printable of metadata");
    j[k] = v;
  }
  for (size_t i = 0; i < r.num_tensors(); ++i) {
    ExpectPrintable(cli::Printable(r.tensor(i).name), "Printable of a tensor name");
  }
  ExpectPrintable(cli::Printable(r.producer()), "Printable of the producer");
  std::string text = j.dump(2, ' ', true, cli::Json::error_handler_t::replace);
  for (char c : text) {
    Expect((c >= 0x20 && c < 0x7f) || c == '\n', "inspect --json output not printable ASCII");
  }
  return Status::Ok();
}

// ---- strings through the C API ------------------------------------------------------------

// Input: fields separated by 0xff bytes: path, tensor name, metadata key, metadata value,
// module name. The C API sees each as a C string (up to its first NUL); the C++ API sees the
// whole field, NULs included, and must refuse what a C string would silently cut.
inline Status FuzzCStrings(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry_fuzz_c_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) Broken("mkdtemp");
    return tmpl;
  }();
  std::vector<std::string> f;
  f.emplace_back();
  for (size_t k = 0; k < size; ++k) {
    if (data[k] == 0xff) {
      if (f.size() == 5) break;
      f.emplace_back();
    } else {
      f.back() += static_cast<char>(data[k]);
    }
  }
  f.resize(5);
  auto cstr = [](const std::string& s) { return std::string(s.c_str()); };
  // Paths stay inside the scratch directory: one component, no separators.
  std::string leaf = f[0].substr(0, 200);
  std::replace(leaf.begin(), leaf.end(), '/', '_');
  const std::string path = dir + "/c_" + cstr(leaf);
  const std::string name = cstr(f[1]), key = cstr(f[2]), value = cstr(f[3]), module = cstr(f[4]);

  ferry_error_t err;
  auto clean = [&](int rc) {
    Expect(rc != FERRY_INTERNAL, "C API Internal error", err.message);
    if (rc != FERRY_OK) Expect(err.message[0] != '\0', "C API error without a message");
    return rc == FERRY_OK;
  };
  ferry_writer_options_t wo;
  ferry_writer_options_init(&wo);
  // No fsync, no O_DIRECT, one worker: the strings are under test, not the disk (with the
  // defaults an input cost ~60 ms, 17 executions per second).
  wo.durable = 0;
  wo.direct_io = 0;
  wo.threads = 1;
  ferry_writer_t* w = nullptr;
  bool added = false, keyed = false;
  if (clean(ferry_writer_create(path.c_str(), &wo, &w, &err))) {
    int64_t shape[1] = {1};
    uint8_t byte = 0x5a;
    added = clean(
        ferry_writer_add_tensor(w, name.c_str(), FERRY_DTYPE_U8, shape, 1, &byte, 1, -1, &err));
    keyed = clean(ferry_writer_set_metadata(w, key.c_str(), value.c_str(), &err));
    ferry_recipe_t recipe;
    ferry_recipe_init(&recipe, FERRY_RECIPE_NONE);
    (void)clean(ferry_writer_add_scaling_state(w, module.c_str(), &recipe, nullptr, 0, &err));
    bool committed = clean(ferry_writer_commit(w, &err));
    ferry_writer_free(w);
    if (committed) {
      ferry_reader_t* r = nullptr;
      Expect(clean(ferry_reader_open(path.c_str(), nullptr, &r, &err)), "committed file opens",
             err.message);
      ferry_tensor_info_t info;
      info.struct_size = sizeof(info);
      Expect(!added || clean(ferry_reader_find_tensor(r, name.c_str(), &info, &err)),
             "an added tensor is found", name);
      if (keyed) {
        const char* got = nullptr;
        Expect(clean(ferry_reader_metadata_get(r, key.c_str(), &got, &err)) && got == value,
               "metadata value read back", key);
        for (size_t i = 0; i < ferry_reader_num_metadata(r); ++i) {
          const char *k = nullptr, *v = nullptr;
          size_t kn = 0, vn = 0;
          Expect(clean(ferry_reader_metadata_entry(r, i, &k, &kn, &v, &vn, &err)) &&
                     std::strlen(k) == kn && vn >= std::strlen(v),
                 "metadata entry lengths");
        }
      }
      ferry_reader_free(r);
      ::unlink(path.c_str());
    }
  }
  // Through the C++ API, which has lengths: a NUL anywhere is refused, never cut.
  WriterOptions cpp_options;
  cpp_options.durable = false;
  cpp_options.direct_io = false;
  cpp_options.threads = 1;
  auto cw = Writer::Create(dir + "/cpp.ferry", cpp_options);
  Expect(cw.ok(), "scratch writer", cw.status().ToString());
  uint8_t byte = 1;
  Status st = cw->AddTensor(f[1], DType::kU8, {1}, &byte, 1);
  if (f[1].find('\0') != std::string::npos) Expect(!st.ok(), "a name with a NUL accepted");
  Status mst = cw->SetMetadata(f[2], f[3]);
  if (f[2].find('\0') != std::string::npos) Expect(!mst.ok(), "a key with a NUL accepted");
  cw->Abort();
  auto bad = Writer::Create(dir + "/cpp" + leaf, cpp_options);
  if (leaf.find('\0') != std::string::npos) {
    Expect(!bad.ok(), "a path with a NUL accepted");
  } else if (bad.ok()) {
    bad->Abort();
  }
  return Status::Ok();
}

}  // namespace ferry::fuzz

#endif  // FERRY_TESTS_FUZZ_FUZZ_HOSTILE_ENTRIES_HPP_
