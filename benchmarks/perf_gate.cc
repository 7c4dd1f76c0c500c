// The performance gate: checks that run on a small, busy CI machine (2 cores, no GPU) and fail
// when the library gets several times slower than it should be. Every check is a ratio of two
// rates measured in the same run, interleaved repetition by repetition, so that the machine's
// speed and the load of other processes cancel: the library's path against a reference that
// does the same work without the library (memcpy, libzstd called directly, a plain unshuffle,
// pread and XXH3 of the footer, write()).
//
//   perf_gate [--dir DIR] [--mib N] [--reps N] [--smoke] [--keep] [--only TEXT]
//
// DIR: where the scratch checkpoints go (default /dev/shm when usable, else TMPDIR or /tmp);
// they are removed at exit unless --keep. --only: the checks whose names contain TEXT. --smoke:
// small files and one repetition, checks printed but not enforced (a run under sanitizers). Each
// check reruns once when it fails; exit status 1 when a check failed twice or a load returned wrong
// bytes, 2 on a set-up error.
//
// Thresholds sit about halfway (geometrically) between the ratio measured on the development
// machines and a third of it, so a 3x slowdown fails and noise does not (benchmarks/README.md,
// "Performance gate").
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#define XXH_INLINE_ALL  // as the library uses it: no xxhash library to link
#include <xxhash.h>

#include "codec/planes.hpp"
#include "ferry/ferry.hpp"
#include "ferry/loader.hpp"
#include "format/block_source.hpp"

namespace {

using namespace ferry;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Printf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Printf(const char* fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "perf_gate: %s\n", what.c_str());
  std::exit(2);
}

template <class T>
T Check(Result<T> r, const char* what) {
  if (!r.ok()) Die(std::string(what) + ": " + r.status().ToString());
  return std::move(*r);
}
void Check(const Status& st, const char* what) {
  if (!st.ok()) Die(std::string(what) + ": " + st.ToString());
}

struct Options {
  std::string dir;
  uint64_t mib = 64;
  int reps = 7;
  bool smoke = false;
  bool keep = false;
  std::string only;  // run the checks whose names contain this
};

// ---- data ---------------------------------------------------------------------------------

// bf16 of weight-like magnitude (|x| in 2^-7..2^0, random sign and mantissa): shuffle+zstd
// compresses it about 1.4x, as it does trained weights.
void FillBf16(uint8_t* out, uint64_t bytes, uint64_t seed) {
  uint64_t x = 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
  for (uint64_t i = 0; i + 1 < bytes; i += 2) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    uint16_t exponent = static_cast<uint16_t>(120 + (x >> 32) % 7);
    uint16_t v = static_cast<uint16_t>(((x >> 8) & 0x8000) | (exponent << 7) | (x & 0x7f));
    std::memcpy(out + i, &v, 2);
  }
}

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // in the raw image and in the destination, 64-byte aligned
};

// Shapes of a transformer layer: blocks cut at 4 MiB leave partial last blocks, as real
// tensors do.
std::vector<TensorSpec> LayerTensors(uint64_t target) {
  const std::vector<std::pair<const char*, std::vector<int64_t>>> layer = {
      {"mlp.up_proj.weight", {2688, 1024}},   {"self_attn.q_proj.weight", {1024, 1024}},
      {"input_layernorm.weight", {1024}},     {"self_attn.k_proj.weight", {256, 1024}},
      {"mlp.down_proj.weight", {1024, 2688}}, {"self_attn.o_proj.weight", {1024, 1024}},
  };
  std::vector<TensorSpec> out;
  uint64_t total = 0;
  for (int l = 0; total < target; ++l) {
    for (const auto& [name, shape] : layer) {
      TensorSpec t;
      t.name = "model.layers." + std::to_string(l) + "." + name;
      t.shape = shape;
      t.bytes = 2;
      for (int64_t d : shape) t.bytes *= static_cast<uint64_t>(d);
      t.offset = total;
      total += (t.bytes + 63) / 64 * 64;
      out.push_back(std::move(t));
    }
  }
  return out;
}

const TensorSpec& SpecOf(const std::vector<TensorSpec>& tensors, std::string_view name) {
  for (const TensorSpec& t : tensors) {
    if (t.name == name) return t;
  }
  Die("no tensor " + std::string(name));
}

