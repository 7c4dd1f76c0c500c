// Loads of checkpoints named by URL (s3://, http://, https://) or path, every tensor, timed
// from Reader::Open to the last byte in memory: what a process that resumes from an object store
// pays. remote_bench.py drives it beside the parallel range-GET ceiling and peer loaders.
//
//   remote_load [--device] [--reps=N] [--threads=N] [--verify] URL...
//
// Prints one JSON line per load: {"url", "rep", "seconds", "tensor_bytes", "stored_bytes",
// "target"}. tensor_bytes counts uncompressed tensor bytes (what a caller receives);
// stored_bytes the object's size (what crossed the network, trailer and footer included).
// --device loads onto the current GPU (Loader::Load, default allocator); without it, into host
// memory (Loader::LoadToHost). S3 settings come from the usual AWS_* variables.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ferry/loader.hpp"

namespace {

struct Args {
  bool device = false;
  bool verify = false;
  int reps = 1;
  int threads = 0;
  std::vector<std::string> urls;
};

bool Flag(const char* arg, const char* name, const char** value) {
  size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0) return false;
  if (arg[n] == '\0') {
    *value = nullptr;
    return true;
  }
  if (arg[n] != '=') return false;
  *value = arg + n + 1;
  return true;
}

// JSON string contents: the URLs printed here are the caller's own, so escaping quotes and
// backslashes is enough.
std::string Quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

int LoadOnce(const Args& args, const std::string& url, int rep) {
  auto t0 = std::chrono::steady_clock::now();
  auto reader = ferry::Reader::Open(url);
  if (!reader.ok()) {
    std::fprintf(stderr, "remote_load: %s\n", reader.status().ToString().c_str());
    return 1;
  }
  ferry::LoaderOptions options;
  options.threads = args.threads;
  options.verify = args.verify;
  auto loader = ferry::Loader::Create(options);
  if (!loader.ok()) {
    std::fprintf(stderr, "remote_load: %s\n", loader.status().ToString().c_str());
    return 1;
  }
  auto loaded = args.device ? (*loader)->Load(**reader, {}) : (*loader)->LoadToHost(**reader, {});
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!loaded.ok()) {
    std::fprintf(stderr, "remote_load: %s\n", loaded.status().ToString().c_str());
    return 1;
  }
  uint64_t tensor_bytes = 0;
  for (const ferry::LoadedTensor& t : *loaded) tensor_bytes += t.nbytes;
  std::printf(
      "{\"url\": %s, \"rep\": %d, \"seconds\": %.6f, \"tensor_bytes\": %llu, "
      "\"stored_bytes\": %llu, \"target\": \"%s\"}\n",
      Quoted(url).c_str(), rep, seconds, static_cast<unsigned long long>(tensor_bytes),
      static_cast<unsigned long long>((*reader)->file_size()), args.device ? "device" : "host");
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const char* v = nullptr;
    if (Flag(argv[i], "--device", &v)) {
      args.device = true;
    } else if (Flag(argv[i], "--verify", &v)) {
      args.verify = true;
    } else if (Flag(argv[i], "--reps", &v) && v != nullptr) {
      args.reps = std::max(1, std::atoi(v));
    } else if (Flag(argv[i], "--threads", &v) && v != nullptr) {
      args.threads = std::atoi(v);
    } else if (argv[i][0] == '-') {
      std::fprintf(stderr, "remote_load: unknown option %s\n", argv[i]);
      return 2;
    } else {
      args.urls.emplace_back(argv[i]);
    }
  }
  if (args.urls.empty()) {
    std::fprintf(stderr,
                 "usage: remote_load [--device] [--reps=N] [--threads=N] [--verify] URL...\n");
    return 2;
  }
  for (const std::string& url : args.urls) {
    for (int rep = 0; rep < args.reps; ++rep) {
      if (int rc = LoadOnce(args, url, rep); rc != 0) return rc;
    }
  }
  return 0;
}
