// Shared pieces of the `ferry` command: options of each subcommand, formatting, progress.
#ifndef FERRY_SRC_CLI_CLI_HPP_
#define FERRY_SRC_CLI_CLI_HPP_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry::cli {

// Exit codes: scripts tell a bad command line from a failed check or a broken file.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // an error, or a checksum that does not match
inline constexpr int kExitUsage = 2;

struct InspectOptions {
  std::string file;
  bool json = false;
};

struct VerifyOptions {
  std::string file;
  int threads = 0;
  bool json = false;
};

struct ConvertOptions {
  std::string in, out;
  std::string to;  // "ferry" or "safetensors"; empty: by OUT's extension (ChooseOutputFormat)
  std::string encoding = "raw";
  int level = WriterOptions().zstd_level;  // the library default (1)
  std::string block_size = "4MiB";
  int threads = 0;
};

struct BenchOptions {
  std::string file;
  std::string generate;  // a size: "1GiB"; empty: bench `file`
  std::string dir;       // where --generate writes; empty: /dev/shm if usable, else $TMPDIR
  bool keep = false;
  int threads = 0;
  int slot_mib = 4;
  int staging_mib = 64;
  std::string path = "auto";
  std::string io = "auto";
  int repeat = 5;
  int device = -1;
  bool verify = false;
  bool prealloc = false;
  std::string encoding = "raw";  // of the --generate checkpoint
  std::string dtype = "bf16";    // of the --generate checkpoint: bf16, f8_e4m3, f8_e5m2
  // Evict the file from the page cache before the first load, which then reads the disk;
  // its rate is printed beside the disk's O_DIRECT read rate.
  bool cold = false;
};

int RunInspect(const InspectOptions& options);
int RunVerify(const VerifyOptions& options);
int RunConvert(const ConvertOptions& options);
int RunBench(const BenchOptions& options);
// PyTorch checkpoints (torch_input.cc): torch.save files, sharded .bin indexes, DCP folders.
bool IsTorchInput(const std::string& path);
int RunInspectTorch(const InspectOptions& options);
int RunConvertTorch(const ConvertOptions& options, const WriterOptions& writer_options);

// --quiet: no progress display and no summary of a job that succeeded; errors still print.
extern bool g_quiet;

// Ctrl-C and SIGTERM during a job that writes a file: the first one is recorded (the job sees
// it through InterruptSignal, stops, and its writer removes the temporary file); a second one
// ends the process at once. Signals ignored when ferry started (nohup) stay ignored.
void CatchInterrupts();
// The signal that asked the job to stop, or 0.
int InterruptSignal();

// An encoding by name: EncodingName's spelling ("raw", "zstd", "shuffle+zstd", "planes", the
// one `ferry` prints) or the Python keyword's ("shuffle_zstd"); nullopt when unknown.
std::optional<Encoding> ParseEncoding(std::string_view name);
// The accepted names, for --help and messages.
inline constexpr const char* kEncodingNames = "raw, zstd, shuffle+zstd (or shuffle_zstd), planes";

// Prints "ferry: <code>: <message>" to stderr and returns kExitFailure.
int Fail(const Status& status);

// Text from a file made safe for a terminal: control bytes (C0, DEL, and C1 code points, which
// some terminals obey as escape sequences) and bytes that are not UTF-8 become
// \xNN; valid UTF-8 text stays as it is. Everything `ferry` prints from a file goes through it.
std::string Printable(std::string_view text);

// Prints a JSON document and a newline on stdout: every `--json` output goes through here.
// ASCII only (control characters and every non-ASCII code point, C1 controls among them, are
// \u escapes, so nothing from a file reaches a terminal raw), and bytes that are not UTF-8 (a
// name, a metadata value, the path itself) are replaced (U+FFFD) instead of failing the dump:
// a good file is never reported as bad because of what it or its path is called.
void PrintJson(const nlohmann::ordered_json& document);

// "1.50 GiB", "512 B".
std::string HumanBytes(uint64_t bytes);
// "[4096, 11008]"; "[]" for a scalar.
std::string ShapeString(const std::vector<int64_t>& shape);
// "12.34 GB/s" (decimal gigabytes, like every figure TensorFerry reports).
std::string Rate(double bytes, double seconds);
// Parses "1GiB", "512MiB", "4M" (binary), "2GB" (decimal) or a plain byte count.
std::optional<uint64_t> ParseSize(const std::string& text);

// Progress of one long job, in bytes, on stderr. On a terminal, one line redrawn at most ten
// times a second, cut to the terminal's width so that it never wraps (a wrapped line cannot be
// redrawn in place), shown only once the job has run for a second (quick jobs stay quiet) and
// erased at the end; elsewhere (logs, pipes) a plain line every ten seconds; nothing with
// --quiet. Add may be called from any thread.
class Progress {
 public:
  Progress(std::string label, uint64_t total);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void Add(uint64_t bytes);
  // Erases the bar; idempotent. Call before printing the job's result.
  void Finish();
  double seconds() const;

 private:
  void Render(uint64_t done, std::chrono::steady_clock::time_point now);

  std::string label_;
  uint64_t total_;
  bool tty_;
  bool quiet_;
  std::atomic<uint64_t> done_{0};
  std::chrono::steady_clock::time_point start_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point last_;
  bool shown_ = false;
  bool finished_ = false;
};

}  // namespace ferry::cli

#endif  // FERRY_SRC_CLI_CLI_HPP_