uint64_t ImageBytes(const std::vector<TensorSpec>& tensors) {
  const TensorSpec& last = tensors.back();
  return last.offset + (last.bytes + 63) / 64 * 64;
}

uint64_t PayloadBytes(const std::vector<TensorSpec>& tensors) {
  uint64_t n = 0;
  for (const TensorSpec& t : tensors) n += t.bytes;
  return n;
}

WriterOptions ScratchWriter(Encoding encoding) {
  WriterOptions o;
  o.durable = false;  // scratch files: no fsync
  o.direct_io = false;
  o.encoding = encoding;
  return o;
}

void WriteCheckpoint(const std::string& path, Encoding encoding,
                     const std::vector<TensorSpec>& tensors, const uint8_t* image) {
  Writer w = Check(Writer::Create(path, ScratchWriter(encoding)), "create");
  for (const TensorSpec& t : tensors) {
    Check(w.AddTensor(t.name, DType::kBF16, t.shape, image + t.offset, t.bytes, encoding), "add");
  }
  Check(w.Commit(), "commit");
}

// ---- timing -------------------------------------------------------------------------------

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds per run of a subject and its reference, run alternately (each once untimed first):
// wall-clock seconds.
struct Timings {
  std::vector<double> subject, reference;
};

Timings Interleaved(int reps, const std::function<void()>& subject,
                    const std::function<void()>& reference) {
  reference();
  subject();
  Timings t;
  for (int k = 0; k < reps; ++k) {
    double t0 = Now();
    reference();
    double t1 = Now();
    subject();
    double t2 = Now();
    t.reference.push_back(t1 - t0);
    t.subject.push_back(t2 - t1);
  }
  return t;
}

// Runs fn(worker) on `threads` threads (the caller's among them) and waits for all.
void OnThreads(int threads, const std::function<void(int)>& fn) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (auto& t : pool) t.join();
}

// ---- the references -----------------------------------------------------------------------

// One stored block and where its raw bytes go.
struct RefBlock {
  const uint8_t* src;
  uint64_t stored, raw;
  bool zstd, planes;
  uint8_t* dst;
};

// Decodes a checkpoint's blocks without the library's read path: libzstd called directly, a
// plain unshuffle (kept out of the library's codec so that a slower library unshuffle shows),
// the PLANES codec's own entry point. Per-thread contexts and scratch are made once.
class RefDecoder {
 public:
  RefDecoder(const Reader& reader, uint8_t* dst, const std::vector<TensorSpec>& tensors,
             int max_threads) {
    const BlockSource& source = BlocksOf(reader);
    uint64_t largest = 0;
    for (size_t i = 0; i < source.size(); ++i) {
      const TensorInfo info = source.Info(i);
      shuffled_ = shuffled_ || info.encoding == Encoding::kShuffleZstd;
      uint8_t* base = dst + SpecOf(tensors, info.name).offset;
      for (uint64_t b = 0; b < source.NumBlocks(i); ++b) {
        const StoredBlock s = source.Block(i, b);
        blocks_.push_back(RefBlock{source.mapping()->data() + s.file_offset, s.stored_size,
                                   s.raw_size, s.compressed, s.planes, base + s.raw_offset});
        largest = std::max(largest, s.raw_size);
      }
    }
    for (int t = 0; t < max_threads; ++t) {
      ctx_.emplace_back(ZSTD_createDCtx(), ZSTD_freeDCtx);
      scratch_.emplace_back(largest, uint8_t{1});  // touched now, not in the timed runs
    }
  }

  void Run(int threads) {
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    OnThreads(threads, [&](int w) {
      for (size_t k; (k = next.fetch_add(1)) < blocks_.size();) {
        if (!Decode(blocks_[k], ctx_[w].get(), scratch_[w].data())) failed = true;
      }
    });
    if (failed) Die("reference decode failed");
  }

 private:
  bool Decode(const RefBlock& b, ZSTD_DCtx* ctx, uint8_t* scratch) const {
    if (b.planes) return planes::Decode(b.src, b.stored, b.dst, b.raw, scratch).ok();
    uint8_t* out = shuffled_ ? scratch : b.dst;
    if (b.zstd) {
      if (ZSTD_decompressDCtx(ctx, out, b.raw, b.src, b.stored) != b.raw) return false;
    } else {
      std::memcpy(out, b.src, b.raw);
    }
    if (shuffled_) Unshuffle2(scratch, b.dst, b.raw);
    return true;
  }

