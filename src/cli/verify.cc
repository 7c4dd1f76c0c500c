// `ferry verify`: every block checksum of every tensor, in parallel; each mismatch reported.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>

#include "base/util.hpp"
#include "base/worker_pool.hpp"
#include "cli.hpp"
#include "format/block_source.hpp"

namespace ferry::cli {

namespace {

struct Failure {
  size_t tensor;
  uint64_t block;
  std::string message;
};

}  // namespace

int RunVerify(const VerifyOptions& options) {
  // Opening already checks the trailer, the footer checksum and every extent.
  auto opened = Reader::Open(options.file);
  if (!opened.ok()) return Fail(opened.status());
  const Reader& reader = **opened;
  const BlockSource& blocks = BlocksOf(reader);

  uint64_t raw_total = 0;
  for (size_t i = 0; i < reader.num_tensors(); ++i) raw_total += blocks.RawSize(i);

  if (!blocks.has_checksums()) {
    if (options.json) {
      nlohmann::ordered_json j = {{"path", reader.path()},
                                  {"format", "safetensors"},
                                  {"checksums", false},
                                  {"tensors", reader.num_tensors()},
                                  {"bytes", raw_total},
                                  {"ok", true},
                                  {"failures", nlohmann::ordered_json::array()}};
      PrintJson(j);
    } else {
      std::printf(
          "%s: safetensors file, header valid (%zu tensors, %s, no overlaps, all within the "
          "file)\nchecksums: unavailable (safetensors stores none); convert to TensorFerry to "
          "get them\n",
          reader.path().c_str(), reader.num_tensors(), HumanBytes(raw_total).c_str());
    }
    return kExitOk;
  }

  // One work item per block, so one large tensor spreads over every thread.
  std::vector<std::pair<size_t, uint64_t>> items;
  for (size_t i = 0; i < reader.num_tensors(); ++i) {
    for (uint64_t b = 0; b < blocks.NumBlocks(i); ++b) items.emplace_back(i, b);
  }
  int threads = options.threads > 0 ? options.threads : DefaultThreads(16);
  threads = static_cast<int>(std::min<size_t>(threads, std::max<size_t>(1, items.size())));

  Progress progress("verifying", raw_total);
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::vector<Failure> failures;
  Status resource;
  auto work = [&] {
    for (;;) {
      size_t k = next.fetch_add(1);
      if (k >= items.size()) break;
      auto [i, b] = items[k];
      Status st = blocks.VerifyBlock(i, b);
      if (st.code() == StatusCode::kResourceExhausted) {
        // Not a verdict on the file: the whole check fails, saying why. Huge blocks lease
        // their decode scratch from one budget (docs/SECURITY.md), so threads take turns.
        std::lock_guard<std::mutex> lock(mu);
        if (resource.ok()) resource = st;
        next = items.size();
        break;
      }
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        failures.push_back(Failure{i, b, st.message()});
      }
      progress.Add(blocks.Block(i, b).raw_size);
    }
  };
  const int ran = RunParts(threads, [&](int) { work(); });
  if (ran < threads) {
    // Fewer threads than asked for (a thread or address-space limit): slower, same result.
    std::fprintf(stderr,
                 "ferry: warning: verifying with %d threads, not %d: the system refused more\n",
                 ran, threads);
  }
  progress.Finish();
  if (!resource.ok()) return Fail(resource);
  double secs = progress.seconds();
  std::sort(failures.begin(), failures.end(), [](const Failure& a, const Failure& b) {
    return a.tensor != b.tensor ? a.tensor < b.tensor : a.block < b.block;
  });
  size_t bad_tensors = 0;
  for (size_t k = 0; k < failures.size(); ++k) {
    if (k == 0 || failures[k].tensor != failures[k - 1].tensor) ++bad_tensors;
  }

  if (options.json) {
    nlohmann::ordered_json jf = nlohmann::ordered_json::array();
    for (const Failure& f : failures) {
      jf.push_back({{"tensor", std::string(blocks.Name(f.tensor))},
                    {"block", f.block},
                    {"message", f.message}});
    }
    nlohmann::ordered_json j = {{"path", reader.path()},  {"format", "tensorferry"},
                                {"checksums", true},      {"tensors", reader.num_tensors()},
                                {"blocks", items.size()}, {"bytes", raw_total},
                                {"seconds", secs},        {"ok", failures.empty()},
                                {"failures", jf}};
    PrintJson(j);
  } else {
    for (const Failure& f : failures) std::printf("FAILED %s\n", Printable(f.message).c_str());
    if (failures.empty()) {
      if (!g_quiet) {
        std::printf(
            "%s: OK: footer and %zu tensors (%zu blocks, %s) match their XXH3-64 "
            "checksums (%.2f s, %s)\n",
            reader.path().c_str(), reader.num_tensors(), items.size(),
            HumanBytes(raw_total).c_str(), secs, Rate(raw_total, secs).c_str());
      }
    } else {
      std::printf("%s: FAILED: %zu of %zu blocks in %zu of %zu tensors do not match\n",
                  reader.path().c_str(), failures.size(), items.size(), bad_tensors,
                  reader.num_tensors());
    }
  }
  return failures.empty() ? kExitOk : kExitFailure;
}

}  // namespace ferry::cli