  // bf16: two planes of count bytes, then a trailing odd byte as stored.
  static void Unshuffle2(const uint8_t* src, uint8_t* dst, uint64_t n) {
    const uint64_t count = n / 2;
    const uint8_t* lo = src;
    const uint8_t* hi = src + count;
    for (uint64_t i = 0; i < count; ++i) {
      dst[2 * i] = lo[i];
      dst[2 * i + 1] = hi[i];
    }
    if (n % 2) dst[n - 1] = src[n - 1];
  }

  std::vector<RefBlock> blocks_;
  bool shuffled_ = false;
  std::vector<std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)>> ctx_;
  std::vector<std::vector<uint8_t>> scratch_;
};

// memcpy of every tensor's bytes from the mapping of a raw checkpoint into the destination.
void CopyRaw(const Reader& reader, uint8_t* dst, const std::vector<TensorSpec>& tensors,
             int threads) {
  const BlockSource& source = BlocksOf(reader);
  constexpr uint64_t kPiece = uint64_t{4} << 20;  // the loader's piece size
  struct Piece {
    const uint8_t* src;
    uint8_t* dst;
    uint64_t len;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < source.size(); ++i) {
    const uint8_t* from = source.mapping()->data() + source.FileOffset(i);
    uint8_t* to = dst + SpecOf(tensors, source.Name(i)).offset;
    for (uint64_t b = 0; b < source.RawSize(i); b += kPiece) {
      pieces.push_back(Piece{from + b, to + b, std::min(kPiece, source.RawSize(i) - b)});
    }
  }
  std::atomic<size_t> next{0};
  OnThreads(threads, [&](int) {
    for (size_t k; (k = next.fetch_add(1)) < pieces.size();) {
      std::memcpy(pieces[k].dst, pieces[k].src, pieces[k].len);
    }
  });
}

// ---- checks -------------------------------------------------------------------------------

// Seconds per run (medians, or the fastest runs) and the subject's speed as a fraction of the
// reference's.
struct Measured {
  double subject_secs = 0, reference_secs = 0, ratio = 0;
};

// Throughput checks: the median of the runs' pairwise ratios (each pair ran back to back, under
// the same load from other processes), beside the median times.
Measured Medians(const Timings& t) {
  std::vector<double> ratios;
  for (size_t k = 0; k < t.subject.size(); ++k) ratios.push_back(t.reference[k] / t.subject[k]);
  return Measured{Median(t.subject), Median(t.reference), Median(ratios)};
}
// Operations of a few milliseconds spread over threads (open + index parses its footer in
// slices): their CPU time is the sum over the threads, so the fastest wall-clock run of many,
// which is what a caller waits for and what a busy machine can only slow down, is compared.
Measured Least(const Timings& t) {
  Measured m{*std::min_element(t.subject.begin(), t.subject.end()),
             *std::min_element(t.reference.begin(), t.reference.end()), 0};
  m.ratio = m.reference_secs / m.subject_secs;
  return m;
}

struct Gate {
  Options options;
  std::vector<std::string> failed;
  int held = 0;

  // Runs a check, once more if it misses its threshold; prints both figures and the ratio.
  bool Selected(const std::string& name) const {
    return name.find(options.only) != std::string::npos;
  }

  void Run(const std::string& name, const std::string& reference, uint64_t bytes, double min_ratio,
           const std::function<Measured()>& measure, std::string* note = nullptr) {
    if (!Selected(name)) return;
    for (int attempt = 0; attempt < 2; ++attempt) {
      Measured m = measure();
      const bool held_ratio = m.ratio >= min_ratio, ok = held_ratio || options.smoke;
      const char* verdict = held_ratio      ? "ok"
                            : options.smoke ? "low (smoke run: not enforced)"
                            : attempt == 0  ? "LOW, measuring again"
                                            : "FAILED";
      std::printf("%-38s %10s  vs %-22s %10s  ratio %.2f (min %.2f)  %s%s%s\n", name.c_str(),
                  Figure(bytes, m.subject_secs).c_str(), reference.c_str(),
                  Figure(bytes, m.reference_secs).c_str(), m.ratio, min_ratio, verdict,
                  note != nullptr && !note->empty() ? "  " : "",
                  note != nullptr ? note->c_str() : "");
      std::fflush(stdout);
      if (note != nullptr) note->clear();
      if (ok) {
        ++held;
        return;
      }
    }
    failed.push_back(name);
  }

  static std::string Figure(uint64_t bytes, double secs) {
    return bytes == 0 ? Printf("%.2f ms", secs * 1e3) : Printf("%.2f GB/s", bytes / secs / 1e9);
  }
};

std::vector<LoadRequest> Requests(const std::vector<TensorSpec>& tensors, uint8_t* dst) {
  std::vector<LoadRequest> out;
  for (const TensorSpec& t : tensors) {
    LoadRequest q;
    q.name = t.name;
    q.dst = dst + t.offset;
    q.dst_bytes = t.bytes;
    out.push_back(std::move(q));
  }
  return out;
}

// Runs `fill` once into a poisoned `dst`: it must leave there exactly the tensors written.
void ExpectImage(uint8_t* dst, const std::vector<uint8_t>& image,
                 const std::vector<TensorSpec>& tensors, const std::string& what,
                 const std::function<void()>& fill, std::vector<std::string>* wrong) {
  std::memset(dst, 0xA5, image.size());
  fill();
  for (const TensorSpec& t : tensors) {
    if (std::memcmp(dst + t.offset, image.data() + t.offset, t.bytes) != 0) {
      std::printf("%s: wrong bytes in %s\n", what.c_str(), t.name.c_str());
      wrong->push_back(what);
      return;
    }
  }
}

// Reads the footer the way an open must at least: pread into fresh memory, then XXH3-64.
double ReadFooter(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Die("open " + path);
  struct stat st;
  ::fstat(fd, &st);
  uint8_t trailer[24];
  if (::pread(fd, trailer, sizeof(trailer), st.st_size - 24) != 24) Die("trailer");
  uint64_t footer = 0;
  std::memcpy(&footer, trailer, 8);
  std::unique_ptr<uint8_t[]> buf(new uint8_t[footer]);
  const off_t at = st.st_size - 24 - static_cast<off_t>(footer);
  if (::pread(fd, buf.get(), footer, at) != static_cast<ssize_t>(footer)) Die("footer");
  volatile uint64_t sum = XXH3_64bits(buf.get(), footer);
  (void)sum;
  ::close(fd);
  return static_cast<double>(footer);
}

void WriteMany(const std::string& path, int count) {
  Writer w = Check(Writer::Create(path, ScratchWriter(Encoding::kRaw)), "create");
  for (int i = 0; i < count; ++i) {
    // Names shaped like a mixture of experts': long shared prefixes.
    char name[96];
    std::snprintf(name, sizeof(name), "model.layers.%d.experts.%d.mlp.down_proj.weight", i / 128,
                  i % 128);
    uint16_t v[2] = {static_cast<uint16_t>(i), static_cast<uint16_t>(i >> 16)};
    Check(w.AddTensor(name, DType::kBF16, {2}, v, sizeof(v)), "add");
  }
  Check(w.Commit(), "commit");
}

void WriteAll(const std::string& path, const uint8_t* data, uint64_t n) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Die("create " + path);
  for (uint64_t done = 0; done < n;) {
    ssize_t w = ::write(fd, data + done, std::min<uint64_t>(n - done, uint64_t{1} << 30));
    if (w <= 0) Die("write " + path);
    done += static_cast<uint64_t>(w);
  }
  ::close(fd);
}

std::string DefaultDir() {
  if (::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp ? tmp : "/tmp";
}

Options Parse(int argc, char** argv) {
  Options o;
  o.dir = DefaultDir();
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--dir") {
      o.dir = value();
    } else if (a == "--mib") {
      o.mib = std::stoull(value());
    } else if (a == "--reps") {
      o.reps = std::max(1, std::stoi(value()));
    } else if (a == "--smoke") {
      o.smoke = true;
    } else if (a == "--keep") {
      o.keep = true;
    } else if (a == "--only") {
      o.only = value();
    } else {
      Die("usage: perf_gate [--dir DIR] [--mib N] [--reps N] [--smoke] [--keep] [--only TEXT]");
    }
  }
  if (o.smoke) {
    o.mib = std::min<uint64_t>(o.mib, 8);
    o.reps = 1;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Gate gate;
  gate.options = Parse(argc, argv);
  const Options& opt = gate.options;
  std::string tmpl = opt.dir + "/ferry_perf_gate_XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) Die("cannot make a folder in " + opt.dir);
  const std::string dir = tmpl;
  struct Cleanup {
    std::string dir;
    bool keep;
    ~Cleanup() {
      std::error_code ec;
      if (!keep) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{dir, opt.keep};

  const double t_start = Now();
  const std::vector<TensorSpec> tensors = LayerTensors(opt.mib << 20);
  const uint64_t image_bytes = ImageBytes(tensors), payload = PayloadBytes(tensors);
  std::vector<uint8_t> image(image_bytes, 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    FillBf16(image.data() + tensors[i].offset, tensors[i].bytes, i);
  }
  std::vector<uint8_t> dst(image_bytes, 1);  // prefaulted: both sides write warm memory
  std::vector<std::string> wrong;

  struct File {
    Encoding encoding;
    const char* label;
    std::string path;
    std::shared_ptr<Reader> reader;
  };
  std::vector<File> files = {{Encoding::kRaw, "raw", "", nullptr},
                             {Encoding::kZstd, "zstd", "", nullptr},
                             {Encoding::kShuffleZstd, "shuffle+zstd", "", nullptr},
                             {Encoding::kPlanes, "planes", "", nullptr}};
  for (File& f : files) {
    f.path = dir + "/" + EncodingName(f.encoding) + ".ferry";
    WriteCheckpoint(f.path, f.encoding, tensors, image.data());
    f.reader = Check(Reader::Open(f.path), "open");
  }
  std::printf("perf gate: %zu bf16 tensors, %.1f MiB per checkpoint (raw), stored:", tensors.size(),
              payload / 1048576.0);
  for (const File& f : files) {
    std::printf(" %s %.2fx", f.label,
                static_cast<double>(payload) / (f.reader->file_size() - 4096));
  }
  std::printf(
      "\nperf gate: %u hardware threads; each check runs subject and reference alternately, %d "
      "pairs: median times, ratio = median of the pairs' ratios (open: fastest of %d "
      "each)%s\n",
      std::thread::hardware_concurrency(), opt.reps, 2 * opt.reps + 1,
      opt.smoke ? "; smoke run, ratios not enforced" : "");

  const std::vector<LoadRequest> requests = Requests(tensors, dst.data());
  auto expect = [&](const std::string& what, const std::function<void()>& fill) {
    ExpectImage(dst.data(), image, tensors, what, fill, &wrong);
  };
  auto load = [&](const Reader& reader, int threads, bool verify, uint64_t slot_bytes = 0) {
    LoaderOptions lo;
    lo.threads = threads;
    lo.verify = verify;
    if (slot_bytes != 0) lo.slot_bytes = slot_bytes;
    std::unique_ptr<Loader> loader = Check(Loader::Create(lo), "loader");
    return [&reader, loader = std::shared_ptr<Loader>(std::move(loader)), &requests] {
      Check(loader->LoadToHost(reader, requests), "load");
    };
  };

  // 1. Raw loads into the caller's buffers against memcpy of the same bytes, as many threads.
  const Reader& raw = *files[0].reader;
  for (int threads : {1, 2}) {
    auto subject = load(raw, threads, false);
    std::string name = "raw load, " + std::to_string(threads) + " thr";
    gate.Run(name, "memcpy", payload, 0.5, [&] {
      return Medians(
          Interleaved(opt.reps, subject, [&] { CopyRaw(raw, dst.data(), tensors, threads); }));
    });
    if (gate.Selected(name)) expect(name, subject);
  }

  // 2. Raw loads into memory the loader allocates against memcpy into fresh memory: the
  // loader's one huge-page allocation measured 1.7-2.6x faster than plain fresh pages here.
  for (int threads : {1, 2}) {
    LoaderOptions lo;
    lo.threads = threads;
    std::shared_ptr<Loader> loader = Check(Loader::Create(lo), "loader");
    gate.Run("raw load, allocating, " + std::to_string(threads) + " thr", "new[] + memcpy", payload,
             0.5, [&] {
               return Medians(Interleaved(
                   opt.reps, [&] { Check(loader->LoadToHost(raw, {}), "load"); },
                   [&] {
                     std::unique_ptr<uint8_t[]> fresh(new uint8_t[image_bytes]);
                     CopyRaw(raw, fresh.get(), tensors, threads);
                   }));
             });
  }

  // 3. Encoded loads against the same blocks decoded by the reference on as many threads; the
  // note compares with N x the reference's single-thread rate (what an idle machine gives).
  for (size_t k = 1; k < files.size(); ++k) {
    const File& f = files[k];
    RefDecoder ref(*f.reader, dst.data(), tensors, 2);
    double single = 0;
    for (int threads : {1, 2}) {
      auto subject = load(*f.reader, threads, false);
      std::string name = std::string(f.label) + " load, " + std::to_string(threads) + " thr";
      std::string note;
      gate.Run(
          name, "direct decode", payload, 0.55,
          [&] {
            Measured m = Medians(Interleaved(opt.reps, subject, [&] { ref.Run(threads); }));
            if (threads == 1) single = m.reference_secs;
            if (threads > 1 && single > 0) {
              note = Printf("(%.2f of %d x 1-thread decode)", single / threads / m.subject_secs,
                            threads);
            }
            return m;
          },
          &note);
      if (gate.Selected(name)) {
        expect(name, subject);
        expect(name + " (reference)", [&] { ref.Run(threads); });
      }
    }
  }

  // 4. A verified load: checking each block costs a hash of it, not another decode. A loader
  // with 1 MiB slots: host loads still decode each 4 MiB block once, not once per slot.
  {
    const File& f = files[2];
    RefDecoder ref(*f.reader, dst.data(), tensors, 1);
    auto subject = load(*f.reader, 1, true);
    gate.Run("shuffle+zstd load, verify, 1 thr", "decode + XXH3", payload, 0.5, [&] {
      return Medians(Interleaved(opt.reps, subject, [&] {
        ref.Run(1);
        for (const TensorSpec& t : tensors) {
          volatile uint64_t sum = XXH3_64bits(dst.data() + t.offset, t.bytes);
          (void)sum;
        }
      }));
    });
    expect("verified load", subject);
    auto small_slots = load(*f.reader, 1, false, uint64_t{1} << 20);
    gate.Run("shuffle+zstd load, 1 MiB slots, 1 thr", "direct decode", payload, 0.55,
             [&] { return Medians(Interleaved(opt.reps, small_slots, [&] { ref.Run(1); })); });
    expect("1 MiB slots", small_slots);
  }

  // 5. Open and index of many tensors against reading and hashing the footer. Measured at
  // 0.28-0.42 on a busy 2-core machine (the open's slices wait for cores there); 0.12 still
  // catches a 3x slower open.
  {
    const std::string many = dir + "/many.ferry";
    const int count = opt.smoke ? 2000 : 100000;
    WriteMany(many, count);
    auto open = [&] {
      auto reader = Check(Reader::Open(many), "open");
      if (reader->num_tensors() != static_cast<size_t>(count)) Die("tensor count");
    };
    gate.Run("open + index, " + std::to_string(count) + " tensors, CPU", "pread + XXH3 of footer",
             0, 0.12,
             [&] { return Least(Interleaved(2 * opt.reps + 1, open, [&] { ReadFooter(many); })); });
  }

  // 6. A raw save against write() of the same bytes, both into fresh files in the folder.
  {
    const std::string saved = dir + "/saved.ferry", plain = dir + "/plain.bin";
    gate.Run("raw save", "write()", payload, 0.4, [&] {
      return Medians(Interleaved(
          opt.reps,
          [&] {
            ::unlink(saved.c_str());
            WriteCheckpoint(saved, Encoding::kRaw, tensors, image.data());
          },
          [&] {
            ::unlink(plain.c_str());
            WriteAll(plain, image.data(), image_bytes);
          }));
    });
  }

  std::string failed;
  for (const std::string& n : gate.failed) failed += (failed.empty() ? ": " : "; ") + n;
  std::printf("perf gate: %d checks held, %zu failed%s (%.1f s)\n", gate.held, gate.failed.size(),
              failed.c_str(), Now() - t_start);
  if (!wrong.empty()) std::printf("perf gate: %zu loads returned wrong bytes\n", wrong.size());
  return gate.failed.empty() && wrong.empty() ? 0 : 1;
}
